#!/usr/bin/env python3
"""The headline on a real vLLM (issue 22): Qwen3-30B-A3B's exact shapes in vLLM 0.26, refitted
from a trainer holding the BF16 weights, by mxrefit and by vLLM's own IPC weight-transfer path,
in one process on one GPU, next to the device-to-device copy floor measured in the run.

vLLM starts with ``load_format="dummy"`` from a folder holding only config.json (and, for MXFP8,
the ModelOpt quantization config), so no 61 GB checkpoint is written. The trainer's weights are
random BF16 tensors with transformers 5's in-memory names (grouped expert slabs).

Per format (``--fmts mxfp8,bf16``, one engine at a time; the trainer keeps its 61 GB):
- mxrefit: ``--refits`` refits through the worker extension (``Sender(device="cuda")``): the
  sender's phases and the engine's apply/process times from the RefitReport, the device's
  peak extra memory during the refit (``mem_get_info`` sampled every ms; trainer's own share from
  its allocator), and the time to the first token after the refit; ``--more-bucket-mb 2048,...``
  then repeats those refits on the same engine with a new trainer (a new plan) per bucket size
  (per-bucket costs on both sides: the trainer's turn-around, the engine's processing and sync);
  ``--in-step`` then repeats them with ``Sender(one_behind=False)`` (each bucket's "ready" sent as
  soon as it is queued; the default sends it one bucket behind), so the real engine times the
  option beside the default;
- vLLM's own path: ``--own-refits`` rounds of ``start_weight_update`` / IPC
  ``trainer_send_weights`` (packed, 1 GiB buffer; the checkpoint-format tensors, quantized on the
  trainer by vLLM's own ``mxfp8_e4m3_quantize`` for MXFP8, per-expert names as a ModelOpt
  checkpoint holds them) / ``finish_weight_update``, each phase timed; then the same first-token time.
vLLM 0.26's IPC engine module imports ``ray`` (not on the H200): ``scripts/vllm_hooks/noray``
holds an empty stand-in that the shell puts on PYTHONPATH for this run only.
The engine's config, vLLM's own path and the mxrefit refit are ``mxrefit.bench.peer_vllm``'s, which
``mxrefit bench --peer vllm`` runs too.

    python3 scripts/vllm_headline.py --fmts mxfp8,bf16 --json $OUT/headline.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vllm_oracle's worker probes


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] headline:", *a, flush=True)


def config_dir(path: str, fmt: str, layers: int) -> str:
    """Qwen3-30B-A3B's config with ``layers`` layers (``mxrefit.bench.peer_vllm.config_dir``)."""
    from dataclasses import replace

    from mxrefit.bench.peer_vllm import config_dir as shape_config_dir
    from mxrefit.plan.shapes import BUILTIN

    return shape_config_dir(path, replace(BUILTIN["qwen3-30b-a3b"], layers=layers), fmt)


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, bytes read + written per second (median of 10)."""
    import torch

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / statistics.median(times)


def first_token_s(llm) -> float:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - t0


def trainer_weights(layers: int, distinct: int = 0):
    """The trainer's BF16 weights. ``distinct`` > 0: layer i holds views of layer i mod ``distinct``'s
    storage, so an 80 GB card runs 48 layers' traffic (every refit still reads and writes every
    layer's bytes; the L2 is 50 MB, so no reuse) beside a 48-layer engine."""
    from dataclasses import replace

    import torch

    from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs

    shape = replace(BUILTIN["qwen3-30b-a3b"], layers=layers)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shp, dtype in hf_tensor_specs(shape, experts="grouped"):
        m = re.match(r"(.*\.layers\.)(\d+)(\..*)", name)
        if distinct and m and int(m[2]) >= distinct:
            out[name] = out[f"{m[1]}{int(m[2]) % distinct}{m[3]}"]
            continue
        t = torch.empty(shp, dtype=dtype, device="cuda")
        t.normal_(0, 0.02, generator=g)
        out[name] = t
    return out


def _process_by_kind(worker) -> dict:
    return dict(worker._mxrefit.engine.process_by_kind)


def _reset_process_by_kind(worker) -> None:
    worker._mxrefit.engine.process_by_kind.clear()


