"""H200 soak: repeated refits of Qwen3-30B-A3B's exact shapes over CUDA IPC, resources sampled; expandable segments.

    python scripts/gpu_soak.py                 # on the H200: JSON to $OUT/gpu_soak.json (about 4 minutes, 9.5 at most)
    python scripts/gpu_soak.py --smoke         # on a CPU: tiny model over shared memory, CUDA-only runs skipped

Runs, each a fresh trainer process that spawns its engine process (``integrations.vllm.layout`` tables in a
``LayoutEngine``, a real ``Receiver``; the trainer is a real ``Sender``):
- ``direct``: ``--refits`` refits (100), the trainer writing into the engine's exported arena
  (the default transport on one GPU);
- ``buffers``: ``--refits`` refits through the two persistent CUDA IPC transfer buffers;
- ``buffers_expandable`` and ``direct_expandable``: 30 refits each with both processes started
  under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; the transfer buffers must not be
  expandable (``torch.cuda.memory_snapshot``) while the trainer's weights are.
Each run records every refit's time and, at refits 1, 10, 50 and the last, per process: CUDA
memory allocated/reserved (the engine's via a probe thread), host RSS, open fds, mappings of
``/dev/nvidia*`` (where opened IPC handles show), gc-tracked objects after a full collection (and before it), the engine's
report-history length; plus device memory used
(``cudaMemGetInfo``, nvidia-smi) and an engine byte check of one tensor per family. "Flat" from
the sample at refit 10 to the last: equal fds, /dev/nvidia mappings and CUDA allocated/reserved
bytes; RSS and device-used growth under 64 MiB; gc objects under 200.
A third, diagnostic step exports ordinary expandable-segment memory the way torch shares CUDA
tensors (no mxrefit allocation) and opens it in another process: what mxrefit avoids.
The exit status is 1 if any run failed a check.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

SAMPLES = (1, 10, 50)
WARM = 10
EXPANDABLE_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


# ---- measurements -------------------------------------------------------------------------


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def _proc_counts(pid: int) -> dict:
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read().splitlines()
    return {
        "rss": _rss(pid),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "maps": len(maps),
        "nvidia_maps": sum("/dev/nvidia" in m for m in maps),
        "shm_maps": sum("/dev/shm/" in m for m in maps),
    }


def _objects() -> dict:
    """gc-tracked objects after a full collection (what is still reachable: a leak) and before it (garbage in
    reference cycles, freed by the next collection; the first H200 soak counted without collecting and saw the
    engine's count rise ~300 per probe, not per refit)."""
    before = len(gc.get_objects())
    gc.collect()
    return {"objects": len(gc.get_objects()), "objects_before_collect": before}


def _cuda_counts(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def _nvidia_smi_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


# ---- engine process -----------------------------------------------------------------------


def _answer_probes(conn, device: torch.device, receiver) -> None:
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        counts = {**_cuda_counts(device), **_objects(), "history": len(receiver.history)}
        expandable = sum(s.get("is_expandable", False) for s in torch.cuda.memory_snapshot()) if device.type == "cuda" else 0
        conn.send({**counts, "expandable_segments": expandable})


def engine_main(conn, probe_conn, model: str, device: str, timeout_s: float) -> None:
    from mxrefit.devices import bind
    from mxrefit.engine.layout import LayoutEngine
    from mxrefit.engine.receiver import Receiver
    from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
    from mxrefit.plan.shapes import BUILTIN

    dev = bind(device)
    shape = BUILTIN[model]
    engine = LayoutEngine(vllm_params(shape, mxfp8=True), vllm_destinations(shape, mxfp8=True), dev)
    receiver = Receiver(engine, timeout_s=timeout_s)
    threading.Thread(target=_answer_probes, args=(probe_conn, dev, receiver), daemon=True).start()
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        receiver.close()


# ---- one run (this process is the trainer) ------------------------------------------------


def _buffers_expandable(sender) -> list[bool]:
    segments = torch.cuda.memory_snapshot()

    def expandable(t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(s["address"] <= p < s["address"] + s["total_size"] and s.get("is_expandable", False) for s in segments)

    return [expandable(b) for b in sender.buffers.buffers]


def _flat(samples: list[dict]) -> dict:
    warm = next(s for s in samples if s["refit"] == WARM)
    last = samples[-1]
    checks = {}
    for side in ("trainer", "engine"):
        for key in ("fds", "nvidia_maps", "shm_maps", "allocated", "reserved"):
            if key in warm[side]:
                checks[f"{side}.{key} equal"] = last[side][key] == warm[side][key]
        checks[f"{side}.rss growth < 64 MiB"] = last[side]["rss"] - warm[side]["rss"] < 64 << 20
        checks[f"{side}.objects growth < 200"] = last[side]["objects"] - warm[side]["objects"] < 200
    if warm.get("device_used") is not None:
        checks["device used growth < 64 MiB"] = last["device_used"] - warm["device_used"] < 64 << 20
    return checks


def trainer_run(model: str, device: str, refits: int, bucket_mb: int, transport: str, out_path: str) -> None:
    from mxrefit.bench.run import _sample_check, make_weights
    from mxrefit.devices import bind
    from mxrefit.integrations.vllm.layout import vllm_destinations
    from mxrefit.plan.build import SourceSpec
    from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs
    from mxrefit.source.sender import Sender

    dev = bind(device)
    shape = BUILTIN[model]
    specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape)]
    weights = make_weights(specs, dev)
    tensors = list(weights.values())
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    probe, probe_child = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(child, probe_child, model, device, 300.0), daemon=True)
    proc.start()
    result: dict = {
        "model": model,
        "device": device,
        "tensors": len(specs),
        "refits": refits,
        "transport": transport,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "ok": False,
    }
    sender = None
    try:
        if not conn.poll(180):
            raise RuntimeError("the engine process did not start within 180 s")
        hello = conn.recv()
        sender = Sender(
            hello["address"], hello["token"], device=dev, bucket_bytes=bucket_mb << 20, timeout_s=300, transport=transport
        )
        sender.plan(specs)
        result["transport_used"] = sender.transport
        if dev.type == "cuda":
            result["buffers_expandable"] = _buffers_expandable(sender) if sender.buffers is not None else []
            result["weights_expandable"] = any(s.get("is_expandable", False) for s in torch.cuda.memory_snapshot())
        times, samples, checks = [], [], []
        for refit in range(1, refits + 1):
            with torch.no_grad():
                torch._foreach_mul_(tensors, 1.0 + 2.0**-7 * (1 if refit % 2 else -1))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            sender.refit(weights)
            times.append(time.perf_counter() - t)
            if refit in SAMPLES or refit == refits:
                check = _sample_check(sender, shape, vllm_destinations(shape, mxfp8=True), weights, "none")
                checks.append({"refit": refit, **check})
                probe.send("probe")
                engine_side = probe.recv() if probe.poll(60) else {}
                free, total = torch.cuda.mem_get_info(dev) if dev.type == "cuda" else (0, 0)
                samples.append(
                    {
                        "refit": refit,
                        "trainer": {**_proc_counts(os.getpid()), **_cuda_counts(dev), **_objects()},
                        "engine": {**_proc_counts(proc.pid), **engine_side},
                        "device_used": total - free if dev.type == "cuda" else None,
                        "nvidia_smi_used_mib": _nvidia_smi_used_mib() if dev.type == "cuda" else None,
                    }
                )
        result.update(times_s=times, samples=samples, byte_checks=checks, flat=_flat(samples))
        result["bytes_exact"] = all(not c["mismatched"] for c in checks)
        # the buffers must be plain cudaMalloc memory; under expandable_segments:True the weights must not be
        expandable_ok = dev.type != "cuda" or (
            not any(result["buffers_expandable"])
            and ("expandable_segments:True" not in (result["alloc_conf"] or "") or result["weights_expandable"])
        )
        result["ok"] = result["bytes_exact"] and all(result["flat"].values()) and expandable_ok
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        if sender is not None:
            try:
                sender.close(shutdown_engine=True)
            except Exception:
                result.setdefault("error", traceback.format_exc())
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        with open(out_path, "w") as f:
            json.dump(result, f)


