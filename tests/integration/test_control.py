"""The control channel over real zmq sockets, with the server in a separate process where it matters."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxrefit.transport.control import (
    ControlClient,
    ControlError,
    ControlServer,
    PeerTimeout,
    ProtocolError,
    new_token,
    private_ipc_address,
)

SPAWN = multiprocessing.get_context("spawn")
FUZZ_TOKEN = new_token()


def _serve_echo(address: str, token: bytes) -> None:
    """Child process: echo every valid message with the rejection count, until 'stop'."""
    server = ControlServer(address, token=token)
    try:
        while True:
            msg = server.recv(30, step="serving the echo test")
            if msg["op"] == "stop":
                server.send({"op": "bye", "rejected": server.rejected})
                return
            server.send({"op": "echo", "msg": msg, "rejected": server.rejected})
    finally:
        server.close()


@pytest.fixture
def echo_server():
    """An echo ControlServer in a spawned process; yields (address, token)."""
    address, token = private_ipc_address(), new_token()
    proc = SPAWN.Process(target=_serve_echo, args=(address, token), daemon=True)
    proc.start()
    yield address, token, proc
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)


def _stop(client: ControlClient, proc) -> dict:
    reply = client.request({"op": "stop"}, 30, step="stopping the echo server")
    proc.join(30)
    assert proc.exitcode == 0
    return reply


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _raw_recv(sock: zmq.Socket, timeout_s: float) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no reply within the timeout"
    return sock.recv_multipart()


def _close_raw(ctx: zmq.Context, sock: zmq.Socket) -> None:
    sock.close(linger=0)
    ctx.term()


def test_round_trip_between_processes(echo_server):
    address, token, proc = echo_server
    msg = {
        "op": "data",
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "f": 1.5,
        "s": "héllo",
        "b": b"\x00\xff" * 10,
        "nested": {"a": [None, True, False], "d": {}},
        "tup": (1, 2),
    }
    with ControlClient(address, token) as client:
        reply = client.request(msg, 30, step="waiting for the echo")
        assert reply == {"op": "echo", "msg": {**msg, "tup": [1, 2]}, "rejected": 0}
        assert _stop(client, proc) == {"op": "bye", "rejected": 0}


def test_wrong_token_client_is_rejected_and_valid_client_still_served(echo_server):
    address, token, proc = echo_server
    with ControlClient(address, new_token()) as stranger, ControlClient(address, token) as client:
        stranger.send({"op": "hello"})
        reply = stranger.recv(30, step="waiting for the rejection")
        assert reply["op"] == "rejected" and "token" in reply["why"]
        assert "tok" not in reply
        assert client.request({"op": "ping"}, 30, step="ping") == {"op": "echo", "msg": {"op": "ping"}, "rejected": 1}
        assert _stop(client, proc)["rejected"] == 1


def test_garbage_and_non_map_frames_are_rejected_without_crashing(echo_server):
    address, token, proc = echo_server
    bad_frames = [
        [b"\xc1\xc1\xc1"],
        [b""],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"tok": token})],
        [msgpack.packb({"tok": token, "op": 5})],
        [msgpack.packb({"tok": token.decode("latin-1"), "op": "x"})],
        [msgpack.packb({"tok": token, "op": "two frames"}), b"extra"],
        [msgpack.packb({1: 2, "tok": token, "op": "int key"})],
        [msgpack.packb({"tok": token, "op": "ext", "x": msgpack.ExtType(3, b"zz")})],
        # the token as the frame's prefix (the wire format), then a bad map
        [token],
        [token + b"\xc1"],
        [token + msgpack.packb([1, 2])],
        [token + msgpack.packb({"no": "op"})],
        [token + msgpack.packb({"op": 5})],
        [token + msgpack.packb({"op": "two frames"}), b"extra"],
        [token + msgpack.packb({1: 2, "op": "int key"})],
        [token + msgpack.packb({"op": "ext", "x": msgpack.ExtType(3, b"zz")})],
        [token + b"\x82\xa2op\xa1x\xa1d" + b"\x91" * 1019 + b"\x90"],  # 1,020 deep: RecursionError bait
        [token + b"\xdd" + (1 << 24).to_bytes(4, "big") + b"\x80" * 1024],  # claims 16M maps
        [token[:-1] + msgpack.packb({"op": "x"})],
    ]
    ctx, raw = _raw_dealer(address)
    try:
        for frames in bad_frames:
            raw.send_multipart(frames)
            (reply,) = _raw_recv(raw, 30)
            assert msgpack.unpackb(reply)["op"] == "rejected"
    finally:
        _close_raw(ctx, raw)
    with ControlClient(address, token) as client:
        assert client.request({"op": "ping"}, 30, step="ping")["rejected"] == len(bad_frames)
        _stop(client, proc)


def test_default_address_is_private_ipc_and_close_removes_it():
    server = ControlServer()
    path = server.address[len("ipc://") :]
    directory = os.path.dirname(path)
    try:
        assert server.address.startswith("ipc://")
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert len(server.token) == 32
    finally:
        server.close()
    assert not os.path.exists(path)
    assert not os.path.exists(directory)
    server.close()
    with pytest.raises(ControlError, match="closed"):
        server.recv(0.1, step="after close")


def test_tcp_binds_loopback_and_round_trips():
    with ControlServer(tcp=True) as server:
        assert server.address.startswith("tcp://127.0.0.1:")
        assert int(server.address.rsplit(":", 1)[1]) > 0
        with ControlClient(server.address, server.token) as client:
            client.send({"op": "hello"})
            assert server.recv(10, step="hello") == {"op": "hello"}
            server.send({"op": "welcome", "n": 1})
            assert client.recv(10, step="welcome") == {"op": "welcome", "n": 1}


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://10.1.2.3:5555", "tcp://eth0:5555", "tcp://example.com:80"]
)
def test_non_loopback_tcp_needs_allow_remote(address):
    with pytest.raises(ValueError, match="allow_remote"):
        ControlServer(address)


def test_allow_remote_and_loopback_spellings_bind():
    with ControlServer("tcp://0.0.0.0:*", allow_remote=True) as server:
        assert server.address.startswith("tcp://0.0.0.0:")
    with ControlServer("tcp://localhost:*") as server:
        assert server.address.startswith("tcp://")
    with ControlServer("tcp://127.0.0.2:*") as server:
        assert server.address.startswith("tcp://127.0.0.2:")


@pytest.mark.parametrize("address", ["inproc://x", "ipc://@abstract", "udp://127.0.0.1:1"])
def test_bad_addresses_are_refused(address):
    with pytest.raises(ValueError):
        ControlServer(address)


def test_tcp_flag_conflicts_with_ipc_address():
    with pytest.raises(ValueError, match="tcp=True"):
        ControlServer("ipc:///tmp/x.sock", tcp=True)


def test_client_peer_timeout_names_engine_and_step():
    address = private_ipc_address()
    try:
        with ControlClient(address, new_token()) as client:
            start = time.monotonic()
            with pytest.raises(PeerTimeout) as err:
                client.recv(0.5, step="waiting for the engine's hello")
            elapsed = time.monotonic() - start
    finally:
        os.rmdir(os.path.dirname(address[len("ipc://") :]))
    assert 0.45 <= elapsed < 0.5 + 2
    expected = f"no message from the engine at {address} within 0.5 s while waiting for the engine's hello"
    assert str(err.value) == expected


def test_server_timeout_is_not_extended_by_strangers():
    with ControlServer() as server:
        ctx, raw = _raw_dealer(server.address)
        try:
            for _ in range(3):
                raw.send(b"garbage")
            start = time.monotonic()
            with pytest.raises(PeerTimeout, match=r"the trainer at ipc://.* within 1 s while waiting for step 3"):
                server.recv(1.0, step="waiting for step 3")
            elapsed = time.monotonic() - start
            assert 0.95 <= elapsed < 1.0 + 2
            assert server.rejected == 3
        finally:
            _close_raw(ctx, raw)


def test_recv_without_timeout_returns_waiting_message():
    with ControlServer() as server, ControlClient(server.address, server.token) as client:
        client.send({"op": "queued"})
        assert server.recv(None, step="forever") == {"op": "queued"}


def test_oversized_messages_are_refused_on_both_sides():
    with ControlServer(max_message_bytes=4096) as server:
        with ControlClient(server.address, server.token, max_message_bytes=1024) as client:
            with pytest.raises(ValueError, match=r"op 'big' is \d+ bytes"):
                client.send({"op": "big", "pad": b"x" * 2000})
            ctx, raw = _raw_dealer(server.address)
            try:
                raw.send(server.token + msgpack.packb({"op": "huge", "pad": b"x" * 10000}))
                time.sleep(0.2)
                client.send({"op": "small"})
                assert server.recv(10, step="small") == {"op": "small"}
                with pytest.raises(PeerTimeout):
                    server.recv(0.3, step="the huge one must never arrive")
            finally:
                _close_raw(ctx, raw)
            with pytest.raises(ValueError, match="op 'reply'"):
                server.send({"op": "reply", "pad": b"x" * 5000})


def _stalling_server(server: ControlServer, stall_s: float) -> None:
    """Thread: answers 'first' only after ``stall_s``, then answers every message at once until 'stop'."""
    msg = server.recv(10, step="first")
    time.sleep(stall_s)
    server.send({"op": "answer", "to": msg["op"]})
    while True:
        msg = server.recv(10, step="next")
        server.send({"op": "answer", "to": msg["op"]})
        if msg["op"] == "stop":
            return


def test_a_late_reply_is_not_taken_for_the_answer_to_a_later_request():
    """A peer that answers after the requester gave up must not shift every later answer by one."""
    with ControlServer() as server, ControlClient(server.address, server.token) as client:
        thread = threading.Thread(target=_stalling_server, args=(server, 0.5))
        thread.start()
        try:
            with pytest.raises(PeerTimeout):
                client.request({"op": "first"}, 0.2, step="the engine is stalled")
            time.sleep(0.5)
            assert client.request({"op": "second"}, 10, step="second") == {"op": "answer", "to": "second"}
            client.send({"op": "pipelined-1"})
            client.send({"op": "pipelined-2"})
            assert client.recv(10, step="p1") == {"op": "answer", "to": "pipelined-1"}
            assert client.recv(10, step="p2") == {"op": "answer", "to": "pipelined-2"}
            assert client.request({"op": "stop"}, 10, step="stop") == {"op": "answer", "to": "stop"}
        finally:
            thread.join(10)


def test_abandoned_answers_are_dropped():
    """A fire-and-forget message's answer must not be read as the answer to the next one."""
    with ControlServer() as server, ControlClient(server.address, server.token) as client:
        client.send({"op": "fire-and-forget"})
        client.abandon()
        assert server.recv(10, step="fire-and-forget") == {"op": "fire-and-forget"}
        server.send({"op": "answer nobody waits for"})
        client.send({"op": "next"})
        assert server.recv(10, step="next") == {"op": "next"}
        server.send({"op": "answer to next"})
        assert client.recv(10, step="next") == {"op": "answer to next"}


