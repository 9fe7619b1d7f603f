"""vLLM 0.32 layout tables: coverage, hand-checked offsets, and the real vLLM model built on CPU.

The real-vLLM test builds the model modules in a subprocess (no engine, no worker: the same
``initialize_model`` the loader calls), compares ``named_parameters()`` with ``vllm_params``,
then feeds random HF-named tensors through vLLM's own ``load_weights`` and checks that every
target's byte range holds exactly the source's bytes (MXFP8 values and scales included).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace

import pytest
import torch

from mxrefit.integrations.vllm.layout import (
    EXPERTS,
    coverage_check,
    quantized_param_names,
    scale_param,
    vllm_destinations,
    vllm_params,
)
from mxrefit.plan.shapes import BUILTIN, ModelShape
from mxrefit.plan.types import Destination, Target

F8, U8, BF16 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16
LAYOUTS = ("per_expert", "grouped")
KV_CACHE_SCALES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")


def _variants() -> list[tuple[str, ModelShape]]:
    base = [BUILTIN["tiny-qwen3-moe"], BUILTIN["qwen3-30b-a3b"]]
    extra = [
        replace(BUILTIN["tiny-qwen3-moe"], name="tiny-tied", tied_embeddings=True),
        ModelShape("tiny-dense", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512, intermediate=256),
        ModelShape(
            "tiny-llama",
            hidden=128,
            layers=2,
            heads=4,
            kv_heads=2,
            head_dim=32,
            vocab=512,
            intermediate=256,
            arch="llama",
            tied_embeddings=True,
        ),
        BUILTIN["qwen3-235b-a22b-ep8"],
    ]
    return [(s.name, s) for s in base + extra]


@pytest.mark.parametrize("mxfp8", [True, False], ids=["mxfp8", "bf16"])
@pytest.mark.parametrize("experts", LAYOUTS)
@pytest.mark.parametrize("name,shape", _variants(), ids=[n for n, _ in _variants()])
def test_every_byte_covered_exactly_once(name, shape, experts, mxfp8):
    params = vllm_params(shape, mxfp8=mxfp8)
    dests = vllm_destinations(shape, mxfp8=mxfp8, experts=experts)
    coverage_check(params, dests)
    quantized = set(quantized_param_names(shape))
    for d in dests.values():
        if mxfp8 and d.targets[0].param in quantized:
            assert d.format == "mxfp8" and [t.dtype for t in d.targets] == [F8, U8]
            assert d.targets[1].param == scale_param(d.targets[0].param)
            assert d.targets[1].shape == (*d.targets[0].shape[:-1], d.targets[0].shape[-1] // 32)
        else:
            assert d.format == "bf16" and len(d.targets) == 1 and d.targets[0].dtype == BF16


def test_param_dtypes_and_scales():
    shape = BUILTIN["tiny-qwen3-moe"]
    quantized = set(quantized_param_names(shape))
    q_params = vllm_params(shape, mxfp8=True)
    for n, p in q_params.items():
        if n in quantized:
            assert p.dtype == F8
            scale = q_params[scale_param(n)]
            assert scale.dtype == U8 and scale.shape == (*p.shape[:-1], p.shape[-1] // 32)
        elif n.endswith("_scale"):
            assert n.removesuffix("_scale") in quantized
        else:
            assert p.dtype == BF16, n
    assert q_params["model.layers.0.mlp.gate.weight"].dtype == BF16
    assert q_params["lm_head.weight"].dtype == BF16
    assert q_params[f"model.layers.0.{EXPERTS}.w13_weight_scale"].shape == (8, 256, 8)
    assert q_params[f"model.layers.0.{EXPERTS}.w2_weight_scale"].shape == (8, 256, 4)
    plain = vllm_params(shape, mxfp8=False)
    assert all(p.dtype == BF16 for p in plain.values())
    assert not any(n.endswith("_scale") for n in plain)
    assert [n for n in q_params if not n.endswith("_scale")] == list(plain)


def test_hand_offsets_qwen3_30b():
    shape = BUILTIN["qwen3-30b-a3b"]
    h, i_, l5 = 2048, 768, "model.layers.5"
    for mxfp8, item in ((True, 1), (False, 2)):
        d = vllm_destinations(shape, mxfp8=mxfp8)
        k = d[f"{l5}.self_attn.k_proj.weight"].targets
        assert k[0] == Target(f"{l5}.self_attn.qkv_proj.weight", 32 * 128 * h * item, (512, h), F8 if mxfp8 else BF16)
        v = d[f"{l5}.self_attn.v_proj.weight"].targets
        assert v[0].offset == (32 + 4) * 128 * h * item
        up3 = d[f"{l5}.mlp.experts.3.up_proj.weight"].targets
        assert up3[0].param == f"{l5}.{EXPERTS}.w13_weight"
        assert up3[0].offset == (3 * 2 * i_ + i_) * h * item and up3[0].shape == (i_, h)
        if mxfp8:
            assert k[1] == Target(f"{l5}.self_attn.qkv_proj.weight_scale", 32 * 128 * (h // 32), (512, h // 32), U8)
            assert v[1].offset == (32 + 4) * 128 * (h // 32)
            assert up3[1].offset == (3 * 2 * i_ + i_) * (h // 32)
            down5 = d[f"{l5}.mlp.experts.5.down_proj.weight"].targets
            assert down5[1] == Target(f"{l5}.{EXPERTS}.w2_weight_scale", 5 * h * (i_ // 32), (h, i_ // 32), U8)
            assert down5[0].offset == 5 * h * i_
    grouped = vllm_destinations(shape, mxfp8=True, experts="grouped")
    gu = grouped[f"{l5}.mlp.experts.gate_up_proj"].targets
    assert [(t.param, t.offset, t.shape) for t in gu] == [
        (f"{l5}.{EXPERTS}.w13_weight", 0, (128, 2 * i_, h)),
        (f"{l5}.{EXPERTS}.w13_weight_scale", 0, (128, 2 * i_, h // 32)),
    ]
    assert grouped[f"{l5}.mlp.experts.down_proj"].targets[0].shape == (128, h, i_)


def test_tied_embeddings_have_one_destination():
    shape = replace(BUILTIN["tiny-qwen3-moe"], tied_embeddings=True)
    assert "lm_head.weight" not in vllm_params(shape, mxfp8=True)
    dests = vllm_destinations(shape, mxfp8=True)
    assert "lm_head.weight" not in dests
    assert dests["model.embed_tokens.weight"].targets[0].param == "model.embed_tokens.weight"


def test_coverage_check_names_problems():
    shape = BUILTIN["tiny-qwen3-moe"]
    params = vllm_params(shape, mxfp8=True)
    dests = vllm_destinations(shape, mxfp8=True)
    qkv = "model.layers.1.self_attn.qkv_proj.weight"

    gap = dict(dests)
    del gap["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=rf"{qkv}: bytes \[65536, 98304\) not covered"):
        coverage_check(params, gap)

    dup = dict(dests)
    dup["extra"] = Destination("extra", "bf16", (dests["model.layers.1.self_attn.v_proj.weight"].targets[0],))
    with pytest.raises(ValueError, match=r"written by both"):
        coverage_check(params, dup)

    past = dict(dests)
    t = dests["model.norm.weight"].targets[0]
    past["model.norm.weight"] = Destination(t.param, "bf16", (replace(t, shape=(t.shape[0] + 1,)),))
    with pytest.raises(ValueError, match=r"past the end"):
        coverage_check(params, past)

    wrong = dict(dests)
    wrong["model.norm.weight"] = Destination("model.norm.weight", "bf16", (replace(t, param="nope"),))
    with pytest.raises(ValueError, match=r"'nope' does not exist"):
        coverage_check(params, wrong)

    bad_dtype = dict(dests)
    bad_dtype["model.norm.weight"] = Destination("model.norm.weight", "bf16", (replace(t, dtype=torch.float16),))
    with pytest.raises(ValueError, match=r"dtype"):
        coverage_check(params, bad_dtype)


def test_unsupported_shapes_refused():
    with pytest.raises(ValueError, match="pads the vocabulary"):
        vllm_params(replace(BUILTIN["tiny-qwen3-moe"], vocab=4000), mxfp8=False)
    with pytest.raises(ValueError, match="MXFP8 block"):
        vllm_params(replace(BUILTIN["tiny-qwen3-moe"], moe_intermediate=100), mxfp8=True)
    vllm_params(replace(BUILTIN["tiny-qwen3-moe"], moe_intermediate=100), mxfp8=False)


# --- FP8-block (vLLM's Fp8Config, 128x128 blocks) --------------------------------------------

F32 = torch.float32
FP8_FORMATS = ("fp8-block", "fp8-block-ue8m0")


def _fp8_variants() -> list[tuple[str, ModelShape]]:
    """Shapes vLLM can hold in block FP8: every fused partition but the last a multiple of 128 rows.
    The ``ragged`` shapes have N and K that are not multiples of 128 (hidden 320: o_proj, down_proj
    and each expert's w2 rows, qkv/gate_up/w13 columns), so tiles at the edges are partial and an
    expert's scale rows do not follow from its value rows by division alone."""
    return [
        (s.name, s)
        for s in (
            BUILTIN["tiny-qwen3-moe"],
            BUILTIN["qwen3-30b-a3b"],
            BUILTIN["qwen3-235b-a22b-ep8"],
            BUILTIN["qwen3-32b"],
            replace(BUILTIN["tiny-qwen3-moe"], name="tiny-tied", tied_embeddings=True),
            ModelShape("ragged-dense", hidden=320, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512, intermediate=384),
            ModelShape(
                "ragged-moe",
                hidden=320,
                layers=2,
                heads=4,
                kv_heads=2,
                head_dim=64,
                vocab=512,
                intermediate=0,
                experts=4,
                moe_intermediate=128,
            ),
        )
    ]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("experts", LAYOUTS)
@pytest.mark.parametrize("name,shape", _fp8_variants(), ids=[n for n, _ in _fp8_variants()])
def test_fp8_block_every_byte_covered_exactly_once(name, shape, experts, fmt):
    from mxrefit.formats import fp8_block

    params = vllm_params(shape, fmt=fmt)
    dests = vllm_destinations(shape, fmt=fmt, experts=experts)
    coverage_check(params, dests)
    quantized = set(quantized_param_names(shape))
    for n in quantized:
        assert params[n].dtype == F8 and params[n + "_scale_inv"].dtype == F32
        assert params[n + "_scale_inv"].shape == fp8_block.scale_shape(params[n].shape)
        assert n + "_scale" not in params
    for d in dests.values():
        if d.targets[0].param in quantized:
            values, scales = d.targets
            assert d.format == fmt and (values.dtype, scales.dtype) == (F8, F32)
            assert scales.param == values.param + "_scale_inv"
            assert scales.shape == fp8_block.scale_shape(values.shape)
        else:
            assert d.format == "bf16" and len(d.targets) == 1 and d.targets[0].dtype == BF16
    # the same params and HF tensors as the other layouts: only the quantized ones' dtypes and scales differ
    mx = vllm_params(shape, mxfp8=True)
    assert [n for n in params if not n.endswith("_scale_inv")] == [n for n in mx if not n.endswith("_scale")]
    assert set(dests) == set(vllm_destinations(shape, mxfp8=False, experts=experts))


def test_fp8_block_hand_offsets_qwen3_30b():
    """Scale targets start at the tile row where the source's values start: q is 32 tiles of qkv,
    k 4, an expert's w13 is 12 tile rows (gate 6 + up 6), w2's 16; 2048 columns are 16 tiles."""
    shape = BUILTIN["qwen3-30b-a3b"]
    h, i_, l5 = 2048, 768, "model.layers.5"
    qkv, w13, w2 = f"{l5}.self_attn.qkv_proj.weight", f"{l5}.{EXPERTS}.w13_weight", f"{l5}.{EXPERTS}.w2_weight"
    params = vllm_params(shape, fmt="fp8-block")
    assert params[qkv + "_scale_inv"].shape == (40, 16)
    assert params[w13 + "_scale_inv"].shape == (128, 12, 16) and params[w2 + "_scale_inv"].shape == (128, 16, 6)
    d = vllm_destinations(shape, fmt="fp8-block")
    k = d[f"{l5}.self_attn.k_proj.weight"].targets
    assert k == (Target(qkv, 32 * 128 * h, (512, h), F8), Target(qkv + "_scale_inv", 32 * 16 * 4, (4, 16), F32))
    assert d[f"{l5}.self_attn.v_proj.weight"].targets[1].offset == (32 + 4) * 16 * 4
    up3 = d[f"{l5}.mlp.experts.3.up_proj.weight"].targets
    assert up3 == (
        Target(w13, (3 * 2 * i_ + i_) * h, (i_, h), F8),
        Target(w13 + "_scale_inv", (3 * 12 + 6) * 16 * 4, (6, 16), F32),
    )
    down5 = d[f"{l5}.mlp.experts.5.down_proj.weight"].targets
    assert down5 == (Target(w2, 5 * h * i_, (h, i_), F8), Target(w2 + "_scale_inv", 5 * 16 * 6 * 4, (16, 6), F32))
    gu = vllm_destinations(shape, fmt="fp8-block-ue8m0", experts="grouped")[f"{l5}.mlp.experts.gate_up_proj"]
    assert gu.format == "fp8-block-ue8m0"
    assert [(t.param, t.offset, t.shape) for t in gu.targets] == [
        (w13, 0, (128, 2 * i_, h)),
        (w13 + "_scale_inv", 0, (128, 12, 16)),
    ]


def test_fp8_block_rules_keep_layers_bf16():
    """Layers the rules exclude keep BF16 weights and no scale, as in the MXFP8 layout."""
    from mxrefit.plan.eligibility import QuantRules

    shape = BUILTIN["tiny-qwen3-moe"]
    rules = QuantRules(bf16_first_layers=1)
    params = vllm_params(shape, fmt="fp8-block", rules=rules)
    coverage_check(params, vllm_destinations(shape, fmt="fp8-block", rules=rules, experts="grouped"))
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == BF16
    assert f"model.layers.0.{EXPERTS}.w13_weight_scale_inv" not in params
    assert params[f"model.layers.1.{EXPERTS}.w13_weight"].dtype == F8


def test_fp8_block_unsupported_shapes_refused():
    dense = ModelShape("tiny-dense", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512, intermediate=256)
    with pytest.raises(ValueError, match=r"qkv_proj.weight fuses partitions of \[128, 64, 64\] rows.*validate_fp8_block_shape"):
        vllm_params(dense, fmt="fp8-block")
    with pytest.raises(ValueError, match=r"qkv_proj.weight fuses partitions"):
        vllm_destinations(dense, fmt="fp8-block")
    vllm_params(dense, mxfp8=True)  # one scale row per row: any partition works for MXFP8
    refined = replace(BUILTIN["qwen3-30b-a3b"], name="30b-tp4", moe_intermediate=192)  # 768 / TP 4
    with pytest.raises(ValueError, match=r"intermediate size per rank \(192\).*refine_fp8_moe_block_shape.*not support"):
        vllm_params(refined, fmt="fp8-block")
    vllm_params(refined, mxfp8=True)
    with pytest.raises(ValueError, match="contradicts"):
        vllm_params(BUILTIN["tiny-qwen3-moe"], mxfp8=True, fmt="fp8-block")
    with pytest.raises(ValueError, match="unknown quantized format 'nvfp4'"):
        vllm_params(BUILTIN["tiny-qwen3-moe"], fmt="nvfp4")


# --- against the real vLLM model ------------------------------------------------------------

_CASES = [
    {"kind": "moe", "mxfp8": True, "tied": False, "experts": "per_expert"},
    {"kind": "moe", "mxfp8": True, "tied": False, "experts": "grouped"},
    {"kind": "moe", "mxfp8": False, "tied": True, "experts": "grouped"},
    {"kind": "moe", "mxfp8": False, "tied": False, "experts": "per_expert"},
    {"kind": "dense", "mxfp8": True, "tied": False, "experts": "per_expert"},
    {"kind": "llama", "mxfp8": True, "tied": True, "experts": "per_expert"},
]
# Fp8Config block FP8: hidden 320 makes edge tiles partial (qkv/gate_up/w13 columns, o_proj/down/w2 rows)
_FP8_CASES = [
    {"kind": "dense", "fmt": "fp8-block", "tied": False, "experts": "per_expert"},
    {"kind": "moe", "fmt": "fp8-block", "tied": False, "experts": "per_expert"},
    {"kind": "moe", "fmt": "fp8-block", "tied": False, "experts": "grouped"},
]


def _fp8_config(kind: str):
    """Small configs vLLM can build with 128x128 blocks: q and k partitions of 256 and 128 rows,
    expert intermediate 128; hidden 320 is 2.5 tiles."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=128,
        intermediate_size=384,
        tie_word_embeddings=False,
    )
    if kind == "moe":
        cfg = Qwen3MoeConfig(moe_intermediate_size=128, num_experts=3, num_experts_per_tok=2, **common)
    else:
        cfg = Qwen3Config(**common)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def _case_config(case: dict):
    return _fp8_config(case["kind"]) if "fmt" in case else _tiny_config(case["kind"], case["tied"])


def _tiny_config(kind: str, tied: bool):
    """Small configs whose every K is a multiple of 32 and whose vocab needs no padding."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=96,
        tie_word_embeddings=tied,
    )
    if kind == "moe":
        cfg = Qwen3MoeConfig(head_dim=32, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2, **common)
    elif kind == "dense":
        cfg = Qwen3Config(head_dim=32, **common)
    else:
        cfg = LlamaConfig(**common)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def _checkpoint_tensors(shape: ModelShape, case: dict, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Random HF-named tensors as a checkpoint would hold them (quantized: values + ``<name><scale suffix>``)."""
    from mxrefit.formats import fp8_block, mxfp8
    from mxrefit.integrations.vllm.layout import QUANT_LAYOUTS
    from mxrefit.plan.shapes import hf_tensor_specs

    gen = torch.Generator().manual_seed(seed)
    dests = vllm_destinations(shape, mxfp8=case.get("mxfp8", False), fmt=case.get("fmt"), experts=case["experts"])
    quantize = {
        "mxfp8": lambda x: mxfp8.quantize(x, backend="torch"),
        "fp8-block": lambda x: fp8_block.quantize(x, backend="torch"),
    }
    sent: dict[str, torch.Tensor] = {}
    for name, shp, dtype in hf_tensor_specs(shape, experts=case["experts"]):
        x = (torch.randn(shp, generator=gen) * 0.05).to(dtype)
        fmt = dests[name].format
        if fmt in quantize:
            sent[name], sent[name + QUANT_LAYOUTS[fmt].scale_suffix] = quantize[fmt](x)
        else:
            sent[name] = x
    return sent, dests


def _child(out_path: str) -> None:
    """Build each case's vLLM model on CPU, record its params, load bytes, check the targets."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import PlatformEnum
    from vllm.utils.torch_utils import set_default_torch_dtype

    from mxrefit.integrations.vllm.layout import QUANT_LAYOUTS
    from tests.helpers.fp8_block_emulation import register_emulation_kernel

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    register_emulation_kernel()  # Fp8Config picks its linear kernel when it builds a layer
    results = []
    work = tempfile.mkdtemp()
    for n, case in enumerate(_CASES + _FP8_CASES):
        cfg = _case_config(case)
        d = os.path.join(work, str(n))
        cfg.save_pretrained(d)
        quant = None
        if case.get("mxfp8"):
            quant = {
                "quant_method": "modelopt_mxfp8",
                "quantization": {
                    "quant_algo": "MXFP8",
                    "kv_cache_quant_algo": None,
                    "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"],
                },
            }
        elif case.get("fmt") == "fp8-block":  # Fp8Config matches ignored_layers exactly: every router by name
            quant = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)],
            }
        if quant is not None:
            path = os.path.join(d, "config.json")
            with open(path) as f:
                raw = json.load(f)
            raw["quantization_config"] = quant
            with open(path, "w") as f:
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
        named = [(k, list(p.shape), str(p.dtype)) for k, p in model.named_parameters()]
        shape = ModelShape.from_hf_config(cfg)
        sent, dests = _checkpoint_tensors(shape, case, seed=n)
        model.load_weights(iter(sent.items()))
        flat = {k: p.data.reshape(-1).view(torch.uint8) for k, p in model.named_parameters()}
        mismatched = []
        for name, dest in dests.items():
            sources = [sent[name]]
            if dest.format != "bf16":
                sources.append(sent[name + QUANT_LAYOUTS[dest.format].scale_suffix])
            for t, src in zip(dest.targets, sources):
                got = flat[t.param][t.offset : t.offset + t.nbytes]
                if not torch.equal(got, src.contiguous().reshape(-1).view(torch.uint8)):
                    mismatched.append(f"{name} -> {t.param}@{t.offset}")
        results.append(
            {
                "case": case,
                "named": named,
                "mismatched": mismatched,
                "tied_same": bool(case["tied"]) and model.lm_head.weight is model.model.embed_tokens.weight,
            }
        )
    shutil.rmtree(work, ignore_errors=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def real_vllm() -> list[dict]:
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
@pytest.mark.parametrize(
    "index",
    range(len(_CASES)),
    ids=[f"{c['kind']}-{'mxfp8' if c['mxfp8'] else 'bf16'}-{c['experts']}{'-tied' if c['tied'] else ''}" for c in _CASES],
)
def test_matches_real_vllm_model(real_vllm, index):
    res = real_vllm[index]
    case = res["case"]
    shape = ModelShape.from_hf_config(_tiny_config(case["kind"], case["tied"]))
    want = [(n, list(p.shape), str(p.dtype)) for n, p in vllm_params(shape, mxfp8=case["mxfp8"]).items()]
    got = [tuple(x) for x in res["named"] if not x[0].endswith(KV_CACHE_SCALES)]
    assert [tuple(x) for x in want] == got
    assert res["mismatched"] == []
    assert res["tied_same"] == case["tied"]


@pytest.mark.vllm
@pytest.mark.parametrize("index", range(len(_FP8_CASES)), ids=[f"{c['kind']}-{c['fmt']}-{c['experts']}" for c in _FP8_CASES])
def test_fp8_block_matches_real_vllm_model(real_vllm, index):
    """vLLM's Fp8Config block model has exactly the tables' params, and its own loader puts every
    checkpoint tensor's values and scale_inv where the tables' targets say (tile rows included)."""
    res = real_vllm[len(_CASES) + index]
    case = res["case"]
    shape = ModelShape.from_hf_config(_fp8_config(case["kind"]))
    want = [(n, list(p.shape), str(p.dtype)) for n, p in vllm_params(shape, fmt=case["fmt"]).items()]
    got = [tuple(x) for x in res["named"] if not x[0].endswith(KV_CACHE_SCALES)]
    assert [tuple(x) for x in want] == got
    assert any(n.endswith("qkv_proj.weight_scale_inv") for n, _, _ in want)
    assert res["mismatched"] == []


if __name__ == "__main__":
    _child(sys.argv[1])
