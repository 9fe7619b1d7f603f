"""Two real processes, shared memory, real control channel: refits land bit-exact, failures are reported."""

from __future__ import annotations

import re

import pytest
import torch

from mxrefit.formats import mxfp8
from mxrefit.plan.build import PlanMismatch, SourceSpec, align
from mxrefit.source.sender import RefitError, Sender
from tests.helpers.checks import engine_matches
from tests.helpers.engine_proc import SWIZZLED, swizzle_scales
from tests.helpers.refit_helpers import EngineProcess, engine_digests, sha, tiny_weights


@pytest.mark.parametrize(
    "quant", [None, "mxfp8", "fp8-block", "fp8-block-ue8m0"], ids=["bf16", "mxfp8", "fp8-block", "fp8-block-ue8m0"]
)
def test_repeated_refits_land_exactly(quant):
    """Every refit, not just the first, replaces every byte range: values and scales (2x per step, so scales move)."""
    engine = EngineProcess(quant=quant)
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10)
    try:
        before = None
        for step, seed in enumerate((11, 12, 13, 14)):
            weights = {n: t * 2.0**step for n, t in tiny_weights(seed).items()}
            report = sender.refit(weights)
            assert report.version == step + 1 and report.buckets > 3
            assert sender.status() == {"version": step + 1, "state": "ready", "error": None}
            assert engine_matches(sender, weights) == []
            if quant is not None:
                formats = {d.format for d in sender._tables[1].values()}
                assert formats == {"bf16", quant}, formats
            after = engine_digests(sender)
            if before is not None:
                assert [k for k in after if after[k] == before[k]] == []
            before = after
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


def test_post_processed_scales_follow_every_refit():
    """An engine that derives swizzled scales after loading must not keep the first refit's copy (a field failure)."""
    engine = EngineProcess(mxfp8=True, post_process=True)
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10)
    try:
        sender.connect()
        params, dests = sender._tables
        swizzled = {n: p for n, p in params.items() if n.endswith(SWIZZLED)}
        assert len(swizzled) == sum(d.format == "mxfp8" for d in dests.values()) > 0
        for step, seed in enumerate((31, 32, 33)):
            weights = {n: t * 2.0**step for n, t in tiny_weights(seed).items()}
            sender.refit(weights)
            want = {
                f"{n}_scale{SWIZZLED}": sha(swizzle_scales(mxfp8.quantize(weights[n], backend="torch")[1]))
                for n, d in dests.items()
                if d.format == "mxfp8"
            }
            ranges = [[n, 0, swizzled[n].nbytes] for n in want]
            got = sender.client.request({"op": "checksum", "ranges": ranges}, 30, step="swizzled scales")["sha256"]
            assert [n for n, g in zip(want, got) if g != want[n]] == [], f"stale derived scales after refit {step + 1}"
    finally:
        engine.stop(sender)


def test_tensors_at_and_past_the_bucket_size_are_sent():
    """The bucket grows to the largest tensor: below it, one byte below, exactly at it, one byte above."""
    engine = EngineProcess(model="llama")
    weights = tiny_weights(3, "llama")
    largest = align(max(t.numel() * t.element_size() for t in weights.values()))
    try:
        for asked in (4096, largest - 1, largest, largest + 1):
            sender = Sender(engine.address, engine.token, bucket_bytes=asked)
            weights = {n: t * 2.0 for n, t in weights.items()}
            report = sender.refit(weights)
            plan = sender.plan_
            assert plan.bucket_bytes == max(align(asked), largest)
            assert all(b.nbytes <= plan.bucket_bytes for b in plan.buckets)
            if asked <= largest:  # the largest tensor fills its bucket to the last byte
                assert max(b.nbytes for b in plan.buckets) == plan.bucket_bytes
            assert report.buckets > 1 and engine_matches(sender, weights) == []
            sender.close()
    finally:
        engine.stop(Sender(engine.address, engine.token))


