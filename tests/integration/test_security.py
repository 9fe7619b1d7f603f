"""Nobody without the session token can change an engine's weights; nothing on the wire can carry code.

The engine runs in its own process behind a real Receiver. Intruders are real local clients:
another process with no token, a wrong token, or frames captured from another session and
replayed; a stranger fuzzes the socket with hypothesis. Each must leave the engine's bytes,
version and state as they were, be counted in ``rejected``, and leave the trainer served.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mxrefit
from mxrefit.source.sender import RefitError, Sender
from mxrefit.transport.control import DEFAULT_MAX_MESSAGE_BYTES, TOKEN_BYTES, new_token
from tests.helpers.faults import record
from tests.helpers.refit_helpers import CTX, EngineProcess, engine_matches, random_weights, specs_to_plain, trainer_specs

BUCKET = 16 << 10


class Session:
    """An engine with one committed refit and the frames its trainer sent for it."""

    def __init__(self, seed: int):
        self.engine = EngineProcess(mxfp8=True, timeout_s=3.0)
        self.sender = Sender(self.engine.address, self.engine.token, bucket_bytes=BUCKET, timeout_s=10)
        self.specs = trainer_specs(self.sender)
        recorder = record(self.sender.client)
        self.weights = random_weights(self.specs, seed)
        self.sender.refit(self.weights)
        self.frames = list(recorder.frames)
        recorder.frames.clear()

    def status(self) -> dict:
        return self.sender.client.request({"op": "status"}, 10, step="status")

    def assert_untouched(self, rejected_before: int, rejected_now: int) -> None:
        status = self.status()
        assert status["rejected"] == rejected_before + rejected_now, status
        assert status["version"] == self.sender.engine_status["version"] and status["state"] == "ready", status
        assert status["error"] is None
        assert engine_matches(self.sender, self.weights) == []

    def close(self) -> None:
        self.engine.stop(self.sender)


@pytest.fixture(scope="module")
def sessions():
    ours, theirs = Session(1), Session(2)
    yield ours, theirs
    ours.close()
    theirs.close()


def _raw_socket(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _send_and_count_rejections(address: str, frames: list[bytes]) -> int:
    """Send each frame as one message; every one must be answered 'rejected'. Returns how many were."""
    ctx, sock = _raw_socket(address)
    rejected = 0
    try:
        for frame in frames:
            sock.send(frame)
            assert sock.poll(10_000), "no answer to a foreign frame"
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["op"] == "rejected" and "tok" not in reply, reply
            rejected += 1
    finally:
        sock.close(linger=0)
        ctx.term()
    return rejected


def intruder(address: str, plain_specs: list, frames: list[bytes], conn) -> None:
    """A second local process: a full refit with a wrong token, tokenless frames, then replayed foreign frames."""
    from tests.helpers.refit_helpers import random_weights, specs_from_plain

    result = {}
    intruding = Sender(address, new_token(), bucket_bytes=BUCKET, timeout_s=5)
    try:
        intruding.refit(random_weights(specs_from_plain(plain_specs), 99))
        result["wrong_token"] = "refit succeeded"
    except RefitError as err:
        result["wrong_token"] = str(err)
    finally:
        intruding.close()
    tokenless = [
        msgpack.packb({"op": op, "version": 99, "bucket": 0}) for op in ("hello", "begin", "ready", "commit", "shutdown")
    ]
    result["tokenless"] = _send_and_count_rejections(address, tokenless)
    result["replayed"] = _send_and_count_rejections(address, frames)
    conn.send(result)


def test_a_second_local_client_without_the_token_cannot_change_weights(sessions):
    ours, theirs = sessions
    before = ours.status()["rejected"]
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=intruder, args=(ours.engine.address, specs_to_plain(ours.specs), theirs.frames, child))
    proc.start()
    assert parent.poll(120), "the intruder process did not report"
    result = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert "refused 'hello': missing or wrong session token" in result["wrong_token"], result
    assert result["tokenless"] == 5
    assert result["replayed"] == len(theirs.frames) == 8  # their plan, begin, 5 ready, commit
    # the wrong-token Sender's hello (and the abort it sends first) were rejected too
    ours.assert_untouched(before, 2 + result["tokenless"] + result["replayed"])
    ours.weights = random_weights(ours.specs, 3)
    ours.sender.refit(ours.weights)
    assert engine_matches(ours.sender, ours.weights) == []


def test_replaying_this_sessions_own_frames_writes_nothing(sessions):
    """A captured refit replayed with the right token: its begin is a stale version, so no bucket is applied."""
    ours, _ = sessions
    recorder = record(ours.sender.client)
    ours.weights = random_weights(ours.specs, 4)
    ours.sender.refit(ours.weights)
    captured = list(recorder.frames)
    ours.weights = random_weights(ours.specs, 5)
    ours.sender.refit(ours.weights)
    before = ours.status()["rejected"]
    ctx, sock = _raw_socket(ours.engine.address)
    try:
        replies = []
        for frame in captured:
            sock.send(frame)
            assert sock.poll(10_000)
            replies.append(msgpack.unpackb(sock.recv()[TOKEN_BYTES:], raw=False))  # answered with the token first
    finally:
        sock.close(linger=0)
        ctx.term()
    ops = [r["op"] for r in replies]
    assert "begun" not in ops and "applied" not in ops and "committed" not in ops, replies
    begin = next(r for r, f in zip(replies, captured) if msgpack.unpackb(f[TOKEN_BYTES:])["op"] == "begin")
    assert "stale or duplicate version" in begin["problems"][0]
    ours.assert_untouched(before, 0)


_token_free = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary(max_size=40),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


def _mutate(frame: bytes, how: str, at: int, byte: int) -> bytes:
    at %= max(len(frame), 1)
    if how == "flip":
        return frame[:at] + bytes([frame[at] ^ (1 << (byte % 8))]) + frame[at + 1 :]
    if how == "truncate":
        return frame[:at]
    if how == "insert":
        return frame[:at] + bytes([byte]) + frame[at:]
    return frame + frame  # two maps back to back


@st.composite
def _stranger_frames(draw, foreign: list[bytes], token: bytes) -> bytes:
    kind = draw(st.sampled_from(["bytes", "value", "map", "foreign", "mutated", "ext", "deep", "huge"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "value":
        return msgpack.packb(draw(_token_free))
    if kind == "map":  # a message a client would send, under a wrong, short, absent or non-bytes token
        tok = draw(st.sampled_from([None, b"", token[:-1], token + b"x", bytes(32), token.hex()]) | st.binary(max_size=40))
        msg = {"op": draw(st.sampled_from(["hello", "plan", "begin", "ready", "commit", "shutdown"])), "version": 9}
        return msgpack.packb(msg if tok is None else {**msg, "tok": tok})
    if kind == "foreign":
        return draw(st.sampled_from(foreign))
    if kind == "mutated":
        return _mutate(
            draw(st.sampled_from(foreign)),
            draw(st.sampled_from(["flip", "truncate", "insert", "double"])),
            draw(st.integers(0, 1 << 20)),
            draw(st.integers(0, 255)),
        )
    if kind == "ext":  # under the old token-in-the-map format, and as the token's frame would carry it
        ext = {"op": "hello", "x": msgpack.ExtType(draw(st.integers(0, 127)), b"\x00" * 8)}
        return draw(st.sampled_from([msgpack.packb({"tok": token, **ext}), token + msgpack.packb(ext)]))
    if kind == "deep":
        return b"\x91" * draw(st.integers(1000, 200_000)) + b"\xc0"
    return draw(st.sampled_from([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff" + b"ab"]))


def _valid_for(frame: bytes, token: bytes) -> bool:
    """Would the server accept this frame (our token first, then a map with a str op)? Such frames are not a stranger's."""
    if not frame.startswith(token):
        return False
    try:
        obj = msgpack.unpackb(frame[len(token) :], raw=False, strict_map_key=True, max_ext_len=0)
    except Exception:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("op"), str)