def soak(args, llm, sender, weights: dict, dump) -> dict:
    """``--soak`` more refits with generation between: the worker's RSS, fds, mappings and CUDA
    memory, the device's used memory and the trainer's own, sampled every 10 refits, must stay flat."""
    import cloudpickle
    import torch
    import vllm_oracle
    from vllm import SamplingParams

    from mxrefit.integrations.vllm.client import refit_while

    cloudpickle.register_pickle_by_value(vllm_oracle)  # the worker cannot import scripts/
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out: dict = {"refits": args.soak, "samples": [], "ms": []}
    for i in range(1, args.soak + 1):
        with torch.no_grad():
            for t in list(weights.values())[:8]:
                t.add_(1e-3)
        r = refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
        out["ms"].append(r.total_s * 1e3)
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}] * 4, sp, use_tqdm=False)
        if i == 1 or i % 10 == 0:
            row = {
                "refit": i,
                **vllm_oracle.worker_stats(llm),
                "trainer_rss_mb": vllm_oracle.rss_mb(),
                "trainer_fds": len(os.listdir("/proc/self/fd")),
                "trainer_allocated_mb": torch.cuda.memory_allocated() / 2**20,
            }
            out["samples"].append(row)
            log(
                f"soak {i}: {r.total_s * 1e3:.1f} ms, worker rss {row['rss_mb']:.0f} MB fds {row['fds']} "
                f"nvidia maps {row['nvidia_maps']} reserved {row.get('reserved_mb', 0):.0f} MB, device {row['device_used_gb']:.2f} GB"
            )
            dump()
    first, last = out["samples"][1], out["samples"][-1]
    out["growth_from_refit_10"] = {k: last[k] - first[k] for k in first if isinstance(first[k], (int, float)) and k != "pid"}
    out["median_ms"] = statistics.median(out["ms"][1:])
    return out


def steady_ms(rows: list[dict]) -> float:
    """Median refit time after the refits that settled the layout (``peer_vllm.settled_at``)."""
    from mxrefit.bench.peer_vllm import settled_at

    return statistics.median(r["total_ms"] for r in rows[settled_at(rows) :] or rows)


def mxrefit_refits(args, what: str, llm, sender, weights: dict, n: int | None = None) -> list[dict]:
    """``n`` (default ``args.refits``) refits through ``sender`` (the weights change between them), one row each."""
    import torch

    from mxrefit.bench.peer_vllm import mxrefit_refit

    refits = []
    for i in range(args.refits if n is None else n):
        if i == 1:  # the per-kind profile covers the steady refits: the first one learns and builds staging
            llm.collective_rpc(_reset_process_by_kind)
        with torch.no_grad():
            for t in list(weights.values())[:8]:
                t.add_(1e-3)  # the weights change between refits
        r, mem = mxrefit_refit(llm, sender, weights)
        llm.reset_prefix_cache()
        ttft = first_token_s(llm)
        row = {
            "total_ms": r.total_s * 1e3,
            "check_ms": r.check_s * 1e3,
            "pack_ms": r.pack_s * 1e3,
            "wait_ms": r.wait_s * 1e3,
            "engine_fetch_ms": r.engine_fetch_s * 1e3,
            "engine_apply_ms": r.engine_apply_s * 1e3,
            "engine_process_ms": r.engine_process_s * 1e3,
            "engine_after_refit_ms": r.engine_after_refit_s * 1e3,
            "bytes": r.bytes,
            "buckets": r.buckets,
            "transport": r.transport,
            "extra": r.extra,
            "peak_extra_device_gb": mem.extra_gb,
            "peak_extra_trainer_gb": mem.trainer_extra_gb,
            "device_gb_left_after": mem.after_gb,
            "first_token_after_s": ttft,
            "replanned": bool(getattr(r, "replanned", False)),  # the engine's tables changed (learned orders): planned again
        }
        refits.append(row)
        log(
            f"{what}: mxrefit {i + 1}: {row['total_ms']:.1f} ms (process {row['engine_process_ms']:.1f} ms, "
            f"{r.bytes / 1e9:.2f} GB, {r.transport}), peak +{mem.extra_gb:.2f} GB, first token {ttft * 1e3:.1f} ms"
        )
    return refits


