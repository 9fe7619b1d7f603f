"""The vLLM engine's table choice, from checkpoint-format metadata alone (no vLLM model needed).

``_fast_tables`` reads the quantized format from the live params (E4M3 values with a uint8
``_scale``: MXFP8; with a float32 ``_scale_inv``: FP8-block) and must then agree with the live
model on every parameter; ``_fallback_tables`` pairs checkpoint tensors the same way. The real
engines are exercised in tests/integration/test_vllm_engine.py and tests/integration/test_vllm_fp8_block_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from mxrefit.integrations.vllm.compat import VllmSetupError
from mxrefit.integrations.vllm.engine import _fallback_tables, _fast_tables, _quant_layouts
from mxrefit.integrations.vllm.layout import EXPERTS, coverage_check, vllm_params
from mxrefit.plan.eligibility import QuantRules
from mxrefit.plan.shapes import BUILTIN

F8, U8, F32, BF16 = torch.float8_e4m3fn, torch.uint8, torch.float32, torch.bfloat16
SHAPE = BUILTIN["tiny-qwen3-moe"]


def _live(fmt: str, rules: QuantRules = QuantRules()) -> dict:
    """What ``checkpoint_specs`` reports for a vLLM model holding ``fmt``: {name: (shape, dtype, module type)}."""
    return {n: (p.shape, p.dtype, "Layer") for n, p in vllm_params(SHAPE, fmt=fmt, rules=rules).items()}


@pytest.mark.parametrize(
    "fmt,fp8_block,want",
    [
        ("mxfp8", "fp8-block", "mxfp8"),
        ("fp8-block", "fp8-block", "fp8-block"),
        ("fp8-block", "fp8-block-ue8m0", "fp8-block-ue8m0"),  # same engine params, power-of-two scales on the wire
        ("bf16", "fp8-block", None),
    ],
)
@pytest.mark.parametrize("experts", ["per_expert", "grouped"])
def test_format_is_read_from_the_live_params(fmt, fp8_block, want, experts):
    params, dests, problems = _fast_tables(SHAPE, _live(fmt), experts, fp8_block)
    assert problems == []
    coverage_check(params, dests)
    formats = {d.format for d in dests.values()}
    assert formats == ({"bf16", want} if want else {"bf16"})
    q = dests["model.layers.1.self_attn.k_proj.weight"]
    if want and want.startswith("fp8-block"):
        assert [(t.param, t.offset, t.shape, t.dtype) for t in q.targets][1] == (
            "model.layers.1.self_attn.qkv_proj.weight_scale_inv",
            2 * 2 * 4,
            (1, 2),
            F32,
        )  # after q's 2 tile rows of 2


def test_layers_kept_bf16_by_the_checkpoint_are_followed():
    params, dests, problems = _fast_tables(SHAPE, _live("fp8-block", QuantRules(bf16_last_layers=1)), "grouped")
    assert problems == []
    assert dests["model.layers.3.mlp.experts.gate_up_proj"].format == "bf16"
    assert dests["model.layers.2.mlp.experts.gate_up_proj"].format == "fp8-block"
    assert params[f"model.layers.3.{EXPERTS}.w13_weight"].dtype == BF16


def test_mixed_or_unknown_quantization_takes_the_fallback():
    live = _live("fp8-block")
    mx = _live("mxfp8")
    o = "model.layers.0.self_attn.o_proj.weight"
    mixed = {k: v for k, v in live.items() if not k.startswith(o)} | {o: mx[o], o + "_scale": mx[o + "_scale"]}
    assert "mixes quantized formats ['fp8-block', 'mxfp8']" in _fast_tables(SHAPE, mixed, "grouped")[2][0]
    # per-tensor FP8 (a float32 `weight_scale` of one element): no layout of the tables, so problems -> fallback
    per_tensor = {k: v for k, v in live.items() if not k.endswith("_scale_inv")}
    per_tensor.update({k.removesuffix("_inv"): ((1,), F32, "Layer") for k in live if k.endswith("_scale_inv")})
    problems = _fast_tables(SHAPE, per_tensor, "grouped")[2]
    assert any("table says" in p and "the live model holds" in p for p in problems)


def test_fallback_pairs_fp8_block_and_mxfp8_checkpoint_tensors():
    manifest = {
        "a.weight": ((300, 256), F8),
        "a.weight_scale_inv": ((3, 2), F32),  # FP8-block
        "b.weight": ((64, 64), F8),
        "b.weight_scale": ((64, 2), U8),  # MXFP8
        "c.weight": ((8, 8), F8),
        "c.weight_scale": ((1,), F32),  # per-tensor FP8: not a pair of ours
        "norm.weight": ((64,), BF16),
    }
    params, dests = _fallback_tables(manifest, "fp8-block-ue8m0")
    assert set(params) == set(manifest)
    assert set(dests) == {"a.weight", "b.weight", "c.weight", "c.weight_scale", "norm.weight"}
    a = dests["a.weight"]
    assert a.format == "fp8-block-ue8m0"
    assert [(t.param, t.shape, t.dtype) for t in a.targets] == [("a.weight", (300, 256), F8), ("a.weight_scale_inv", (3, 2), F32)]
    assert dests["b.weight"].format == "mxfp8" and dests["b.weight"].targets[1].param == "b.weight_scale"
    assert dests["c.weight"].format == "bf16" and dests["norm.weight"].format == "bf16"


def test_unknown_fp8_block_format_is_refused():
    with pytest.raises(VllmSetupError, match="fp8_block must be one of"):
        _quant_layouts("fp8-block-e8m0")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_an_engine_in_float16_or_float32_gets_the_fast_path(dtype, fmt):
    """The tables hold unquantized tensors in the engine's own dtype (vLLM's ``model_config.dtype``)."""
    import dataclasses

    shape = dataclasses.replace(SHAPE, dtype=dtype)
    live = {n: (p.shape, p.dtype, "Layer") for n, p in vllm_params(shape, fmt=fmt).items()}
    assert live["model.embed_tokens.weight"][1] == dtype
    params, dests, problems = _fast_tables(shape, live, "grouped")
    assert problems == []
    coverage_check(params, dests)
    assert dests["model.norm.weight"].targets[0].dtype == dtype
    # a bfloat16 table would have sent every unquantized parameter to the slow path
    assert any("table says" in p for p in _fast_tables(SHAPE, live, "grouped")[2])


def test_the_kernel_output_digest_is_what_the_kernel_computes_and_names_a_kernel_that_fails():
    """``kernel_state``'s digest of a CPU GEMM (vLLM's ``cpu_linear``) on its fixed probe: the
    kernel's own result, whatever the parameter holds; a kernel that raises is named, not raised."""
    from mxrefit.integrations.vllm.engine import _cpu_kernel_digest, _cpu_kernel_output

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(6, 8, dtype=BF16), requires_grad=False)
    layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)
    plain = _cpu_kernel_digest(layer)
    assert _cpu_kernel_digest(layer) == plain
    packed = layer.weight.detach().clone()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=BF16), requires_grad=False)
    layer.input_size_per_partition = 8  # a packed kernel: the parameter is gone, the kernel holds a copy
    layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, packed, b)
    assert _cpu_kernel_digest(layer) == plain and _cpu_kernel_output(layer).shape == (4, 6)
    layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, packed * 2, b)  # a stale copy
    assert _cpu_kernel_digest(layer) != plain
    layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)  # reads the empty parameter
    assert _cpu_kernel_digest(layer).startswith("not run: RuntimeError")
