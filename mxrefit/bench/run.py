"""`mxrefit bench`: trainer and engine in two processes, modes A/B against the copy floor, one run.

The trainer process (this one) makes random BF16 weights with the model's HF names and
shapes; the engine process holds vLLM's MXFP8 checkpoint layout (fused qkv / w13 / w2,
E4M3 values + uint8 scales; embeddings, router, norms, lm_head BF16). Modes:
- ``baseline``: BF16 over the wire, buffers and handles new each step, the engine quantizes
  tensor by tensor (``mxrefit.bench.baseline``);
- ``prequant``: mxrefit — MXFP8 quantized on the trainer straight into persistent buffers,
  applied by the engine as batched copies.
After the last prequant step the engine's bytes for a sample of tensors from every family
are compared (sha256) with ``mxfp8.quantize`` of the trainer's tensors.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from mxrefit.engines.layout import LayoutEngine
from mxrefit.engines.vllm_layout import vllm_destinations, vllm_params
from mxrefit.formats import mxfp8
from mxrefit.plan import SourceSpec
from mxrefit.shapes import BUILTIN, ModelShape, hf_tensor_specs

MODES = ("baseline", "prequant")


def _engine_main(conn, model: str, mode: str, device: str, timeout_s: float, experts: str) -> None:
    """Engine process: build the layout, serve refits until told to stop, report memory."""
    from mxrefit.bench.baseline import BaselineReceiver
    from mxrefit.receiver import Receiver

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shape = BUILTIN[model]
    engine = LayoutEngine(vllm_params(shape, mxfp8=True), vllm_destinations(shape, mxfp8=True, experts=experts), dev)
    base_mem = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    receiver = BaselineReceiver(engine, timeout_s=timeout_s) if mode == "baseline" else Receiver(engine, timeout_s=timeout_s)
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        peak = torch.cuda.max_memory_allocated(dev) - base_mem if dev.type == "cuda" else 0
        receiver.close()
        conn.send({"engine_peak_extra_bytes": peak})


def _family(name: str) -> str:
    for key in ("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                "input_layernorm", "post_attention_layernorm", "mlp.gate.weight", "gate_proj", "up_proj",
                "down_proj", "gate_up_proj", "model.norm"):
        if key in name:
            return key
    return "other"


def make_weights(specs: list[SourceSpec], device: torch.device, progress=None, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for s in specs:
        t = torch.randn(s.shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(s.dtype)
        if "norm" in s.name:
            t.add_(1.0)
        out[s.name] = t
        if progress is not None:
            progress()
    return out


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second of a plain copy on this device, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(7):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def _sample_check(sender, engine_dests, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Engine bytes of one tensor per family equal quantize() of the trainer's tensor."""
    picked: dict[str, str] = {}
    for name in weights:
        picked.setdefault(_family(name), name)
    ranges, want = [], []
    for name in picked.values():
        dest = engine_dests[name]
        src = weights[name]
        parts = mxfp8.quantize(src) if dest.format == "mxfp8" else (src.to(dest.targets[0].dtype),)
        for tgt, part in zip(dest.targets, parts):
            ranges.append([tgt.param, tgt.offset, tgt.nbytes])
            want.append(hashlib.sha256(part.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
    reply = sender.client.request({"op": "checksum", "ranges": ranges}, sender.timeout_s, step="checking engine bytes")
    got = reply["sha256"]
    bad = [r[0] for r, g, w in zip(ranges, got, want) if g != w]
    return {"families": sorted(picked), "tensors_checked": len(picked), "parts_checked": len(ranges), "mismatched": bad}


def run_mode(mode: str, shape: ModelShape, device: torch.device, weights: dict[str, torch.Tensor], *,
             steps: int, warmup: int, bucket_bytes: int, timeout_s: float, experts: str, on_step=None) -> dict[str, Any]:
    from mxrefit.bench.baseline import BaselineSender
    from mxrefit.sender import Sender

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_main, args=(child, shape.name, mode, str(device), timeout_s, experts), daemon=True)
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("the engine process did not start within 600 s")
        hello = parent.recv()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base_mem = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if mode == "baseline":
            sender = BaselineSender(hello["address"], hello["token"], device=device, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        else:
            sender = Sender(hello["address"], hello["token"], device=device, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
            sender.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()])
        reports = []
        tensors = list(weights.values())
        for step in range(warmup + steps):
            with torch.no_grad():
                torch._foreach_mul_(tensors, 1.0 + 2.0**-7 * (1 if step % 2 else -1))  # a new "optimizer step"
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            report = sender.refit(weights)
            if step >= warmup:
                reports.append(report)
            if on_step is not None:
                on_step()
        result: dict[str, Any] = {"mode": mode, "steps": [asdict(r) for r in reports]}
        if mode == "prequant":
            result["check"] = _sample_check(sender, vllm_destinations(shape, mxfp8=True, experts=experts), weights)
        result["trainer_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base_mem if device.type == "cuda" else 0
        sender.close(shutdown_engine=True)
        result.update(parent.recv() if parent.poll(60) else {})
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return result


def _median(reports: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in reports)


def summarize(result: dict[str, Any]) -> dict[str, float]:
    reps = result["steps"]
    total = _median(reps, "total_s")
    nbytes = reps[0]["bytes"]
    return {
        "pack_s": _median(reps, "pack_s"),
        "wait_s": _median(reps, "wait_s"),
        "engine_s": _median(reps, "engine_apply_s"),
        "check_s": _median(reps, "check_s"),
        "total_s": total,
        "bytes": nbytes,
        "GBps": nbytes / total / 1e9,
    }


def bench(model: str = "tiny-qwen3-moe", device: str = "auto", steps: int = 5, warmup: int = 1,
          modes: tuple[str, ...] = MODES, bucket_bytes: int = 512 << 20, timeout_s: float = 300.0,
          experts: str = "per_expert", progress: bool = True) -> dict[str, Any]:
    """Run the benchmark and return one JSON-able object with every figure."""
    from rich.progress import Progress

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    shape = BUILTIN[model]
    specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape, experts=experts)]
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"weights for {model}", total=len(specs))
        weights = make_weights(specs, dev, progress=lambda: bar.advance(task))
        trainer_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        engine_bytes = sum(p.nbytes for p in vllm_params(shape, mxfp8=True).values())
        bw = copy_bandwidth(dev, min(1 << 30, max(64 << 20, engine_bytes)) if dev.type == "cpu" else 4 << 30)
        results = {}
        for mode in modes:
            task = bar.add_task(f"{mode} refits", total=warmup + steps)
            results[mode] = run_mode(mode, shape, dev, weights, steps=steps, warmup=warmup, bucket_bytes=bucket_bytes,
                                     timeout_s=timeout_s, experts=experts, on_step=lambda t=task: bar.advance(t))
    out: dict[str, Any] = {
        "model": model, "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tensors": len(specs), "trainer_bf16_bytes": trainer_bytes, "engine_bytes": engine_bytes,
        "copy_GBps": bw / 1e9, "floor_s": (trainer_bytes + engine_bytes) / bw, "steps": steps, "warmup": warmup,
        "bucket_bytes": bucket_bytes, "modes": {},
    }
    for mode, res in results.items():
        out["modes"][mode] = {**summarize(res), **{k: v for k, v in res.items() if k != "steps"}, "per_step": res["steps"]}
    if "baseline" in out["modes"] and "prequant" in out["modes"]:
        out["speedup"] = out["modes"]["baseline"]["total_s"] / out["modes"]["prequant"]["total_s"]
    return out
