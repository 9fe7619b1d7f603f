"""The refit plan: computed once, then every step replays it.

For every trainer tensor the plan records its format, its bucket, and for each encoded part
(values, scales) the byte range in the bucket and the byte range in the engine parameter it
lands in. Within a bucket, parts are laid out in destination order, so parts that are
neighbours in an engine parameter (expert 3's up rows after its gate rows, expert 4 after
expert 3) become one contiguous *run*: the engine applies a bucket as a handful of copies.
Parts of one shared region (``plan/regions.py``: per-expert gate and up rows interleaved in a
kernel layout) share one bucket and one byte range of it.

Both sides build the plan from the same inputs (the trainer's source list, the engine's
tables, the bucket size) with the same deterministic function and compare digests, so a plan
that does not match the engine is refused before any weight is written.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import torch

from mxrefit.devices import ALIGN, align
from mxrefit.errors import MxrefitError
from mxrefit.formats import get_format
from mxrefit.formats.block_permutation import BlockPermutation
from mxrefit.formats.kernel_layout import KernelLayout
from mxrefit.plan.dtypes import dtype_from_name, dtype_name
from mxrefit.plan.regions import region_key, region_problems, shared_regions, spans
from mxrefit.plan.types import Destination, ParamSpec, Target

DEFAULT_BUCKET_BYTES = 512 << 20


class PlanMismatch(MxrefitError, ValueError):
    """Trainer tensors and engine tables disagree; lists every offending name."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        super().__init__(f"refit plan does not match the engine ({len(problems)} problems):\n  {shown}{more}")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Part:
    """One encoded part of a source: bytes [offset, offset+nbytes) of its bucket."""

    source: int
    role: int
    offset: int
    target: Target


@dataclass(frozen=True)
class Run:
    """Contiguous bytes of a bucket that land contiguously in one engine parameter."""

    offset: int
    param: str
    param_offset: int
    nbytes: int


@dataclass
class Bucket:
    index: int
    slot: int
    nbytes: int = 0
    sources: list[int] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)


WRITE_AHEAD = 1
"""Buckets a trainer that sends one behind (``Sender(one_behind=True)``) may be ahead of its
``slots`` window: its "ready" messages go out one bucket behind, so it starts bucket *i* once
bucket *i - slots - 1* was applied. The plan carries it (``RefitPlan.write_ahead``: 0 for every
other trainer), and both sides read the window from ``RefitPlan.window``, so an engine's staging
holds that extra bucket only for a trainer that writes it. A trainer that says nothing (from
before the field; some ran one behind) gets the extra bucket."""


@dataclass
class RefitPlan:
    sources: list[SourceSpec]
    formats: list[str]
    buckets: list[Bucket]
    bucket_bytes: int
    slots: int
    digest: str
    write_ahead: int = 0  # buckets past ``slots`` the trainer may write ahead (``WRITE_AHEAD`` or 0)

    @property
    def window(self) -> int:
        """The most buckets the trainer may have written past the last one the engine applied.

        Why it matters: whatever the engine keeps per bucket (a staging region awaiting its layer's
        processing) must outlive it, or the trainer writes the next layer over bytes not yet read.
        """
        return self.slots + self.write_ahead

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for b in self.buckets for r in b.runs)


