"""One spelling per device: ``"cuda"`` means the current CUDA device, with its index.

Why: torch compares ``torch.device("cuda")`` and ``torch.device("cuda", 0)`` as different, so
a sender built with ``device="cuda"`` would refuse tensors that live on ``cuda:0``.
"""

from __future__ import annotations

import torch


def resolve(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def bind(device: torch.device | str) -> torch.device:
    """Resolve ``device`` and make it this thread's current CUDA device (``set_device`` wants an index)."""
    dev = resolve(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
