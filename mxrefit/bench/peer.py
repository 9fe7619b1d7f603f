"""`mxrefit bench --peer checkpoint-engine`: MoonshotAI's checkpoint-engine on the bench's own tensors.
(``--peer vllm``, vLLM's own weight-transfer path, is ``peer_vllm``; ``unavailable`` answers for both.)

Its own code path, as its vLLM worker extension drives it, written against checkpoint-engine
0.4.2 (the ``peer`` extra): trainer side (this process) ``ParameterServer.register_checkpoint``
(the BF16 tensors copied into pinned host memory, a shared pool reused across refits) ->
``gather_metas`` (a world-size-1 NCCL process group, which ``update`` tears down again) ->
``update`` (host -> GPU buckets, broadcast, the bucket's CUDA IPC handle and a pickled
manifest over ZeroMQ) -> ``unregister_checkpoint``; engine side (another process)
``checkpoint_engine.worker.update_weights_from_ipc`` copying each received tensor into a dict
of BF16 tensors, the engine a BF16 vLLM would be. After the last refit every received tensor is
compared with the trainer's (sha256 of its bytes).

CUDA only: the ParameterServer needs a CUDA device (its ``DeviceManager`` refuses others), NCCL
and CUDA IPC; ``unavailable`` says why a run cannot happen instead of failing inside it. Not run
in CI (no GPU there); the refusals are tested on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mxrefit.bench import peer_vllm
from mxrefit.devices import first_cuda_problem
from mxrefit.plan.shapes import ModelShape
from mxrefit.transport.bytesum import tensor_sha256

PEERS = ("checkpoint-engine", peer_vllm.PEER)
CHECKPOINT = "mxrefit-bench"
_ALIGN = 256  # checkpoint-engine's alignment of each tensor in its pinned buckets (pin_memory._ALIGN_SIZE)
_INSTALL = "pip install 'mxrefit[peer]' (checkpoint-engine==0.4.2)"


def unavailable(peer: str, device: torch.device, shape: ModelShape | None = None, fmt: str = "mxfp8") -> str | None:
    """Why ``peer`` cannot run on ``device`` here, every missing piece named; None when it can.
    ``shape`` and ``fmt``: the bench's model and format (checkpoint-engine moves BF16 whatever they are)."""
    if peer not in PEERS:
        return f"--peer {peer}: unknown peer; known: {', '.join(PEERS)}"
    if peer == peer_vllm.PEER:
        return peer_vllm.unavailable(device, shape, fmt)
    reasons = []
    why = first_cuda_problem(
        device,
        "its ParameterServer shares GPU buckets by CUDA IPC and runs NCCL",
        "a single-process ParameterServer works on cuda:0 (rank 0 % GPUs)",
    )
    if why:
        reasons.append(why)
    elif not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        reasons.append("it needs torch.distributed with NCCL, which this torch lacks")
    if importlib.util.find_spec("checkpoint_engine") is None:
        reasons.append(f"the package checkpoint-engine is not installed: {_INSTALL}")
    else:
        try:
            importlib.import_module("checkpoint_engine.ps")
            importlib.import_module("checkpoint_engine.worker")
        except ImportError as err:
            reasons.append(f"checkpoint-engine does not import ({err}); its dependencies come with {_INSTALL}")
    if not reasons:
        return None
    return f"--peer {peer} cannot run here: " + "; ".join(reasons)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _rank_zero_env() -> Iterator[None]:
    """RANK=0, WORLD_SIZE=1 while the ParameterServer starts: it reads ``RANK`` from the environment
    whenever the ``rank`` argument is falsy, which 0 is."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor's bytes, by name."""
    return {name: tensor_sha256(t) for name, t in tensors.items()}


def _device_uuid(dev: torch.device) -> str:
    """The key checkpoint-engine names a GPU's socket by (as its vLLM worker extension computes it)."""
    return f"GPU-{torch.cuda.get_device_properties(dev).uuid!s}"


