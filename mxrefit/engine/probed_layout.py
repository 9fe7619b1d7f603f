"""Post-load processing learned once as a fixed byte gather, by probing the processing itself.

Why: some backends' post-load processing is a pure byte permutation run slowly. vLLM's Marlin
MXFP8 path on Hopper (``MarlinMxfp8LinearKernel``, Marlin MoE) packs fp8 bytes into int32
words, repacks them into Marlin tiles (``gptq_marlin_repack``) and permutes the e8m0 scales
through bf16 and back, looping over experts in Python: 2.5 s per refit for Qwen3-30B-A3B. No
byte of the result is computed, each is copied from one input byte, so for one module
*signature* (classes, shapes, dtypes) the whole processing is ``kernel = staged[index]``, and
that index can be read off the processing by feeding it index-coded inputs:
- per expert, the staged inputs' bytes are laid end to end (T bytes); probe d puts digit d
  (base 256) of ``o + 1`` at byte offset o, the same in every expert; the kernel's bytes after
  the D probes (D: base-256 digits of T) spell, per output byte, 1 + the offset it came from (0: from no input byte);
- a probe of seeded random bytes, different per expert, and then the real weights check the
  learned gather against the processing byte for byte: content-dependent processing
  (arithmetic, sorting, cross-expert moves) that happens to fit the index probes fails there;
- tensors the processing keeps beside its parameters (``watch``) must hold the same bytes
  after every probe, else skipping the processing would leave them stale.
Refusals are reasons (strings), never exceptions: the caller keeps the slow path for them.
Whatever the outcome, ``derive`` ends by processing the real weights, so the module serves
them. ``ProbedLayout.apply`` then runs one gather per kernel tensor: a Triton kernel on CUDA
that reads the per-expert index once for all experts, ``index_select`` elsewhere, writing into
the kernel tensors' bytes in place (CUDA graphs hold their addresses). Where every 1 KB output
block reads at most 64 aligned 16-byte input chunks (Marlin's tiles do), a second kernel loads
those chunks whole instead of byte by byte (``ChunkTable``); ``derive`` times both once on the
device and keeps the faster. Both write the same bytes, and the checks below run the one kept.

What the callables must do (vLLM: ``process`` = ``_process_with_vllm(module, ·)``): ``process`` runs
the full processing from checkpoint-format tensors and leaves the results in the tensors
``read_kernel`` returns (in place or not: they are read after each run); ``read_kernel`` returns
only tensors whose bytes come from the staged ones (empty placeholders are skipped); anything
else the processing keeps (Marlin's ``workspace``) belongs in ``watch``. The cache key must
fix everything else the processing depends on: classes (module, quant method, kernel), shapes
and dtypes of staged and kernel tensors, the parameter dtype scales pass through (e8m0 through
bf16 or fp32 is exact; through fp16 it is not, and the validation refuses).

Output bytes no input feeds are refused, zero padding included (Marlin pads weights whose
shapes miss its tiles, ``marlin_padded_nk``): such modules keep the slow path.

Engine-agnostic: only torch (triton lazily); tests/test_probed_layout.py checks it on CPU
against the TRT-LLM layout of ``integrations/vllm/trtllm.py``, vLLM's own Marlin MXFP8 steps that run
on CPU, a Marlin-like repack and negative controls.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import torch

from mxrefit.devices import sync_current, triton_kernels

Tensors = dict[str, torch.Tensor]
VALIDATION_SEED = 20260605
CHECK_BYTES = 1 << 26  # scratch for checking a learned gather against the processing
CHUNK_BLOCK, CHUNK_BYTES = 1024, 16  # the chunked kernel's output block and input chunk (Marlin: 16x64 tiles, 16-byte rows)
OTHER_KERNEL_WINS = 0.95  # another kernel is kept only if it took less than this share of the byte gather's time
TILE_PERIODS = tuple(1 << p for p in range(6, 17))  # 64 B .. 64 KB: output tiles a periodic index may repeat over
LEARNED_LAYOUT_ENV = "MXREFIT_LEARNED_LAYOUT"
LEARNED_LAYOUT_MODES = ("0", "1", "quantized")


def learned_layout_mode(device_type: str, value: str | None = None) -> str:
    """What an engine on ``device_type`` learns, from ``value`` (default: ``MXREFIT_LEARNED_LAYOUT``).

    "1": modules whose processing is known to be a byte permutation (Hopper's Marlin MXFP8; on
    CUDA also small unquantized linears, learned as identities); "quantized": every quantized
    module (tests, kernels known to keep no state outside tensors); "0": none, vLLM's processing
    every refit. Unset or empty: "1" on CUDA, where every learned layout passed fresh-vLLM oracles
    on Hopper (docs/vllm.md), "0" elsewhere (the CPU build keeps packed state no probe sees)."""
    value = os.environ.get(LEARNED_LAYOUT_ENV, "") if value is None else value
    if value == "":
        return "1" if device_type == "cuda" else "0"
    if value not in LEARNED_LAYOUT_MODES:
        raise ValueError(f"{LEARNED_LAYOUT_ENV}={value!r}: use one of {', '.join(LEARNED_LAYOUT_MODES)} (or leave it unset)")
    return value


log = logging.getLogger("mxrefit.engine.probed_layout")


class _Refusal(ValueError):
    """A reason the processing is not a fixed per-expert byte gather (``derive`` returns it as a string)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (a view: writes land in the tensor)."""
    if not t.is_contiguous():
        raise _Refusal(f"a non-contiguous tensor {tuple(t.shape)} has no flat byte view")
    return t.reshape(-1).view(torch.uint8)


def _expert_rows(t: torch.Tensor, experts: int, name: str) -> torch.Tensor:
    """``t``'s bytes as (experts, bytes per expert)."""
    flat = _bytes(t)
    if flat.numel() % experts:
        raise _Refusal(f"{name}: {flat.numel()} bytes do not split over {experts} experts")
    return flat.view(experts, -1)


