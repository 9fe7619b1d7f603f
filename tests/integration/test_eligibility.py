"""Quantization rules: defaults, layer ranges, ignore patterns, the hf_quant_config round trip,
agreement with vLLM's own layer matcher and model builder, and disagreements refused at plan time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxrefit.engine.torch import TorchEngine
from mxrefit.integrations.vllm.layout import coverage_check, quantized_param_names, vllm_destinations, vllm_params
from mxrefit.plan.build import PlanMismatch, SourceSpec
from mxrefit.plan.eligibility import DEFAULT_RULES, QuantRules, check_rules, layer_count, layer_excluded, layer_of
from mxrefit.plan.shapes import ModelShape, hf_tensor_specs
from mxrefit.source.sender import Sender
from tests.helpers import models
from tests.helpers.trainer_procs import EngineProcess

F8, U8, BF16 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16


def _moe_shape(layers: int = 4) -> ModelShape:
    return ModelShape(
        "t-moe",
        hidden=128,
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=32,
        vocab=512,
        intermediate=0,
        experts=4,
        moe_intermediate=64,
    )


def _dense_shape(layers: int = 4) -> ModelShape:
    return ModelShape(
        "t-llama", hidden=128, layers=layers, heads=4, kv_heads=2, head_dim=32, vocab=512, intermediate=256, arch="llama"
    )


def _quantized(rules: QuantRules, shape: ModelShape, experts: str = "grouped") -> set[str]:
    decided = rules.decide((n, s) for n, s, _ in hf_tensor_specs(shape, experts=experts))
    return {n for n, q in decided.items() if q}


# ---- decisions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", ["grouped", "per_expert"])
def test_default_rules_keep_embeddings_head_router_norms_bf16(experts):
    shape = _moe_shape(layers=2)
    specs = hf_tensor_specs(shape, experts=experts)
    quantized = _quantized(DEFAULT_RULES, shape, experts)
    for name, _, _ in specs:
        bf16 = any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.weight", "norm"))
        assert (name not in quantized) == bf16, name
    assert "model.layers.1.mlp.experts.gate_up_proj" in quantized or "model.layers.1.mlp.experts.3.up_proj.weight" in quantized
    decided = DEFAULT_RULES.decide(
        [
            ("model.layers.0.self_attn.q_proj.bias", (128,)),
            ("model.layers.0.self_attn.o_proj.bias", (4, 128)),
            ("model.layers.0.mlp.experts.gate_up_proj", (4, 128, 128)),
        ]
    )
    assert decided == {
        "model.layers.0.self_attn.q_proj.bias": False,
        "model.layers.0.self_attn.o_proj.bias": False,
        "model.layers.0.mlp.experts.gate_up_proj": True,
    }


def test_layer_of_names_the_vllm_layer():
    p = "model.layers.3"
    assert layer_of(f"{p}.self_attn.k_proj.weight") == f"{p}.self_attn.qkv_proj"
    assert layer_of(f"{p}.self_attn.o_proj.weight") == f"{p}.self_attn.o_proj"
    assert layer_of(f"{p}.mlp.up_proj.weight") == f"{p}.mlp.gate_up_proj"
    assert layer_of(f"{p}.mlp.down_proj.weight") == f"{p}.mlp.down_proj"
    assert layer_of(f"{p}.mlp.experts.gate_up_proj") == f"{p}.mlp.experts"
    assert layer_of(f"{p}.mlp.experts.17.down_proj.weight") == f"{p}.mlp.experts"
    assert layer_of(f"{p}.mlp.gate.weight") == f"{p}.mlp.gate"
    assert layer_of("lm_head.weight") == "lm_head"


def test_first_and_last_layers_stay_bf16_with_the_count_taken_from_names():
    shape = _moe_shape(layers=5)
    rules = QuantRules(bf16_first_layers=2, bf16_last_layers=1)
    quantized = _quantized(rules, shape)
    layers_quantized = {int(n.split(".")[2]) for n in quantized}
    assert layers_quantized == {2, 3}
    assert layer_count(n for n, _, _ in hf_tensor_specs(shape)) == 5
    assert rules.exclude_modules(5)[-3:] == ["model.layers.0.*", "model.layers.1.*", "model.layers.4.*"]
    assert QuantRules(bf16_first_layers=9).exclude_modules(5)[-5:] == [f"model.layers.{i}.*" for i in range(5)]
    with pytest.raises(ValueError, match="need the layer count"):
        rules.decide([("lm_head.weight", (512, 128))])
    with pytest.raises(ValueError, match=">= 0"):
        QuantRules(bf16_last_layers=-1)


def test_ignore_patterns():
    shape = _moe_shape(layers=3)
    base = _quantized(DEFAULT_RULES, shape, "per_expert")

    def dropped(*patterns):
        return base - _quantized(QuantRules(ignore=DEFAULT_RULES.ignore + patterns), shape, "per_expert")

    assert dropped("*.o_proj") == {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(3)}
    experts_1 = {n for n in base if n.startswith("model.layers.1.mlp.experts.")}
    assert len(experts_1) == 12
    assert dropped("model.layers.1.mlp.experts") == experts_1
    # vLLM's expert rule: naming one expert's projection excludes the layer's whole expert block
    assert dropped("model.layers.1.mlp.experts.3.up_proj") == experts_1
    qkv_2 = {f"model.layers.2.self_attn.{p}_proj.weight" for p in "qkv"}
    assert dropped("model.layers.2.self_attn.qkv_proj") == qkv_2
    assert dropped(*(f"model.layers.2.self_attn.{p}_proj" for p in "qkv")) == qkv_2
    # substring matching, as vLLM does: "layers.1" also names layers 10-19 (ranges use "layers.1.*")
    many = {n: (1, 32) for n in (f"model.layers.{i}.self_attn.o_proj.weight" for i in (1, 10, 2))}
    assert QuantRules(ignore=("model.layers.1",)).decide(many.items()) == {
        "model.layers.1.self_attn.o_proj.weight": False,
        "model.layers.10.self_attn.o_proj.weight": False,
        "model.layers.2.self_attn.o_proj.weight": True,
    }
    with pytest.raises(ValueError, match=r"\['q_proj'\] but not every shard"):
        QuantRules(ignore=("model.layers.0.self_attn.q_proj",)).decide((n, s) for n, s, _ in hf_tensor_specs(shape))


# ---- the hf_quant_config round trip --------------------------------------------------------------


def test_hf_quant_config_round_trip(tmp_path):
    shape = _moe_shape(layers=4)
    specs = [(n, s) for n, s, _ in hf_tensor_specs(shape, experts="per_expert")]
    rules = QuantRules(ignore=DEFAULT_RULES.ignore + ("*.o_proj",), bf16_first_layers=1, bf16_last_layers=1)
    cfg = rules.to_hf_quant_config(shape.layers)
    assert cfg["quantization"] == {
        "quant_algo": "MXFP8",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "*.o_proj", "model.layers.0.*", "model.layers.3.*"],
    }
    path = tmp_path / "hf_quant_config.json"
    path.write_text(json.dumps(cfg))
    for parsed in (
        QuantRules.from_hf_quant_config(path),
        QuantRules.from_hf_quant_config(str(path)),
        QuantRules.from_hf_quant_config({"quant_method": "modelopt", **cfg}),
        QuantRules.from_hf_quant_config(
            {"quant_method": "modelopt", "quant_algo": "mxfp8", "ignore": cfg["quantization"]["exclude_modules"]}
        ),
    ):
        assert parsed.decide(specs) == rules.decide(specs)
    assert QuantRules.from_hf_quant_config(cfg).decide(specs) != DEFAULT_RULES.decide(specs)


def test_hf_quant_config_errors():
    with pytest.raises(ValueError, match="no 'quant_algo'"):
        QuantRules.from_hf_quant_config({"quantization": {"exclude_modules": []}})
    with pytest.raises(ValueError, match="'NVFP4' is not supported"):
        QuantRules.from_hf_quant_config({"quantization": {"quant_algo": "NVFP4", "exclude_modules": []}})
    with pytest.raises(ValueError, match="list of strings"):
        QuantRules.from_hf_quant_config({"quantization": {"quant_algo": "MXFP8", "exclude_modules": "lm_head"}})


# ---- the same decisions as vLLM 0.32 ------------------------------------------------------------


def _vllm_layers(shape: ModelShape) -> list[str]:
    out = ["lm_head"]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        out += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj"]
        out += [f"{p}.mlp.experts", f"{p}.mlp.gate"] if shape.is_moe else [f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"]
    return out


@pytest.fixture(scope="module")
def vllm_matcher():
    """vLLM's own ``is_layer_excluded``, configured as its model loader configures it."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    def excluded(patterns: list[str], moe: bool, layer: str) -> bool | str:
        model_cls = Qwen3MoeForCausalLM if moe else LlamaForCausalLM
        cfg = ModelOptMxFp8Config.from_config(
            {"quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": list(patterns)}}
        )
        cfg.apply_vllm_mapper(model_cls.hf_to_vllm_mapper.get_rename_mapper())
        cfg.packed_modules_mapping = model_cls.packed_modules_mapping
        try:
            return cfg.is_layer_excluded(layer)
        except ValueError:
            return "error"

    return excluded


