"""Triton kernels of ``engines.trtllm``: the TRT-LLM layouts in one memory-speed pass each.

Why kernels: on an H200, torch's ``index_select`` along the row dim of a [E, M, K] byte tensor
and ``index_copy_`` along dim 1 run an order of magnitude under copy speed (the generic
indexing path); these move whole rows (values) and 4-byte groups (scales) instead. The bytes
are the torch path's exactly (``tests/integration/test_trtllm_layout.py`` compares both under Triton's
interpreter; the bench compares the kernel layout with plain indexing on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_gather(src, dst, perm, M, K8, N_ROWS, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """dst[e, j, :] = src[e, perm[j], :] over rows viewed as int64 words (K8 = K / 8)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < N_ROWS
    e = rows // M
    j = rows % M
    src_rows = e * M + tl.load(perm + j, mask=live, other=0).to(tl.int64)
    for k in range(0, K8, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols[None, :] < K8)
        words = tl.load(src + src_rows[:, None] * K8 + cols[None, :], mask=mask)
        tl.store(dst + rows[:, None] * K8 + cols[None, :], words, mask=mask)


@triton.jit
def _scale_interleave(src, dst, perm, M, C, OUT_PER_E, CP4, N_ROWS, HAS_PERM: tl.constexpr, ROWS: tl.constexpr, CB: tl.constexpr):
    """dst[e, tile(j, c)] = src[e, perm[j], c]: the 128x4 interleave of (row-permuted) scale bytes."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < N_ROWS
    e = rows // M
    j = rows % M
    if HAS_PERM:
        s = tl.load(perm + j, mask=live, other=0).to(tl.int64)
    else:
        s = j
    c = tl.arange(0, CB)
    mask = live[:, None] & (c[None, :] < C)
    b = tl.load(src + (e * M + s)[:, None] * C + c[None, :], mask=mask)
    off = (
        (j // 128)[:, None] * CP4 * 512
        + (c // 4)[None, :] * 512
        + (j % 32)[:, None] * 16
        + ((j % 128) // 32)[:, None] * 4
        + (c % 4)[None, :]
    )
    tl.store(dst + e[:, None] * OUT_PER_E + off, b, mask=mask)


def row_gather(
    src: torch.Tensor, dst: torch.Tensor, perm: torch.Tensor, *, rows: int = 4, block: int = 256, num_warps: int = 4
) -> None:
    """``src``/``dst``: contiguous uint8 [E, M, K] with K % 8 == 0; ``perm``: int32/int64 [M]."""
    e, m, k = src.shape
    grid = (triton.cdiv(e * m, rows),)
    _row_gather[grid](
        src.view(torch.int64), dst.view(torch.int64), perm, m, k // 8, e * m, ROWS=rows, BLOCK=block, num_warps=num_warps
    )


def scale_interleave(
    src: torch.Tensor, dst: torch.Tensor, perm: torch.Tensor | None, out_per_expert: int, *, rows: int = 16, num_warps: int = 4
) -> None:
    """``src``: contiguous uint8 [E, M, C]; ``dst``: flat uint8 (E * out_per_expert), padding pre-zeroed."""
    e, m, c = src.shape
    grid = (triton.cdiv(e * m, rows),)
    cp4 = -(-c // 4)
    _scale_interleave[grid](
        src,
        dst,
        perm if perm is not None else src,
        m,
        c,
        out_per_expert,
        cp4,
        e * m,
        HAS_PERM=perm is not None,
        ROWS=rows,
        CB=triton.next_power_of_2(c),
        num_warps=num_warps,
    )
