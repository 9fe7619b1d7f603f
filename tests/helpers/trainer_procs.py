"""Processes for the trainer-side tests: engines behind a real Receiver that hand back their bytes,
and FSDP2 trainer ranks on a gloo group."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import torch

CTX = mp.get_context("spawn")


def module_from_tensors(named: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A bare module tree whose parameters carry exactly these names (e.g. checkpoint names)."""
    root = torch.nn.Module()
    for name, tensor in named.items():
        owner = root
        *path, attr = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(attr, torch.nn.Parameter(tensor.detach().clone(), requires_grad=False))
    return root


def make_model(name: str, seed: int, layers: int | None = None):
    from tests.helpers import models

    if name == "moe":
        return models.tiny_qwen3_moe(seed) if layers is None else models.tiny_qwen3_moe(seed, layers=layers)
    if name == "llama":
        return models.tiny_llama(seed)
    if name == "llama_tied":
        return models.tiny_llama(seed, tied=True)
    raise ValueError(name)


def build_engine(spec: dict):
    """``spec``: kind torch|vllm_layout, model, mxfp8, experts (grouped|per_expert), rules (kwargs), layers."""
    from mxrefit.engine.layout import LayoutEngine
    from mxrefit.engine.torch import TorchEngine
    from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
    from mxrefit.plan.eligibility import DEFAULT_RULES, QuantRules
    from mxrefit.plan.shapes import ModelShape
    from mxrefit.source.hf import HFSource

    rules = QuantRules(**spec["rules"]) if "rules" in spec else DEFAULT_RULES
    model = make_model(spec["model"], spec.get("seed", 1), spec.get("layers"))
    experts = spec.get("experts", "grouped")
    if spec["kind"] == "torch":
        if experts == "per_expert":
            model = module_from_tensors(dict(HFSource(model, experts="per_expert")))
        return TorchEngine(model, mxfp8=spec["mxfp8"], rules=rules)
    shape = ModelShape.from_hf_config(model.config)
    return LayoutEngine(
        vllm_params(shape, mxfp8=spec["mxfp8"], rules=rules),
        vllm_destinations(shape, mxfp8=spec["mxfp8"], experts=experts, rules=rules),
    )


