"""Per-bucket integrity sums (``verify=True``): cheap on a GPU, equal on both sides.

Why two sums and not a cryptographic hash: the check runs every refit over every byte, so it
must be one memory-speed pass; what it must catch is a corrupted or stale buffer (bit flips,
a bucket written twice or not at all, a slot reused too early), not an adversary — the
control channel's token keeps strangers out. ``s1`` is the plain byte sum (any single changed
byte moves it); ``s2`` weighs each byte by its offset (moved or swapped bytes move it).

Both sides build a ``ByteSum`` once per bucket over the same regions: the trainer over the
views it encodes into, the engine over the bytes that landed in its storage (or staging), so
the check covers the transport and the engine's copies.
"""

from __future__ import annotations

import os

import torch

MOD = 65521


def _triton_module():
    try:
        from mxrefit import _bytesum_triton
    except ImportError:
        return None
    return _bytesum_triton


class ByteSum:
    """Built once for fixed byte views (flat uint8); call to get ``(s1, s2)``."""

    def __init__(self, views: list[torch.Tensor]):
        for v in views:
            if v.dtype != torch.uint8 or v.dim() != 1 or not v.is_contiguous():
                raise ValueError("ByteSum needs flat contiguous uint8 views")
        self.views = views
        device = views[0].device if views else torch.device("cpu")
        kernels = _triton_module()
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self._group = kernels.ByteSumGroup(views, device) if kernels is not None and (device.type == "cuda" or interpreted) else None
        self._weights: dict[int, torch.Tensor] = {}

    def __call__(self) -> tuple[int, int]:
        if self._group is not None:
            return self._group()
        s1 = s2 = 0
        for v in self.views:
            n = v.numel()
            if n not in self._weights:
                self._weights[n] = torch.arange(n, dtype=torch.int64, device=v.device) % MOD + 1
            b = v.to(torch.int64)
            s1 += int(b.sum())
            s2 += int((b * self._weights[n]).sum())
        return s1, s2
