"""A learned MXFP8 order as a kernel layout: tables on the wire, plans of fused regions, the writers.

The engine's order here is the Marlin-8-bit-like order built by index arithmetic in
``test_block_permutation`` (16 of K x 64 of N tiles along N first, K interleaved; scales
transposed and 8x8-permuted), over a fused region the way vLLM fuses q, k and v (or an expert's
gate and up): several trainer tensors, each a row range of one region. The bytes every writer
leaves are compared with the two passes they replace: quantize the fused checkpoint tensor
(``mxfp8.quantize``, torch path), then move every byte by the index the order was learned from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxrefit.formats import get_format, mxfp8
from mxrefit.formats.block_permutation import MAX_TABLE_BYTES, BlockPermutation
from mxrefit.formats.kernel_layout import KernelLayout, read_reference
from mxrefit.plan.build import PlanMismatch, SourceSpec, build_plan, tables_from_msg, tables_to_msg
from mxrefit.plan.types import Destination, ParamSpec, Target
from tests.helpers.checks import run_under_triton_interpreter
from tests.unit.test_block_permutation import index_of, marlin8_scales, marlin8_values, marlin_like_values

K = 64
SPLITS = (("q", 128), ("k", 64), ("v", 64))  # rows of each part of the fused region
ROWS = sum(m for _, m in SPLITS)


def region_order(rows: int = ROWS, cols: int = K) -> BlockPermutation:
    perm = BlockPermutation.of(index_of(marlin8_values, rows, cols), index_of(marlin8_scales, rows, cols // 32))
    assert isinstance(perm, BlockPermutation), perm
    return perm


def tables(perm: BlockPermutation, splits=SPLITS, experts: int = 1) -> tuple[dict, dict]:
    """One fused param (and its scales) per layer; each part a row range of it, in the learned order."""
    rows = sum(m for _, m in splits)
    lead = (experts,) if experts > 1 else ()
    params = {
        "qkv.weight": ParamSpec("qkv.weight", (*lead, rows, K), torch.float8_e4m3fn),
        "qkv.weight_scale": ParamSpec("qkv.weight_scale", (*lead, rows, K // 32), torch.uint8),
    }
    dests, first = {}, 0
    for name, m in splits:
        lay = dict(row_offset=first, region_rows=rows if m != rows else None, permutation=perm)
        dests[name] = Destination(
            name,
            "mxfp8",
            (
                Target("qkv.weight", 0, (*lead, m, K), torch.float8_e4m3fn, KernelLayout(order=f"{perm.digest}:values", **lay)),
                Target(
                    "qkv.weight_scale", 0, (*lead, m, K // 32), torch.uint8, KernelLayout(order=f"{perm.digest}:scales", **lay)
                ),
            ),
        )
        first += m
    return params, dests


def two_pass(parts: list[torch.Tensor], perm_rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused tensor quantized to the checkpoint layout, then gathered by the learned index."""
    fused = torch.cat(parts, dim=-2)
    v, s = mxfp8.quantize(fused, backend="torch")
    lead = fused.shape[:-2].numel()
    idx, sidx = index_of(marlin8_values, perm_rows, K), index_of(marlin8_scales, perm_rows, K // 32)
    return v.view(torch.uint8).reshape(lead, -1)[:, idx].reshape(-1), s.view(torch.uint8).reshape(lead, -1)[:, sidx].reshape(-1)


def test_tables_carry_each_order_once_and_refuse_malformed_ones():
    perm = region_order()
    params, dests = tables(perm)
    msg = tables_to_msg(params, dests)
    assert len(msg["orders"]) == 1  # three parts, one order
    got_params, got = tables_from_msg(msg)
    assert got == dests and got_params == params
    lay = got["k"].targets[0].layout
    assert lay.permutation is not None and torch.equal(lay.permutation.index(), perm.index())
    # negative controls: tables that are not the named order, or not a permutation
    other = region_order(rows=256, cols=128)
    msg_swapped = {**msg, "orders": [[perm.digest, other.to_msg()]]}
    with pytest.raises(ValueError, match="came with the tables of"):
        tables_from_msg(msg_swapped)
    broken = perm.to_msg()
    local = torch.frombuffer(bytearray(broken["local"]), dtype=torch.int32).clone()
    local[1] = local[0]  # one byte read twice
    broken["local"] = local.numpy().tobytes()
    with pytest.raises(ValueError, match="not describe a permutation"):
        BlockPermutation.from_msg(broken)
    without = {k: v for k, v in msg.items() if k != "orders"}
    with pytest.raises(ValueError, match="without its tables"):
        tables_from_msg(without)
    # the size rule, asked without encoding: this order fits; one table past a message field is named
    assert perm.wire_problem() is None
    big = dataclasses.replace(perm, unit_src=torch.zeros(MAX_TABLE_BYTES // 4 + 1, dtype=torch.int64))
    assert "unit_src table is 1048580 bytes" in (big.wire_problem() or "")
    with pytest.raises(ValueError, match="unit_src table"):
        big.to_msg()


def test_a_fused_region_is_planned_once_and_the_torch_path_writes_its_bytes():
    perm = region_order()
    params, dests = tables(perm)
    sources = [SourceSpec(n, (m, K), torch.bfloat16) for n, m in SPLITS]
    plan = build_plan(sources, params, dests)
    assert sum(r.nbytes for b in plan.buckets for r in b.runs) == ROWS * K + ROWS * K // 32  # the region once
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(m, K, generator=g).to(torch.bfloat16) for _, m in SPLITS]
    region_v, region_s = torch.zeros(ROWS * K, dtype=torch.uint8), torch.zeros(ROWS * K // 32, dtype=torch.uint8)
    layouts = [[t.layout for t in dests[n].targets] for n, _ in SPLITS]
    outs = [[region_v, region_s] for _ in SPLITS]
    fmt = get_format("mxfp8")
    for (n, _), lay in zip(SPLITS, layouts):
        fmt.check_layouts(n, fmt.parts((dict(SPLITS)[n], K), torch.float8_e4m3fn), lay)
    encode = fmt.encoder([(tuple(p.shape), p.dtype) for p in parts], outs, layouts=layouts)
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    encode(parts, bad)
    want_v, want_s = two_pass(parts)
    assert torch.equal(region_v, want_v) and torch.equal(region_s, want_s)
    # and the engine reads the checkpoint bytes back from the region (its check against vLLM's loader)
    whole = KernelLayout(order=f"{perm.digest}:values", permutation=perm)
    back = read_reference(whole, region_v, (ROWS, K), torch.float8_e4m3fn)
    assert torch.equal(back, mxfp8.quantize(torch.cat(parts), backend="torch")[0])


def test_a_unit_across_two_tensors_is_refused_by_name():
    """Marlin's units here are 4 rows x 32 of K: a split at row 2 leaves a unit two tensors write."""
    perm = region_order(rows=192)
    params, dests = tables(perm, splits=(("q", 130), ("k", 62)))
    fmt = get_format("mxfp8")
    with pytest.raises(ValueError, match=r"'q'.*reads rows 0..130 and rows of another tensor"):
        fmt.check_layouts("q", fmt.parts((130, K), torch.float8_e4m3fn), [t.layout for t in dests["q"].targets])
    with pytest.raises(PlanMismatch):
        build_plan([SourceSpec("q", (130, K), torch.bfloat16), SourceSpec("k", (62, K), torch.bfloat16)], params, dests)


def test_values_and_scales_must_share_one_order():
    perm = region_order()
    other = BlockPermutation.of(index_of(marlin_like_values, ROWS, K), index_of(marlin8_scales, ROWS, K // 32))
    assert isinstance(other, BlockPermutation) and other.digest != perm.digest
    fmt = get_format("mxfp8")
    parts = fmt.parts((ROWS, K), torch.float8_e4m3fn)
    mine = KernelLayout(order=f"{perm.digest}:values", permutation=perm)
    theirs = KernelLayout(order=f"{other.digest}:scales", permutation=other)
    with pytest.raises(ValueError, match="share one row order"):
        fmt.check_layouts("w", parts, [mine, theirs])
    swapped = KernelLayout(order=f"{perm.digest}:scales", permutation=perm)
    with pytest.raises(ValueError, match="in the scales' order"):
        fmt.check_layouts("w", parts, [swapped, swapped])


_GROUP = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _mxfp8_triton as k, mxfp8
from mxrefit.formats._common import NO_BAD, bad_flag
from tests.unit.test_learned_order import SPLITS, K, ROWS, region_order, two_pass

perm = region_order()
g = torch.Generator().manual_seed(11)
E = 3  # experts: every tensor [E, m, K], its region [E, ROWS, K]
for dtype in (torch.bfloat16, torch.float16):
    parts = [(torch.randn(E, m, K, generator=g) * 4).to(dtype) for _, m in SPLITS]
    ov, os_ = torch.zeros(E * ROWS * K, dtype=torch.uint8), torch.zeros(E * ROWS * K // 32, dtype=torch.uint8)
    bad = bad_flag(torch.device("cpu"))
    first = 0
    for i, (name, m) in enumerate(SPLITS):
        sub = perm.rows(first, m, K)
        group = k.PermutedGroup(sub, [p.to("meta") for p in parts[i : i + 1]], [(ov, os_)], [i], device=torch.device("cpu"))
        group(parts[i : i + 1], 0, bad)
        first += m
    want_v, want_s = two_pass(parts)
    assert int(bad.item()) == NO_BAD
    assert torch.equal(ov, want_v) and torch.equal(os_, want_s), dtype
# many tensors in one launch (every layer's k alike), and a NaN reports its caller's index
parts = [(torch.randn(64, K, generator=g)).to(torch.bfloat16) for _ in range(4)]
outs = [(torch.zeros(ROWS * K, dtype=torch.uint8), torch.zeros(ROWS * K // 32, dtype=torch.uint8)) for _ in parts]
sub = perm.rows(128, 64, K)
group = k.PermutedGroup(sub, [p.to("meta") for p in parts], outs, [7, 8, 9, 10], device=torch.device("cpu"))
parts[2][3, 5] = float("nan")
bad = bad_flag(torch.device("cpu"))
group(parts, 0, bad)
assert int(bad.item()) == 9, bad
for p, (v, s) in zip(parts[:2], outs[:2]):
    ref_v, ref_s = torch.zeros_like(v), torch.zeros_like(s)
    q, sc = mxfp8.quantize(p, backend="torch")
    sub.write_reference(q, sc, ref_v, ref_s)
    assert torch.equal(v, ref_v) and torch.equal(s, ref_s)
# negative control: the k units written from q's rows land other bytes
wrong = perm.rows(0, 64, K)
v0 = outs[0][0].clone()
k.PermutedGroup(wrong, [parts[0].to("meta")], [outs[0]], [0], device=torch.device("cpu"))(parts[:1], 0, bad)
assert not torch.equal(outs[0][0], v0)
print("ok")
"""


def test_the_group_kernel_writes_every_part_of_a_region_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(_GROUP)
