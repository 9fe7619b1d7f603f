"""Triton kernels of ``engines.probed_layout``: one byte gather for every expert of a parameter.

Why a kernel: the index is per expert (a Qwen3-30B-A3B expert's w13 is 1536x2048 bytes, 12.6 MB
of int32 index), and ``index_select`` along dim 1 of the (E, bytes) views walks it once per
expert; here each program loads its part of the index once and moves those bytes for all E
experts. ``gather`` loads byte by byte; ``tiled`` does the same from a periodic index (one
tile's pattern plus an offset per tile: no index traffic); ``chunked`` serves layouts whose
output blocks each read a few aligned input chunks (Marlin's 16x64 tiles read 64 rows of 16
bytes): it loads the chunks whole and picks the block's bytes out of them in registers. All three
write the torch path's bytes exactly (tests/unit/test_probed_layout.py compares them under
Triton's interpreter).

Where a parameter has few output blocks but many experts (a MoE's scales: Qwen3-30B-A3B's w13
scales are 96 blocks of 1 KB per expert), the experts are split over a second grid axis: one
program walking all 128 experts left most of an H100 idle (2026-12-06, docs/vllm.md: 320 GB/s
against 1,808 GB/s for a copy, and 4x slower again at 4 KB blocks, i.e. with fewer programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS = 2048  # programs worth launching: ~16 per SM of a 132-SM Hopper


@triton.jit
def _experts_of_program(src, dst, N_IN, N_OUT, E, PER):
    """This program's first expert row of ``src`` and ``dst`` and how many experts it walks (axis 1
    of the grid splits the experts into groups of PER)."""
    first = tl.program_id(1) * PER  # < E: int32, so the loop bound is int32 as E is
    return src + first.to(tl.int64) * N_IN, dst + first.to(tl.int64) * N_OUT, tl.minimum(PER, E - first)


@triton.jit
def _gather(src, dst, index, N_IN, N_OUT, E, PER, BLOCK: tl.constexpr):
    """dst[e, j] = src[e, index[j]] for j in this program's block, for this program's PER experts."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < N_OUT
    idx = tl.load(index + j, mask=live, other=0).to(tl.int64)
    s, d, count = _experts_of_program(src, dst, N_IN, N_OUT, E, PER)
    for _ in range(count):  # pointers advance per expert: no E * N product in 32 bits
        tl.store(d + j, tl.load(s + idx, mask=live), mask=live)
        s += N_IN
        d += N_OUT


@triton.jit
def _chunked(src, dst, starts, local, N_IN, N_OUT, E, PER, SLOTS: tl.constexpr, CHUNK: tl.constexpr):
    """Output block b (SLOTS * CHUNK bytes): its SLOTS input chunks (byte offsets ``starts[b]``) loaded whole,
    then dst[e, block byte i] = chunk bytes[local[b, i]], for this program's PER experts."""
    BLOCK: tl.constexpr = SLOTS * CHUNK
    b = tl.program_id(0).to(tl.int64)
    at = tl.multiple_of(tl.load(starts + b * SLOTS + tl.arange(0, SLOTS)), CHUNK)
    offs = at[:, None] + tl.arange(0, CHUNK)[None, :]
    pick = tl.load(local + b * BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
    out = b * BLOCK + tl.arange(0, BLOCK)
    s, d, count = _experts_of_program(src, dst, N_IN, N_OUT, E, PER)
    for _ in range(count):
        tl.store(d + out, tl.gather(tl.reshape(tl.load(s + offs), (BLOCK,)), pick, 0))
        s += N_IN
        d += N_OUT


@triton.jit
def _tiled(src, dst, base, pattern, N_IN, N_OUT, E, PER, PERIOD: tl.constexpr, BLOCK: tl.constexpr):
    """dst[e, j] = src[e, base[j // PERIOD] + pattern[j % PERIOD]] for j in this program's block, for its PER experts."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < N_OUT
    at = tl.load(base + j // PERIOD, mask=live, other=0) + tl.load(pattern + j % PERIOD, mask=live, other=0).to(tl.int64)
    s, d, count = _experts_of_program(src, dst, N_IN, N_OUT, E, PER)
    for _ in range(count):
        tl.store(d + j, tl.load(s + at, mask=live), mask=live)
        s += N_IN
        d += N_OUT


def expert_split(blocks: int, experts: int, programs: int = PROGRAMS) -> tuple[int, int]:
    """(groups, experts per group): the experts split so that blocks x groups reaches ``programs``
    where it can; every group but the last holds the same number."""
    groups = min(experts, max(1, -(-programs // blocks)))
    per = -(-experts // groups)
    return -(-experts // per), per


def gather(
    src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, *, block: int = 1024, num_warps: int = 4, programs: int = PROGRAMS
) -> None:
    """``src``: contiguous uint8 (E, n_in); ``dst``: contiguous uint8 (E, n_out); ``index``: int32/int64 (n_out,).
    ``programs=1`` keeps one program per block walking every expert (the layout before 2026-12-06)."""
    e, n_in = src.shape
    n_out = dst.shape[1]
    blocks = triton.cdiv(n_out, block)
    groups, per = expert_split(blocks, e, programs)
    _gather[(blocks, groups)](src, dst, index, n_in, n_out, e, per, BLOCK=block, num_warps=num_warps)


def chunked(
    src: torch.Tensor,
    dst: torch.Tensor,
    starts: torch.Tensor,
    local: torch.Tensor,
    *,
    num_warps: int = 4,
    programs: int = PROGRAMS,
) -> None:
    """``starts``: int64 (blocks, slots) chunk offsets, multiples of the chunk size; ``local``: int16
    (blocks, block bytes), each output byte's place among its block's chunk bytes (``ChunkTable``)."""
    e, n_in = src.shape
    blocks, slots = starts.shape
    chunk = local.shape[1] // slots
    groups, per = expert_split(blocks, e, programs)
    _chunked[(blocks, groups)](src, dst, starts, local, n_in, dst.shape[1], e, per, SLOTS=slots, CHUNK=chunk, num_warps=num_warps)


def tiled(
    src: torch.Tensor,
    dst: torch.Tensor,
    base: torch.Tensor,
    pattern: torch.Tensor,
    *,
    block: int = 1024,
    num_warps: int = 4,
    programs: int = PROGRAMS,
) -> None:
    """``base``: int64 (tiles,) input offset per output tile; ``pattern``: int32 (period,), the same
    for every tile (``TiledIndex``)."""
    e, n_in = src.shape
    n_out = dst.shape[1]
    blocks = triton.cdiv(n_out, block)
    groups, per = expert_split(blocks, e, programs)
    _tiled[(blocks, groups)](
        src, dst, base, pattern, n_in, n_out, e, per, PERIOD=pattern.numel(), BLOCK=block, num_warps=num_warps
    )
