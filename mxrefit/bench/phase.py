"""Phase bench: ``prepare_for_generation`` / ``prepare_for_training`` around real refits of a built-in model.

Trainer (this process): the model's HF-named BF16 weights (the refit's source), and a real AdamW
over the first tensors, in trainer order, whose gradients and state (BF16 like the parameters:
grad + exp_avg + exp_avg_sq, 6 bytes per parameter) come to ``state_bytes``: the slim part the
trainer offloads to make room. Each step is one optimizer step, then the generation phase, then
the training phase.

Engine (another process): vLLM's MXFP8 layout behind a real ``Receiver``, as ``mxrefit bench``'s
prequant mode builds it (direct transport; with ``post="trtllm"`` in FlashInfer's TRT-LLM layout,
written in place by the trainer where it can and brought there after every refit elsewhere;
``"trtllm-staged"``: all of it after every refit), and a KV-cache stand-in
of ``kv_bytes`` that ``sleep`` frees and ``wake_up(["kv_cache"])`` allocates, so the engine really
takes the memory the offload gave back. Its weights stay resident: vLLM's cumem unmap/remap of
weights (and a level-1 sleep's weight backup) is not modeled, so ``wake_weights_s`` here is only
the call's round trip. vLLM is not on the GPU machine; a real vLLM engine's sleep/wake order is
tested on CPU (tests/integration/test_lifecycle_vllm.py).

Both phase modes run in one process: ``overlap`` (offload copies run during the weights wake and
the refit) and ``serial`` (offload finished first).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
from dataclasses import asdict
from typing import Any

import torch

from mxrefit.bench.run import POST, _sample_check, make_weights
from mxrefit.devices import bind, resolve
from mxrefit.engine.layout import LayoutEngine
from mxrefit.engine.receiver import Receiver
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import vllm_mxfp8_kernel_tables
from mxrefit.lifecycle import OptimizerOffloader, prepare_for_generation, prepare_for_training
from mxrefit.plan.build import SourceSpec
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs
from mxrefit.source.sender import Sender


def _free_bytes(dev: torch.device) -> int:
    return torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0


def _engine_main(conn, model: str, device: str, timeout_s: float, experts: str, post: str, kv_bytes: int) -> None:
    """Engine process: refits are served on a thread; sleep/wake_up arrive on the pipe."""
    dev = bind(device)
    shape = BUILTIN[model]
    params = vllm_params(shape, mxfp8=True)
    dests = vllm_destinations(shape, mxfp8=True, experts=experts)
    if post == "none":
        engine = LayoutEngine(params, dests, dev)
    else:
        k = vllm_mxfp8_kernel_tables(shape, params, dests, dev, direct=post == "trtllm")
        engine = LayoutEngine(k.params, k.destinations, dev, units=k.units, kernel=k.kernel)
    receiver = Receiver(engine, timeout_s=timeout_s)

    def serve() -> None:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # the current device is per thread
        receiver.serve()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    conn.send({"address": receiver.address, "token": receiver.token})
    kv = None
    while True:
        msg = conn.recv()
        if msg["op"] == "stop":
            break
        if msg["op"] == "sleep":
            kv = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        elif msg["op"] == "wake_up" and (msg["tags"] is None or "kv_cache" in msg["tags"]) and kv is None:
            kv = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        conn.send({"free_bytes": _free_bytes(dev)})
    server.join(60)
    receiver.close()


class EngineProcess:
    """Trainer-side handle with vLLM's ``sleep(level)`` / ``wake_up(tags) -> fully awake`` signatures."""

    def __init__(self, model: str, device: torch.device, timeout_s: float, experts: str, post: str, kv_bytes: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_engine_main, args=(child, model, str(device), timeout_s, experts, post, kv_bytes), daemon=True
        )
        self.proc.start()
        if not self.conn.poll(600):
            raise RuntimeError("the engine process did not start within 600 s")
        hello = self.conn.recv()
        self.address, self.token = hello["address"], hello["token"]
        self.asleep: set[str] = set()
        self.free_bytes = 0

    def _call(self, msg: dict) -> None:
        self.conn.send(msg)
        if not self.conn.poll(600):
            raise RuntimeError(f"the engine process did not answer {msg}")
        self.free_bytes = self.conn.recv()["free_bytes"]

    def sleep(self, level: int = 1) -> None:
        self._call({"op": "sleep", "level": level})
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._call({"op": "wake_up", "tags": tags})
        self.asleep -= set(tags or ("weights", "kv_cache"))
        return not self.asleep

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send({"op": "stop"})
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def _slim_optimizer(
    weights: dict[str, torch.Tensor], state_bytes: int, seed: int
) -> tuple[torch.optim.Optimizer, list[tuple[str, torch.nn.Parameter]]]:
    params, names, total = [], [], 0
    g = torch.Generator(device=next(iter(weights.values())).device).manual_seed(seed)
    for name, t in weights.items():
        if total >= state_bytes:
            break
        p = torch.nn.Parameter(t)  # shares storage with weights[name]: the optimizer updates the refit's source
        p.grad = torch.empty_like(t).normal_(0, 1e-3, generator=g)
        params.append(p)
        names.append(name)
        total += 3 * t.numel() * t.element_size()
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=False)  # per tensor: no model-sized temporaries
    opt.step()
    return opt, list(zip(names, params))


