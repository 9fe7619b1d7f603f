"""Engine memory that the trainer writes into directly: the "direct" transport.

Why: in a colocated refit the fastest path has no transfer buffer at all. The trainer's
quantize kernel writes every part straight into the engine's parameter (or staging) bytes,
so a refit moves each byte once (read BF16 on the trainer, write the engine's format), the
engine copies nothing, and neither side holds a bucket buffer. The engine exports the
storage behind its destination tensors once per plan; the trainer opens the export once.

Two kinds, chosen by where the engine's tensors live:
- ``cuda_ipc``: CUDA IPC of each distinct storage (``mxrefit.transport.cuda_ipc`` does the
  handle work). Memory must come from ``cudaMalloc`` (the caching allocator without
  expandable segments), which ``allocate`` guarantees for memory mxrefit allocates itself,
  also in a process running expandable segments (``cuda_ipc.ipc_shareable_allocations``).
- ``shm``: host tensors inside a shared-memory segment made by ``allocate`` (POSIX shm), so
  CPU engines and the tests run the same path.

Who writes when is the control protocol's job, as for buffers. ``DirectSend`` and ``DirectLand``
are the transport's two sides (``mxrefit.transport.base``): the engine exports the storage refits
land in with its ``planned`` answer, the trainer opens it once per plan and its encoders write there.

The opener (the trainer) writes into memory the engine names, so it trusts a named shm segment
only if its own user owns it (the engine then runs as this user: a segment of another user, or
the engine's of another uid, is refused) and it is as large as described; ``OpenedExports.verify``
re-checks before each refit that no segment shrank (a write past a shrunk segment's end is a
SIGBUS). A process of the trainer's own user could also ptrace or kill it, so that is the bound.
"""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from mxrefit.plan.build import Bucket, Part, RefitPlan, Run
from mxrefit.transport.base import LandInit, LandPath, SendInit, SendPath
from mxrefit.transport.cuda_ipc import (
    _OWNED_HERE,
    _check_fields,
    _device_uuid,
    _local_index,
    _rebuild,
    ipc_shareable_allocations,
    own_here,
    views_here,
)
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, MAX_BUFFERS, Malformed, check_int, check_keys, check_list
from mxrefit.transport.shm import _NAME, ShmBuffers, _map_segment, _tensor_over

_MAX_TENSORS = 1 << 20
_SHM_ARENAS: dict[int, tuple[str, int]] = {}  # base address -> (segment name, nbytes), live arenas of this process


