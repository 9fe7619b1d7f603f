"""One spelling per device (``"cuda"`` means the current CUDA device, with its index), the one
buffer alignment, and the one current-stream sync.

Why: torch compares ``torch.device("cuda")`` and ``torch.device("cuda", 0)`` as different, so
a sender built with ``device="cuda"`` would refuse tensors that live on ``cuda:0``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch


def resolve(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


ALIGN = 512  # bytes: every staged tensor, bucket and arena piece starts on this boundary


def first_cuda_problem(device: torch.device, needs: str, first_only: str) -> str | None:
    """Why a peer that runs on the first visible GPU cannot run on ``device``: ``needs`` says why
    it needs CUDA, ``first_only`` why it takes only the first GPU; None when ``device`` is usable."""
    if device.type != "cuda":
        return f"it needs CUDA ({needs}); this run's device is {device}"
    if not torch.cuda.is_available():
        return f"it needs CUDA and this torch ({torch.__version__}) sees no CUDA device"
    if device.index not in (None, 0):
        return f"{first_only}; run with CUDA_VISIBLE_DEVICES={device.index} and --device cuda instead of --device cuda:N"
    return None


def align(n: int) -> int:
    """Round ``n`` up to ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


def sync_current(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (not the side streams); no-op off CUDA."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def triton_interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, read by Triton at its first import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, and on CPU under the interpreter (how the tests check them)."""
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreting())


def triton_kernels(module: str, device: torch.device) -> ModuleType | None:
    """The Triton kernel module ``module`` where its kernels run on ``device``, else None (the torch
    path); Triton is optional, so a missing one is None too."""
    if not triton_runs_on(device):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def bind(device: torch.device | str) -> torch.device:
    """Resolve ``device`` and make it this thread's current CUDA device (``set_device`` wants an index)."""
    dev = resolve(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