# ---- diagnostic: torch's own sharing of expandable memory ---------------------------------


def _open_raw(desc: dict, conn) -> None:
    try:
        from mxrefit.transport.factory import open_buffers

        opened = open_buffers(desc)
        conn.send({"opened": True, "first_bytes": opened.buffers[0][:4].cpu().tolist()})
    except Exception as err:
        conn.send({"opened": False, "error": f"{type(err).__name__}: {err}"[:500]})


def raw_expandable_ipc(out_path: str) -> None:
    """Export plain caching-allocator memory of an expandable_segments:True process and open it elsewhere."""
    from mxrefit.transport.cuda_ipc import _device_uuid

    result: dict = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    t = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    result["tensor_expandable"] = any(
        s["address"] <= t.data_ptr() < s["address"] + s["total_size"] and s.get("is_expandable", False)
        for s in torch.cuda.memory_snapshot()
    )
    try:
        fields = list(t.untyped_storage()._share_cuda_())
        result["exported"] = True
    except Exception as err:
        result.update(exported=False, export_error=f"{type(err).__name__}: {err}"[:500])
    if result["exported"]:
        desc = {
            "kind": "cuda_ipc",
            "nbytes": t.numel(),
            "device_uuid": _device_uuid(torch.cuda.current_device()),
            "owner_id": "diagnostic",
            "exports": [fields],
        }
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_open_raw, args=(desc, child))
        proc.start()
        result.update(conn.recv() if conn.poll(120) else {"opened": False, "error": "no answer within 120 s"})
        proc.join(30)
        result["opener_exit"] = proc.exitcode
    with open(out_path, "w") as f:
        json.dump(result, f)


# ---- orchestration -------------------------------------------------------------------------


