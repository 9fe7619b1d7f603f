"""Triton kernel of ``engines.probed_layout``: one byte gather for every expert of a parameter.

Why a kernel: the index is per expert (a Qwen3-30B-A3B expert's w13 is 1536x2048 bytes, 12.6 MB
of int32 index), and ``index_select`` along dim 1 of the (E, bytes) views walks it once per
expert; here each program loads one block of the index once and moves that block for all E
experts. The bytes are the torch path's exactly (tests/test_probed_layout.py compares both
under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather(src, dst, index, N_IN, N_OUT, E, BLOCK: tl.constexpr):
    """dst[e, j] = src[e, index[j]] for j in this program's block, every e."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < N_OUT
    idx = tl.load(index + j, mask=live, other=0).to(tl.int64)
    s = src
    d = dst
    for _ in range(E):  # pointers advance per expert: no E * N product to overflow 32 bits
        tl.store(d + j, tl.load(s + idx, mask=live), mask=live)
        s += N_IN
        d += N_OUT


def gather(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, *, block: int = 1024, num_warps: int = 4) -> None:
    """``src``: contiguous uint8 (E, n_in); ``dst``: contiguous uint8 (E, n_out); ``index``: int32/int64 (n_out,)."""
    e, n_in = src.shape
    n_out = dst.shape[1]
    _gather[(triton.cdiv(n_out, block),)](src, dst, index, n_in, n_out, e, BLOCK=block, num_warps=num_warps)
