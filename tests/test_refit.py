"""Two real processes, shared memory, real control channel: refits land bit-exact, failures are reported."""

from __future__ import annotations

import re

import pytest

from checks import engine_matches
from mxrefit.formats import mxfp8
from mxrefit.plan import PlanMismatch, SourceSpec
from mxrefit.sender import RefitError, Sender
from refit_helpers import EngineProcess, tiny_weights


@pytest.mark.parametrize("quant", [None, "mxfp8", "fp8-block", "fp8-block-ue8m0"], ids=["bf16", "mxfp8", "fp8-block", "fp8-block-ue8m0"])
def test_repeated_refits_land_exactly(quant):
    engine = EngineProcess(quant=quant)
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10)
    try:
        for step, seed in enumerate((11, 12, 13)):
            weights = tiny_weights(seed)
            report = sender.refit(weights)
            assert report.version == step + 1 and report.buckets > 3
            assert sender.status() == {"version": step + 1, "state": "ready", "error": None}
            assert engine_matches(sender, weights) == []
            if quant is not None:
                formats = {d.format for d in sender._tables[1].values()}
                assert formats == {"bf16", quant}, formats
    finally:
        engine.stop(sender)


def _refit_with_late_inf(sender: Sender) -> str:
    """Refit once, then again with +inf in the last FP8-block source; returns its name."""
    sender.refit(tiny_weights(51))
    plan = sender.plan_
    name = plan.sources[max(i for i, f in enumerate(plan.formats) if f == "fp8-block")].name
    bad = tiny_weights(52)
    bad[name][-1, -1] = float("inf")
    with pytest.raises(RefitError, match=re.escape(f"non-finite values in [{name!r}]")):
        sender.refit(bad)
    return name


def test_fp8_block_encoder_flags_non_finite_while_packing():
    """With the sender's pre-check off, the format's own non-finite report aborts the refit."""
    engine = EngineProcess(quant="fp8-block")
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10, check_finite=False)
    try:
        _refit_with_late_inf(sender)
        assert sender.status()["version"] == 1 and sender.status()["state"] == "partial"
    finally:
        engine.stop(sender)


def test_refit_after_a_non_finite_abort_repairs():
    engine = EngineProcess(quant="fp8-block")
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10, check_finite=False)
    try:
        _refit_with_late_inf(sender)
        repaired = tiny_weights(53)
        assert sender.refit(repaired).version == 2 and sender.status()["state"] == "ready"
        assert engine_matches(sender, repaired) == []
    finally:
        engine.stop(sender)


def test_a_tensor_larger_than_the_bucket_is_sent():
    engine = EngineProcess(model="llama")
    sender = Sender(engine.address, engine.token, bucket_bytes=4096)
    try:
        weights = tiny_weights(3, "llama")
        report = sender.refit(weights)
        assert sender.plan_.bucket_bytes >= max(t.numel() * t.element_size() for t in weights.values())
        assert report.buckets > 1 and engine_matches(sender, weights) == []
    finally:
        engine.stop(sender)


def test_mismatched_input_is_refused_before_anything_is_written():
    engine = EngineProcess(mxfp8=True)
    sender = Sender(engine.address, engine.token)
    try:
        good = tiny_weights(21)
        sender.refit(good)
        bad = dict(tiny_weights(22))
        name = "model.layers.0.self_attn.o_proj.weight"
        bad[name] = bad[name][:, :96].contiguous()
        with pytest.raises(PlanMismatch, match="o_proj"):
            sender.refit(bad)
        nan = dict(tiny_weights(23))
        nan[name][0, 0] = float("nan")
        with pytest.raises(mxfp8.NonFiniteError, match="nothing was sent"):
            sender.refit(nan)
        missing = dict(tiny_weights(24))
        missing.pop("model.norm.weight")
        with pytest.raises(PlanMismatch, match="model.norm.weight"):
            sender.refit(missing)
        assert sender.status()["version"] == 1 and sender.status()["state"] == "ready"
        assert engine_matches(sender, good) == []
    finally:
        engine.stop(sender)


def test_engine_refuses_a_plan_that_is_not_its_own():
    engine = EngineProcess()
    sender = Sender(engine.address, engine.token)
    try:
        sender.connect()
        specs = [SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tiny_weights(1).items()]
        specs[0] = SourceSpec(specs[0].name, (specs[0].shape[0] + 1, specs[0].shape[1]), specs[0].dtype)
        reply = sender.client.request({"op": "plan", "sources": [[s.name, list(s.shape), "bfloat16"] for s in specs],
                                       "bucket_bytes": 1 << 20, "slots": 2, "digest": "0" * 64, "buffers": {}}, 30, step="bad plan")
        assert reply["op"] == "error" and reply["kind"] == "plan_mismatch"
        assert specs[0].name in " ".join(reply["problems"])
        assert sender.status() == {"version": 0, "state": "ready", "error": None}
    finally:
        engine.stop(sender)


def test_wrong_token_cannot_refit():
    engine = EngineProcess()
    intruder = Sender(engine.address, b"x" * 32, timeout_s=5)
    sender = Sender(engine.address, engine.token)
    try:
        with pytest.raises(RefitError, match="refused"):
            intruder.refit(tiny_weights(31))
        weights = tiny_weights(32)
        sender.refit(weights)
        assert engine_matches(sender, weights) == []
    finally:
        intruder.close()
        engine.stop(sender)
