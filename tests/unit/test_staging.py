"""Staging pool placement: units in flight never share bytes; finished units give theirs back."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxrefit.engine.layout import LayoutEngine
from mxrefit.engine.staging import StagedUnit, StagingPool, assign_regions
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import vllm_mxfp8_kernel_tables
from mxrefit.plan.build import SourceSpec, build_plan
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs
from mxrefit.plan.types import ParamSpec

units_st = st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(units_st)
def test_units_whose_intervals_overlap_never_share_bytes(raw):
    sizes = [s for s, _, _ in raw]
    intervals = [(a, a + d) for _, a, d in raw]
    offsets, total = assign_regions(sizes, intervals)
    for i in range(len(raw)):
        assert offsets[i] + sizes[i] <= total
        for j in range(i):
            (a0, a1), (b0, b1) = intervals[i], intervals[j]
            if a0 <= b1 and b0 <= a1:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i], (i, j)
    # never more than all units side by side (512-aligned)
    assert total <= sum(-(-s // 512) * 512 for s in sizes)


def test_disjoint_intervals_reuse_the_same_bytes():
    offsets, total = assign_regions([1000, 1000, 1000], [(0, 1), (2, 3), (4, 5)])
    assert offsets == [0, 0, 0] and total == 1024


def _layout_plan(layers: int, bucket_bytes: int, slots: int = 2, write_ahead: int = 0):
    shape = replace(BUILTIN["tiny-qwen3-moe"], layers=layers)
    params = vllm_params(shape, mxfp8=True)
    dests = vllm_destinations(shape, mxfp8=True)
    specs = [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(shape)]
    plan = build_plan(specs, params, dests, bucket_bytes=bucket_bytes, slots=slots, write_ahead=write_ahead)
    return shape, params, dests, plan


def test_units_are_processed_once_right_after_their_last_bucket():
    shape, params, dests, plan = _layout_plan(layers=12, bucket_bytes=64 << 10)  # buckets are >= the 2 MB embedding
    seen: list[tuple[int, str]] = []
    clock = {"bucket": -1}
    units = [StagedUnit(n, (n,), lambda t, n=n: seen.append((clock["bucket"], n))) for n in params if n.endswith("_scale")]
    pool = StagingPool(params, units, torch.device("cpu"))
    pool.place(plan)
    last = {}
    for b in plan.buckets:
        for r in b.runs:
            last[r.param] = b.index
    for b in plan.buckets:
        clock["bucket"] = b.index
        pool.after_bucket(b.index)
    assert sorted(n for _, n in seen) == sorted(u.name for u in units)
    assert all(b == last[n] for b, n in seen)
    assert 0 < pool.pool_bytes < sum(params[u.name].nbytes for u in units)


def test_deferred_staging_keeps_every_unit_until_commit():
    shape, params, dests, plan = _layout_plan(layers=2, bucket_bytes=64 << 10)
    done = []
    units = [StagedUnit(n, (n,), lambda t, n=n: done.append(n)) for n in params if n.endswith("_scale")]
    pool = StagingPool(params, units, torch.device("cpu"), deferred=True)
    pool.place(plan)
    for b in plan.buckets:
        pool.after_bucket(b.index)
    assert done == []
    pool.process_all()
    assert sorted(done) == sorted(u.name for u in units)
    assert pool.pool_bytes >= sum(params[u.name].nbytes for u in units)


def test_a_unit_no_trainer_tensor_writes_is_refused():
    shape, params, dests, plan = _layout_plan(layers=1, bucket_bytes=1 << 20)
    extra = {**params, "ghost": ParamSpec("ghost", (4,), torch.bfloat16)}
    pool = StagingPool(extra, [StagedUnit("ghost", ("ghost",), lambda t: None)], torch.device("cpu"))
    try:
        pool.place(plan)
    except ValueError as err:
        assert "ghost" in str(err)
    else:
        raise AssertionError("a staged unit without writes must be refused")


def test_layout_engine_with_trtllm_units_places_its_pool_per_plan():
    shape, params, dests, plan = _layout_plan(layers=3, bucket_bytes=96 << 10)
    k = vllm_mxfp8_kernel_tables(shape, params, dests, torch.device("cpu"), direct=False)
    units, kernel = k.units, k.kernel
    engine = LayoutEngine(params, dests, "cpu", units=units, kernel=kernel)
    engine.prepare(plan)
    staged = [n for n in params if engine.staging.staged(n)]
    assert staged and all(engine.storage(n).numel() == params[n].nbytes for n in staged)
    assert set(kernel) == set(staged)


def _clashes(plan, pool, units, ahead: int) -> list[tuple[int, str, str]]:
    """Replay a trainer that writes bucket ``j`` once bucket ``j - ahead`` was processed: every
    (bucket, unit written, unit still awaiting processing) pair whose staged bytes overlap."""
    span = {
        p: (pool.storage(p).data_ptr(), pool.storage(p).data_ptr() + pool.storage(p).numel()) for u in units for p in u.params
    }
    unit_of = {p: u.name for u in units for p in u.params}
    buckets_of: dict[str, list[int]] = {}
    for b in plan.buckets:
        for r in b.runs:
            if r.param in unit_of:
                buckets_of.setdefault(unit_of[r.param], []).append(b.index)
    clashes = []
    for b in plan.buckets:
        processed = b.index - ahead  # the engine processed buckets <= this one
        written = {r.param for r in b.runs if r.param in unit_of}
        waiting = [u for u in units if min(buckets_of[u.name]) < b.index and max(buckets_of[u.name]) > processed]
        for p in written:
            for u in waiting:
                if u.name != unit_of[p] and any(span[p][0] < span[q][1] and span[q][0] < span[p][1] for q in u.params):
                    clashes.append((b.index, unit_of[p], u.name))
    return clashes


@pytest.mark.parametrize("write_ahead", [0, 1], ids=["in-step", "one-behind"])
@pytest.mark.parametrize("bucket_kb,slots", [(64, 2), (96, 2), (96, 3), (256, 2), (1024, 2)])
def test_staged_regions_outlive_the_trainers_write_window(bucket_kb, slots, write_ahead):
    """A trainer starts bucket i once bucket i - slots - write_ahead was applied (``plan.window``;
    a one-behind sender writes one further): no layer it writes may land on a layer still waiting
    to be processed. Negative control: a trainer one bucket further ahead does clash on these
    plans, so the replay can see a clash (the 2026-12-05 CI failure: a one-behind trainer on
    staging that kept regions for ``slots`` buckets only)."""
    shape, params, dests, plan = _layout_plan(layers=12, bucket_bytes=bucket_kb << 10, slots=slots, write_ahead=write_ahead)
    k = vllm_mxfp8_kernel_tables(shape, params, dests, torch.device("cpu"), direct=False)
    pool = StagingPool(k.params, k.units, torch.device("cpu"))
    pool.place(plan)
    assert plan.window == slots + write_ahead
    assert _clashes(plan, pool, k.units, ahead=plan.window) == []
    assert _clashes(plan, pool, k.units, ahead=plan.window + 1) != []


def test_an_in_step_trainer_costs_the_engine_a_smaller_pool():
    """Staging keeps the extra bucket only for a one-behind trainer (``write_ahead``): an in-step
    trainer's plan leaves the pool smaller. The digest, which covers where bytes go, is the same."""
    sizes, digests = {}, {}
    for write_ahead in (0, 1):
        shape, params, dests, plan = _layout_plan(layers=12, bucket_bytes=96 << 10, write_ahead=write_ahead)
        k = vllm_mxfp8_kernel_tables(shape, params, dests, torch.device("cpu"), direct=False)
        pool = StagingPool(k.params, k.units, torch.device("cpu"))
        pool.place(plan)
        sizes[write_ahead], digests[write_ahead] = pool.pool_bytes, plan.digest
    assert sizes[0] < sizes[1] and digests[0] == digests[1]
    with pytest.raises(ValueError, match="write_ahead must be 0 or 1"):
        _layout_plan(layers=2, bucket_bytes=96 << 10, write_ahead=2)