def _nonempty(kernel: Tensors) -> Tensors:
    """Kernel tensors with bytes to write (Marlin-style modules hold empty placeholders such as ``g_idx``)."""
    return {attr: t for attr, t in kernel.items() if t.numel()}


def gather_rows(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor) -> None:
    """``dst[e, j] = src[e, index[j]]`` for uint8 (E, n_in) ``src`` and (E, n_out) ``dst``, in place."""
    kernels = triton_kernels("mxrefit.engine._gather_triton", dst.device)
    if kernels is not None:
        kernels.gather(src, dst, index)
    else:
        torch.index_select(src, 1, index, out=dst)


@dataclass(frozen=True)
class ChunkTable:
    """A gather as whole input chunks per output block, for ``_gather_triton.chunked``: output block b
    (``block`` bytes) reads the ``chunk``-byte aligned input chunks at byte offsets ``starts[b]`` and
    takes output byte i from their concatenated bytes at ``local[b, i]``."""

    starts: torch.Tensor  # int64 (blocks, block // chunk); unused slots repeat the block's first chunk
    local: torch.Tensor  # int16 (blocks, block)

    @classmethod
    def of(cls, index: torch.Tensor, source_bytes: int, block: int = CHUNK_BLOCK, chunk: int = CHUNK_BYTES) -> ChunkTable | None:
        """The table of ``index`` (one expert's gather from ``source_bytes``), or None where an output
        block reads more than ``block // chunk`` chunks, or the output is not whole blocks, or the
        input not whole chunks (the last chunk would be read past the input's end)."""
        n = index.numel()
        if n == 0 or n % block or source_bytes % chunk:
            return None
        slots = block // chunk
        idx = index.to(torch.int64).view(-1, block)
        ids = idx // chunk
        order = ids.argsort(dim=1, stable=True)
        ranked = ids.gather(1, order)
        first = torch.ones_like(ranked, dtype=torch.bool)
        first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
        slot_ranked = first.to(torch.int64).cumsum(1) - 1  # the chunk's slot among the block's distinct chunks
        if int(slot_ranked[:, -1].max()) >= slots:
            return None
        slot = torch.empty_like(slot_ranked).scatter_(1, order, slot_ranked)
        starts = ranked[:, :1].expand(-1, slots).clone()
        starts.scatter_(1, slot_ranked, ranked)
        local = slot * chunk + idx % chunk
        return cls((starts * chunk).contiguous(), local.to(torch.int16).contiguous())

    @property
    def nbytes(self) -> int:
        return self.starts.numel() * self.starts.element_size() + self.local.numel() * self.local.element_size()


