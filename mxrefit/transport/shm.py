"""POSIX shared-memory transfer buffers (host memory, any two processes of one machine).

Two lifetime rules shape this module:

* Each tensor owns its own ``mmap`` of the segment, so the mapping lives exactly as long as some
  tensor (or view of it) does. ``torch.frombuffer`` keeps the buffer object alive but does not
  hold a buffer export, so the stdlib's ``SharedMemory.close()`` (also run by its ``__del__``)
  would unmap memory under live tensors and a later access would crash the process. We therefore
  use ``SharedMemory`` only to create, name and unlink segments, and never map through it.
* Only the owner registers segments with multiprocessing's resource tracker, so a crashed owner's
  segments are unlinked by its tracker. The opener maps the segment without touching any tracker:
  registering would make an unrelated engine's tracker unlink the owner's segment when the engine
  exits, and "register then unregister" is wrong when the opener shares the owner's tracker (a
  child started by multiprocessing does): the tracker keeps a set of names, so the opener's
  unregister would erase the owner's own registration and a crashed owner would leak.
"""

from __future__ import annotations

import mmap
import os
import re
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from mxrefit.transport.buffers import OpenedBuffers, TransferBuffers
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, check_int, check_keys, check_list

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def _map_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write without registering it anywhere."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared memory segment {name!r} does not exist: its owner closed it or exited") from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _tensor_over(segment: mmap.mmap, nbytes: int, name: str) -> torch.Tensor:
    """A uint8 tensor on the first ``nbytes`` of the mapping; the tensor keeps the mapping alive."""
    if len(segment) < nbytes:
        size = len(segment)
        segment.close()
        raise ValueError(f"shared memory segment {name!r} has {size} bytes, fewer than the {nbytes} described")
    return torch.frombuffer(segment, dtype=torch.uint8, count=nbytes)


class ShmBuffers(TransferBuffers):
    """Owner of ``count`` shared-memory segments; close() unlinks them."""

    kind = "shm"

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffers = []
        self._segments: list[SharedMemory] = []
        try:
            for _ in range(count):
                self._add_segment()
        except BaseException:
            self.close()
            raise

    def _add_segment(self) -> None:
        segment = SharedMemory(create=True, size=self.nbytes)
        self._segments.append(segment)
        segment.close()
        self.buffers.append(_tensor_over(_map_segment(segment.name), self.nbytes, segment.name))

    def describe(self) -> dict[str, Any]:
        """Names and size; reusable by any number of openers."""
        return {"kind": self.kind, "nbytes": self.nbytes, "names": [s.name for s in self._segments]}

    def close(self) -> None:
        """Unlink the segments now; the memory goes away when the last tensor mapping it does."""
        self.buffers = []
        for segment in self._segments:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
        self._segments = []


class ShmOpened(OpenedBuffers):
    """The owner's segments mapped into this process."""

    kind = "shm"

    def __init__(self, names: list[str], nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffers = [_tensor_over(_map_segment(name), nbytes, name) for name in names]

    def close(self) -> None:
        """Drop our tensors (and so our mappings); the segments stay for their owner."""
        self.buffers = []


def _check_desc(desc: dict[str, Any]) -> tuple[list[str], int]:
    check_keys(desc, {"kind", "nbytes", "names"})
    nbytes = check_int(desc["nbytes"], "nbytes", 1, MAX_BUFFER_BYTES)
    names = check_list(desc["names"], "names")
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"bad shared memory segment name {name!r:.100}")
    if len(set(names)) != len(names):
        raise ValueError("shared memory segment names repeat")
    return names, nbytes


def open_shm(desc: dict[str, Any], device: torch.device | str | None = None) -> ShmOpened:
    """Validate an ``shm`` description and map its segments."""
    names, nbytes = _check_desc(desc)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"shm buffers live in host memory; cannot open them on {device!r}")
    return ShmOpened(names, nbytes)
