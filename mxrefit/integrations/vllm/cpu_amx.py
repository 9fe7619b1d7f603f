"""AMX tile permission for vLLM's CPU build: why its workers die with SIGILL, and the remedy.

Linux (5.16 and later) keeps AMX tile data switched off in every process until the process asks
for it with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the first tile instruction of
a process that did not ask traps, and the process dies with SIGILL. vLLM's CPU build loads
``vllm._C`` on hosts that report AVX512-BF16, and that library holds AMX tile code (``ldtilecfg``,
``tdpbf16ps``) in vLLM's own attention main loop and micro-GEMM, chosen for bfloat16 whenever
``torch.cpu._is_amx_tile_supported()`` is true, without ever asking for the permission (the only
``ARCH_REQ_XCOMP_PERM`` in it is oneDNN's, for oneDNN's own kernels). ``vllm._C_AVX512``, loaded
elsewhere, holds no tile instruction. So on an AMX host the first bfloat16 ``generate`` kills the
worker, float32 (vector attention) runs, and torch's own bfloat16 matmul runs (oneDNN asks first).

``ensure_amx_usable`` runs in every vLLM process through mxrefit's plugin: it asks for the
permission through torch (``torch.cpu._init_amx``), and if the kernel refuses it (an older kernel
or a hypervisor that does not pass the tile state through) it tells vLLM, in that process only,
that the CPU has no AMX tiles, so vLLM takes its vector kernels instead of dying.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

import torch

logger = logging.getLogger("mxrefit")

_SYS_ARCH_PRCTL = 158  # x86-64 Linux
_ARCH_GET_XCOMP_PERM = 0x1022
_XFEATURE_XTILEDATA = 18


def tile_data_permitted() -> bool:
    """Whether this process may execute AMX tile instructions (Linux ``ARCH_GET_XCOMP_PERM``)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    mask = ctypes.c_ulong(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False  # a kernel without dynamic xstate permissions: no tile data for anyone
    return bool(mask.value & (1 << _XFEATURE_XTILEDATA))


def amx_safe() -> bool:
    """The invariant vLLM's CPU kernels need: they choose AMX only where this process may run it."""
    return not torch.cpu._is_amx_tile_supported() or tile_data_permitted()


def ensure_amx_usable() -> str:
    """Make AMX either usable or invisible to vLLM in this process.

    Returns ``"absent"`` (the CPU reports no AMX tiles), ``"permitted"`` (the kernel granted tile
    data to this process) or ``"disabled"`` (granting failed: ``torch.cpu._is_amx_tile_supported``
    now answers False in this process, and one warning says why).
    """
    if not torch.cpu._is_amx_tile_supported():
        return "absent"
    if torch.cpu._init_amx() and tile_data_permitted():
        return "permitted"
    torch.cpu._is_amx_tile_supported = _no_amx_tiles
    logger.warning(
        "mxrefit: this CPU reports AMX tiles but Linux refused this process the tile-data permission "
        "(arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's CPU build would die with SIGILL in its AMX kernels, "
        "so vLLM is told in this process that there are no AMX tiles and takes its vector kernels"
    )
    return "disabled"


def _no_amx_tiles() -> bool:
    """Stands in for ``torch.cpu._is_amx_tile_supported`` where tile data was refused."""
    return False
