"""H200 run for the colocated lifecycle: pinned copy bandwidth, then slim offload, reference swap and the
prepare-for-generation phase measured against it, all in one run.

    python scripts/gpu_lifecycle.py --json $OUT/lifecycle.json            # H200
    python scripts/gpu_lifecycle.py --smoke --json /tmp/lifecycle.json    # CPU, reduced sizes

1. Bandwidth: host<->device copies of ``--bw-gib`` between a ``PinnedArena`` (page-locked with
   cudaHostRegister) and the GPU, each direction alone and both at once; torch's own pinned memory
   (cudaHostAlloc) alongside, to show registered memory copies as fast.
2. Offload: a real AdamW (fp32) over model-shaped tensors (Qwen3-30B-A3B's, in order) whose
   gradients + exp_avg + exp_avg_sq are ``--state-gib``; offload and reload timed to completion,
   median of ``--reps`` after a warm-up, as GB/s and % of the same direction's bandwidth; every
   offloaded byte compared after the first reload; device memory before/after. Overlap: the
   offload alone, a device-to-device copy workload alone, and both at once.
3. Reference swap of ``--ref-gib`` of BF16 weights: swap_in (both directions at once) against the
   serial and the measured duplex floor, swap_out against host->device; bytes and data pointers
   checked.
4. Phase: ``mxrefit.bench.phase`` on ``--model`` (overlap and serial modes), state ``--state-gib``.
Target: offload, reload and swaps at >= 80% of the pinned bandwidth measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch

from mxrefit.lifecycle import OptimizerOffloader, PinnedArena, ReferenceSwap
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs

GiB = 1 << 30


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


def median_time(dev: torch.device, fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        timed(dev, fn)
    return statistics.median(timed(dev, fn) for _ in range(reps))


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def bandwidth(dev: torch.device, nbytes: int, reps: int) -> dict:
    """Bytes per second, pinned host<->device, each direction alone and both at once."""
    cuda = dev.type == "cuda"
    host = [PinnedArena(nbytes, what="bandwidth buffer") for _ in range(2)]
    devbuf = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in range(2)] if cuda else [None, None]

    def both():
        for s, fn in zip(
            streams,
            (lambda: devbuf[0].copy_(host[0].data, non_blocking=cuda), lambda: host[1].data.copy_(devbuf[1], non_blocking=cuda)),
        ):
            if s is None:
                fn()
            else:
                s.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream(dev).wait_stream(s)

    out = {"bytes": nbytes, "arena_is_pinned": bool(host[0].data.is_pinned()) if cuda else False}
    t_h2d = median_time(dev, lambda: devbuf[0].copy_(host[0].data, non_blocking=cuda), reps)
    t_d2h = median_time(dev, lambda: host[0].data.copy_(devbuf[0], non_blocking=cuda), reps)
    t_both = median_time(dev, both, reps)
    out.update(
        h2d_GBps=nbytes / t_h2d / 1e9, d2h_GBps=nbytes / t_d2h / 1e9, both_s=t_both, both_GBps_per_direction=nbytes / t_both / 1e9
    )
    if cuda:  # torch's caching host allocator (cudaHostAlloc): the same copies
        alloc = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["torch_pinned_h2d_GBps"] = nbytes / median_time(dev, lambda: devbuf[0].copy_(alloc, non_blocking=True), reps) / 1e9
        out["torch_pinned_d2h_GBps"] = nbytes / median_time(dev, lambda: alloc.copy_(devbuf[0], non_blocking=True), reps) / 1e9
        del alloc
    for h in host:
        h.close()
    return out


def model_shaped(
    model: str, nbytes: int, dtype: torch.dtype, bytes_per_element: int, dev: torch.device, seed: int
) -> list[torch.Tensor]:
    """Tensors with the model's HF shapes, in order, until ``bytes_per_element`` x elements reaches ``nbytes``."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out, total = [], 0
    while total < nbytes:
        for _, shape, _ in hf_tensor_specs(BUILTIN[model]):
            if total >= nbytes:
                break
            t = torch.randn(shape, generator=g, device=dev, dtype=torch.float32).mul_(0.02).to(dtype)
            out.append(t)
            total += t.numel() * bytes_per_element
    return out


def _storages(off: OptimizerOffloader) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in (p for g in off.optimizer.param_groups for p in g["params"]):
        for t in [p.grad, *off.optimizer.state[p].values()]:
            if isinstance(t, torch.Tensor) and t.device == off.device and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                out.append(t)
    return out