@dataclass(frozen=True)
class TiledIndex:
    """A gather whose output tiles of ``period`` bytes all move their bytes alike, shifted:
    ``index[t * period + j] = base[t] + pattern[j]`` (vLLM's Marlin repack treats every 16x64 tile the
    same way). Why: the byte index is 4 bytes of traffic per byte moved, and a linear's index is not
    shared by experts (a Qwen3-30B-A3B qkv index is 69 MB, more than an H100's L2); this one is a
    pattern that stays in cache plus one offset per tile."""

    period: int
    base: torch.Tensor  # int64 (tiles,): the input offset of each tile's pattern
    pattern: torch.Tensor  # int32 (period,)

    @classmethod
    def of(cls, index: torch.Tensor, periods: tuple[int, ...] = TILE_PERIODS) -> TiledIndex | None:
        """The smallest-period encoding of ``index`` (one expert's gather), or None where no period
        in ``periods`` divides it into tiles moved alike."""
        n = index.numel()
        idx = index.to(torch.int64)
        for period in periods:
            if n % period or n == period:
                continue
            rows = idx.view(-1, period)
            base = rows[:, :1]
            pattern = rows[:1] - base[:1]
            if pattern.abs().max() < 2**31 and torch.equal(rows - base, pattern.expand_as(rows)):
                return cls(period, base.reshape(-1).contiguous(), pattern.reshape(-1).to(torch.int32).contiguous())
        return None

    @property
    def nbytes(self) -> int:
        return self.base.numel() * self.base.element_size() + self.pattern.numel() * self.pattern.element_size()


@dataclass(frozen=True)
class ByteGather:
    """``kernel[e].view(uint8)[j] = staged[source][e].view(uint8)[index[j]]`` for every expert e.

    An identity gather (every output byte its own input byte: processing that leaves the bytes
    as loaded, vLLM's unquantized linears on CUDA say) keeps no index and is a plain copy."""

    source: str
    experts: int  # 1 when the parameter has no expert dimension
    source_bytes: int  # bytes of one expert of ``source``: a staged tensor of another size is refused
    index: torch.Tensor  # int32 (int64 past 2 GiB per expert), on the device, one entry per output byte of ONE expert
    identity: bool = False  # then ``index`` is empty and the output has ``source_bytes`` bytes per expert
    chunks: ChunkTable | None = None  # set where the chunked kernel runs this gather (``_with_faster_kernel``)
    tiles: TiledIndex | None = None  # set where the tiled kernel runs it

    @property
    def out_bytes(self) -> int:
        """Bytes of one expert of the kernel tensor."""
        return self.source_bytes if self.identity else self.index.numel()

    @property
    def kernel(self) -> str:
        """How ``rows`` moves the bytes: ``copy``, ``tiled``, ``chunked`` or ``gather``."""
        if self.identity:
            return "copy"
        return "tiled" if self.tiles is not None else "chunked" if self.chunks is not None else "gather"

    def rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The gather on (E', source_bytes) uint8 ``src`` rows into (E', out_bytes) ``dst`` rows."""
        if self.identity:
            dst.copy_(src)
        elif self.tiles is not None:
            from mxrefit.engine import _gather_triton

            _gather_triton.tiled(src, dst, self.tiles.base, self.tiles.pattern)
        elif self.chunks is not None:
            from mxrefit.engine import _gather_triton

            _gather_triton.chunked(src, dst, self.chunks.starts, self.chunks.local)
        else:
            gather_rows(src, dst, self.index)

    def __call__(self, staged: torch.Tensor, kernel: torch.Tensor) -> None:
        src, dst = _bytes(staged), _bytes(kernel)
        if src.numel() != self.experts * self.source_bytes or dst.numel() != self.experts * self.out_bytes:
            raise ValueError(
                f"the gather from {self.source} was learned for {self.experts} x {self.source_bytes} bytes "
                f"into {self.experts} x {self.out_bytes}, got {src.numel()} into {dst.numel()}"
            )
        self.rows(src.view(self.experts, -1), dst.view(self.experts, -1))


@dataclass
class ProbedLayout:
    """A module's post-load processing as one byte gather per kernel tensor."""

    gathers: dict[str, ByteGather]  # kernel attribute -> gather

    def apply(self, staged: Tensors, kernel: Tensors) -> None:
        """Write every kernel tensor from the checkpoint-format ``staged`` tensors, in place."""
        for attr, g in self.gathers.items():
            g(staged[g.source], kernel[attr])

    @property
    def index_bytes(self) -> int:
        """Device memory the indices (and chunk tables) hold."""
        return sum(
            g.index.numel() * g.index.element_size()
            + (g.chunks.nbytes if g.chunks is not None else 0)
            + (g.tiles.nbytes if g.tiles is not None else 0)
            for g in self.gathers.values()
        )

    @property
    def kernels(self) -> dict[str, str]:
        """Per kernel tensor, how its bytes are moved (``ByteGather.kernel``)."""
        return {attr: g.kernel for attr, g in self.gathers.items()}