def allocate(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` that ``export_tensors`` can export.

    CUDA: plain cudaMalloc'd device memory, also when the process runs expandable segments
    (whose memory CUDA IPC cannot export). Host: a shared-memory segment, unlinked when the
    tensor is freed.
    """
    device = torch.device(device)
    check_int(nbytes, "nbytes", 1, MAX_BUFFER_BYTES)
    if device.type == "cuda":
        with ipc_shareable_allocations():
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type != "cpu":
        raise ValueError(f"exportable memory lives on CUDA or in host shared memory, not on {device}")
    owner = ShmBuffers(1, nbytes)
    tensor = owner.buffers[0]
    name = owner.describe()["names"][0]
    base = tensor.data_ptr()
    _SHM_ARENAS[base] = (name, nbytes)
    weakref.finalize(tensor, _release_arena, base, owner)
    return tensor


def _release_arena(base: int, owner: Any) -> None:
    _SHM_ARENAS.pop(base, None)
    owner.close()


def _locate_shm(t: torch.Tensor) -> tuple[str, int, int]:
    """(segment name, byte offset, segment size) of a host tensor inside an arena of ``allocate``."""
    ptr = t.data_ptr()
    for base, (name, size) in _SHM_ARENAS.items():
        if base <= ptr and ptr + t.numel() * t.element_size() <= base + size:
            return name, ptr - base, size
    raise LookupError


def exportable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """True if ``export_tensors`` can export every tensor (all CUDA, or all in shm arenas)."""
    try:
        _plan_export(tensors)
    except ValueError:
        return False
    return True


def _plan_export(tensors: Mapping[str, torch.Tensor]) -> str:
    kinds = set()
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; only contiguous storage can be exported")
        if t.is_cuda:
            kinds.add("cuda_ipc")
        elif t.device.type == "cpu":
            try:
                _locate_shm(t)
            except LookupError:
                raise ValueError(
                    f"tensor {name!r} is in private host memory; the direct transport needs engine storage "
                    f"made by mxrefit.transport.direct.allocate"
                ) from None
            kinds.add("shm")
        else:
            raise ValueError(f"tensor {name!r} is on {t.device}, which cannot be exported")
    if len(kinds) > 1:
        raise ValueError(f"cannot export a mix of {sorted(kinds)} memory in one description")
    return kinds.pop() if kinds else "shm"


def export_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Plain data (msgpack-able) that lets ONE peer process open views of these tensors.

    Distinct storages are exported once; each tensor is (storage index, byte offset, nbytes).
    """
    kind = _plan_export(tensors)
    storages: list[Any] = []
    index: dict[Any, int] = {}
    rows: list[list[Any]] = []
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if kind == "cuda_ipc":
            storage = t.untyped_storage()
            key: Any = storage.data_ptr()
            offset = t.storage_offset() * t.element_size()
            if key not in index:
                index[key] = len(storages)
                storages.append(storage)
        else:
            seg, offset, size = _locate_shm(t)
            key = seg
            if key not in index:
                index[key] = len(storages)
                storages.append((seg, size))
        rows.append([name, index[key], offset, nbytes])
    if kind == "shm":
        return {"kind": "shm", "segments": [[n, s] for n, s in storages], "tensors": rows}
    return {"kind": "cuda_ipc", **_describe_cuda(storages), "tensors": rows}


def _describe_cuda(storages: list[torch.UntypedStorage]) -> dict[str, Any]:
    if not storages:
        return {"device_uuid": "", "owner_id": "", "exports": []}
    device = storages[0].device
    owner_id = secrets.token_hex(16)
    own_here(owner_id, storages)
    exports = []
    with torch.cuda.device(device):
        for s in storages:
            fields = list(s._share_cuda_())
            _check_fields(fields, s.nbytes())
            exports.append(fields)
    return {"device_uuid": _device_uuid(device.index), "owner_id": owner_id, "exports": exports}


class OpenedExports:
    """The peer's view of exported tensors: ``tensors[name]`` is a flat uint8 tensor."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], keepalive: list[Any], segments: list[tuple[str, int, int]] | None = None
    ):
        self.tensors = tensors
        self._keepalive = keepalive
        self._segments = segments or []  # shm: (name, inode, bytes this side writes into)

    def verify(self) -> None:
        """ValueError unless every shm segment is still the one opened, owned by this user and large enough."""
        for name, inode, size in self._segments:
            _checked_segment_stat(name, size, inode)

    def close(self) -> None:
        """Drop this process's views; the owner's memory is never freed from here."""
        self.tensors = {}
        self._keepalive = []


def _check_rows(rows: Any, sizes: list[int]) -> list[tuple[str, int, int, int]]:
    if not isinstance(rows, list):
        raise ValueError(f"exported tensors must be a list, got {type(rows).__name__}")
    if len(rows) > _MAX_TENSORS:
        raise ValueError(f"an export of {len(rows)} tensors is over the {_MAX_TENSORS} limit")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str):
            raise ValueError(f"bad exported tensor row {row!r:.100}")
        name = row[0]
        idx = check_int(row[1], f"{name}: storage index", 0, len(sizes) - 1)
        off = check_int(row[2], f"{name}: offset", 0, MAX_BUFFER_BYTES)
        n = check_int(row[3], f"{name}: nbytes", 0, MAX_BUFFER_BYTES)
        if off + n > sizes[idx]:
            raise ValueError(f"exported tensor {name!r} bytes [{off}, {off + n}) run past its storage ({sizes[idx]} bytes)")
        out.append((name, idx, off, n))
    return out


def open_exports(desc: dict[str, Any], device: torch.device | str | None = None) -> OpenedExports:
    """Open an ``export_tensors`` description; ValueError if it is malformed."""
    if not isinstance(desc, dict):
        raise ValueError(f"an export description must be a dict, got {type(desc).__name__}")
    kind = desc.get("kind")
    if kind == "shm":
        return _open_shm(desc, device)
    if kind == "cuda_ipc":
        return _open_cuda(desc, device)
    raise ValueError(f"unknown export kind {kind!r:.100}; expected 'shm' or 'cuda_ipc'")


def _open_shm(desc: dict[str, Any], device: torch.device | str | None) -> OpenedExports:
    check_keys(desc, {"kind", "segments", "tensors"})
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"shm exports live in host memory; cannot open them on {device!r}")
    segments = check_list(desc["segments"], "segments")
    bases, sizes = [], []
    for seg in segments:
        if not (isinstance(seg, list) and len(seg) == 2 and isinstance(seg[0], str) and _NAME.fullmatch(seg[0])):
            raise ValueError(f"bad shared memory segment {seg!r:.100}")
        sizes.append(check_int(seg[1], "segment size", 1, MAX_BUFFER_BYTES))
    rows = _check_rows(desc["tensors"], sizes)
    checked = []
    for (name, _), size in zip(segments, sizes):
        inode = _checked_segment_stat(name, size)
        bases.append(_tensor_over(_map_segment(name), size, name))
        checked.append((name, inode, size))
    tensors = {name: bases[i][off : off + n] for name, i, off, n in rows}
    return OpenedExports(tensors, bases, checked)


def _checked_segment_stat(name: str, size: int, inode: int | None = None) -> int:
    """The inode of shm segment ``name`` after checking it may be written: owned by this user, at
    least ``size`` bytes (and, given ``inode``, still that segment). ValueError otherwise."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError as err:
        raise ValueError(f"exported shared memory segment {name!r} cannot be opened: {err}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"exported shared memory segment {name!r} belongs to uid {st.st_uid}, not to this user "
            f"({os.geteuid()}): direct writes go only into this user's segments; use buffers"
        )
    if st.st_size < size:
        raise ValueError(f"exported shared memory segment {name!r} has {st.st_size} bytes, fewer than the {size} described")
    if inode is not None and st.st_ino != inode:
        raise ValueError(f"exported shared memory segment {name!r} was replaced since it was opened")
    return st.st_ino


def _open_cuda(desc: dict[str, Any], device: torch.device | str | None) -> OpenedExports:
    check_keys(desc, {"kind", "device_uuid", "owner_id", "exports", "tensors"})
    exports = desc["exports"]
    if not isinstance(exports, list) or len(exports) > MAX_BUFFERS * 64:
        raise ValueError("bad CUDA IPC export list")
    sizes = []
    for fields in exports:
        _check_fields(fields, 1)
        sizes.append(fields[2])  # the storage's own bytes (fields[3] is its offset in the cudaMalloc block)
    rows = _check_rows(desc["tensors"], sizes) if exports else []
    if not exports:
        return OpenedExports({}, [])
    if desc["owner_id"] in _OWNED_HERE:  # a colocated trainer and engine: the exporter's own tensors
        bases = views_here(desc["owner_id"], sizes, device)
        return OpenedExports({name: bases[i][off : off + n] for name, i, off, n in rows}, bases)
    if not torch.cuda.is_available():
        raise RuntimeError("opening cuda_ipc exports needs CUDA, but torch.cuda.is_available() is False here")
    index = _local_index(desc["device_uuid"], device)
    torch.cuda.init()
    with torch.cuda.device(index):
        bases = [_rebuild(fields, index, size) for fields, size in zip(exports, sizes)]
    tensors = {name: bases[i][off : off + n] for name, i, off, n in rows}
    return OpenedExports(tensors, bases)


class DirectSend(SendPath):
    """Trainer side: the encoders write into the storage the engine exported with its ``planned`` answer."""

    name = "direct"

    def __init__(self, init: SendInit) -> None:
        self.device = init.device
        self.exports: OpenedExports | None = None

    @classmethod
    def unfit(cls, init: SendInit) -> str | None:
        engine = init.engine
        if engine.exportable and engine.device == init.device.type:
            return None
        return (
            f"transport 'direct' needs an engine that exports its storage on this device type "
            f"({init.device.type}); the engine at {init.address} is on {engine.device} "
            f"and {'can' if engine.exportable else 'cannot'} export"
        )

    def prepare(self, plan: RefitPlan) -> None:
        self.close()  # the engine exports afresh at every plan

    def plan_fields(self) -> dict[str, Any]:
        return {"transport": DirectLand.wire}

    def adopt(self, reply: dict[str, Any]) -> None:
        if not isinstance(reply.get("exports"), dict):
            raise Malformed("planned direct writes without exporting its storage")
        self.exports = open_exports(reply["exports"], self.device if self.device.type == "cuda" else None)

    def _opened(self) -> OpenedExports:
        if self.exports is None:
            raise RuntimeError("the direct transport is not wired: plan first")
        return self.exports

    def part_view(self, bucket: Bucket, part: Part) -> torch.Tensor:
        t = part.target
        return self._opened().tensors[t.param][t.offset : t.offset + t.nbytes]

    def run_view(self, bucket: Bucket, run: Run) -> torch.Tensor:
        return self._opened().tensors[run.param][run.param_offset : run.param_offset + run.nbytes]

    def check(self) -> None:
        self._opened().verify()

    def close(self) -> None:
        if self.exports is not None:
            self.exports.close()
            self.exports = None


class DirectLand(LandPath):
    """Engine side: export the storage refits land in; the trainer's writes land there, nothing to copy."""

    wire = "direct"

    @classmethod
    def refusal(cls, init: LandInit) -> str | None:
        if not init.exportable:
            return f"this engine ({init.engine}) cannot export its storage; use buffers"
        if init.sharded:
            return (
                "this engine rank holds slices of some parameters; direct writes place whole tensors, so use buffers or broadcast"
            )
        return None

    @classmethod
    def open(cls, msg: dict[str, Any], plan: RefitPlan, init: LandInit) -> DirectLand:
        return cls()

    def arrival(self, bucket: Bucket) -> None:
        return None

    def planned(self, landing: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"exports": export_tensors(landing)}

    def close(self) -> None:
        pass
