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

import functools
import hashlib
from dataclasses import dataclass

import torch

BLOCK = 32  # MXFP8 block: elements per scale, and E4M3 bytes of one block of one row
CHUNK = 64  # output bytes written as one run (a 64-byte line of the engine's tile)
MAX_UNIT_BYTES = 1 << 13  # one program's output: 8 KB of E4M3 (256 blocks) at most
MAX_TABLE_BYTES = 1 << 20  # a table on the wire: the control channel's largest binary field (transport/protocol.py)


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

    @property
    def source_elements(self) -> int:
        """Elements of one expert of the source these units read: ``n_values`` for a whole order,
        fewer for the rows of one part (``rows``)."""
        return self.units * self.blocks_per_unit * BLOCK

    def to(self, device: torch.device | str) -> BlockPermutation:
        """The same tables on ``device``."""
        moved = {f: getattr(self, f).to(device) for f in _TABLES}
        return BlockPermutation(self.n_values, **moved)

    def to_msg(self) -> dict:
        """The tables as msgpack-able data: int32 bytes (every offset is within one expert, whose
        bytes ``of`` keeps below 2 GiB); raises ValueError past ``MAX_TABLE_BYTES`` a table."""
        problem = self.wire_problem()
        if problem:
            raise ValueError(problem)
        msg: dict = {"n_values": self.n_values}
        for f in _TABLES:
            msg[f] = getattr(self, f).cpu().to(torch.int32).contiguous().numpy().tobytes()
        return msg

    def wire_problem(self) -> str | None:
        """Why ``to_msg`` would refuse these tables (a table past ``MAX_TABLE_BYTES`` as int32), or
        None; an engine asks before it offers an order, without encoding the tables twice."""
        for f in _TABLES:
            size = getattr(self, f).numel() * 4
            if size > MAX_TABLE_BYTES:
                return f"the order's {f} table is {size} bytes, more than one message field takes ({MAX_TABLE_BYTES})"
        return None

    @classmethod
    def from_msg(cls, msg: dict) -> BlockPermutation:
        """The tables of ``to_msg``, checked for the shapes a kernel relies on (a peer's data)."""
        n = int(msg["n_values"])
        tables = {
            f: torch.frombuffer(bytearray(msg[f]), dtype=torch.int32).to(torch.int32 if f == "local" else torch.int64)
            for f in _TABLES
        }
        perm = cls(n, **tables)
        problem = perm._problem()
        if problem is not None:
            raise ValueError(f"a learned MXFP8 order of {n} bytes is malformed: {problem}")
        return perm

    def _problem(self) -> str | None:
        """Why these tables cannot describe whole units of a permutation of ``n_values`` bytes."""
        g, c, u = self.blocks_per_unit, self.chunks_per_unit, self.units
        if self.n_values <= 0 or self.n_values % CHUNK:
            return f"{self.n_values} bytes are not whole {CHUNK}-byte chunks"
        if g == 0 or c * CHUNK != g * BLOCK or g & (g - 1) or c * CHUNK > MAX_UNIT_BYTES:
            return f"a unit of {g} blocks into {c} chunks is not one power-of-two tile of at most {MAX_UNIT_BYTES} bytes"
        if u * g * BLOCK != self.n_values or self.unit_out.numel() != u or self.unit_scale.numel() != u:
            return f"{u} units of {g * BLOCK} bytes do not make {self.n_values} bytes"
        if self.local.numel() != c * CHUNK or self.scale_pattern.numel() != g:
            return "the unit-local tables have the wrong length"
        if bool((self.local < 0).any()) or bool((self.local >= g * BLOCK).any()):
            return "a unit-local byte reads outside its unit"
        if not torch.equal(torch.sort(self.index()).values, torch.arange(self.n_values)):
            return "the tables do not describe a permutation of the bytes"
        if not torch.equal(torch.sort(self.scale_index()).values, torch.arange(self.n_values // BLOCK)):
            return "the scale tables do not describe a permutation of the scale bytes"
        return None

    @functools.cached_property
    def digest(self) -> str:
        """A name for these tables (sha256 of their bytes): what plans and their digests refer to.
        Cached: every target in a learned order checks it, and the tables are never changed in place."""
        h = hashlib.sha256(str(self.n_values).encode())
        for f in _TABLES:
            h.update(getattr(self, f).cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:24]

    def index(self) -> torch.Tensor:
        """The value gather (int64, on the CPU): output byte j reads checkpoint byte ``index()[j]``
        (-1 where no unit here writes it: the other parts' bytes of a region)."""
        src, dst = self.value_positions()
        index = torch.full((self.n_values,), -1, dtype=torch.int64)
        index[dst] = src
        return index

    def scale_index(self) -> torch.Tensor:
        """The scale gather (int64, on the CPU): output scale byte j reads scale byte ``scale_index()[j]`` (-1: none)."""
        src, dst = self.scale_positions()
        index = torch.full((self.n_values // BLOCK,), -1, dtype=torch.int64)
        index[dst] = src
        return index

    def rows(self, first: int, count: int, cols: int) -> BlockPermutation | str:
        """The units that read rows [first, first + count) of a [N, ``cols``] region, their sources
        shifted to that part's own first element: what a trainer tensor holding only those rows
        writes (q of a fused qkv, one expert's gate of w13). The rule, as a string, where a unit
        reads rows of both the part and another (then no part can write it alone)."""
        lo, hi = first * cols, (first + count) * cols
        if not (0 <= lo < hi <= self.n_values):
            return f"rows {first}..{first + count} of {cols} elements lie outside the order's {self.n_values} bytes"
        start = self.unit_src[:, None] + self.block_pattern[None, :]
        inside = (start >= lo) & (start < hi)
        whole = inside.all(dim=1)
        if not bool((whole | ~inside.any(dim=1)).all()):
            return f"a unit of the engine's order reads rows {first}..{first + count} and rows of another tensor"
        keep = whole.nonzero().reshape(-1)
        if keep.numel() * self.blocks_per_unit * BLOCK != hi - lo:
            return f"the units inside rows {first}..{first + count} do not cover them"
        return BlockPermutation(
            n_values=self.n_values,
            unit_src=(self.unit_src[keep] - lo).contiguous(),
            unit_out=self.unit_out[keep].contiguous(),
            unit_scale=self.unit_scale[keep].contiguous(),
            block_pattern=self.block_pattern,
            chunk_pattern=self.chunk_pattern,
            local=self.local,
            scale_pattern=self.scale_pattern,
        )

    @classmethod
    def of(cls, value_index: torch.Tensor, scale_index: torch.Tensor) -> BlockPermutation | str:
        """The units of a learned order, or the rule it breaks (a string: the caller keeps the
        engine's own processing for that tensor)."""
        idx = value_index.to(torch.int64).cpu()
        sidx = scale_index.to(torch.int64).cpu()
        n = idx.numel()
        if n >= 2**31:
            return f"{n} value bytes per expert: offsets past 2 GiB do not fit the tables' int32"
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

    def value_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(source byte, output byte) of every value byte these units move, flat int64 on the CPU:
        ``out[dst] = src_bytes[src]`` writes the order, ``src_bytes[src] = out[dst]`` reads it back."""
        t = self.to("cpu")
        local = t.local.to(torch.int64)
        src = (t.unit_src[:, None] + t.block_pattern[None, :])[:, local // BLOCK] + local % BLOCK
        dst = ((t.unit_out[:, None] + t.chunk_pattern[None, :])[:, :, None] + torch.arange(CHUNK)).reshape(self.units, -1)
        return src.reshape(-1), dst.reshape(-1)

    def scale_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(source scale byte, output scale byte) of every block these units move, flat int64 on the CPU."""
        t = self.to("cpu")
        src = (t.unit_src[:, None] + t.block_pattern[None, :]) // BLOCK
        dst = t.unit_scale[:, None] + t.scale_pattern[None, :]
        return src.reshape(-1), dst.reshape(-1)

    def write_reference(
        self, values: torch.Tensor, scales: torch.Tensor, out_values: torch.Tensor, out_scales: torch.Tensor
    ) -> None:
        """Checkpoint-layout E4M3 ``values`` ([..., rows, K], ``source_elements`` per expert) and their
        scale bytes into the learned order (``n_values`` bytes per expert), by plain indexing: the
        tests' oracle for the kernel, and the torch path."""
        experts = values.numel() // self.source_elements
        for part, out, (src, dst) in ((values, out_values, self.value_positions()), (scales, out_scales, self.scale_positions())):
            rows = part.contiguous().view(torch.uint8).reshape(experts, -1)
            out.view(torch.uint8).reshape(experts, -1)[:, dst.to(rows.device)] = rows[:, src.to(rows.device)]


_TABLES = ("unit_src", "unit_out", "unit_scale", "block_pattern", "chunk_pattern", "local", "scale_pattern")


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
