"""One-pass Triton MXFP8 kernel: read BF16/FP16 once, write E4M3 values and scale bytes once.

The input is read as raw 16-bit words and widened to float32 bits with integer ops (exact, and
the interpreter's own bf16 cast drops subnormals). Scale byte, exact for BF16/FP16 input (integer form of the vLLM formula, see DESIGN.md):
the bits of amax are the integer max of the magnitudes' bits; with E, M its float32
exponent and mantissa, ``sb = clamp(E - 8 + (M > 0x600000), 0, 254)``.

Values have two exact roundings, chosen by the constexpr ``INT_ROUND``:
- hardware (GPU default): multiply by 2**(127 - sb) as two normal powers of two (exact),
  then the hardware's round-to-nearest-even cast to e4m3;
- integer (used under TRITON_INTERPRET=1, whose fp8 cast does not round like the GPU):
  round-to-nearest-even on the integer significand, built from IEEE bits.
Both are checked byte for byte against the torch path on the H200 (scripts/gpu_mxfp8.py).

A non-finite block is reported through ``bad``, the smallest flat block index holding one.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path serves without it
    triton = None

_INT32_MAX = 2**31 - 1
_KERNELS: dict[bool, object] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(x: torch.Tensor) -> bool:
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return x.is_cuda or (interpreting() and x.device.type == "cpu")


def _kernel_source(
    x_ptr, v_ptr, s_ptr, bad_ptr, n_blocks,
    MIN_BYTE: tl.constexpr, NB: tl.constexpr, INT_ROUND: tl.constexpr, IS_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    pid = tl.program_id(0)
    if WIDE_INDEX:
        pid = pid.to(tl.int64)
    blk = pid * NB + tl.arange(0, NB)
    blk_mask = blk < n_blocks
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    raw = tl.load(x_ptr + offs, mask=blk_mask[:, None], other=0)
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
    xf = bits.to(tl.float32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    amag = tl.max(mag, axis=1)

    bad_here = tl.where(blk_mask & (amag >= 0x7F800000), blk, 2147483647)
    first_bad = tl.min(bad_here, axis=0).to(tl.int32)
    tl.atomic_min(bad_ptr, first_bad, mask=first_bad < 2147483647)

    sb = (amag >> 23) - 8 + ((amag & 0x7FFFFF) > 0x600000).to(tl.int32)
    sb = tl.minimum(tl.maximum(sb, MIN_BYTE), 254)

    if INT_ROUND:
        e = mag >> 23
        sig = tl.where(e == 0, mag & 0x7FFFFF, (mag & 0x7FFFFF) | 0x800000)
        top = (sig.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        q = tl.maximum(e, 1) - 23 - sb[:, None]
        shift = tl.minimum(tl.maximum(top - 3, -9 - q), 25)
        kept = sig >> shift
        rem = sig & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
        r = kept + up.to(tl.int32)
        code = tl.where(r == 0, 0, ((q + shift + 9) << 3) + r)
        byte = (code | ((bits >> 24) & 0x80)).to(tl.uint8)
    else:
        k = 127 - sb
        k1 = k >> 1
        f1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
        f2 = ((k - k1 + 127) << 23).to(tl.float32, bitcast=True)
        y = (xf * f1[:, None]) * f2[:, None]
        byte = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    tl.store(v_ptr + offs, byte, mask=blk_mask[:, None])
    tl.store(s_ptr + blk, sb.to(tl.uint8), mask=blk_mask)


def _kernel():
    mode = interpreting()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_kernel_source)
    return _KERNELS[mode]


def quantize_into(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    min_byte: int,
    *,
    blocks_per_program: int = 128,
    num_warps: int = 4,
    int_round: bool | None = None,
    bad: torch.Tensor | None = None,
) -> int | None:
    """Quantize ``x`` into contiguous ``values`` / ``scales``; returns the first bad block or None.

    Blocks are consecutive runs of 32 elements of the contiguous input, so one flat index
    serves 2-D and 3-D tensors alike. Pass ``bad`` (an int32 [1] tensor set to INT32_MAX)
    to collect non-finite reports from several launches and check once, without a
    synchronization per tensor.
    """
    if not x.is_contiguous():
        x = x.contiguous()
    n_blocks = x.numel() // 32
    if n_blocks == 0:
        return None
    if int_round is None:
        int_round = interpreting()
    own_bad = bad is None
    if own_bad:
        bad = torch.full((1,), _INT32_MAX, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _kernel()[grid](
        x.view(torch.int16), values.view(torch.uint8), scales, bad, n_blocks,
        MIN_BYTE=min_byte, NB=blocks_per_program, INT_ROUND=int_round, IS_BF16=x.dtype == torch.bfloat16,
        WIDE_INDEX=x.numel() >= 2**31, num_warps=num_warps,
    )
    if not own_bad:
        return None
    first = int(bad.item())
    return None if first == _INT32_MAX else first
