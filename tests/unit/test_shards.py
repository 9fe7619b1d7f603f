"""A rank's slice of whole-parameter bytes: the strided copies against plain indexing, and the refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxrefit.engine.shards import check_shards, local_nbytes, run_copies, strided
from mxrefit.formats.kernel_layout import KernelLayout
from mxrefit.plan.types import Destination, ParamSpec, Shard, Target


@st.composite
def sharded_runs(draw):
    """A whole param, a shard of it (pieces permuted into the rank's order), and a byte run of it."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
    dim = draw(st.integers(0, ndim - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[dim]), min_size=2, max_size=5))))
    if len(cuts) < 2:
        cuts = [0, shape[dim]]
    windows = [(a, b) for a, b in zip(cuts, cuts[1:]) if draw(st.booleans())] or [(cuts[0], cuts[1])]
    order = draw(st.permutations(windows))
    pieces, at = [], 0
    for a, b in order:
        pieces.append((a, b, at))
        at += b - a
    spec = ParamSpec("w", shape, dtype)
    start = draw(st.integers(0, spec.nbytes - 1))
    nbytes = draw(st.integers(1, spec.nbytes - start))
    return spec, Shard(dim, at, tuple(pieces)), start, nbytes


def _reference(spec: ParamSpec, shard: Shard, start: int, nbytes: int, whole: torch.Tensor) -> torch.Tensor:
    """The rank's bytes after copying whole bytes [start, start+nbytes): plain index arithmetic."""
    inner = math.prod(spec.shape[shard.dim + 1 :]) * spec.dtype.itemsize
    index = torch.arange(spec.nbytes).view(math.prod(spec.shape[: shard.dim]), spec.shape[shard.dim], inner)
    local = torch.empty(index.shape[0], shard.size, inner, dtype=torch.long)
    for a, b, at in shard.pieces:
        local[:, at : at + b - a] = index[:, a:b]
    local = local.reshape(-1)
    inside = (local >= start) & (local < start + nbytes)
    return torch.where(inside, whole[local], torch.zeros_like(whole[local]))


@settings(max_examples=300, deadline=None)
@given(sharded_runs(), st.integers(0, 64))
def test_run_copies_take_exactly_the_ranks_bytes(case, slot_offset):
    spec, shard, start, nbytes = case
    whole = torch.randint(1, 256, (spec.nbytes,), dtype=torch.uint8)
    bucket = torch.zeros(slot_offset + nbytes + 7, dtype=torch.uint8)
    bucket[slot_offset : slot_offset + nbytes] = whole[start : start + nbytes]
    local = torch.zeros(local_nbytes(spec, shard), dtype=torch.uint8)
    for c in run_copies(slot_offset, start, nbytes, spec, shard):
        strided(local, c.dst, c.dst_pitch, c.rows, c.width).copy_(strided(bucket, c.src, c.src_pitch, c.rows, c.width))
    assert torch.equal(local, _reference(spec, shard, start, nbytes, whole))


def test_a_column_slice_of_a_whole_run_is_one_strided_copy():
    spec = ParamSpec("o_proj.weight", (256, 128), torch.float8_e4m3fn)
    copies = run_copies(512, 0, spec.nbytes, spec, Shard(1, 64, ((64, 128, 0),)))
    assert [(c.src, c.src_pitch, c.dst, c.dst_pitch, c.rows, c.width) for c in copies] == [(576, 128, 0, 64, 256, 64)]


def _mxfp8_tables(values_shard: Shard | None, scales_shard: Shard | None):
    params = {"w": ParamSpec("w", (64, 128), torch.float8_e4m3fn), "w_scale": ParamSpec("w_scale", (64, 4), torch.uint8)}
    dest = Destination("w", "mxfp8", (Target("w", 0, (64, 128), torch.float8_e4m3fn), Target("w_scale", 0, (64, 4), torch.uint8)))
    shards = {k: v for k, v in (("w", values_shard), ("w_scale", scales_shard)) if v is not None}
    return params, {"w": dest}, shards


def test_mxfp8_column_slices_on_whole_blocks_are_accepted():
    check_shards(*_mxfp8_tables(Shard(1, 64, ((64, 128, 0),)), Shard(1, 2, ((2, 4, 0),))))
    check_shards(*_mxfp8_tables(Shard(0, 32, ((32, 64, 0),)), Shard(0, 32, ((32, 64, 0),))))


@pytest.mark.parametrize(
    "values, scales, rule",
    [
        (Shard(1, 48, ((16, 64, 0),)), Shard(1, 1, ((0, 1, 0),)), "multiples of 32"),
        (Shard(1, 64, ((64, 128, 0),)), None, "sliced together"),
        (Shard(1, 64, ((64, 128, 0),)), Shard(1, 2, ((0, 2, 0),)), "does not match"),
        (Shard(0, 32, ((0, 32, 0),)), Shard(0, 32, ((32, 64, 0),)), "does not match"),
    ],
    ids=["off-block", "scales-whole", "scales-elsewhere", "rows-differ"],
)
def test_mxfp8_slices_that_would_need_requantizing_are_refused(values, scales, rule):
    with pytest.raises(ValueError, match=rule) as err:
        check_shards(*_mxfp8_tables(values, scales))
    assert "'w'" in str(err.value)


@pytest.mark.parametrize(
    "shard, rule",
    [
        (Shard(2, 4, ((0, 4, 0),)), "not a dim"),
        (Shard(0, 8, ((60, 68, 0),)), "outside dim 0"),
        (Shard(0, 8, ((0, 4, 0), (8, 16, 2))), "written twice"),
        (Shard(0, 8, ((0, 4, 0), (8, 12, 5))), "never written"),
        (Shard(0, 8, ((0, 4, 0),)), "cover 4 of the rank's 8"),
    ],
    ids=["dim", "range", "overlap", "gap", "short"],
)
def test_malformed_shards_are_refused_by_name(shard, rule):
    params = {"norm": ParamSpec("norm", (64, 16), torch.bfloat16)}
    with pytest.raises(ValueError, match=rule) as err:
        check_shards(params, {}, {"norm": shard})
    assert "'norm'" in str(err.value)


def test_slices_of_a_format_without_a_slicing_rule_are_refused():
    params = {
        "w": ParamSpec("w", (256, 256), torch.float8_e4m3fn),
        "w_scale_inv": ParamSpec("w_scale_inv", (2, 2), torch.float32),
    }
    dest = Destination(
        "w", "fp8-block", (Target("w", 0, (256, 256), torch.float8_e4m3fn), Target("w_scale_inv", 0, (2, 2), torch.float32))
    )
    with pytest.raises(ValueError, match="'w'.*fp8-block"):
        check_shards(params, {"w": dest}, {"w": Shard(0, 128, ((0, 128, 0),))})


def test_slices_of_a_param_in_a_kernel_layout_are_refused():
    params, dests, shards = _mxfp8_tables(Shard(0, 32, ((32, 64, 0),)), Shard(0, 32, ((32, 64, 0),)))
    values, scales = dests["w"].targets
    laid = replace(dests["w"], targets=(replace(values, layout=KernelLayout(rows="trtllm")), scales))
    check_shards(params, dests, shards)
    with pytest.raises(ValueError, match=r"'w'.*kernel layout") as err:
        check_shards(params, {"w": laid}, shards)
    assert "'w'" in str(err.value)
