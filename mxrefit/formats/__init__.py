"""Wire formats: how one trainer tensor is encoded into the transfer buffer.

A format is a plug-in with one contract: ``parts`` says which byte parts a source tensor
becomes (shape, dtype each), ``check_source`` rejects sources it cannot encode, and
``encoder`` is built once per bucket for fixed destinations and then, every step, writes the
whole group of sources into their parts (one launch per group where the format has a fused
kernel), so per-step work does not grow with the tensor count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mxrefit.formats import mxfp8


@dataclass(frozen=True)
class PartSpec:
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype


Encoder = Callable[[Sequence[torch.Tensor], torch.Tensor], None]


class Format(ABC):
    name: str

    @abstractmethod
    def parts(self, shape: tuple[int, ...], value_dtype: torch.dtype) -> tuple[PartSpec, ...]:
        """Encoded parts of a source of ``shape``; ``value_dtype`` is the engine's value dtype."""

    @abstractmethod
    def check_source(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raise ValueError naming ``name`` and the rule if this source cannot be encoded."""

    @abstractmethod
    def encoder(self, sources: Sequence[tuple[tuple[int, ...], torch.dtype]], outs: Sequence[Sequence[torch.Tensor]]) -> Encoder:
        """Build, once, the step function that encodes sources of these specs into ``outs``.

        The returned callable takes the step's source tensors (in the same order) and an int32
        ``bad`` flag on the destination's device, which receives the smallest index of a
        source found non-finite (formats that cannot see it leave it untouched).
        """


class Passthrough(Format):
    """Sent as the engine's own dtype (norms, router, embeddings; everything in BF16 mode)."""

    name = "bf16"

    def parts(self, shape, value_dtype):
        return (PartSpec("value", tuple(shape), value_dtype),)

    def check_source(self, name, shape, dtype):
        if not (dtype.is_floating_point and dtype.itemsize >= 2):
            raise ValueError(f"tensor {name!r}: a {dtype} source cannot be sent as a plain floating-point weight")

    def encoder(self, sources, outs):
        dsts = [o[0] for o in outs]

        def encode(step_sources, bad):
            if dsts:
                torch._foreach_copy_(dsts, list(step_sources))

        return encode


class MXFP8(Format):
    """E4M3 values + E8M0 scale bytes per 32 along K; bytes equal vLLM's quantization."""

    name = "mxfp8"

    def __init__(self, zero_block_scale_one: bool = False):
        self.min_byte = 1 if zero_block_scale_one else 0

    def parts(self, shape, value_dtype):
        return (
            PartSpec("values", tuple(shape), mxfp8.VALUE_DTYPE),
            PartSpec("scales", mxfp8.scale_shape(tuple(shape)), mxfp8.SCALE_DTYPE),
        )

    def check_source(self, name, shape, dtype):
        mxfp8.check_quantizable(tuple(shape), dtype, name)

    def encoder(self, sources, outs):
        kernels = mxfp8._triton_module()
        device = outs[0][0].device if outs else torch.device("cpu")
        fused_ok = kernels is not None and device.type == "cuda"
        groups = []  # (indices, QuantizeGroup) per input dtype the kernel takes
        rest = list(range(len(sources)))
        if fused_ok:
            for dtype in (torch.bfloat16, torch.float16):
                idx = [i for i, (_, dt) in enumerate(sources) if dt == dtype]
                if idx:
                    shaped = [torch.empty(sources[i][0], dtype=dtype, device="meta") for i in idx]
                    groups.append((idx, kernels.QuantizeGroup(shaped, [outs[i] for i in idx], device=device)))
            grouped = {i for idx, _ in groups for i in idx}
            rest = [i for i in rest if i not in grouped]
        zero_one = bool(self.min_byte)

        def encode(step_sources, bad):
            for idx, group in groups:
                group([step_sources[i] for i in idx], self.min_byte, bad)
            for i in rest:
                values, scales = outs[i]
                try:
                    mxfp8.quantize(step_sources[i], out=values, scale_out=scales, backend="torch", zero_block_scale_one=zero_one)
                except mxfp8.NonFiniteError:
                    bad.fill_(min(int(bad.item()), i))

        return encode


FORMATS: dict[str, Format] = {f.name: f for f in (Passthrough(), MXFP8())}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {sorted(FORMATS)}") from None