def _engine_main(conn, specs: list[tuple[str, tuple[int, ...], torch.dtype]], device: str) -> None:
    """Engine process: a dict of BF16 tensors, filled by ``update_weights_from_ipc`` on each update."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc
    from loguru import logger

    logger.disable("checkpoint_engine")
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    params = {name: torch.empty(shape, dtype=dtype, device=dev) for name, shape, dtype in specs}
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ctx = zmq.Context()
    uuid = _device_uuid(dev)
    conn.send({"ready": True})
    while True:
        msg = conn.recv()
        if msg["op"] == "update":
            apply_s = 0.0

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                nonlocal apply_s
                t = time.perf_counter()
                for name, tensor in weights:
                    params[name].copy_(tensor)
                torch.cuda.synchronize(dev)
                apply_s += time.perf_counter() - t

            try:
                update_weights_from_ipc(ctx, msg["paths"][uuid], dev.index, run=load)
                conn.send({"engine_apply_s": apply_s})
            except Exception as err:  # reported to the trainer, which raises it
                conn.send({"error": f"{type(err).__name__}: {err}"})
        elif msg["op"] == "digest":
            conn.send(_digests(params))
        else:
            conn.send({"engine_peak_extra_bytes": torch.cuda.max_memory_allocated(dev) - base})
            break
    ctx.destroy(linger=0)


def _expect(conn, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"checkpoint-engine's engine process did not answer within {timeout_s:.0f} s ({what})")
    reply = conn.recv()
    if isinstance(reply, dict) and "error" in reply:
        raise RuntimeError(f"checkpoint-engine's engine process failed ({what}): {reply['error']}")
    return reply


def run_checkpoint_engine(
    weights: dict[str, torch.Tensor],
    device: torch.device,
    *,
    steps: int,
    warmup: int,
    timeout_s: float,
    step: Callable[[int], None],
    on_step: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``warmup + steps`` refits of ``weights`` through checkpoint-engine into another process on
    ``device``; ``step(i)`` changes the weights before refit ``i`` as the bench's modes do."""
    why = unavailable("checkpoint-engine", device)
    if why:
        raise RuntimeError(why)
    import zmq
    from checkpoint_engine.ps import ParameterServer
    from loguru import logger

    logger.disable("checkpoint_engine")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    specs = [(name, tuple(t.shape), t.dtype) for name, t in weights.items()]
    proc = ctx.Process(target=_engine_main, args=(child, specs, str(device)), daemon=True)
    proc.start()
    try:
        _expect(conn, 600, "start")
        with _rank_zero_env():
            ps = ParameterServer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
        # its REQ socket waits for the engine without a limit: a dead engine would hang the bench
        ps_ctx = getattr(ps, "_zmq_ctx", None)
        if ps_ctx is not None:
            ps_ctx.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        reports = []
        for i in range(warmup + steps):
            step(i)
            torch.cuda.synchronize(device)
            engine: dict[str, Any] = {}

            def request(socket_paths: list[tuple[str, str]]) -> None:
                conn.send({"op": "update", "paths": dict(socket_paths)})
                try:
                    engine.update(_expect(conn, timeout_s, f"refit {i}"))
                except (TimeoutError, RuntimeError) as err:
                    engine["error"] = str(err)

            t0 = time.perf_counter()
            ps.register_checkpoint(CHECKPOINT, named_tensors=weights, use_shared_memory_pool=True)
            t1 = time.perf_counter()
            ps.gather_metas(CHECKPOINT)
            t2 = time.perf_counter()
            ps.update(CHECKPOINT, request)
            t3 = time.perf_counter()
            ps.unregister_checkpoint(CHECKPOINT)
            t4 = time.perf_counter()
            if "error" in engine:
                raise RuntimeError(engine["error"])
            if i >= warmup:
                reports.append(
                    {
                        "register_s": t1 - t0,
                        "gather_s": t2 - t1,
                        "update_s": t3 - t2,
                        "unregister_s": t4 - t3,
                        "total_s": t4 - t0,
                        "engine_apply_s": engine.get("engine_apply_s", 0.0),
                    }
                )
            if on_step is not None:
                on_step()
        trainer_peak = torch.cuda.max_memory_allocated(device) - base
        del ps  # with it the shared pinned pool (unregistered by name above, kept for reuse until now)
        conn.send({"op": "digest"})
        want = _digests(weights)  # while the engine hashes its copies
        got = _expect(conn, timeout_s, "sha256 of the received tensors")
        conn.send({"op": "stop"})
        engine_peak = _expect(conn, 60, "stop")["engine_peak_extra_bytes"]
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    total = statistics.median(r["total_s"] for r in reports)
    summary = {k: statistics.median(r[k] for r in reports) for k in reports[0]}
    return {
        **summary,
        "bytes": nbytes,
        "GBps": nbytes / total / 1e9,
        "trainer_peak_extra_bytes": trainer_peak,
        "engine_peak_extra_bytes": engine_peak,
        "pinned_host_bytes": sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in weights.values()),
        "check": {"tensors_checked": len(want), "mismatched": sorted(n for n in want if got.get(n) != want[n])},
        "per_step": reports,
    }