def test_reserved_and_malformed_message_numbers_are_refused():
    with ControlServer() as server, ControlClient(server.address, server.token) as client:
        for key in ("seq", "re"):
            with pytest.raises(ValueError, match="reserved for message numbers"):
                client.send({"op": "x", key: 1})
        ctx, raw = _raw_dealer(server.address)
        try:
            for seq in (-1, 2**63, "1", True, 1.5):
                raw.send(server.token + msgpack.packb({"op": "numbered", "seq": seq}))
            raw.send(server.token + msgpack.packb({"op": "valid", "seq": 7}))
            assert server.recv(10, step="valid") == {"op": "valid"}
            assert server.rejected == 5
        finally:
            _close_raw(ctx, raw)


def test_send_refuses_bad_messages():
    with ControlServer() as server, ControlClient(server.address, server.token) as client:
        with pytest.raises(ControlError, match="no valid message"):
            server.send({"op": "nobody asked"})
        with pytest.raises(ValueError, match="'op'"):
            client.send({"no": "op"})
        with pytest.raises(TypeError, match="'obj'"):
            client.send({"op": "obj", "v": object()})


def test_client_checks_the_servers_token():
    address = private_ipc_address()
    token = new_token()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    try:
        with ControlClient(address, token) as client:
            client.send({"op": "hi"})
            identity, _frame = _raw_recv(router, 10)

            def reply(obj) -> None:
                router.send_multipart([identity, obj if isinstance(obj, bytes) else msgpack.packb(obj)])

            reply(new_token() + msgpack.packb({"op": "ok"}))
            with pytest.raises(ProtocolError, match="token"):
                client.recv(10, step="impostor")
            reply(b"\xc1 not msgpack")
            with pytest.raises(ProtocolError, match="bad reply"):
                client.recv(10, step="garbage")
            reply([1, 2])
            with pytest.raises(ProtocolError):
                client.recv(10, step="a list")
            reply({"op": "ok"})
            with pytest.raises(ProtocolError, match="token"):
                client.recv(10, step="tokenless non-rejection")
            reply({"op": "rejected", "why": "you are a stranger"})
            assert client.recv(10, step="rejection") == {"op": "rejected", "why": "you are a stranger"}
            reply(token + msgpack.packb({"op": "error", "why": "boom"}))
            assert client.recv(10, step="error") == {"op": "error", "why": "boom"}
    finally:
        router.close(linger=0)
        ctx.term()
        shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=24),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=10,
)
_maps = st.builds(
    lambda extra, head: {**extra, **head},
    st.dictionaries(st.text(max_size=6), _plain, max_size=3),
    st.fixed_dictionaries({}, optional={"op": st.text(max_size=8) | _plain, "seq": _plain}),
)
_prefixes = st.sampled_from([FUZZ_TOKEN, FUZZ_TOKEN[:-1], b"", b"\x00" * 32, FUZZ_TOKEN + b"x"]) | st.binary(max_size=40)
_framed = st.builds(lambda prefix, m: prefix + msgpack.packb(m, use_bin_type=True), _prefixes, _maps)
_frames = st.one_of(
    st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    _framed.map(lambda f: [f]),
    st.lists(_framed, min_size=2, max_size=3),
)


