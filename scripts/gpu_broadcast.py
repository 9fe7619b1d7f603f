"""Multi-GPU run for the broadcast transport: trainer on GPU 0, engine ranks on GPUs 1..N, NCCL.

    python scripts/gpu_broadcast.py --json $OUT/broadcast.json                 # every GPU of the host
    python scripts/gpu_broadcast.py --smoke --json /tmp/broadcast_smoke.json   # CPU, gloo, tiny model

For each wire format (MXFP8 prequantized, BF16) and tensor parallelism (TP=1: every engine GPU
holds the whole model, a replica; TP=2: pairs of engine GPUs each hold vLLM's TP slices) the
engine ranks hold vLLM 0.32's layout of the model (``LayoutEngine`` + ``integrations.vllm.layout``), a
``BroadcastSender`` refits them ``--steps`` times after one warm-up refit, and the same
processes then time a plain broadcast of the same bucket sizes over a fresh group of the same
backend: the wire floor measured in the same run. After the timed refits each rank's bytes are
compared (sha256) with ``mxfp8.quantize`` of the trainer's tensors, sliced like vLLM's loader
(``torch.narrow`` of the whole parameter): a sample of parameters on GPUs, all in ``--smoke``.
Figures: median refit seconds and phases, wire bytes per refit, GB/s = wire bytes / seconds,
and the ratio refit / plain broadcast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch

from mxrefit.bench.run import _checkpoint_param, make_weights
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params, vllm_shards
from mxrefit.plan.build import SourceSpec
from mxrefit.plan.shapes import BUILTIN, ModelShape, hf_tensor_specs
from mxrefit.source.broadcast_sender import BroadcastSender
from mxrefit.transport.broadcast import BroadcastBuffers, RendezvousStore

CTX = mp.get_context("spawn")


def _engine_main(conn, shape: ModelShape, mxfp8: bool, device: str, tp: tuple[int, int], experts: str, timeout_s: float) -> None:
    """One engine rank: serve refits until shutdown, then join the plain-broadcast group and time it."""
    from mxrefit.devices import bind
    from mxrefit.engine.layout import LayoutEngine
    from mxrefit.engine.receiver import Receiver
    from mxrefit.transport.broadcast import open_broadcast

    bind(device)
    shards = vllm_shards(shape, mxfp8=mxfp8, tp_rank=tp[0], tp_size=tp[1])
    engine = LayoutEngine(
        vllm_params(shape, mxfp8=mxfp8), vllm_destinations(shape, mxfp8=mxfp8, experts=experts), device, shards=shards
    )
    receiver = Receiver(engine, timeout_s=timeout_s)
    conn.send({"address": receiver.address, "token": receiver.token, "engine_bytes": engine.arena.numel()})
    try:
        receiver.serve()
    finally:
        receiver.close()
    desc, sizes, steps = conn.recv()
    opened = open_broadcast(desc, device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for i, n in enumerate(sizes):
            opened.fetch(i % 2, n)
        times.append(time.perf_counter() - t)
    opened.close()
    conn.send(times)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _rank_bytes(whole: torch.Tensor, spec, shard) -> torch.Tensor:
    """What vLLM's loader leaves on a rank: narrow() of the whole parameter per piece."""
    t = whole.view(spec.dtype).view(spec.shape)
    if shard is not None:
        t = torch.cat([t.narrow(shard.dim, a, b - a) for a, b, _ in shard.pieces], shard.dim)
    return t


