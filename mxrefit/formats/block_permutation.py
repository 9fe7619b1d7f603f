"""A learned byte permutation of MXFP8 bytes, cut into units a quantize kernel can write itself.

Why: on Hopper, vLLM's Marlin MXFP8 kernels read E4M3 bytes and scale bytes in an order of their
own. The engine learns that order as a byte gather (``engine/probed_layout.py``) and today moves
every byte a second time after it lands (about twice a copy of the bytes: half of a 48-layer
refit into vLLM 0.26 on an H100). A quantize kernel can write the engine's order directly when
the permutation has the shape described here, with no Marlin-specific byte order in mxrefit:
the order comes from the engine's own processing, so the bytes are exact by construction.

Learned from ``value_index`` (output value byte j reads checkpoint value byte ``value_index[j]``,
[N, K] row-major E4M3 bytes: block b is bytes [32 b, 32 b + 32), one MXFP8 block of one row)
and ``scale_index`` (the same for the scale bytes, [N, K / 32]: scale byte b belongs to block b):

- the output is cut into 64-byte chunks, and chunks and blocks into *units*: the connected
  groups of "this chunk reads a byte of that block". Every unit must read G whole blocks (each
  byte once) into C chunks, C x 64 = G x 32, with G and C powers of two (a program's tile);
- every unit must look alike, shifted: its blocks at ``unit_src[u] + block_pattern`` (source
  elements), its chunks at ``unit_out[u] + chunk_pattern`` (output bytes), the same
  ``local`` map from the unit's output bytes to its blocks' bytes (block rank x 32 + byte),
  and its scale bytes at ``unit_scale[u] + scale_pattern``.

vLLM 0.26's Marlin MXFP8 order (qkv, o, and the MoE's w13 and w2) is units of 8 blocks into 4
chunks (H100, 2026-12-06, docs/vllm.md). Anything else is refused with the rule it breaks, and the
engine keeps its own processing for that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # MXFP8 block: elements per scale, and E4M3 bytes of one block of one row
CHUNK = 64  # output bytes written as one run (a 64-byte line of the engine's tile)
MAX_UNIT_BYTES = 1 << 13  # one program's output: 8 KB of E4M3 (256 blocks) at most


@dataclass(frozen=True)
class BlockPermutation:
    """One expert's value and scale order as units of whole MXFP8 blocks (see the module doc)."""

    n_values: int  # E4M3 bytes of one expert (N x K)
    unit_src: torch.Tensor  # int64 (units,): source element offset of the unit's first block
    unit_out: torch.Tensor  # int64 (units,): output byte offset of the unit's first chunk
    unit_scale: torch.Tensor  # int64 (units,): scale byte offset of the unit's first block's scale
    block_pattern: torch.Tensor  # int64 (G,): each block's source element offset from unit_src, ascending
    chunk_pattern: torch.Tensor  # int64 (C,): each chunk's output byte offset from unit_out, ascending
    local: torch.Tensor  # int32 (C * 64,): output byte i of a unit takes the unit's block bytes at local[i]
    scale_pattern: torch.Tensor  # int64 (G,): each block's scale byte offset from unit_scale

    @property
    def blocks_per_unit(self) -> int:
        return self.block_pattern.numel()

    @property
    def chunks_per_unit(self) -> int:
        return self.chunk_pattern.numel()

    @property
    def units(self) -> int:
        return self.unit_src.numel()

    def to(self, device: torch.device | str) -> BlockPermutation:
        """The same tables on ``device``."""
        moved = {f: getattr(self, f).to(device) for f in self.__dataclass_fields__ if f != "n_values"}
        return BlockPermutation(self.n_values, **moved)

    @classmethod
    def of(cls, value_index: torch.Tensor, scale_index: torch.Tensor) -> BlockPermutation | str:
        """The units of a learned order, or the rule it breaks (a string: the caller keeps the
        engine's own processing for that tensor)."""
        idx = value_index.to(torch.int64).cpu()
        sidx = scale_index.to(torch.int64).cpu()
        n = idx.numel()
        if n == 0 or n % CHUNK:
            return f"{n} value bytes are not whole {CHUNK}-byte chunks (nor, then, whole {BLOCK}-byte blocks)"
        if not torch.equal(torch.bincount(idx, minlength=n), torch.ones(n, dtype=torch.int64)):
            return "the value order is not a permutation of the checkpoint's bytes (a byte read twice, or never)"
        blocks = n // BLOCK
        if sidx.numel() != blocks or not torch.equal(
            torch.bincount(sidx, minlength=blocks), torch.ones(blocks, dtype=torch.int64)
        ):
            return f"the scale order is not a permutation of the {blocks} scale bytes"
        chunks = n // CHUNK
        chunk_of = torch.arange(n) // CHUNK
        block_of = idx // BLOCK
        units = _units(chunk_of, block_of, chunks, blocks)
        if isinstance(units, str):
            return units
        chunk_label, block_label = units
        c_per, g_per = _uniform_count(chunk_label), _uniform_count(block_label)
        if c_per is None or g_per is None:
            return "the units differ in size (chunks or blocks per unit)"
        if c_per * CHUNK != g_per * BLOCK or c_per & (c_per - 1) or g_per & (g_per - 1):
            return f"a unit of {c_per} chunks and {g_per} blocks is not one power-of-two tile of whole blocks"
        if c_per * CHUNK > MAX_UNIT_BYTES:
            return f"a unit of {c_per * CHUNK} bytes is larger than one program's {MAX_UNIT_BYTES}"
        # chunk and block ids grouped by unit, each group ascending; both sides list the units in
        # label order (a label is the unit's first chunk), so row u is the same unit on both
        chunk_ids = torch.argsort(chunk_label * chunks + torch.arange(chunks)).view(-1, c_per)
        block_ids = torch.argsort(block_label * blocks + torch.arange(blocks)).view(-1, g_per)
        chunk_pattern = _shared(chunk_ids * CHUNK)
        block_pattern = _shared(block_ids * BLOCK)
        scale_at = torch.empty(blocks, dtype=torch.int64)
        scale_at[sidx] = torch.arange(blocks)  # where block b's scale byte lands
        scale_pattern = _shared(scale_at[block_ids])
        if chunk_pattern is None or block_pattern is None or scale_pattern is None:
            return "the units are not one shape shifted (chunk, block or scale offsets differ between units)"
        rank = torch.empty(blocks, dtype=torch.int64)
        rank[block_ids.reshape(-1)] = torch.arange(g_per).repeat(block_ids.shape[0])
        out_bytes = (chunk_ids[:, :, None] * CHUNK + torch.arange(CHUNK)).reshape(block_ids.shape[0], -1)
        src = idx[out_bytes]
        local = _shared(rank[src // BLOCK] * BLOCK + src % BLOCK, relative=False)
        if local is None:
            return "the units move their bytes differently (no one map from a unit's blocks to its chunks)"
        return cls(
            n_values=n,
            unit_src=(block_ids[:, 0] * BLOCK).contiguous(),
            unit_out=(chunk_ids[:, 0] * CHUNK).contiguous(),
            unit_scale=scale_at[block_ids[:, 0]].contiguous(),
            block_pattern=block_pattern,
            chunk_pattern=chunk_pattern,
            local=local.to(torch.int32),
            scale_pattern=scale_pattern,
        )

    def write_reference(
        self, values: torch.Tensor, scales: torch.Tensor, out_values: torch.Tensor, out_scales: torch.Tensor
    ) -> None:
        """Checkpoint-layout E4M3 ``values`` ([..., N, K]) and scale bytes into the learned order, by
        plain indexing (the tests' oracle for the kernel): per expert, unit by unit."""
        v = values.contiguous().view(torch.uint8).reshape(-1, self.n_values)
        s = scales.contiguous().view(torch.uint8).reshape(v.shape[0], -1)
        ov = out_values.view(torch.uint8).reshape(v.shape[0], -1)
        os_ = out_scales.view(torch.uint8).reshape(v.shape[0], -1)
        dev = v.device
        src = (self.unit_src[:, None] + self.block_pattern[None, :]).to(dev)  # (units, G) first byte of each block
        unit_bytes = (src[:, :, None] + torch.arange(BLOCK, device=dev)).reshape(self.units, -1)
        dest = (self.unit_out[:, None] + self.chunk_pattern[None, :]).to(dev)
        dest_bytes = (dest[:, :, None] + torch.arange(CHUNK, device=dev)).reshape(self.units, -1)
        scale_dest = (self.unit_scale[:, None] + self.scale_pattern[None, :]).to(dev)
        local = self.local.to(device=dev, dtype=torch.int64)
        for e in range(v.shape[0]):
            ov[e, dest_bytes.reshape(-1)] = v[e, unit_bytes][:, local].reshape(-1)
            os_[e, scale_dest.reshape(-1)] = s[e, src.reshape(-1) // BLOCK]


def _units(chunk_of: torch.Tensor, block_of: torch.Tensor, chunks: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Per chunk and per block, its unit's label (the smallest chunk id in it): label propagation
    over the edges (chunk of output byte j, block it reads), until no label moves."""
    big = chunks
    chunk_label = torch.arange(chunks)
    for _ in range(256):
        block_label = torch.full((blocks,), big).scatter_reduce(0, block_of, chunk_label[chunk_of], "amin")
        moved = torch.full((chunks,), big).scatter_reduce(0, chunk_of, block_label[block_of], "amin")
        if torch.equal(moved, chunk_label):
            return chunk_label, block_label
        chunk_label = moved
    return "the units did not settle in 256 rounds (chunks and blocks too entangled for one program)"


def _uniform_count(label: torch.Tensor) -> int | None:
    """How many members each unit has, if all have the same number."""
    counts = torch.bincount(label)
    counts = counts[counts > 0]
    return int(counts[0]) if bool((counts == counts[0]).all()) else None


def _shared(rows: torch.Tensor, relative: bool = True) -> torch.Tensor | None:
    """The one row every unit's row equals (after subtracting its first entry, if ``relative``), or None."""
    shifted = rows - rows[:, :1] if relative else rows
    first = shifted[0]
    return first.contiguous() if bool((shifted == first).all()) else None
