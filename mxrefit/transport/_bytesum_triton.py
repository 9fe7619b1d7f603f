"""Triton kernel of ``mxrefit.transport.bytesum``: two int64 sums over many byte regions in one launch.

Programs are (region, chunk) pairs from a table built once per bucket (regions are views of
persistent buffers or engine storage, so their addresses never change). A region is read as
little-endian 32-bit words ``w_k`` (the bytes past its end are zeros); each program adds
``w_k`` into ``out[0]`` and ``w_k * (k % 65521 + 1)`` into ``out[1]`` for its chunk's words.
Words, not bytes: per byte the arithmetic cost more than the memory (byte-wise sums ran at 27%
of the read bandwidth on an H200, docs/data/bytesum_h200_2026-12-03.json). Per lane, at most
CHUNK / BLOCK products below 2**48 are added, and a program's total stays below 2**63; the
atomic adds across programs wrap modulo 2**64, which is the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrefit.transport.protocol import BYTESUM_MOD as MOD

CHUNK = 16384  # words per program, below MOD: see the weights in the kernel


@triton.jit
def _bytesum_kernel(
    prog_region,
    prog_start,
    nbytes_of,
    addr_of,
    out,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    MOD: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.load(prog_region + pid)
    start = tl.multiple_of(tl.load(prog_start + pid), CHUNK)  # first word of the chunk
    n = tl.load(nbytes_of + r)
    base = tl.load(addr_of + r).to(tl.pointer_type(tl.uint8))
    if ALIGNED:  # a tabled address carries no alignment: say it, or every load is scalar
        base = tl.multiple_of(base, 16)
    words = base.to(tl.pointer_type(tl.uint32))
    # weights (k % MOD) + 1 without a 64-bit modulo per word: k = start + j with j < CHUNK <= MOD,
    # so (start % MOD) + j is below 2 * MOD and one conditional subtract ends it
    first = (start % MOD).to(tl.int32)
    s1 = tl.zeros([BLOCK], dtype=tl.int64)
    s2 = tl.zeros([BLOCK], dtype=tl.int64)
    whole = (start + CHUNK) * 4 <= n
    if not ALIGNED:
        whole = n < 0  # never: an unaligned region's words are assembled from its bytes
    for i in range(0, CHUNK, BLOCK):
        j = i + tl.arange(0, BLOCK)
        if whole:  # whole aligned words, no mask: the loads vectorize
            w = tl.load(words + start + j).to(tl.int64)
        else:  # the region's tail, or an unaligned region: assemble each word from its bytes
            at = (start + j) * 4
            w = tl.zeros([BLOCK], dtype=tl.int64)
            for q in tl.static_range(4):
                b = tl.load(base + at + q, mask=at + q < n, other=0).to(tl.int64)
                w += b << (8 * q)
        k = first + j
        k = tl.where(k >= MOD, k - MOD, k) + 1
        s1 += w
        s2 += w * k.to(tl.int64)
    tl.atomic_add(out, tl.sum(s1, axis=0))
    tl.atomic_add(out + 1, tl.sum(s2, axis=0))


class ByteSumGroup:
    def __init__(self, views: list[torch.Tensor], device: torch.device, block: int = 256, num_warps: int = 4):
        self.block, self.num_warps = block, num_warps
        prog_region: list[int] = []
        prog_start: list[int] = []
        for r, v in enumerate(views):
            starts = range(0, -(-v.numel() // 4), CHUNK)
            prog_region.extend([r] * len(starts))
            prog_start.extend(starts)
        as_dev = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        self.prog_region = as_dev(prog_region, torch.int32)
        self.prog_start = as_dev(prog_start, torch.int64)
        self.nbytes_of = as_dev([v.numel() for v in views], torch.int64)
        self.addr_of = as_dev([v.data_ptr() for v in views], torch.int64)
        self.aligned = all(v.data_ptr() % 16 == 0 for v in views)
        self.out = torch.zeros(2, dtype=torch.int64, device=device)
        self.programs = len(prog_region)

    def __call__(self) -> tuple[int, int]:
        """The two sums as signed int64 (the caller reduces them modulo 2**64)."""
        self.out.zero_()
        if self.programs:
            _bytesum_kernel[(self.programs,)](
                self.prog_region,
                self.prog_start,
                self.nbytes_of,
                self.addr_of,
                self.out,
                CHUNK=CHUNK,
                BLOCK=self.block,
                MOD=MOD,
                ALIGNED=self.aligned,
                num_warps=self.num_warps,
            )
        s1, s2 = self.out.tolist()
        return s1, s2
