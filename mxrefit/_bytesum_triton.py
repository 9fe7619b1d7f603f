"""Triton kernel of ``mxrefit.bytesum``: two int64 sums over many byte regions in one launch.

Programs are (region, chunk) pairs from a table built once per bucket (regions are views of
persistent buffers or engine storage, so their addresses never change). Each program adds
its bytes ``b`` at region offset ``i`` into ``out[0] += b`` and ``out[1] += b * (i % 65521 + 1)``.
Per lane, s1 stays far below 2**31 (CHUNK / BLOCK bytes of at most 255); products
(< 255 * 65522) are widened before they are summed.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

CHUNK = 32768  # below MOD: see the weights in the kernel
MOD = 65521


@triton.jit
def _bytesum_kernel(prog_region, prog_start, nbytes_of, addr_of, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    MOD: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.load(prog_region + pid)
    start = tl.multiple_of(tl.load(prog_start + pid), CHUNK)
    n = tl.load(nbytes_of + r)
    base = tl.load(addr_of + r).to(tl.pointer_type(tl.uint8))
    if ALIGNED:  # a tabled address carries no alignment: say it, or every load is a single byte
        base = tl.multiple_of(base, 16)
    # weights (offset % MOD) + 1 without a 64-bit modulo per byte: offset = start + j with
    # j < CHUNK <= MOD, so (start % MOD) + j is below 2 * MOD and one conditional subtract ends it
    first = (start % MOD).to(tl.int32)
    s1 = tl.zeros([BLOCK], dtype=tl.int32)
    s2 = tl.zeros([BLOCK], dtype=tl.int64)
    whole = start + CHUNK <= n
    for i in range(0, CHUNK, BLOCK):
        j = i + tl.arange(0, BLOCK)
        if whole:  # no mask: the loads vectorize
            b = tl.load(base + start + j).to(tl.int32)
        else:
            b = tl.load(base + start + j, mask=start + j < n, other=0).to(tl.int32)
        w = first + j
        w = tl.where(w >= MOD, w - MOD, w) + 1
        s1 += b
        s2 += (b * w).to(tl.int64)
    tl.atomic_add(out, tl.sum(s1.to(tl.int64), axis=0))
    tl.atomic_add(out + 1, tl.sum(s2, axis=0))


class ByteSumGroup:
    def __init__(self, views: list[torch.Tensor], device: torch.device, block: int = 4096):
        self.block = block
        prog_region, prog_start = [], []
        for r, v in enumerate(views):
            starts = range(0, v.numel(), CHUNK)
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
        self.out.zero_()
        if self.programs:
            _bytesum_kernel[(self.programs,)](self.prog_region, self.prog_start, self.nbytes_of, self.addr_of, self.out,
                                              CHUNK=CHUNK, BLOCK=self.block, MOD=MOD, ALIGNED=self.aligned, num_warps=4)
        s1, s2 = self.out.tolist()
        return s1, s2
