"""CUDA IPC transfer buffers: device memory of the trainer mapped into the engine on the same GPU.

Built on the same primitives torch.multiprocessing uses for CUDA tensors, called once per buffer
for the whole session instead of once per tensor per step:

* owner: ``storage._share_cuda_()`` returns ``(device, handle, size, offset, ref_counter_handle,
  ref_counter_offset, event_handle, event_sync_required)``. ``handle`` names the whole cudaMalloc
  block and ``offset`` our storage within it. The call also puts the storage behind a
  cross-process reference count, so when the owner frees it while a peer still maps it, torch
  parks the block ("limbo") until the peer lets go; ``torch.cuda.ipc_collect()`` reclaims it.
* peer: ``UntypedStorage._new_shared_cuda(*fields)`` opens the handle (waiting on the owner's event
  when asked) and decrements the reference count when the storage dies.

One export carries one reference, so ``describe()`` exports afresh on every call: give each
opening process its own description (the engine opens once per session). An export that is never
opened keeps its block parked until the owner exits.

Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, common in trainers to
fight fragmentation) map memory with cuMemCreate/cuMemMap, which the legacy CUDA IPC handle
cannot name; torch's own export of such memory needs driver-specific file-descriptor passing
that fails in many containers. The buffers are therefore allocated with expandable segments
switched off for the moment of allocation, which the caching allocator supports for exactly this
reason (``get_free_block`` in c10/cuda/CUDACachingAllocator.cpp skips expandable blocks "since we
cannot share expandable memory via IPC, someone might temporarily disable it") and which makes it
``cudaMalloc`` fresh segments; the process's setting is restored right after. Everything else the
trainer allocates keeps expandable segments.

Nothing touches CUDA at import time, so this module imports fine on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from mxrefit.devices import resolve
from mxrefit.transport.buffers import OpenedBuffers, TransferBuffers
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, check_int, check_keys, check_list

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_FIELD_NAMES = (
    "device",
    "handle",
    "size",
    "offset",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_FIELD_TYPES: tuple[tuple[type, ...], ...] = ((int,), (bytes,), (int,), (int,), (bytes,), (int,), (bytes, type(None)), (bool,))
_MAX_HANDLE_BYTES = 4096
_OWNED_HERE: dict[str, list[weakref.ref[torch.UntypedStorage]]] = {}  # this process's exports, by owner id
_OPEN_HERE: set[tuple[bytes, int]] = set()


def _enables_expandable(settings: str) -> bool:
    """Whether an allocator settings string (``key:value,...``) turns expandable segments on."""
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() == "true":
            return True
    return False


def expandable_segments_setting(environ: dict[str, str] | None = None) -> str | None:
    """``"VAR=value"`` if an allocator environment variable turns on expandable segments, else None."""
    env = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        if _enables_expandable(env.get(var, "")):
            return f"{var}={env[var]}"
    return None


def allocator_settings() -> str:
    """The caching allocator's settings as last set (at run time, else from the environment)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = get() if get is not None else ""
    # some torch builds report nothing until CUDA starts although the environment already set it
    return settings or ",".join(v for v in (os.environ.get(var, "") for var in ALLOC_CONF_VARS) if v)


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch releases before the accelerator-generic setter
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


@contextlib.contextmanager
def ipc_shareable_allocations() -> Iterator[None]:
    """Inside, the caching allocator hands out cudaMalloc memory (CUDA IPC can export it), whatever the
    process's expandable_segments setting; the setting is restored on the way out (see the module docstring)."""
    before = allocator_settings()
    if not _enables_expandable(before):
        yield
        return
    items = [i for i in before.split(",") if i.partition(":")[0].strip() not in ("", "expandable_segments")]
    _set_allocator_settings(",".join([*items, "expandable_segments:False"]))
    try:
        yield
    finally:
        _set_allocator_settings(before)


