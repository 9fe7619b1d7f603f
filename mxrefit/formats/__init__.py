"""Wire formats: how one trainer tensor is encoded into the transfer buffer.

A format is a plug-in with one contract: ``parts`` says which byte parts a source tensor
becomes (shape, dtype each), ``check_source`` rejects sources it cannot encode, and
``encoder`` is built once per bucket for fixed destinations and then, every step, writes the
whole group of sources into their parts (one launch per group where the format has a fused
kernel), so per-step work does not grow with the tensor count.

Non-finite input: the sender either screens every source in a pass of its own before any byte
moves (``check_finite=True``, the default), or builds its encoders with ``screen=True``
(``check_finite=False``), and then every format reports NaN/Inf in ``bad`` in the same pass
that encodes: the quantized formats always do (their kernels see each block's amax), the
passthrough format only when asked (on CUDA its grouped copy tests exponents in the read it
makes anyway), so the default path never reads its bytes a second time for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mxrefit.devices import triton_kernels
from mxrefit.formats import fp8_block, mxfp8
from mxrefit.formats._common import NonFiniteError
from mxrefit.formats.block_permutation import BlockPermutation
from mxrefit.formats.finite_check import FiniteCheck
from mxrefit.formats.kernel_layout import KernelLayout, layout_problem, write_reference


@dataclass(frozen=True)
class PartSpec:
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype


Encoder = Callable[[Sequence[torch.Tensor], torch.Tensor], None]
Layouts = Sequence[Sequence[KernelLayout | None]]  # per source, per part: the engine's kernel layout or None


class Format(ABC):
    name: str

    @abstractmethod
    def parts(self, shape: tuple[int, ...], value_dtype: torch.dtype) -> tuple[PartSpec, ...]:
        """Encoded parts of a source of ``shape``; ``value_dtype`` is the engine's value dtype."""

    @abstractmethod
    def check_source(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raise ValueError naming ``name`` and the rule if this source cannot be encoded."""

    def check_layouts(self, name: str, parts: Sequence[PartSpec], layouts: Sequence[KernelLayout | None]) -> None:
        """Raise ValueError naming ``name`` and the rule unless this format can write its parts in
        the engine's kernel ``layouts`` (one per part, None = checkpoint layout). By default a
        format writes the checkpoint layout only."""
        for spec, layout in zip(parts, layouts):
            if layout is not None:
                raise ValueError(
                    f"tensor {name!r}: the engine asks for its {spec.role} in kernel layout {layout}; format "
                    f"{self.name} writes the checkpoint layout only"
                )

    @abstractmethod
    def encoder(
        self,
        sources: Sequence[tuple[tuple[int, ...], torch.dtype]],
        outs: Sequence[Sequence[torch.Tensor]],
        *,
        screen: bool = False,
        layouts: Layouts | None = None,
    ) -> Encoder:
        """Build, once, the step function that encodes sources of these specs into ``outs``.

        The returned callable takes the step's source tensors (in the same order) and an int32
        ``bad`` flag on the destination's device, which receives the smallest index of a
        source found non-finite. With ``screen`` (no separate screen ran) every format must
        report every non-finite source there; without, a format may leave ``bad`` untouched
        (the sender screened already) and should not spend a second read on it. ``layouts``
        (accepted by ``check_layouts``): a part with a kernel layout gets its flat stored bytes
        in ``outs`` (``Target.view``) and is written in that layout.
        """


def _checkpoint_layout_only(fmt: Format, layouts: Layouts | None) -> None:
    if layouts is not None and any(lay is not None for per_source in layouts for lay in per_source):
        raise ValueError(f"format {fmt.name} writes the checkpoint layout only (check_layouts refuses kernel layouts)")


class Passthrough(Format):
    """Sent as the engine's own dtype (norms, router, embeddings; everything in BF16 mode)."""

    name = "bf16"

    def parts(self, shape, value_dtype):
        return (PartSpec("value", tuple(shape), value_dtype),)

    def check_source(self, name, shape, dtype):
        if not (dtype.is_floating_point and dtype.itemsize >= 2):
            raise ValueError(f"tensor {name!r}: a {dtype} source cannot be sent as a plain floating-point weight")

    def encoder(self, sources, outs, *, screen=False, layouts=None):
        _checkpoint_layout_only(self, layouts)
        return _grouped_copy(sources, [o[0] for o in outs], screen)


def _grouped_copy(sources: Sequence[tuple[tuple[int, ...], torch.dtype]], dsts: list[torch.Tensor], screen: bool) -> Encoder:
    """Passthrough through one launch per source dtype where Triton runs
    (``_passthrough_triton.CopyGroup``): it copies same-dtype sources and tests their exponent bits
    in the same read. Used on CUDA with or without ``screen``: a bucket of BF16 experts is
    hundreds of 3 MB tensors, and ``_foreach_copy_`` of them ran at 65% of the copy rate on an
    H100 (2026-12-06), launch-bound; the test costs nothing in a memory-bound copy. Every other
    source (another dtype than its destination's, or no Triton) is copied by ``_foreach_copy_``,
    and screened (``FiniteCheck``: ``_foreach_norm`` on CPU) only with ``screen``. An unscreened
    CPU copy is all ``_foreach_copy_``: Triton's interpreter there is for checking the kernel."""
    device = dsts[0].device if dsts else torch.device("cpu")
    use_kernel = screen or device.type == "cuda"
    kernels = triton_kernels("mxrefit.formats._passthrough_triton", device) if use_kernel else None
    groups = []  # (indices, launch) per dtype the kernel copies
    rest = list(range(len(sources)))
    if kernels is not None:
        for dtype in kernels.DTYPES:
            idx = [i for i in rest if sources[i][1] == dtype and dsts[i].dtype == dtype]
            if idx:
                numels = [dsts[i].numel() for i in idx]
                groups.append((idx, kernels.CopyGroup(numels, dtype, [dsts[i] for i in idx], idx, device)))
        grouped = {i for idx, _ in groups for i in idx}
        rest = [i for i in rest if i not in grouped]
    rest_dsts = [dsts[i] for i in rest]
    check = FiniteCheck([sources[i] for i in rest], device) if rest and screen else None

    def encode(step_sources, bad):
        for idx, launch in groups:
            launch([step_sources[i] for i in idx], bad)
        if rest:
            srcs = [step_sources[i] for i in rest]
            torch._foreach_copy_(rest_dsts, srcs)
            if check is not None:
                first = check.first_bad(srcs)
                if first is not None:
                    bad.fill_(min(int(bad.item()), rest[first]))

    return encode


MakeGroup = Callable[[list[torch.Tensor], list[Sequence[torch.Tensor]], Layouts | None, torch.device], Callable]


def _kernel_encoder(
    sources: Sequence[tuple[tuple[int, ...], torch.dtype]],
    outs: Sequence[Sequence[torch.Tensor]],
    make_group: MakeGroup | None,
    encode_one: Callable[[torch.Tensor, Sequence[torch.Tensor], Sequence[KernelLayout | None]], None],
    layouts: Layouts | None = None,
) -> Encoder:
    """The step function of a quantized format: on CUDA one grouped kernel launch per input
    dtype the kernels take (BF16, FP16) and per kind of destination (checkpoint layout, or some
    part in a kernel layout), built once by ``make_group``; every other source through
    ``encode_one`` (the torch path), whose NonFiniteError lands in ``bad`` like the kernels'
    reports. Sources without kernel layouts get exactly the launches they had before layouts."""
    device = outs[0][0].device if outs else torch.device("cpu")
    per_source = [tuple(lay) for lay in layouts] if layouts is not None else [(None,) * len(o) for o in outs]
    laid_out = [any(lay is not None for lay in ls) for ls in per_source]
    groups = []  # (indices, launch) per input dtype the kernel takes and destination kind
    rest = list(range(len(sources)))
    if make_group is not None and device.type == "cuda":
        for dtype in (torch.bfloat16, torch.float16):
            for kind in (False, True):
                idx = [i for i, (_, dt) in enumerate(sources) if dt == dtype and laid_out[i] == kind]
                if idx:
                    shaped = [torch.empty(sources[i][0], dtype=dtype, device="meta") for i in idx]
                    group_layouts = [per_source[i] for i in idx] if kind else None
                    groups.append((idx, make_group(shaped, [outs[i] for i in idx], group_layouts, device)))
        grouped = {i for idx, _ in groups for i in idx}
        rest = [i for i in rest if i not in grouped]

    def encode(step_sources, bad):
        for idx, launch in groups:
            launch([step_sources[i] for i in idx], bad)
        for i in rest:
            try:
                encode_one(step_sources[i], outs[i], per_source[i])
            except NonFiniteError:
                bad.fill_(min(int(bad.item()), i))

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

    def check_layouts(self, name, parts, layouts):
        """Values: a row order only; scales: a row order and/or 128x4 tiles; one row order and one
        region for both (a scale byte must sit in the row of its values); a shared region without
        tile padding (no writer owns the padding bytes to zero them). A learned order: on both
        parts, the same one, each in its role, and its units must not mix this tensor's rows with
        another's (``BlockPermutation.rows``)."""
        for spec, layout in zip(parts, layouts):
            if layout is None:
                continue
            if spec.role == "values" and layout.tiles is not None:
                raise ValueError(f"tensor {name!r}: MXFP8 values are never tiled; the engine asks for values in {layout}")
            if layout.order is not None and layout.order_role != spec.role:
                raise ValueError(f"tensor {name!r}: the engine asks for its {spec.role} in the {layout.order_role}' order")
            problem = layout_problem(layout, spec.role, tuple(spec.shape))
            if problem is not None:
                raise ValueError(f"tensor {name!r}: cannot write kernel layout {layout}: {problem}")
            if layout.shared and layout.padded(tuple(spec.shape), spec.dtype):
                raise ValueError(
                    f"tensor {name!r}: cannot write kernel layout {layout}: the {spec.role}' region of "
                    f"{layout.region(spec.shape[-2])} rows is tile padded, and a region several sources share "
                    f"needs whole 128x4 tiles"
                )
        rows = [
            (lay.rows, lay.row_offset, lay.region_rows, lay.order and lay.order.rpartition(":")[0])
            if lay is not None
            else (None, 0, None, None)
            for lay in layouts
        ]
        if len(set(rows)) > 1:
            raise ValueError(
                f"tensor {name!r}: MXFP8 values and scales must share one row order and region (a scale byte sits "
                f"in its values' row); the engine asks for {layouts[0]} and {layouts[1]}"
            )

    def encoder(self, sources, outs, *, screen=False, layouts=None):  # the kernels and the torch path always report
        kernels = mxfp8._triton_module()
        min_byte = self.min_byte
        make_group = None
        if kernels is not None:

            def make_group(shaped, group_outs, group_layouts, device):
                group = kernels.QuantizeGroup(shaped, group_outs, device=device, layouts=group_layouts)
                return lambda srcs, bad: group(srcs, min_byte, bad)

        def encode_one(src, out, part_layouts):
            if not any(part_layouts):
                mxfp8.quantize(src, out=out[0], scale_out=out[1], backend="torch", zero_block_scale_one=bool(min_byte))
                return
            # the two-pass fallback (no kernel for this source): checkpoint layout, then the layout's gathers
            parts = mxfp8.quantize(src, backend="torch", zero_block_scale_one=bool(min_byte))
            for part, dst, layout in zip(parts, out, part_layouts):
                if layout is None:
                    dst.copy_(part)
                else:
                    write_reference(layout, part, dst)

        ordered = _learned_order_groups(sources, outs, layouts) if kernels is not None else {}
        if not ordered:
            return _kernel_encoder(sources, outs, make_group, encode_one, layouts)
        inside = {i for _, idx in ordered.values() for i in idx}
        rest = [i for i in range(len(sources)) if i not in inside]
        inner = _kernel_encoder(
            [sources[i] for i in rest],
            [outs[i] for i in rest],
            make_group,
            encode_one,
            [layouts[i] for i in rest] if layouts is not None else None,
        )
        launches = []
        for perm, idx in ordered.values():
            shaped = [torch.empty(sources[i][0], dtype=sources[i][1], device="meta") for i in idx]
            device = outs[idx[0]][0].device
            group = kernels.PermutedGroup(perm, shaped, [tuple(outs[i]) for i in idx], idx, device=device)
            launches.append((idx, group))

        def encode(step_sources, bad):
            for idx, group in launches:
                group([step_sources[i] for i in idx], min_byte, bad)
            if rest:
                inner([step_sources[i] for i in rest], bad)

        return encode


def _learned_order_groups(
    sources: Sequence[tuple[tuple[int, ...], torch.dtype]], outs: Sequence[Sequence[torch.Tensor]], layouts: Layouts | None
) -> dict[tuple, tuple[BlockPermutation, list[int]]]:
    """Sources on CUDA whose parts are in a learned order, grouped by the units they write (one
    ``PermutedGroup`` launch each: a layer's q and every layer's q alike, or all experts' gates)
    and source dtype."""
    groups: dict[tuple, tuple[BlockPermutation, list[int]]] = {}
    for i, per_part in enumerate(layouts or ()):
        lay = per_part[0] if per_part else None
        if lay is None or lay.order is None or sources[i][1] not in (torch.bfloat16, torch.float16):
            continue
        if outs[i][0].device.type != "cuda":
            continue
        perm = lay.part_order(tuple(sources[i][0]))
        if isinstance(perm, str):  # check_layouts refused it before any encoder was built
            raise ValueError(perm)
        key = (lay.order, lay.row_offset, tuple(sources[i][0][-2:]), sources[i][1])
        groups.setdefault(key, (perm, []))[1].append(i)
    return groups


class FP8Block(Format):
    """E4M3 values + one float32 scale_inv per 128x128 tile; bytes equal vLLM's ``per_block_cast_to_fp8``.

    ``use_ue8m0`` (format ``fp8-block-ue8m0``) sends power-of-two scales, what a DeepGEMM E8M0
    engine re-quantizes to after loading: the engine's weights are then one rounding of the
    trainer's, not two.
    """

    def __init__(self, use_ue8m0: bool = False):
        self.use_ue8m0 = use_ue8m0
        self.name = "fp8-block-ue8m0" if use_ue8m0 else "fp8-block"

    def parts(self, shape, value_dtype):
        return (
            PartSpec("values", tuple(shape), fp8_block.VALUE_DTYPE),
            PartSpec("scales", fp8_block.scale_shape(tuple(shape)), fp8_block.SCALE_DTYPE),
        )

    def check_source(self, name, shape, dtype):
        fp8_block.check_quantizable(tuple(shape), dtype, name)

    def encoder(self, sources, outs, *, screen=False, layouts=None):  # the kernels and the torch path always report
        _checkpoint_layout_only(self, layouts)
        kernels = fp8_block._triton_module()
        use_ue8m0 = self.use_ue8m0
        make_group = None
        if kernels is not None:

            def make_group(shaped, group_outs, group_layouts, device):
                return kernels.QuantizeGroup(shaped, group_outs, fp8_block.BLOCK, use_ue8m0, device=device)

        def encode_one(src, out, part_layouts):
            fp8_block.quantize(src, out=out[0], scale_out=out[1], use_ue8m0=use_ue8m0, backend="torch")

        return _kernel_encoder(sources, outs, make_group, encode_one)


FORMATS: dict[str, Format] = {f.name: f for f in (Passthrough(), MXFP8(), FP8Block(), FP8Block(use_ue8m0=True))}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {sorted(FORMATS)}") from None
