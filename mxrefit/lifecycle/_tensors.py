"""Small tensor helpers shared by the offloader and the reference swap."""

from __future__ import annotations

import contextlib

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this process holds: a DTensor's local shard, else ``t`` detached."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor.detach()
    return t.detach()


def local_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage of ``local(t)``, without building a tensor (called per state tensor per offload)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor.untyped_storage()
    return t.untyped_storage()


def data_ptr(t: torch.Tensor) -> int:
    """Address of the local memory, without building a tensor (cheap enough to check per swap)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor.data_ptr()
    return t.data_ptr()


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """All bytes of ``storage`` as a flat uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's own bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def on_stream(stream: "torch.cuda.Stream | None"):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
