"""Persistent transfer buffers: the trainer allocates them once, the engine opens them once.

Why: re-allocating buffers and re-opening IPC handles every refit step is pure overhead and a
known source of leaked memory. The owner (trainer) creates ``count`` flat uint8 buffers of
``nbytes`` each and sends ``describe()`` (plain msgpack-able data) over the control channel; the
peer (engine) calls ``open_buffers`` on it and keeps the result for the whole session.

The kinds are made and opened by ``mxrefit.transport.factory``. Kinds: ``"shm"`` (POSIX shared memory, CPU) and ``"cuda_ipc"`` (CUDA IPC of device memory) share
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
