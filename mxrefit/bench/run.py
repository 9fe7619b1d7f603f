"""`mxrefit bench`: trainer and engine in two processes, modes A/B against the copy floor, one run.

The trainer process (this one) makes random BF16 weights with the model's HF names and
shapes; the engine process holds vLLM's quantized checkpoint layout in format ``fmt`` (fused
qkv / w13 / w2; embeddings, router, norms, lm_head BF16):
- ``mxfp8`` (default): E4M3 values + uint8 scales per 32 (ModelOpt MXFP8). With
  ``post="trtllm"`` (its default) the engine holds FlashInfer's TRT-LLM kernel layout (MoE
  values/scales shuffled and interleaved, linear scales swizzled) and advertises it in its
  tables, so the trainer's quantize kernel writes it in place (per-expert gate/up into their
  expert's shared w13 region); only the params it cannot (linear partitions off the 128-row
  tiles) are staged and moved after every refit, timed as its own phase.
  ``post="trtllm-staged"`` stages every one of them (the two-pass path, for comparison).
- ``fp8-block`` / ``fp8-block-ue8m0``: E4M3 values + float32 ``scale_inv`` per 128x128 tile
  (``Fp8Config``; float32 ``amax / 448`` or power-of-two scales). No post-process
  (``post="none"``, required): Hopper's generic block kernel (CUTLASS/Triton) reads the
  checkpoint layout as loaded; DeepGEMM's UE8M0 re-quantization and scale re-layout is not
  modelled.
- ``bf16``: every weight in BF16, as most RL stacks serve today (fused qkv / w13 / w2 still);
  the refit is a copy into the fused layout. No post-process.
Modes:
- ``baseline``: BF16 over the wire, buffers and handles new each step, the engine quantizes
  tensor by tensor (``baseline.quantize_as``), then post-processes expert by expert
  (``mxrefit.bench.baseline``);
- ``prequant``: mxrefit — quantized on the trainer straight into the engine's memory
  (direct transport), post-processed layer by layer as buckets land, in one gather each;
- ``prequant-buffers``: mxrefit through two persistent transfer buffers instead.
After the last step of an mxrefit mode the engine's bytes for one tensor of every family
are compared (sha256) with the format's quantizer applied to the trainer's tensors, brought
into the kernel layout by plain indexing (``trtllm.reference_kernel_bytes``) where the
engine post-processes.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mxrefit.bench.baseline import BaselineReceiver, BaselineSender, quantize_as
from mxrefit.bench.peer import run_checkpoint_engine, unavailable
from mxrefit.bench.peer_vllm import PEER as VLLM_PEER
from mxrefit.bench.peer_vllm import run_vllm
from mxrefit.bench.trace import traced_refit
from mxrefit.devices import bind, resolve
from mxrefit.engine.layout import LayoutEngine
from mxrefit.engine.receiver import Receiver
from mxrefit.integrations.vllm.layout import quantized_param_names, scale_param, vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import reference_kernel_bytes, vllm_mxfp8_kernel_tables
from mxrefit.plan.build import SourceSpec
from mxrefit.plan.shapes import BUILTIN, ModelShape, hf_tensor_specs
from mxrefit.source.sender import Sender
from mxrefit.transport.bytesum import tensor_sha256
from mxrefit.transport.factory import default_kind

if TYPE_CHECKING:
    from rich.progress import Progress, Task, TaskID

MODES = ("baseline", "prequant")
ALL_MODES = ("baseline", "prequant", "prequant-buffers")
# what the options cost: ready messages sent in step (one_behind=False), per-bucket integrity sums,
# receiving into a shadow committed whole, and the non-finite screen fused into encoding
# (check_finite=False: one read of the sources, not two)
CHECK_MODES = ("prequant", "prequant-in-step", "prequant-fused", "prequant-verify", "prequant-transactional")
POST = ("trtllm", "trtllm-staged", "none")
FORMATS = ("mxfp8", "fp8-block", "fp8-block-ue8m0", "bf16")


def resolve_post(fmt: str, post: str | None) -> str:
    """The engine's post-load layout for ``fmt``: by default TRT-LLM's for MXFP8, none otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if post is None:
        return "trtllm" if fmt == "mxfp8" else "none"
    if post not in POST:
        raise ValueError(f"post must be one of {POST}, got {post!r}")
    if post != "none" and fmt != "mxfp8":
        why = (
            "a BF16 engine's kernels read its weights as loaded"
            if fmt == "bf16"
            else "Hopper's generic block kernel reads the checkpoint layout as loaded; DeepGEMM's UE8M0 re-layout is not modelled"
        )
        raise ValueError(
            f"post {post!r} is FlashInfer's TRT-LLM MXFP8 layout; {fmt} has no post-process here ({why}): use post 'none'"
        )
    return post


