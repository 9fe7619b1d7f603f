"""The learned byte gather alone on the GPU, on vLLM's own Marlin MXFP8 layouts of Qwen3-30B-A3B (issue 22).

Why: in the 48-layer headline on the H200 the engine side took ~98 ms of a 160 ms MXFP8 refit, where
a copy of its 32 GB needs ~15 ms; the H100 at 24 layers showed the same share without the profile's
syncs (58 of 88 ms). Most of those bytes go through ``ByteGather`` (``engine/probed_layout.py``).
This script learns each module kind's layout from vLLM's own Marlin processing (``derive``, as the
engine does), then times, per kind and against a copy of the same bytes:
- ``library``: ``ByteGather.rows`` with the kernel ``derive`` kept (``kernel``: the byte gather or the
  chunked one, whichever ran faster when learned), what a refit runs;
- ``gather_b*_w*``: the library's byte gather kernel at other block sizes and warp counts;
  ``gather_b1024_w4_p*``: with the experts split for another number of programs (``p1``: one
  program per output block walking every expert, the kernel before 2026-12-06);
- ``scatter_b*_w*``: the same permutation driven from the input side (loads contiguous, byte stores
  scattered), where the index is a permutation;
- ``wide*``: the gather over 2-, 4- or 8-byte words, where the index moves aligned runs that long;
- ``tiled_b*_w*``: the library's tiled kernel (``TiledIndex``: one tile's pattern plus an offset
  per tile, where every output tile moves its bytes alike: no index traffic);
- ``chunked_b*_c*``: the library's chunked kernel (``ChunkTable``: per output block the aligned input
  chunks it reads, loaded whole, its bytes picked out of them in registers) at other block and chunk
  sizes (Marlin's 16x64 tiles read 64 rows of 16 bytes each: the byte gather's loads touch ~8
  sectors per warp instruction there);
and describes each index (the longest aligned run it moves whole; the 32-byte input sectors a warp's
32 consecutive output bytes read; the input span of a 1,024-byte output block; the smallest output
group that reads whole 32-byte input blocks, which a trainer-side kernel writing the layout itself
would handle per program), so a faster kernel is aimed at what the layout is. Every variant's bytes
are compared with vLLM's processing.
Then, per value tensor and its scales, ``trainer_write``: the learned order cut into units of whole
MXFP8 blocks (``formats/block_permutation.py``) and, where it is, the trainer-side kernel that
quantizes BF16 straight into vLLM's order (``write_b*_w*``, bytes against vLLM's processing of the
checkpoint quantization of the same BF16) beside what it replaces (``quantize_then_gather``) and a
copy of the same traffic: the next design step's premise (docs/vllm.md), measured before it is wired.
Ends with the estimate for a whole 48-layer refit, to set beside the headline's engine-side time.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_gather_profile.py --json $OUT/gather.json     # vLLM on the path
    python3 scripts/gpu_gather_profile.py --smoke --json /tmp/gather.json   # CPU: a stand-in layout, tiny shapes
    TRITON_INTERPRET=1 python3 scripts/gpu_gather_profile.py --smoke ...    # the same with every kernel variant
    PYTHONPATH=$PWD python3 scripts/gpu_gather_profile.py --standin --json $OUT/gather.json  # GPU, no vLLM: stand-in layout, full shapes
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from mxrefit.devices import triton_runs_on
from mxrefit.engine.probed_layout import ByteGather, ChunkTable, TiledIndex, derive

Tensors = dict[str, torch.Tensor]
LAYERS = 48  # Qwen3-30B-A3B
E, HIDDEN, MOE_I, QKV_N, O_K = 128, 2048, 768, (32 + 2 * 4) * 128, 32 * 128


def timed(fn: Callable[[], None], dev: torch.device, reps: int = 7) -> float:
    """Median seconds of ``reps`` calls after a warm-up (CUDA events on the GPU, the wall clock on CPU,
    where one call is enough: the smoke run checks bytes, not speed)."""
    if dev.type == "cuda":
        from cuda_timing import timed as cuda_timed

        return cuda_timed(fn, reps)
    reps = 1
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


# ---- the processing whose layout is learned ----------------------------------------------------
def vllm_dense(n: int, k: int) -> Callable[[Tensors], Tensors]:
    """vLLM's ``prepare_mxfp8_layer_for_marlin`` on a linear of (n, k): what ``MarlinMxfp8LinearKernel`` runs."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import prepare_mxfp8_layer_for_marlin

    layer = torch.nn.Module()
    layer.output_size_per_partition, layer.input_size_per_partition = n, k

    def process(t: Tensors) -> Tensors:
        for name, x in t.items():
            setattr(layer, name, torch.nn.Parameter(x.clone(), requires_grad=False))
        prepare_mxfp8_layer_for_marlin(layer)
        return {"weight": layer.weight.data, "weight_scale": layer.weight_scale.data}

    return process


