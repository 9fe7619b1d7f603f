"""One-pass Triton FP8-block kernel: read BF16/FP16 once, write E4M3 values and float32 scale_inv once.

One program per tile (128x128 by default), the whole tile in registers: raw 16-bit words widened
to float32 bits with integer ops; amax as the integer max of the magnitudes' bits, floored at
float32(1e-4); ``scale = amax / 448`` and ``1 / scale`` as IEEE divisions (``div_rn``: Triton's
``/`` is approximate on NVIDIA); with ``UE8M0`` the scale is raised to the next power of two
from its bits (exactly vLLM's float32 ``ceil(log2(.))`` for BF16/FP16 input, see fp8_block.py).
Values ``x * (1 / scale)`` are rounded to E4M3 by the hardware cast (GPU; never above 448 * (1 +
2**-22), so its saturation never acts) or by integer round-to-nearest-even (under
TRITON_INTERPRET=1, whose fp8 cast does not round like the GPU). Both are checked byte for byte
against the torch path on the H200 (scripts/gpu_fp8_block.py).

Tiles are numbered flat over [E, ceil(N/BN), ceil(K/BK)], the layout of scale_inv itself, so a
tile's index is its scale's offset. A non-finite tile is reported through ``bad``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxrefit.devices import triton_interpreting
from mxrefit.formats._common import bad_flag, first_bad
from mxrefit.formats._triton_common import LaunchTable, e4m3_rne, supports, widen_to_f32_bits

__all__ = ["supports", "supports_block", "quantize_into", "QuantizeGroup"]

_AMAX_FLOOR_BITS = int(torch.tensor(1e-4, dtype=torch.float32).view(torch.int32))


def supports_block(block: tuple[int, int]) -> bool:
    return all(16 <= b <= 256 and b & (b - 1) == 0 for b in block)


@triton.jit
def _quantize_tile(
    src,
    dst_values,
    dst_scales,
    tile,
    n_rows,
    n_cols,
    row_stride,
    tiles_k,
    tiles_per_mat,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UE8M0: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    AMAX_FLOOR_BITS: tl.constexpr,
):
    """Quantize flat tile ``tile`` (int64) of one tensor; returns whether it held NaN/Inf.

    ``row_stride`` is ``n_cols`` as int32: offsets within a tile are int32 per element, the
    tile's own offset is int64 once."""
    mat = tile // tiles_per_mat
    in_mat = tile % tiles_per_mat
    row0 = (in_mat // tiles_k) * BN
    col0 = (in_mat % tiles_k) * BK
    base = mat * n_rows * n_cols + row0 * n_cols + col0  # int64, once per tile
    r = tl.arange(0, BN)
    c = tl.arange(0, BK)
    mask = (row0 + r < n_rows)[:, None] & (col0 + c < n_cols)[None, :]
    offs = r[:, None] * row_stride + c[None, :]
    src = src + base
    dst_values = dst_values + base
    bits = widen_to_f32_bits(tl.load(src + offs, mask=mask, other=0), IS_BF16)
    amag = tl.max(tl.max(bits & 0x7FFFFFFF, axis=1), axis=0)
    amax = tl.maximum(amag, AMAX_FLOOR_BITS).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        sbits = scale.to(tl.int32, bitcast=True)
        scale = (((sbits >> 23) + ((sbits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    y = bits.to(tl.float32, bitcast=True) * tl.math.div_rn(1.0, scale)
    if INT_ROUND:
        byte = e4m3_rne(y.to(tl.int32, bitcast=True), 127)
    else:
        byte = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(dst_values + offs, byte, mask=mask)
    tl.store(dst_scales + tile, scale)
    return amag >= 0x7F800000


@triton.jit
def _single_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    bad_ptr,
    n_rows,
    n_cols,
    tiles_k,
    tiles_per_mat,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UE8M0: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    AMAX_FLOOR_BITS: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    is_bad = _quantize_tile(
        x_ptr,
        v_ptr,
        s_ptr,
        tile,
        n_rows,
        n_cols,
        n_cols,
        tiles_k,
        tiles_per_mat,
        BN,
        BK,
        UE8M0,
        INT_ROUND,
        IS_BF16,
        AMAX_FLOOR_BITS,
    )
    tl.atomic_min(bad_ptr, tile.to(tl.int32), mask=is_bad)


@triton.jit
def _group_kernel(
    prog_tensor,
    prog_tile,
    dims,
    src_addr,
    values_addr,
    scales_addr,
    bad_ptr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UE8M0: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    AMAX_FLOOR_BITS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    tile = tl.load(prog_tile + pid).to(tl.int64)
    n_rows = tl.load(dims + 4 * t)
    n_cols = tl.load(dims + 4 * t + 1)
    tiles_k = tl.load(dims + 4 * t + 2)
    tiles_per_mat = tl.load(dims + 4 * t + 3)
    src = tl.load(src_addr + t).to(tl.pointer_type(tl.int16))
    dst_values = tl.load(values_addr + t).to(tl.pointer_type(tl.uint8))
    dst_scales = tl.load(scales_addr + t).to(tl.pointer_type(tl.float32))
    row_stride = n_cols.to(tl.int32)
    if ALIGNED:  # every row starts 16-byte aligned in source and values: vector loads and stores
        n_cols = tl.multiple_of(n_cols, 16)
        row_stride = tl.multiple_of(row_stride, 16)
        src = tl.multiple_of(src, 16)
        dst_values = tl.multiple_of(dst_values, 16)
    is_bad = _quantize_tile(
        src,
        dst_values,
        dst_scales,
        tile,
        n_rows,
        n_cols,
        row_stride,
        tiles_k,
        tiles_per_mat,
        BN,
        BK,
        UE8M0,
        INT_ROUND,
        IS_BF16,
        AMAX_FLOOR_BITS,
    )
    tl.atomic_min(bad_ptr, t, mask=is_bad)


def _dims(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """(matrices, rows, cols, tiles along cols, tiles per matrix) of a 2-D or 3-D shape."""
    n, k = shape[-2:]
    mats = shape[0] if len(shape) == 3 else 1
    tiles_k = -(-k // block[1])
    return mats, n, k, tiles_k, -(-n // block[0]) * tiles_k


def quantize_into(
    x: torch.Tensor,
    values: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    use_ue8m0: bool,
    *,
    num_warps: int = 8,
    int_round: bool | None = None,
    bad: torch.Tensor | None = None,
) -> int | None:
    """Quantize ``x`` into contiguous ``values`` / ``scale_inv``; returns the first bad tile or None.

    Pass ``bad`` (``_common.bad_flag``) to collect non-finite reports from
    several launches and check once, without a synchronization per tensor.
    """
    if not x.is_contiguous():
        x = x.contiguous()
    mats, n, k, tiles_k, per_mat = _dims(tuple(x.shape), block)
    if mats * per_mat == 0:
        return None
    own_bad = bad is None
    flag = bad_flag(x.device) if bad is None else bad
    _single_kernel[(mats * per_mat,)](
        x.view(torch.int16),
        values.view(torch.uint8),
        scale_inv,
        flag,
        n,
        k,
        tiles_k,
        per_mat,
        BN=block[0],
        BK=block[1],
        UE8M0=use_ue8m0,
        INT_ROUND=triton_interpreting() if int_round is None else int_round,
        IS_BF16=x.dtype == torch.bfloat16,
        AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS,
        num_warps=num_warps,
    )
    return first_bad(flag) if own_bad else None


class QuantizeGroup:
    """One launch for many tensors of one dtype: one program per tile (``LaunchTable`` rows).

    Destinations are fixed (views of a persistent transfer buffer), so their addresses are
    tabled at construction; source addresses are re-sent only when they change.
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        outs: list[tuple[torch.Tensor, torch.Tensor]],
        block: tuple[int, int],
        use_ue8m0: bool,
        *,
        device: torch.device | None = None,
        num_warps: int = 8,
    ):
        """``sources`` give shapes and dtype only (meta tensors will do); ``outs`` are the destinations."""
        self.device = device if device is not None else outs[0][0].device
        self.is_bf16 = sources[0].dtype == torch.bfloat16
        self.block = block
        self.use_ue8m0 = use_ue8m0
        self.num_warps = num_warps
        dims = [_dims(tuple(s.shape), block) for s in sources]
        self.table = LaunchTable([m * per_mat for m, _, _, _, per_mat in dims], 1, outs, self.device, "FP8-block")
        self.dims = self.table.ints([d for _, *rest in dims for d in rest], torch.int64)
        self._rows_aligned = all(k % 16 == 0 for _, _, k, _, _ in dims) and all(v.data_ptr() % 16 == 0 for v, _ in outs)
        self._aligned = False

    def __call__(self, sources: list[torch.Tensor], bad: torch.Tensor, int_round: bool | None = None) -> None:
        table = self.table
        if table.bind(sources):
            self._aligned = self._rows_aligned and all(a % 16 == 0 for a in table.src_addresses)
        if table.programs == 0:
            return
        values_addr, scales_addr = table.out_addr
        _group_kernel[(table.programs,)](
            table.prog_tensor,
            table.prog_unit,
            self.dims,
            table.src_addr,
            values_addr,
            scales_addr,
            bad,
            BN=self.block[0],
            BK=self.block[1],
            UE8M0=self.use_ue8m0,
            INT_ROUND=triton_interpreting() if int_round is None else int_round,
            IS_BF16=self.is_bf16,
            AMAX_FLOOR_BITS=_AMAX_FLOOR_BITS,
            ALIGNED=self._aligned,
            num_warps=self.num_warps,
        )
