"""Faults injected into real processes at precise protocol points; after each, the next refit lands bit-exact.

Every case checks the same three things (docs/reliability.md counts them):
1. the surviving side raises or reports a clear error within its timeout;
2. the engine reports ``partial`` (some bucket of the failed refit was written) or ``ready``
   (nothing was), always with the last complete version;
3. the next refit succeeds and the engine's bytes equal the trainer's (``engine_matches``).

The engine is a tiny Qwen3-MoE held in MXFP8 (5 buckets of 128 KiB) in a spawned process;
trainers that must die are spawned processes too (``engine_proc.faulty_trainer``).
"""

from __future__ import annotations

import random
import re
import time

import pytest

from mxrefit.plan.build import PlanMismatch, SourceSpec
from mxrefit.source.sender import RefitError, Sender
from mxrefit.transport.control import PeerTimeout
from tests.helpers.engine_proc import faulty_trainer
from tests.helpers.faults import KILLED_ENGINE_EXIT, KILLED_TRAINER_EXIT, FaultyClient
from tests.helpers.refit_helpers import (
    CTX,
    EngineProcess,
    engine_matches,
    random_weights,
    specs_to_plain,
    trainer_specs,
    wait_until,
)

ENGINE_TIMEOUT_S = 3.0
TRAINER_TIMEOUT_S = 2.0
SLACK_S = 1.5  # scheduling on a loaded 2-core CI machine; a doubled timeout would exceed it
BUCKET = 16 << 10  # raised by the plan to the largest tensor (128 KiB): 5 buckets
BUCKETS = 5
KILL_SEED = 20261203


@pytest.fixture(scope="module")
def engine():
    eng = EngineProcess(mxfp8=True, timeout_s=ENGINE_TIMEOUT_S)
    yield eng
    eng.stop(Sender(eng.address, eng.token, timeout_s=10))


def _sender(engine: EngineProcess, **kwargs) -> Sender:
    return Sender(engine.address, engine.token, bucket_bytes=BUCKET, timeout_s=TRAINER_TIMEOUT_S, **kwargs)


def _raw_status(sender: Sender) -> dict:
    return sender.client.request({"op": "status"}, 10, step="status")


def _answers_status(sender: Sender) -> bool:
    try:
        sender.client.request({"op": "status"}, 0.2, step="probing a hung engine")
        return True
    except PeerTimeout:
        return False


def _assert_next_refit_lands(sender: Sender, seed: int) -> None:
    before = sender.status()["version"]
    weights = random_weights(trainer_specs(sender), seed)
    report = sender.refit(weights)
    assert report.version == before + 1
    assert sender.status() == {"version": before + 1, "state": "ready", "error": None}
    assert engine_matches(sender, weights) == []


def _kill_points() -> list[dict]:
    """Before bucket 0 (nothing written), before two random later buckets, after the last bucket, before commit."""
    rng = random.Random(KILL_SEED)
    picked = sorted(rng.sample(range(2, BUCKETS), 2))
    points = [{"op": "ready", "nth": 0, "action": "die_before"}]
    points += [{"op": "ready", "nth": k, "action": "die_before"} for k in picked]
    points += [
        {"op": "ready", "nth": BUCKETS - 1, "action": "die_after", "delay_s": 0.3},
        {"op": "commit", "nth": 0, "action": "die_before"},
    ]
    return points


def _kill_id(p: dict) -> str:
    return f"{p['action']}-{p['op']}{p['nth'] if p['op'] == 'ready' else ''}"


@pytest.mark.parametrize("fault", _kill_points(), ids=_kill_id)
def test_trainer_killed_at_a_bucket(engine, fault):
    sender = _sender(engine)
    try:
        first = random_weights(trainer_specs(sender), 1)
        sender.refit(first)
        version = sender.engine_status["version"]
        specs = specs_to_plain(trainer_specs(sender))
        dying = CTX.Process(
            target=faulty_trainer, args=(engine.address, engine.token, specs, [2], fault, BUCKET, TRAINER_TIMEOUT_S)
        )
        dying.start()
        dying.join(120)
        assert dying.exitcode == KILLED_TRAINER_EXIT
        waited = wait_until(
            lambda: (_raw_status(sender).get("error") or "").find(f"version {version + 1}") >= 0, ENGINE_TIMEOUT_S + SLACK_S
        )
        status = _raw_status(sender)
        assert status["version"] == version, status
        if fault["op"] == "commit":
            expected = f"expected bucket {BUCKETS} or commit|no bucket {BUCKETS} of {BUCKETS}"
        elif fault["action"] == "die_after":
            expected = f"no bucket {fault['nth'] + 1} of {BUCKETS}"
        else:
            expected = "|".join(f"no bucket {k} of {BUCKETS}" for k in {max(fault["nth"] - 1, 0), fault["nth"]})
        assert re.search(expected, status["error"]) and f"{ENGINE_TIMEOUT_S:g} s timeout" in status["error"], status
        written = fault["op"] == "commit" or fault["nth"] >= 2 or fault["action"] == "die_after"
        assert status["state"] == ("partial" if written else "ready"), status
        if not written:
            assert engine_matches(sender, first) == []
        print(f"killed trainer ({_kill_id(fault)}): engine reported within {waited:.2f} s of its exit")
        sender.plan(trainer_specs(sender))  # the dead trainer's plan holds the engine's buffers now
        _assert_next_refit_lands(sender, 3)
    finally:
        sender.close()