def offload_bench(dev: torch.device, model: str, state_bytes: int, reps: int, bw: dict) -> dict:
    params = [torch.nn.Parameter(t) for t in model_shaped(model, state_bytes, torch.float32, 12, dev, seed=1)]
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()
    off = OptimizerOffloader(opt)
    tensors = _storages(off)
    want = [t.clone() for t in tensors]
    cuda = dev.type == "cuda"
    _free(dev)
    allocated, reserved = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)) if cuda else (0, 0)
    out: dict = {"tensors": len(params), "storages": len(tensors)}
    t = time.perf_counter()
    off.offload()
    off.wait(release=False)
    out["first_offload_s"] = time.perf_counter() - t  # includes allocating + page-locking the arena
    out["arena_is_pinned"] = off.arena.pinned and bool(off.arena.data.is_pinned()) if cuda else False
    out["freed_bytes"] = allocated - torch.cuda.memory_allocated(dev) if cuda else 0
    off.wait()  # releases the cached blocks to the driver
    out["released_bytes"] = reserved - torch.cuda.memory_reserved(dev) if cuda else 0
    off.reload()
    off.wait()
    out["mismatched_storages"] = sum(
        not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(tensors, want)
    )
    del want
    _free(dev)
    nbytes = off.nbytes
    _free(dev)
    before_reps = torch.cuda.memory_allocated(dev) if cuda else 0
    offload_s, reload_s, release_s = [], [], []
    for _ in range(reps):
        offload_s.append(timed(dev, lambda: (off.offload(), off.wait(release=False))))
        release_s.append(timed(dev, torch.cuda.empty_cache if dev.type == "cuda" else (lambda: None)))
        reload_s.append(timed(dev, lambda: (off.reload(), off.wait())))
    out["allocated_growth_bytes"] = (torch.cuda.memory_allocated(dev) - before_reps) if cuda else 0
    out.update(
        bytes=nbytes,
        arena_allocations=off.arena_allocations,
        offload_s=statistics.median(offload_s),
        reload_s=statistics.median(reload_s),
        release_s=statistics.median(release_s),
    )
    out["offload_GBps"] = nbytes / out["offload_s"] / 1e9
    out["reload_GBps"] = nbytes / out["reload_s"] / 1e9
    out["offload_pct_of_d2h"] = 100 * out["offload_GBps"] / bw["d2h_GBps"]
    out["reload_pct_of_h2d"] = 100 * out["reload_GBps"] / bw["h2d_GBps"]
    out["overlap"] = overlap_bench(dev, off, reps)
    off.close()
    del opt, params, tensors
    _free(dev)
    return out