def _bad_inputs(good: dict[str, torch.Tensor]) -> dict[str, tuple[dict, type, str]]:
    """Trainer tensors that must be refused before anything is written: name -> (tensors, error, message)."""
    o_proj, norm = "model.layers.0.self_attn.o_proj.weight", "model.norm.weight"

    def changed(name: str, t: torch.Tensor) -> dict:
        return {**good, name: t}

    def poked(name: str, value: float) -> dict:
        t = good[name].clone()
        t.view(-1)[t.numel() // 2] = value
        return changed(name, t)

    return {
        "shape": (changed(o_proj, good[o_proj][:, :96].contiguous()), PlanMismatch, "o_proj"),
        "dtype": (changed(o_proj, good[o_proj].float()), PlanMismatch, f"{o_proj}.*float32"),
        "NaN in an MXFP8 tensor": (poked(o_proj, float("nan")), mxfp8.NonFiniteError, f"{o_proj}.*nothing was sent"),
        "+Inf in an MXFP8 tensor": (poked(o_proj, float("inf")), mxfp8.NonFiniteError, o_proj),
        "-Inf in a BF16 tensor": (poked(norm, float("-inf")), mxfp8.NonFiniteError, norm),
        "NaN in a BF16 tensor": (poked(norm, float("nan")), mxfp8.NonFiniteError, norm),
        "missing": ({n: t for n, t in good.items() if n != norm}, PlanMismatch, f"missing tensor '{norm}'"),
        "unexpected": ({**good, "model.extra.weight": good[norm]}, PlanMismatch, "unexpected tensor 'model.extra.weight'"),
        "not contiguous": (changed(o_proj, good[o_proj].t().contiguous().t()), PlanMismatch, f"{o_proj}.*not contiguous"),
        "wrong device": (changed(norm, torch.empty_like(good[norm], device="meta")), PlanMismatch, f"{norm}.*is on meta"),
    }


def test_bad_input_is_refused_before_anything_is_written():
    engine = EngineProcess(mxfp8=True)
    sender = Sender(engine.address, engine.token)
    try:
        with pytest.raises(PlanMismatch, match="o_proj"):  # before any plan: nothing reaches the engine
            sender.refit(_bad_inputs(tiny_weights(20))["shape"][0])
        good = tiny_weights(21)
        sender.refit(good)
        for case, (tensors, error, message) in _bad_inputs({n: t * 2.0 for n, t in good.items()}).items():
            with pytest.raises(error, match=message):
                sender.refit(tensors)
            assert sender.status() == {"version": 1, "state": "ready", "error": None}, case
            assert engine_matches(sender, good) == [], case
    finally:
        engine.stop(sender)


def test_engine_refuses_a_plan_that_is_not_its_own():
    engine = EngineProcess()
    sender = Sender(engine.address, engine.token)
    try:
        sender.connect()
        specs = [SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tiny_weights(1).items()]
        specs[0] = SourceSpec(specs[0].name, (specs[0].shape[0] + 1, specs[0].shape[1]), specs[0].dtype)
        reply = sender.client.request(
            {
                "op": "plan",
                "sources": [[s.name, list(s.shape), "bfloat16"] for s in specs],
                "bucket_bytes": 1 << 20,
                "slots": 2,
                "digest": "0" * 64,
                "buffers": {},
            },
            30,
            step="bad plan",
        )
        assert reply["op"] == "error" and reply["kind"] == "plan_mismatch"
        assert specs[0].name in " ".join(reply["problems"])
        assert sender.status() == {"version": 0, "state": "ready", "error": None}
    finally:
        engine.stop(sender)


@pytest.mark.parametrize("quant", [None, "mxfp8"], ids=["bf16", "mxfp8"])
def test_fused_screen_aborts_on_a_non_finite_passthrough_tensor_and_the_next_refit_repairs(quant):
    """``check_finite=False``: the passthrough copy screens what it copies (norms here, in every
    mode); the abort names the tensor, leaves the engine ``partial`` at its last complete version,
    and the next good refit repairs it."""
    engine = EngineProcess(quant=quant)
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10, check_finite=False)
    try:
        sender.refit(tiny_weights(61))
        plan = sender.plan_
        norms = [i for i, s in enumerate(plan.sources) if plan.formats[i] == "bf16" and "layernorm" in s.name]
        bucket_of = {i: b.index for b in plan.buckets for i in b.sources}
        culprit = norms[len(norms) // 2]
        name = plan.sources[culprit].name
        assert bucket_of[culprit] > 0, "some buckets land first"
        bad = tiny_weights(62)
        bad[name].view(-1)[-1] = float("nan")
        with pytest.raises(RefitError, match=re.escape(f"non-finite values in [{name!r}] found while packing")):
            sender.refit(bad)  # without the passthrough screen this refit would pass and ship the NaN
        assert sender.status()["version"] == 1 and sender.status()["state"] == "partial"
        repaired = tiny_weights(63)
        assert sender.refit(repaired).version == 2
        assert sender.status() == {"version": 2, "state": "ready", "error": None}
        assert engine_matches(sender, repaired) == []
    finally:
        engine.stop(sender)
