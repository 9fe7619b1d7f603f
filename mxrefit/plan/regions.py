"""Shared regions: one byte range of an engine parameter that several trainer tensors write.

Why: FlashInfer's gated MoE order interleaves an expert's gate rows with its up rows, so a
trainer holding them as two tensors (per-expert ``gate_proj``/``up_proj``) cannot write either
into a byte range of its own. Their targets instead name the same range (the expert's w13
region) with a ``KernelLayout`` saying which rows of it each one is (``row_offset``,
``region_rows``), and each source's encoder writes its rows into that range.

The plan then must (``build_plan``):
- refuse regions whose writers disagree, leave rows unwritten or write rows twice
  (``region_problems``, naming the tensors and the rule);
- keep every writer of a region in one bucket, so a bucket boundary never splits one
  (``spans``: the sources a bucket boundary may not fall inside);
- lay a region's bytes once in its bucket, so runs, bucket sizes and the engine's landed and
  staged bytes count each region once.
A region is known by its ``(param, offset)``; targets without a shared layout are never in one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mxrefit.plan.coverage import cover_problems
from mxrefit.plan.types import Target

RegionKey = tuple[str, int]


def region_key(t: Target) -> RegionKey | None:
    """The shared region ``t`` writes into, or None where its bytes are its own."""
    return (t.param, t.offset) if t.layout is not None and t.layout.shared else None


def shared_regions(targets: Mapping[int, Sequence[Target]]) -> dict[RegionKey, list[tuple[int, int]]]:
    """Every shared region and its writers, as (source index, part index), in source order."""
    regions: dict[RegionKey, list[tuple[int, int]]] = {}
    for s, ts in targets.items():
        for r, t in enumerate(ts):
            key = region_key(t)
            if key is not None:
                regions.setdefault(key, []).append((s, r))
    return regions


def _describes(t: Target) -> tuple:
    """What every writer of a region must say alike: all of its target but the rows it holds."""
    lay = t.layout
    return (lay.rows, lay.tiles, lay.region_rows, lay.order) if lay else None, t.dtype, t.shape[:-2], t.shape[-1], t.nbytes


def _rows(t: Target) -> tuple[int, int]:
    """[first, end) of the region's rows per expert that ``t`` holds."""
    first = t.layout.row_offset if t.layout else 0
    return first, first + t.shape[-2]


def region_problems(
    names: Sequence[str], targets: Mapping[int, Sequence[Target]], regions: Mapping[RegionKey, list[tuple[int, int]]]
) -> list[str]:
    """Why these regions cannot be written as described: writers that disagree on the region's
    layout or row width, rows written twice, rows written by no trainer tensor."""
    problems = []
    for (param, offset), members in regions.items():
        where = f"shared region at byte {offset} of {param!r}"
        parts = [(names[s], targets[s][r]) for s, r in members]
        first_name, first = parts[0]
        odd = [name for name, t in parts if _describes(t) != _describes(first)]
        if odd:
            problems.append(
                f"{where}: {odd[0]!r} describes it otherwise than {first_name!r} (its writers share one row "
                f"order, tiling, region rows, dtype and row width)"
            )
            continue
        total = first.layout.region_rows if first.layout and first.layout.region_rows else 0
        for p in cover_problems(((*_rows(t), name) for name, t in parts), total):
            if p.kind == "overlap":
                problems.append(f"{where}: rows [{p.start}, {p.end}) are written by both {p.earlier!r} and {p.writer!r}")
            elif p.kind == "gap":
                problems.append(f"{where}: rows [{p.start}, {p.end}) of {total} are written by no trainer tensor")
            elif p.kind == "tail":
                problems.append(
                    f"{where}: rows [{p.start}, {p.end}) of {total} are written by no trainer tensor (after {p.earlier!r})"
                )
    return problems


def spans(n_sources: int, regions: Mapping[RegionKey, list[tuple[int, int]]]) -> list[range]:
    """Consecutive source ranges no bucket boundary may fall inside: from the first writer of a
    region to its last (overlapping ones merged); every other source is a span of its own. Buckets
    hold sources in order, so keeping a region's first and last writer together keeps them all."""
    reach = list(range(n_sources))  # the last source each one must share a bucket with
    for members in regions.values():
        first, last = min(s for s, _ in members), max(s for s, _ in members)
        reach[first] = max(reach[first], last)
    out, i = [], 0
    while i < n_sources:
        j, end = i, reach[i]
        while j < end:
            j += 1
            end = max(end, reach[j])
        out.append(range(i, end + 1))
        i = end + 1
    return out