def _median_seconds(fns: list[Callable[[], None]], device: torch.device, reps: int = 5) -> list[float]:
    """Median time of each of ``fns``, after a warm-up call of each (which also compiles a Triton kernel).
    The calls take turns, so a GPU shared with another process (a trainer packing the next bucket)
    slows each about alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, spent in zip(fns, times):
            sync_current(device)
            t = time.perf_counter()
            fn()
            sync_current(device)
            spent.append(time.perf_counter() - t)
    return [statistics.median(spent) for spent in times]


def _with_faster_kernel(g: ByteGather, src: torch.Tensor, dst: torch.Tensor, what: str) -> ByteGather:
    """``g`` on the fastest kernel its layout allows on these (E, bytes) rows: the byte gather, the
    tiled one (a periodic index: no index traffic) or the chunked one (whole input chunks per output
    block). Timed rather than assumed: on an H100 the chunked kernel beat the byte gather on three
    of four Marlin weights and lost on the fourth (docs/vllm.md, 2026-12-06). Another kernel is kept
    only if it took less than ``OTHER_KERNEL_WINS`` of the byte gather's time."""
    if g.identity or triton_kernels("mxrefit.engine._gather_triton", dst.device) is None:
        return g
    candidates: list[ByteGather] = []
    tiles = TiledIndex.of(g.index)
    if tiles is not None:
        candidates.append(replace(g, tiles=tiles))
    table = ChunkTable.of(g.index, g.source_bytes)
    if table is not None:
        candidates.append(replace(g, chunks=table))
    runnable: list[ByteGather] = []
    for other in candidates:
        try:
            other.rows(src, dst)  # compiles it, and finds a Triton without tl.gather (say) before timing
        except Exception as exc:
            log.info("%s: the %s gather did not run (%r)", what, other.kernel, exc)
            continue
        runnable.append(other)
    if not runnable:
        return g
    fns = [lambda: g.rows(src, dst)] + [lambda o=o: o.rows(src, dst) for o in runnable]
    gather_s, *others_s = _median_seconds(fns, dst.device)
    for other, other_s in zip(runnable, others_s):
        log.info("%s: byte gather %.3f ms, %s %.3f ms", what, gather_s * 1e3, other.kernel, other_s * 1e3)
    best_s, best = min(zip(others_s, runnable), key=lambda pair: pair[0])
    return best if best_s < OTHER_KERNEL_WINS * gather_s else g