def _check(
    sender: BroadcastSender,
    shape: ModelShape,
    mxfp8: bool,
    tp: int,
    ranks: int,
    experts: str,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    sample: bool,
) -> dict:
    """Each rank's bytes against the trainer's tensors; returns mismatched params per rank."""
    params = vllm_params(shape, mxfp8=mxfp8)
    dests = vllm_destinations(shape, mxfp8=mxfp8, experts=experts)
    names = list(params)
    if sample:
        last = f"model.layers.{shape.layers - 1}."
        names = [n for n in names if not n.startswith("model.layers.") or n.startswith(("model.layers.0.", last))]
    wholes = {n: _checkpoint_param(n, params[n].nbytes, dests, weights, device) for n in names}
    want = {}  # per tensor-parallel rank: param -> (nbytes, sha256); replicas share it
    for t in range(tp):
        shards = vllm_shards(shape, mxfp8=mxfp8, tp_rank=t, tp_size=tp)
        rank_bytes = {n: _rank_bytes(wholes[n], params[n], shards.get(n)) for n in names}
        want[t] = {n: (b.numel() * b.element_size(), _sha(b)) for n, b in rank_bytes.items()}
    fan = sender.client
    bad = {}
    for r in range(ranks):
        ranges = [[n, 0, nbytes] for n, (nbytes, _) in want[r % tp].items()]
        fan.send_to(r, {"op": "checksum", "ranges": ranges})
        got = fan.recv_from(r, time.monotonic() + 600, "checksums")["sha256"]
        bad[r] = [n for (n, (_, w)), g in zip(want[r % tp].items(), got) if g != w]
    return {"params_checked": len(names), "mismatched": bad}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(
    shape: ModelShape,
    mxfp8: bool,
    tp: int,
    engine_devices: list[str],
    device: torch.device,
    weights: dict[str, torch.Tensor],
    args,
) -> dict:
    ranks = len(engine_devices)
    conns, procs = [], []
    for r, dev in enumerate(engine_devices):
        conn, child = CTX.Pipe()
        p = CTX.Process(
            target=_engine_main, args=(child, shape, mxfp8, dev, (r % tp, tp), args.experts, args.timeout), daemon=True
        )
        p.start()
        conns.append(conn)
        procs.append(p)
    hellos = [c.recv() for c in conns]
    sender = BroadcastSender(
        [(h["address"], h["token"]) for h in hellos],
        device=device,
        bucket_bytes=args.bucket_mb << 20,
        timeout_s=args.timeout,
        rendezvous_timeout_s=args.timeout,
    )
    out: dict = {
        "format": "mxfp8" if mxfp8 else "bf16",
        "tp": tp,
        "engine_ranks": ranks,
        "engine_bytes_per_rank": hellos[0]["engine_bytes"],
    }
    try:
        t = time.perf_counter()
        sender.plan([SourceSpec(n, tuple(w.shape), w.dtype) for n, w in weights.items()])
        out["plan_s"] = time.perf_counter() - t  # includes forming the group (NCCL communicator)
        reports = []
        for step in range(args.warmup + args.steps):
            _sync(device)
            report = sender.refit(weights)
            if step >= args.warmup:
                reports.append(asdict(report))
        wire = reports[-1]["bytes"]
        refit_s = statistics.median(r["total_s"] for r in reports)
        out.update(
            wire_bytes=wire,
            buckets=reports[-1]["buckets"],
            refit_s=refit_s,
            refit_GBps=wire / refit_s / 1e9,
            phases={
                k: statistics.median(r[k] for r in reports)
                for k in ("check_s", "pack_s", "wait_s", "engine_fetch_s", "engine_apply_s")
            },
            check=_check(sender, shape, mxfp8, tp, ranks, args.experts, weights, device, sample=not args.smoke),
        )
        sizes = [b.nbytes for b in sender.plan_.buckets]
    finally:
        sender.close(shutdown_engine=True)
    store = RendezvousStore()
    plain = BroadcastBuffers(
        2, max(sizes), device, store=store, world_size=ranks + 1, timeout_s=args.timeout, rendezvous_timeout_s=args.timeout
    )
    desc = plain.describe()
    for r, c in enumerate(conns):
        c.send(({**desc, "rank": r + 1}, sizes, args.steps))
    plain.join([f"engine {r}" for r in range(ranks)])
    times = []
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        for i, n in enumerate(sizes):
            plain.acquire(i % 2)
            plain.publish(i % 2, n)
        plain.acquire(0)
        plain.acquire(1)
        _sync(device)
        times.append(time.perf_counter() - t)
    engine_times = [c.recv() for c in conns]
    plain.close()
    for p in procs:
        p.join(60)
    plain_s = max(statistics.median(times), max(statistics.median(e) for e in engine_times))
    out.update(
        plain_broadcast_s=plain_s, plain_broadcast_GBps=sum(sizes) / plain_s / 1e9, refit_over_plain=out["refit_s"] / plain_s
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(BUILTIN))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument(
        "--experts",
        default="grouped",
        choices=("per_expert", "grouped"),
        help="trainer's expert tensors (grouped = transformers 5 in memory)",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny model, 2 engine processes, all bytes checked")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        shape = replace(BUILTIN["tiny-qwen3-moe"], layers=2, vocab=512)
        device, engine_devices = torch.device("cpu"), ["cpu", "cpu"]
        args.bucket_mb = 1
    else:
        shape = BUILTIN[args.model]
        n = torch.cuda.device_count()
        if n < 2:
            print(f"needs at least 2 GPUs (trainer + one engine), found {n}", file=sys.stderr)
            return 2
        device, engine_devices = torch.device("cuda:0"), [f"cuda:{i}" for i in range(1, n)]
    specs = [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(shape, experts=args.experts)]
    weights = make_weights(specs, device, seed=1)
    result = {
        "model": shape.name,
        "device": str(device),
        "engine_devices": engine_devices,
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "trainer_bytes": sum(w.numel() * w.element_size() for w in weights.values()),
        "configs": [],
    }
    for tp in (1, 2):
        usable = engine_devices if tp == 1 else engine_devices[: len(engine_devices) // 2 * 2]
        if not usable:
            result["configs"].append({"tp": tp, "skipped": f"needs 2 engine GPUs, found {len(engine_devices)}"})
            continue
        for mxfp8 in (True, False):
            cfg = run_config(shape, mxfp8, tp, usable, device, weights, args)
            result["configs"].append(cfg)
            print(
                json.dumps({k: v for k, v in cfg.items() if k != "check"}), "mismatched:", cfg["check"]["mismatched"], flush=True
            )
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    bad = any(any(c.get("check", {}).get("mismatched", {}).values()) for c in result["configs"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
