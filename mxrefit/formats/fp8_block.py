"""FP8 block-wise (DeepSeek style): E4M3 values, one float32 ``scale_inv`` per 128x128 tile.

This is what vLLM's ``Fp8Config`` with ``weight_block_size: [128, 128]`` loads (``*.weight`` +
``*.weight_scale_inv``) and Hopper runs natively. The bytes are those of vLLM 0.32's
``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py:984``), the one function vLLM uses to
quantize weights to block FP8: online block quantization of BF16 checkpoints
(``layers/quantization/online/fp8.py:360`` linear, ``:735``/``:740`` experts, ``use_ue8m0=False``)
and DeepGEMM's re-quantization of loaded FP8 checkpoints to power-of-two scales
(``requant_weight_ue8m0_inplace``, ``layers/quantization/utils/fp8_utils.py:1148``,
``use_ue8m0=True``)::

    amax      = max(max |x| over the tile, float32(1e-4))
    scale_inv = amax / 448                                  float32, IEEE division
              = 2**ceil(log2(amax / 448))  if use_ue8m0      a power of two ("UE8M0")
    values    = e4m3(x * (1 / scale_inv))                    float32 reciprocal and product, nearest even

Tiles cover the last two dims [N, K]; a 3-D [E, N, K] tensor is E matrices whose tiles never
straddle experts (vLLM quantizes expert by expert). Two implementations share this contract:
plain torch ops (any device) and a one-pass Triton kernel (CUDA; BF16/FP16 input).

Decisions, also in docs/formats.md:
- ragged edges (N or K not a multiple of 128): a partial tile is scaled by the amax of the
  elements it has, as vLLM's zero padding does (zeros never raise an amax); the scale has
  ``ceil(N/128) x ceil(K/128)`` entries;
- an all-zero tile (or one with amax below 1e-4) gets ``scale_inv = float32(1e-4) / 448``
  and zero values, signs kept (-0 stays 0x80), exactly as vLLM;
- non-finite input (NaN/Inf) is always an error naming the first bad tile, as for MXFP8;
- ``1 / scale_inv`` and ``amax / 448`` are IEEE operations on every device (a CUDA division by
  a Python scalar would multiply by its reciprocal, one ulp off for some amax);
- ``use_ue8m0`` takes vLLM's float32 ``ceil(log2(.))``; for BF16/FP16 input that is the exact
  ceiling (no amax / 448 lies within float32 rounding of a power of two unless it is one), for
  FP32 input it is whatever ``torch.log2`` gives on the device, as vLLM's own call would.
"""

from __future__ import annotations

import torch

from mxrefit.formats._common import Backend, NonFiniteError, choose_backend, destinations, kernel_module, label

BLOCK = (128, 128)
VALUE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0
AMAX_FLOOR = float(torch.tensor(1e-4, dtype=torch.float32))  # vLLM's clamp(1e-4), as float32 compares it
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = [
    "BLOCK",
    "VALUE_DTYPE",
    "SCALE_DTYPE",
    "E4M3_MAX",
    "AMAX_FLOOR",
    "INPUT_DTYPES",
    "NonFiniteError",
    "scale_shape",
    "check_quantizable",
    "quantize",
    "dequantize",
]


