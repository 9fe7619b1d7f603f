"""FlashInfer TRT-LLM MXFP8 layouts as fixed gathers, computed once and applied in one pass.

What vLLM 0.32 does after loading an MXFP8 MoE layer for the TRT-LLM backend
(``layers/quantization/utils/flashinfer_utils.py``: ``prepare_fp8_moe_layer_for_fi`` and
``_shuffle_mxfp8_moe_weights``), per expert, on values and on scales alike:
1. ``swap_w13_to_w31``: rows ``[w1; w3] -> [w3; w1]`` (gated MoE only);
2. ``get_reorder_rows_for_gated_act_gemm_row_indices``: row ``2i`` <- ``i``, ``2i+1`` <- ``M/2 + i``
   (gated only);
3. ``get_shuffle_matrix_a_row_indices(M, epilogue_tile_m=128)``: within each 32-row block,
   ``arange(32).view(8, 4).T`` order;
4. scales only: ``block_scale_interleave`` into 128x4 tiles (``swizzle_mxfp8_scale``'s layout).
Every step is ``new = old[idx]`` along rows, so the three row steps compose into ONE row
permutation ``P = swap[reorder[shuffle]]`` (values: one gather), and the scale interleave is a
fixed byte map, so each scale tensor is one scatter with a precomputed index (padding bytes
stay zero from set-up). vLLM runs three gathers plus the interleave; this runs one pass each.
Linear layers (FlashInfer CUTLASS MXFP8 GEMM) only swizzle their scales
(``mxfp8_utils.swizzle_mxfp8_scale``), the same 128x4 map without a row permutation.

The formulas are checked on CPU against vLLM's own pure-torch ``swap_w13_to_w31`` and
``swizzle_mxfp8_scale`` and against the DESIGN.md formulas (tests/integration/test_trtllm_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mxrefit.devices import triton_kernels
from mxrefit.engine.staging import StagedUnit
from mxrefit.formats.kernel_layout import (
    TILE_COLS,
    TILE_ROWS,
    KernelLayout,
    interleave_index,
    interleaved_size,
    row_permutation,
)
from mxrefit.integrations.vllm.layout import EXPERTS, quantized_param_names, scale_param
from mxrefit.plan.types import Destination, ParamSpec, Target

SCALE_BLOCK = 32


def moe_row_order(gated: bool) -> str:
    """The ``KernelLayout`` row order of a MoE weight: w13 of a gated MoE, or any other."""
    return "trtllm-gated" if gated else "trtllm"


def moe_row_permutation(m: int, gated: bool) -> torch.Tensor:
    """The composed per-expert row permutation P (``kernel_rows = checkpoint_rows[P]``)."""
    return row_permutation(moe_row_order(gated), m)


def check_moe_alignment(name: str, rows: int, k: int) -> None:
    """The TRT-LLM MXFP8 MoE kernel keeps per-expert scale tensors unpadded: rows % 128, K % 128."""
    if rows % TILE_ROWS or k % (SCALE_BLOCK * TILE_COLS):
        raise ValueError(
            f"{name}: the FlashInfer TRT-LLM MXFP8 MoE layout needs per-expert rows divisible by {TILE_ROWS} "
            f"and K divisible by {SCALE_BLOCK * TILE_COLS}; got rows={rows}, K={k}"
        )


class MoeLayout:
    """Writes one MoE parameter (values or scales, [E, M, C]) into its TRT-LLM kernel layout."""

    def __init__(self, experts: int, rows: int, cols: int, gated: bool, device: torch.device, *, scales: bool):
        self.scales = scales
        self.perm = moe_row_permutation(rows, gated).to(device)
        self.kernels = triton_kernels("mxrefit.integrations.vllm._trtllm_triton", torch.device(device))
        if self.kernels is not None and not scales and cols % 8:
            self.kernels = None  # the row kernel moves 8-byte words
        self.out_per_expert = interleaved_size(rows, cols) if scales else rows * cols
        if scales:
            # scale byte (r, c) of the checkpoint lands at interleave(P^-1 (r), c)
            inv = torch.empty_like(self.perm)
            inv[self.perm] = torch.arange(rows, device=device)
            idx = interleave_index(rows, cols).to(device).view(rows, cols)
            self.scatter = idx[inv].reshape(-1)

    def __call__(self, staged: torch.Tensor, kernel: torch.Tensor) -> None:
        e = staged.shape[0]
        if self.kernels is not None:
            if self.scales:
                self.kernels.scale_interleave(staged, kernel.view(-1), self.perm, self.out_per_expert)
            else:
                self.kernels.row_gather(staged, kernel.view(staged.shape), self.perm)
        elif self.scales:
            kernel.view(e, -1).index_copy_(1, self.scatter, staged.reshape(e, -1))
        else:
            torch.index_select(staged, 1, self.perm, out=kernel.view(staged.shape))


class LinearScaleLayout:
    """``swizzle_mxfp8_scale`` as one scatter into a zeroed, padded flat kernel tensor."""

    def __init__(self, rows: int, cols: int, device: torch.device):
        self.kernels = triton_kernels("mxrefit.integrations.vllm._trtllm_triton", torch.device(device))
        self.scatter = interleave_index(rows, cols).to(device)
        self.out_bytes = interleaved_size(rows, cols)

    def __call__(self, staged: torch.Tensor, kernel: torch.Tensor) -> None:
        if self.kernels is not None:
            self.kernels.scale_interleave(staged.reshape(1, *staged.shape), kernel.view(-1), None, self.out_bytes)
        else:
            kernel.view(-1).index_copy_(0, self.scatter, staged.reshape(-1))


def _writers(dests: dict[str, Destination], param: str) -> list[tuple[str, int, Target]]:
    """(destination, part index, target) of every target landing in ``param``."""
    return [(d.name, i, t) for d in dests.values() for i, t in enumerate(d.targets) if t.param == param]


def _with_targets(dests: dict[str, Destination], new: dict[tuple[str, int], Target]) -> dict[str, Destination]:
    out = dict(dests)
    for name in {n for n, _ in new}:
        d = out[name]
        out[name] = replace(d, targets=tuple(new.get((name, i), t) for i, t in enumerate(d.targets)))
    return out


def moe_direct_targets(dests: dict[str, Destination], name: str, rows: int, k: int, gated: bool) -> dict[str, Destination] | None:
    """``dests`` with every target of MoE values param ``name`` ([E, rows, k]) and of its scales in
    the TRT-LLM kernel layout (written by the trainer's quantize kernel), or None where the
    sources do not allow it (a target that is not a row range of one expert, or an expert whose
    rows its sources do not cover exactly once). A source covering whole experts (grouped slabs,
    per-expert ``down_proj``) gets the layout on its own bytes; one covering a row range of an
    expert (per-expert ``gate_proj``/``up_proj``: the gated order interleaves the two, so neither
    owns a contiguous byte range) gets a shared region: the expert's whole range, with its first
    row there (``KernelLayout.row_offset``/``region_rows``), and the plan keeps the region's
    writers together (``mxrefit/plan/regions.py``). Checked by the caller: rows % 128 and
    K % 128 (``check_moe_alignment``), so the scale tiles have no padding and keep each expert's
    bytes and rows."""
    scales = {d: (j, t) for d, j, t in _writers(dests, scale_param(name))}
    order = moe_row_order(gated)
    kb = k // SCALE_BLOCK
    new = {}
    covered: dict[int, list[tuple[int, int]]] = {}  # region offset -> (first row, rows) of its writers
    for dname, i, t in _writers(dests, name):
        if dname not in scales or len(t.shape) not in (2, 3) or t.offset % k:
            return None
        j, st = scales[dname]
        expert, first = divmod(t.offset // k, rows)
        m = t.shape[-2]
        if m == rows and first == 0:
            new[(dname, i)] = replace(t, layout=KernelLayout(rows=order))
            new[(dname, j)] = replace(st, layout=KernelLayout(rows=order, tiles="128x4"))
            continue
        if len(t.shape) != 2 or first + m > rows or st.offset != (expert * rows + first) * kb or st.shape[0] != m:
            return None
        region = expert * rows
        covered.setdefault(region, []).append((first, m))
        new[(dname, i)] = replace(t, offset=region * k, layout=KernelLayout(order, None, first, rows))
        new[(dname, j)] = replace(st, offset=region * kb, layout=KernelLayout(order, "128x4", first, rows))
    for writers in covered.values():
        pos = 0
        for first, m in sorted(writers):
            if first != pos:
                return None
            pos += m
        if pos != rows:
            return None
    return _with_targets(dests, new) if new else None


def linear_scale_direct_targets(dests: dict[str, Destination], sname: str, rows: int, cols: int) -> dict[str, Destination] | None:
    """``dests`` with every target of linear scale param ``sname`` ([rows, cols]) 128x4-tiled at its
    place in the fused param's tiles, or None where a fused partition does not own whole 128-row
    tile bands (it starts off a band, or ends off one before the last): its bytes would share
    tiles with its neighbour's, and then the engine swizzles after the refit as before."""
    writers = _writers(dests, sname)
    cp = -(-cols // TILE_COLS) * TILE_COLS
    new = {}
    for dname, i, t in writers:
        row0, n = t.offset // cols, t.shape[0]
        if len(t.shape) != 2 or t.offset % cols or row0 % TILE_ROWS or (n % TILE_ROWS and row0 + n != rows):
            return None
        new[(dname, i)] = Target(sname, row0 * cp, t.shape, t.dtype, KernelLayout(tiles="128x4"))
    return _with_targets(dests, new)


@dataclass
class KernelTables:
    """An engine in FlashInfer's kernel layouts: its tables (kernel-layout targets where the
    trainer writes that layout), the staged units that bring the rest there after each refit,
    and the kernel tensors those units write (``LayoutEngine(params, destinations, units=..., kernel=...)``)."""

    params: dict[str, ParamSpec]
    destinations: dict[str, Destination]
    units: list[StagedUnit]
    kernel: dict[str, torch.Tensor]
    direct: list[str]  # params the trainer writes in their kernel layout: no pass after the refit


def vllm_mxfp8_kernel_tables(
    shape, params: dict[str, ParamSpec], dests: dict[str, Destination], device: torch.device, *, direct: bool = True
) -> KernelTables:
    """vLLM's MXFP8 checkpoint layout brought into the layout FlashInfer's kernels read: MoE values
    and scales shuffled and interleaved, linear scales swizzled.

    With ``direct`` every param whose sources allow it (``moe_direct_targets``,
    ``linear_scale_direct_targets``) is written by the trainer in that layout, in place; the
    others (and all with ``direct=False``) are staged in the checkpoint layout and moved by one
    pass each after their last bucket. ``shape`` is a ``mxrefit.plan.shapes.ModelShape``,
    ``params``/``dests`` its ``vllm_params``/``vllm_destinations`` in MXFP8.
    """
    params, dests = dict(params), dict(dests)
    units: list[StagedUnit] = []
    kernel: dict[str, torch.Tensor] = {}
    written: list[str] = []
    for name in quantized_param_names(shape):
        spec = params[name]
        sname = scale_param(name)
        sspec = params[sname]
        if name.endswith((f"{EXPERTS}.w13_weight", f"{EXPERTS}.w2_weight")):
            e, m, k = spec.shape
            check_moe_alignment(name, m, k)
            gated = name.endswith("w13_weight")
            laid = moe_direct_targets(dests, name, m, k, gated) if direct else None
            if laid is not None:
                dests = laid
                written += [name, sname]
                continue
            values = MoeLayout(e, m, k, gated, device, scales=False)
            scales = MoeLayout(e, m, k // SCALE_BLOCK, gated, device, scales=True)
            kernel[name] = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            kernel[sname] = torch.zeros(e * scales.out_per_expert, dtype=torch.uint8, device=device)

            def process_moe(t, name=name, sname=sname, values=values, scales=scales):
                values(t[name].view(torch.uint8), kernel[name].view(torch.uint8))
                scales(t[sname], kernel[sname])

            units.append(StagedUnit(name, (name, sname), process_moe))
        else:
            rows, cols = sspec.shape
            laid = linear_scale_direct_targets(dests, sname, rows, cols) if direct else None
            if laid is not None:
                dests = laid
                params[sname] = ParamSpec(sname, (interleaved_size(rows, cols),), torch.uint8)
                written.append(sname)
                continue
            layout = LinearScaleLayout(rows, cols, device)
            kernel[sname] = torch.zeros(layout.out_bytes, dtype=torch.uint8, device=device)

            def process_linear(t, sname=sname, layout=layout):
                layout(t[sname], kernel[sname])

            units.append(StagedUnit(sname, (sname,), process_linear))
    return KernelTables(params, dests, units, kernel, written)


def reference_kernel_bytes(name: str, checkpoint: torch.Tensor) -> torch.Tensor:
    """What ``vllm_mxfp8_units`` must hold for param ``name`` given its checkpoint-format bytes,
    computed by plain indexing (no fused scatter): the bench's independent check."""
    u8 = checkpoint.view(torch.uint8)
    if f"{EXPERTS}." in name:
        gated = ".w13_weight" in name
        perm = moe_row_permutation(u8.shape[1], gated).to(u8.device)
        rows = u8[:, perm]
        if not name.endswith("_scale"):
            return rows.reshape(-1)
        e, m, c = rows.shape
        tiles = rows.view(e, m // 128, 4, 32, c // 4, 4).permute(0, 1, 4, 3, 2, 5)
        return tiles.reshape(-1)
    n_rows, n_cols = u8.shape
    out = torch.zeros(interleaved_size(n_rows, n_cols), dtype=torch.uint8, device=u8.device)
    rp, cp = -(-n_rows // 128) * 128, -(-n_cols // 4) * 4
    padded = torch.zeros(rp, cp, dtype=torch.uint8, device=u8.device)
    padded[:n_rows, :n_cols] = u8
    out.copy_(padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
    return out
