"""Host memory for state moved off the GPU: one allocation, made once, page-locked when CUDA is there.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every request
up to a power of two before it calls ``cudaHostAlloc``, so 20 GiB of optimizer state would lock
32 GiB of host memory. An arena instead takes exactly the bytes it needs (page aligned) from the
ordinary CPU allocator and page-locks them with ``cudaHostRegister``, as torch's own checkpoint
stager does; the lock is dropped when the arena is closed or collected.

Without CUDA nothing can be pinned: the arena is plain host memory and every caller runs the same
code, so CPU tests walk every path except the page-locking itself.

Before allocating, the arena checks ``MemAvailable`` (what the kernel can hand out without
swapping) and raises ``HostMemoryError`` naming what it needs and what there is, instead of
letting the process be OOM-killed halfway through an offload.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from mxrefit.devices import ALIGN
from mxrefit.errors import MxrefitError

PAGE = 4096
DEFAULT_HEADROOM_BYTES = 1 << 30


class HostMemoryError(MxrefitError, MemoryError):
    """Not enough host memory for an arena; says how much is needed and how much is available."""


def host_available_bytes() -> int:
    """Bytes the kernel can give this process without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def aligned_layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets that start every piece on an ``align`` boundary, and the total bytes."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, -(-end // align) * align


def _cuda_pinning() -> bool:
    return torch.cuda.is_available()


def _unregister(ptr: int, base: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc != 0:  # nothing sensible to do at collection time but say so
        import warnings

        warnings.warn(f"cudaHostUnregister failed with CUDA error {rc}; {gib(base.numel())} stay page-locked")


class PinnedArena:
    """``nbytes`` of host memory allocated once; callers carve it into views with ``view``."""

    def __init__(
        self,
        nbytes: int,
        *,
        what: str = "arena",
        pin: bool | None = None,
        available: Callable[[], int] = host_available_bytes,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    ):
        self.nbytes = int(nbytes)
        self.what = what
        have = int(available())
        if self.nbytes + headroom_bytes > have:
            raise HostMemoryError(
                f"{what} needs {gib(self.nbytes)} of host memory (plus {gib(headroom_bytes)} headroom) but only "
                f"{gib(have)} is available; free host memory, offload less, or lower the headroom"
            )
        self.pinned = _cuda_pinning() if pin is None else pin
        base = torch.empty(self.nbytes + PAGE, dtype=torch.uint8)
        shift = (-base.data_ptr()) % PAGE
        self.data = base[shift : shift + self.nbytes]
        self._finalizer = None
        if self.pinned and self.nbytes:
            ptr = self.data.data_ptr()
            rc = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0))
            if rc != 0:
                raise HostMemoryError(f"{what}: page-locking {gib(self.nbytes)} of host memory failed (CUDA error {rc})")
            self._finalizer = weakref.finalize(self, _unregister, ptr, base)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` as a flat uint8 tensor (no copy)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"{self.what}: bytes [{offset}, {offset + nbytes}) outside its {self.nbytes} bytes")
        return self.data[offset : offset + nbytes]

    def close(self) -> None:
        """Drop the page lock now rather than at garbage collection (views stay valid, unpinned)."""
        if self._finalizer is not None:
            self._finalizer()
        self.data = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0