def _engine_bytes(engine) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor the engine holds, by every name it is reachable under, as raw bytes."""
    from mxrefit.engine.torch import TorchEngine

    if isinstance(engine, TorchEngine):
        tensors = dict(engine.module.named_parameters(remove_duplicate=False)) | {n: engine.tensor(n) for n in engine.params()}
    else:
        tensors = engine.tensors
    return {
        n: (
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
        )
        for n, t in tensors.items()
    }


def serve_engine(conn, spec: dict, timeout_s: float) -> None:
    from mxrefit.engine.receiver import Receiver

    logging.basicConfig(level=logging.WARNING)
    engine = build_engine(spec)
    receiver = Receiver(engine, timeout_s=timeout_s)
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        receiver.close()
        conn.send({"status": receiver.status(), "bytes": _engine_bytes(engine)})


class EngineProcess:
    """An engine in its own process; ``stop`` shuts it down and returns {name: uint8 tensor} it held."""

    def __init__(self, spec: dict, timeout_s: float = 60.0):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=serve_engine, args=(child, spec, timeout_s), daemon=True)
        self.proc.start()
        assert self.conn.poll(180), "engine did not start"
        hello = self.conn.recv()
        self.address, self.token = hello["address"], hello["token"]

    def stop(self, sender=None) -> dict[str, torch.Tensor]:
        if sender is not None:
            sender.close(shutdown_engine=True)
        try:
            if not self.conn.poll(60):
                return {}
            final = self.conn.recv()
            return {n: torch.frombuffer(bytearray(raw), dtype=torch.uint8) for n, (_, _, raw) in final["bytes"].items()}
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def expected_mismatches(destinations: dict, weights: dict[str, torch.Tensor], engine_bytes: dict[str, torch.Tensor]) -> list[str]:
    """Trainer names whose bytes in the engine are not their encoding (MXFP8 where the engine is)."""
    from mxrefit.formats import mxfp8

    bad = []
    for name, dest in destinations.items():
        src = weights[name].detach()
        parts = mxfp8.quantize(src, backend="torch") if dest.format == "mxfp8" else (src.to(dest.targets[0].dtype),)
        for tgt, part in zip(dest.targets, parts):
            want = part.contiguous().view(-1).view(torch.uint8)
            got = engine_bytes[tgt.param][tgt.offset : tgt.offset + tgt.nbytes]
            if not torch.equal(got, want):
                bad.append(name)
                break
    return bad


# ---- FSDP2 trainer ranks ------------------------------------------------------------------------


def _fsdp2_model(seed: int, layers: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import models

    model = models.tiny_qwen3_moe(seed, layers=layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_refit_rank(rank: int, world: int, rdzv: str, seed: int, engine: dict, out_dir: str) -> None:
    """Rank 0 refits the engine from the FSDP2 model's stream; the other ranks join the gathers."""
    import json

    import torch.distributed as dist

    from mxrefit.source.hf import HFSource
    from mxrefit.source.sender import Sender

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        model = _fsdp2_model(seed, layers=2, world=world)
        source = HFSource(model, experts=engine.get("experts", "as_is"))
        sharded = [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"]
        if rank == 0:
            sender = Sender(engine["address"], engine["token"], bucket_bytes=64 << 10)
            sender.plan(source.specs())
            report = sender.refit(source)  # streamed: one gathered parameter at a time
            sender.close(shutdown_engine=True)
            with open(os.path.join(out_dir, "rank0.json"), "w") as f:
                json.dump(
                    {
                        "version": report.version,
                        "buckets": report.buckets,
                        "sharded": sharded,
                        "params": len(list(model.parameters())),
                    },
                    f,
                )
        else:
            for _ in source:
                pass
    finally:
        dist.destroy_process_group()


def allocation_peaks(fn) -> dict[str, int]:
    """Bytes torch allocates on the CPU while ``fn()`` runs, above the start, from the profiler's
    allocation events (every allocation and free, with its size and thread).

    ``peak``/``final`` count the thread that runs ``fn`` (the stream and its consumer);
    ``peak_all`` adds every other thread, e.g. gloo's work thread, whose CPU all_gather stages
    through a scratch tensor that it frees asynchronously, whenever that thread gets to it.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("measured"):
            fn()
    events, tid = [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == "measured":
            tid = node.start_tid
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.start_tid))
        stack.extend(node.children)
    out = {"peak": 0, "final": 0, "peak_all": 0}
    current = current_all = 0
    for _, size, thread in sorted(events):
        current_all += size
        out["peak_all"] = max(out["peak_all"], current_all)
        if thread == tid:
            current += size
            out["peak"] = max(out["peak"], current)
    out["final"] = current
    return out


def fsdp2_memory_rank(rank: int, world: int, rdzv: str, layers: int, out_dir: str, engine: dict | None = None) -> None:
    """Every rank streams the FSDP2 model and records: how many earlier streamed tensors were alive
    whenever a new one arrived, which are alive after the stream, the allocation peaks of the
    stream, and of materializing it whole (``dict(source)``, the control that the measure sees a model).
    With ``engine`` (address, token, bucket), rank 0 then refits it from the stream (planned first,
    so the transfer buffers exist before the measure) and records that refit's allocation peaks."""
    import gc
    import json
    import weakref

    import torch.distributed as dist

    from mxrefit.source.hf import HFSource

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        model = _fsdp2_model(seed=3, layers=layers, world=world)
        source = HFSource(model)
        sizes = [s.shape for s in source.specs()]
        itemsize = next(model.parameters()).dtype.itemsize
        nbytes = [itemsize * torch.Size(s).numel() for s in sizes]
        seen, refs, held = [], [], []

        def stream():
            for name, t in source:
                held.append(sum(1 for ref in refs if ref() is not None))  # earlier tensors still alive
                seen.append((name, tuple(t.shape), t.is_contiguous(), type(t).__name__))
                refs.append(weakref.ref(t))
                # a consumer that packs and releases holds nothing across steps; a bare for loop
                # would keep the previous tensor in ``t`` while the next one is gathered
                del t

        streamed = allocation_peaks(stream)
        gc.collect()
        alive = [name for (name, *_), ref in zip(seen, refs) if ref() is not None]
        whole = allocation_peaks(lambda: dict(source))
        refit = None
        if engine is not None:
            if rank == 0:
                from mxrefit.source.sender import Sender

                sender = Sender(engine["address"], engine["token"], bucket_bytes=engine["bucket"])
                sender.plan(source.specs())
                refit = allocation_peaks(lambda: sender.refit(source))
                refit["bucket_bytes"] = sender.plan_.bucket_bytes
                sender.close(shutdown_engine=True)
            else:
                for _ in source:  # join rank 0's gathers
                    pass
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "stream": streamed,
                    "whole": whole,
                    "refit": refit,
                    "alive": alive,
                    "held": max(held),
                    "largest": max(nbytes),
                    "total": sum(nbytes),
                    "seen": seen,
                    "specs": [[s.name, list(s.shape)] for s in source.specs()],
                },
                f,
            )
    finally:
        dist.destroy_process_group()