def _expected(frames: list[bytes]) -> dict | None:
    """The message a correct server returns for these frames, or None if it must reject them."""
    if len(frames) != 1 or not frames[0].startswith(FUZZ_TOKEN):
        return None
    try:
        obj = msgpack.unpackb(frames[0][len(FUZZ_TOKEN) :], raw=False, max_ext_len=0)
    except Exception:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        return None
    seq = obj.get("seq")
    if "seq" in obj and seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**63):
        return None
    return {k: v for k, v in obj.items() if k != "seq"}


def test_fuzzed_frames_never_crash_the_server_nor_pass_as_valid():
    server = ControlServer(token=FUZZ_TOKEN)
    ctx, raw = _raw_dealer(server.address)
    counter = iter(range(10**9))

    @settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(frames=_frames)
    def check(frames: list[bytes]) -> None:
        sentinel = {"op": "sentinel", "n": next(counter)}
        raw.send_multipart(frames)
        raw.send(FUZZ_TOKEN + msgpack.packb(sentinel))
        before = server.rejected
        expected = _expected(frames)
        first = server.recv(10, step="fuzzing")
        if expected is None:
            assert first == sentinel
            assert server.rejected == before + 1
            (reply,) = _raw_recv(raw, 10)
            assert msgpack.unpackb(reply)["op"] == "rejected"
        else:
            assert first == expected
            assert server.recv(10, step="fuzzing") == sentinel
            assert server.rejected == before

    try:
        check()
    finally:
        _close_raw(ctx, raw)
        server.close()
