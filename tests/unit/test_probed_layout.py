"""Probed layouts: post-load processing learned as a byte gather equals running the processing.

The black boxes are real processing functions filling a module's parameters in place, as
vLLM's ``process_weights_after_loading`` does: the TRT-LLM MoE layout of ``integrations/vllm/trtllm.py``,
vLLM's own Marlin MXFP8 steps that run on CPU (all but the CUDA-only ``gptq_marlin_repack``;
marked vllm), a Marlin-like repack written here (fp8 bytes packed into int32 words, transposed, tiled,
bytes interleaved; e8m0 scales through bf16 bits and back), and negative controls that are
not fixed byte gathers. Each negative must come back as a reason with the module holding the
real weights' processing. The Triton gather runs under Triton's CPU interpreter in a
subprocess (TRITON_INTERPRET=1 must be set before triton is first imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from mxrefit.devices import triton_kernels
from mxrefit.engine import probed_layout
from mxrefit.engine.probed_layout import (
    ChunkTable,
    LayoutCache,
    ProbedLayout,
    TiledIndex,
    derive,
    learned_layout_mode,
    tensor_signature,
)
from mxrefit.integrations.vllm.trtllm import SCALE_BLOCK, MoeLayout

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")

Tensors = dict[str, torch.Tensor]
U8 = torch.uint8


def random_like(staged: Tensors, seed: int) -> Tensors:
    """Fresh random bytes shaped like ``staged`` (fp8 NaN patterns included: no arithmetic is done)."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g, dtype=U8).view(t.dtype).view(t.shape)
        for n, t in staged.items()
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(U8), b.reshape(-1).view(U8))


class Processed(torch.nn.Module):
    """A module whose parameters ``fn(staged)`` fills in place, byte for byte (addresses kept)."""

    def __init__(self, fn: Callable[[Tensors], Tensors], staged: Tensors):
        super().__init__()
        self.fn = fn
        self.runs = 0
        for name, t in fn(staged).items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))

    def process(self, tensors: Tensors) -> None:
        self.runs += 1
        for name, t in self.fn(tensors).items():
            getattr(self, name).data.reshape(-1).view(U8).copy_(t.reshape(-1).view(U8))

    def kernel(self) -> Tensors:
        return {n: p.data for n, p in self.named_parameters()}

    def holds(self, staged: Tensors) -> bool:
        """The parameters hold the processing of ``staged``."""
        want = self.fn(staged)
        return all(same_bytes(p, want[n]) for n, p in self.kernel().items())


def with_placeholder(fn: Callable[[Tensors], Tensors]) -> Callable[[Tensors], Tensors]:
    """``fn`` plus an empty kernel tensor, as Marlin modules hold (``g_idx``): nothing to write, not a refusal."""
    return lambda staged: {**fn(staged), "g_idx": torch.empty(0, dtype=torch.int32)}


def learn(fn: Callable[[Tensors], Tensors], staged: Tensors, experts: int, **kw) -> tuple[Processed, ProbedLayout | str]:
    module = Processed(fn, staged)
    return module, derive(module.process, module.kernel, staged, experts=experts, **kw)


# ---- black boxes that are byte gathers ------------------------------------------------------------------------------
def trtllm_moe(staged: Tensors) -> Tensors:
    """FlashInfer's TRT-LLM MXFP8 MoE layout of a gated w13 (values and scales), as integrations/vllm/trtllm.py writes it."""
    w, s = staged["w13_weight"], staged["w13_weight_scale"]
    e, m, k = w.shape
    values = MoeLayout(e, m, k, True, w.device, scales=False)
    scales = MoeLayout(e, m, k // SCALE_BLOCK, True, w.device, scales=True)
    out_w = torch.empty_like(w)
    values(w.view(U8), out_w.view(U8))
    out_s = torch.zeros(e * scales.out_per_expert, dtype=U8)
    scales(s, out_s)
    return {"w13_weight": out_w, "w13_weight_scale": out_s}


SCALE_PERM = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])  # Marlin's scale_perm shape of permutation