def _block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of ``scale_inv`` for values of ``shape``: [..., ceil(N/bn), ceil(K/bk)]."""
    bn, bk = _block(block)
    return (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))


def check_quantizable(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, name: str | None = None, block: tuple[int, int] = BLOCK
) -> None:
    """Raise ValueError unless a tensor of this shape and dtype can be quantized to block FP8."""
    what = label(name)
    _block(block)
    if len(shape) not in (2, 3):
        raise ValueError(f"{what}: FP8-block needs a 2-D [N, K] or 3-D [E, N, K] tensor, got shape {tuple(shape)}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(
            f"{what}: FP8-block prequantization needs a bfloat16, float16 or float32 source, got {dtype} (shape {tuple(shape)})"
        )


def first_bad_tile_message(shape: tuple[int, ...], flat_tile: int, block: tuple[int, int], what: str) -> str:
    bn, bk = block
    tiles = scale_shape(shape, block)
    index = []
    for dim in reversed(tiles):
        flat_tile, i = divmod(flat_tile, dim)
        index.append(i)
    *lead, tr, tc = reversed(index)
    where = ", ".join(
        [*(str(i) for i in lead), f"{tr * bn}:{min((tr + 1) * bn, shape[-2])}", f"{tc * bk}:{min((tc + 1) * bk, shape[-1])}"]
    )
    return (
        f"{what}: non-finite value (NaN or Inf) in shape {tuple(shape)}; first bad {bn}x{bk} tile at "
        f"[{where}] (FP8-block input must be finite)"
    )


def pow2_from_exponents(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2**e as float32 for integer-valued ``e`` in the normal range, built from IEEE bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _quantize_torch(
    x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], use_ue8m0: bool, what: str
) -> None:
    bn, bk = block
    n, k = x.shape[-2:]
    mats = x.reshape(-1, n, k)
    nb, kb = -(-n // bn), -(-k // bk)
    if (n, k) == (nb * bn, kb * bk):
        padded = mats
    else:  # zero padding to whole tiles, as vLLM: zeros never raise a tile's amax
        padded = mats.new_zeros(mats.shape[0], nb * bn, kb * bk)
        padded[:, :n, :k] = mats
    tiles = padded.view(-1, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(2, 4)).float()
    finite = torch.isfinite(amax)
    if not bool(finite.all()):
        first = int((~finite).reshape(-1).nonzero()[0])
        raise NonFiniteError(first_bad_tile_message(tuple(x.shape), first, block, what))
    amax = amax.clamp(min=AMAX_FLOOR)
    scale = amax / amax.new_tensor(E4M3_MAX)  # a device tensor: IEEE division on CUDA too
    if use_ue8m0:
        scale = pow2_from_exponents(torch.ceil(torch.log2(scale)))
    q = tiles * scale.reciprocal()[:, :, None, :, None]
    values.view(-1, n, k).copy_(q.view(padded.shape)[:, :n, :k])
    scale_inv.copy_(scale.view(scale_inv.shape))


def _triton_module():
    """The kernel module, or None where triton is not installed."""
    return kernel_module("_fp8_block_triton")


def quantize(
    x: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    use_ue8m0: bool = False,
    backend: Backend = "auto",
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ([N, K] or [E, N, K]) to block FP8; returns ``(values, scale_inv)``.

    ``use_ue8m0`` rounds every scale up to a power of two (vLLM's DeepGEMM E8M0 path).
    ``out`` / ``scale_out`` are destinations to write into (e.g. views of a transfer buffer).
    ``name`` labels errors. On an error the destinations may hold partial bytes.
    """
    what = label(name)
    block = _block(block)
    check_quantizable(tuple(x.shape), x.dtype, name, block)
    vshape, sshape = tuple(x.shape), scale_shape(x.shape, block)
    out, scale_out = destinations(x, vshape, sshape, VALUE_DTYPE, SCALE_DTYPE, out, scale_out, what)
    kernels = _triton_module()
    chosen = choose_backend(x, backend, kernels)
    if chosen == "triton" and not kernels.supports_block(block):
        if backend == "triton":
            raise ValueError(f"{what}: the Triton kernel takes power-of-two blocks from 16 to 256, got {block}")
        chosen = "torch"
    if chosen == "triton":
        bad = kernels.quantize_into(x, out, scale_out, block, use_ue8m0)
        if bad is not None:
            raise NonFiniteError(first_bad_tile_message(vshape, bad, block, what))
    else:
        _quantize_torch(x, out, scale_out, block, use_ue8m0, what)
    return out, scale_out


def dequantize(
    values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """Values times their tile's ``scale_inv``, in ``dtype`` (the dequantization of vLLM's
    ``requant_weight_ue8m0_inplace``, ``fp8_utils.py:1139-1146``)."""
    bn, bk = _block(block)
    if values.dtype != VALUE_DTYPE or scale_inv.dtype != SCALE_DTYPE:
        raise ValueError(
            f"dequantize needs {VALUE_DTYPE} values and {SCALE_DTYPE} scale_inv, got {values.dtype}, {scale_inv.dtype}"
        )
    if values.dim() not in (2, 3) or tuple(scale_inv.shape) != scale_shape(values.shape, block):
        raise ValueError(
            f"dequantize: scale_inv of shape {tuple(scale_inv.shape)} does not match values of shape "
            f"{tuple(values.shape)} (expected {scale_shape(values.shape, block) if values.dim() in (2, 3) else 'a 2-D or 3-D tensor'})"
        )
    n, k = values.shape[-2:]
    s = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return (values.to(torch.float32) * s).to(dtype)
