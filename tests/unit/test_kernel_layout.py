"""Kernel layouts written by the trainer's MXFP8 encoder equal the engine's two-pass layout code.

The reference is what the engine did before layouts existed: quantize in the checkpoint layout
(``mxfp8.quantize``), then ``trtllm.MoeLayout`` / ``trtllm.LinearScaleLayout`` (their torch
path here, their Triton kernels in the interpreter run). Checked on the torch path (CPU) and
on the grouped Triton kernel under Triton's interpreter, with a negative control each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mxrefit.formats import MXFP8, FP8Block
from mxrefit.formats import mxfp8 as mx
from mxrefit.formats.kernel_layout import KernelLayout, interleaved_size, read_reference, row_permutation, write_reference
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import (
    LinearScaleLayout,
    MoeLayout,
    moe_direct_targets,
    reference_kernel_bytes,
    vllm_mxfp8_kernel_tables,
)
from mxrefit.plan.build import PlanMismatch, SourceSpec, build_plan, tables_from_msg, tables_to_msg
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs
from mxrefit.plan.types import Destination, ParamSpec, Target
from tests.helpers.checks import run_under_triton_interpreter

CPU = torch.device("cpu")
MOE_CASES = [((3, 256, 256), True), ((2, 384, 128), False), ((1, 128, 512), True)]  # several experts and 128-row tiles
LINEAR_CASES = [(100, 96), (200, 9 * 32), (256, 128)]  # padded rows, padded block columns, no padding
W13_CASES = [(3, 512, 256), (2, 256, 128)]  # per-expert gate/up: experts, w13 rows (2 and 4 128-row tiles), K


def moe_two_pass(x: torch.Tensor, gated: bool, min_byte: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's path: checkpoint-layout quantize, then the post-pass."""
    e, m, k = x.shape
    v, s = mx.quantize(x, backend="torch", zero_block_scale_one=bool(min_byte))
    kv = torch.empty(e, m, k, dtype=torch.uint8)
    MoeLayout(e, m, k, gated, CPU, scales=False)(v.view(torch.uint8), kv)
    ks = torch.zeros(e * interleaved_size(m, k // 32), dtype=torch.uint8)
    MoeLayout(e, m, k // 32, gated, CPU, scales=True)(s, ks)
    return kv.reshape(-1), ks


def linear_two_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v, s = mx.quantize(x, backend="torch")
    layout = LinearScaleLayout(*s.shape, CPU)
    ks = torch.zeros(layout.out_bytes, dtype=torch.uint8)
    layout(s, ks)
    return v.view(torch.uint8).reshape(-1), ks


def moe_layouts(gated: bool) -> tuple[KernelLayout, KernelLayout]:
    order = "trtllm-gated" if gated else "trtllm"
    return KernelLayout(rows=order), KernelLayout(rows=order, tiles="128x4")


def region_layouts(first: int, rows: int) -> tuple[KernelLayout, KernelLayout]:
    """Values and scales of a source holding rows [first, ...) of an expert's gated w13 region."""
    return KernelLayout("trtllm-gated", None, first, rows), KernelLayout("trtllm-gated", "128x4", first, rows)


def per_expert_w13(experts: int, rows: int, k: int, seed: int, swap: bool = False):
    """Per-expert gate/up sources of a gated MoE (each expert's pair writing the same two region
    views), their region layouts, the flat w13 values/scales those views belong to, and the
    engine's reference: [w1; w3] quantized in the checkpoint layout, then ``MoeLayout``. With
    ``swap`` (negative control) gate and up claim each other's rows."""
    half = rows // 2
    gates = [source((half, k), seed + 2 * e) for e in range(experts)]
    ups = [source((half, k), seed + 2 * e + 1) for e in range(experts)]
    want = moe_two_pass(torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]), gated=True)
    values, scales = garbage(experts * rows * k), garbage(experts * rows * k // 32)
    srcs, outs, layouts = [], [], []
    for e, (g, u) in enumerate(zip(gates, ups)):
        region = [values[e * rows * k : (e + 1) * rows * k], scales[e * rows * k // 32 : (e + 1) * rows * k // 32]]
        for x, first in ((g, 0), (u, half)):
            srcs.append(x)
            outs.append(region)
            layouts.append(region_layouts(half - first if swap else first, rows))
    return srcs, outs, layouts, (values, scales), want


def garbage(n: int) -> torch.Tensor:
    return torch.full((n,), 0xA5, dtype=torch.uint8)  # padding must come out zero whatever was there


def source(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10.0 ** (seed % 5 - 2)).to(torch.bfloat16)


def test_torch_encoder_writes_moe_and_linear_layouts_like_the_two_pass_path():
    srcs, outs, layouts, want = [], [], [], []
    for i, (shape, gated) in enumerate(MOE_CASES):
        x = source(shape, i)
        kv, ks = moe_two_pass(x, gated)
        srcs.append(x)
        outs.append([garbage(kv.numel()), garbage(ks.numel())])
        layouts.append(moe_layouts(gated))
        want.append((kv, ks))
    for i, shape in enumerate(LINEAR_CASES):
        x = source(shape, 10 + i)
        v, ks = linear_two_pass(x)
        srcs.append(x)
        outs.append([torch.empty(shape, dtype=mx.VALUE_DTYPE), garbage(ks.numel())])
        layouts.append((None, KernelLayout(tiles="128x4")))
        want.append((v, ks))
    encode = MXFP8().encoder([(tuple(s.shape), s.dtype) for s in srcs], outs, layouts=layouts)
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    encode(srcs, bad)
    assert int(bad) == 2**31 - 1
    for (v, s), (wv, ws) in zip(outs, want):
        assert torch.equal(v.reshape(-1).view(torch.uint8), wv)
        assert torch.equal(s, ws)


@pytest.mark.parametrize("experts,rows,k", W13_CASES)
def test_per_expert_gate_and_up_write_their_rows_into_the_shared_w13_region(experts, rows, k):
    """The torch path: gate and up of each expert scatter their rows into one region, and the
    whole w13 equals the engine's two-pass bytes of the stacked [w1; w3]."""
    srcs, outs, layouts, got, want = per_expert_w13(experts, rows, k, seed=40)
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    MXFP8().encoder([(tuple(x.shape), x.dtype) for x in srcs], outs, layouts=layouts)(srcs, bad)
    assert int(bad) == 2**31 - 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # negative controls: gate and up on each other's rows, and the up rows never written
    srcs, outs, layouts, swapped, _ = per_expert_w13(experts, rows, k, seed=40, swap=True)
    MXFP8().encoder([(tuple(x.shape), x.dtype) for x in srcs], outs, layouts=layouts)(srcs, bad)
    assert not torch.equal(swapped[0], want[0]) and not torch.equal(swapped[1], want[1])
    srcs, outs, layouts, gates_only, _ = per_expert_w13(experts, rows, k, seed=40)
    MXFP8().encoder([(tuple(x.shape), x.dtype) for x in srcs[::2]], outs[::2], layouts=layouts[::2])(srcs[::2], bad)
    assert int((gates_only[0] != want[0]).sum()) > 0 and int((gates_only[0] == 0xA5).sum()) >= experts * rows * k // 4


def test_negative_control_a_wrong_row_order_is_caught():
    x = source((2, 256, 128), 3)
    kv, ks = moe_two_pass(x, gated=True)
    out = [garbage(kv.numel()), garbage(ks.numel())]
    MXFP8().encoder([(tuple(x.shape), x.dtype)], [out], layouts=[moe_layouts(False)])([x], torch.zeros(1, dtype=torch.int32))
    assert not torch.equal(out[0], kv) and not torch.equal(out[1], ks)
    # and a permutation one swap away from P differs from the engine's too
    p = row_permutation("trtllm-gated", 256).clone()
    p[[0, 1]] = p[[1, 0]]
    v = mx.quantize(x, backend="torch")[0].view(torch.uint8)
    assert not torch.equal(v[:, p].reshape(-1), kv)


def test_reference_writer_equals_the_engine_reference_and_zero_block_scale_one_holds():
    x = source((2, 128, 256), 4)
    x[0, :32] = 0  # all-zero blocks: scale byte 1 with zero_block_scale_one, values stay zero
    kv, ks = moe_two_pass(x, gated=True, min_byte=1)
    out = [garbage(kv.numel()), garbage(ks.numel())]
    MXFP8(zero_block_scale_one=True).encoder([(tuple(x.shape), x.dtype)], [out], layouts=[moe_layouts(True)])(
        [x], torch.zeros(1, dtype=torch.int32)
    )
    assert torch.equal(out[0], kv) and torch.equal(out[1], ks) and int(out[1].min()) >= 1
    name = "model.layers.0.mlp.experts.routed_experts.w13_weight_scale"
    assert torch.equal(reference_kernel_bytes(name, mx.quantize(x, backend="torch", zero_block_scale_one=True)[1]), ks)


def test_torch_encoder_reports_non_finite_sources_in_layouts():
    srcs = [source((2, 128, 64), 5), source((1, 128, 64), 6)]
    srcs[1][0, 77, 3] = float("nan")
    outs = [[garbage(2 * 128 * 64), garbage(2 * 128 * 2 * 2)], [garbage(128 * 64), garbage(128 * 4)]]
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    MXFP8().encoder([(tuple(s.shape), s.dtype) for s in srcs], outs, layouts=[moe_layouts(False)] * 2)(srcs, bad)
    assert int(bad) == 1


def test_layout_rules_are_refused_naming_the_tensor_and_the_rule():
    parts = MXFP8().parts((2, 96, 64), torch.bfloat16)
    with pytest.raises(ValueError, match=r"'w'.*blocks of 32.*80 rows"):
        MXFP8().check_layouts("w", MXFP8().parts((2, 80, 64), torch.bfloat16), moe_layouts(True))
    with pytest.raises(ValueError, match=r"'w'.*values are never tiled"):
        MXFP8().check_layouts("w", parts, (KernelLayout(tiles="128x4"), None))
    with pytest.raises(ValueError, match=r"'w'.*share one row order"):
        MXFP8().check_layouts("w", parts, (KernelLayout(rows="trtllm"), KernelLayout(rows="trtllm-gated", tiles="128x4")))
    with pytest.raises(ValueError, match=r"'w'.*fp8-block writes the checkpoint layout only"):
        FP8Block().check_layouts("w", FP8Block().parts((256, 256), torch.bfloat16), (None, KernelLayout(tiles="128x4")))
    with pytest.raises(ValueError, match="unknown kernel row order"):
        KernelLayout(rows="marlin")
    MXFP8().check_layouts("w", parts, moe_layouts(True))


def test_plan_refuses_a_layout_the_format_cannot_write_and_tables_carry_layouts():
    params = {"p": ParamSpec("p", (256, 64), torch.float32), "s": ParamSpec("s", (256, 64), torch.float32)}
    tiled = KernelLayout(tiles="128x4")
    dests = {
        "w": Destination(
            "w", "fp8-block", (Target("p", 0, (256, 256), torch.float8_e4m3fn), Target("s", 0, (2, 2), torch.float32, tiled))
        )
    }
    with pytest.raises(PlanMismatch, match=r"'w'.*fp8-block writes the checkpoint layout only"):
        build_plan([SourceSpec("w", (256, 256), torch.bfloat16)], params, dests)
    lin = {"v": ParamSpec("v", (100, 96), mx.VALUE_DTYPE), "s": ParamSpec("s", (interleaved_size(100, 3),), torch.uint8)}
    plain = {"w": Destination("w", "mxfp8", (Target("v", 0, (100, 96), mx.VALUE_DTYPE), Target("s", 0, (100, 3), torch.uint8)))}
    laid = {"w": Destination("w", "mxfp8", (plain["w"].targets[0], Target("s", 0, (100, 3), torch.uint8, tiled)))}
    assert laid["w"].targets[1].nbytes == 128 * 4  # tile padding is part of the target's bytes
    assert tables_from_msg(tables_to_msg(lin, laid)) == (lin, laid)
    assert tables_from_msg(tables_to_msg(lin, plain)) == (lin, plain)
    src = [SourceSpec("w", (100, 96), torch.bfloat16)]
    assert build_plan(src, lin, plain).digest != build_plan(src, lin, laid).digest


def test_bench_tables_write_in_place_for_grouped_and_per_expert_sources():
    shape = BUILTIN["tiny-qwen3-moe"]
    params = vllm_params(shape, mxfp8=True)
    per_expert = vllm_mxfp8_kernel_tables(shape, params, vllm_destinations(shape, mxfp8=True), CPU)
    grouped = vllm_mxfp8_kernel_tables(shape, params, vllm_destinations(shape, mxfp8=True, experts="grouped"), CPU)
    staged = vllm_mxfp8_kernel_tables(shape, params, vllm_destinations(shape, mxfp8=True), CPU, direct=False)
    assert not grouped.units and not grouped.kernel  # nothing left for the engine to do after a refit
    assert not per_expert.units and not per_expert.kernel  # gate/up halves: rows of shared w13 regions
    assert not staged.direct and len(staged.units) == 4 * shape.layers  # qkv and o scales, w13, w2 per layer
    for k, experts in ((grouped, "grouped"), (per_expert, "per_expert")):
        specs = [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(shape, experts=experts)]
        build_plan(specs, k.params, k.destinations)  # every layout passes the format's rules
        laid = {t.param for d in k.destinations.values() for t in d.targets if t.layout is not None}
        assert laid == set(k.direct)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _mxfp8_triton
from tests.unit.test_kernel_layout import (
    LINEAR_CASES, MOE_CASES, W13_CASES, garbage, linear_two_pass, moe_layouts, moe_two_pass, per_expert_w13, source,
)
from mxrefit.formats.kernel_layout import KernelLayout

def run(srcs, layouts, sizes, min_byte=0, inverse_fault=False, iters=1):
    outs = [(garbage(a), garbage(b)) for a, b in sizes]
    group = _mxfp8_triton.QuantizeGroup(srcs, outs, blocks_per_program=16, layouts=layouts, iters=iters)
    assert group.layout is not None
    if inverse_fault:  # negative control: one swapped pair in the first tensor's inverse permutation
        group.layout.inverses[0][[0, 1]] = group.layout.inverses[0][[1, 0]]
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    group(srcs, min_byte, bad)
    return outs, int(bad)

srcs, layouts, want = [], [], []
for i, (shape, gated) in enumerate(MOE_CASES):
    x = source(shape, i)
    srcs.append(x); layouts.append(moe_layouts(gated)); want.append(moe_two_pass(x, gated))
for i, shape in enumerate(LINEAR_CASES):
    x = source(shape, 10 + i)
    srcs.append(x); layouts.append((None, KernelLayout(tiles="128x4"))); want.append(linear_two_pass(x))
sizes = [(v.numel(), s.numel()) for v, s in want]
for iters in (1, 3):  # one run of blocks per program (the default), and three
    outs, bad = run(srcs, layouts, sizes, iters=iters)
    assert bad == 2**31 - 1
    for (v, s), (wv, ws) in zip(outs, want):
        assert torch.equal(v, wv) and torch.equal(s, ws), iters
# per-expert gate/up into shared w13 regions, in one launch with whole experts and linear scales
for experts, rows, k in W13_CASES:
    for swap in (False, True):
        w_srcs, w_outs, w_layouts, got, w_want = per_expert_w13(experts, rows, k, seed=40, swap=swap)
        mixed = [(garbage(a), garbage(b)) for a, b in sizes] + w_outs
        group = _mxfp8_triton.QuantizeGroup(srcs + w_srcs, mixed, blocks_per_program=16, layouts=layouts + w_layouts)
        flag = torch.full((1,), 2**31 - 1, dtype=torch.int32)
        group(srcs + w_srcs, 0, flag)
        assert int(flag) == 2**31 - 1
        assert all(torch.equal(o[0], w[0]) and torch.equal(o[1], w[1]) for o, w in zip(mixed, want))
        same = torch.equal(got[0], w_want[0]) and torch.equal(got[1], w_want[1])
        assert same != swap, (experts, rows, k, swap)  # swapped halves: the negative control differs
# here the engine's two-pass reference ran its own Triton layout kernels (interpreted)
from mxrefit.integrations.vllm.trtllm import MoeLayout
assert MoeLayout(1, 128, 512, True, torch.device("cpu"), scales=True).kernels is not None
# zero_block_scale_one and fp16 input
x = source((2, 128, 256), 4); x[0, :32] = 0
outs, _ = run([x], [moe_layouts(True)], [(2 * 128 * 256, 2 * 128 * 8)], min_byte=1)
assert all(torch.equal(a, b) for a, b in zip(outs[0], moe_two_pass(x, True, 1)))
h = source((1, 256, 64), 7).to(torch.float16)
import mxrefit.formats.mxfp8 as mx
from mxrefit.formats.kernel_layout import interleaved_size, write_reference
outs, _ = run([h], [moe_layouts(False)], [(256 * 64, interleaved_size(256, 2))])
v, s = mx.quantize(h, backend="torch")
ref_v, ref_s = garbage(v.numel()), garbage(outs[0][1].numel())
write_reference(moe_layouts(False)[0], v, ref_v); write_reference(moe_layouts(False)[1], s, ref_s)
assert torch.equal(outs[0][0], ref_v) and torch.equal(outs[0][1], ref_s)
# the non-finite report names the same tensor as the checkpoint-layout group
faulty = [t.clone() for t in srcs]
faulty[3][5, 70] = float("inf"); faulty[1][1, 3, 9] = float("nan")
_, bad = run(faulty, layouts, sizes)
assert bad == 1, bad
_, bad = run(faulty, layouts, sizes, iters=3)
assert bad == 1, bad
# negative control: a wrong permutation in the kernel's table is caught by the comparison
outs, _ = run(srcs, layouts, sizes, inverse_fault=True)
assert not torch.equal(outs[0][0], want[0][0])
assert all(torch.equal(o[0], w[0]) and torch.equal(o[1], w[1]) for o, w in zip(outs[1:], want[1:]))
print("ok")
"""


def test_grouped_triton_kernel_writes_layouts_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(_INTERPRETED, timeout_s=900)


def test_write_reference_pads_with_zeros():
    s = torch.full((1, 100, 3), 9, dtype=torch.uint8)
    out = garbage(interleaved_size(100, 3))
    write_reference(KernelLayout(tiles="128x4"), s, out)
    assert int((out == 9).sum()) == 300 and int((out == 0).sum()) == out.numel() - 300


@pytest.mark.parametrize(
    "shape,layout",
    [
        ((3, 256, 8), KernelLayout(rows="trtllm-gated", tiles="128x4")),
        ((100, 3), KernelLayout(tiles="128x4")),
        ((2, 128, 64), KernelLayout(rows="trtllm")),
        ((128, 8), KernelLayout(rows="trtllm-gated", tiles="128x4", row_offset=128, region_rows=256)),
        ((64, 32), KernelLayout(rows="trtllm-gated", row_offset=32, region_rows=128)),
    ],
)
def test_read_reference_inverts_write_reference(shape, layout):
    """What ``VllmEngine`` hands vLLM's own processing under MXREFIT_VERIFY: the checkpoint bytes back."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(len(shape)))
    out = garbage(layout.stored_bytes(shape, torch.uint8))
    write_reference(layout, x, out)
    assert torch.equal(read_reference(layout, out, shape, torch.uint8), x)
    if layout.rows is not None:  # negative control: the other row order does not give them back
        wrong = replace(layout, rows="trtllm" if layout.rows == "trtllm-gated" else "trtllm-gated")
        assert not torch.equal(read_reference(wrong, out, shape, torch.uint8), x)


def test_a_w13_written_by_per_expert_regions_reads_back_as_its_checkpoint():
    """What ``VllmEngine`` hands vLLM's own processing under MXREFIT_VERIFY for a w13 that per-expert
    gate/up wrote: ``read_reference`` with the whole param's layout (``_advertise_trtllm_layouts``)
    gives back the checkpoint bytes of [w1; w3]."""
    experts, rows, k = W13_CASES[0]
    srcs, outs, layouts, (values, scales), _ = per_expert_w13(experts, rows, k, seed=50)
    MXFP8().encoder([(tuple(x.shape), x.dtype) for x in srcs], outs, layouts=layouts)(srcs, torch.zeros(1, dtype=torch.int32))
    ckpt_v, ckpt_s = mx.quantize(torch.stack([torch.cat(srcs[i : i + 2]) for i in range(0, len(srcs), 2)]), backend="torch")
    got_v = read_reference(KernelLayout("trtllm-gated"), values, (experts, rows, k), mx.VALUE_DTYPE)
    assert torch.equal(got_v.view(torch.uint8), ckpt_v.view(torch.uint8))
    assert torch.equal(read_reference(KernelLayout("trtllm-gated", "128x4"), scales, tuple(ckpt_s.shape), torch.uint8), ckpt_s)
    assert not torch.equal(read_reference(KernelLayout("trtllm", "128x4"), scales, tuple(ckpt_s.shape), torch.uint8), ckpt_s)


def test_per_expert_gate_and_up_get_a_shared_region_only_where_they_cover_each_expert_once():
    shape = BUILTIN["tiny-qwen3-moe"]
    name = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    _, m, k = vllm_params(shape, mxfp8=True)[name].shape
    dests = vllm_destinations(shape, mxfp8=True)
    gate, up = (dests[f"model.layers.0.mlp.experts.1.{p}_proj.weight"] for p in ("gate", "up"))
    laid = moe_direct_targets(dests, name, m, k, gated=True)
    assert laid is not None
    for d, first in ((gate, 0), (up, m // 2)):
        values, scales = laid[d.name].targets
        assert (values.offset, scales.offset) == (m * k, m * k // 32)  # expert 1's whole region
        assert values.layout == KernelLayout("trtllm-gated", None, first, m)
        assert scales.layout == KernelLayout("trtllm-gated", "128x4", first, m)
    down = "model.layers.0.mlp.experts.routed_experts.w2_weight"
    assert moe_direct_targets(dests, down, *vllm_params(shape, mxfp8=True)[down].shape[1:], gated=False) is not None
    # an expert whose up rows come from nowhere keeps the engine's pass (the trainer cannot cover them)
    no_up = {n: d for n, d in dests.items() if n != up.name}
    assert moe_direct_targets(no_up, name, m, k, gated=True) is None