def _check(sources: list[SourceSpec], params: dict[str, ParamSpec], destinations: dict[str, Destination]) -> None:
    problems: list[str] = []
    names = {s.name for s in sources}
    counts = Counter(s.name for s in sources)
    problems += [f"duplicate trainer tensor {n!r} ({c} times)" for n, c in counts.items() if c > 1]
    problems += [f"unexpected tensor {n!r}: the engine has no destination for it" for n in sorted(names - destinations.keys())]
    problems += [
        f"missing tensor {n!r}: the engine expects it and the trainer did not send it"
        for n in sorted(destinations.keys() - names)
    ]
    hint = _expert_layout_hint(names - destinations.keys(), destinations.keys() - names)
    if hint:
        problems.insert(0, hint)
    for src in sources:
        dest = destinations.get(src.name)
        if dest is None:
            continue
        try:
            fmt = get_format(dest.format)
            fmt.check_source(src.name, src.shape, src.dtype)
        except ValueError as err:
            problems.append(str(err))
            continue
        want = fmt.parts(src.shape, dest.targets[0].dtype)
        if len(want) != len(dest.targets):
            problems.append(
                f"tensor {src.name!r}: format {dest.format} has {len(want)} parts, the engine gives {len(dest.targets)} targets"
            )
            continue
        for spec, tgt in zip(want, dest.targets):
            if tuple(spec.shape) != tuple(tgt.shape) or spec.dtype != tgt.dtype:
                problems.append(
                    f"tensor {src.name!r} ({tuple(src.shape)}, {src.dtype}): its {spec.role} would be "
                    f"{tuple(spec.shape)} {spec.dtype}, the engine's {tgt.param!r} takes {tuple(tgt.shape)} {tgt.dtype}"
                )
                break
            if tgt.param not in params:
                problems.append(f"tensor {src.name!r}: target parameter {tgt.param!r} does not exist in the engine")
                break
            if tgt.offset < 0 or tgt.offset + tgt.nbytes > params[tgt.param].nbytes:
                problems.append(
                    f"tensor {src.name!r}: target bytes [{tgt.offset}, {tgt.offset + tgt.nbytes}) outside {tgt.param!r}"
                )
                break
        else:
            layouts = tuple(t.layout for t in dest.targets)
            if any(layouts):
                try:
                    fmt.check_layouts(src.name, want, layouts)
                except ValueError as err:
                    problems.append(str(err))
    if problems:
        raise PlanMismatch(problems)


def _expert_layout_hint(unexpected: set[str], missing: set[str]) -> str | None:
    """Name the usual cause when the two sides hold MoE experts in different layouts."""
    grouped = lambda names: any(n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for n in names)  # noqa: E731
    per_expert = lambda names: any(".mlp.experts." in n and n.endswith("_proj.weight") for n in names)  # noqa: E731
    if grouped(unexpected) and per_expert(missing):
        return (
            "expert layout: the trainer sends grouped expert slabs (mlp.experts.gate_up_proj/down_proj) but the "
            "engine expects per-expert names; build the engine with experts='grouped'"
        )
    if per_expert(unexpected) and grouped(missing):
        return (
            "expert layout: the trainer sends per-expert names (mlp.experts.{e}.*_proj.weight) but the engine "
            "expects grouped slabs; build the engine with experts='per_expert'"
        )
    return None


def _layout(bucket: Bucket, sources_parts: dict[int, list[Target]], param_rank: dict[str, int]) -> None:
    """Place the bucket's parts in destination order; merge neighbours into runs. The parts of a
    shared region get the bytes its first part got."""
    entries = [(param_rank[t.param], t.offset, s, r, t) for s in bucket.sources for r, t in enumerate(sources_parts[s])]
    entries.sort(key=lambda e: (e[0], e[1]))
    offset = 0
    prev: Run | None = None
    placed: dict[tuple[str, int], int] = {}
    for _, _, s, r, t in entries:
        key = region_key(t)
        if key is not None and key in placed:
            bucket.parts.append(Part(s, r, placed[key], t))
            continue
        if prev is not None and prev.param == t.param and prev.param_offset + prev.nbytes == t.offset:
            bucket.runs[-1] = Run(prev.offset, prev.param, prev.param_offset, prev.nbytes + t.nbytes)
        else:
            offset = align(offset)
            bucket.runs.append(Run(offset, t.param, t.offset, t.nbytes))
        bucket.parts.append(Part(s, r, offset, t))
        if key is not None:
            placed[key] = offset
        offset += t.nbytes
        prev = bucket.runs[-1]
    bucket.nbytes = offset


def build_plan(
    sources: list[SourceSpec],
    params: dict[str, ParamSpec],
    destinations: dict[str, Destination],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    slots: int = 2,
    write_ahead: int = 0,
) -> RefitPlan:
    """Validate and lay out a refit; raises PlanMismatch listing every problem."""
    if write_ahead not in (0, WRITE_AHEAD):
        raise ValueError(f"write_ahead must be 0 or {WRITE_AHEAD}, got {write_ahead}")
    _check(sources, params, destinations)
    targets = {i: list(destinations[s.name].targets) for i, s in enumerate(sources)}
    regions = shared_regions(targets)
    problems = region_problems([s.name for s in sources], targets, regions)
    if problems:
        raise PlanMismatch(problems)
    groups = spans(len(sources), regions)
    footprint = [_footprint(span, targets) for span in groups]
    bucket_bytes = max(align(bucket_bytes), max(footprint, default=ALIGN))
    param_rank = {name: i for i, name in enumerate(params)}
    buckets: list[Bucket] = []
    used = bucket_bytes
    for span, size in zip(groups, footprint):
        if used + size > bucket_bytes:
            buckets.append(Bucket(index=len(buckets), slot=len(buckets) % slots))
            used = 0
        buckets[-1].sources.extend(span)
        used += size
    for b in buckets:
        _layout(b, targets, param_rank)
    formats = [destinations[s.name].format for s in sources]
    layouts = [[i, r, t.layout.to_msg()] for i, ts in targets.items() for r, t in enumerate(ts) if t.layout is not None]
    digest = _digest(sources, formats, buckets, bucket_bytes, slots, layouts)
    return RefitPlan(sources, formats, buckets, bucket_bytes, slots, digest, write_ahead)