def marlin_like_weight(w: torch.Tensor) -> torch.Tensor:
    """fp8 (N, K) -> int32 words of 4 bytes along K -> (K/4, N) -> 16x64 tiles -> bytes [0, 2, 1, 3] in each word."""
    n, k = w.shape
    words = w.view(U8).reshape(n, k // 4, 4).view(torch.int32).reshape(n, k // 4).t()
    tiles = words.reshape(k // 64, 16, n // 64, 64).permute(0, 2, 1, 3).contiguous()
    return tiles.view(U8).reshape(-1, 4)[:, [0, 2, 1, 3]].contiguous().view(torch.int32).reshape(k // 64, n * 16)


def marlin_like_scales(s: torch.Tensor) -> torch.Tensor:
    """e8m0 (N, K/32) -> bf16 of the same power of two (bits byte << 7) -> transposed, 64-groups permuted -> e8m0."""
    bf16 = (s.view(U8).to(torch.int16) << 7).view(torch.bfloat16)
    permuted = bf16.t().reshape(-1, 64)[:, SCALE_PERM].reshape(s.shape[1], s.shape[0])
    return ((permuted.view(torch.int16) >> 7) & 0xFF).to(U8).view(torch.float8_e8m0fnu)


def marlin_like(staged: Tensors) -> Tensors:
    """The repack of a linear (2-D) or, looped per expert in Python as vLLM's Marlin MoE does, an MoE (3-D)."""
    w, s = staged["weight"], staged["weight_scale"]
    if w.dim() == 2:
        return {"weight": marlin_like_weight(w), "weight_scale": marlin_like_scales(s)}
    return {
        "weight": torch.stack([marlin_like_weight(x) for x in w]),
        "weight_scale": torch.stack([marlin_like_scales(x) for x in s]),
    }


def moe_staged(e: int = 4, m: int = 128, k: int = 128, seed: int = 0) -> Tensors:
    return random_like(
        {
            "w13_weight": torch.empty(e, m, k, dtype=torch.float8_e4m3fn),
            "w13_weight_scale": torch.empty(e, m, k // SCALE_BLOCK, dtype=U8),
        },
        seed,
    )


def marlin_staged(experts: int, n: int = 128, k: int = 256, seed: int = 0) -> Tensors:
    lead = (experts,) if experts > 1 else ()
    return random_like(
        {
            "weight": torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn),
            "weight_scale": torch.empty(*lead, n, k // 32, dtype=torch.float8_e8m0fnu),
        },
        seed,
    )


def test_trtllm_moe_layout_is_learned_per_expert_and_applied_in_place():
    staged = moe_staged()
    module, layout = learn(trtllm_moe, staged, experts=4)
    assert isinstance(layout, ProbedLayout), layout
    assert module.holds(staged)  # derive ends on the real weights
    w, s = layout.gathers["w13_weight"], layout.gathers["w13_weight_scale"]
    assert (w.source, w.experts, w.index.numel(), w.index.dtype) == ("w13_weight", 4, 128 * 128, torch.int32)
    assert (s.source, s.experts, s.index.numel()) == ("w13_weight_scale", 4, 128 * 4)
    assert layout.index_bytes == 4 * (128 * 128 + 128 * 4)
    fresh = moe_staged(seed=1)
    addresses = {n: t.data_ptr() for n, t in module.kernel().items()}
    layout.apply(fresh, module.kernel())
    assert {n: t.data_ptr() for n, t in module.kernel().items()} == addresses
    assert module.holds(fresh)


@pytest.mark.parametrize("experts", [1, 3])
def test_marlin_like_repack_int32_and_e8m0_outputs(experts, monkeypatch):
    monkeypatch.setattr(probed_layout, "CHECK_BYTES", 1)  # the checks go one expert at a time
    n = 256 if experts == 1 else 128  # the linear's 67584 bytes take three digit probes
    staged = marlin_staged(experts, n=n)
    module, layout = learn(with_placeholder(marlin_like), staged, experts=experts)
    assert isinstance(layout, ProbedLayout), layout
    assert sorted(layout.gathers) == ["weight", "weight_scale"]
    assert module.runs == (3 if experts == 1 else 2) + 2  # digit probes, random, real
    kernel = module.kernel()
    assert (kernel["weight"].dtype, kernel["weight_scale"].dtype) == (torch.int32, torch.float8_e8m0fnu)
    assert layout.gathers["weight"].index.numel() == n * 256  # one expert's bytes
    fresh = marlin_staged(experts, n=n, seed=7)
    layout.apply(fresh, kernel)
    assert module.holds(fresh)


def vllm_marlin_mxfp8(staged: Tensors) -> Tensors:
    """vLLM's own ``prepare_mxfp8_layer_for_marlin`` steps that run on CPU, in its order: fp8 packed into
    int32 GPTQ words (``gptq_marlin_repack``, CUDA-only, would follow) and the e8m0 scales through bf16,
    ``marlin_permute_scales`` and ``mxfp8_marlin_process_scales``; per expert for an MoE, as vLLM loops."""
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_fp8", reason="needs vLLM")
    marlin = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils", reason="needs vLLM")

    def one(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = w.shape
        qweight = fp8.pack_fp8_to_int32(w, size_k_first=False).T.contiguous()
        scales = s.contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16).T.contiguous()
        scales = marlin.marlin_permute_scales(s=scales, size_k=k, size_n=n, group_size=32)
        return qweight, fp8.mxfp8_marlin_process_scales(scales)

    w, s = staged["weight"], staged["weight_scale"]
    if w.dim() == 2:
        qweight, scales = one(w, s)
        return {"weight": qweight, "weight_scale": scales}
    pairs = [one(x, y) for x, y in zip(w, s)]
    return {"weight": torch.stack([q for q, _ in pairs]), "weight_scale": torch.stack([m for _, m in pairs])}


@pytest.mark.vllm
@pytest.mark.parametrize("experts", [1, 3])
def test_vllm_marlin_mxfp8_steps_are_learned(experts):
    staged = marlin_staged(experts)
    staged["weight_scale"] = staged["weight_scale"].view(U8)  # the checkpoint's uint8 e8m0
    module, layout = learn(vllm_marlin_mxfp8, staged, experts=experts)
    assert isinstance(layout, ProbedLayout), layout
    assert module.kernel()["weight_scale"].dtype == torch.float8_e8m0fnu
    fresh = marlin_staged(experts, seed=11)
    fresh["weight_scale"] = fresh["weight_scale"].view(U8)
    layout.apply(fresh, module.kernel())
    assert module.holds(fresh)


@pytest.mark.parametrize("experts", [1, 3])
def test_processing_that_keeps_the_bytes_is_learned_as_a_copy(experts):
    """vLLM's unquantized linears on CUDA: the kernel tensors hold the loaded bytes. Learned as an
    identity (no index kept, a plain copy); a transposed weight of the same shape is not one."""
    lead = (experts,) if experts > 1 else ()
    staged = random_like({"weight": torch.empty(*lead, 64, 48, dtype=torch.bfloat16)}, 3)
    module, layout = learn(lambda t: {"weight": t["weight"].clone()}, staged, experts=experts)
    assert isinstance(layout, ProbedLayout), layout
    g = layout.gathers["weight"]
    assert g.identity and g.index.numel() == 0 and layout.index_bytes == 0 and g.out_bytes == 64 * 48 * 2
    fresh = random_like(staged, 4)
    layout.apply(fresh, module.kernel())
    assert module.holds(fresh)
    square = random_like({"weight": torch.empty(*lead, 48, 48, dtype=torch.bfloat16)}, 5)
    module, moved = learn(lambda t: {"weight": t["weight"].transpose(-1, -2).contiguous()}, square, experts=experts)
    assert isinstance(moved, ProbedLayout) and not moved.gathers["weight"].identity  # a gather, not a copy
    fresh = random_like(square, 6)
    moved.apply(fresh, module.kernel())
    assert module.holds(fresh)


def test_apply_refuses_tensors_of_another_size():
    staged = marlin_staged(1)
    module, layout = learn(marlin_like, staged, experts=1)
    other = marlin_staged(1, n=64)
    with pytest.raises(ValueError, match="learned for 1 x 32768 bytes"):
        layout.apply(other, module.kernel())


# ---- negative controls: not fixed byte gathers -----------------------------------------------------------------------
def xor_with_content(staged: Tensors) -> Tensors:
    u8 = staged["a"].view(U8)
    return {"out": u8 ^ (u8.to(torch.int64).sum() % 251 + 1).to(U8)}


def requantize(staged: Tensors) -> Tensors:
    """fp8 values doubled and cast back: computed, not moved."""
    return {"out": (staged["a"].float() * 2).to(torch.float8_e4m3fn)}


def sort_bytes(staged: Tensors) -> Tensors:
    """Identity on the index probes (their bytes are ascending when T < 256), not on random bytes."""
    return {"out": staged["a"].view(U8).reshape(-1).sort().values.view(staged["a"].shape)}


def pad_with_zeros(staged: Tensors) -> Tensors:
    return {"out": torch.cat([staged["a"].view(U8).reshape(-1), torch.zeros(16, dtype=U8)])}


def mix_two_inputs(staged: Tensors) -> Tensors:
    return {"out": torch.cat([staged["a"].view(U8).reshape(-1), staged["b"].view(U8).reshape(-1)])}


def layout_per_expert(staged: Tensors) -> Tensors:
    """Odd experts reversed: a gather the same for every expert cannot express it."""
    u8 = staged["a"].view(U8)
    return {"out": torch.stack([x.flip(-1) if i % 2 else x for i, x in enumerate(u8)])}


def next_expert(staged: Tensors) -> Tensors:
    """Kernel expert e from staged expert e + 1: the index probes (equal experts) cannot see it."""
    return {"out": staged["a"].view(U8).roll(1, 0)}


def reject_nan(staged: Tensors) -> Tensors:
    """A finiteness check on the fp8 input: probe bytes hold NaN patterns, real weights do not."""
    if not bool(torch.isfinite(staged["a"].float()).all()):
        raise ValueError("non-finite weight")
    return {"out": staged["a"].view(U8).flip(-1)}


def one_input(shape: tuple[int, ...], seed: int = 3, dtype: torch.dtype = U8) -> Tensors:
    return random_like({"a": torch.empty(shape, dtype=dtype)}, seed)


NEGATIVES = {
    "arithmetic": (xor_with_content, one_input((4, 60)), 1, "^out: "),
    "requantize": (requantize, {"a": torch.linspace(-2, 2, 240).to(torch.float8_e4m3fn).view(4, 60)}, 1, "^out: "),
    "sorting": (sort_bytes, one_input((4, 60)), 1, "differs from the processing on random bytes"),
    "padding": (pad_with_zeros, one_input((4, 60)), 1, "come from no input byte"),
    "two inputs": (mix_two_inputs, {**one_input((4, 60)), "b": one_input((8,), 4)["a"]}, 1, r"several inputs \(a ... b\)"),
    "per expert": (layout_per_expert, one_input((4, 300)), 4, "experts given the same bytes come out different"),
    "cross expert": (next_expert, one_input((4, 300)), 4, r"differs from the processing on random bytes \(experts 0..3 of 4\)"),
    "rejects probes": (
        reject_nan,
        {"a": torch.linspace(-2, 2, 600).to(torch.float8_e4m3fn).view(2, 300)},
        2,
        "failed on a probe: ValueError",
    ),
}


@pytest.mark.parametrize("case", list(NEGATIVES))
def test_negative_controls_refuse_and_leave_the_real_weights(case):
    fn, staged, experts, reason = NEGATIVES[case]
    module, layout = learn(fn, staged, experts=experts)
    assert isinstance(layout, str)
    assert re.search(reason, layout), layout
    assert module.holds(staged)


def test_watch_catches_content_derived_state():
    """A plain attribute computed from the input (an amax, say) would go stale on the fast path."""
    staged = one_input((4, 60))
    module = Processed(lambda t: {"out": t["a"].view(U8).flip(0)}, staged)
    workspace = torch.zeros(8)  # content-independent state is fine

    def process(tensors: Tensors) -> None:
        module.process(tensors)
        module.amax = tensors["a"].view(U8).max()

    ok = derive(process, module.kernel, staged, experts=1, watch=lambda: {"workspace": workspace})
    assert isinstance(ok, ProbedLayout), ok
    bad = derive(process, module.kernel, staged, experts=1, watch=lambda: {"workspace": workspace, "amax": module.amax})
    assert isinstance(bad, str) and "['amax']" in bad, bad
    assert module.holds(staged) and module.amax == staged["a"].max()


def test_cache_probes_each_signature_once_and_remembers_refusals():
    cache = LayoutCache()
    layers = [marlin_staged(3, seed=s) for s in range(3)]
    modules = [Processed(marlin_like, t) for t in layers]
    for module, staged in zip(modules, layers):
        module.process(staged)  # vLLM's own first load: the kernel tensors exist before any refit
        module.runs = 0
    refit = [marlin_staged(3, seed=10 + s) for s in range(3)]
    key = ("marlin", tensor_signature(refit[0]), tensor_signature(modules[0].kernel()))
    results = [cache.run(key, m.process, m.kernel, t, experts=3) for m, t in zip(modules, refit)]
    assert isinstance(results[0], ProbedLayout) and all(r is results[0] for r in results)
    assert [m.runs for m in modules] == [2 + 2, 0, 0]  # 33792 bytes per expert: 2 digit probes, random, real
    assert all(m.holds(t) for m, t in zip(modules, refit))

    staged = one_input((4, 60))
    sorter = Processed(sort_bytes, staged)
    assert isinstance(cache.run("sort", sorter.process, sorter.kernel, staged, experts=1), str)
    sorter.runs = 0
    again = one_input((4, 60), seed=9)
    assert isinstance(cache.run("sort", sorter.process, sorter.kernel, again, experts=1), str)
    assert sorter.runs == 1 and sorter.holds(again)  # the slow path, no second probe


def test_derive_refuses_staged_tensors_without_the_expert_dimension():
    staged = {**marlin_staged(3), "bias": torch.zeros(5)}
    module = Processed(marlin_like, staged)
    reason = derive(module.process, module.kernel, staged, experts=3)
    assert isinstance(reason, str) and "bias" in reason and module.holds(staged)


def marlin_8bit_index(n: int, k: int) -> torch.Tensor:
    """Where each byte of vLLM's Marlin 8-bit repack of a (n, k) fp8 weight comes from, written from its
    CUDA kernel's description: 1 KB per 16x64 (k x n) tile, tiles k-major; in a tile, word
    ``(c * 4 + r) * 8 + 2 * w + j`` holds column ``w * 16 + j * 8 + c`` at k = 2r, 2r+8, 2r+1, 2r+9."""
    kt, nt, c, r, w, j, lo, hi = torch.meshgrid(*(torch.arange(x) for x in (k // 16, n // 64, 8, 4, 4, 2, 2, 2)), indexing="ij")
    return ((nt * 64 + w * 16 + j * 8 + c) * k + kt * 16 + hi * 8 + r * 2 + lo).reshape(-1)


def rebuilt(table: ChunkTable, chunk: int = 16) -> torch.Tensor:
    """The byte index a chunk table encodes."""
    return (table.starts.gather(1, table.local.long() // chunk) + table.local.long() % chunk).reshape(-1)


def test_chunk_table_encodes_marlin_tiles_and_refuses_scattered_layouts():
    index = marlin_8bit_index(128, 256)
    table = ChunkTable.of(index.to(torch.int32), 128 * 256)
    assert table is not None and table.starts.shape == (32, 64) and table.local.dtype == torch.int16
    assert torch.equal(rebuilt(table), index)
    assert bool((table.starts % 16 == 0).all())
    staged = marlin_staged(1)
    module, layout = learn(marlin_like, staged, experts=1)
    assert isinstance(layout, ProbedLayout)
    learned = layout.gathers["weight"].index
    assert torch.equal(
        rebuilt(ChunkTable.of(learned, layout.gathers["weight"].source_bytes)), learned.long()
    )  # the stand-in's tiles qualify too
    assert layout.kernels == {"weight": "gather", "weight_scale": "gather"}  # no Triton here: nothing timed
    # negative controls: a scattered permutation reads 256 chunks per block; a ragged output is not whole
    # blocks; an input of 8 bytes more than whole chunks would have its last chunk read past its end
    assert ChunkTable.of(torch.randperm(4096, generator=torch.Generator().manual_seed(0)), 4096) is None
    assert ChunkTable.of(index[:1000], 128 * 256) is None
    assert ChunkTable.of(index, 128 * 256 + 8) is None


def test_tiled_index_encodes_marlin_tiles_and_refuses_what_is_not_periodic():
    index = marlin_8bit_index(128, 256)
    tiles = TiledIndex.of(index.to(torch.int32))
    assert tiles is not None and tiles.period <= 1024 and tiles.pattern.dtype == torch.int32
    rebuilt_index = (tiles.base.view(-1, 1) + tiles.pattern.long().view(1, -1)).reshape(-1)
    assert torch.equal(rebuilt_index, index)
    assert tiles.nbytes * 8 < index.numel() * 4  # the point: far less than the byte index
    # negative controls: a scattered permutation; Marlin's index with one byte moved; one period only
    assert TiledIndex.of(torch.randperm(4096, generator=torch.Generator().manual_seed(0))) is None
    broken = index.clone()
    broken[5000] = broken[5001]
    assert TiledIndex.of(broken) is None
    assert TiledIndex.of(index[:64]) is None


# ---- the Triton gather under the interpreter -------------------------------------------------------------------------
def test_triton_gather_tests_pass_under_the_interpreter():
    if INTERPRETING:
        pytest.skip("this is the subprocess")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(__file__),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "26 passed" in run.stdout, run.stdout[-2000:]


def test_expert_split_covers_every_expert_once():
    from mxrefit.engine._gather_triton import expert_split

    for blocks in (1, 3, 48, 96, 3072):
        for experts in (1, 5, 128):
            for programs in (1, 9, 2048):
                groups, per = expert_split(blocks, experts, programs)
                assert (groups - 1) * per < experts <= groups * per, (blocks, experts, programs)
                assert groups * blocks >= min(programs, experts * blocks) or per == 1
    assert expert_split(96, 128) == (22, 6)  # Qwen3-30B-A3B w13 scales: 96 blocks of 1 KB
    assert expert_split(3072, 128) == (1, 128)  # its w13 weights: enough blocks already


@inside
@pytest.mark.parametrize("programs", [1, 9, 2048])  # one group; 3 groups of 2, 2, 1 experts; one per expert
@pytest.mark.parametrize("experts", [1, 5])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_interpreted_gather_equals_index_select(experts, index_dtype, programs):
    from mxrefit.engine import _gather_triton

    g = torch.Generator().manual_seed(experts)
    n_in, n_out = 3001, 2 * 1024 + 77  # neither a multiple of the block
    src = torch.randint(0, 256, (experts, n_in), generator=g, dtype=U8)
    index = torch.randint(0, n_in, (n_out,), generator=g).to(index_dtype)
    got = torch.zeros(experts, n_out, dtype=U8)
    _gather_triton.gather(src, got, index, programs=programs)
    assert torch.equal(got, torch.index_select(src, 1, index))


@inside
def test_interpreted_apply_of_a_learned_layout():
    assert triton_kernels("mxrefit.engine._gather_triton", torch.device("cpu")) is not None
    staged = marlin_staged(3)
    module, layout = learn(marlin_like, staged, experts=3)
    assert isinstance(layout, ProbedLayout), layout
    fresh = marlin_staged(3, seed=5)
    layout.apply(fresh, module.kernel())
    assert module.holds(fresh)


@inside
@pytest.mark.parametrize("programs", [1, 40, 2048])  # 16 blocks: one group; 3 groups of 2, 2, 1; one per expert
@pytest.mark.parametrize("experts", [1, 5])
def test_interpreted_chunked_gather_equals_index_select(experts, programs):
    from mxrefit.engine import _gather_triton

    index = marlin_8bit_index(128, 128)
    table = ChunkTable.of(index, index.numel())
    assert table is not None
    src = torch.randint(0, 256, (experts, index.numel()), generator=torch.Generator().manual_seed(experts), dtype=U8)
    got = torch.zeros_like(src)
    _gather_triton.chunked(src, got, table.starts, table.local, programs=programs)
    assert torch.equal(got, torch.index_select(src, 1, index))


@inside
@pytest.mark.parametrize("programs", [1, 2048])
@pytest.mark.parametrize("experts", [1, 5])
def test_interpreted_tiled_gather_equals_index_select(experts, programs):
    from mxrefit.engine import _gather_triton

    index = marlin_8bit_index(128, 128)
    tiles = TiledIndex.of(index)
    assert tiles is not None
    src = torch.randint(0, 256, (experts, index.numel()), generator=torch.Generator().manual_seed(experts), dtype=U8)
    got = torch.zeros_like(src)
    _gather_triton.tiled(src, got, tiles.base, tiles.pattern, programs=programs)
    assert torch.equal(got, torch.index_select(src, 1, index))


@inside
@pytest.mark.parametrize(
    "wins,tiled,kept",
    [(float("inf"), False, {"chunked"}), (float("inf"), True, {"tiled", "chunked"}), (0.0, True, {"gather"})],
)
def test_interpreted_learning_times_the_kernels_and_keeps_the_bytes(monkeypatch, wins, tiled, kept):
    """Which kernel is kept follows the timing (forced here: any kernel wins, or none does; the tiled
    one withheld to reach the chunked one); each writes the processing's bytes."""
    monkeypatch.setattr(probed_layout, "OTHER_KERNEL_WINS", wins)
    if not tiled:
        monkeypatch.setattr(probed_layout.TiledIndex, "of", classmethod(lambda cls, index: None))
    staged = marlin_staged(3)
    module, layout = learn(marlin_like, staged, experts=3)
    assert isinstance(layout, ProbedLayout), layout
    assert layout.kernels["weight"] in kept
    fresh = marlin_staged(3, seed=9)
    layout.apply(fresh, module.kernel())
    assert module.holds(fresh)


def _experts(seed: int) -> Tensors:
    """BF16 experts shaped like a small MoE layer's w13 (gate and up halves) and w2."""
    return random_like(
        {"w13_weight": torch.empty(4, 32, 16, dtype=torch.bfloat16), "w2_weight": torch.empty(4, 16, 16, dtype=torch.bfloat16)},
        seed,
    )


def _swap_halves(t: Tensors) -> Tensors:
    """FlashInfer CUTLASS's processing of w13: [w1; w3] -> [w3; w1]."""
    w13 = t["w13_weight"]
    half = w13.shape[1] // 2
    return {"w13_weight": torch.cat([w13[:, half:], w13[:, :half]], 1), "w2_weight": t["w2_weight"].clone()}


def test_identity_is_learned_from_one_real_run_and_a_permutation_is_refused():
    """vLLM's unquantized MoE experts on CUDA/Triton: the processing keeps the bytes, seen on the real
    weights alone (no probes); a row permutation of the same shape (negative control) is refused,
    and the module serves the real weights either way."""
    staged = _experts(1)
    module = Processed(lambda t: {n: x.clone() for n, x in t.items()}, _experts(0))
    module.process(_experts(0))  # what the engine served before this refit
    verdict = probed_layout.learn_identity(module.process, module.kernel, staged)
    assert verdict == probed_layout.IdentityVerdict(True, True), verdict
    assert module.runs == 2 and module.holds(staged)
    swapped = Processed(_swap_halves, _experts(0))
    swapped.process(_experts(0))
    verdict = probed_layout.learn_identity(swapped.process, swapped.kernel, staged)
    assert verdict.decided and not verdict.kept and "w13_weight: the processing moved" in verdict.reason, verdict
    assert swapped.holds(staged)


def test_identity_is_not_decided_on_a_sample_that_cannot_tell():
    """Weights the module already served (state kept beside them could follow the weights unseen), or
    a constant tensor (a permutation would keep it too): undecided, and the module serves them."""
    staged = _experts(1)
    plain = Processed(lambda t: {n: x.clone() for n, x in t.items()}, staged)
    plain.process(staged)  # already serving these weights
    same = probed_layout.learn_identity(plain.process, plain.kernel, staged)
    assert not same.decided and "already held" in same.reason, same
    swapped = Processed(_swap_halves, staged)
    swapped.process(staged)  # the same weights cannot hide a permutation: refused all the same
    moved = probed_layout.learn_identity(swapped.process, swapped.kernel, staged)
    assert moved.decided and not moved.kept, moved
    flat = {n: torch.full_like(t, 0.5) for n, t in staged.items()}
    plain.process(_experts(2))
    verdict = probed_layout.learn_identity(plain.process, plain.kernel, flat)
    assert not verdict.decided and "constant staged tensors" in verdict.reason, verdict
    assert plain.holds(flat)


def test_identity_is_refused_when_kept_state_follows_the_weights():
    """A copy whose processing also keeps something computed from the weights (a prepacked handle's
    tensor, an amax) would go stale on a plain copy: refused."""
    staged = _experts(1)
    module = Processed(lambda t: {n: x.clone() for n, x in t.items()}, _experts(0))
    module.process(_experts(0))
    kept = {"amax": staged["w2_weight"].new_zeros(())}

    def process(tensors: Tensors) -> None:
        module.process(tensors)
        kept["amax"] = tensors["w2_weight"].abs().amax()

    verdict = probed_layout.learn_identity(process, module.kernel, staged, watch=lambda: dict(kept))
    assert verdict.decided and not verdict.kept and "['amax']" in verdict.reason, verdict


def test_the_learned_layout_is_on_by_default_on_cuda_only_and_settable(monkeypatch):
    """Unset or empty: on for CUDA (it passed fresh-vLLM oracles on Hopper), off elsewhere (the CPU
    build keeps packed state no probe sees); "0", "1", "quantized" as set; anything else named."""
    monkeypatch.delenv("MXREFIT_LEARNED_LAYOUT", raising=False)
    assert learned_layout_mode("cuda") == "1" and learned_layout_mode("cpu") == "0"
    monkeypatch.setenv("MXREFIT_LEARNED_LAYOUT", "")
    assert learned_layout_mode("cuda") == "1" and learned_layout_mode("cpu") == "0"
    for value in ("0", "1", "quantized"):
        monkeypatch.setenv("MXREFIT_LEARNED_LAYOUT", value)
        assert learned_layout_mode("cuda") == value and learned_layout_mode("cpu") == value
    monkeypatch.setenv("MXREFIT_LEARNED_LAYOUT", "yes")
    with pytest.raises(ValueError, match=r"MXREFIT_LEARNED_LAYOUT='yes': use one of 0, 1, quantized"):
        learned_layout_mode("cuda")
