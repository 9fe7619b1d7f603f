"""Staging for engines whose kernels do not read the checkpoint layout as it arrives.

Why: many engines transform weights after loading (vLLM's Marlin repack, FlashInfer's
MoE shuffles and scale swizzles, CPU GEMM prepacking, MXFP8 emulation's dequantization).
Their refit must land checkpoint-format bytes somewhere, then run the engine's own
processing per layer and write the result into the kernel tensors in place. Keeping a
checkpoint-format copy of the whole model costs as much memory as the model; staging only
the layers whose bytes are in flight costs a few buckets (the write window, ``RefitPlan.window``, and
the layers that straddle bucket edges).

A *unit* is what gets processed at once (one layer module): a few checkpoint-format
parameters and a ``process`` callable that reads them and writes the kernel tensors.
``place(plan)`` gives every unit a region of one pool such that two units share bytes only
if one is processed before the trainer can start writing the other. The trainer writes
bucket *i* once the engine has processed bucket *i - window* (``RefitPlan.window``: the
slots, plus one where the plan says the trainer sends one behind, ``write_ahead``), so a unit written in
buckets [first, last] holds its region from ``first`` until ``last + window - 1`` in the
trainer's bucket clock.
``after_bucket(i)`` processes the units whose last bucket is *i*. With ``deferred=True``
(transactions) nothing is processed before ``process_all``, so every unit is live at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mxrefit.devices import align
from mxrefit.plan.types import ParamSpec
from mxrefit.transport.direct import allocate


@dataclass
class StagedUnit:
    """Parameters staged and processed together; ``process`` gets them by name as typed tensors."""

    name: str
    params: Sequence[str]
    process: Callable[[dict[str, torch.Tensor]], None]


def assign_regions(sizes: Sequence[int], intervals: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """First-fit offsets so that units with overlapping [start, end] intervals never overlap in bytes.

    Returns (offset per unit, pool bytes). Units are placed in start order; a region is
    free again once its unit's interval ended before the new unit's start.
    """
    order = sorted(range(len(sizes)), key=lambda u: (intervals[u][0], -sizes[u]))
    offsets = [0] * len(sizes)
    live: list[tuple[int, int, int]] = []  # (offset, size, end)
    top = 0
    for u in order:
        start, end = intervals[u]
        live = [r for r in live if r[2] >= start]
        size = align(max(sizes[u], 1))
        pos = 0
        for off, sz, _ in sorted(live):
            if pos + size <= off:
                break
            pos = max(pos, off + sz)
        offsets[u] = pos
        live.append((pos, size, end))
        top = max(top, pos + size)
    return offsets, top


class StagingPool:
    """One exportable pool holding the staged parameters of the units in flight."""

    def __init__(self, specs: dict[str, ParamSpec], units: Sequence[StagedUnit], device: torch.device, *, deferred: bool = False):
        self.specs = specs
        self.units = list(units)
        self.device = torch.device(device)
        self.deferred = deferred
        self._unit_of = {p: i for i, u in enumerate(self.units) for p in u.params}
        missing = [p for p in self._unit_of if p not in specs]
        if missing:
            raise ValueError(f"staged parameters without a spec: {missing[:5]}")
        self._pool: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._due: dict[int, list[int]] = {}
        self.pool_bytes = 0

    def release(self) -> None:
        """Drop the pool now (shared memory is unlinked once no view is left), not at garbage collection."""
        self._views = {}
        self._due = {}
        self._pool = None
        self.pool_bytes = 0

    def staged(self, param: str) -> bool:
        return param in self._unit_of

    def place(self, plan) -> None:
        """Give every unit a region for this plan (``plan``: a ``mxrefit.plan.RefitPlan``)."""
        touched: dict[int, list[int]] = {}
        for b in plan.buckets:
            for r in b.runs:
                u = self._unit_of.get(r.param)
                if u is not None:
                    touched.setdefault(u, []).append(b.index)
        never = [self.units[u].name for u in range(len(self.units)) if u not in touched]
        if never:
            raise ValueError(f"staged units that no trainer tensor writes: {never[:5]}")
        last_bucket = len(plan.buckets) - 1
        intervals, sizes = [], []
        for u, unit in enumerate(self.units):
            first, last = min(touched[u]), max(touched[u])
            end = last_bucket + plan.window if self.deferred else last + plan.window - 1
            intervals.append((first, end))
            sizes.append(sum(align(self.specs[p].nbytes) for p in unit.params))
        offsets, total = assign_regions(sizes, intervals)
        if self._pool is None or self._pool.numel() < total:
            self._pool = None
            self._pool = allocate(max(total, 1), self.device)
        self.pool_bytes = total
        self._views = {}
        for u, unit in enumerate(self.units):
            pos = offsets[u]
            for p in unit.params:
                n = self.specs[p].nbytes
                self._views[p] = self._pool[pos : pos + n]
                pos += align(n)
        self._due = {}
        if not self.deferred:
            for u in range(len(self.units)):
                self._due.setdefault(max(touched[u]), []).append(u)

    def storage(self, param: str) -> torch.Tensor:
        return self._views[param]

    def typed(self, param: str) -> torch.Tensor:
        spec = self.specs[param]
        return self._views[param].view(spec.dtype).view(spec.shape)

    def _process(self, u: int) -> None:
        unit = self.units[u]
        unit.process({p: self.typed(p) for p in unit.params})

    def after_bucket(self, bucket: int) -> None:
        for u in self._due.get(bucket, ()):
            self._process(u)

    def process_all(self) -> None:
        """Process every unit (deferred mode, at commit)."""
        if self.deferred:
            for u in range(len(self.units)):
                self._process(u)


def staged_bytes(specs: dict[str, ParamSpec], units: Sequence[StagedUnit]) -> int:
    """Bytes a whole checkpoint-format copy of the staged parameters would take (for reports)."""
    return sum(math.prod(specs[p].shape) * specs[p].dtype.itemsize for u in units for p in u.params)
