"""Shared kernel-layout regions in the plan: per-expert gate and up rows written into one w13 region.

The plan must keep a region's writers in one bucket at one byte range, count its bytes once,
refuse regions its writers do not describe alike or do not cover exactly once (naming the
tensors), and leave tables without layouts exactly as before (same wire form, same digest).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mxrefit.formats import MXFP8
from mxrefit.formats.kernel_layout import KernelLayout
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import vllm_mxfp8_kernel_tables
from mxrefit.plan.build import PlanMismatch, SourceSpec, build_plan, tables_from_msg, tables_to_msg
from mxrefit.plan.regions import region_key, spans
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs

SHAPE = BUILTIN["tiny-qwen3-moe"]
CPU = torch.device("cpu")
UP = "model.layers.0.mlp.experts.1.up_proj.weight"
GATE = "model.layers.0.mlp.experts.1.gate_proj.weight"

# build_plan digests of these tables at eef1fa3 (before regions existed), bucket_bytes 96 KiB
DIGESTS_BEFORE = {
    ("per_expert", "none"): "966988575fccd917e7bc1d5e92605e3c559831e334c92adab198361b7c2840f0",
    ("grouped", "none"): "d1f7a0cfd52e8f9b949a5a200d316dd62fff3884b3073b12e743444fc3876805",
    ("grouped", "trtllm"): "46d614622459277fca4a10faf9c586589d8335d18231d58f93cadbe38d4d7a12",
}


def specs(experts: str = "per_expert") -> list[SourceSpec]:
    return [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(SHAPE, experts=experts)]


def tables(experts: str = "per_expert", direct: bool = True):
    params = vllm_params(SHAPE, mxfp8=True)
    k = vllm_mxfp8_kernel_tables(SHAPE, params, vllm_destinations(SHAPE, mxfp8=True, experts=experts), CPU, direct=direct)
    return k.params, k.destinations


def regions_of(plan) -> dict[tuple[str, int], set[tuple[int, int]]]:
    """(bucket, bucket offset) of every part of each shared region."""
    out: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for b in plan.buckets:
        for p in b.parts:
            key = region_key(p.target)
            if key is not None:
                out.setdefault(key, set()).add((b.index, p.offset))
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 40 << 10, 96 << 10, 512 << 20])
def test_a_region_is_one_byte_range_of_one_bucket_and_counts_once(bucket_bytes):
    params, dests = tables()
    plan = build_plan(specs(), params, dests, bucket_bytes=bucket_bytes)
    where = regions_of(plan)
    assert len(where) == SHAPE.layers * SHAPE.experts * 2  # values and scales of every expert's w13
    assert all(len(places) == 1 for places in where.values())  # gate and up: same bucket, same bytes
    covered = {n: torch.zeros(p.nbytes, dtype=torch.int32) for n, p in params.items()}
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes
        for r in b.runs:
            covered[r.param][r.param_offset : r.param_offset + r.nbytes] += 1
    assert all(bool((c == 1).all()) for c in covered.values()), "an engine byte is landed zero or two times"
    assert plan.total_bytes == sum(p.nbytes for p in params.values())
    assert [i for b in plan.buckets for i in b.sources] == list(range(len(plan.sources)))  # streams keep their order


def test_writers_far_apart_in_trainer_order_share_a_bucket():
    """A trainer listing every gate before every up: each region's span reaches its up, and
    overlapping spans merge, so the bucket grows to hold them rather than split a region."""
    params, dests = tables()
    ordered = specs()
    layer0 = [s for s in ordered if ".layers.0.mlp.experts." in s.name]
    gates_first = sorted(layer0, key=lambda s: ("up_proj" in s.name, s.name))
    rest = [s for s in ordered if s not in layer0]
    plan = build_plan(gates_first + rest, params, dests, bucket_bytes=1)
    assert all(len(places) == 1 for places in regions_of(plan).values())
    first = next(b for b in plan.buckets if set(b.sources) & {i for i, s in enumerate(plan.sources) if s in layer0})
    assert {plan.sources[i].name for i in first.sources} >= {s.name for s in layer0 if "proj" in s.name and "down" not in s.name}


def test_spans_merge_overlapping_writer_ranges():
    regions = {("w", 0): [(1, 0), (4, 0)], ("w", 8): [(3, 0), (6, 0)], ("w", 16): [(8, 0), (9, 0)]}
    assert spans(11, regions) == [range(0, 1), range(1, 7), range(7, 8), range(8, 10), range(10, 11)]
    assert spans(3, {}) == [range(0, 1), range(1, 2), range(2, 3)]


def _with_layout(dests, name: str, **changes):
    d = dests[name]
    return {**dests, name: replace(d, targets=tuple(replace(t, layout=replace(t.layout, **changes)) for t in d.targets))}


def test_regions_written_twice_partly_or_unlike_are_refused_naming_the_tensors():
    params, dests = tables()
    src = specs()
    with pytest.raises(PlanMismatch, match=rf"rows \[0, 128\) are written by both '{GATE}' and '{UP}'"):
        build_plan(src, params, _with_layout(dests, UP, row_offset=0))
    # the up tensor's rows moved to a region of its own: the gate's region lacks them
    moved = {**dests, UP: replace(dests[UP], targets=tuple(replace(t, offset=t.offset + 1) for t in dests[UP].targets))}
    with pytest.raises(PlanMismatch, match=rf"rows \[128, 256\) of 256 are written by no trainer tensor \(after '{GATE}'\)"):
        build_plan(src, params, moved)
    with pytest.raises(PlanMismatch, match=rf"'{UP}' describes it otherwise than '{GATE}'"):
        build_plan(src, params, _with_layout(dests, UP, rows="trtllm"))


def test_the_format_refuses_regions_it_cannot_write():
    fmt = MXFP8()
    with pytest.raises(ValueError, match=r"'w'.*past the end of their region of 160 rows"):
        fmt.check_layouts("w", fmt.parts((64, 128), torch.bfloat16), [KernelLayout("trtllm", None, 128, 160)] * 2)
    padded = (KernelLayout("trtllm", None, 0, 160), KernelLayout("trtllm", "128x4", 0, 160))
    with pytest.raises(ValueError, match=r"'w'.*region of 160 rows is tile padded"):
        fmt.check_layouts("w", fmt.parts((64, 128), torch.bfloat16), padded)
    with pytest.raises(ValueError, match=r"'w'.*share one row order and region"):
        fmt.check_layouts("w", fmt.parts((64, 128), torch.bfloat16), (padded[0], KernelLayout("trtllm", "128x4", 0, 256)))
    with pytest.raises(ValueError, match="without a region"):
        KernelLayout("trtllm", None, 32)
    with pytest.raises(ValueError, match="not a row of a region"):
        KernelLayout("trtllm", None, 256, 256)
    fmt.check_layouts(
        "w",
        fmt.parts((64, 128), torch.bfloat16),
        (KernelLayout("trtllm", None, 64, 256), KernelLayout("trtllm", "128x4", 64, 256)),
    )


def test_tables_without_regions_keep_their_wire_form_and_digest():
    for experts, post in DIGESTS_BEFORE:
        params, dests = (
            tables(experts)
            if post == "trtllm"
            else (vllm_params(SHAPE, mxfp8=True), vllm_destinations(SHAPE, mxfp8=True, experts=experts))
        )
        assert not any(t.layout is not None and t.layout.shared for d in dests.values() for t in d.targets)
        assert build_plan(specs(experts), params, dests, bucket_bytes=96 << 10).digest == DIGESTS_BEFORE[(experts, post)]
        wire = tables_to_msg(params, dests)
        assert all(len(t) == 4 or len(t[4]) == 2 for _, _, ts in wire["destinations"] for t in ts)
    params, dests = tables()
    assert tables_from_msg(tables_to_msg(params, dests)) == (params, dests)  # regions cross the wire whole
    assert tables_to_msg(params, dests)["destinations"] != tables_to_msg(*tables(direct=False))["destinations"]
    regions = build_plan(specs(), params, dests, bucket_bytes=96 << 10).digest
    assert regions != build_plan(specs(), *tables(direct=False), bucket_bytes=96 << 10).digest
