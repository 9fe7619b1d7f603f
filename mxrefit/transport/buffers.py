"""Persistent transfer buffers: the trainer allocates them once, the engine opens them once.

Why: re-allocating buffers and re-opening IPC handles every refit step is pure overhead and a
known source of leaked memory. The owner (trainer) creates ``count`` flat uint8 buffers of
``nbytes`` each and sends ``describe()`` (plain msgpack-able data) over the control channel; the
peer (engine) calls ``open_buffers`` on it and keeps the result for the whole session.

Kinds: ``"shm"`` (POSIX shared memory, CPU) and ``"cuda_ipc"`` (CUDA IPC of device memory) share
memory; ``"broadcast"`` (``mxrefit.transport.broadcast``) gives each side its own slots and moves
a bucket's bytes by a collective when the trainer ``publish``-es it and the engine ``fetch``-es it.
Those two hooks (and ``acquire``) do nothing for shared memory, so the refit loop is one code
path for every kind. The buffers give memory, not ordering: who writes when is the control
protocol's job.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from mxrefit.errors import MxrefitError

KINDS = ("shm", "cuda_ipc")
PEER_KINDS = (*KINDS, "broadcast")
MAX_BUFFERS = 1024
MAX_BUFFER_BYTES = 1 << 44


class TransportError(MxrefitError, RuntimeError):
    """The data path failed (a peer lost mid-transfer, a collective timed out): the refit
    cannot go on over it, and a new plan must wire a new one."""


class TransferBuffers(ABC):
    """Owner side. ``buffers`` are flat contiguous uint8 tensors of ``nbytes`` each."""

    buffers: list[torch.Tensor]
    nbytes: int
    kind: str

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Plain data (msgpack-able) that lets one peer process open these buffers."""

    @abstractmethod
    def close(self) -> None:
        """Release the buffers; tensors still referenced elsewhere stay valid until dropped."""

    def acquire(self, slot: int) -> None:
        """The trainer is about to write ``slot`` again: wait until nothing still reads it."""

    def publish(self, slot: int, nbytes: int) -> None:
        """The trainer wrote the first ``nbytes`` of ``slot``: start moving them to the peers."""

    def __enter__(self) -> TransferBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenedBuffers(ABC):
    """Peer side: the owner's buffers mapped into this process."""

    buffers: list[torch.Tensor]
    nbytes: int
    kind: str

    @abstractmethod
    def close(self) -> None:
        """Drop this process's mapping; never destroys the owner's buffers."""

    def fetch(self, slot: int, nbytes: int) -> None:
        """Before the engine reads ``slot``: make the owner's first ``nbytes`` of it present here."""

    def __enter__(self) -> OpenedBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_int(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high], else ValueError (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def check_keys(desc: dict[str, Any], expected: set[str]) -> None:
    """Exact key set, so a truncated or foreign description fails loudly instead of half-working."""
    missing = expected - desc.keys()
    extra = desc.keys() - expected
    if missing or extra:
        raise ValueError(
            f"bad {desc.get('kind')!r} buffer description: missing keys {sorted(missing)}, "
            f"unexpected keys {sorted(map(str, extra))}"
        )


def check_list(value: Any, name: str) -> list[Any]:
    """A non-empty list of at most MAX_BUFFERS entries."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BUFFERS:
        raise ValueError(f"{name} must be a list of 1..{MAX_BUFFERS} entries, got {value!r:.200}")
    return value


def default_kind(device: torch.device | str) -> str:
    """``"cuda_ipc"`` for a CUDA device, else ``"shm"``."""
    return "cuda_ipc" if torch.device(device).type == "cuda" else "shm"


def create_buffers(kind: str, count: int, nbytes: int, device: torch.device | str = "cpu") -> TransferBuffers:
    """Allocate ``count`` buffers of ``nbytes`` once, for the whole session."""
    check_int(count, "count", 1, MAX_BUFFERS)
    check_int(nbytes, "nbytes", 1, MAX_BUFFER_BYTES)
    if kind == "shm":
        from mxrefit.transport.shm import ShmBuffers

        if torch.device(device).type != "cpu":
            raise ValueError(f"shm buffers live in host memory; got device {device!r} (use kind 'cuda_ipc')")
        return ShmBuffers(count, nbytes)
    if kind == "cuda_ipc":
        from mxrefit.transport.cuda_ipc import CudaIpcBuffers

        return CudaIpcBuffers(count, nbytes, device)
    raise ValueError(f"unknown transfer buffer kind {kind!r}; expected one of {KINDS}")


def open_buffers(desc: dict[str, Any], device: torch.device | str | None = None, *,
                 max_wait_s: float | None = None) -> OpenedBuffers:
    """Open buffers from an owner's ``describe()``; ValueError if the description is malformed.

    ``max_wait_s``: the opener's own bound on any wait the description asks for (a broadcast
    rendezvous), so a peer's message cannot keep the opener busy longer than it allows.
    """
    if not isinstance(desc, dict):
        raise ValueError(f"a buffer description must be a dict, got {type(desc).__name__}")
    kind = desc.get("kind")
    if kind == "shm":
        from mxrefit.transport.shm import open_shm

        return open_shm(desc, device)
    if kind == "cuda_ipc":
        from mxrefit.transport.cuda_ipc import open_cuda_ipc

        return open_cuda_ipc(desc, device)
    if kind == "broadcast":
        from mxrefit.transport.broadcast import open_broadcast

        return open_broadcast(desc, device, max_wait_s=max_wait_s)
    raise ValueError(f"unknown transfer buffer kind {kind!r:.100}; expected one of {PEER_KINDS}")


def decline_buffers(desc: Any, why: str) -> None:
    """The peer will not open these buffers (it refused the plan): tell an owner that waits for it."""
    if isinstance(desc, dict) and desc.get("kind") == "broadcast":
        from mxrefit.transport.broadcast import decline_broadcast

        decline_broadcast(desc, why)