def overlap_bench(dev: torch.device, off: OptimizerOffloader, reps: int) -> dict:
    """The offload alone, a device-to-device copy workload alone (sized to last about as long), both at once."""
    chunk = min(2 * GiB, max(1 << 20, off.nbytes // 8))
    src = torch.empty(chunk, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    work = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    one = median_time(dev, lambda: dst.copy_(src), 3)
    alone_off = median_time(dev, lambda: (off.offload(), off.wait(release=False), off.reload(), off.wait()), reps)
    copies = max(1, math.ceil(alone_off / one))

    def workload():
        if work is None:
            for _ in range(copies):
                dst.copy_(src)
            return
        work.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(work):
            for _ in range(copies):
                dst.copy_(src)

    alone_work = median_time(dev, workload, reps)
    both = median_time(dev, lambda: (workload(), off.offload(), off.wait(release=False), off.reload(), off.wait()), reps)
    hidden = (alone_off + alone_work - both) / min(alone_off, alone_work)
    return {
        "what": "offload+reload vs device-to-device copies on another stream",
        "copy_bytes_each": chunk,
        "copies": copies,
        "offload_reload_alone_s": alone_off,
        "copies_alone_s": alone_work,
        "both_s": both,
        "hidden_fraction": hidden,
    }


def reference_bench(dev: torch.device, model: str, nbytes: int, reps: int, bw: dict) -> dict:
    live_list = model_shaped(model, nbytes, torch.bfloat16, 2, dev, seed=2)
    ref_list = model_shaped(model, nbytes, torch.bfloat16, 2, dev, seed=3)
    live = {f"t{i}": t for i, t in enumerate(live_list)}
    ref = {f"t{i}": t for i, t in enumerate(ref_list)}
    original = [t.clone() for t in live_list]
    ptrs = [t.data_ptr() for t in live_list]
    t = time.perf_counter()
    swap = ReferenceSwap(live, ref)
    out: dict = {"tensors": len(live), "bytes": swap.nbytes, "build_s": time.perf_counter() - t}
    swap.swap_in()
    swap.wait()
    out["mismatched_in"] = sum(not torch.equal(a, b) for a, b in zip(live_list, ref_list))
    swap.swap_out()
    swap.wait()
    out["mismatched_out"] = sum(not torch.equal(a, b) for a, b in zip(live_list, original))
    del ref_list, ref, original
    _free(dev)
    before_reps = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    ins, outs = [], []
    for _ in range(reps + 1):
        ins.append(timed(dev, lambda: (swap.swap_in(), swap.wait())))
        outs.append(timed(dev, lambda: (swap.swap_out(), swap.wait())))
    n = swap.nbytes
    out.update(
        swap_in_s=statistics.median(ins[1:]),
        swap_out_s=statistics.median(outs[1:]),
        pointers_kept=[t.data_ptr() for t in live_list] == ptrs,
        allocated_growth_bytes=(torch.cuda.memory_allocated(dev) - before_reps) if dev.type == "cuda" else 0,
    )
    serial_floor = n / (bw["d2h_GBps"] * 1e9) + n / (bw["h2d_GBps"] * 1e9)
    duplex_floor = n / (bw["both_GBps_per_direction"] * 1e9)
    out.update(
        swap_in_pct_of_serial_floor=100 * serial_floor / out["swap_in_s"],
        swap_in_pct_of_duplex_floor=100 * duplex_floor / out["swap_in_s"],
        swap_out_GBps=n / out["swap_out_s"] / 1e9,
    )
    out["swap_out_pct_of_h2d"] = 100 * out["swap_out_GBps"] / bw["h2d_GBps"]
    swap.close()
    del swap, live, live_list
    _free(dev)
    return out


def _copy_parts(dev: torch.device, args, result: dict, save) -> bool:
    """Parts 1-3: bandwidth, slim offload and reference swap; returns whether every byte came back exact."""
    result["bandwidth"] = bw = bandwidth(dev, int(args.bw_gib * GiB), args.reps)
    print(json.dumps(bw), flush=True)
    save()
    result["offload"] = off = offload_bench(dev, args.model, int(args.state_gib * GiB), args.reps, bw)
    print(json.dumps(off), flush=True)
    save()
    result["reference_swap"] = ref = reference_bench(dev, args.model, int(args.ref_gib * GiB), args.reps, bw)
    print(json.dumps(ref), flush=True)
    save()
    result["targets_80pct"] = {
        "offload": off["offload_pct_of_d2h"] >= 80,
        "reload": off["reload_pct_of_h2d"] >= 80,
        "swap_in_vs_serial": ref["swap_in_pct_of_serial_floor"] >= 80,
        "swap_out": ref["swap_out_pct_of_h2d"] >= 80,
    }
    exact = off["mismatched_storages"] == 0 and ref["mismatched_in"] == 0 and ref["mismatched_out"] == 0 and ref["pointers_kept"]
    result["bit_exact"] = exact
    save()
    return exact


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, reduced sizes: checks that the script runs")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--bw-gib", type=float, default=4.0)
    ap.add_argument("--state-gib", type=float, default=20.0)
    ap.add_argument("--ref-gib", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phase-steps", type=int, default=3)
    ap.add_argument("--skip-phase", action="store_true")
    ap.add_argument("--phase-only", action="store_true", help="only part 4 (the bandwidth parts were recorded before)")
    args = ap.parse_args(argv)
    if args.smoke:
        dev = torch.device("cpu")
        args.bw_gib, args.state_gib, args.ref_gib, args.reps, args.phase_steps = 1 / 64, 1 / 64, 1 / 64, 2, 1
        args.model, phase_state = "tiny-qwen3-moe", 8 << 20
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke on CPU", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        phase_state = int(args.state_gib * GiB)
    result: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "args": vars(args),
    }

    def save():
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    exact = True
    if not args.phase_only:
        exact = _copy_parts(dev, args, result, save)
    if not args.skip_phase:
        from mxrefit.bench.phase import phase_bench

        result["phase"] = phase = phase_bench(
            args.model,
            str(dev),
            steps=args.phase_steps,
            warmup=1,
            state_bytes=phase_state,
            bucket_bytes=(1 << 20) if args.smoke else 512 << 20,
        )
        for mode, m in phase["modes"].items():
            print(mode, json.dumps(m["generation"]), json.dumps(m["training"]), flush=True)
        exact = exact and phase["state_sample_mismatched"] == 0 and not phase["check"]["mismatched"]
        result["bit_exact"] = exact
        save()
    print(json.dumps({"targets_80pct": result.get("targets_80pct"), "bit_exact": exact}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
