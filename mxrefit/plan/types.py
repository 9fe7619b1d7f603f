"""What an engine tells mxrefit: its parameter storage and where each trainer tensor lands.

An engine is described by two tables, built once from the live model:
- ``params``: every destination parameter (engine name -> shape, dtype), whose storage is
  contiguous and written in place (parameter identity kept, CUDA graphs stay valid);
- ``destinations``: every trainer (HF) tensor name -> its format and, for each encoded part
  (values, scales), a ``Target``: a contiguous byte range of one parameter.
Both are plain data, so they cross the control channel as msgpack.

A target may carry a ``KernelLayout`` (``mxrefit.formats.kernel_layout``): the engine's kernel
reads that part in another order than the checkpoint's (FlashInfer's TRT-LLM MoE rows, 128x4
scale tiles), and the trainer's encoder writes it so, straight into its final place. A target
without one takes the checkpoint layout, as before layouts existed.

An engine rank that holds only a slice of some parameters (tensor or expert parallelism)
still describes the WHOLE parameters in both tables, so every rank of a multi-rank engine
builds the same plan (one digest for all, full tensors on the wire); ``shards`` then says,
per parameter, which slice this rank stores, and the receiver copies only those bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mxrefit.formats.kernel_layout import KernelLayout


@dataclass(frozen=True)
class Target:
    """One encoded part of a trainer tensor: ``shape``/``dtype`` bytes at ``offset`` in ``param``,
    in the checkpoint layout, or in ``layout`` (then ``nbytes`` counts its tile padding too, and
    for a shared region is the whole region, whose other rows other targets write)."""

    param: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: KernelLayout | None = None

    @property
    def nbytes(self) -> int:
        if self.layout is not None:
            return self.layout.stored_bytes(self.shape, self.dtype)
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The part's ``nbytes`` flat uint8 bytes as its encoder writes them: typed and shaped in the
        checkpoint layout, flat bytes in a kernel layout."""
        return flat if self.layout is not None else flat.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Destination:
    """Where the trainer tensor ``name`` goes: its wire format and one Target per part."""

    name: str
    format: str
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Shard:
    """The slice of a whole parameter that one engine rank stores.

    Along ``dim`` the rank's tensor has ``size`` indices (every other dim is whole); each
    piece ``(start, stop, at)`` puts the whole parameter's indices ``[start, stop)`` at the
    rank's indices ``[at, at + stop - start)``. Column-parallel rows (q/k/v, gate/up) are
    pieces along dim 0 (two pieces for a fused [gate; up]), row-parallel columns (o_proj,
    down_proj) one piece along the last dim, expert parallelism one piece along the expert dim.
    """

    dim: int
    size: int
    pieces: tuple[tuple[int, int, int], ...]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The rank's tensor shape for a whole parameter of ``shape``."""
        return (*shape[: self.dim], self.size, *shape[self.dim + 1 :])