def _ours(patterns: list[str], layer: str) -> bool | str:
    try:
        return layer_excluded(layer, patterns)
    except ValueError:
        return "error"


_HAND_PATTERNS = [
    [],
    ["lm_head"],
    ["model.layers.*.mlp.gate"],
    ["model.layers.1"],
    ["model.layers.1*"],
    ["model.layers.1.*"],
    ["*.o_proj"],
    ["*o_proj"],
    ["*q_proj"],
    ["model.layers.2.self_attn.q_proj"],
    [f"model.layers.2.self_attn.{p}_proj" for p in "qkv"],
    ["model.layers.2.self_attn.qkv_proj"],
    ["model.layers.0.mlp.gate_proj"],
    ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
    ["model.layers.3.mlp.experts"],
    ["model.layers.3.mlp.experts.5.down_proj"],
    ["mlp.experts"],
    ["experts"],
    ["model.layers.0.mlp.gate"],
    ["self_attn"],
    ["*"],
    ["model.layers.1?.*"],
    ["lm_head", "model.layers.*.mlp.gate", "model.layers.0.*", "model.layers.11.*"],
]


@pytest.mark.parametrize("moe", [True, False], ids=["qwen3_moe", "llama"])
def test_layer_matcher_equals_vllm_on_chosen_patterns(vllm_matcher, moe):
    shape = _moe_shape(layers=12) if moe else _dense_shape(layers=12)
    differ = []
    for patterns in _HAND_PATTERNS:
        for layer in _vllm_layers(shape):
            want, got = vllm_matcher(patterns, moe, layer), _ours(patterns, layer)
            if want != got:
                differ.append((patterns, layer, want, got))
    assert differ == []


