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

``QuantizeGroup(..., layouts=...)`` writes engines' kernel layouts (``formats/kernel_layout.py``)
in the same pass: only the destination offsets of each block's values and scale byte differ;
what is read, the scale byte, the rounding and the non-finite report are the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mxrefit.devices import triton_interpreting
from mxrefit.formats._common import bad_flag, first_bad
from mxrefit.formats._triton_common import LaunchTable, e4m3_rne, supports, widen_to_f32_bits
from mxrefit.formats.block_permutation import BlockPermutation
from mxrefit.formats.kernel_layout import KernelLayout, interleaved_size, inverse_row_permutation

__all__ = ["supports", "quantize_into", "quantize_permuted", "PermutedGroup", "QuantizeGroup"]


@triton.jit
def _block_bytes(raw, MIN_BYTE: tl.constexpr, INT_ROUND: tl.constexpr, IS_BF16: tl.constexpr):
    """Raw 16-bit words of blocks ([blocks, 32]) -> their E4M3 bytes, scale bytes (int32) and the
    bits of each block's largest magnitude (>= 0x7F800000: the block holds a NaN or Inf)."""
    bits = widen_to_f32_bits(raw, IS_BF16)
    mag = bits & 0x7FFFFFFF
    amag = tl.max(mag, axis=1)
    sb = (amag >> 23) - 8 + ((amag & 0x7FFFFF) > 0x600000).to(tl.int32)
    sb = tl.minimum(tl.maximum(sb, MIN_BYTE), 254)

    if INT_ROUND:
        byte = e4m3_rne(bits, sb[:, None])
    else:
        k = 127 - sb
        k1 = k >> 1
        f1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
        f2 = ((k - k1 + 127) << 23).to(tl.float32, bitcast=True)
        y = (bits.to(tl.float32, bitcast=True) * f1[:, None]) * f2[:, None]
        byte = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return byte, sb, amag


