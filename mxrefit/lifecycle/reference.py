"""Reference-model swap for KL/logprob steps: the policy's own parameters briefly hold reference weights.

No second model is kept on the GPU. The reference weights wait in host memory (pinned on CUDA,
copied in once); ``swap_in`` copies the live weights into a host scratch area of the same arena
and the reference weights into the live parameters, ``swap_out`` copies the live weights back.
Every copy is in place: parameter objects and their data pointers never change, so modules,
optimizers and a refit plan built on them stay valid, and a round trip is a byte copy (bit-exact).

On CUDA, ``swap_in`` moves both directions at once: live->host on one stream and host->live on
another, per group of about ``group_bytes``; group g's host->live copy waits (by event) only for
group g's live->host copy, so the two directions of the PCIe/C2C link overlap. Both directions
first wait for the work already queued on the current stream, and the current stream waits for
the last copy, so the host never blocks and the next kernel sees the swapped weights.

Live and reference are checked against each other before any byte moves: same names, and per
tensor the same local (DTensor shard) shape and dtype; live tensors must be contiguous, on one
device, and not share memory. Every problem is listed, naming the tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from mxrefit.errors import MxrefitError
from mxrefit.lifecycle._tensors import data_ptr, flat_bytes, local, on_stream
from mxrefit.lifecycle.arena import DEFAULT_HEADROOM_BYTES, PinnedArena, aligned_layout, host_available_bytes

DEFAULT_GROUP_BYTES = 256 << 20


class ReferenceMismatch(MxrefitError, ValueError):
    """Live and reference weights do not pair up; ``problems`` lists each tensor and why."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "; ".join(problems[:20]) + (f"; ... {len(problems) - 20} more" if len(problems) > 20 else "")
        super().__init__(f"{len(problems)} problem(s) between live and reference weights: {shown}")


def _check(live: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> list[str]:
    problems = [f"reference has no tensor {n!r}" for n in live if n not in reference]
    problems += [f"reference tensor {n!r} has no live parameter" for n in reference if n not in live]
    devices = set()
    spans = []
    for name, t in live.items():
        shard = local(t)
        devices.add(shard.device)
        if not shard.is_contiguous():
            problems.append(f"live tensor {name!r} is not contiguous (strides {shard.stride()})")
        if shard.numel():
            start = shard.data_ptr()
            spans.append((start, start + shard.numel() * shard.element_size(), name))
        if name in reference:
            ref = local(reference[name])
            if tuple(ref.shape) != tuple(shard.shape) or ref.dtype != shard.dtype:
                problems.append(
                    f"tensor {name!r}: live {tuple(shard.shape)} {shard.dtype}, reference {tuple(ref.shape)} {ref.dtype}"
                )
    if len(devices) > 1:
        problems.append(f"live tensors are on several devices: {sorted(map(str, devices))}")
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            problems.append(f"live tensors {a!r} and {b!r} share memory (pass each tied parameter once)")
    return problems


class ReferenceSwap:
    def __init__(
        self,
        live: Mapping[str, torch.Tensor],
        reference: Mapping[str, torch.Tensor],
        *,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        available: Callable[[], int] = host_available_bytes,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    ):
        problems = _check(live, reference)
        if problems:
            raise ReferenceMismatch(problems)
        self.names = list(live)
        self._params = [live[n] for n in self.names]
        shards = [local(t) for t in self._params]
        self.device = shards[0].device if shards else torch.device("cpu")
        self._live = [flat_bytes(s) for s in shards]
        self._ptrs = [s.data_ptr() for s in shards]
        offsets, total = aligned_layout([b.numel() for b in self._live])
        self.nbytes = sum(b.numel() for b in self._live)
        self.arena = PinnedArena(
            2 * total,
            what="reference swap (reference weights + live scratch)",
            available=available,
            headroom_bytes=headroom_bytes,
        )
        self._ref = [self.arena.view(o, b.numel()) for o, b in zip(offsets, self._live)]
        self._scratch = [self.arena.view(total + o, b.numel()) for o, b in zip(offsets, self._live)]
        with torch.no_grad():
            for dst, name in zip(self._ref, self.names):
                dst.copy_(flat_bytes(local(reference[name]).contiguous()))
        self._groups = self._split(group_bytes)
        self.swapped = False
        self._cuda = _Streams.on(self.device, len(self._groups)) if self.device.type == "cuda" else None

    def _split(self, group_bytes: int) -> list[range]:
        groups, start, size = [], 0, 0
        for i, b in enumerate(self._live):
            size += b.numel()
            if size >= group_bytes:
                groups.append(range(start, i + 1))
                start, size = i + 1, 0
        if start < len(self._live):
            groups.append(range(start, len(self._live)))
        return groups

    def _check_unmoved(self) -> None:
        moved = [n for n, p, ptr in zip(self.names, self._params, self._ptrs) if data_ptr(p) != ptr]
        if moved:
            raise RuntimeError(f"parameters {moved[:5]} were re-allocated since the swap was built; build a new ReferenceSwap")

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the reference weights into the live parameters (the live weights wait in host scratch)."""
        if self.swapped:
            raise RuntimeError("the reference weights are already in place; swap_out() first")
        self._check_unmoved()
        cuda = self._cuda
        if cuda is None:
            for live, scratch, ref in zip(self._live, self._scratch, self._ref):
                scratch.copy_(live)
                live.copy_(ref)
        else:
            current = torch.cuda.current_stream(self.device)
            cuda.d2h.wait_stream(current)
            cuda.h2d.wait_stream(current)
            for group, done in zip(self._groups, cuda.group_done):
                with torch.cuda.stream(cuda.d2h):
                    for i in group:
                        self._scratch[i].copy_(self._live[i], non_blocking=True)
                    done.record(cuda.d2h)
                cuda.h2d.wait_event(done)
                with torch.cuda.stream(cuda.h2d):
                    for i in group:
                        self._live[i].copy_(self._ref[i], non_blocking=True)
            cuda.done.record(cuda.h2d)
            current.wait_event(cuda.done)
        self.swapped = True

    @torch.no_grad()
    def swap_out(self) -> None:
        """Put the live weights back, bit-exact."""
        if not self.swapped:
            raise RuntimeError("the reference weights are not in place; swap_in() first")
        self._check_unmoved()
        cuda = self._cuda
        if cuda is not None:
            cuda.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with on_stream(cuda.h2d if cuda is not None else None):
            for live, scratch in zip(self._live, self._scratch):
                live.copy_(scratch, non_blocking=cuda is not None)
            if cuda is not None:
                cuda.done.record(cuda.h2d)
        if cuda is not None:
            torch.cuda.current_stream(self.device).wait_event(cuda.done)
        self.swapped = False

    def wait(self) -> None:
        """Block the host until the last swap's copies are done (the current stream already waits)."""
        if self._cuda is not None:
            self._cuda.done.synchronize()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """``with swap.reference(): logprobs = policy(batch)`` runs on the reference weights."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    def close(self) -> None:
        if self.swapped:
            self.swap_out()
            self.wait()
        self.arena.close()


@dataclass
class _Streams:
    """The swap's copy streams and events on a CUDA device: host-bound (d2h) and device-bound (h2d)."""

    d2h: torch.cuda.Stream
    h2d: torch.cuda.Stream
    group_done: list[torch.cuda.Event]
    done: torch.cuda.Event

    @classmethod
    def on(cls, device: torch.device, groups: int) -> _Streams:
        return cls(
            torch.cuda.Stream(device), torch.cuda.Stream(device), [torch.cuda.Event() for _ in range(groups)], torch.cuda.Event()
        )