def _footprint(span: range, targets: dict[int, list[Target]]) -> int:
    """Bucket bytes a span of sources may take: a shared region counts once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for i in span:
        for t in targets[i]:
            key = region_key(t)
            if key is None or key not in seen:
                total += align(t.nbytes)
            if key is not None:
                seen.add(key)
    return total


def _digest(
    sources: list[SourceSpec], formats: list[str], buckets: list[Bucket], bucket_bytes: int, slots: int, layouts: list
) -> str:
    """sha256 of the layout both sides must agree on; kernel layouts enter only where there are
    some, so a plan without them keeps the digest it always had. The write-ahead does not enter:
    it places no byte, the engine takes the trainer's word for it (``Receiver._adopt_plan``)."""
    h = hashlib.sha256()
    h.update(msgpack.packb([bucket_bytes, slots, [[s.name, list(s.shape), dtype_name(s.dtype)] for s in sources], formats]))
    for b in buckets:
        h.update(msgpack.packb([b.slot, b.sources, [[r.offset, r.param, r.param_offset, r.nbytes] for r in b.runs]]))
    if layouts:
        h.update(msgpack.packb(["kernel layouts", layouts]))
    return h.hexdigest()


def sources_to_msg(sources: list[SourceSpec]) -> list:
    return [[s.name, list(s.shape), dtype_name(s.dtype)] for s in sources]


def sources_from_msg(msg: list) -> list[SourceSpec]:
    return [SourceSpec(str(n), tuple(int(d) for d in shape), dtype_from_name(dt)) for n, shape, dt in msg]


def tables_to_msg(params: dict[str, ParamSpec], destinations: dict[str, Destination]) -> dict:
    """The tables as msgpack-able data; learned orders' tables once each under ``orders`` (only
    where there are some, so other engines' messages keep their form)."""
    msg: dict = {
        "params": [[p.name, list(p.shape), dtype_name(p.dtype)] for p in params.values()],
        "destinations": [[d.name, d.format, [_target_to_msg(t) for t in d.targets]] for d in destinations.values()],
    }
    orders = {
        t.layout.order.rpartition(":")[0]: t.layout.permutation
        for d in destinations.values()
        for t in d.targets
        if t.layout is not None and t.layout.order is not None and t.layout.permutation is not None
    }
    if orders:
        msg["orders"] = [[digest, perm.to_msg()] for digest, perm in orders.items()]
    return msg


def _target_to_msg(t: Target) -> list:
    """``[param, offset, shape, dtype]``, and the kernel layout as a fifth item where there is one."""
    row = [t.param, t.offset, list(t.shape), dtype_name(t.dtype)]
    return row if t.layout is None else [*row, t.layout.to_msg()]


def _target_from_msg(row: list, orders: dict[str, BlockPermutation]) -> Target:
    p, off, shape, dt, *layout = row
    return Target(p, int(off), tuple(shape), dtype_from_name(dt), KernelLayout.from_msg(layout[0], orders) if layout else None)


def tables_from_msg(msg: dict) -> tuple[dict[str, ParamSpec], dict[str, Destination]]:
    params = {n: ParamSpec(n, tuple(shape), dtype_from_name(dt)) for n, shape, dt in msg["params"]}
    orders = {}
    for digest, tables in msg.get("orders") or ():
        perm = BlockPermutation.from_msg(tables)
        if perm.digest != digest:
            raise ValueError(f"learned order {str(digest)[:40]!r} came with the tables of {perm.digest}")
        orders[digest] = perm
    destinations = {
        n: Destination(n, fmt, tuple(_target_from_msg(t, orders) for t in tgts)) for n, fmt, tgts in msg["destinations"]
    }
    return params, destinations