class _Watch:
    """Bytes of the tensors the processing keeps beside its parameters, after each processing run."""

    def __init__(self, watch: Callable[[], Tensors] | None):
        self.watch = watch
        self.first: Tensors | None = None
        self.changed: set[str] = set()

    def look(self) -> None:
        if self.watch is None:
            return
        now = {name: t.detach().reshape(-1).view(torch.uint8).clone() for name, t in self.watch().items()}
        if self.first is None:
            self.first = now
            return
        for name in self.first.keys() | now.keys():
            a, b = self.first.get(name), now.get(name)
            if a is None or b is None or not torch.equal(a, b):
                self.changed.add(name)

    def reason(self) -> str | None:
        if not self.changed:
            return None
        return (
            f"the processing keeps tensors whose bytes depend on its input: {sorted(self.changed)} "
            "(a gather would leave them stale)"
        )


def _coded_inputs(staged: Tensors, rows: torch.Tensor) -> Tensors:
    """Tensors shaped like ``staged`` from (E, T) uint8 ``rows``: each expert's inputs' bytes laid end to end."""
    out, at = {}, 0
    for name, t in staged.items():
        n = t.numel() * t.element_size() // rows.shape[0]
        out[name] = rows[:, at : at + n].contiguous().view(-1).view(t.dtype).view(t.shape)
        at += n
    return out


def _check_inputs(staged: Tensors, experts: int) -> None:
    for name, t in staged.items():
        if t.dtype == torch.bool:
            raise _Refusal(f"{name}: bool tensors cannot carry arbitrary bytes")
        if experts > 1 and (t.dim() == 0 or t.shape[0] != experts):
            raise _Refusal(f"{name}: shape {tuple(t.shape)} has no leading expert dimension of {experts}")