_PIECES = st.sampled_from(
    [
        "model",
        "layers",
        "1",
        "2",
        "11",
        "*",
        "self_attn",
        "q_proj",
        "qkv_proj",
        "o_proj",
        "mlp",
        "gate",
        "gate_proj",
        "up_proj",
        "gate_up_proj",
        "down_proj",
        "experts",
        "3",
        "lm_head",
        "?",
    ]
)
_PATTERN = st.builds(
    lambda parts, star: ".".join(parts) + ("*" if star else ""), st.lists(_PIECES, min_size=1, max_size=6), st.booleans()
)


@settings(max_examples=150, deadline=None)
@given(patterns=st.lists(_PATTERN, max_size=4), moe=st.booleans())
def test_layer_matcher_equals_vllm_on_random_patterns(vllm_matcher, patterns, moe):
    shape = _moe_shape(layers=12) if moe else _dense_shape(layers=12)
    for layer in _vllm_layers(shape):
        assert _ours(patterns, layer) == vllm_matcher(patterns, moe, layer), (patterns, layer)


# ---- engine tables follow the rules ----------------------------------------------------------------

_RULE_CASES = {
    "default": QuantRules(),
    "ranges": QuantRules(bf16_first_layers=1, bf16_last_layers=1),
    "ignore": QuantRules(
        ignore=DEFAULT_RULES.ignore
        + ("*.o_proj", "model.layers.2.mlp.experts", "model.layers.1.self_attn.qkv_proj", "model.layers.2.mlp.down_proj")
    ),
}


