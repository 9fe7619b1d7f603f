"""A rank's slice of whole-tensor bytes: checked once per engine, copied as strided runs.

The plan lays whole encoded tensors out in a bucket as runs (contiguous bytes of one whole
parameter), identically for every rank. A rank that stores a slice of that parameter
(``Shard``) copies only its slice's bytes: seen as ``[outer, L, inner]`` around the sliced
dim, a piece is the same window ``[start, stop)`` of every outer row, so the part of a piece
that one run covers is at most one 2-D strided copy (the outer rows wholly inside the run)
plus a partial row at either end. The copies are computed once per plan; every step applies
them with the rest of the bucket in one batched copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mxrefit.formats.mxfp8 import BLOCK
from mxrefit.plan.types import Destination, ParamSpec, Shard


@dataclass(frozen=True)
class Copy:
    """``rows`` rows of ``width`` bytes: bucket bytes at ``src`` (rows ``src_pitch`` apart) to
    the rank's storage at ``dst`` (rows ``dst_pitch`` apart)."""

    src: int
    src_pitch: int
    dst: int
    dst_pitch: int
    rows: int
    width: int


def local_nbytes(spec: ParamSpec, shard: Shard | None) -> int:
    """Bytes this rank stores of ``spec``."""
    if shard is None:
        return spec.nbytes
    return math.prod(shard.local_shape(spec.shape)) * spec.dtype.itemsize


def _shard_problems(name: str, spec: ParamSpec, shard: Shard) -> list[str]:
    shape = spec.shape
    if not 0 <= shard.dim < len(shape):
        return [f"shard of {name!r}: dim {shard.dim} is not a dim of its shape {shape}"]
    extent = shape[shard.dim]
    if shard.size < 1 or not shard.pieces:
        return [f"shard of {name!r}: it must hold at least one index (size {shard.size}, {len(shard.pieces)} pieces)"]
    problems = []
    covered = 0
    for start, stop, at in sorted(shard.pieces, key=lambda p: p[2]):
        if not 0 <= start < stop <= extent:
            problems.append(f"shard of {name!r}: piece [{start}, {stop}) is outside dim {shard.dim} of size {extent}")
        elif at != covered:
            problems.append(
                f"shard of {name!r}: the rank's indices along dim {shard.dim} must be covered once, in pieces; "
                f"index {covered} is {'written twice' if at < covered else 'never written'}"
            )
        covered = at + stop - start
    if not problems and covered != shard.size:
        problems.append(f"shard of {name!r}: pieces cover {covered} of the rank's {shard.size} indices along dim {shard.dim}")
    return problems


def _mxfp8_problems(dest: Destination, shards: Mapping[str, Shard], params: Mapping[str, ParamSpec]) -> list[str]:
    """Values and scales must be sliced alike; a K slice must fall on whole 32-value blocks."""
    values, scales = dest.targets[0].param, dest.targets[1].param
    sv, ss = shards.get(values), shards.get(scales)
    if sv is None and ss is None:
        return []
    if sv is None or ss is None:
        held, whole = (values, scales) if ss is None else (scales, values)
        return [
            f"tensor {dest.name!r}: this rank holds a slice of {held!r} but all of {whole!r}; "
            f"MXFP8 values and scales must be sliced together"
        ]
    ndim = len(params[values].shape)
    if sv.dim == ndim - 1 and any(e % BLOCK for p in sv.pieces for e in p):
        cols = ", ".join(f"[{a}, {b})" for a, b, _ in sv.pieces)
        return [
            f"tensor {dest.name!r}: this rank takes columns {cols} of {values!r}; an MXFP8 column slice must "
            f"start and end on multiples of {BLOCK} along K, since one scale byte covers {BLOCK} values"
        ]
    expected = mxfp8_scale_shard(sv, ndim)
    if ss != expected:
        return [
            f"tensor {dest.name!r}: the rank's slice of {scales!r} ({ss}) does not match its slice of "
            f"{values!r}; expected {expected}"
        ]
    return []