def vllm_moe() -> Callable[[Tensors], Tensors]:
    """vLLM's ``prepare_mxfp8_moe_layer_for_marlin`` on all experts of one layer (its Python loop over experts)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import prepare_mxfp8_moe_layer_for_marlin

    layer = torch.nn.Module()
    names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")

    def process(t: Tensors) -> Tensors:
        return dict(zip(names, prepare_mxfp8_moe_layer_for_marlin(layer, *(t[n] for n in names))))

    return process


def standin(t: Tensors) -> Tensors:
    """A tiled transpose with byte interleaving inside 4-byte words, for the CPU smoke run (no Marlin there)."""
    out = {}
    for name, x in t.items():
        u8 = x.view(torch.uint8)
        *lead, n, k = u8.shape
        tiles = u8.reshape(*lead, n // 4, 4, k // 4, 4).transpose(-3, -2).transpose(-2, -1)
        out[name] = tiles[..., [0, 2, 1, 3]].contiguous().view(*lead, n, k)
    return out


def standin_words(t: Tensors) -> Tensors:
    """A transpose of 4-byte words, for the CPU smoke run: aligned runs of 4 bytes (the ``wide4`` row)."""
    return {name: x.view(torch.uint8).view(torch.int32).transpose(-2, -1).contiguous() for name, x in t.items()}


def kinds(
    smoke: bool, dev: torch.device, standin_only: bool = False
) -> dict[str, tuple[Tensors, int, Callable[[Tensors], Tensors]]]:
    """Per module kind: checkpoint-format tensors (random bytes), experts, processing (``standin_only``:
    the stand-in at Qwen3-30B-A3B's shapes, for a GPU without vLLM)."""

    def linear(n: int, k: int, e: int = 0) -> Tensors:
        lead = (e,) if e else ()
        w = torch.randint(0, 256, (*lead, n, k), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        s = torch.randint(100, 140, (*lead, n, k // 32), dtype=torch.uint8, device=dev)
        return {"weight": w, "weight_scale": s}

    if smoke:
        return {
            "dense": (linear(64, 128), 1, standin),
            "moe_w13": (linear(96, 128, 4), 4, standin),
            "words": (linear(64, 256, 2), 2, standin_words),
        }
    moe = {
        **{f"w13_{n}": t for n, t in linear(2 * MOE_I, HIDDEN, E).items()},
        **{f"w2_{n}": t for n, t in linear(HIDDEN, MOE_I, E).items()},
    }
    if standin_only:
        qkv, o, experts = standin, standin, standin
    else:
        qkv, o, experts = vllm_dense(QKV_N, HIDDEN), vllm_dense(HIDDEN, O_K), vllm_moe()
    return {
        "qkv_proj": (linear(QKV_N, HIDDEN), 1, qkv),
        "o_proj": (linear(HIDDEN, O_K), 1, o),
        "experts": (moe, E, experts),
    }


# ---- what an index looks like ------------------------------------------------------------------
def granule(index: torch.Tensor) -> int:
    """The longest aligned run (8, 4, 2 or 1 bytes) that the index moves whole, word for word."""
    for g in (8, 4, 2):
        if index.numel() % g:
            continue
        runs = index.view(-1, g).to(torch.int64)
        if bool((runs[:, 0] % g == 0).all()) and bool((runs - runs[:, :1] == torch.arange(g, device=index.device)).all()):
            return g
    return 1


def write_group_bytes(index: torch.Tensor, block: int = 32, largest: int = 1 << 20) -> int | None:
    """The smallest aligned output group (from ``block`` bytes up to ``largest`` and under half the
    index, where it would be trivially true) in which every group reads whole ``block``-byte input
    blocks, each once; None where no such size exists. Sizes tried: powers of two, and multiples of
    1 KB that divide the index (a group of two Marlin k-tile rows is 32 x N bytes: 160 KB for
    qkv's N = 5,120, 48 KB for w13's 1,536, neither a power of two).
    Why: a trainer-side kernel can write such a layout itself, one group per program, since a group
    holds every value of the MXFP8 blocks it needs a scale for (docs/vllm.md, next design step)."""
    idx = index.to(torch.int64)
    top = min(largest, idx.numel() // 2)
    sizes = {1 << p for p in range(block.bit_length() - 1, top.bit_length()) if (1 << p) >= block}
    sizes |= set(range(1024, top + 1, 1024))
    for size in sorted(sizes):
        if size > top or size % block or idx.numel() % size:
            continue
        runs = (idx.view(-1, size) // block).sort(dim=1).values.view(-1, size // block, block)
        whole = bool((runs == runs[..., :1]).all())
        if whole and bool((runs[:, 1:, 0] != runs[:, :-1, 0]).all()):
            return size
    return None


def shape_of(index: torch.Tensor, tiles: TiledIndex | None, values: bool) -> dict:
    """Sectors per warp load and input span per 1,024-byte output block (means); ``tiles``: the index as a
    ``TiledIndex``, if it is one; ``values``: E4M3 bytes (for scale bytes a write group means nothing)."""
    idx = index.to(torch.int64)
    n = idx.numel() // 32 * 32
    warp = (idx[:n].view(-1, 32) // 32).sort(dim=1).values
    sectors = 1 + (warp[:, 1:] != warp[:, :-1]).sum(1)
    m = idx.numel() // 1024 * 1024
    blocks = idx[:m].view(-1, 1024)
    span = blocks.max(1).values - blocks.min(1).values + 1
    return {
        "out_bytes_per_expert": idx.numel(),
        "granule_bytes": granule(index),
        "is_permutation": bool(torch.equal(idx.sort().values, torch.arange(idx.numel(), device=idx.device))),
        "sectors_per_warp_load": float(sectors.float().mean()) if n else None,
        "input_span_per_1k_block": float(span.float().mean()) if m else None,
        "tile_period": tiles.period if tiles is not None else None,
        "write_group_bytes": write_group_bytes(index) if values else None,
    }


# ---- variants ----------------------------------------------------------------------------------
def _triton_variants():
    import triton
    import triton.language as tl

    @triton.jit
    def scatter(src, dst, inverse, N_IN, N_OUT, E, BLOCK: tl.constexpr):
        """dst[e, inverse[i]] = src[e, i]: the input read in order, the bytes stored where they go."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < N_IN
        to = tl.load(inverse + i, mask=live, other=0).to(tl.int64)
        s = src
        d = dst
        for _ in range(E):
            tl.store(d + to, tl.load(s + i, mask=live), mask=live)
            s += N_IN
            d += N_OUT

    return triton, scatter


def variants(
    g: ByteGather,
    src: torch.Tensor,
    dst: torch.Tensor,
    want: torch.Tensor,
    dev: torch.device,
    permutation: bool,
    tiles: TiledIndex | None,
) -> dict:
    """Every variant of one gather ((E, n_in) ``src`` into (E, n_out) ``dst``), timed and checked against ``want``;
    the scatter only where the index is a ``permutation``."""
    rows: dict = {}
    moved = src.numel() + dst.numel() if g.identity else 2 * dst.numel()

    def row(name: str, fn: Callable[[], None]) -> None:
        dst.zero_()
        fn()
        equal = torch.equal(dst, want)
        s = timed(fn, dev)
        rows[name] = {"s": s, "GBps": moved / s / 1e9, "bytes_equal": equal}

    copy_src = torch.empty_like(dst)
    s = timed(lambda: dst.copy_(copy_src), dev)
    rows["copy"] = {"s": s, "GBps": 2 * dst.numel() / s / 1e9}
    row("library", lambda: g.rows(src, dst))
    if g.identity or not triton_runs_on(dev):  # the kernels run on CUDA, and on CPU under Triton's interpreter
        return rows
    from mxrefit.engine import _gather_triton as gk

    e, n_in = src.shape
    for block in (512, 1024, 2048, 4096):
        for warps in (4, 8):
            row(f"gather_b{block}_w{warps}", lambda: gk.gather(src, dst, g.index, block=block, num_warps=warps))
    for programs in (1, 512, 8192):  # 1: one program per block walking every expert (before 2026-12-06)
        row(f"gather_b1024_w4_p{programs}", lambda: gk.gather(src, dst, g.index, programs=programs))
    wide = granule(g.index)
    if wide > 1:
        word = {2: torch.int16, 4: torch.int32, 8: torch.int64}[wide]
        windex = (g.index.view(-1, wide)[:, 0] // wide).long()
        ws, wd = src.view(word), dst.view(word)
        row(f"wide{wide}", lambda: torch.index_select(ws, 1, windex, out=wd))
    triton, scatter = _triton_variants()
    for block, chunk in ((1024, 16), (2048, 16), (1024, 32)):
        table = ChunkTable.of(g.index, n_in, block, chunk)
        if table is None:
            rows[f"chunked_b{block}_c{chunk}"] = {"refused": "an output block reads more chunks than it has bytes for"}
            continue
        for warps in (4, 8):
            row(
                f"chunked_b{block}_c{chunk}_w{warps}",
                lambda: gk.chunked(src, dst, table.starts, table.local, num_warps=warps),
            )
        row(f"chunked_b{block}_c{chunk}_w4_p1", lambda: gk.chunked(src, dst, table.starts, table.local, programs=1))
    if tiles is None:
        rows["tiled"] = {"refused": "no period moves every output tile alike"}
    else:
        for block, warps in ((1024, 4), (1024, 8), (4096, 8)):
            row(
                f"tiled_b{block}_w{warps}",
                lambda: gk.tiled(src, dst, tiles.base, tiles.pattern, block=block, num_warps=warps),
            )
    if permutation:
        inverse = torch.empty_like(g.index)
        inverse[g.index.long()] = torch.arange(g.index.numel(), device=dev, dtype=g.index.dtype)
        for block in (1024, 4096):
            for warps in (4, 8):
                row(
                    f"scatter_b{block}_w{warps}",
                    lambda: scatter[(triton.cdiv(n_in, block),)](
                        src, dst, inverse, n_in, dst.shape[1], e, BLOCK=block, num_warps=warps
                    ),
                )
    return rows


def trainer_write_rows(staged: Tensors, layout, process: Callable[[Tensors], Tensors], experts: int, dev: torch.device) -> dict:
    """Per learned value tensor with its scales: the order cut into units of whole MXFP8 blocks
    (``BlockPermutation``: the units' size, or the rule it breaks) and, where it is, the trainer-side
    kernel that quantizes BF16 straight into it (``quantize_permuted``), timed at several programs'
    sizes against a copy of the same traffic (BF16 read, E4M3 and scale bytes written) and against
    what it replaces (quantize to the checkpoint layout, then the library's gather of values and
    scales); its bytes compared with vLLM's processing of the checkpoint quantization of the same BF16."""
    from mxrefit.formats import mxfp8
    from mxrefit.formats._common import NO_BAD, bad_flag
    from mxrefit.formats.block_permutation import BlockPermutation

    rows: dict = {}
    by_source = {g.source: (attr, g) for attr, g in layout.gathers.items() if not g.identity}
    for source, (attr, g) in by_source.items():
        if source.endswith("_scale") or f"{source}_scale" not in by_source:
            continue
        scale_attr, sg = by_source[f"{source}_scale"]
        perm = BlockPermutation.of(g.index, sg.index)
        if isinstance(perm, str):
            rows[attr] = {"refused": perm}
            continue
        info: dict = {"blocks_per_unit": perm.blocks_per_unit, "chunks_per_unit": perm.chunks_per_unit, "units": perm.units}
        rows[attr] = info
        if not triton_runs_on(dev):
            continue
        from mxrefit.formats import _mxfp8_triton as mk

        perm = perm.to(dev)
        shape = tuple(staged[source].shape)
        x = torch.randn(shape, dtype=torch.bfloat16, device=dev) * 0.02
        qv, qs = mxfp8.quantize(x)
        checkpoint = dict(staged)
        checkpoint[source] = qv.view(staged[source].dtype)
        checkpoint[f"{source}_scale"] = (
            qs.view(torch.uint8).view(staged[f"{source}_scale"].dtype).view(staged[f"{source}_scale"].shape)
        )
        want = {a: t.clone() for a, t in process(checkpoint).items()}
        ov = torch.empty(experts, perm.n_values, dtype=torch.uint8, device=dev)
        os_ = torch.empty(experts, perm.n_values // 32, dtype=torch.uint8, device=dev)
        moved = 2 * x.numel() + ov.numel() + os_.numel()
        bad = bad_flag(dev)
        for bpp in (64, 128, 256, 512, 1024):
            for warps in (4, 8):
                ov.zero_()
                os_.zero_()
                mk.quantize_permuted(x, perm, ov, os_, 0, bad, blocks_per_program=bpp, num_warps=warps)
                equal = torch.equal(ov.view(-1), want[attr].reshape(-1).view(torch.uint8)) and torch.equal(
                    os_.view(-1), want[scale_attr].reshape(-1).view(torch.uint8)
                )
                s = timed(lambda: mk.quantize_permuted(x, perm, ov, os_, 0, bad, blocks_per_program=bpp, num_warps=warps), dev)
                info[f"write_b{bpp}_w{warps}"] = {
                    "s": s,
                    "GBps": moved / s / 1e9,
                    "bytes_equal": equal,
                    "clean": int(bad.item()) == NO_BAD,
                }
        src_v, src_s = qv.view(torch.uint8).view(experts, -1), qs.view(torch.uint8).view(experts, -1)
        dst_v, dst_s = ov.view(experts, -1), os_.view(experts, -1)

        def two_pass() -> None:
            mxfp8.quantize(x, out=qv, scale_out=qs)
            g.rows(src_v, dst_v)
            sg.rows(src_s, dst_s)

        info["quantize_then_gather"] = {"s": timed(two_pass, dev)}
        flat = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        other = torch.empty_like(flat)
        s = timed(lambda: flat.copy_(other), dev)
        info["copy_same_traffic"] = {"s": s, "GBps": 2 * flat.numel() / s / 1e9}
    return rows


def profile_kind(name: str, staged: Tensors, experts: int, process: Callable[[Tensors], Tensors], dev: torch.device) -> dict:
    held: Tensors = {}

    def run(t: Tensors) -> None:
        held.clear()
        held.update(process(t))

    t = time.perf_counter()
    layout = derive(run, lambda: dict(held), staged, experts=experts)
    learn_s = time.perf_counter() - t
    if isinstance(layout, str):
        return {"refused": layout}
    want = {a: x.clone() for a, x in held.items()}  # vLLM's processing of the real weights
    kernel = {a: torch.empty_like(x) for a, x in want.items()}
    out: dict = {"learn_s": learn_s, "experts": experts, "index_bytes": layout.index_bytes}
    lib = timed(lambda: layout.apply(staged, kernel), dev)
    out["apply_all_s"] = lib
    out["apply_all_equal"] = all(torch.equal(kernel[a].view(torch.uint8), want[a].view(torch.uint8)) for a in want)
    out["processing_s"] = timed(lambda: process(staged), dev, reps=3)
    out["tensors"] = {}
    for attr, g in layout.gathers.items():
        src = staged[g.source].reshape(-1).view(torch.uint8).view(experts, -1)
        dst = torch.empty(experts, g.out_bytes, dtype=torch.uint8, device=dev)
        ref = want[attr].reshape(-1).view(torch.uint8).view(experts, -1)
        tiles = None if g.identity else TiledIndex.of(g.index)
        info = {
            "identity": g.identity,
            "kernel": g.kernel,
            **({} if g.identity else shape_of(g.index, tiles, "scale" not in attr)),
        }
        info["rows"] = variants(g, src, dst, ref, dev, bool(info.get("is_permutation")), tiles)
        out["tensors"][attr] = info
    out["trainer_write"] = trainer_write_rows(staged, layout, process, experts, dev)
    for attr, w in out["trainer_write"].items():
        writes = {k: r for k, r in w.items() if k.startswith("write_")}
        best = min(writes.items(), key=lambda kv: kv[1]["s"]) if writes else None
        print(
            f"gather trainer_write {name}.{attr}: "
            + (
                w["refused"]
                if "refused" in w
                else f"units of {w['blocks_per_unit']} blocks into {w['chunks_per_unit']} chunks"
                + (
                    f"; best {best[0]} {best[1]['GBps']:.0f} GB/s (copy {w['copy_same_traffic']['GBps']:.0f}), "
                    f"bytes equal vLLM's: {all(r['bytes_equal'] for r in writes.values())}; "
                    f"quantize then gather {w['quantize_then_gather']['s'] * 1e3:.2f} ms vs {best[1]['s'] * 1e3:.2f} ms"
                    if best
                    else ""
                )
            )
        )
    print(
        f"{name}: "
        + ", ".join(
            f"{a} {t['rows']['library']['GBps']:.0f} GB/s (copy {t['rows']['copy']['GBps']:.0f})"
            for a, t in out["tensors"].items()
        )
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: a stand-in layout on tiny shapes (no vLLM)")
    ap.add_argument("--standin", action="store_true", help="GPU without vLLM: the stand-in layout at the model's shapes")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    torch.set_default_dtype(torch.bfloat16)  # the engine's parameter dtype: Marlin's scales pass through it
    result: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "kinds": {}}
    for name, (staged, experts, process) in kinds(args.smoke, dev, args.standin).items():
        result["kinds"][name] = profile_kind(name, staged, experts, process, dev)
    done = [k for k in result["kinds"].values() if "apply_all_s" in k]
    result["all_equal"] = bool(done) and all(
        k["apply_all_equal"]
        and all(r.get("bytes_equal", True) for t in k["tensors"].values() for r in t["rows"].values())
        and all(r.get("bytes_equal", True) for t in k["trainer_write"].values() for r in t.values() if isinstance(r, dict))
        for k in done
    )
    if not args.smoke:
        layer = sum(k["apply_all_s"] for k in done)
        copy = sum(t["rows"]["copy"]["s"] for k in done for t in k["tensors"].values())
        result["per_refit_48_layers_ms"] = {"library": LAYERS * layer * 1e3, "copy_same_bytes": LAYERS * copy * 1e3}
        print(f"gather per 48-layer refit: {LAYERS * layer * 1e3:.1f} ms (a copy of the same bytes {LAYERS * copy * 1e3:.1f} ms)")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"all bytes equal the processing's: {result['all_equal']}")


if __name__ == "__main__":
    main()