@pytest.mark.parametrize("case", sorted(_RULE_CASES))
@pytest.mark.parametrize("dense", [False, True], ids=["moe", "dense"])
def test_vllm_layout_follows_rules(case, dense):
    rules = _RULE_CASES[case]
    shape = _dense_shape() if dense else _moe_shape()
    params = vllm_params(shape, mxfp8=True, rules=rules)
    for experts in ("grouped", "per_expert"):
        dests = vllm_destinations(shape, mxfp8=True, experts=experts, rules=rules)
        coverage_check(params, dests)
        check_rules(rules, dests)
        assert {n for n, d in dests.items() if d.format == "mxfp8"} == _quantized(rules, shape, experts)
    quantized = set(quantized_param_names(shape, rules))
    for name, p in params.items():
        if name.endswith("_scale"):
            assert name.removesuffix("_scale") in quantized and p.dtype == U8
        else:
            assert p.dtype == (F8 if name in quantized else BF16), name
    if case == "ignore" and not dense:
        assert params["model.layers.2.mlp.experts.routed_experts.w13_weight"].dtype == BF16
        assert "model.layers.2.mlp.experts.routed_experts.w13_weight_scale" not in params


def test_vllm_layout_refuses_rules_that_quantize_head_or_router():
    with pytest.raises(ValueError, match=r"quantize \['lm_head'\]"):
        vllm_params(_moe_shape(), mxfp8=True, rules=QuantRules(ignore=("model.layers.*.mlp.gate",)))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate"):
        vllm_params(_moe_shape(), mxfp8=True, rules=QuantRules(ignore=("lm_head",)))
    vllm_params(_dense_shape(), mxfp8=True, rules=QuantRules(ignore=("lm_head",)))  # no router in a dense model


def test_torch_engine_follows_rules_and_names_unquantizable_layers():
    rules = QuantRules(bf16_last_layers=1, ignore=DEFAULT_RULES.ignore + ("*.qkv_proj",))
    engine = TorchEngine(models.tiny_qwen3_moe(seed=1), mxfp8=True, rules=rules)
    dests = engine.destinations()
    assert {n for n, d in dests.items() if d.format == "mxfp8"} == {
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    check_rules(rules, dests)
    # as in vLLM, a wildcard is matched against the fused layer's name: "*.q_proj" does not name qkv_proj
    shards = QuantRules(ignore=DEFAULT_RULES.ignore + ("*.q_proj", "*.k_proj", "*.v_proj"))
    assert (
        TorchEngine(models.tiny_qwen3_moe(seed=1), mxfp8=True, rules=shards)
        .destinations()["model.layers.0.self_attn.q_proj.weight"]
        .format
        == "mxfp8"
    )
    assert engine.tensor("model.layers.1.self_attn.o_proj.weight").dtype == BF16

    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        )
    )
    with pytest.raises(ValueError, match=r"q_proj.weight.*not a multiple of 32.*'model.layers.0.self_attn.qkv_proj': add it"):
        TorchEngine(odd, mxfp8=True)


