"""The embedded engine holds eligible weights quantized, in vLLM's names, and dequantizes them for checks."""

from __future__ import annotations

import pytest
import torch

from mxrefit.engine.torch import TorchEngine
from mxrefit.formats import fp8_block, mxfp8
from tests.helpers.models import tiny_qwen3_moe


@pytest.mark.parametrize(
    "quant, scale_suffix, scale_dtype, quantize",
    [
        ("mxfp8", "_scale", torch.uint8, lambda w: mxfp8.quantize(w)),
        ("fp8-block", "_scale_inv", torch.float32, lambda w: fp8_block.quantize(w)),
        ("fp8-block-ue8m0", "_scale_inv", torch.float32, lambda w: fp8_block.quantize(w, use_ue8m0=True)),
    ],
)
def test_quantized_weights_are_held_in_vllm_names_and_dequantize(quant, scale_suffix, scale_dtype, quantize):
    trainer = tiny_qwen3_moe(seed=3)
    weights = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    engine = TorchEngine(tiny_qwen3_moe(seed=3), quant=quant)
    dests = engine.destinations()
    o = "model.layers.1.self_attn.o_proj.weight"
    assert dests[o].format == quant and [t.param for t in dests[o].targets] == [o, o + scale_suffix]
    assert engine.tensor(o + scale_suffix).dtype == scale_dtype
    assert dests["lm_head.weight"].format == "bf16" and dests["model.layers.0.mlp.gate.weight"].format == "bf16"
    state = engine.dequantized_state(torch.float32)
    for name, dest in dests.items():
        if dest.format == quant:
            values, scales = quantize(weights[name])
            assert torch.equal(engine.tensor(name).view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(engine.tensor(name + scale_suffix), scales), name
            rel = (state[name] - weights[name].float()).norm() / weights[name].float().norm()
            assert rel < 0.05, (name, rel)
        else:
            assert torch.equal(state[name], weights[name]), name


def test_quant_argument_is_checked():
    with pytest.raises(ValueError, match="quant must be None or one of"):
        TorchEngine(tiny_qwen3_moe(seed=3), quant="nvfp4")
    with pytest.raises(ValueError, match="disagree"):
        TorchEngine(tiny_qwen3_moe(seed=3), mxfp8=True, quant="fp8-block")
    assert TorchEngine(tiny_qwen3_moe(seed=3), mxfp8=True).quant == "mxfp8"
