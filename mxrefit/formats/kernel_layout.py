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

A *shared region* (``region_rows``, ``row_offset``): the part's m rows per expert are rows
[row_offset, row_offset + m) of a region of ``region_rows`` rows per expert, and the order and
tiling apply to the region. Per-expert gate and up tensors are the two halves of one expert's
w13 rows, which the gated order interleaves, so each is written into the same region at its
own rows; the plan keeps such parts on one byte range (``mxrefit/plan/regions.py``). Without a
region the part is its own region (offset 0, its own rows), as before regions existed.

A *learned order* (``order``, with the tables in ``permutation``): an engine that learned its
kernel's MXFP8 byte order from its own processing (vLLM's Marlin on Hopper, ``engine/probed_layout.py``)
advertises it as a ``BlockPermutation`` of one expert of the region, named by its digest, with
``order = "<digest>:values"`` on the values' target and ``"<digest>:scales"`` on the scales'. A
part of a region then writes the units that read its rows (``BlockPermutation.rows``). The
tables travel once in the engine's tables message, not per target (``plan/build.py``).

``write_reference`` is the plain-indexing definition (the torch path and the tests' oracle).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from mxrefit.formats.block_permutation import BlockPermutation

ROW_ORDERS = ("trtllm", "trtllm-gated")
TILINGS = ("128x4",)
ORDER_ROLES = ("values", "scales")
TILE_ROWS = 128
TILE_COLS = 4
SHUFFLE_BLOCK = 32


@dataclass(frozen=True)
class KernelLayout:
    """How an engine's kernel stores one part: a per-expert row order and/or a scale tiling."""

    rows: str | None = None
    tiles: str | None = None
    row_offset: int = 0
    region_rows: int | None = None  # rows per expert of the shared region; None: the part is its own region
    order: str | None = None  # a learned order: "<digest>:values" or "<digest>:scales"
    permutation: BlockPermutation | None = field(default=None, compare=False, repr=False)  # its tables (one expert)

    def __post_init__(self) -> None:
        if self.order is not None:
            digest, _, role = self.order.rpartition(":")
            if not digest or role not in ORDER_ROLES or self.rows is not None or self.tiles is not None:
                raise ValueError(f"a learned order is '<digest>:values' or '<digest>:scales' alone, got {self!r}")
            if self.permutation is not None and self.permutation.digest != digest:
                raise ValueError(f"learned order {digest} was given the tables of {self.permutation.digest}")
        elif self.rows is None and self.tiles is None:
            raise ValueError("a kernel layout names a row order, a tiling, or both (None means the checkpoint layout)")
        if self.rows is not None and self.rows not in ROW_ORDERS:
            raise ValueError(f"unknown kernel row order {self.rows!r}; known: {ROW_ORDERS}")
        if self.tiles is not None and self.tiles not in TILINGS:
            raise ValueError(f"unknown kernel tiling {self.tiles!r}; known: {TILINGS}")
        if self.region_rows is None and self.row_offset:
            raise ValueError(f"row offset {self.row_offset} without a region: a row offset places a part in a shared region")
        if self.region_rows is not None and not (self.region_rows > 0 and 0 <= self.row_offset < self.region_rows):
            raise ValueError(f"row offset {self.row_offset} is not a row of a region of {self.region_rows} rows")

    def __str__(self) -> str:
        order = None if self.order is None else f"learned {self.order[:8]}..{self.order.rpartition(':')[2]}"
        text = "+".join(f"{k}={v}" for k, v in (("rows", self.rows), ("tiles", self.tiles), ("order", order)) if v is not None)
        return text if self.region_rows is None else f"{text}+region=rows {self.row_offset}.. of {self.region_rows}"

    def to_msg(self) -> list:
        """``[rows, tiles]``, and ``row_offset, region_rows`` only for a shared region (so tables
        without regions keep the wire form and the plan digest they had)."""
        head: list = [self.rows or "", self.tiles or ""]
        if self.order is not None:  # and the order's name; its tables travel beside the targets
            return [*head, self.row_offset, self.region_rows or 0, self.order]
        return head if self.region_rows is None else [*head, self.row_offset, self.region_rows]

    @classmethod
    def from_msg(cls, msg: list, orders: dict[str, BlockPermutation] | None = None) -> KernelLayout:
        """The layout of ``to_msg``; a learned order takes its tables from ``orders`` (by digest)."""
        rows, tiles, *region = msg
        if len(region) == 3:
            order = str(region[2])
            perm = (orders or {}).get(order.rpartition(":")[0])
            if perm is None:
                raise ValueError(f"learned order {order[:40]!r} without its tables")
            return cls(None, None, int(region[0]), int(region[1]) or None, order, perm)
        if region:
            return cls(str(rows) or None, str(tiles) or None, int(region[0]), int(region[1]))
        return cls(str(rows) or None, str(tiles) or None)

    @property
    def order_role(self) -> str | None:
        """ "values" or "scales" for a learned order, else None."""
        return None if self.order is None else self.order.rpartition(":")[2]

    def part_order(self, shape: tuple[int, ...]) -> BlockPermutation | str:
        """The learned order's units a part of ``shape`` (its values' or scales' shape) writes: those
        that read its rows of the region (``BlockPermutation.rows``), or the rule it breaks."""
        if self.permutation is None:
            return f"learned order {self.order} has no tables"
        return _part_order(self, shape[-2], shape[-1] * (32 if self.order_role == "scales" else 1))

    @property
    def shared(self) -> bool:
        """Whether the part is a row range of a region other parts write too."""
        return self.region_rows is not None

    def region(self, m: int) -> int:
        """Rows per expert of the region a part of ``m`` rows per expert lands in."""
        return m if self.region_rows is None else self.region_rows

    def stored_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of the part's region in the engine's parameter (tile padding included)."""
        *lead, m, c = shape
        rows = self.region(m)
        if self.tiles is None:
            return math.prod(lead) * rows * c * dtype.itemsize
        return math.prod(lead) * interleaved_size(rows, c * dtype.itemsize)

    def padded(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        *lead, m, c = shape
        return self.stored_bytes(shape, dtype) != math.prod(lead) * self.region(m) * c * dtype.itemsize

    def kernel_rows(self, m: int) -> torch.Tensor:
        """Where each of the part's ``m`` checkpoint rows lands among its region's kernel rows."""
        rows = self.region(m)
        if self.rows is None:
            return torch.arange(self.row_offset, self.row_offset + m)
        return inverse_row_permutation(self.rows, rows)[self.row_offset : self.row_offset + m]


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
    m = shape[-2]
    if layout.shared and layout.row_offset + m > layout.region(m):
        return (
            f"the {role} have {m} rows per expert from row {layout.row_offset}, past the end of their "
            f"region of {layout.region(m)} rows"
        )
    if layout.order is not None:
        perm = layout.part_order(shape)
        if isinstance(perm, str):
            return perm
        cols = shape[-1] * (32 if layout.order_role == "scales" else 1)
        if layout.region(m) * cols != perm.n_values:
            return f"the learned order holds {perm.n_values} bytes per expert, the {role}' region {layout.region(m)} x {cols}"
        return None
    if layout.rows is not None and layout.region(m) % SHUFFLE_BLOCK:
        return (
            f"row order {layout.rows!r} permutes each expert's rows in blocks of {SHUFFLE_BLOCK}; "
            f"the {role} have {layout.region(m)} rows per expert{' in their region' if layout.shared else ''}"
        )
    return None


@functools.lru_cache(maxsize=256)
def _part_order(layout: KernelLayout, m: int, cols: int) -> BlockPermutation | str:
    """``layout.permutation``'s units for rows [row_offset, row_offset + m) of ``cols`` values each (cached:
    the key holds the order's digest, which names its tables)."""
    assert layout.permutation is not None
    return layout.permutation.rows(layout.row_offset, m, cols)


@functools.lru_cache(maxsize=256)
def _order_positions(layout: KernelLayout, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(part byte, region byte) pairs of one expert of a part in a learned order (cached beside
    ``_part_order``: a CPU refit writes the same parts every time)."""
    perm = layout.part_order(shape)
    if isinstance(perm, str):
        raise ValueError(f"cannot write learned order {layout}: {perm}")
    return perm.value_positions() if layout.order_role == "values" else perm.scale_positions()


@functools.lru_cache(maxsize=64)
def _tile_index(layout: KernelLayout, m: int, cb: int) -> torch.Tensor:
    """Flat [m * cb]: the offset, within one expert's tiled region, of each byte of the part's rows."""
    rows = layout.region(m)
    return interleave_index(rows, cb).view(rows, cb)[layout.kernel_rows(m)].reshape(-1)


def write_reference(layout: KernelLayout, part: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``part`` (checkpoint layout, [..., m, C]) into ``out`` (flat uint8, ``stored_bytes``: its
    whole region) in ``layout``, by plain indexing: its rows to their kernel rows, or its bytes to
    their tile offsets. A part that is its own region zeroes the tile padding first; a part of a
    shared region writes only its own rows' bytes (the plan refuses shared regions with padding)."""
    *lead, m, c = part.shape
    rows = part.contiguous().view(torch.uint8).reshape(math.prod(lead), m, -1)
    e, cb = rows.shape[0], rows.shape[2]
    if layout.order is not None:
        src, dst = _order_positions(layout, tuple(part.shape))
        out.view(e, -1)[:, dst.to(rows.device)] = rows.reshape(e, -1)[:, src.to(rows.device)]
        return
    if layout.tiles is None:
        out.view(e, layout.region(m), cb).index_copy_(1, layout.kernel_rows(m).to(rows.device), rows)
        return
    if not layout.shared:
        out.zero_()
    out.view(e, -1).index_copy_(1, _tile_index(layout, m, cb).to(rows.device), rows.reshape(e, -1))


def read_reference(layout: KernelLayout, stored: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``write_reference``: the checkpoint-layout part of ``shape``/``dtype`` whose
    kernel-layout bytes are in ``stored`` (flat uint8, its region). Engines use it to hand their own
    processing the checkpoint bytes a trainer wrote in the kernel layout (a check, never the refit path)."""
    *lead, m, c = shape
    e, cb = math.prod(lead), c * dtype.itemsize
    if layout.order is not None:
        src, dst = _order_positions(layout, tuple(shape))
        part = torch.empty(e, m * cb, dtype=torch.uint8, device=stored.device)
        part[:, src.to(stored.device)] = stored.view(e, -1)[:, dst.to(stored.device)]
        return part.view(dtype).view(shape)
    if layout.tiles is None:
        rows = stored.view(e, layout.region(m), cb)[:, layout.kernel_rows(m).to(stored.device)]
    else:
        rows = stored.view(e, -1)[:, _tile_index(layout, m, cb).to(stored.device)]
    return rows.contiguous().view(dtype).view(shape)
