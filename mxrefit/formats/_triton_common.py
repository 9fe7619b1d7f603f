"""Triton pieces the MXFP8 and FP8-block kernels share.

- ``widen_to_f32_bits``: raw BF16/FP16 words to float32 bits with integer ops (exact; the
  interpreter's own bf16 cast drops subnormals).
- ``e4m3_rne``: round-to-nearest-even of ``value * 2**(127 - sb)`` to E4M3 with integer ops,
  for Triton's interpreter, whose fp8 cast does not round like the GPU.
- ``exp_hits``: which raw words hold a non-finite element (all exponent bits set), one or
  several elements per word (the passthrough copy and the finite scan); ``widest_lanes`` and
  ``require_lanes`` are the host-side rules for those words.
- ``LaunchTable``: one launch over many tensors: per-program (tensor, first unit) rows built
  once, destination addresses tabled once, source addresses re-sent only when they change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mxrefit.devices import triton_runs_on


def supports(x: torch.Tensor) -> bool:
    """The kernels take BF16/FP16 on CUDA, or on CPU under TRITON_INTERPRET=1."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return triton_runs_on(x.device)


def widest_lanes(dtype: torch.dtype, numels: Sequence[int], addresses: Sequence[int], most: int | None = None) -> int:
    """The most ``dtype`` elements one word (at most 64 bits, at most ``most`` elements) can hold
    such that every size divides by them and every address by the word's bytes: a wider word
    means fewer loads and fewer exponent tests per byte, and any layout falls back to one."""
    lanes = 64 // (dtype.itemsize * 8) if most is None else most
    while lanes > 1 and (any(n % lanes for n in numels) or any(a % (dtype.itemsize * lanes) for a in addresses)):
        lanes //= 2
    return max(lanes, 1)


def require_lanes(dtype: torch.dtype, lanes: int, chunk: int, block: int) -> int:
    """The word width (bits) of ``lanes`` ``dtype`` elements; ValueError unless it is one the
    kernels move (16, 32, 64) and the chunk and block (in elements) divide into whole words."""
    bits = dtype.itemsize * 8 * lanes
    if bits not in (16, 32, 64):
        raise ValueError(f"{lanes} {dtype} elements per word make a {bits}-bit word; the kernels move 16, 32 or 64")
    if chunk % lanes or block % lanes:
        raise ValueError(f"chunk {chunk} and block {block} elements must divide by {lanes} elements per word")
    return bits


@triton.jit
def exp_hits(words, EXP_MASK: tl.constexpr, ELEM_BITS: tl.constexpr, LANES: tl.constexpr):
    """1 where any of a word's LANES elements has all exponent bits set (Inf/NaN), else 0."""
    if LANES == 1:
        return ((words.to(tl.int32) & EXP_MASK) == EXP_MASK).to(tl.int32)
    hit = ((words & EXP_MASK) == EXP_MASK).to(tl.int32)
    for j in tl.static_range(1, LANES):
        hit = hit | (((words >> (j * ELEM_BITS)) & EXP_MASK) == EXP_MASK).to(tl.int32)
    return hit


@triton.jit
def widen_to_f32_bits(raw, IS_BF16: tl.constexpr):
    """16-bit words (loaded as int16) -> the int32 bits of the same value as float32."""
    raw = raw.to(tl.int32) & 0xFFFF
    if IS_BF16:
        bits = raw << 16
    else:  # float16 -> float32 bits; its subnormals m * 2**-24 are float32 normals
        e5 = (raw >> 10) & 0x1F
        m10 = raw & 0x3FF
        sub = (m10.to(tl.float32) * 5.9604644775390625e-08).to(tl.int32, bitcast=True)
        normal = ((e5 + 112) << 23) | (m10 << 13)
        bits = tl.where(e5 == 0, sub, tl.where(e5 == 0x1F, 0x7F800000 | (m10 << 13), normal))
        bits = bits | ((raw & 0x8000) << 16)
    return bits


@triton.jit
def e4m3_rne(bits, sb):
    """E4M3 byte of float32 ``bits`` times 2**(127 - sb), rounded to nearest even (|result| <= 448 assumed)."""
    mag = bits & 0x7FFFFFFF
    e = mag >> 23
    sig = tl.where(e == 0, mag & 0x7FFFFF, (mag & 0x7FFFFF) | 0x800000)
    top = (sig.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    q = tl.maximum(e, 1) - 23 - sb
    shift = tl.minimum(tl.maximum(top - 3, -9 - q), 25)
    kept = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    r = kept + up.to(tl.int32)
    code = tl.where(r == 0, 0, ((q + shift + 9) << 3) + r)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


class LaunchTable:
    """Per-program rows of one grouped launch: program p handles ``units_per_program`` units
    of tensor ``prog_tensor[p]`` starting at unit ``prog_unit[p]`` (a unit is whatever the
    kernel calls its work item: a 32-block, a 128x128 tile)."""

    def __init__(
        self,
        units: Sequence[int],
        units_per_program: int,
        outs: Sequence[Sequence[torch.Tensor]],
        device: torch.device,
        kind: str,
    ):
        self.device = device
        self.kind = kind
        prog_tensor: list[int] = []
        prog_unit: list[int] = []
        for t, n in enumerate(units):
            starts = range(0, n, units_per_program)
            prog_tensor.extend([t] * len(starts))
            prog_unit.extend(starts)
        self.prog_tensor = self.ints(prog_tensor, torch.int32)
        self.prog_unit = self.ints(prog_unit, torch.int32)
        roles = len(outs[0]) if outs else 0
        self.out_addr = [self.ints([o[r].data_ptr() for o in outs], torch.int64) for r in range(roles)]
        self.src_addr = torch.zeros(len(units), dtype=torch.int64, device=device)
        self.src_addresses: list[int] = []
        self.programs = len(prog_tensor)

    def ints(self, xs: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=dtype, device=self.device)

    def bind(self, sources: Sequence[torch.Tensor]) -> bool:
        """Table the sources' addresses; returns whether they changed since the last step."""
        addrs = [s.data_ptr() for s in sources]
        if addrs == self.src_addresses:
            return False
        for s in sources:
            if not s.is_contiguous():
                raise ValueError(f"grouped {self.kind} needs contiguous sources, got strides {s.stride()}")
        self.src_addr.copy_(torch.tensor(addrs, dtype=torch.int64))
        self.src_addresses = addrs
        return True
