"""The quantized checkpoint writers: bytes are the refits' quantizers', configs are what vLLM reads.

The FP8-block writer's ``ignored_layers`` is checked with vLLM 0.32's own matcher
(``is_layer_skipped`` in exact mode after ``hf_to_vllm_mapper``, as ``Fp8Config`` applies them)
against the rules, layer by layer. Loading such a checkpoint in a running vLLM is
tests/integration/test_vllm_fp8_block_engine.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mxrefit.formats import fp8_block, mxfp8
from mxrefit.plan.eligibility import QuantRules
from mxrefit.source.checkpoint import fp8_ignored_layers, save_fp8_block_checkpoint, save_mxfp8_checkpoint
from tests.helpers import vllm_models as vm


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["fp8-block", "fp8-block-ue8m0"])
def test_fp8_block_checkpoint_holds_the_refits_bytes(tmp_path, use_ue8m0):
    model = vm.qwen3_dense(seed=3)
    formats = save_fp8_block_checkpoint(model, tmp_path, use_ue8m0=use_ue8m0)
    fmt = "fp8-block-ue8m0" if use_ue8m0 else "fp8-block"
    saved = _tensors(tmp_path)
    weights = dict(model.state_dict())
    assert formats["model.layers.1.mlp.down_proj.weight"] == fmt and formats["lm_head.weight"] == "bf16"
    assert formats["model.embed_tokens.weight"] == "bf16" and formats["model.norm.weight"] == "bf16"
    for name, f in formats.items():
        if f == "bf16":
            assert torch.equal(saved[name], weights[name]) and name + "_scale_inv" not in saved
            continue
        values, scales = fp8_block.quantize(weights[name], use_ue8m0=use_ue8m0, backend="torch")
        assert torch.equal(saved[name].view(torch.uint8), values.view(torch.uint8)), name
        assert saved[name + "_scale_inv"].dtype == torch.float32
        assert torch.equal(saved[name + "_scale_inv"], scales), name
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head"],
    }
    assert not (tmp_path / "hf_quant_config.json").exists()  # vLLM would read it as ModelOpt's


def test_mxfp8_checkpoint_unchanged_by_the_shared_writer(tmp_path):
    model = vm.qwen3_dense(seed=3)
    formats = save_mxfp8_checkpoint(model, tmp_path)
    saved = _tensors(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    values, scales = mxfp8.quantize(model.state_dict()[name], backend="torch")
    assert formats[name] == "mxfp8" and torch.equal(saved[name + "_scale"], scales)
    assert torch.equal(saved[name].view(torch.uint8), values.view(torch.uint8))
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quantization"]["exclude_modules"] == ["lm_head", "model.layers.*.mlp.gate"]
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"] == config["quantization"]


RULES = [
    QuantRules(),
    QuantRules(bf16_first_layers=1),
    QuantRules(bf16_last_layers=1, ignore=("lm_head", "model.layers.*.mlp.gate", "self_attn.o_proj")),
    QuantRules(ignore=("lm_head", "model.layers.*.mlp.gate", "model.layers.0.mlp.experts.2.up_proj")),
]


@pytest.mark.parametrize("rules", RULES, ids=["default", "first", "last+o_proj", "one-expert"])
def test_fp8_ignored_layers_mean_the_rules_to_vllm(rules):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    model = vm.qwen3_moe(seed=0)
    specs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    # transformers 5 holds grouped slabs; checkpoint names are per expert: both must give the same list
    per_expert = [(n, s) for n, s in specs if ".mlp.experts." not in n]
    for i in range(2):
        for e in range(8):
            per_expert += [
                (f"model.layers.{i}.mlp.experts.{e}.{p}.weight", (64, 128)) for p in ("gate_proj", "up_proj", "down_proj")
            ]
    ignored = fp8_ignored_layers(specs, rules)
    assert sorted(ignored) == sorted(fp8_ignored_layers(per_expert, rules))
    mapped = Qwen3MoeForCausalLM.hf_to_vllm_mapper.apply_list(ignored)  # Fp8Config.apply_vllm_mapper
    packed = Qwen3MoeForCausalLM.packed_modules_mapping
    for i in range(2):
        p = f"model.layers.{i}"
        for layer in (f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate", f"{p}.mlp.experts"):
            vllm_skips = is_layer_skipped(layer, mapped, packed, match_mode="exact")
            assert vllm_skips == rules.excludes_layer(layer, 2), (layer, ignored)
    assert "lm_head" in ignored