def test_trainer_killed_while_the_engine_applies_its_bucket():
    """The engine's "applied" then has no one to go to: the engine must report it, not die of it."""
    engine = EngineProcess(
        mxfp8=True, timeout_s=ENGINE_TIMEOUT_S, fault={"refit": 1, "bucket": 1, "action": "hang", "seconds": 1.5}
    )
    sender = _sender(engine)
    try:
        specs = trainer_specs(sender)
        fault = {"op": "ready", "nth": 1, "action": "die_after", "delay_s": 0.3}
        dying = CTX.Process(
            target=faulty_trainer,
            args=(engine.address, engine.token, specs_to_plain(specs), [21], fault, BUCKET, TRAINER_TIMEOUT_S),
        )
        dying.start()
        dying.join(120)
        assert dying.exitcode == KILLED_TRAINER_EXIT
        wait_until(lambda: _raw_status(sender)["error"] is not None, ENGINE_TIMEOUT_S + SLACK_S)
        status = _raw_status(sender)
        assert engine.proc.is_alive()
        assert status["version"] == 0 and status["state"] == "partial", status
        assert re.search(r"refit to version 1: the trainer at .* disconnected after bucket 1 of 5", status["error"]), status
        _assert_next_refit_lands(sender, 22)
    finally:
        engine.stop(sender)


def test_a_restarted_trainer_refits_at_once_after_its_predecessor_died_mid_refit(engine):
    """The new trainer need not wait out the engine's timeout: it preempts the dead refit."""
    probe = _sender(engine)
    version = probe.status()["version"]
    specs = specs_to_plain(trainer_specs(probe))
    fault = {"op": "ready", "nth": 3, "action": "die_before"}
    dying = CTX.Process(target=faulty_trainer, args=(engine.address, engine.token, specs, [4], fault, BUCKET, TRAINER_TIMEOUT_S))
    dying.start()
    dying.join(120)
    assert dying.exitcode == KILLED_TRAINER_EXIT
    assert _raw_status(probe)["state"] == "partial"
    probe.close()
    restarted = _sender(engine)
    try:
        start = time.monotonic()
        weights = random_weights(trainer_specs(restarted), 5)
        assert restarted.refit(weights).version == version + 1
        elapsed = time.monotonic() - start
        assert elapsed < ENGINE_TIMEOUT_S
        print(f"restarted trainer: refit landed after {elapsed:.2f} s")
        assert engine_matches(restarted, weights) == []
    finally:
        restarted.close()


def test_trainer_hung_past_the_engine_timeout_then_resumes(engine):
    hang = ENGINE_TIMEOUT_S + 1.5
    sender = _sender(engine)
    try:
        first = random_weights(trainer_specs(sender), 6)
        sender.refit(first)
        version = sender.engine_status["version"]
        sender.client.close()
        sender.client = FaultyClient(engine.address, engine.token, {"op": "ready", "nth": 2, "action": "hang", "seconds": hang})
        start = time.monotonic()
        with pytest.raises(RefitError, match="between refits") as err:
            sender.refit(random_weights(trainer_specs(sender), 7))
        assert time.monotonic() - start >= hang
        status = _raw_status(sender)
        assert status["version"] == version and status["state"] == "partial", status
        assert f"no bucket 2 of {BUCKETS} from the trainer" in status["error"]
        assert f"engine holds version {version}, state partial" in str(err.value)
        _assert_next_refit_lands(sender, 8)
    finally:
        sender.close()