def mxfp8_scale_shard(values: Shard, ndim: int) -> Shard:
    """The slice of MXFP8 scales that goes with a slice of their values (a K slice counts blocks)."""
    if values.dim != ndim - 1:
        return values
    return Shard(values.dim, values.size // BLOCK, tuple((a // BLOCK, b // BLOCK, c // BLOCK) for a, b, c in values.pieces))


def check_shards(params: Mapping[str, ParamSpec], destinations: Mapping[str, Destination], shards: Mapping[str, Shard]) -> None:
    """Raise ValueError listing every shard that is malformed or that a format cannot honour."""
    problems = [f"shard of {n!r}: the engine has no such parameter" for n in shards if n not in params]
    for name, shard in shards.items():
        if name in params:
            problems += _shard_problems(name, params[name], shard)
    if not problems:
        for dest in destinations.values():
            laid = [t.param for t in dest.targets if t.layout is not None and t.param in shards]
            if laid:
                problems.append(
                    f"tensor {dest.name!r}: {laid[0]!r} is held in slices and its target has a kernel layout; a slice "
                    f"of permuted rows or scale tiles is not a slice of the checkpoint (advertise no layout there)"
                )
            elif dest.format == "mxfp8" and len(dest.targets) == 2:
                problems += _mxfp8_problems(dest, shards, params)
            elif dest.format != "bf16" and any(t.param in shards for t in dest.targets):
                problems.append(
                    f"tensor {dest.name!r}: slices of format {dest.format!r} are not modelled (only "
                    f"bf16 and mxfp8 weights can be held in slices)"
                )
    if problems:
        raise ValueError("engine shards refused:\n  " + "\n  ".join(problems))


def run_copies(src: int, param_offset: int, nbytes: int, spec: ParamSpec, shard: Shard | None) -> list[Copy]:
    """The copies that move whole-parameter bytes ``[param_offset, +nbytes)``, found at bucket
    offset ``src``, into this rank's storage (all of them when the rank holds the whole param)."""
    if shard is None:
        return [Copy(src, nbytes, param_offset, nbytes, 1, nbytes)]
    shape = spec.shape
    inner = math.prod(shape[shard.dim + 1 :]) * spec.dtype.itemsize
    outer = math.prod(shape[: shard.dim])
    pitch, local_pitch = shape[shard.dim] * inner, shard.size * inner
    a, e = param_offset, param_offset + nbytes
    copies = []
    for start, stop, at in shard.pieces:
        c, w = start * inner, (stop - start) * inner
        o_lo = max(0, (a - c - w) // pitch + 1)  # first outer row whose window ends after a
        o_hi = min(outer - 1, -((c - e) // pitch) - 1)  # last outer row whose window starts before e
        if o_lo > o_hi:
            continue
        f_lo, f_hi = max(o_lo, -((c - a) // pitch)), min(o_hi, (e - c - w) // pitch)  # windows wholly inside
        if f_lo <= f_hi:
            copies.append(
                _normalized(
                    Copy(src + f_lo * pitch + c - a, pitch, f_lo * local_pitch + at * inner, local_pitch, f_hi - f_lo + 1, w)
                )
            )
        for o in sorted({o_lo, o_hi}):
            if f_lo <= o <= f_hi:
                continue
            seg = o * pitch + c
            lo, hi = max(seg, a), min(seg + w, e)
            copies.append(Copy(src + lo - a, hi - lo, o * local_pitch + at * inner + lo - seg, hi - lo, 1, hi - lo))
    return copies


def _normalized(c: Copy) -> Copy:
    """Rows that sit back to back on both sides are one contiguous row."""
    if c.rows > 1 and c.src_pitch == c.width and c.dst_pitch == c.width:
        n = c.rows * c.width
        return Copy(c.src, n, c.dst, n, 1, n)
    return c


def strided(flat: torch.Tensor, offset: int, pitch: int, rows: int, width: int) -> torch.Tensor:
    """A [rows, width] uint8 view of the flat byte tensor ``flat`` (1-D when rows == 1)."""
    if rows == 1:
        return flat[offset : offset + width]
    end = offset + (rows - 1) * pitch + width
    if end > flat.numel():
        raise ValueError(f"strided view ends at byte {end}, past the {flat.numel()} bytes it views")
    return flat.as_strided((rows, width), (pitch, 1), flat.storage_offset() + offset)
