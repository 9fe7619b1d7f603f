"""Kernel layouts: an encoded part written in the order an engine's kernel reads, not the checkpoint's.

Why: FlashInfer's TRT-LLM MXFP8 kernels read MoE rows in a fixed per-expert order and scale
bytes in 128x4 tiles. An engine that receives the checkpoint's row-major bytes must move
every byte again after each refit; a quantize kernel that knows the layout writes each row
and each scale byte to its final offset in the same pass, so that second pass disappears.

A ``KernelLayout`` is the small descriptor an engine puts on a ``Target`` (the tables it sends
at set-up); a format that can write it does (``Format.check_layouts`` refuses the others,
naming the tensor and the rule). Two independent parts, each optional:

- ``rows``: a per-expert row permutation P over the part's last-but-one dim, with
  ``kernel_rows = checkpoint_rows[P]``: ``"trtllm"`` is FlashInfer's
  ``shuffle_matrix_a`` order (blocks of 32 rows read as [8, 4] and transposed), ``"trtllm-gated"``
  first turns [w1; w3] into [w3; w1] and interleaves the halves (``swap_w13_to_w31`` and
  ``reorder_rows_for_gated_act_gemm``), as vLLM 0.32 does for a gated MoE's w13;
- ``tiles``: ``"128x4"`` stores each [M, C] byte matrix (per expert) zero padded to
  [ceil(M/128)*128, ceil(C/4)*4] in 128x4 tiles (``block_scale_interleave``,
  ``swizzle_mxfp8_scale``): offset(r, c) = (r//128)*(Cp/4)*512 + (c//4)*512 + (r%32)*16 +
  ((r%128)//32)*4 + c%4. Its padding bytes are part of the stored bytes and are written zero.

``write_reference`` is the plain-indexing definition (the torch path and the tests' oracle).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROW_ORDERS = ("trtllm", "trtllm-gated")
TILINGS = ("128x4",)
TILE_ROWS = 128
TILE_COLS = 4
SHUFFLE_BLOCK = 32


@dataclass(frozen=True)
class KernelLayout:
    """How an engine's kernel stores one part: a per-expert row order and/or a scale tiling."""

    rows: str | None = None
    tiles: str | None = None

    def __post_init__(self) -> None:
        if self.rows is None and self.tiles is None:
            raise ValueError("a kernel layout names a row order, a tiling, or both (None means the checkpoint layout)")
        if self.rows is not None and self.rows not in ROW_ORDERS:
            raise ValueError(f"unknown kernel row order {self.rows!r}; known: {ROW_ORDERS}")
        if self.tiles is not None and self.tiles not in TILINGS:
            raise ValueError(f"unknown kernel tiling {self.tiles!r}; known: {TILINGS}")

    def __str__(self) -> str:
        return "+".join(f"{k}={v}" for k, v in (("rows", self.rows), ("tiles", self.tiles)) if v is not None)

    def to_msg(self) -> list[str]:
        return [self.rows or "", self.tiles or ""]

    @classmethod
    def from_msg(cls, msg: list) -> KernelLayout:
        rows, tiles = msg
        return cls(str(rows) or None, str(tiles) or None)

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes the part occupies in the engine's parameter (tile padding included)."""
        if self.tiles is None:
            return math.prod(shape) * dtype.itemsize
        *lead, m, c = shape
        return math.prod(lead) * interleaved_size(m, c * dtype.itemsize)

    def padded(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return self.stored_bytes(shape, dtype) != math.prod(shape) * dtype.itemsize


def swap_rows(m: int) -> torch.Tensor:
    """``idx`` with ``new = old[idx]`` turning rows [w1; w3] into [w3; w1]."""
    return (torch.arange(m) + m // 2) % m


def gated_reorder_rows(m: int) -> torch.Tensor:
    """Interleave the two halves: new row 2i is old row i, new row 2i+1 is old row m/2 + i."""
    half = torch.arange(m // 2)
    return torch.stack([half, half + m // 2], dim=1).reshape(m)


def shuffle_rows(m: int) -> torch.Tensor:
    """``shuffle_matrix_a``'s row order (epilogue tile 128): blocks of 32 rows read as [8, 4], transposed."""
    if m % SHUFFLE_BLOCK:
        raise ValueError(f"the TRT-LLM row shuffle needs a row count divisible by {SHUFFLE_BLOCK}, got {m}")
    return torch.arange(m).view(m // SHUFFLE_BLOCK, 8, 4).transpose(1, 2).reshape(m)


@functools.lru_cache(maxsize=64)
def row_permutation(order: str, m: int) -> torch.Tensor:
    """The composed per-expert permutation P of ``order`` (``kernel_rows = checkpoint_rows[P]``)."""
    p = shuffle_rows(m)
    if order == "trtllm-gated":
        p = swap_rows(m)[gated_reorder_rows(m)[p]]
    elif order != "trtllm":
        raise ValueError(f"unknown kernel row order {order!r}; known: {ROW_ORDERS}")
    return p


@functools.lru_cache(maxsize=64)
def inverse_row_permutation(order: str, m: int) -> torch.Tensor:
    """P^-1: checkpoint row r lands on kernel row ``inverse[r]``."""
    p = row_permutation(order, m)
    inv = torch.empty_like(p)
    inv[p] = torch.arange(m)
    return inv


def interleaved_size(rows: int, cols: int) -> int:
    """Bytes of the 128x4-tiled layout of a [rows, cols] byte matrix (zero padded)."""
    return (-(-rows // TILE_ROWS) * TILE_ROWS) * (-(-cols // TILE_COLS) * TILE_COLS)


@functools.lru_cache(maxsize=64)
def interleave_index(rows: int, cols: int) -> torch.Tensor:
    """For each byte (r, c) of a row-major [rows, cols] matrix, its offset in the 128x4 layout."""
    cp = -(-cols // TILE_COLS) * TILE_COLS
    r = torch.arange(rows).view(rows, 1)
    c = torch.arange(cols).view(1, cols)
    off = (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return off.reshape(-1)


def layout_problem(layout: KernelLayout, role: str, shape: tuple[int, ...]) -> str | None:
    """Why a part of ``shape`` cannot be written in ``layout`` (the rule), else None."""
    if len(shape) < 2:
        return f"a kernel layout needs a part of at least 2 dims, the {role} are {tuple(shape)}"
    if layout.rows is not None and shape[-2] % SHUFFLE_BLOCK:
        return (
            f"row order {layout.rows!r} permutes each expert's rows in blocks of {SHUFFLE_BLOCK}; "
            f"the {role} have {shape[-2]} rows per expert"
        )
    return None


def write_reference(layout: KernelLayout, part: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``part`` (checkpoint layout, [..., M, C]) into ``out`` (flat uint8, ``stored_bytes``) in
    ``layout``, by plain indexing: one row gather, then the tile view of the zero-padded matrix."""
    *lead, m, c = part.shape
    rows = part.contiguous().view(torch.uint8).reshape(math.prod(lead), m, -1)
    if layout.rows is not None:
        rows = rows[:, row_permutation(layout.rows, m).to(rows.device)]
    if layout.tiles is None:
        out.copy_(rows.reshape(-1))
        return
    e, cb = rows.shape[0], rows.shape[2]
    rp, cp = -(-m // TILE_ROWS) * TILE_ROWS, -(-cb // TILE_COLS) * TILE_COLS
    padded = torch.zeros(e, rp, cp, dtype=torch.uint8, device=rows.device)
    padded[:, :m, :cb] = rows
    tiles = padded.view(e, rp // TILE_ROWS, 4, 32, cp // TILE_COLS, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
    out.copy_(tiles.reshape(-1))


def read_reference(layout: KernelLayout, stored: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``write_reference``: the checkpoint-layout part of ``shape``/``dtype`` whose
    kernel-layout bytes are ``stored`` (flat uint8). Engines use it to hand their own processing
    the checkpoint bytes a trainer wrote in the kernel layout (a check, never the refit path)."""
    *lead, m, c = shape
    e, cb = math.prod(lead), c * dtype.itemsize
    if layout.tiles is None:
        rows = stored.view(e, m, cb)
    else:
        rp, cp = -(-m // TILE_ROWS) * TILE_ROWS, -(-cb // TILE_COLS) * TILE_COLS
        tiles = stored.view(e, rp // TILE_ROWS, cp // TILE_COLS, 32, 4, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
        rows = tiles.reshape(e, rp, cp)[:, :m, :cb]
    if layout.rows is not None:
        rows = rows[:, inverse_row_permutation(layout.rows, m).to(rows.device)]
    return rows.contiguous().view(dtype).view(shape)