def resolve_shape(model: str, layers: int | None = None) -> ModelShape:
    """A built-in shape, optionally with fewer or more layers (for size sweeps)."""
    shape = BUILTIN[model]
    if layers is not None and layers != shape.layers:
        shape = replace(shape, name=f"{shape.name}@{layers}l", layers=layers)
    return shape


def _post_params(shape: ModelShape, post: str) -> set[str]:
    """Engine params whose served bytes are in a kernel layout after post-processing."""
    if post == "none":
        return set()
    names = quantized_param_names(shape)
    return {scale_param(n) for n in names} | {n for n in names if ".experts." in n}


def _engine_main(conn, shape: ModelShape, mode: str, device: str, timeout_s: float, experts: str, post: str, fmt: str) -> None:
    """Engine process: build the layout, serve refits until told to stop, report memory."""
    dev = bind(device)
    params = vllm_params(shape, fmt=fmt)
    dests = vllm_destinations(shape, fmt=fmt, experts=experts)
    if mode == "baseline" or post == "none":
        engine = LayoutEngine(params, dests, dev)
    else:
        k = vllm_mxfp8_kernel_tables(shape, params, dests, dev, direct=post == "trtllm")
        engine = LayoutEngine(k.params, k.destinations, dev, units=k.units, kernel=k.kernel)
    base_mem = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    if mode == "baseline":
        post_names = quantized_param_names(shape) if post != "none" else []
        receiver: BaselineReceiver | Receiver = BaselineReceiver(engine, timeout_s=timeout_s, post=post_names)
    else:
        receiver = Receiver(engine, timeout_s=timeout_s, transactional=mode == "prequant-transactional")
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        peak = torch.cuda.max_memory_allocated(dev) - base_mem if dev.type == "cuda" else 0
        staging = getattr(engine, "staging", None)
        pool = staging.pool_bytes if staging is not None else 0
        receiver.close()
        conn.send(
            {
                "engine_peak_extra_bytes": peak,
                "engine_staging_bytes": pool,
                "engine_transactional": getattr(receiver, "transactional", False),
            }
        )


def _family(name: str) -> str:
    for key in (
        "embed_tokens",
        "lm_head",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_norm",
        "k_norm",
        "input_layernorm",
        "post_attention_layernorm",
        "mlp.gate.weight",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "model.norm",
    ):
        if key in name:
            return key
    return "other"


def advance_open_ended(bar: Progress, task: TaskID) -> None:
    """One step of a count not known ahead (the learned layout's settling refits): the total stays
    above what is done, so the bar never reads full before its run returns."""
    bar.advance(task)
    t = task_of(bar, task)
    if t.total is not None and t.completed >= t.total:
        bar.update(task, total=t.completed + 1)


def task_of(bar: Progress, task: TaskID) -> Task:
    """rich's task record by its id (``Progress.tasks`` is a list, not keyed by id)."""
    return next(t for t in bar.tasks if t.id == task)


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


def _checkpoint_param(param: str, nbytes: int, engine_dests, weights: dict[str, torch.Tensor], device) -> torch.Tensor:
    """The checkpoint-format bytes of one engine param, assembled from every trainer tensor landing in it."""
    out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    for name, dest in engine_dests.items():
        if not any(t.param == param for t in dest.targets):
            continue
        for tgt, part in zip(dest.targets, quantize_as(dest.format, weights[name], backend="auto")):
            if tgt.param == param:
                out[tgt.offset : tgt.offset + tgt.nbytes] = part.contiguous().view(-1).view(torch.uint8)
    return out