def run_format(args, fmt: str, weights: dict, result: dict, dump) -> None:
    import torch
    from vllm import LLM

    from mxrefit.bench.peer_vllm import engine_kwargs
    from mxrefit.source.sender import Sender

    path = config_dir(os.path.join(args.work, fmt), fmt, args.layers)
    kw = engine_kwargs(path, gpu_util=args.gpu_util, own_path=bool(args.own_refits))
    if args.moe_backend:
        kw["moe_backend"] = args.moe_backend
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    res: dict = {"engine_kwargs": {k: v for k, v in kw.items() if k != "model"}}
    result[fmt] = res
    t0 = time.time()
    llm = LLM(**kw)
    res["engine_start_s"] = time.time() - t0
    res["device_used_gb_engine_up"] = (lambda f, t: (t - f) / 1e9)(*torch.cuda.mem_get_info())
    log(f"{fmt}: engine up in {res['engine_start_s']:.1f} s")
    res["first_token_steady_s"] = min(first_token_s(llm) for _ in range(3))
    try:
        info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped"})[0]
        res["init"] = {k: v for k, v in info.items() if k != "token"}
        if args.gather_refits:  # A/B in one run: a trainer that keeps its first plan gets the engine's learned gather
            pinned = Sender(
                info["address"],
                bytes.fromhex(info["token"]),
                device="cuda",
                bucket_bytes=args.bucket_mb << 20,
                follow_tables=False,
            )
            res["engine_gather"] = gathered = mxrefit_refits(
                args, f"{fmt} engine gather", llm, pinned, weights, args.gather_refits
            )
            res["engine_gather_median_ms"] = steady_ms(gathered)
            pinned.close()
            dump()
        sender = Sender(info["address"], bytes.fromhex(info["token"]), device="cuda", bucket_bytes=args.bucket_mb << 20)
        res["mxrefit"] = refits = mxrefit_refits(args, fmt, llm, sender, weights)
        res["mxrefit_median_ms"] = steady_ms(refits)
        # MXREFIT_PROFILE=1: the engine's post-load processing per module kind, per refit from the second on
        res["process_by_kind_ms_per_refit"] = {
            k: v * 1e3 / max(1, args.refits - 1) for k, v in llm.collective_rpc(_process_by_kind)[0].items()
        }
        dump()
        if args.soak:
            res["soak"] = soak(args, llm, sender, weights, dump)
        for mb in args.more_bucket_mb:  # the same engine, a new trainer and plan with larger buckets
            sender.close()
            sender = Sender(info["address"], bytes.fromhex(info["token"]), device="cuda", bucket_bytes=mb << 20)
            more = mxrefit_refits(args, f"{fmt} @{mb} MiB buckets", llm, sender, weights)
            res.setdefault("bucket_sweep", {})[mb] = {
                "refits": more,
                "median_ms": steady_ms(more),
            }
            dump()
        if args.in_step:  # the same engine, a new trainer whose ready messages go out as soon as queued
            sender.close()
            sender = Sender(
                info["address"], bytes.fromhex(info["token"]), device="cuda", bucket_bytes=args.bucket_mb << 20, one_behind=False
            )
            in_step = mxrefit_refits(args, f"{fmt} in step", llm, sender, weights)
            res["in_step"] = {"refits": in_step, "median_ms": steady_ms(in_step)}
            dump()
        sender.close()
        llm.collective_rpc("mxrefit_close")
        dump()
        own = []
        if args.own_refits:
            from mxrefit.bench.peer_vllm import own_refit

            for i in range(args.own_refits):
                r = own_refit(llm, weights, fmt)
                llm.reset_prefix_cache()
                ttft = first_token_s(llm)
                row = {
                    "total_ms": r["total_s"] * 1e3,
                    "start_ms": r["start_s"] * 1e3,
                    "send_and_load_ms": r["send_load_s"] * 1e3,
                    "trainer_quantize_ms": r["trainer_quantize_s"] * 1e3,
                    "finish_ms": r["finish_s"] * 1e3,
                    "peak_extra_device_gb": r["device_peak_extra_bytes"] / 1e9,
                    "peak_extra_trainer_gb": r["trainer_peak_extra_bytes"] / 1e9,
                    "first_token_after_s": ttft,
                }
                own.append(row)
                log(
                    f"{fmt}: vLLM IPC {i + 1}: {row['total_ms']:.1f} ms (send+load {row['send_and_load_ms']:.1f}, "
                    f"finish {row['finish_ms']:.1f}), peak +{row['peak_extra_device_gb']:.2f} GB, first token {ttft * 1e3:.1f} ms"
                )
            res["vllm_ipc"] = own
            res["vllm_ipc_median_ms"] = statistics.median(r["total_ms"] for r in own)
            res["speedup"] = res["vllm_ipc_median_ms"] / res["mxrefit_median_ms"]
    finally:
        from mxrefit.bench.peer_vllm import shutdown

        try:
            shutdown(llm)
        except Exception as err:  # noqa: BLE001
            log("shutdown:", err)
        del llm
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fmts", default="mxfp8,bf16")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument(
        "--distinct-layers",
        type=int,
        default=0,
        help="the trainer holds this many layers' storage and the rest are views of them (0: all distinct); "
        "lets an 80 GB card time a 48-layer MXFP8 refit",
    )
    p.add_argument("--refits", type=int, default=4)
    p.add_argument(
        "--gather-refits",
        type=int,
        default=0,
        help="first, this many refits from a trainer that keeps its first plan (MXREFIT_LEARNED_LAYOUT: the engine's "
        "learned gather), then the usual refits, which write the learned orders: both in one run",
    )
    p.add_argument("--own-refits", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument(
        "--more-bucket-mb",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="after the refits (and the soak): as many refits again at each of these bucket sizes, same engine",
    )
    p.add_argument(
        "--in-step",
        action="store_true",
        help="after those: as many refits again with Sender(one_behind=False), same engine and bucket size",
    )
    p.add_argument("--gpu-util", type=float, default=0.45)
    p.add_argument("--moe-backend", default=None)
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=256,
        help="max_num_batched_tokens: vLLM's start-up warm-up forward runs this many tokens",
    )
    p.add_argument("--soak", type=int, default=0, help="then this many refits with generation between, resources sampled")
    p.add_argument("--work", default="/tmp/mxrefit_headline")
    p.add_argument("--json", default="headline.json")
    args = p.parse_args()
    if args.distinct_layers and not 0 < args.distinct_layers < args.layers:
        p.error(f"--distinct-layers {args.distinct_layers} must be between 1 and --layers {args.layers} - 1 (0: all distinct)")
    import torch

    result: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name()}
    result["copy_gbps"] = copy_bandwidth() / 1e9
    log(f"copy {result['copy_gbps']:.0f} GB/s")
    weights = trainer_weights(args.layers, args.distinct_layers)
    result["trainer_gb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    result["trainer_tensors"] = len(weights)
    result["trainer_storage_gb"] = sum({t.data_ptr(): t.numel() * t.element_size() for t in weights.values()}.values()) / 1e9
    log(f"trainer: {len(weights)} tensors, {result['trainer_gb']:.1f} GB")

    def dump():
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for fmt in args.fmts.split(","):
        engine_gb = result["trainer_gb"] * (0.5 + 1 / 64 if fmt == "mxfp8" else 1.0)
        result.setdefault("floor_ms", {})[fmt] = (result["trainer_gb"] + engine_gb) / result["copy_gbps"] * 1e3
        try:
            run_format(args, fmt, weights, result, dump)
        except Exception:  # noqa: BLE001 - recorded; the next format still runs
            import traceback

            result.setdefault(fmt, {})["error"] = traceback.format_exc()
            log(f"{fmt}: ERROR\n{result[fmt]['error']}")
        dump()
        r = result.get(fmt, {})
        if "mxrefit_median_ms" in r:
            log(
                f"{fmt}: mxrefit {r['mxrefit_median_ms']:.1f} ms, vLLM IPC {r.get('vllm_ipc_median_ms', float('nan')):.1f} ms, "
                f"speedup {r.get('speedup', float('nan')):.1f}x, floor {result['floor_ms'][fmt]:.1f} ms"
            )
        if "engine_gather_median_ms" in r:
            log(f"{fmt}: the engine's learned gather (first plan kept) {r['engine_gather_median_ms']:.1f} ms, same run")
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