def _state_sample(opt: torch.optim.Optimizer, limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, total = [], 0
    for p in (p for group in opt.param_groups for p in group["params"]):
        for t in [p.grad, *opt.state[p].values()]:
            if isinstance(t, torch.Tensor) and t.device == p.device and total < limit:
                out.append((t, t.clone()))
                total += t.numel() * t.element_size()
    return out


def _medians(reports: list[dict]) -> dict[str, float]:
    keys = [k for k, v in reports[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: statistics.median(r[k] for r in reports) for k in keys}


def phase_bench(
    model: str = "tiny-qwen3-moe",
    device: str = "auto",
    *,
    steps: int = 3,
    warmup: int = 1,
    state_bytes: int | None = None,
    kv_bytes: int | None = None,
    bucket_bytes: int = 512 << 20,
    experts: str = "per_expert",
    post: str = "trtllm",
    timeout_s: float = 300.0,
    modes: tuple[str, ...] = ("overlap", "serial"),
    seed: int = 0,
) -> dict[str, Any]:
    """Run both phase modes on one engine process; one JSON-able object with every figure."""
    if post not in POST:
        raise ValueError(f"post must be one of {POST}, got {post!r}")

    dev = resolve(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    shape = BUILTIN[model]
    specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape, experts=experts)]
    weights = make_weights(specs, dev, seed=seed)
    trainer_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    state_bytes = trainer_bytes // 8 if state_bytes is None else state_bytes
    opt, named = _slim_optimizer(weights, state_bytes, seed)
    offloader = OptimizerOffloader(opt, named_parameters=named)
    engine = EngineProcess(model, dev, timeout_s, experts, post, kv_bytes if kv_bytes is not None else state_bytes)
    out: dict[str, Any] = {
        "model": model,
        "device": str(dev),
        "post": post,
        "tensors": len(specs),
        "trainer_bf16_bytes": trainer_bytes,
        "optimizer_tensors": len(named),
        "kv_bytes": kv_bytes if kv_bytes is not None else state_bytes,
        "steps": steps,
        "warmup": warmup,
        "modes": {},
    }
    try:
        engine.sleep(level=1)  # starts asleep: the trainer holds its state, the engine has no KV cache
        sender = Sender(engine.address, engine.token, device=dev, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        sender.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()])
        first = True
        for mode in modes:
            gens, trains, free = [], [], []
            for step in range(warmup + steps):
                opt.step()
                if first:
                    sample = _state_sample(opt, 64 << 20)
                gen = prepare_for_generation(
                    lambda: sender.refit(weights), trainer=offloader, engine=engine, overlap=mode == "overlap", device=dev
                )
                free_awake = engine.free_bytes
                train = prepare_for_training(trainer=offloader, engine=engine, sleep_level=1, device=dev)
                if first:  # the offload round trip of a sample of the state, byte for byte
                    out["state_sample_mismatched"] = sum(not torch.equal(t, want) for t, want in sample)
                    out["state_sample_tensors"] = len(sample)
                    first = False
                if step >= warmup:
                    gens.append(gen.as_dict())
                    trains.append(asdict(train))
                    free.append(free_awake)
            out["modes"][mode] = {
                "generation": _medians([{k: v for k, v in g.items() if k != "refit"} for g in gens]),
                "refit": _medians([g["refit"] for g in gens]),
                "training": _medians(trains),
                "free_bytes_when_awake": min(free),
                "per_step": {"generation": gens, "training": trains},
            }
        out["offload_bytes"] = offloader.nbytes
        out["arena_allocations"] = offloader.arena_allocations
        out["transport"] = sender.transport
        out["check"] = _sample_check(sender, shape, vllm_destinations(shape, mxfp8=True, experts=experts), weights, post)
        sender.close(shutdown_engine=True)
    finally:
        engine.stop()
        offloader.close()
    return out