def _cuda_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"cuda_ipc buffers need a CUDA device, got {device!r} (use kind 'shm')")
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_ipc buffers need CUDA, but torch.cuda.is_available() is False here")
    return resolve(dev)


def own_here(owner_id: str, storages: list[torch.UntypedStorage]) -> None:
    """Record this process's export ``owner_id`` (its storages, held weakly: torch keeps a
    storage's Python object as long as the storage lives)."""
    for key in [k for k, refs in _OWNED_HERE.items() if any(r() is None for r in refs)]:
        del _OWNED_HERE[key]
    _OWNED_HERE[owner_id] = [weakref.ref(s) for s in storages]


def views_here(owner_id: str, sizes: list[int], device: torch.device | str | None) -> list[torch.Tensor]:
    """This process's own exported storages, as flat uint8 tensors of ``sizes`` bytes.

    Why: CUDA refuses to open an IPC handle in the process that made it, and a colocated trainer
    and engine (TRL's colocate mode: vLLM's worker runs in the trainer's process) share one
    process, where the exporter's tensors themselves are the way in.
    """
    views = []
    for ref, size in zip(_OWNED_HERE[owner_id], sizes):
        storage = ref()
        if storage is None:
            raise RuntimeError("the exported CUDA memory was freed in this process before it was opened")
        if device is not None and _cuda_device(device) != storage.device:
            raise ValueError(f"the exported memory lives on {storage.device}, not on {device}")
        if storage.nbytes() < size:
            raise ValueError(f"an exported storage has {storage.nbytes()} bytes, fewer than the {size} described")
        views.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (size,), (1,)))
    return views


def _device_uuid(index: int) -> str:
    """The GPU's UUID: device indices differ between processes with different CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _export(tensor: torch.Tensor) -> list[Any]:
    """The IPC fields of one buffer's storage, as a msgpack-able list."""
    fields = list(tensor.untyped_storage()._share_cuda_())
    _check_fields(fields, tensor.numel())
    return fields


def _check_fields(fields: Any, nbytes: int) -> None:
    if not isinstance(fields, list) or len(fields) != len(_FIELD_NAMES):
        raise ValueError(f"a CUDA IPC export must be a list of {len(_FIELD_NAMES)} fields {_FIELD_NAMES}")
    for name, kinds, value in zip(_FIELD_NAMES, _FIELD_TYPES, fields):
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            wanted = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"CUDA IPC field {name!r} must be {wanted}, got {value!r:.100}")
        if isinstance(value, bytes) and not 0 < len(value) <= _MAX_HANDLE_BYTES:
            raise ValueError(f"CUDA IPC field {name!r} has a bad length {len(value)}")
    check_int(fields[0], "device", 0, 1 << 16)
    check_int(fields[2], "size", nbytes, MAX_BUFFER_BYTES)
    check_int(fields[3], "offset", 0, MAX_BUFFER_BYTES)
    check_int(fields[5], "ref_counter_offset", 0, 1 << 40)


class CudaIpcBuffers(TransferBuffers):
    """Owner of ``count`` device buffers exported over CUDA IPC."""

    kind = "cuda_ipc"

    def __init__(self, count: int, nbytes: int, device: torch.device | str) -> None:
        self.device = _cuda_device(device)
        self.nbytes = nbytes
        with ipc_shareable_allocations():
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self._uuid = _device_uuid(self.device.index)
        self._owner_id = secrets.token_hex(16)
        own_here(self._owner_id, [b.untyped_storage() for b in self.buffers])

    def describe(self) -> dict[str, Any]:
        """A fresh export for one opening process (see the module docstring)."""
        if not self.buffers:
            raise RuntimeError("these CUDA IPC buffers are closed")
        with torch.cuda.device(self.device):
            exports = [_export(t) for t in self.buffers]
        return {
            "kind": self.kind,
            "nbytes": self.nbytes,
            "device_uuid": self._uuid,
            "owner_id": self._owner_id,
            "exports": exports,
        }

    def close(self) -> None:
        """Drop our tensors and reclaim blocks no peer maps any more."""
        self.buffers = []
        _OWNED_HERE.pop(self._owner_id, None)
        torch.cuda.ipc_collect()