@triton.jit
def _quantize_blocks(
    src,
    dst_values,
    dst_scales,
    blk,
    value_at,
    scale_at,
    blk_mask,
    MIN_BYTE: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """Quantize blocks ``blk`` (consecutive runs of 32) of one tensor, each block's 32 value bytes
    to ``dst_values + value_at`` and its scale byte to ``dst_scales + scale_at``; returns which
    blocks were non-finite."""
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    byte, sb, amag = _block_bytes(tl.load(src + offs, mask=blk_mask[:, None], other=0), MIN_BYTE, INT_ROUND, IS_BF16)
    tl.store(dst_values + value_at[:, None] + tl.arange(0, 32)[None, :], byte, mask=blk_mask[:, None])
    tl.store(dst_scales + scale_at, sb.to(tl.uint8), mask=blk_mask)
    return blk_mask & (amag >= 0x7F800000)


@triton.jit
def _single_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    bad_ptr,
    n_blocks,
    MIN_BYTE: tl.constexpr,
    NB: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    pid = tl.program_id(0)
    if WIDE_INDEX:
        pid = pid.to(tl.int64)
    blk = pid * NB + tl.arange(0, NB)
    is_bad = _quantize_blocks(x_ptr, v_ptr, s_ptr, blk, blk * 32, blk, blk < n_blocks, MIN_BYTE, INT_ROUND, IS_BF16)
    lowest = tl.min(tl.where(is_bad, blk, 2147483647), axis=0).to(tl.int32)
    tl.atomic_min(bad_ptr, lowest, mask=lowest < 2147483647)


@triton.jit
def _tabled_pointers(src_addr, values_addr, scales_addr, t, ALIGNED: tl.constexpr):
    """Row ``t`` of the address tables: the source, value and scale pointers. The alignment hint is
    given here, on the loaded pointers: applied by the caller to the returned ones, Triton 3.6 (the
    device image's) drops it and every access goes scalar, 19x slower (docs/benchmarks.md, "The
    6.6x found and fixed"; tests/unit/test_kernel_codegen.py)."""
    src = tl.load(src_addr + t).to(tl.pointer_type(tl.int16))
    values = tl.load(values_addr + t).to(tl.pointer_type(tl.uint8))
    scales = tl.load(scales_addr + t).to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        values = tl.multiple_of(values, 16)
    return src, values, scales


@triton.jit
def _program_tensor(prog_tensor, prog_block, n_blocks_of, src_addr, values_addr, scales_addr, ALIGNED: tl.constexpr):
    """This program's row of the launch table: its tensor, first block and that tensor's block
    count, source, value and scale pointers (what every grouped kernel loads before its first read)."""
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    first = tl.load(prog_block + pid).to(tl.int64)
    n_blocks = tl.load(n_blocks_of + t)
    src, dst_values, dst_scales = _tabled_pointers(src_addr, values_addr, scales_addr, t, ALIGNED)
    return t, first, n_blocks, src, dst_values, dst_scales


@triton.jit
def _group_kernel(
    prog_tensor,
    prog_block,
    n_blocks_of,
    src_addr,
    values_addr,
    scales_addr,
    bad_ptr,
    MIN_BYTE: tl.constexpr,
    NB: tl.constexpr,
    ITERS: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Each program quantizes ITERS runs of NB blocks of one tensor: the table loads before its
    first read are paid once per ITERS runs (H200, 2026-12-05: 99.9% of the copy rate at NB 128,
    ITERS 4 against 92.8% at ITERS 1, the same bytes)."""
    t, first, n_blocks, src, dst_values, dst_scales = _program_tensor(
        prog_tensor, prog_block, n_blocks_of, src_addr, values_addr, scales_addr, ALIGNED
    )
    any_bad = tl.zeros((), dtype=tl.int32)
    for i in tl.static_range(ITERS):
        blk = first + i * NB + tl.arange(0, NB)
        is_bad = _quantize_blocks(src, dst_values, dst_scales, blk, blk * 32, blk, blk < n_blocks, MIN_BYTE, INT_ROUND, IS_BF16)
        any_bad = tl.maximum(any_bad, tl.max(is_bad.to(tl.int32), axis=0))
    tl.atomic_min(bad_ptr, t, mask=any_bad > 0)


@triton.jit
def _layout_group_kernel(
    prog_tensor,
    prog_block,
    n_blocks_of,
    src_addr,
    values_addr,
    scales_addr,
    bad_ptr,
    rows_of,
    region_rows_of,
    row_offset_of,
    kblocks_of,
    inverse_addr,
    tiled_of,
    tile_bytes_of,
    col_groups_of,
    MIN_BYTE: tl.constexpr,
    NB: tl.constexpr,
    ITERS: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """``_group_kernel`` writing kernel layouts: block (expert e, row m, block column kb) of a
    tensor with m_rows rows per expert in a region of R rows per expert from row ``row_offset``
    (R = m_rows, offset 0 unless the region is shared) lands on kernel row
    ``e*R + inverse[row_offset + m]``; its scale byte at that row's place in the 128x4 tiles
    (``tile_bytes`` per expert, ``col_groups`` = ceil(KB/4)) when the tensor's scales are tiled,
    else row-major."""
    t, first, n_blocks, src, dst_values, dst_scales = _program_tensor(
        prog_tensor, prog_block, n_blocks_of, src_addr, values_addr, scales_addr, ALIGNED
    )
    inverse = tl.load(inverse_addr + t).to(tl.pointer_type(tl.int32))
    m_rows = tl.load(rows_of + t)
    kblocks = tl.load(kblocks_of + t)
    row_offset = tl.load(row_offset_of + t)
    region_rows = tl.load(region_rows_of + t)
    tile_bytes = tl.load(tile_bytes_of + t)
    col_groups = tl.load(col_groups_of + t)
    tiled = tl.load(tiled_of + t) != 0
    any_bad = tl.zeros((), dtype=tl.int32)
    for i in tl.static_range(ITERS):
        blk = first + i * NB + tl.arange(0, NB)
        blk_mask = blk < n_blocks
        row = blk // kblocks
        kb = blk - row * kblocks
        e = row // m_rows
        km = tl.load(inverse + row_offset + (row - e * m_rows), mask=blk_mask, other=0).to(tl.int64)
        krow = e * region_rows + km
        tiled_at = (
            e * tile_bytes + (km // 128) * col_groups * 512 + (kb // 4) * 512 + (km % 32) * 16 + ((km % 128) // 32) * 4 + kb % 4
        )
        scale_at = tl.where(tiled, tiled_at, krow * kblocks + kb)
        is_bad = _quantize_blocks(
            src, dst_values, dst_scales, blk, (krow * kblocks + kb) * 32, scale_at, blk_mask, MIN_BYTE, INT_ROUND, IS_BF16
        )
        any_bad = tl.maximum(any_bad, tl.max(is_bad.to(tl.int32), axis=0))
    tl.atomic_min(bad_ptr, t, mask=any_bad > 0)


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
    serves 2-D and 3-D tensors alike. Pass ``bad`` (``_common.bad_flag``)
    to collect non-finite reports from several launches and check once, without a
    synchronization per tensor.
    """
    if not x.is_contiguous():
        x = x.contiguous()
    n_blocks = x.numel() // 32
    if n_blocks == 0:
        return None
    if int_round is None:
        int_round = triton_interpreting()
    own_bad = bad is None
    flag = bad_flag(x.device) if bad is None else bad
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _single_kernel[grid](
        x.view(torch.int16),
        values.view(torch.uint8),
        scales,
        flag,
        n_blocks,
        MIN_BYTE=min_byte,
        NB=blocks_per_program,
        INT_ROUND=int_round,
        IS_BF16=x.dtype == torch.bfloat16,
        WIDE_INDEX=x.numel() >= 2**31,
        num_warps=num_warps,
    )
    return first_bad(flag) if own_bad else None


@triton.jit
def _permuted_kernel(
    src_addr,
    values_addr,
    scales_addr,
    caller_index,
    unit_src,
    unit_out,
    unit_scale,
    block_pattern,
    chunk_pattern,
    local,
    scale_pattern,
    bad_ptr,
    units,
    R: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    MIN_BYTE: tl.constexpr,
    INT_ROUND: tl.constexpr,
    IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Units [R q, R q + R) of instance i (one expert of one source: program (i, q)) of a
    ``BlockPermutation``: their G whole blocks each read (64 bytes a block), quantized, their bytes
    put in the engine's order in registers and written as C runs of 64 bytes each; the scale bytes
    to their places. Addresses come from tables (instances of many tensors in one launch); a
    non-finite block reports ``caller_index[i]``."""
    i = tl.program_id(0)
    u = tl.program_id(1) * R + tl.arange(0, R)
    live = u < units
    src, values, scales = _tabled_pointers(src_addr, values_addr, scales_addr, i, ALIGNED)
    first = tl.load(unit_src + u, mask=live, other=0)
    at = tl.multiple_of(tl.reshape(first[:, None] + tl.load(block_pattern + tl.arange(0, G))[None, :], (R * G,)), 32)
    in_unit = tl.reshape(tl.broadcast_to(live[:, None], (R, G)), (R * G,))
    raw = tl.load(src + at[:, None] + tl.arange(0, 32)[None, :], mask=in_unit[:, None], other=0)
    byte, sb, amag = _block_bytes(raw, MIN_BYTE, INT_ROUND, IS_BF16)
    pick = tl.arange(0, R)[:, None] * (G * 32) + tl.load(local + tl.arange(0, C * 64))[None, :]
    picked = tl.gather(tl.reshape(byte, (R * G * 32,)), tl.reshape(pick, (R * C * 64,)), 0)
    head = tl.load(unit_out + u, mask=live, other=0)
    to = tl.multiple_of(tl.reshape(head[:, None] + tl.load(chunk_pattern + tl.arange(0, C))[None, :], (R * C,)), 64)
    chunk_live = tl.reshape(tl.broadcast_to(live[:, None], (R, C)), (R * C,))
    tl.store(values + to[:, None] + tl.arange(0, 64)[None, :], tl.reshape(picked, (R * C, 64)), mask=chunk_live[:, None])
    sat = tl.load(unit_scale + u, mask=live, other=0)
    scale_to = tl.reshape(sat[:, None] + tl.load(scale_pattern + tl.arange(0, G))[None, :], (R * G,))
    tl.store(scales + scale_to, sb.to(tl.uint8), mask=in_unit)
    any_bad = tl.max((in_unit & (amag >= 0x7F800000)).to(tl.int32), axis=0)
    tl.atomic_min(bad_ptr, tl.load(caller_index + i), mask=any_bad > 0)


def _per_program(perm: BlockPermutation, blocks_per_program: int) -> int:
    """Units a program takes: the most, as a power of two (at least one), that fit ``blocks_per_program``."""
    return 1 << max(0, (blocks_per_program // perm.blocks_per_unit).bit_length() - 1)


class PermutedGroup:
    """One launch writing many tensors that share one learned order (``BlockPermutation``: the
    same layers' q, say, or every expert's gate), each straight into the engine's order.

    Why a group: a MoE's experts are thousands of trainer tensors alike (128 gates per layer), and
    a launch each costs more than their bytes. Each tensor's experts are instances (program grid
    dim 0); destinations are fixed, so their addresses are tabled once; source addresses are
    re-sent only when they change. A non-finite block reports the tensor's ``index``."""

    def __init__(
        self,
        perm: BlockPermutation,
        sources: Sequence[torch.Tensor],
        outs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        indices: Sequence[int],
        *,
        device: torch.device,
        blocks_per_program: int = 128,
        num_warps: int = 4,
    ):
        """``sources`` give shapes and dtype only (meta tensors will do): [..., rows, K] with
        ``perm.source_elements`` elements per expert; ``outs`` hold ``perm.n_values`` value bytes and
        ``n_values / 32`` scale bytes per expert."""
        self.perm = perm.to(device)
        self.device = device
        self.is_bf16 = sources[0].dtype == torch.bfloat16
        self.per_program = _per_program(perm, blocks_per_program)
        self.num_warps = num_warps
        self.experts: list[int] = []
        values, scales, which = [], [], []
        for s, (v, sc), index in zip(sources, outs, indices):
            experts, rem = divmod(s.numel(), perm.source_elements)
            out_v, out_s = v.numel() * v.element_size(), sc.numel() * sc.element_size()
            if s.dtype not in (torch.bfloat16, torch.float16) or s.dtype != sources[0].dtype:
                raise ValueError(f"a permuted write needs BF16 or FP16 sources of one dtype, got {s.dtype}")
            if rem or experts == 0 or out_v != experts * perm.n_values or out_s != experts * (perm.n_values // 32):
                raise ValueError(
                    f"a permuted write of {perm.source_elements} elements into {perm.n_values} bytes per expert got "
                    f"{s.numel()} elements, {out_v} value and {out_s} scale bytes"
                )
            self.experts.append(experts)
            values += [v.data_ptr() + e * perm.n_values for e in range(experts)]
            scales += [sc.data_ptr() + e * (perm.n_values // 32) for e in range(experts)]
            which += [index] * experts
        self.instances = len(values)
        self._aligned_out = all(a % 16 == 0 for a in values)
        self.values_addr = torch.tensor(values, dtype=torch.int64, device=device)
        self.scales_addr = torch.tensor(scales, dtype=torch.int64, device=device)
        self.caller_index = torch.tensor(which, dtype=torch.int32, device=device)
        self._bound: list[int] | None = None
        self.src_addr: torch.Tensor | None = None
        self._aligned = False

    def _bind(self, sources: Sequence[torch.Tensor]) -> None:
        ptrs = [t.data_ptr() for t in sources]
        if ptrs == self._bound:
            return
        step = self.perm.source_elements * 2
        addrs = [p + e * step for p, n in zip(ptrs, self.experts) for e in range(n)]
        self.src_addr = torch.tensor(addrs, dtype=torch.int64).to(self.device)
        self._aligned = self._aligned_out and all(a % 16 == 0 for a in addrs)
        self._bound = ptrs

    def __call__(self, sources: Sequence[torch.Tensor], min_byte: int, bad: torch.Tensor, int_round: bool | None = None) -> None:
        """Write every tensor; ``sources`` are the planned ones (the sender checked shapes and contiguity)."""
        if self.instances == 0 or self.perm.units == 0:
            return
        self._bind(sources)
        p = self.perm
        _permuted_kernel[(self.instances, triton.cdiv(p.units, self.per_program))](
            self.src_addr,
            self.values_addr,
            self.scales_addr,
            self.caller_index,
            p.unit_src,
            p.unit_out,
            p.unit_scale,
            p.block_pattern,
            p.chunk_pattern,
            p.local,
            p.scale_pattern,
            bad,
            p.units,
            R=self.per_program,
            G=p.blocks_per_unit,
            C=p.chunks_per_unit,
            MIN_BYTE=min_byte,
            INT_ROUND=triton_interpreting() if int_round is None else int_round,
            IS_BF16=self.is_bf16,
            ALIGNED=self._aligned,
            num_warps=self.num_warps,
        )


def quantize_permuted(
    x: torch.Tensor,
    perm: BlockPermutation,
    values: torch.Tensor,
    scales: torch.Tensor,
    min_byte: int,
    bad: torch.Tensor,
    *,
    blocks_per_program: int = 128,
    num_warps: int = 4,
    int_round: bool | None = None,
) -> None:
    """Quantize ``x`` ([..., N, K], one ``perm`` per expert of the leading dims) straight into the
    engine's order: ``values`` and ``scales`` hold ``perm``'s bytes per expert. ``bad`` gets the
    lowest expert holding a NaN or Inf; every byte is written either way. (One tensor; a
    ``PermutedGroup`` of one, for the profile scripts and tests.)"""
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():
        raise ValueError(f"a permuted write needs a contiguous BF16 or FP16 source, got {x.dtype} with strides {x.stride()}")
    experts, rem = divmod(x.numel(), perm.source_elements)
    if rem or experts == 0:
        raise ValueError(f"a permuted write of {perm.source_elements} elements per expert got {x.numel()} elements")
    v, s = values.reshape(-1).view(torch.uint8), scales.reshape(-1).view(torch.uint8)
    if v.numel() != experts * perm.n_values or s.numel() != experts * perm.n_values // 32:
        raise ValueError(
            f"a permuted write of {perm.n_values} bytes per expert got {v.numel()} value and {s.numel()} scale bytes "
            f"for {experts} experts"
        )
    outs = [
        (v[e * perm.n_values : (e + 1) * perm.n_values], s[e * perm.n_values // 32 : (e + 1) * perm.n_values // 32])
        for e in range(experts)
    ]
    one = x.reshape(experts, -1)
    group = PermutedGroup(
        perm, list(one), outs, list(range(experts)), device=x.device, blocks_per_program=blocks_per_program, num_warps=num_warps
    )
    group(list(one), min_byte, bad, int_round)


class _LayoutTables:
    """Per-tensor tables of ``_layout_group_kernel``: rows per expert, the region's rows and the
    tensor's first row in it, block columns, the region's inverse row permutation (identity where
    the layout keeps the rows), and the scale tiling."""

    def __init__(self, table: LaunchTable, sources: list[torch.Tensor], layouts: Sequence[Sequence[KernelLayout | None]]):
        rows, region_rows, row_offset, kblocks, tiled, tile_bytes, col_groups = [], [], [], [], [], [], []
        self.inverses: list[torch.Tensor] = []  # kept alive: the kernel reads them by address
        for s, (values, scales) in zip(sources, layouts):
            m, kb = s.shape[-2], s.shape[-1] // 32
            lay = scales if scales is not None else values  # check_layouts: one row order and region for both
            assert lay is not None
            region = lay.region(m)
            inverse = torch.arange(region) if lay.rows is None else inverse_row_permutation(lay.rows, region)
            self.inverses.append(inverse.to(device=table.device, dtype=torch.int32))
            rows.append(m)
            region_rows.append(region)
            row_offset.append(lay.row_offset)
            kblocks.append(kb)
            tiled.append(int(scales is not None and scales.tiles is not None))
            tile_bytes.append(interleaved_size(region, kb))
            col_groups.append(-(-kb // 4))
        self.rows_of = table.ints(rows, torch.int64)
        self.region_rows_of = table.ints(region_rows, torch.int64)
        self.row_offset_of = table.ints(row_offset, torch.int64)
        self.kblocks_of = table.ints(kblocks, torch.int64)
        self.inverse_addr = table.ints([i.data_ptr() for i in self.inverses], torch.int64)
        self.tiled_of = table.ints(tiled, torch.int32)
        self.tile_bytes_of = table.ints(tile_bytes, torch.int64)
        self.col_groups_of = table.ints(col_groups, torch.int64)


class QuantizeGroup:
    """One launch for many tensors (``LaunchTable`` rows of ``blocks_per_program`` x ``iters`` blocks each).

    Destinations are fixed (views of a persistent transfer buffer), so their addresses are
    tabled at construction; source addresses are re-sent only when they change. With
    ``layouts`` (per tensor: the values' and the scales' ``KernelLayout`` or None) every block
    is written in its kernel layout (``_layout_group_kernel``); scale parts whose tiles are padded
    are zeroed first (one ``_foreach_zero_``), since the kernel writes data bytes only (never a
    shared region: ``check_layouts`` refuses padding there).
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        outs: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device | None = None,
        blocks_per_program: int = 128,
        iters: int = 4,
        num_warps: int = 4,
        layouts: Sequence[Sequence[KernelLayout | None]] | None = None,
    ):
        """``sources`` give shapes and dtype only (meta tensors will do); ``outs`` are the destinations.
        ``iters``: runs of ``blocks_per_program`` blocks per program, so the table loads before a
        program's first read are paid once per ``iters`` runs (``scripts/gpu_pack_profile.py``, H100,
        2026-12-06: the kernel-layout launch at 96-98% of the copy rate with 4 against 87-88% with 1;
        the plain launch 98-100% either way, 99.9% against 92.8% on the H200 on 2026-12-05)."""
        self.device = device if device is not None else outs[0][0].device
        self.is_bf16 = sources[0].dtype == torch.bfloat16
        self.nb = blocks_per_program
        self.iters = iters
        self.num_warps = num_warps
        n_blocks = [s.numel() // 32 for s in sources]
        self.table = LaunchTable(n_blocks, self.nb * self.iters, outs, self.device, "MXFP8")
        self.n_blocks_of = self.table.ints(n_blocks, torch.int64)
        self._values_aligned = all(v.data_ptr() % 16 == 0 for v, _ in outs)
        self._aligned = False
        self.layout = _LayoutTables(self.table, sources, layouts) if layouts is not None else None
        self._padded = [
            o[1]
            for s, o, lay in zip(sources, outs, layouts or ())
            if lay[1] is not None and lay[1].padded(tuple(s.shape[:-1]) + (s.shape[-1] // 32,), torch.uint8)
        ]

    def __call__(self, sources: list[torch.Tensor], min_byte: int, bad: torch.Tensor, int_round: bool | None = None) -> None:
        table = self.table
        if table.bind(sources):
            self._aligned = self._values_aligned and all(a % 16 == 0 for a in table.src_addresses)
        if table.programs == 0:
            return
        values_addr, scales_addr = table.out_addr
        common = (table.prog_tensor, table.prog_unit, self.n_blocks_of, table.src_addr, values_addr, scales_addr, bad)
        constants = dict(
            MIN_BYTE=min_byte,
            NB=self.nb,
            INT_ROUND=triton_interpreting() if int_round is None else int_round,
            IS_BF16=self.is_bf16,
            ALIGNED=self._aligned,
            num_warps=self.num_warps,
        )
        lay = self.layout
        if lay is None:
            _group_kernel[(table.programs,)](*common, ITERS=self.iters, **constants)
            return
        if self._padded:
            torch._foreach_zero_(self._padded)
        _layout_group_kernel[(table.programs,)](
            *common,
            lay.rows_of,
            lay.region_rows_of,
            lay.row_offset_of,
            lay.kblocks_of,
            lay.inverse_addr,
            lay.tiled_of,
            lay.tile_bytes_of,
            lay.col_groups_of,
            ITERS=self.iters,
            **constants,
        )
