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

import functools

import torch

from mxrefit.devices import triton_kernels
from mxrefit.engine.staging import StagedUnit
from mxrefit.integrations.vllm.layout import EXPERTS, quantized_param_names, scale_param

SCALE_BLOCK = 32
TILE_ROWS = 128
TILE_COLS = 4


def swap_rows(m: int) -> torch.Tensor:
    """``idx`` with ``new = old[idx]`` turning rows [w1; w3] into [w3; w1]."""
    return (torch.arange(m) + m // 2) % m


def gated_reorder_rows(m: int) -> torch.Tensor:
    """Interleave the two halves: new row 2i is old row i, new row 2i+1 is old row m/2 + i."""
    half = torch.arange(m // 2)
    return torch.stack([half, half + m // 2], dim=1).reshape(m)


def shuffle_rows(m: int, epilogue_tile_m: int = TILE_ROWS) -> torch.Tensor:
    """``shuffle_matrix_a``'s row order: blocks of 32 rows read as [8, 4] and transposed."""
    if m % 32:
        raise ValueError(f"the TRT-LLM row shuffle needs a row count divisible by 32, got {m}")
    return torch.arange(m).view(m // 32, 8, 4).transpose(1, 2).reshape(m)


@functools.lru_cache(maxsize=64)
def moe_row_permutation(m: int, gated: bool) -> torch.Tensor:
    """The composed per-expert row permutation P (``kernel_rows = checkpoint_rows[P]``)."""
    p = shuffle_rows(m)
    if gated:
        p = swap_rows(m)[gated_reorder_rows(m)[p]]
    return p


def interleaved_size(rows: int, cols: int) -> int:
    """Bytes of the 128x4-tiled scale layout of a [rows, cols] scale matrix (zero padded)."""
    return (-(-rows // TILE_ROWS) * TILE_ROWS) * (-(-cols // TILE_COLS) * TILE_COLS)


@functools.lru_cache(maxsize=64)
def interleave_index(rows: int, cols: int) -> torch.Tensor:
    """For each byte (r, c) of a row-major [rows, cols] scale matrix, its offset in the 128x4 layout.

    offset = (r//128)·(Cp/4)·512 + (c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4 (DESIGN.md).
    """
    cp = -(-cols // TILE_COLS) * TILE_COLS
    r = torch.arange(rows).view(rows, 1)
    c = torch.arange(cols).view(1, cols)
    off = (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return off.reshape(-1)


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


def vllm_mxfp8_units(shape, params: dict, device: torch.device) -> tuple[list, dict[str, torch.Tensor]]:
    """Staged units and kernel tensors that turn vLLM's MXFP8 checkpoint layout into the layout
    FlashInfer's kernels read: MoE values and scales shuffled/interleaved, linear scales swizzled.

    ``shape`` is a ``mxrefit.plan.shapes.ModelShape``, ``params`` its ``vllm_params(shape, mxfp8=True)``.
    Returns (units, kernel) for ``LayoutEngine(..., units=units, kernel=kernel)``.
    """
    units, kernel = [], {}
    for name in quantized_param_names(shape):
        spec = params[name]
        sname = scale_param(name)
        sspec = params[sname]
        if name.endswith((f"{EXPERTS}.w13_weight", f"{EXPERTS}.w2_weight")):
            e, m, k = spec.shape
            check_moe_alignment(name, m, k)
            gated = name.endswith("w13_weight")
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
            layout = LinearScaleLayout(rows, cols, device)
            kernel[sname] = torch.zeros(layout.out_bytes, dtype=torch.uint8, device=device)

            def process_linear(t, sname=sname, layout=layout):
                layout(t[sname], kernel[sname])

            units.append(StagedUnit(sname, (sname,), process_linear))
    return units, kernel


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
