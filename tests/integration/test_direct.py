"""The direct transport: the trainer writes straight into the engine's exported memory.

Real processes and real shared memory stand in for CUDA IPC (the same code path: export,
open once, encode into views); the engine holds vLLM's MXFP8 layout of a tiny Qwen3-MoE in the
TRT-LLM kernel layout: written in place by the trainer where its tables advertise it (every
TRT-LLM param, per-expert or grouped), and post-processed layer by layer from a staging pool
on the two-pass path.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import replace

import msgpack
import pytest
import torch

from mxrefit.bench.run import _checkpoint_param, _post_params, make_weights
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
from mxrefit.integrations.vllm.trtllm import reference_kernel_bytes
from mxrefit.plan.build import SourceSpec
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs
from mxrefit.source.broadcast_sender import BroadcastSender
from mxrefit.source.sender import RefitError, Sender
from mxrefit.transport.direct import allocate, export_tensors, exportable, open_exports
from tests.helpers.checks import sha
from tests.helpers.engine_proc import serve_layout

CTX = mp.get_context("spawn")
SHAPE = replace(BUILTIN["tiny-qwen3-moe"], layers=4, vocab=512)  # buckets span less than a layer


class LayoutEngineProc:
    def __init__(
        self,
        post: bool = True,
        timeout_s: float = 20.0,
        device: str = "cpu",
        experts: str = "per_expert",
        direct_layout: bool = True,
        process_delay_s: float = 0.0,
    ):
        self.conn, child = CTX.Pipe()
        args = (child, SHAPE, post, timeout_s, experts, device, False, direct_layout, process_delay_s)
        self.proc = CTX.Process(target=serve_layout, args=args, daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "engine did not start"
        hello = self.conn.recv()
        self.address, self.token = hello["address"], hello["token"]

    def stop(self, sender=None) -> dict:
        if sender is not None:
            sender.close(shutdown_engine=True)
        final = self.conn.recv() if self.conn.poll(30) else {}
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        return final


def _weights(seed: int, device: str = "cpu", experts: str = "per_expert") -> dict[str, torch.Tensor]:
    specs = [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(SHAPE, experts=experts)]
    return make_weights(specs, torch.device(device), seed=seed)


def mismatched_params(
    sender: Sender, weights: dict[str, torch.Tensor], post: bool, experts: str = "per_expert", rank: int | None = None
) -> list[str]:
    """Every engine param whose served bytes differ from what the trainer's tensors must give (on
    engine ``rank`` alone, for a BroadcastSender)."""
    params = vllm_params(SHAPE, mxfp8=True)
    dests = vllm_destinations(SHAPE, mxfp8=True, experts=experts)
    kernel = _post_params(SHAPE, "trtllm" if post else "none")
    ranges, want = [], []
    for name, spec in params.items():
        ckpt = _checkpoint_param(name, spec.nbytes, dests, weights, torch.device("cpu"))
        expected = reference_kernel_bytes(name, ckpt.view(spec.dtype).view(spec.shape)) if name in kernel else ckpt
        ranges.append([name, 0, expected.numel()])
        want.append(sha(expected))
    msg = {"op": "checksum", "ranges": ranges}
    if rank is None:
        got = sender.client.request(msg, 30, step="checksums")["sha256"]
    else:
        sender.client.send_to(rank, msg)
        got = sender.client.recv_from(rank, time.monotonic() + 30, "checksums")["sha256"]
    return [r[0] for r, g, w in zip(ranges, got, want) if g != w]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC direct writes need a GPU")
@pytest.mark.parametrize("post", [True, False], ids=["trtllm", "plain"])
def test_cuda_direct_refits_land_exactly(post):
    engine = LayoutEngineProc(post=post, device="cuda")
    sender = Sender(engine.address, engine.token, bucket_bytes=96 << 10, device="cuda")
    try:
        for step, seed in enumerate((1, 2, 3)):
            weights = _weights(seed, "cuda")
            report = sender.refit(weights)
            assert report.transport == "direct" and report.version == step + 1
            assert mismatched_params(sender, {n: t.cpu() for n, t in weights.items()}, post) == []
        bad = _weights(4, "cuda")
        next(iter(bad.values())).view(-1)[7] = float("nan")
        with pytest.raises(ValueError, match="NaN or Inf; nothing was sent"):
            sender.refit(bad)
        assert sender.status() == {"version": 3, "state": "ready", "error": None}
    finally:
        engine.stop(sender)


@pytest.mark.parametrize("post,direct_layout", [(True, True), (True, False), (False, False)], ids=["trtllm", "staged", "plain"])
def test_direct_refits_land_exactly_and_staging_stays_small(post, direct_layout):
    """Per-expert names (the bench's default): with the kernel layouts advertised the trainer writes
    every TRT-LLM param in place, gate and up rows into their shared w13 regions, so nothing is
    staged; the two-pass path stages only the units in flight. Each layer's processing is slowed
    and the sender runs one bucket behind (the furthest ahead a trainer writes), so that the trainer
    runs as far ahead as its window lets it: a staging region freed too early (the 2026-12-05 CI
    failure, one run in five) is overwritten on every run."""
    engine = LayoutEngineProc(post=post, direct_layout=direct_layout, process_delay_s=0.05)
    sender = Sender(engine.address, engine.token, bucket_bytes=96 << 10, one_behind=True)
    try:
        for step, seed in enumerate((1, 2, 3)):
            weights = _weights(seed)
            report = sender.refit(weights)
            assert sender.transport == "direct" and report.transport == "direct"
            assert report.version == step + 1 and report.buckets >= 4
            assert mismatched_params(sender, weights, post) == []
    finally:
        final = engine.stop(sender)
    staged_total = sum(p.nbytes for n, p in vllm_params(SHAPE, mxfp8=True).items() if n in _post_params(SHAPE, "trtllm"))
    if post and direct_layout:
        assert final["staging_bytes"] == 0
    elif post:  # only the units in flight hold staging: less than a checkpoint-format copy of them all
        assert 0 < final["staging_bytes"] < staged_total


@pytest.mark.parametrize("experts", ["grouped", "per_expert"])
@pytest.mark.parametrize("transport", ["direct", "shm"])
def test_kernel_layouts_written_by_the_trainer_need_no_engine_pass(transport, experts):
    """Grouped expert slabs and per-expert names alike: every TRT-LLM param is advertised in its
    kernel layout (per-expert gate/up as rows of a shared w13 region), so the engine stages
    nothing and processes nothing, and its bytes equal the two-pass reference, whether the
    trainer writes the engine's memory or a buffer the engine copies from."""
    engine = LayoutEngineProc(experts=experts)
    sender = Sender(engine.address, engine.token, bucket_bytes=96 << 10, transport=transport)
    try:
        for seed in (21, 22):
            weights = _weights(seed, experts=experts)
            assert sender.refit(weights).transport == transport
            assert mismatched_params(sender, weights, True, experts=experts) == []
        laid = {t.param for d in sender._tables[1].values() for t in d.targets if t.layout is not None}
        assert laid == _post_params(SHAPE, "trtllm")
        shared = [t for d in sender._tables[1].values() for t in d.targets if t.layout is not None and t.layout.shared]
        assert bool(shared) == (experts == "per_expert")
        assert len(sender.plan_.buckets) >= 4  # several buckets: over shm a region split by one would land stale rows
    finally:
        final = engine.stop(sender)
    assert final["staging_bytes"] == 0


def test_kernel_layouts_broadcast_to_every_rank_land_exactly():
    """Two engine ranks over a broadcast group: the per-expert regions and every other kernel layout
    reach both ranks' memory equal to the two-pass reference, with nothing staged."""
    engines = [LayoutEngineProc(), LayoutEngineProc()]
    sender = BroadcastSender(
        [(e.address, e.token) for e in engines], bucket_bytes=96 << 10, timeout_s=30, rendezvous_timeout_s=30
    )
    try:
        for seed in (41, 42):
            weights = _weights(seed)
            assert sender.refit(weights).transport == "broadcast"
            assert [mismatched_params(sender, weights, True, rank=i) for i in range(2)] == [[], []]
        assert any(t.layout is not None and t.layout.shared for d in sender._tables[1].values() for t in d.targets)
        assert mismatched_params(sender, _weights(43), True, rank=1)  # negative control: other weights differ
    finally:
        sender.close(shutdown_engine=True)
        finals = [e.stop() for e in engines]
    assert [f["staging_bytes"] for f in finals] == [0, 0]


def test_the_two_pass_fallback_still_lands_exactly():
    engine = LayoutEngineProc(direct_layout=False)
    sender = Sender(engine.address, engine.token, bucket_bytes=96 << 10)
    try:
        weights = _weights(31)
        sender.refit(weights)
        assert mismatched_params(sender, weights, True) == []
        assert not any(t.layout for d in sender._tables[1].values() for t in d.targets)
    finally:
        engine.stop(sender)


def test_a_stream_is_sent_bucket_by_bucket_and_a_bad_tensor_late_in_it_aborts():
    engine = LayoutEngineProc(post=True)
    sender = Sender(engine.address, engine.token, bucket_bytes=96 << 10)
    try:
        first = _weights(11)
        sender.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in first.items()])
        pulled = []

        def stream(weights):
            for name, t in weights.items():
                pulled.append(name)
                yield name, t

        sender.refit(stream(first))
        assert mismatched_params(sender, first, True) == [] and sender.status()["state"] == "ready"
        bad = _weights(12)
        buckets = sender.plan_.buckets
        bad_name = sender.plan_.sources[buckets[1].sources[0]].name
        bad[bad_name].view(-1)[0] = float("inf")
        pulled.clear()
        with pytest.raises(RefitError, match=rf"stopped at bucket 1: .*{bad_name}"):
            sender.refit(stream(bad))
        # lazy: only buckets 0 and 1 were pulled from the stream, bucket 0 reached the engine
        assert len(pulled) == len(buckets[0].sources) + len(buckets[1].sources) < len(bad)
        status = sender.status()
        assert status["version"] == 1 and status["state"] == "partial"
        out_of_order = _weights(13)
        names = list(out_of_order)
        names[1], names[2] = names[2], names[1]
        with pytest.raises(RefitError, match="plan order"):
            sender.refit((n, out_of_order[n]) for n in names)
        repaired = _weights(14)
        report = sender.refit(stream(repaired))
        assert report.version == 2 and sender.status()["state"] == "ready"
        assert mismatched_params(sender, repaired, True) == []
    finally:
        engine.stop(sender)