def _sample_check(
    sender, shape: ModelShape, engine_dests, weights: dict[str, torch.Tensor], post: str, fmt: str = "mxfp8"
) -> dict[str, Any]:
    """Engine bytes of one tensor per family equal the format's quantizer on the trainer's tensor;
    where the engine serves a kernel layout, the whole param is compared with the reference layout."""
    picked: dict[str, str] = {}
    for name in weights:
        picked.setdefault(_family(name), name)
    kernel_params = _post_params(shape, post)
    params = vllm_params(shape, fmt=fmt)
    ranges, want, staged = [], [], set()
    for name in picked.values():
        dest = engine_dests[name]
        src = weights[name]
        parts: tuple[torch.Tensor, ...]
        if dest.format == "bf16":
            parts = (src.to(dest.targets[0].dtype),)
        else:
            parts = quantize_as(dest.format, src, backend="auto", name=name)
        for tgt, part in zip(dest.targets, parts):
            if tgt.param in kernel_params:
                staged.add(tgt.param)
                continue
            ranges.append([tgt.param, tgt.offset, tgt.nbytes])
            want.append(tensor_sha256(part))
    for param in sorted(staged):
        ckpt = _checkpoint_param(param, params[param].nbytes, engine_dests, weights, next(iter(weights.values())).device)
        expected = reference_kernel_bytes(param, ckpt.view(params[param].dtype).view(params[param].shape))
        ranges.append([param, 0, expected.numel()])
        want.append(tensor_sha256(expected))
    reply = sender.client.request({"op": "checksum", "ranges": ranges}, sender.timeout_s, step="checking engine bytes")
    got = reply["sha256"]
    bad = [r[0] for r, g, w in zip(ranges, got, want) if g != w]
    return {
        "families": sorted(picked),
        "tensors_checked": len(picked),
        "parts_checked": len(ranges),
        "kernel_layout_params_checked": len(staged),
        "mismatched": bad,
    }


def perturb(weights: dict[str, torch.Tensor], step: int) -> None:
    """A new "optimizer step" before refit ``step``: every weight scaled up or down by 2^-7."""
    with torch.no_grad():
        torch._foreach_mul_(list(weights.values()), 1.0 + 2.0**-7 * (1 if step % 2 else -1))