@pytest.mark.parametrize(
    "action,nth,written,engine_says",
    [
        ("swap_next", 0, False, "expected bucket 0 or commit, got .*'bucket': 1"),
        ("swap_next", 2, True, "expected bucket 2 or commit, got .*'bucket': 3"),
        ("duplicate", 1, True, "expected bucket 2 or commit, got .*'bucket': 1"),
        ("stale_version", 2, True, "expected bucket 2 or commit, got .*'version': "),
        ("commit_instead", 3, True, "expected bucket 3 or commit, got .*'op': 'commit'"),
        ("truncate", 2, True, "rejected.*undecodable frame"),
        (
            "drop",
            BUCKETS - 1,
            True,
            f"within {TRAINER_TIMEOUT_S:g} s while refit .*waiting for the engine to apply bucket {BUCKETS - 1}",
        ),
    ],
    ids=["reorder-first", "reorder", "duplicate", "stale-version", "early-commit", "truncated", "dropped"],
)
def test_protocol_violation_mid_refit(engine, action, nth, written, engine_says):
    sender = _sender(engine)
    try:
        first = random_weights(trainer_specs(sender), 9)
        sender.refit(first)
        version = sender.engine_status["version"]
        sender.client.close()
        sender.client = FaultyClient(engine.address, engine.token, {"op": "ready", "nth": nth, "action": action})
        start = time.monotonic()
        with pytest.raises(RefitError, match=engine_says):
            sender.refit(random_weights(trainer_specs(sender), 10))
        elapsed = time.monotonic() - start
        assert elapsed < TRAINER_TIMEOUT_S + SLACK_S
        print(f"protocol violation ({action}): trainer raised after {elapsed:.2f} s")
        status = _raw_status(sender)
        assert status["version"] == version and status["state"] == ("partial" if written else "ready"), status
        if not written:
            assert engine_matches(sender, first) == []
        _assert_next_refit_lands(sender, 11)
    finally:
        sender.close()


def test_stale_or_duplicate_version_is_refused_and_nothing_written(engine):
    sender = _sender(engine)
    try:
        weights = random_weights(trainer_specs(sender), 12)
        sender.refit(weights)
        version = sender.engine_status["version"]
        for stale in (version, version - 1, 0, -5):
            with pytest.raises(
                RefitError, match=f"stale or duplicate version {stale}: the engine already holds version {version}"
            ):
                sender.refit(random_weights(trainer_specs(sender), 13), version=stale)
            assert sender.status() == {"version": version, "state": "ready", "error": None}
            assert engine_matches(sender, weights) == []
        _assert_next_refit_lands(sender, 14)
    finally:
        sender.close()


def test_plan_changed_between_refits(engine):
    """Trainer tensors that no longer fit the plan (or the engine) are refused before any write; re-planning works."""
    sender = _sender(engine)
    try:
        specs = trainer_specs(sender)
        weights = random_weights(specs, 27)
        sender.refit(weights)
        version = sender.engine_status["version"]
        name = "model.layers.1.mlp.experts.down_proj"
        grown = [SourceSpec(s.name, (s.shape[0], s.shape[1], s.shape[2] + 32), s.dtype) if s.name == name else s for s in specs]
        with pytest.raises(PlanMismatch, match=f"tensor '{name}': planned .* got"):
            sender.refit(random_weights(grown, 28))
        with pytest.raises(PlanMismatch, match=f"'{name}'"):  # nor can a new plan take them: the engine's tables differ
            sender.plan(grown)
        assert sender.status() == {"version": version, "state": "ready", "error": None}
        assert engine_matches(sender, weights) == []
        old_digest = sender.plan_.digest
        sender.bucket_bytes = 256 << 10
        assert sender.plan(specs).digest != old_digest
        _assert_next_refit_lands(sender, 29)
    finally:
        sender.close()


def test_a_trainer_whose_plan_was_replaced_is_refused_and_nothing_written(engine):
    """Two trainers with one layout plan the same digest; only the last one's buffers are the engine's.

    Before plans were identified per adoption, the first trainer's begin was accepted and the
    engine copied the second trainer's buffers: 'ready', with the wrong weights.
    """
    first, second = _sender(engine), _sender(engine)
    try:
        specs = trainer_specs(first)
        first.refit(random_weights(specs, 23))
        theirs = random_weights(specs, 24)
        second.refit(theirs)
        assert first.plan_.digest == second.plan_.digest
        version = second.engine_status["version"]
        with pytest.raises(RefitError, match="adopted another plan .* plan again"):
            first.refit(random_weights(specs, 25), version=version + 1)
        assert first.status() == {"version": version, "state": "ready", "error": None}
        assert engine_matches(first, theirs) == []
        first.plan(specs)
        first.engine_status = first.status()
        _assert_next_refit_lands(first, 26)
    finally:
        first.close()
        second.close()


