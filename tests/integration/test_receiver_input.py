"""Malformed messages from the token holder reach the real Receiver: each gets an error reply, none stops it.

The token holder is trusted to drive refits, not to send well-formed fields: a trainer bug, a
version skew or a truncated plan must produce a clear error reply and leave the engine serving
with its weights and plan as they were. Strangers (no or wrong token) are tests/integration/test_security.py's.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxrefit.plan.build import sources_to_msg
from mxrefit.source.sender import Sender
from mxrefit.transport.control import TOKEN_BYTES, ControlClient
from mxrefit.transport.factory import create_buffers
from tests.helpers.faults import record
from tests.helpers.refit_helpers import EngineProcess, engine_matches, random_weights, trainer_specs

ENGINE_TIMEOUT_S = 3.0
BUCKET = 16 << 10
REPLY_OPS = {"tables", "planned", "status", "checksum", "error", "begun", "applied", "committed", "aborted"}


class Session:
    """An engine with one committed refit, its trainer, and a second client holding the same token."""

    def __init__(self):
        self.engine = EngineProcess(mxfp8=True, timeout_s=ENGINE_TIMEOUT_S)
        self.sender = Sender(self.engine.address, self.engine.token, bucket_bytes=BUCKET, timeout_s=10)
        recorder = record(self.sender.client)
        self.weights = random_weights(trainer_specs(self.sender), 1)
        self.sender.refit(self.weights)
        self.captured = [_decoded(f) for f in recorder.frames]
        self.client = ControlClient(self.engine.address, self.engine.token)

    def status(self) -> dict:
        return self.client.request({"op": "status"}, 10, step="status")

    def ask(self, msg: dict) -> dict:
        reply = self.client.request(msg, 10, step=f"answering a malformed {msg.get('op')!r:.20}")
        assert reply["op"] in REPLY_OPS, reply
        return reply

    def leave_any_refit(self) -> None:
        """A begin the fuzz got accepted leaves the engine mid-refit: end it as a trainer would."""
        self.ask({"op": "abort", "why": "end of malformed input"})

    def assert_unchanged(self) -> None:
        status = self.status()
        assert status["version"] == self.sender.engine_status["version"] and status["state"] == "ready", status
        assert engine_matches(self.sender, self.weights) == []

    def assert_next_refit_lands(self, seed: int) -> None:
        self.weights = random_weights(trainer_specs(self.sender), seed)
        self.sender.refit(self.weights)
        assert engine_matches(self.sender, self.weights) == []

    def close(self) -> None:
        self.client.close()
        self.engine.stop(self.sender)


def _decoded(frame: bytes) -> dict:
    msg = msgpack.unpackb(frame[TOKEN_BYTES:], raw=False)  # a frame is the token, then the map
    return {k: v for k, v in msg.items() if k != "seq"}


@pytest.fixture(scope="module")
def session():
    s = Session()
    yield s
    s.close()


def _plan_msg(session: Session, **change) -> dict:
    plan = session.sender.plan_
    msg = {
        "op": "plan",
        "sources": sources_to_msg(plan.sources),
        "bucket_bytes": plan.bucket_bytes,
        "slots": plan.slots,
        "digest": plan.digest,
        "buffers": session.sender.buffers.describe(),
    }
    msg.update(change)
    return {k: v for k, v in msg.items() if v is not _DROP}


_DROP = object()
_BAD_PLANS = {
    "no sources": {"sources": _DROP},
    "no bucket_bytes": {"bucket_bytes": _DROP},
    "no slots": {"slots": _DROP},
    "no digest": {"digest": _DROP},
    "no buffers": {"buffers": _DROP},
    "sources a string": {"sources": "x"},
    "source of ints": {"sources": [[1, 2, 3]]},
    "source shape a string": {"sources": [["w", "12", "bfloat16"]]},
    "unknown dtype": {"sources": [["w", [32], "complex128"]]},
    "bucket_bytes negative": {"bucket_bytes": -1},
    "bucket_bytes a string": {"bucket_bytes": "16384"},
    "bucket_bytes a bool": {"bucket_bytes": True},
    "bucket_bytes huge": {"bucket_bytes": 2**63 - 1},
    "zero slots": {"slots": 0},
    "slots a float": {"slots": 2.0},
    "too many slots": {"slots": 2**40},
    "write_ahead 2": {"write_ahead": 2},
    "write_ahead a string": {"write_ahead": "1"},
    "digest an int": {"digest": 5},
    "other digest": {"digest": "0" * 64},
    "buffers a list": {"buffers": [1]},
    "missing segment": {"buffers": {"kind": "shm", "nbytes": 1 << 20, "names": ["psm_mxrefit_missing"]}},
}


@pytest.mark.parametrize("change", _BAD_PLANS.values(), ids=_BAD_PLANS.keys())
def test_a_malformed_plan_is_answered_and_the_adopted_plan_stays(session, change):
    reply = session.ask(_plan_msg(session, **change))
    assert reply["op"] == "error" and reply["kind"] == "plan_mismatch" and reply["problems"], reply
    session.assert_unchanged()
    session.assert_next_refit_lands(2)  # no re-plan: the engine still holds this trainer's plan and buffers


def test_buffers_smaller_than_the_bucket_are_refused_and_the_adopted_plan_stays(session):
    with create_buffers("shm", 2, 4096) as small:
        reply = session.ask(_plan_msg(session, buffers=small.describe()))
    assert reply["op"] == "error" and "the plan needs 2 of" in reply["problems"][0], reply
    session.assert_unchanged()
    session.assert_next_refit_lands(3)


_BAD_MESSAGES = {
    "begin version a string": {"op": "begin", "version": "99", "digest": None},
    "begin version None": {"op": "begin", "version": None},
    "begin version a float": {"op": "begin", "version": 99.0},
    "begin version a bool": {"op": "begin", "version": True},
    "begin version a list": {"op": "begin", "version": [99]},
    "begin without version": {"op": "begin"},
    "checksum ranges a string": {"op": "checksum", "ranges": "x"},
    "checksum ranges an int": {"op": "checksum", "ranges": 7},
    "checksum short range": {"op": "checksum", "ranges": [[1]]},
    "checksum offset a string": {"op": "checksum", "ranges": [["model.norm.weight", "0", 4]]},
    "checksum unhashable name": {"op": "checksum", "ranges": [[["model.norm.weight"], 0, 4]]},
    "checksum negative range": {"op": "checksum", "ranges": [["model.norm.weight", 8, -4]]},
    "checksum past the end": {"op": "checksum", "ranges": [["model.norm.weight", 0, 1 << 40]]},
    "ready between refits": {"op": "ready", "version": 99, "bucket": 0},
    "commit between refits": {"op": "commit", "version": 99},
    "abort between refits": {"op": "abort", "why": "x" * 100_000},
    "unknown op": {"op": "frobnicate", "x": {"y": [1, 2]}},
}


@pytest.mark.parametrize("msg", _BAD_MESSAGES.values(), ids=_BAD_MESSAGES.keys())
def test_a_malformed_message_between_refits_is_answered(session, msg):
    reply = session.ask(
        {**msg, **({"digest": session.sender.plan_.digest} if msg["op"] == "begin" and "digest" not in msg else {})}
    )
    if msg["op"] == "checksum" and isinstance(msg["ranges"], list):
        assert reply["op"] == "checksum" and reply["sha256"] == [None] * len(msg["ranges"]), reply
    elif msg["op"] == "abort":  # nothing in flight: the engine answers with its status
        assert reply["op"] == "aborted" and reply["version"] == session.sender.engine_status["version"], reply
    else:
        assert reply["op"] == "error" and reply["problems"], reply
    session.assert_unchanged()


@pytest.mark.parametrize(
    "after_bucket0,bad",
    [
        (False, {"op": "ready", "bucket": "0"}),
        (False, {"op": "ready", "bucket": 0, "version": "v"}),
        (True, {"op": "ready", "bucket": 1, "version": None}),
        (True, {"op": "commit", "version": [1]}),
        (True, {"op": "abort", "why": "y" * 1_000_000}),
    ],
    ids=["bucket-a-string", "version-a-string", "version-none", "commit-version-a-list", "abort-why-1MB"],
)
def test_a_malformed_message_mid_refit_ends_the_refit_with_a_clear_report(session, after_bucket0, bad):
    version = session.status()["version"] + 1
    begin = {
        "op": "begin",
        "version": version,
        "digest": session.sender.plan_.digest,
        "plan_id": session.sender._plan_id,
        "adoptions": session.sender._adoptions,
    }
    assert session.ask(begin)["op"] == "begun"
    if after_bucket0:
        assert session.ask({"op": "ready", "version": version, "bucket": 0}) == {"op": "applied", "bucket": 0}
    msg = {"version": version, **bad}
    reply = session.ask(msg)
    assert reply["op"] == ("aborted" if bad["op"] == "abort" else "error"), reply
    status = session.status()
    assert status["version"] == version - 1 and status["state"] == ("partial" if after_bucket0 else "ready"), status
    assert 0 < len(status["error"]) <= 1000
    session.assert_next_refit_lands(4)


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary(max_size=24),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
_ops = st.sampled_from(["hello", "plan", "begin", "ready", "commit", "abort", "status", "checksum", "applied", ""]) | st.text(
    max_size=10
).filter(lambda op: op != "shutdown")
_fields = st.sampled_from(
    ["version", "bucket", "digest", "sources", "bucket_bytes", "slots", "buffers", "ranges", "why"]
) | st.text(max_size=6).filter(lambda k: k not in ("tok", "seq", "re", "op"))
_random_msgs = st.builds(lambda op, fields: {**fields, "op": op}, _ops, st.dictionaries(_fields, _plain, max_size=5))


def _mutations(captured: list[dict]):
    """A captured real message with one field replaced, removed, nested or set to an edge integer."""

    def mutate(msg: dict, key: str, how: str, value) -> dict:
        out = dict(msg)
        if key == "op" or key not in out:
            out[key if key != "op" else "x"] = value
        elif how == "drop":
            del out[key]
        elif how == "nest":
            out[key] = [out[key]] * 3
        else:
            out[key] = value
        return out

    return st.sampled_from(captured).flatmap(
        lambda msg: st.builds(
            mutate,
            st.just(msg),
            st.sampled_from(sorted(msg)),
            st.sampled_from(["replace", "drop", "nest"]),
            _plain | st.sampled_from([0, -1, 2**63 - 1, 2**64 - 1, -(2**63), "", b"", [], {}]),
        )
    )


def test_fuzzed_messages_from_the_token_holder_never_stop_the_engine(session):
    captured = [m for m in session.captured if m["op"] != "shutdown"]
    seen: dict[str, int] = {}

    @settings(
        max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )
    @given(msg=_random_msgs | _mutations(captured))
    def check(msg: dict) -> None:
        reply = session.ask(msg)
        seen[reply["op"]] = seen.get(reply["op"], 0) + 1

    check()
    print(f"replies to fuzzed token-holder messages: {seen}")
    session.leave_any_refit()
    status = session.status()
    assert status["version"] == session.sender.engine_status["version"], status
    if status["state"] == "ready":
        assert engine_matches(session.sender, session.weights) == []
    session.sender.plan(trainer_specs(session.sender))  # a fuzzed plan may have been adopted
    session.assert_next_refit_lands(5)
