"""Refit over a broadcast group: a trainer and two engine processes over gloo, real components throughout.

Each engine rank is a tiny transformers Qwen3-MoE behind its own Receiver (whole, or one
tensor-parallel rank's slices as vLLM's parallel layers hold them); the trainer is this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from torch import distributed as dist

from mxrefit.formats import mxfp8
from mxrefit.plan.build import PlanMismatch, SourceSpec
from mxrefit.source.broadcast_sender import BroadcastSender
from mxrefit.source.sender import RefitError
from mxrefit.transport.broadcast import RendezvousError
from tests.helpers import models
from tests.helpers.checks import rank_matches
from tests.helpers.engine_proc import dying_broadcast_trainer, serve_tiny

CTX = mp.get_context("spawn")
BUCKET = 32 << 10


class Ranks:
    """Engine processes started together; ``specs[i]`` = serve_tiny keyword arguments of rank i."""

    def __init__(self, specs: list[dict], timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.procs: list = [None] * len(specs)
        self.conns: list = [None] * len(specs)
        self.engines: list = [None] * len(specs)
        for i, spec in enumerate(specs):
            self._spawn(i, spec)
        for i in range(len(specs)):
            self._hello(i)

    def _spawn(self, i: int, spec: dict) -> None:
        self.conns[i], child = CTX.Pipe()
        kwargs = {k: v for k, v in spec.items() if k != "mxfp8"}
        self.procs[i] = CTX.Process(
            target=serve_tiny, args=(child, "moe", spec.get("mxfp8", False), self.timeout_s), kwargs=kwargs, daemon=True
        )
        self.procs[i].start()

    def _hello(self, i: int) -> None:
        assert self.conns[i].poll(120), f"engine {i} did not start"
        hello = self.conns[i].recv()
        self.engines[i] = (hello["address"], hello["token"])

    def restart(self, i: int, spec: dict) -> tuple[str, bytes]:
        self.procs[i].join(5)
        self._spawn(i, spec)
        self._hello(i)
        return self.engines[i]

    def stop(self, sender=None) -> None:
        if sender is not None:
            sender.close(shutdown_engine=True)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in models.tiny_qwen3_moe(seed).named_parameters()}


def tp_take(rank: int, size: int):
    """vLLM's tensor-parallel slice of a whole (encoded) tensor, in plain chunk() terms."""

    def take(name: str, part: torch.Tensor) -> torch.Tensor:
        if size == 1:
            return part
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = part.chunk(2, dim=1)
            return torch.cat([gate.chunk(size, dim=1)[rank], up.chunk(size, dim=1)[rank]], dim=1)
        if name.endswith("mlp.experts.down_proj"):
            return part.chunk(size, dim=2)[rank]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            return part.chunk(size, dim=0)[rank]
        if name.endswith("o_proj.weight"):
            return part.chunk(size, dim=-1)[rank]
        return part

    return take


def _specs(weights: dict[str, torch.Tensor]) -> list[SourceSpec]:
    return [SourceSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()]