def test_engine_killed_mid_receive_trainer_raises_within_its_timeout():
    engine = EngineProcess(mxfp8=True, timeout_s=ENGINE_TIMEOUT_S, fault={"refit": 2, "bucket": 1, "action": "die"})
    sender = _sender(engine)
    try:
        specs = trainer_specs(sender)
        sender.refit(random_weights(specs, 15))
        start = time.monotonic()
        # the engine dies in bucket 1; its "applied" for bucket 0 may die with it, unsent by zmq's I/O thread
        with pytest.raises(
            RefitError,
            match=f"refit 2 failed: no message from the engine at {engine.address} "
            f"within {TRAINER_TIMEOUT_S:g} s while refit 2, waiting for the "
            "engine to apply bucket [01]$",
        ):
            sender.refit(random_weights(specs, 16))
        elapsed = time.monotonic() - start
        assert elapsed < TRAINER_TIMEOUT_S + SLACK_S
        print(f"engine killed mid-receive: trainer raised after {elapsed:.2f} s")
        engine.proc.join(30)
        assert engine.proc.exitcode == KILLED_ENGINE_EXIT
        start = time.monotonic()
        with pytest.raises(RefitError, match="starting refit 2"):
            sender.refit(random_weights(specs, 16))
        elapsed = time.monotonic() - start
        assert elapsed < TRAINER_TIMEOUT_S + SLACK_S
        print(f"engine gone between refits: trainer raised after {elapsed:.2f} s")
    finally:
        sender.close()
    restarted = EngineProcess(mxfp8=True, timeout_s=ENGINE_TIMEOUT_S)
    sender = _sender(restarted)
    try:
        _assert_next_refit_lands(sender, 17)
    finally:
        restarted.stop(sender)


def test_engine_hung_past_the_trainer_timeout_then_next_refit_lands():
    hang = TRAINER_TIMEOUT_S + 2.0
    engine = EngineProcess(
        mxfp8=True, timeout_s=ENGINE_TIMEOUT_S, fault={"refit": 2, "bucket": 1, "action": "hang", "seconds": hang}
    )
    sender = _sender(engine)
    try:
        specs = trainer_specs(sender)
        sender.refit(random_weights(specs, 18))
        start = time.monotonic()
        with pytest.raises(
            RefitError, match=f"within {TRAINER_TIMEOUT_S:g} s while refit 2, waiting for the engine to apply bucket 1"
        ):
            sender.refit(random_weights(specs, 19))
        elapsed = time.monotonic() - start
        assert elapsed < TRAINER_TIMEOUT_S + SLACK_S
        print(f"engine hung: trainer raised after {elapsed:.2f} s")
        wait_until(lambda: _answers_status(sender), hang + SLACK_S)
        _assert_next_refit_lands(sender, 20)
        assert engine.proc.is_alive()
    finally:
        engine.stop(sender)


@pytest.mark.parametrize(
    "transactional,fault",
    [
        (False, {"refit": 2, "bucket": 2, "action": "raise"}),
        (True, {"refit": 2, "bucket": 2, "action": "raise"}),
        (False, {"refit": 2, "action": "raise_after_refit"}),
    ],
    ids=["after_bucket", "after_bucket-transactional", "after_refit"],
)
def test_an_engine_hook_that_raises_is_reported_and_the_engine_keeps_serving(transactional, fault):
    """The engine's own code failing mid-refit (its post-processing, say) ends that refit with an error the
    trainer sees at once, the engine stays up and says it is partial at the last complete version, and
    the next refit repairs it."""
    engine = EngineProcess(mxfp8=True, timeout_s=ENGINE_TIMEOUT_S, transactional=transactional, fault=fault)
    sender = _sender(engine)
    try:
        specs = trainer_specs(sender)
        sender.refit(random_weights(specs, 21))
        hook = "after_refit" if fault["action"] == "raise_after_refit" else "after_bucket"
        start = time.monotonic()
        with pytest.raises(RefitError, match=rf"the engine's {hook} raised RuntimeError: injected failure in {hook}"):
            sender.refit(random_weights(specs, 22))
        assert time.monotonic() - start < TRAINER_TIMEOUT_S, "the trainer must hear of it at once, not by timeout"
        status = sender.status()
        assert (status["version"], status["state"]) == (1, "partial")
        assert f"refit to version 2: the engine's {hook} raised RuntimeError" in status["error"]
        _assert_next_refit_lands(sender, 23)
        assert engine.proc.is_alive()
    finally:
        engine.stop(sender)