def test_direct_is_refused_for_an_engine_that_cannot_export():
    from tests.helpers import models
    from tests.helpers.engine_proc import serve_tiny

    conn, child = CTX.Pipe()
    proc = CTX.Process(target=serve_tiny, args=(child, "llama", False, 20.0), daemon=True)
    proc.start()
    assert conn.poll(120)
    hello = conn.recv()
    sender = Sender(hello["address"], hello["token"], transport="direct")
    try:
        weights = {n: p.detach() for n, p in models.tiny_llama(3).named_parameters()}
        with pytest.raises(ValueError, match="cannot export"):
            sender.refit(weights)
        auto = Sender(hello["address"], hello["token"])
        auto.refit(weights)
        assert auto.transport == "shm"
        auto.close()
    finally:
        sender.close(shutdown_engine=True)
        proc.join(30)


def _child_writes(desc: bytes) -> None:
    opened = open_exports(msgpack.unpackb(desc))
    for i, (name, t) in enumerate(sorted(opened.tensors.items())):
        t.fill_(i + 1)
    opened.close()


def test_shm_exports_are_written_by_another_process():
    arena = allocate(1 << 16, "cpu")
    arena.zero_()
    tensors = {"a": arena[0:1000], "b": arena[4096 : 4096 + 333], "c": arena[8192 : 8192 + 1]}
    desc = export_tensors(tensors)
    assert desc["kind"] == "shm" and len(desc["segments"]) == 1
    child = CTX.Process(target=_child_writes, args=(msgpack.packb(desc),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert [int(t.unique().item()) for _, t in sorted(tensors.items())] == [1, 2, 3]
    assert int(arena[1000:4096].sum()) == 0  # nothing outside the exported views


def test_private_memory_and_malformed_descriptions_are_refused():
    assert not exportable({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="'w' is in private host memory"):
        export_tensors({"w": torch.zeros(4)})
    arena = allocate(4096, "cpu")
    good = export_tensors({"w": arena[:100]})
    with pytest.raises(ValueError, match="past its storage"):
        open_exports({**good, "tensors": [["w", 0, 4000, 200]]})
    with pytest.raises(ValueError, match="storage index"):
        open_exports({**good, "tensors": [["w", 3, 0, 10]]})
    with pytest.raises(ValueError, match="segment"):
        open_exports({**good, "segments": [["../etc/passwd", 10]]})
    with pytest.raises(ValueError, match="unknown export kind"):
        open_exports({"kind": "pickle"})
    with pytest.raises(ValueError, match="missing keys"):
        open_exports({"kind": "shm", "tensors": []})
