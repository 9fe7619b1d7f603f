"""MXFP8 (OCP MX): E4M3 values with one E8M0 scale byte per 32 elements along the last dim.

The bytes are those of vLLM 0.32's ``mxfp8_e4m3_quantize`` (its torch path, used on Hopper and CPU):

    amax = max|x| over a block of 32, clamped below at float32's smallest normal
    sb   = clamp(ceil(log2(amax / 448)) + 127, 0, 254)           # the scale byte (bias 127)
    q    = e4m3(x / 2**(sb - 127))                                 # round to nearest even

Two implementations share this contract: plain torch ops (any device; the oracle) and a fused
one-pass Triton kernel (CUDA; BF16/FP16 input). ``backend="auto"`` picks the kernel on CUDA.

Decisions, also in docs/formats.md:
- the power of two ``2**(sb - 127)`` is built from its bits, never from ``exp2``: CUDA's
  ``exp2(-127)`` is one ulp low, which would change blocks with amax below ~2.6e-36;
  on CPU this equals vLLM's result exactly (tested against vLLM's own function);
- non-finite input (NaN/Inf) is always an error, naming the first bad block; MXFP8 has no
  encoding that a refit should ever ship for it;
- ``zero_block_scale_one=True`` raises the smallest scale byte to 1, the convention of the
  TRT-LLM MoE kernel: all-zero blocks get byte 1 and stay zero, and the values of any block
  are quantized with the scale actually written, so dequantization stays consistent.
"""

from __future__ import annotations

import torch

from mxrefit.formats._common import Backend, NonFiniteError, choose_backend, destinations, kernel_module, label

BLOCK = 32
VALUE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8
E4M3_MAX = 448.0
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Shape of the scale tensor for values of ``shape``."""
    return (*shape[:-1], shape[-1] // BLOCK)


def check_quantizable(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, name: str | None = None) -> None:
    """Raise ValueError unless a tensor of this shape and dtype can be quantized to MXFP8."""
    what = label(name)
    if len(shape) not in (2, 3):
        raise ValueError(f"{what}: MXFP8 needs a 2-D [N, K] or 3-D [E, N, K] tensor, got shape {tuple(shape)}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(
            f"{what}: MXFP8 prequantization needs a bfloat16, float16 or float32 source, got {dtype} (shape {tuple(shape)})"
        )
    if shape[-1] % BLOCK:
        raise ValueError(
            f"{what}: the last dim K={shape[-1]} of shape {tuple(shape)} is not a multiple of {BLOCK}, the MXFP8 block size"
        )


def pow2_from_scale_bytes(sb: torch.Tensor) -> torch.Tensor:
    """Exactly 2**(sb - 127) as float32, built from IEEE bits (byte 0 is the subnormal 2**-127)."""
    sb = sb.to(torch.int32)
    bits = torch.where(sb > 0, sb << 23, torch.full_like(sb, 1 << 22))
    return bits.view(torch.float32)


def first_bad_block_message(shape: tuple[int, ...], flat_block: int, what: str) -> str:
    n_kb = shape[-1] // BLOCK
    lead, kb = divmod(flat_block, n_kb)
    index = []
    for dim in reversed(shape[:-1]):
        lead, i = divmod(lead, dim)
        index.append(i)
    where = ", ".join(str(i) for i in reversed(index))
    return (
        f"{what}: non-finite value (NaN or Inf) in shape {tuple(shape)}; first bad block at "
        f"[{where}, {kb * BLOCK}:{(kb + 1) * BLOCK}] (MXFP8 input must be finite)"
    )


def _quantize_torch(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, min_byte: int, what: str) -> None:
    kb = x.shape[-1] // BLOCK
    xb = x.to(torch.float32).reshape(*x.shape[:-1], kb, BLOCK)
    amax = xb.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    if not bool(finite.all()):
        first = int((~finite).reshape(-1).nonzero()[0])
        raise NonFiniteError(first_bad_block_message(tuple(x.shape), first, what))
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    sb = (torch.ceil(torch.log2(amax / E4M3_MAX)) + 127.0).clamp(min_byte, 254)
    q = xb / pow2_from_scale_bytes(sb).unsqueeze(-1)
    values.copy_(q.view(x.shape).to(VALUE_DTYPE))
    scales.copy_(sb.to(SCALE_DTYPE))


def _triton_module():
    """The kernel module, or None where triton is not installed."""
    return kernel_module("_mxfp8_triton")


def quantize(
    x: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    zero_block_scale_one: bool = False,
    backend: Backend = "auto",
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ([N, K] or [E, N, K]) to MXFP8; returns ``(values, scales)``.

    ``out`` / ``scale_out`` are destinations to write into (e.g. views of a transfer buffer),
    so the bytes land where they are needed with no intermediate copy. ``name`` labels errors.
    On an error the destinations may hold partial bytes; nothing is returned as valid.
    """
    what = label(name)
    check_quantizable(tuple(x.shape), x.dtype, name)
    if x.stride(-1) != 1:
        raise ValueError(f"{what}: the last dim must be contiguous (strides {x.stride()})")
    vshape, sshape = tuple(x.shape), scale_shape(x.shape)
    out, scale_out = destinations(x, vshape, sshape, VALUE_DTYPE, SCALE_DTYPE, out, scale_out, what)
    min_byte = 1 if zero_block_scale_one else 0
    if choose_backend(x, backend, _triton_module()) == "triton":
        bad = _triton_module().quantize_into(x, out, scale_out, min_byte)
        if bad is not None:
            raise NonFiniteError(first_bad_block_message(vshape, bad, what))
    else:
        _quantize_torch(x, out, scale_out, min_byte, what)
    return out, scale_out


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values times their block scale, in ``dtype`` (vLLM's ``dequant_mxfp8_to_bf16`` for bfloat16)."""
    if values.dtype != VALUE_DTYPE or scales.dtype != SCALE_DTYPE:
        raise ValueError(f"dequantize needs {VALUE_DTYPE} values and {SCALE_DTYPE} scales, got {values.dtype}, {scales.dtype}")
    if values.shape[-1] % BLOCK or tuple(scales.shape) != scale_shape(values.shape):
        raise ValueError(
            f"dequantize: scales of shape {tuple(scales.shape)} do not match values of shape "
            f"{tuple(values.shape)} (expected {scale_shape(values.shape)})"
        )
    kb = values.shape[-1] // BLOCK
    xb = values.to(torch.float32).reshape(*values.shape[:-1], kb, BLOCK)
    return (xb * pow2_from_scale_bytes(scales).unsqueeze(-1)).reshape(values.shape).to(dtype)
