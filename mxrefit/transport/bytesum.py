"""Per-bucket integrity sums (``verify=True``): cheap on a GPU, equal on both sides.

Why two sums and not a cryptographic hash: the check runs every refit over every byte, so it
must be one memory-speed pass; what it must catch is a corrupted or stale buffer (bit flips,
a bucket written twice or not at all, a slot reused too early), not an adversary — the
control channel's token keeps strangers out. A region is read as little-endian 32-bit words
``w_k`` (zeros past its end): ``s1 = sum(w_k)`` and ``s2 = sum(w_k * (k % 65521 + 1))``, both
modulo 2**64 and added over the regions. Any change within one word moves ``s1`` (the word
changes by less than 2**32); words swapped or moved by fewer than 65521 positions move ``s2``.

Both sides build a ``ByteSum`` once per bucket over the same regions: the trainer over the
views it encodes into, the engine over the bytes that landed in its storage (or staging), so
the check covers the transport and the engine's copies.

``tensor_sha256`` is the slow, exact counterpart for checks outside a refit (the bench's byte
comparisons, an engine's ``kernel_state``): a tensor's bytes hashed on the host.
"""

from __future__ import annotations

import hashlib

import torch

from mxrefit.devices import triton_kernels
from mxrefit.transport.protocol import BYTESUM_MOD as MOD

WORDS_PER_ROW = 1 << 14  # the torch path sums rows of this many words in int64: each row sum stays below 2**63
_WRAP = 1 << 64


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of the tensor's bytes in row-major order, copied to the host."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _words(view: torch.Tensor) -> torch.Tensor:
    """The region as int64 values of its little-endian 32-bit words, zero-padded to whole rows."""
    n = view.numel()
    padded = torch.zeros(-(-n // (4 * WORDS_PER_ROW)) * 4 * WORDS_PER_ROW, dtype=torch.uint8, device=view.device)
    padded[:n] = view
    return (padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).view(-1, WORDS_PER_ROW)


class ByteSum:
    """Built once for fixed byte views (flat uint8); call to get ``(s1, s2)``, each in [0, 2**64)."""

    def __init__(self, views: list[torch.Tensor]):
        for v in views:
            if v.dtype != torch.uint8 or v.dim() != 1 or not v.is_contiguous():
                raise ValueError("ByteSum needs flat contiguous uint8 views")
        self.views = views
        device = views[0].device if views else torch.device("cpu")
        kernels = triton_kernels("mxrefit.transport._bytesum_triton", device)
        self._group = kernels.ByteSumGroup(views, device) if kernels is not None else None
        self._weights = torch.empty(0, WORDS_PER_ROW, dtype=torch.int64, device=device)  # (k % MOD) + 1, by row

    def __call__(self) -> tuple[int, int]:
        if self._group is not None:
            s1, s2 = self._group()
            return s1 % _WRAP, s2 % _WRAP
        s1 = s2 = 0
        for v in self.views:
            words = _words(v)
            rows = words.shape[0]
            if rows > self._weights.shape[0]:  # one table for every view: each takes its first rows
                self._weights = (torch.arange(words.numel(), dtype=torch.int64, device=v.device) % MOD + 1).view(rows, -1)
            s1 += sum(words.sum(dim=1).tolist())
            s2 += sum((words * self._weights[:rows]).sum(dim=1).tolist())
        return s1 % _WRAP, s2 % _WRAP