def _verify(layout: ProbedLayout, staged: Tensors, kernel: Tensors, what: str) -> None:
    """The gather applied to ``staged`` must equal what the processing left in ``kernel``, byte for byte.
    Checked a few experts at a time, so the scratch stays near ``CHECK_BYTES`` however large the module."""
    kernel = _nonempty(kernel)
    if kernel.keys() != layout.gathers.keys():
        raise _Refusal(f"the processing's kernel tensors changed from {sorted(layout.gathers)} to {sorted(kernel)} on {what}")
    for attr, g in layout.gathers.items():
        src = _expert_rows(staged[g.source], g.experts, g.source)
        want = _expert_rows(kernel[attr], g.experts, attr)
        step = max(1, CHECK_BYTES // max(1, want.shape[1]))
        for e in range(0, g.experts, step):
            got = torch.empty_like(want[e : e + step])
            g.rows(src[e : e + step], got)
            if not torch.equal(got, want[e : e + step]):
                raise _Refusal(
                    f"{attr}: the learned gather differs from the processing on {what} "
                    f"(experts {e}..{min(e + step, g.experts) - 1} of {g.experts}): "
                    "the processing is not a fixed byte permutation"
                )


def _learn(
    process: Callable[[Tensors], None], read_kernel: Callable[[], Tensors], staged: Tensors, experts: int, watch: _Watch
) -> ProbedLayout:
    """The index probes and the random validation probe; raises ``_Refusal``."""
    names = list(staged)
    sizes = [staged[n].numel() * staged[n].element_size() // experts for n in names]
    starts = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
    total = int(starts[-1])
    device = next(iter(staged.values())).device
    digits = 1
    while 256**digits <= total:  # the codes run 1..T; 0 marks a byte no input fed
        digits += 1
    codes = torch.arange(1, total + 1, dtype=torch.int64, device=device)
    acc: dict[str, torch.Tensor] = {}
    for d in range(digits):
        digit = (codes >> (8 * d)).remainder(256).to(torch.uint8)
        process(_coded_inputs(staged, digit.view(1, -1).expand(experts, -1)))  # the same in every expert
        watch.look()
        kernel = _nonempty(read_kernel())
        if acc and kernel.keys() != acc.keys():
            raise _Refusal(f"the processing's kernel tensors changed between probes: {sorted(acc)} vs {sorted(kernel)}")
        for attr, t in kernel.items():
            rows = _expert_rows(t, experts, attr)
            if any(not torch.equal(rows[e], rows[0]) for e in range(1, experts)):
                raise _Refusal(f"{attr}: experts given the same bytes come out different (the layout varies per expert)")
            acc[attr] = acc.get(attr, 0) + (rows[0].to(torch.int64) << (8 * d))
    del codes
    gathers = {}
    for attr, code in acc.items():
        src = code - 1
        if bool((src < 0).any()):
            raise _Refusal(
                f"{attr}: {int((src < 0).sum())} of {src.numel()} bytes come from no input byte (padding, or computed)"
            )
        if bool((src >= total).any()):
            raise _Refusal(f"{attr}: bytes that decode past the inputs' end (the processing computes them)")
        which = torch.searchsorted(starts.to(device), src, right=True) - 1
        first, last = int(which.min()), int(which.max())
        if first != last:
            raise _Refusal(f"{attr}: its bytes come from several inputs ({names[first]} ... {names[last]}): a gather reads one")
        local = src - int(starts[first])
        if local.numel() == sizes[first] and torch.equal(local, torch.arange(local.numel(), device=device)):
            gathers[attr] = ByteGather(names[first], experts, sizes[first], local.new_empty(0, dtype=torch.int32), True)
            continue
        dtype = torch.int32 if sizes[first] < 2**31 else torch.int64
        gathers[attr] = ByteGather(names[first], experts, sizes[first], local.to(dtype))
    del acc
    kernel = _nonempty(read_kernel())  # holds the last probe's result: free to overwrite, the probes below rewrite it
    for attr, bg in gathers.items():
        src_rows = _expert_rows(staged[bg.source], experts, bg.source)
        gathers[attr] = _with_faster_kernel(bg, src_rows, _expert_rows(kernel[attr], experts, attr), attr)
    layout = ProbedLayout(gathers)
    g = torch.Generator(device=device).manual_seed(VALIDATION_SEED)
    noise = torch.randint(0, 256, (experts, total), generator=g, dtype=torch.uint8, device=device)
    probe = _coded_inputs(staged, noise)
    del noise
    process(probe)
    watch.look()
    _verify(layout, probe, read_kernel(), "random bytes")
    return layout


def derive(
    process: Callable[[Tensors], None],
    read_kernel: Callable[[], Tensors],
    staged: Tensors,
    *,
    experts: int,
    watch: Callable[[], Tensors] | None = None,
) -> ProbedLayout | str:
    """Learn the processing of one module as a byte gather, or say why it is not one.

    ``process(tensors)`` runs the processing of the module from checkpoint-format tensors shaped
    like ``staged``; afterwards ``read_kernel()`` returns the module's kernel tensors (any dtype,
    contiguous, the same ones every time). ``watch()`` returns other tensors the processing keeps;
    their bytes must not depend on the input. ``experts``: E, the leading dim of every staged
    tensor (1 for a module without experts). Runs ``process`` D + 2 times (D = base-256 digits of
    the bytes per expert), the last time on ``staged``, so the module ends up holding the
    processed real weights whether a layout or a reason (str) is returned.
    """
    if experts < 1:
        raise ValueError(f"experts must be at least 1, got {experts}")
    watched = _Watch(watch)
    layout: ProbedLayout | None = None
    reason = None
    try:
        _check_inputs(staged, experts)
        layout = _learn(process, read_kernel, staged, experts, watched)
    except _Refusal as refusal:
        reason = str(refusal)
    except Exception as exc:  # the processing may reject probe bytes (a finiteness check, say): its slow path stays
        reason = f"the processing failed on a probe: {exc!r}"
    process(staged)
    watched.look()
    if layout is not None:
        try:
            _verify(layout, staged, read_kernel(), "the real weights")
        except _Refusal as refusal:
            reason = str(refusal)
    reason = reason or watched.reason()
    if reason is not None or layout is None:
        return reason or "no layout was learned"
    return layout


@dataclass(frozen=True)
class IdentityVerdict:
    """What one run of the processing on the real weights says: it ``kept`` every byte, or
    ``reason`` why not; ``decided`` False when that run cannot tell (the next refit may)."""

    kept: bool
    decided: bool
    reason: str = ""


def _constant(t: torch.Tensor) -> bool:
    """Whether every element holds the same bits (a permutation of such a tensor looks like the identity)."""
    if t.numel() < 2:
        return True
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    flat = _bytes(t).view(words) if words is not None else _bytes(t)
    return not bool((flat != flat[0]).any())


def learn_identity(
    process: Callable[[Tensors], None],
    read_kernel: Callable[[], Tensors],
    staged: Tensors,
    *,
    watch: Callable[[], Tensors] | None = None,
) -> IdentityVerdict:
    """Run the processing once on the real weights and say whether it kept their bytes.

    Why not ``derive``: its probes hold ~18 bytes of scratch per byte of the module (22 GB for one
    Qwen3-30B-A3B layer's BF16 experts), while an identity is seen in the real run itself: every
    kernel tensor then equals its staged tensor byte for byte. One sample proves less than the
    probes, so the sample must say something: the module must have held other bytes before (a
    refit of the weights it already serves tells nothing) and no staged tensor may be constant; and
    what the processing keeps beside its parameters (``watch``) must not change with the weights.
    The caller keys verdicts like ``LayoutCache`` (classes, backend, tensor signatures) and uses
    this only where the processing is known to be a copy at most (vLLM's unquantized MoE experts on
    CUDA's Triton backend); the module serves the real weights afterwards in every case."""
    held = read_kernel()
    changed = held.keys() != staged.keys() or any(
        not torch.equal(_bytes(held[a]), _bytes(t)) for a, t in staged.items() if held[a].is_contiguous()
    )
    del held
    watched = _Watch(watch)
    watched.look()
    process(staged)
    watched.look()
    kernel = read_kernel()
    if kernel.keys() != staged.keys():
        return IdentityVerdict(False, True, f"the kernel tensors {sorted(kernel)} are not the staged ones {sorted(staged)}")
    for attr, t in staged.items():
        k = kernel[attr]
        if not k.is_contiguous() or k.numel() * k.element_size() != t.numel() * t.element_size():
            return IdentityVerdict(
                False, True, f"{attr}: the kernel tensor {tuple(k.shape)} {k.dtype} is not the staged bytes' size"
            )
        if not torch.equal(_bytes(k), _bytes(t)):
            return IdentityVerdict(False, True, f"{attr}: the processing moved or computed bytes")
    reason = watched.reason()
    if reason is not None:
        return IdentityVerdict(False, True, reason)
    if not changed:
        return IdentityVerdict(False, False, "the refit brought the bytes the module already held")
    flat = [attr for attr, t in staged.items() if _constant(t)]
    if flat:
        return IdentityVerdict(False, False, f"constant staged tensors {flat}: a permutation would keep them too")
    return IdentityVerdict(True, True)


def tensor_signature(tensors: Tensors) -> tuple:
    """(name, shape, dtype, device) of each tensor: the part of a cache key the tensors give."""
    return tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in tensors.items())


@dataclass
class LayoutCache:
    """Probed layouts, and refusals, per module signature: one probe serves every layer of that shape.

    The key is the caller's; it must hold everything the processing depends on besides the bytes
    (module and quant-method classes, ``tensor_signature`` of the staged and kernel tensors, ...).
    """

    entries: dict[Hashable, ProbedLayout | str] = field(default_factory=dict)

    def run(
        self,
        key: Hashable,
        process: Callable[[Tensors], None],
        read_kernel: Callable[[], Tensors],
        staged: Tensors,
        *,
        experts: int,
        watch: Callable[[], Tensors] | None = None,
    ) -> ProbedLayout | str:
        """Bring the module to the processed ``staged`` weights by the fastest known way, and return
        the key's layout or refusal: a known layout is applied into ``read_kernel()``'s tensors (the
        module must have been processed before, so they exist); a known refusal runs ``process``;
        an unknown key is derived (which processes the real weights last)."""
        known = self.entries.get(key)
        if isinstance(known, ProbedLayout):
            known.apply(staged, read_kernel())
        elif known is not None:
            process(staged)
        else:
            known = derive(process, read_kernel, staged, experts=experts, watch=watch)
            self.entries[key] = known
        return known
