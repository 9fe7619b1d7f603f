"""The one place that maps a buffer kind to its class: create on the trainer, open on the engine.

Kept apart from ``buffers.py`` (the interface) so each kind imports the interface and the
interface imports no kind.
"""

from __future__ import annotations

from typing import Any

import torch

from mxrefit.transport.broadcast import decline_broadcast, open_broadcast
from mxrefit.transport.buffers import OpenedBuffers, TransferBuffers
from mxrefit.transport.cuda_ipc import CudaIpcBuffers, open_cuda_ipc
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, MAX_BUFFERS, check_int
from mxrefit.transport.shm import ShmBuffers, open_shm

KINDS = ("shm", "cuda_ipc")
PEER_KINDS = (*KINDS, "broadcast")


def default_kind(device: torch.device | str) -> str:
    """``"cuda_ipc"`` for a CUDA device, else ``"shm"``."""
    return "cuda_ipc" if torch.device(device).type == "cuda" else "shm"


def create_buffers(kind: str, count: int, nbytes: int, device: torch.device | str = "cpu") -> TransferBuffers:
    """Allocate ``count`` buffers of ``nbytes`` once, for the whole session."""
    check_int(count, "count", 1, MAX_BUFFERS)
    check_int(nbytes, "nbytes", 1, MAX_BUFFER_BYTES)
    if kind == "shm":
        if torch.device(device).type != "cpu":
            raise ValueError(f"shm buffers live in host memory; got device {device!r} (use kind 'cuda_ipc')")
        return ShmBuffers(count, nbytes)
    if kind == "cuda_ipc":
        return CudaIpcBuffers(count, nbytes, device)
    raise ValueError(f"unknown transfer buffer kind {kind!r}; expected one of {KINDS}")


def open_buffers(
    desc: dict[str, Any], device: torch.device | str | None = None, *, max_wait_s: float | None = None
) -> OpenedBuffers:
    """Open buffers from an owner's ``describe()``; ValueError if the description is malformed.

    ``max_wait_s``: the opener's own bound on any wait the description asks for (a broadcast
    rendezvous), so a peer's message cannot keep the opener busy longer than it allows.
    """
    if not isinstance(desc, dict):
        raise ValueError(f"a buffer description must be a dict, got {type(desc).__name__}")
    kind = desc.get("kind")
    if kind == "shm":
        return open_shm(desc, device)
    if kind == "cuda_ipc":
        return open_cuda_ipc(desc, device)
    if kind == "broadcast":
        return open_broadcast(desc, device, max_wait_s=max_wait_s)
    raise ValueError(f"unknown transfer buffer kind {kind!r:.100}; expected one of {PEER_KINDS}")


def decline_buffers(desc: Any, why: str) -> None:
    """The peer will not open these buffers (it refused the plan): tell an owner that waits for it."""
    if isinstance(desc, dict) and desc.get("kind") == "broadcast":
        decline_broadcast(desc, why)