@pytest.fixture
def trainer_world():
    """The trainer's own default process group (world of one), which the refit group must not disturb."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2], ids=["replicas", "tp2"])
@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_refits_reach_every_rank_bit_exact(mx, tp, trainer_world):
    ranks = Ranks([{"mxfp8": mx, "tp": (i % tp, tp)} for i in range(2)])
    # TP ranks also check the per-bucket integrity sums (over the bytes that reached their slots)
    sender = BroadcastSender(ranks.engines, bucket_bytes=BUCKET, timeout_s=30, rendezvous_timeout_s=30, verify=tp == 2)
    try:
        for step, seed in enumerate((11, 12, 13)):
            weights = _weights(seed)
            report = sender.refit(weights)
            assert report.version == step + 1 and report.transport == "broadcast" and report.buckets > 3
            status = sender.status()
            assert status["state"] == "ready" and [r["version"] for r in status["ranks"]] == [step + 1] * 2, status
            for i in range(2):
                assert rank_matches(sender, i, weights, tp_take(i % tp, tp)) == [], f"engine {i}"
        # the trainer's own group still works and still has one member
        x = torch.ones(3)
        dist.all_reduce(x)
        assert dist.get_world_size() == 1 and torch.equal(x, torch.ones(3))
    finally:
        ranks.stop(sender)


def test_tp_slices_of_mxfp8_weights_equal_quantizing_the_slices():
    """What a TP rank gets (a slice of quantize(whole)) is what vLLM computes from its checkpoint slice."""
    weights = _weights(5)
    for name in (
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.self_attn.q_proj.weight",
    ):
        whole = mxfp8.quantize(weights[name], backend="torch")
        for rank in range(2):
            take = tp_take(rank, 2)
            own = mxfp8.quantize(take(name, weights[name]).contiguous(), backend="torch")
            assert all(
                torch.equal(take(name, w).contiguous().view(torch.uint8), o.view(torch.uint8)) for w, o in zip(whole, own)
            ), name


def test_a_rank_killed_mid_refit_is_named_survivor_partial_then_repaired():
    timeout = 5.0
    ranks = Ranks([{"mxfp8": True, "tp": (0, 2)}, {"mxfp8": True, "tp": (1, 2), "die_in_refit": (2, 2)}], timeout_s=timeout)
    sender = BroadcastSender(ranks.engines, bucket_bytes=16 << 10, timeout_s=timeout, rendezvous_timeout_s=30)
    try:
        first = _weights(41)
        sender.refit(first)
        t = time.monotonic()
        with pytest.raises(RefitError, match="engine 1 at") as err:
            sender.refit(_weights(42))
        assert time.monotonic() - t < 2 * timeout + 5
        ranks_now = err.value.engine_status["ranks"]
        assert ranks_now[0]["state"] == "partial" and ranks_now[0]["version"] == 1, ranks_now
        assert ranks_now[1]["state"] == "lost", ranks_now
        with pytest.raises(RefitError, match="replace_engine"):
            sender.refit(first)
        address, token = ranks.restart(1, {"mxfp8": True, "tp": (1, 2)})
        sender.replace_engine(1, address, token)
        repaired = _weights(43)
        report = sender.refit(repaired)
        assert report.version == 2 and sender.status()["state"] == "ready"
        for i in range(2):
            assert rank_matches(sender, i, repaired, tp_take(i, 2)) == [], f"engine {i}"
    finally:
        ranks.stop(sender)


def test_trainer_killed_mid_broadcast_leaves_ranks_partial_then_a_new_trainer_repairs():
    conn, child = CTX.Pipe()
    dying = CTX.Process(target=dying_broadcast_trainer, args=(child, 3))
    dying.start()  # it imports while the engines start
    ranks = Ranks([{"mxfp8": True, "tp": (i, 2)} for i in range(2)], timeout_s=5.0)
    sender = None
    try:
        conn.send(ranks.engines)
        dying.join(120)
        assert dying.exitcode == 17
        sender = BroadcastSender(ranks.engines, bucket_bytes=16 << 10, timeout_s=10, rendezvous_timeout_s=30)
        deadline = time.monotonic() + 20
        while any(r["error"] is None for r in sender.status()["ranks"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for r in sender.status()["ranks"]:  # buckets 0 and 1 landed; bucket 2 was announced, never sent
            assert r["version"] == 0 and r["state"] == "partial", r
            assert "bucket 2 did not arrive" in r["error"] and "gloo refit group" in r["error"], r
        weights = _weights(44)
        assert sender.refit(weights).version == 1
        for i in range(2):
            assert rank_matches(sender, i, weights, tp_take(i, 2)) == [], f"engine {i}"
    finally:
        ranks.stop(sender)


def test_a_rank_that_never_joins_is_named_at_the_rendezvous_timeout_then_refits_recover():
    ranks = Ranks([{}, {}])
    sender = BroadcastSender(ranks.engines, bucket_bytes=BUCKET, timeout_s=5, rendezvous_timeout_s=3)
    weights = _weights(7)
    try:
        sender.connect()
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(RendezvousError, match=r"rank 2 \(engine 1 at .*\) did not join within the 3 s"):
            sender.plan(_specs(weights))
        assert time.monotonic() - t < 3 + 3
        os.kill(ranks.procs[1].pid, signal.SIGCONT)
        report = sender.refit(weights)  # the late answers are skipped; a new group forms
        assert report.version == 1
        for i in range(2):
            assert rank_matches(sender, i, weights) == [], f"engine {i}"
        # a streamed tensor found non-finite mid-refit: every rank aborted, the next refit re-plans
        bad = _weights(8)
        name = "model.layers.1.self_attn.o_proj.weight"
        bad[name][3, 5] = float("inf")
        with pytest.raises(RefitError, match=name) as err:
            sender.refit(iter(bad.items()))
        assert [(r["version"], r["state"]) for r in err.value.engine_status["ranks"]] == [(1, "partial")] * 2
        weights = _weights(9)
        assert sender.refit(weights).version == 2
        for i in range(2):
            assert rank_matches(sender, i, weights) == [], f"engine {i}"
    finally:
        os.kill(ranks.procs[1].pid, signal.SIGCONT)
        ranks.stop(sender)


def test_fused_screen_a_nan_in_a_norm_aborts_every_rank_then_repairs():
    """``check_finite=False`` (no separate screen): the passthrough copy finds the NaN while
    packing; every rank is aborted, left partial at the last version, and the next refit repairs."""
    ranks = Ranks([{}, {}])
    sender = BroadcastSender(ranks.engines, bucket_bytes=BUCKET, timeout_s=30, check_finite=False)
    try:
        assert sender.refit(_weights(11)).version == 1
        bad = _weights(12)
        name = "model.layers.1.post_attention_layernorm.weight"
        bad[name][7] = float("nan")
        with pytest.raises(RefitError, match=name) as err:
            sender.refit(bad)
        assert [(r["version"], r["state"]) for r in err.value.engine_status["ranks"]] == [(1, "partial")] * 2
        weights = _weights(13)
        assert sender.refit(weights).version == 2
        for i in range(2):
            assert rank_matches(sender, i, weights) == [], f"engine {i}"
    finally:
        ranks.stop(sender)


def test_ranks_with_different_models_are_refused_by_name():
    ranks = Ranks([{"mxfp8": True}, {"mxfp8": False}])
    sender = BroadcastSender(ranks.engines, bucket_bytes=BUCKET, timeout_s=10, rendezvous_timeout_s=10)
    try:
        with pytest.raises(PlanMismatch, match=r"engine 1 at .*describe|on engine 1 at") as err:
            sender.refit(_weights(9))
        assert "o_proj" in str(err.value)
        assert [r["version"] for r in sender.status()["ranks"]] == [0, 0]
    finally:
        ranks.stop(sender)