def pick_device(device: str) -> torch.device:
    """``"auto"``: CUDA where torch sees it, else the CPU; otherwise the device named."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)


def run_mode(
    mode: str,
    shape: ModelShape,
    device: torch.device,
    weights: dict[str, torch.Tensor],
    *,
    steps: int,
    warmup: int,
    bucket_bytes: int,
    timeout_s: float,
    experts: str,
    post: str,
    fmt: str = "mxfp8",
    on_step=None,
    trace: Path | None = None,
) -> dict[str, Any]:
    """One mode's refits against its own engine process; ``trace``: a file for one more refit under
    the profiler (``bench.trace``), after the timed ones."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_main, args=(child, shape, mode, str(device), timeout_s, experts, post, fmt), daemon=True)
    proc.start()
    child.close()  # the engine holds the only other end: if it dies, the wait below sees it at once
    try:
        if not parent.poll(600):
            raise RuntimeError("the engine process did not start within 600 s")
        try:
            hello = parent.recv()
        except EOFError:
            proc.join(10)
            raise RuntimeError(
                f"the {mode} engine process exited (code {proc.exitcode}) before it served; its error is printed above"
            ) from None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base_mem = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        sender: BaselineSender | Sender
        prequant: Sender | None = None
        if mode == "baseline":
            sender = BaselineSender(
                hello["address"], hello["token"], device=device, bucket_bytes=bucket_bytes, timeout_s=timeout_s
            )
        else:
            transport = default_kind(device) if mode == "prequant-buffers" else None
            sender = prequant = Sender(
                hello["address"],
                hello["token"],
                device=device,
                bucket_bytes=bucket_bytes,
                timeout_s=timeout_s,
                transport=transport,
                verify=mode == "prequant-verify",
                check_finite=mode != "prequant-fused",
                one_behind=mode != "prequant-in-step",
            )
            sender.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()])
        reports = []
        for step in range(warmup + steps):
            perturb(weights, step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            report = sender.refit(weights)
            if step >= warmup:
                reports.append(report)
            if on_step is not None:
                on_step()
        result: dict[str, Any] = {"mode": mode, "steps": [asdict(r) for r in reports]}
        if trace is not None:
            perturb(weights, warmup + steps)
            result["trace"] = traced_refit(lambda: sender.refit(weights), trace, device)
        if prequant is not None:
            result["transport"] = prequant.transport
            result["verify"] = prequant.verify
            result["check_finite"] = prequant.check_finite
            result["one_behind"] = prequant.one_behind
            result["check"] = _sample_check(
                prequant, shape, vllm_destinations(shape, fmt=fmt, experts=experts), weights, post, fmt
            )
        result["trainer_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base_mem if device.type == "cuda" else 0
        sender.close(shutdown_engine=True)
        try:
            result.update(parent.recv() if parent.poll(60) else {})
        except EOFError:  # the engine exited without its memory report
            pass
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return result


def _median(reports: list[dict], key) -> float:
    return statistics.median(key(r) if callable(key) else r[key] for r in reports)


def summarize(result: dict[str, Any]) -> dict[str, float]:
    reps = result["steps"]
    total = _median(reps, "total_s")
    nbytes = reps[0]["bytes"]
    return {
        "pack_s": _median(reps, "pack_s"),
        "wait_s": _median(reps, "wait_s"),
        "engine_s": _median(reps, "engine_apply_s"),
        "post_s": _median(reps, lambda r: r["engine_process_s"] + r["engine_after_refit_s"]),
        "check_s": _median(reps, "check_s"),
        "total_s": total,
        "bytes": nbytes,
        "GBps": nbytes / total / 1e9,
    }


def bench(
    model: str = "tiny-qwen3-moe",
    device: str = "auto",
    steps: int = 5,
    warmup: int = 1,
    modes: tuple[str, ...] = MODES,
    bucket_bytes: int = 512 << 20,
    timeout_s: float = 300.0,
    experts: str = "per_expert",
    post: str | None = None,
    layers: int | None = None,
    progress: bool = True,
    fmt: str = "mxfp8",
    peers: tuple[str, ...] = (),
    trace: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return one JSON-able object with every figure. ``fmt``: the engine's
    quantized format (``FORMATS``); ``post`` None picks its default (``resolve_post``); ``peers``:
    other projects' refit paths run on the same tensors after mxrefit's modes (``peer.PEERS``);
    ``trace``: a folder for one profiled refit per mode (``trace_<model>_<mode>.json``, the model's
    ``@`` written ``_``: file names stay letters, digits, ``.``, ``_`` and ``-``, which every tool copies)."""
    from rich.progress import Progress

    post = resolve_post(fmt, post)
    dev = pick_device(device)
    shape = resolve_shape(model, layers)
    for peer in peers:
        why = unavailable(peer, dev, shape, fmt)
        if why:
            raise RuntimeError(why)
    dev = resolve(dev)
    specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape, experts=experts)]
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"weights for {shape.name}", total=len(specs))
        weights = make_weights(specs, dev, progress=lambda: bar.advance(task))
        trainer_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        engine_bytes = sum(p.nbytes for p in vllm_params(shape, fmt=fmt).values())
        bw = copy_bandwidth(dev, min(1 << 30, max(64 << 20, engine_bytes)) if dev.type == "cpu" else 4 << 30)
        results = {}
        for mode in modes:
            task = bar.add_task(f"{mode} refits", total=warmup + steps)
            results[mode] = run_mode(
                mode,
                shape,
                dev,
                weights,
                steps=steps,
                warmup=warmup,
                bucket_bytes=bucket_bytes,
                timeout_s=timeout_s,
                experts=experts,
                post=post,
                fmt=fmt,
                on_step=functools.partial(bar.advance, task),
                trace=Path(trace) / f"trace_{shape.name.replace('@', '_')}_{mode}.json" if trace else None,
            )
        peer_results = {}
        for peer in peers:
            if peer == VLLM_PEER:  # mxrefit's and vLLM's own refits into one real vLLM, `steps` each
                task = bar.add_task(f"{peer} refits (mxrefit, then its own)", total=2 * steps)
                peer_results[peer] = run_vllm(
                    weights,
                    shape,
                    dev,
                    fmt=fmt,
                    experts=experts,
                    steps=steps,
                    bucket_bytes=bucket_bytes,
                    timeout_s=timeout_s,
                    step=lambda i: perturb(weights, i),
                    on_step=functools.partial(advance_open_ended, bar, task),
                )
                bar.update(task, total=task_of(bar, task).completed)
                continue
            task = bar.add_task(f"{peer} refits", total=warmup + steps)
            peer_results[peer] = run_checkpoint_engine(
                weights,
                dev,
                steps=steps,
                warmup=warmup,
                timeout_s=timeout_s,
                step=lambda i: perturb(weights, i),
                on_step=functools.partial(bar.advance, task),
            )
            # it moves the BF16 tensors into a BF16 engine whatever the format: its own floor
            peer_results[peer]["floor_s"] = 2 * trainer_bytes / bw
    out: dict[str, Any] = {
        "model": shape.name,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tensors": len(specs),
        "trainer_bf16_bytes": trainer_bytes,
        "engine_bytes": engine_bytes,
        "copy_GBps": bw / 1e9,
        "floor_s": (trainer_bytes + engine_bytes) / bw,
        "steps": steps,
        "warmup": warmup,
        "bucket_bytes": bucket_bytes,
        "format": fmt,
        "post": post,
        "experts": experts,
        "modes": {},
    }
    for mode, res in results.items():
        out["modes"][mode] = {**summarize(res), **{k: v for k, v in res.items() if k != "steps"}, "per_step": res["steps"]}
    if peer_results:
        out["peers"] = peer_results
    if "baseline" in out["modes"] and "prequant" in out["modes"]:
        out["speedup"] = out["modes"]["baseline"]["total_s"] / out["modes"]["prequant"]["total_s"]
    return out