def _local_index(uuid: str, device: torch.device | str | None) -> int:
    """This process's index of the GPU holding the buffers (found by UUID unless ``device`` is given)."""
    if device is not None:
        index = _cuda_device(device).index
        if _device_uuid(index) != uuid:
            raise ValueError(f"cuda:{index} here is GPU {_device_uuid(index)}, but the buffers live on GPU {uuid}")
        return index
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"GPU {uuid} holding the transfer buffers is not visible in this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
    )


def _rebuild(fields: list[Any], index: int, nbytes: int) -> torch.Tensor:
    """Open one export and view it as a flat uint8 tensor of ``nbytes``."""
    _owner_device, *rest = fields
    storage = torch.UntypedStorage._new_shared_cuda(index, *rest)
    empty = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    return empty.set_(storage, 0, (nbytes,), (1,))


def _ref_counter_key(fields: list[Any]) -> tuple[bytes, int]:
    return fields[4], fields[5]


class CudaIpcOpened(OpenedBuffers):
    """The owner's device buffers mapped into this process."""

    kind = "cuda_ipc"

    def __init__(self, exports: list[list[Any]], nbytes: int, index: int) -> None:
        keys = {_ref_counter_key(fields) for fields in exports}
        if len(keys) != len(exports) or keys & _OPEN_HERE:
            raise RuntimeError("this CUDA IPC description was already opened: each describe() serves one open")
        self.nbytes = nbytes
        self.device = torch.device("cuda", index)
        torch.cuda.init()
        with torch.cuda.device(index):
            self.buffers = [_rebuild(fields, index, nbytes) for fields in exports]
        self._keys = keys
        _OPEN_HERE.update(keys)

    def close(self) -> None:
        """Drop our mappings; torch then releases the owner's reference counts."""
        self.buffers = []
        _OPEN_HERE.difference_update(self._keys)
        self._keys = set()


class SameProcessOpened(OpenedBuffers):
    """Buffers this process exported itself, opened by this process (see ``views_here``)."""

    kind = "cuda_ipc"

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.nbytes = buffers[0].numel() if buffers else 0
        self.device = buffers[0].device if buffers else torch.device("cuda")

    def close(self) -> None:
        """Drop the views; the owner keeps its buffers."""
        self.buffers = []


def _check_desc(desc: dict[str, Any]) -> tuple[list[list[Any]], int, str, str]:
    check_keys(desc, {"kind", "nbytes", "device_uuid", "owner_id", "exports"})
    nbytes = check_int(desc["nbytes"], "nbytes", 1, MAX_BUFFER_BYTES)
    exports = check_list(desc["exports"], "exports")
    for fields in exports:
        _check_fields(fields, nbytes)
    uuid, owner_id = desc["device_uuid"], desc["owner_id"]
    if not isinstance(uuid, str) or not 0 < len(uuid) <= 100:
        raise ValueError(f"bad device_uuid {uuid!r:.100}")
    if not isinstance(owner_id, str) or not 0 < len(owner_id) <= 100:
        raise ValueError(f"bad owner_id {owner_id!r:.100}")
    return exports, nbytes, uuid, owner_id


def open_cuda_ipc(desc: dict[str, Any], device: torch.device | str | None = None) -> OpenedBuffers:
    """Validate a ``cuda_ipc`` description and open its buffers (not in the owner's own process)."""
    exports, nbytes, uuid, owner_id = _check_desc(desc)
    if owner_id in _OWNED_HERE:
        return SameProcessOpened(views_here(owner_id, [nbytes] * len(exports), device))
    if not torch.cuda.is_available():
        raise RuntimeError("opening cuda_ipc buffers needs CUDA, but torch.cuda.is_available() is False here")
    return CudaIpcOpened(exports, nbytes, _local_index(uuid, device))