def test_check_rules_names_every_disagreeing_tensor():
    engine = TorchEngine(models.tiny_qwen3_moe(seed=1), mxfp8=True)
    check_rules(DEFAULT_RULES, engine.destinations())
    with pytest.raises(PlanMismatch) as err:
        check_rules(QuantRules(bf16_first_layers=1), engine.destinations())
    names = {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    assert len(err.value.problems) == len(names)
    assert all(any(n in p for p in err.value.problems) for n in names)
    assert "the trainer's rules keep it bf16, the engine holds it as mxfp8" in str(err.value)
    with pytest.raises(PlanMismatch) as err:
        check_rules(QuantRules(ignore=("model.layers.*.mlp.gate",)), engine.destinations())
    assert err.value.problems == [
        "tensor 'lm_head.weight' (layer 'lm_head'): the trainer's rules quantize it, the engine holds it as bf16"
    ]
    with pytest.raises(PlanMismatch, match="not every shard"):
        check_rules(QuantRules(ignore=("model.layers.1.self_attn.k_proj",)), engine.destinations())


def test_sender_with_rules_refuses_a_disagreeing_engine_before_any_write():
    trainer = models.tiny_qwen3_moe(seed=5)
    specs = [SourceSpec(n, tuple(p.shape), p.dtype) for n, p in trainer.named_parameters()]
    engine = EngineProcess({"kind": "torch", "model": "moe", "mxfp8": True, "rules": {"bf16_last_layers": 1}})
    sender = Sender(engine.address, engine.token, rules=QuantRules())
    try:
        with pytest.raises(PlanMismatch) as err:
            sender.plan(specs)
        assert len(err.value.problems) == 6 and all("model.layers.1." in p for p in err.value.problems)
        assert sender.status() == {"version": 0, "state": "ready", "error": None}
        agreeing = Sender(engine.address, engine.token, rules=QuantRules(bf16_last_layers=1))
        agreeing.refit({n: p.detach() for n, p in trainer.named_parameters()})
        assert agreeing.status()["version"] == 1
        agreeing.close()
    finally:
        engine.stop(sender)


# ---- vLLM builds exactly these layers from the exported config -----------------------------------

_VLLM_CASES = [
    ("moe", {"bf16_first_layers": 1, "bf16_last_layers": 1}),
    ("moe", {"ignore": ["lm_head", "model.layers.*.mlp.gate", "*.o_proj", "model.layers.1.mlp.experts.0.up_proj"]}),
    ("dense", {"ignore": ["lm_head", "model.layers.2.self_attn.qkv_proj", "*down_proj"], "bf16_last_layers": 1}),
]


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=96,
        tie_word_embeddings=False,
    )
    cfg = (
        Qwen3MoeConfig(head_dim=32, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2, **common)
        if kind == "moe"
        else LlamaConfig(**common)
    )
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def _vllm_child(out_path: str) -> None:
    """Build each case's model with vLLM from the exported config; record its parameters."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import PlatformEnum
    from vllm.utils.torch_utils import set_default_torch_dtype

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    work = tempfile.mkdtemp()
    results = []
    for n, (kind, kwargs) in enumerate(_VLLM_CASES):
        cfg = _config(kind)
        d = os.path.join(work, str(n))
        cfg.save_pretrained(d)
        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
        raw["quantization_config"] = {
            "quant_method": "modelopt",
            **QuantRules(**kwargs).to_hf_quant_config(cfg.num_hidden_layers),
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(raw, f)
        vc = EngineArgs(
            model=d, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=128
        ).create_engine_config()
        with set_current_vllm_config(vc):
            if n == 0:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"file://{os.path.join(work, 'dist')}",
                )
                initialize_model_parallel(1, 1)
            with set_default_torch_dtype(torch.bfloat16):
                model = initialize_model(vc)
        results.append([(k, list(p.shape), str(p.dtype)) for k, p in model.named_parameters()])
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def vllm_built() -> list:
    pytest.importorskip("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=path)
        proc = subprocess.run([sys.executable, __file__, out], capture_output=True, text=True, timeout=300, env=env, cwd=root)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out) as f:
            return json.load(f)


@pytest.mark.vllm
@pytest.mark.parametrize("index", range(len(_VLLM_CASES)), ids=[f"{k}-{'-'.join(sorted(a))}" for k, a in _VLLM_CASES])
def test_vllm_builds_the_layers_the_rules_decide(vllm_built, index):
    kind, kwargs = _VLLM_CASES[index]
    rules = QuantRules(**kwargs)
    shape = ModelShape.from_hf_config(_config(kind))
    want = [(n, list(p.shape), str(p.dtype)) for n, p in vllm_params(shape, mxfp8=True, rules=rules).items()]
    got = [
        tuple(x)
        for x in vllm_built[index]
        if not x[0].endswith((".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale"))
    ]
    assert [tuple(x) for x in want] == got
    n_bf16 = sum(1 for n in quantized_param_names(shape) if n not in quantized_param_names(shape, rules))
    assert n_bf16 > 0  # the case does exclude something


if __name__ == "__main__":
    _vllm_child(sys.argv[1])
