"""A bounded, seeded fuzz of both ends of the wire (issue 25): thousands of frames, minutes at most.

Engine side: a real engine process receives 2,000 frames from one seed — strangers' bytes, the
token followed by garbage, real captured frames mutated byte-wise, random maps of every request
kind, deep nesting. Every frame gets exactly one answer, the engine never dies, and after re-planning
the next refit is bit-exact.

Trainer side: a real Sender refits against an engine that answers with the real engine's replies,
one in three mutated (a field replaced, dropped or nested; bytes flipped or cut; a wrong token).
Until 1,000 replies went out, every failure is a RefitError, a PlanMismatch or a control error,
never a raw KeyError/TypeError/RecursionError; the same loop without mutations succeeds every
time (the negative control: the fuzz path itself works).
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from mxrefit.plan.build import PlanMismatch
from mxrefit.source.sender import RefitError, Sender
from mxrefit.transport.control import TOKEN_BYTES, ControlError
from tests.helpers.faults import record
from tests.helpers.hostile import FakeEngine, framed, tables_reply
from tests.helpers.refit_helpers import EngineProcess, engine_matches, random_weights, trainer_specs

SEED = 20261204
ENGINE_FRAMES = 2000
TRAINER_REPLIES = 1000
BUCKET = 16 << 10
OPS = ["hello", "plan", "begin", "ready", "commit", "abort", "status", "checksum", "applied", "tables", ""]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**63 - 1, 2**64 - 1, -(2**63), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.random() * 1e6
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(20)))
    if kind == 5:
        return rng.randbytes(rng.randrange(40))
    if kind == 6:
        return "x" * rng.choice([0, 1000, 100_000])
    if kind == 7:
        return rng.choice(["ready", "partial", "plan_mismatch", "bfloat16", "lm_head.weight"])
    if kind == 8:
        return _deep(rng.choice([5, 17, 100, 500]))  # msgpack packs at most 511 deep
    if kind in (9, 10):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["op", "version", "bucket", "x", "problems"]): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _deep(n: int):
    v: list = []
    for _ in range(n):
        v = [v]
    return v


def _bytes_mutation(rng: random.Random, frame: bytes, keep: int) -> bytes:
    """Flip, cut or insert past the first ``keep`` bytes (the token stays intact when keep = its size)."""
    at = rng.randrange(keep, max(len(frame), keep + 1))
    how = rng.randrange(3)
    if how == 0 and at < len(frame):
        return frame[:at] + bytes([frame[at] ^ (1 << rng.randrange(8))]) + frame[at + 1 :]
    if how == 1:
        return frame[:at]
    return frame[:at] + bytes([rng.randrange(256)]) + frame[at:]


def _shutdown(frame: bytes, token: bytes) -> bool:
    try:
        return msgpack.unpackb(frame[len(token) :], raw=False).get("op") == "shutdown"
    except Exception:
        return False


def _engine_frames(rng: random.Random, token: bytes, captured: list[bytes]) -> list[bytes]:
    frames = []
    while len(frames) < ENGINE_FRAMES:
        kind = rng.randrange(6)
        if kind == 0:  # a stranger: random bytes, or a real frame under a corrupted token
            f = rng.randbytes(rng.randrange(200)) if rng.random() < 0.5 else _bytes_mutation(rng, rng.choice(captured), 0)
        elif kind == 1:
            f = token + rng.randbytes(rng.randrange(200))
        elif kind in (2, 3):
            f = _bytes_mutation(rng, rng.choice(captured), TOKEN_BYTES)
        elif kind == 4:
            msg = {
                "op": rng.choice(OPS),
                **{
                    rng.choice(
                        [
                            "version",
                            "bucket",
                            "digest",
                            "sources",
                            "slots",
                            "bucket_bytes",
                            "buffers",
                            "ranges",
                            "why",
                            "sum",
                            "seq",
                        ]
                    ): _value(rng)
                    for _ in range(rng.randrange(5))
                },
            }
            f = token + msgpack.packb(msg, use_bin_type=True)
        else:
            f = token + b"\x81\xa2op" + b"\x91" * rng.choice([15, 16, 17, 1019, 5000]) + b"\xc0"
        if not _shutdown(f, token):
            frames.append(f)
    return frames


def test_a_seeded_fuzz_of_the_engine_side():
    engine = EngineProcess(mxfp8=True, timeout_s=3.0)
    sender = Sender(engine.address, engine.token, bucket_bytes=BUCKET, timeout_s=10)
    try:
        specs = trainer_specs(sender)
        recorder = record(sender.client)
        sender.refit(random_weights(specs, 1))
        captured = [f for f in recorder.frames if not _shutdown(f, engine.token)]
        recorder.frames.clear()
        frames = _engine_frames(random.Random(SEED), engine.token, captured)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.address)
        replies: dict[str, int] = {}
        t = time.monotonic()
        try:
            for i, f in enumerate(frames):
                sock.send(f)
                assert sock.poll(15_000), f"no answer to frame {i} ({f[:80]!r}...)"
                reply = sock.recv()
                body = reply[TOKEN_BYTES:] if reply.startswith(engine.token) else reply
                op = msgpack.unpackb(body, raw=False)["op"]
                replies[op] = replies.get(op, 0) + 1
                assert not sock.poll(0), f"two answers to frame {i}"
        finally:
            sock.close(linger=0)
            ctx.term()
        print(f"engine fuzz, seed {SEED}: {len(frames)} frames in {time.monotonic() - t:.1f} s, answers {replies}")
        assert sum(replies.values()) == len(frames)
        assert engine.proc.is_alive()
        sender.plan(specs)  # a fuzzed plan may have been adopted
        weights = random_weights(specs, 2)
        sender.refit(weights)
        assert engine_matches(sender, weights) == []
    finally:
        engine.stop(sender)


# ---- trainer side ----------------------------------------------------------------------------
class _RealReplies:
    """The replies a real engine gives (captured once), rebuilt per request, with mutations."""

    def __init__(self, tables: dict, rng: random.Random, mutate: float):
        self.tables, self.rng, self.mutate, self.sent = tables, rng, mutate, 0
        self.version = 0

    def real(self, msg: dict) -> dict:
        op, status = msg["op"], {"version": self.version, "state": "ready", "error": None, "rejected": 0}
        if op == "hello":
            return {**self.tables, **status}
        if op == "plan":
            return {"op": "planned", "digest": msg["digest"], "adoption": "fuzz"}
        if op == "begin":
            return {"op": "begun", "version": msg["version"]}
        if op == "ready":
            return {"op": "applied", "bucket": msg["bucket"]}
        if op == "commit":
            self.version = msg["version"]
            return {"op": "committed", **status, "version": msg["version"], "fetch_s": 0.0, "apply_s": 0.001}
        return {
            "op": {"abort": "aborted", "status": "status"}.get(op, "error"),
            **status,
            **({"kind": "protocol", "problems": ["?"]} if op not in ("abort", "status") else {}),
        }

    def __call__(self, token: bytes, msg: dict, seq: int | None) -> bytes:
        reply = self.real(msg)
        self.sent += 1
        rng = self.rng
        if rng.random() >= self.mutate:
            return framed(token, reply, seq)
        how = rng.randrange(6)
        if how == 0:
            reply[rng.choice(sorted(reply))] = _value(rng)
        elif how == 1:
            reply.pop(rng.choice(sorted(reply)))
        elif how == 2:
            key = rng.choice(sorted(reply))
            reply[key] = [reply[key]] * rng.choice([1, 3])
        elif how == 3:
            reply[rng.choice(["x", "problems", "why", "exports", "adoption"])] = _value(rng)
        if how < 4:
            return framed(token, reply, seq)
        data = framed(token, reply, seq)
        return _bytes_mutation(rng, data, TOKEN_BYTES) if how == 4 else rng.randbytes(32) + data[32:]


def _trainer_loop(replies: _RealReplies, until: int, refits: int | None = None) -> dict[str, int]:
    engine = FakeEngine(lambda msg, seq: [replies(engine_token[0], msg, seq)])
    engine_token = [engine.token]
    outcomes: dict[str, int] = {}
    sender = Sender(engine.address, engine.token, bucket_bytes=BUCKET, timeout_s=2, transport="shm")
    try:
        weights = None
        n = 0
        while (replies.sent < until) if refits is None else (n < refits):
            n += 1
            try:
                if weights is None:
                    weights = random_weights(trainer_specs(sender), 1)
                sender.refit(weights)
                outcome = "ok"
            except (RefitError, PlanMismatch, ControlError) as err:
                outcome = type(err).__name__
                if sender._tables is None:
                    weights = None
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        sender.close()
        engine.close()
    return outcomes


@pytest.fixture(scope="module")
def tables() -> dict:
    return tables_reply()


def test_the_trainer_side_fuzz_loop_refits_when_nothing_is_mutated(tables):
    outcomes = _trainer_loop(_RealReplies(tables, random.Random(SEED), mutate=0.0), 0, refits=5)
    assert outcomes == {"ok": 5}, outcomes


def test_a_seeded_fuzz_of_the_trainer_side(tables):
    replies = _RealReplies(tables, random.Random(SEED), mutate=1 / 3)
    t = time.monotonic()
    outcomes = _trainer_loop(replies, TRAINER_REPLIES)
    print(f"trainer fuzz, seed {SEED}: {replies.sent} replies in {time.monotonic() - t:.1f} s, refits ended {outcomes}")
    assert replies.sent >= TRAINER_REPLIES
    assert set(outcomes) <= {"ok", "RefitError", "PlanMismatch", "PeerTimeout", "ProtocolError", "ControlError"}, outcomes