def test_a_fuzzing_stranger_is_rejected_frame_by_frame_and_changes_nothing(sessions):
    ours, theirs = sessions
    before = ours.status()["rejected"]
    ctx, sock = _raw_socket(ours.engine.address)
    sent = 0

    @settings(
        max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )
    @given(frame=_stranger_frames(theirs.frames, ours.engine.token))
    def check(frame: bytes) -> None:
        nonlocal sent
        assume(not _valid_for(frame, ours.engine.token))
        sock.send(frame)
        assert sock.poll(10_000), "no answer to a foreign frame"
        assert msgpack.unpackb(sock.recv(), raw=False)["op"] == "rejected"
        sent += 1

    try:
        check()
    finally:
        sock.close(linger=0)
        ctx.term()
    ours.assert_untouched(before, sent)


def test_an_oversized_frame_never_reaches_the_engine(sessions):
    """libzmq drops the connection at the size bound (256 MiB), before msgpack or the token check see a byte."""
    ours, _ = sessions
    before = ours.status()["rejected"]
    ctx, sock = _raw_socket(ours.engine.address)
    try:
        sock.send(ours.engine.token + msgpack.packb({"op": "hello", "pad": b"\x00" * DEFAULT_MAX_MESSAGE_BYTES}), copy=False)
        assert not sock.poll(2_000)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert ours.engine.proc.is_alive()
    ours.assert_untouched(before, 0)