def _child(args: list[str], env: dict, out_path: str, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args, "--result", out_path]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout_s} s"}
    try:
        with open(out_path) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {"ok": False, "error": "no result written"}
    out["exit"] = proc.returncode
    out["stderr_tail"] = proc.stderr[-3000:]
    return out


def _summary(name: str, run: dict) -> str:
    if "samples" not in run:
        return f"{name}: FAILED {run.get('error', '')[-800:]}"
    times = run["times_s"]
    lines = [
        f"{name} ({run.get('transport_used')}): ok={run['ok']} refits={len(times)} first={times[0]:.3f}s "
        f"median={sorted(times)[len(times) // 2]:.3f}s "
        f"last={times[-1]:.3f}s bytes_exact={run['bytes_exact']} buffers_expandable={run.get('buffers_expandable')}"
    ]
    for s in run["samples"]:
        t, e = s["trainer"], s["engine"]
        lines.append(
            f"  refit {s['refit']:4d}: trainer rss {t['rss'] >> 20} MiB fds {t['fds']} nv-maps {t['nvidia_maps']} "
            f"alloc {t.get('allocated', 0) >> 20} MiB | engine rss {e['rss'] >> 20} MiB fds {e['fds']} "
            f"nv-maps {e['nvidia_maps']} alloc {e.get('allocated', 0) >> 20} MiB | device used "
            f"{(s['device_used'] or 0) >> 20} MiB"
        )
    lines += [f"  NOT FLAT: {k}" for k, v in run["flat"].items() if not v]
    return "\n".join(lines)


def _write(path: str, report: dict, started: float) -> None:
    report["wall_s"] = time.perf_counter() - started
    report["ok"] = all(r.get("ok") for r in report["runs"].values())
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model over shared memory, GPU-only parts skipped")
    p.add_argument("--refits", type=int, default=None)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--runs", default=None, help="comma-separated subset of the runs, in this order (default: all)")
    p.add_argument("--role", choices=["trainer", "raw-expandable-ipc"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="qwen3-30b-a3b", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="direct", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "trainer":
        trainer_run(args.model, args.device, args.refits, args.bucket_mb, args.transport, args.result)
        return 0
    if args.role == "raw-expandable-ipc":
        raw_expandable_ipc(args.result)
        return 0

    cuda = torch.cuda.is_available() and not args.smoke
    model, device = ("qwen3-30b-a3b", "cuda") if cuda else ("tiny-qwen3-moe", "cpu")
    refits = args.refits or (100 if cuda else 20)
    if refits < WARM:
        p.error(f"--refits must be at least {WARM} (flatness is measured from refit {WARM})")
    bucket_mb = args.bucket_mb if cuda else 1
    os.makedirs(args.out, exist_ok=True)
    report: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": model,
        "refits": refits,
        "bucket_mb": bucket_mb,
        "runs": {},
    }
    started = time.perf_counter()
    out_json = os.path.join(args.out, "gpu_soak.json")
    # (name, environment, transport, refits, time limit): at most 150 + 150 + 110 + 110 + 60 s
    runs = [
        ("direct", {}, "direct", refits, 150),
        ("buffers", {}, "cuda_ipc", refits, 150),
        ("buffers_expandable", EXPANDABLE_ENV, "cuda_ipc", 30, 110),
        ("direct_expandable", EXPANDABLE_ENV, "direct", 30, 110),
    ]
    if not cuda:  # the same two data paths over host shared memory
        runs = [("direct", {}, "direct", refits, 240), ("buffers", {}, "shm", refits, 240)]
        report["skipped"] = "the expandable_segments runs and the raw IPC diagnostic need CUDA"
    if args.runs:
        wanted = args.runs.split(",")
        unknown = set(wanted) - {r[0] for r in runs}
        if unknown:
            p.error(f"--runs: unknown {sorted(unknown)}; choose from {[r[0] for r in runs]}")
        runs = [next(r for r in runs if r[0] == name) for name in wanted]
    for name, env, transport, n, limit in runs:
        args_ = [
            "--role",
            "trainer",
            "--model",
            model,
            "--device",
            device,
            "--refits",
            str(n),
            "--bucket-mb",
            str(bucket_mb),
            "--transport",
            transport,
        ]
        report["runs"][name] = _child(args_, env, os.path.join(args.out, f"gpu_soak_{name}.part.json"), limit)
        _write(out_json, report, started)  # written after every step: a cut-off run still leaves its figures
    if cuda and not args.runs:
        report["raw_expandable_ipc"] = _child(
            ["--role", "raw-expandable-ipc"], EXPANDABLE_ENV, os.path.join(args.out, "gpu_soak_raw.part.json"), 60
        )
    _write(out_json, report, started)
    for name, run in report["runs"].items():
        print(_summary(name, run))
    if "raw_expandable_ipc" in report:
        print("raw expandable IPC:", {k: v for k, v in report["raw_expandable_ipc"].items() if k != "stderr_tail"})
    print(f"ok={report['ok']} wall {report['wall_s']:.0f} s -> {out_json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