def test_the_engines_socket_is_private_and_tokens_are_per_session(sessions):
    ours, theirs = sessions
    for session in (ours, theirs):
        path = session.engine.address.removeprefix("ipc://")
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert len(session.engine.token) == 32
    assert ours.engine.token != theirs.engine.token
    assert os.path.dirname(ours.engine.address) != os.path.dirname(theirs.engine.address)


# ---- no pickle on the wire --------------------------------------------------------------------

_PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
_PICKLING_CALLS = {("torch", "save"), ("torch", "load"), ("numpy", "load"), ("np", "load")}
_PICKLING_METHODS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}
_PICKLING_KEYWORDS = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook", "allow_pickle"}


def pickling_uses(source: str) -> list[str]:
    """Every place in ``source`` that could put code on the wire: pickle-family imports and calls,
    torch.save/load, pyzmq's pickling helpers, msgpack hooks that rebuild objects.

    Not flagged: ``multiprocessing`` pipes, which the benchmark harness uses to hand an engine
    process's address and token to the process that started it (never the refit channel).
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLING_MODULES:
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else None
                if (owner, func.attr) in _PICKLING_CALLS or func.attr in _PICKLING_METHODS or owner in _PICKLING_MODULES:
                    found.append(f"line {node.lineno}: {owner or '...'}.{func.attr}(...)")
            found += [f"line {node.lineno}: {k.arg}=" for k in node.keywords if k.arg in _PICKLING_KEYWORDS]
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from pickle import loads",
        "import dill.settings",
        "torch.save(t, f)",
        "x = torch.load(f)",
        "sock.send_pyobj(x)",
        "sock.recv_pyobj()",
        "msgpack.unpackb(b, ext_hook=h)",
        "msgpack.unpackb(b, object_hook=h)",
        "np.load(f, allow_pickle=True)",
        "pickle.loads(b)",
    ],
)
def test_the_pickle_check_catches_each_way_in(snippet):
    assert pickling_uses(snippet), snippet


def test_no_module_of_mxrefit_can_pickle():
    root = Path(mxrefit.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 20
    found = {str(p.relative_to(root)): pickling_uses(p.read_text()) for p in sources}
    assert {p: uses for p, uses in found.items() if uses} == {}
