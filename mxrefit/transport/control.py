"""Control channel between trainer and engine: ZeroMQ carrying msgpack maps, each checked against a token.

Why this shape: the refit control traffic is a handful of small messages per step, so it must be
boring and safe rather than fast. msgpack carries only plain data (never code, unlike pickle), the
default endpoint is a Unix socket in a private 0700 directory, and every frame starts with a 32-byte
session token that is checked before anything is decoded, so a stranger that reaches the socket can
neither run anything, nor make the engine decode its bytes, nor be mistaken for the peer. Malformed
or foreign frames are dropped and answered with ``{"op": "rejected"}``; they never raise out of the
server. Framing, limits and message kinds: ``mxrefit.transport.protocol``.

Wire format: one zmq message = one frame = the token, then a msgpack map with ``"op"`` (str).
Only dict/list/str/bytes/int/float/bool/None cross; tuples arrive as lists. The client numbers its
messages (``"seq"``) and the server's replies name the message they answer (``"re"``), so a reply
that arrives after its request was given up (a peer that stalled past a timeout) is dropped
instead of being taken for the answer to a later request. Deadlines hold while frames arrive: a
flood of foreign frames or late replies never extends a wait.

Routing ids: libzmq numbers anonymous peers from ``rand()``, which nothing seeds, so every engine
would start at the same id and a stranger connecting with those ids first makes libzmq abort the
process (an id collision is an assertion). The server seeds ``rand()`` from ``secrets`` before it
makes its ROUTER, so the next anonymous id is one of 2**32 values a peer cannot see. Clients
choose a random 16-byte id (never starting with a zero byte, libzmq's reserved prefix).

Connections: a ROUTER never closes a peer, so connections that send no authenticated message
are dropped by the server itself after ``stranger_idle_s`` (and the oldest at once beyond
``max_strangers``): idle strangers cannot hold the engine's file descriptors.

Threading: zmq sockets are not thread-safe. Use each ControlServer / ControlClient from one thread.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import math
import os
import secrets
import signal
import socket
import stat
import tempfile
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from mxrefit.errors import MxrefitError
from mxrefit.transport import protocol
from mxrefit.transport.protocol import Malformed, Op

log = logging.getLogger("mxrefit.control")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
TOKEN_BYTES = 32
_SOCKET_NAME = "control.sock"
_MAX_UNIX_PATH = 107
_MAX_WHY_CHARS = 200
_ROUTING_ID_BYTES = 16
_DIR_PREFIX = "mxrefit-"
_STALE_AFTER_S = 60.0  # a directory younger than this may belong to a server that is about to bind
_STRANGER_IDLE_S = 10.0  # a connection that sent no authenticated message in this long is dropped
_MAX_STRANGERS = 64  # ... and beyond this many such connections, the oldest are dropped at once
_LOG_EVERY_S = 1.0  # rejections are counted each, logged at most this often (a flood must not flood the log)


class ControlError(MxrefitError, RuntimeError):
    """Base class for control channel failures."""


class PeerTimeout(ControlError):
    """The peer sent nothing usable in time; the message names the peer's address and the step."""


class ProtocolError(ControlError):
    """Our own peer sent something malformed (bad frame, wrong token)."""


class _Invalid(Exception):
    """Internal: a frame that must be dropped, with the reason."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why[:_MAX_WHY_CHARS]


def new_token() -> bytes:
    """A fresh random session token; share it with the peer out of band (e.g. via the launcher)."""
    return secrets.token_bytes(TOKEN_BYTES)


def private_ipc_address() -> str:
    """An ``ipc://`` address inside a new directory only this user can enter (mode 0700).

    Directories left by servers of this user that were killed (no one listens on their socket)
    are removed first.
    """
    remove_stale_dirs()
    directory = tempfile.mkdtemp(prefix=_DIR_PREFIX)
    os.chmod(directory, 0o700)
    path = os.path.join(directory, _SOCKET_NAME)
    if len(path.encode()) > _MAX_UNIX_PATH:
        os.rmdir(directory)
        raise ValueError(f"Unix socket path {path!r} is longer than {_MAX_UNIX_PATH} bytes; set TMPDIR to a shorter directory")
    return f"ipc://{path}"


def remove_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's ``mxrefit-*`` socket directories whose server is gone; returns them.

    Gone: the socket refuses connections (nobody listens), or there is no socket and the directory
    is older than a server takes to bind. A SIGKILLed engine leaves such a directory behind.
    """
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        directory = os.path.join(parent, name)
        try:  # another process's sweep may remove the directory at any point of this: skip it then
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not _is_dead(directory, st.st_mtime):
                continue
        except OSError:
            continue
        if _remove_private_dir(directory):
            removed.append(directory)
    return removed


def _is_dead(directory: str, mtime: float) -> bool:
    path = os.path.join(directory, _SOCKET_NAME)
    if not os.path.exists(path):
        return time.time() - mtime > _STALE_AFTER_S and not os.listdir(directory)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


_LIVE_DIRS: set[str] = set()
_previous_sigterm: Any = None


def _register_dir(directory: str) -> None:
    """Remember a server's directory, so that SIGTERM (which skips ``close``) still removes it."""
    global _previous_sigterm
    _LIVE_DIRS.add(directory)
    if _previous_sigterm is not None or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current in (signal.SIG_IGN, None):
        return
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Remove the live servers' directories, then do what SIGTERM did before (by default: die of it)."""
    for directory in list(_LIVE_DIRS):
        _remove_private_dir(directory)
    _LIVE_DIRS.clear()
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class _Deadline:
    """Turns an optional timeout in seconds into poll() budgets; None means wait forever."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._end = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)

    def remaining_ms(self) -> int | None:
        if self._end is None:
            return None
        return max(0, math.ceil((self._end - time.monotonic()) * 1000))

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end


def _encode(msg: dict[str, Any], token: bytes, limit: int, number: tuple[str, int] | None = None) -> bytes:
    """Frame ``msg`` with the token (and ``number``: ``("seq", n)`` or ``("re", n)``); refuse messages the peer would drop."""
    if not isinstance(msg, dict):
        raise TypeError(f"a control message must be a dict, not {type(msg).__name__}")
    op = msg.get(protocol.OP)
    if not isinstance(op, str):
        raise ValueError(f"a control message needs a str 'op', got {op!r}")
    if protocol.SEQ in msg or protocol.RE in msg:
        raise ValueError(f"'{protocol.SEQ}' and '{protocol.RE}' are reserved for message numbers (op {op!r})")
    extra = {} if number is None else {number[0]: number[1]}
    try:
        data = protocol.frame(token, {**msg, **extra})
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(f"op {op!r} carries a value msgpack cannot encode as plain data: {err}") from err
    if len(data) > limit:
        raise ValueError(f"op {op!r} is {len(data)} bytes encoded, over the {limit}-byte message limit")
    return data


def _authenticated(data: bytes, token: bytes, number_key: str) -> tuple[dict[str, Any], int | None]:
    """The message in ``data`` and its number, or _Invalid: the token is checked before anything is decoded."""
    body = protocol.authenticated_body(data, token)
    if body is None:
        raise _Invalid("missing or wrong session token")
    try:
        msg = protocol.decode(body)
        return msg, protocol.number(msg, number_key)
    except Malformed as bad:
        raise _Invalid(bad.why) from None


def _poll_frames(sock: zmq.Socket, poller: zmq.Poller, deadline: _Deadline, peer: str, step: str) -> list[bytes]:
    """Wait for one multipart message, or raise PeerTimeout naming the peer and the step."""
    while True:
        if poller.poll(deadline.remaining_ms()):
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
        _check_deadline(deadline, peer, step)


def _check_deadline(deadline: _Deadline, peer: str, step: str) -> None:
    """PeerTimeout once the deadline passed; callers that skip unwanted frames call it per frame,
    so a flood of them never extends a wait."""
    if deadline.expired():
        raise PeerTimeout(f"no message from {peer} within {deadline.timeout_s:g} s while {step}")


def _tcp_host(address: str) -> str:
    """The host part of ``tcp://host:port`` (brackets stripped from IPv6)."""
    rest = address[len("tcp://") :]
    host, sep, _port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"tcp address {address!r} must look like tcp://host:port")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_bind_address(address: str, allow_remote: bool) -> None:
    """Only ipc and loopback tcp unless the caller opts in: the token travels in clear over tcp."""
    if address.startswith("ipc://"):
        if address.startswith("ipc://@"):
            raise ValueError(f"{address!r}: abstract Unix sockets have no file permissions; use a path")
        return
    if not address.startswith("tcp://"):
        raise ValueError(f"control address {address!r} must start with ipc:// or tcp://")
    host = _tcp_host(address)
    if not _is_loopback(host) and not allow_remote:
        raise ValueError(
            f"{address!r} is not a loopback address (127.x, ::1, localhost); pass allow_remote=True to bind "
            "it, knowing the token and all control traffic then cross the network unencrypted"
        )


def _checked_limit(max_message_bytes: int) -> int:
    if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
    return max_message_bytes


def _new_socket(kind: int, address: str, max_message_bytes: int) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    return ctx, sock


def _ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class _Strangers:
    """The server's connections that have not sent one authenticated message, by fd; idle ones are dropped.

    Why: a ROUTER cannot close a peer, and every connection holds an fd for as long as the peer
    keeps it open, so a stranger opening enough idle connections exhausts the engine's fds (and
    libzmq then spins on accept). The socket monitor names each accepted connection's fd and every
    frame names its source (``ZMQ_SRCFD``), so the connections that never authenticated are known;
    ``shutdown`` (not close: libzmq owns the fd) makes libzmq drop one. A trainer whose connection
    was dropped before its first message reconnects by itself (libzmq reconnects DEALERs).
    """

    def __init__(self, sock: zmq.Socket, idle_s: float, most: int) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.idle_s, self.most = idle_s, most
        self.since: dict[int, float] = {}
        self.dropped = 0

    def read_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.since[fd] = time.monotonic()
            else:
                self.since.pop(fd, None)

    def trusted(self, frame: zmq.Frame) -> None:
        """The connection ``frame`` came on authenticated: it is never dropped."""
        try:
            self.since.pop(frame.get(zmq.SRCFD), None)
        except zmq.ZMQError:
            pass

    def sweep(self) -> None:
        """Drop the connections idle past ``idle_s`` and the oldest beyond ``most``."""
        self.read_events()
        now = time.monotonic()
        oldest = sorted(self.since, key=self.since.__getitem__)
        drop = set(oldest[: max(0, len(oldest) - self.most)]) | {fd for fd in oldest if now - self.since[fd] > self.idle_s}
        for fd in drop:
            self.since.pop(fd)
            try:
                with socket.socket(fileno=os.dup(fd)) as conn:
                    conn.shutdown(socket.SHUT_RDWR)
                self.dropped += 1
            except OSError:
                pass

    def wake_ms(self) -> int | None:
        """How soon the next idle connection is due (None: none is tracked)."""
        if not self.since:
            return None
        return max(0, math.ceil((min(self.since.values()) + self.idle_s - time.monotonic()) * 1000)) + 10

    def close(self, sock: zmq.Socket) -> None:
        if not sock.closed:
            sock.disable_monitor()
        self.monitor.close(linger=0)


class ControlServer:
    """Engine side: a ROUTER socket that answers the one trainer holding the token.

    Use from a single thread. ``rejected`` counts dropped frames (strangers, garbage). Connections
    that send no authenticated message are dropped after ``stranger_idle_s``, and at once beyond
    ``max_strangers`` of them (``_Strangers``).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: bytes | None = None,
        tcp: bool = False,
        allow_remote: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stranger_idle_s: float = _STRANGER_IDLE_S,
        max_strangers: int = _MAX_STRANGERS,
    ) -> None:
        self.token: bytes = new_token() if token is None else _checked_token(token)
        self.max_message_bytes = _checked_limit(max_message_bytes)
        self.rejected: int = 0
        self._logged_at = -_LOG_EVERY_S
        self._unlogged = 0
        self._peer_identity: bytes | None = None
        self._reply_to: int | None = None
        self._private_dir: str | None = None
        self._strangers: _Strangers | None = None
        bind_to = self._choose_address(address, tcp, allow_remote)
        _seed_routing_ids()
        self._ctx, self._sock = _new_socket(zmq.ROUTER, bind_to, max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(bind_to)
            self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._restrict_socket_file()
            self._strangers = _Strangers(self._sock, stranger_idle_s, max_strangers)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.monitor, zmq.POLLIN)

    @property
    def _watch(self) -> _Strangers:
        """The stranger watch; ``__init__`` sets it or closes the server and raises."""
        assert self._strangers is not None
        return self._strangers

    @property
    def dropped_connections(self) -> int:
        """Connections dropped for never authenticating (idle, or too many)."""
        return self._watch.dropped

    def _choose_address(self, address: str | None, tcp: bool, allow_remote: bool) -> str:
        if address is None:
            if tcp:
                return "tcp://127.0.0.1:*"
            chosen = private_ipc_address()
            self._private_dir = os.path.dirname(chosen[len("ipc://") :])
            _register_dir(self._private_dir)
            return chosen
        if tcp and not address.startswith("tcp://"):
            raise ValueError(f"tcp=True conflicts with the non-tcp address {address!r}")
        _check_bind_address(address, allow_remote)
        return address

    def _restrict_socket_file(self) -> None:
        path = _ipc_path(self.address)
        if path is not None:
            os.chmod(path, 0o600)

    @property
    def _peer(self) -> str:
        return f"the trainer at {self.address}"

    def recv(self, timeout_s: float | None, *, step: str) -> dict[str, Any]:
        """Next valid message (token removed); invalid frames are rejected while the same deadline runs."""
        self._require_open()
        deadline = _Deadline(timeout_s)
        while True:
            self._watch.sweep()
            waits = [w for w in (deadline.remaining_ms(), self._watch.wake_ms()) if w is not None]
            ready = dict(self._poller.poll(min(waits) if waits else None))
            if self._sock in ready:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    frames = None
                if frames is not None:
                    identity = frames[0].bytes
                    try:
                        if len(frames) != 2:
                            raise _Invalid(f"expected one frame per message, got {len(frames) - 1}")
                        msg, seq = _authenticated(frames[1].bytes, self.token, protocol.SEQ)
                    except _Invalid as bad:
                        self._reject(identity, bad.why)
                    else:
                        self._watch.trusted(frames[1])
                        self._peer_identity, self._reply_to = identity, seq
                        return msg
            _check_deadline(deadline, self._peer, step)

    def _reject(self, identity: bytes, why: str) -> None:
        """Count, log (rate-limited) and answer a dropped frame; the answer carries no token and may be lost."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            more = f" (and {self._unlogged} more since the last one logged)" if self._unlogged else ""
            log.warning("rejected a control frame from connection %s on %s: %s%s", identity.hex()[:16], self.address, why, more)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        try:
            self._sock.send_multipart([identity, protocol.encode({protocol.OP: Op.REJECTED, "why": why})], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def send(self, msg: dict[str, Any]) -> None:
        """Answer the last valid message, on its connection (the authenticated trainer)."""
        self._require_open()
        if self._peer_identity is None:
            raise ControlError(f"nothing to reply to on {self.address}: no valid message received yet")
        number = None if self._reply_to is None else (protocol.RE, self._reply_to)
        frame = _encode(msg, self.token, self.max_message_bytes, number)
        try:
            self._sock.send_multipart([self._peer_identity, frame])
        except zmq.ZMQError as err:
            raise ControlError(f"{self._peer} is no longer connected ({err}); op {msg['op']!r} not sent") from err

    def _require_open(self) -> None:
        if self._sock.closed:
            raise ControlError(f"control server on {self.address} is closed")

    def close(self) -> None:
        """Close the socket and remove the socket file and private directory this server created."""
        if self._strangers is not None:
            self._strangers.close(self._sock)
        _close_socket(self._ctx, self._sock)
        if self._private_dir is not None:
            _remove_private_dir(self._private_dir)
            _LIVE_DIRS.discard(self._private_dir)
            self._private_dir = None

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_socket(ctx: zmq.Context, sock: zmq.Socket) -> None:
    if not sock.closed:
        sock.close(linger=0)
    if not ctx.closed:
        ctx.term()


def _remove_private_dir(directory: str) -> bool:
    """Remove our socket file (libzmq may already have) and the then-empty private directory.

    Returns whether this call removed the directory; one already gone (a racing sweep) is no error.
    """
    try:
        os.remove(os.path.join(directory, _SOCKET_NAME))
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("could not remove the control socket in %s: %s", directory, err)
    try:
        os.rmdir(directory)
        return True
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("could not remove the control socket directory %s: %s", directory, err)
        return False


def _checked_token(token: bytes) -> bytes:
    if not isinstance(token, bytes) or len(token) < 16:
        raise ValueError("the session token must be bytes of at least 16 bytes (use new_token())")
    return token


class ControlClient:
    """Trainer side: a DEALER socket connected to the engine's ControlServer. Use from a single thread."""

    def __init__(self, address: str, token: bytes, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if not (address.startswith("ipc://") or address.startswith("tcp://")):
            raise ValueError(f"control address {address!r} must start with ipc:// or tcp://")
        self.address = address
        self.token = _checked_token(token)
        self.max_message_bytes = _checked_limit(max_message_bytes)
        self._ctx, self._sock = _new_socket(zmq.DEALER, address, max_message_bytes)
        self._sock.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(_ROUTING_ID_BYTES - 1))
        try:
            self._sock.connect(address)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._last_seq = 0
        self._stale_below = 0

    @property
    def _peer(self) -> str:
        return f"the engine at {self.address}"

    def send(self, msg: dict[str, Any]) -> int:
        """Send one message and return its number; ValueError if it is over the size limit (named by op and size)."""
        self._require_open()
        seq = self._last_seq + 1
        self._sock.send(_encode(msg, self.token, self.max_message_bytes, (protocol.SEQ, seq)))
        self._last_seq = seq
        return seq

    def recv(self, timeout_s: float | None, *, step: str) -> dict[str, Any]:
        """Next reply. ``rejected``/``error`` ops are returned, not raised; a bad reply raises ProtocolError.

        Replies to messages sent before the last ``request`` are late answers to a request that
        was given up: they are dropped (logged) while the same deadline runs.
        """
        self._require_open()
        deadline = _Deadline(timeout_s)
        while True:
            frames = _poll_frames(self._sock, self._poller, deadline, self._peer, step)
            if len(frames) != 1:
                raise ProtocolError(f"{self._peer} sent {len(frames)} frames while {step}; expected 1")
            rejection = None if frames[0].startswith(self.token) else protocol.decode_rejection(frames[0])
            if rejection is not None:
                return rejection
            try:
                msg, answers = _authenticated(frames[0], self.token, protocol.RE)
            except _Invalid as bad:
                raise ProtocolError(f"{self._peer} sent a bad reply while {step}: {bad.why}") from None
            if answers is not None and answers < self._stale_below:
                log.info("dropped a late %r reply from %s to message %d while %s", msg["op"], self._peer, answers, step)
                _check_deadline(deadline, self._peer, step)
                continue
            return msg

    def request(self, msg: dict[str, Any], timeout_s: float | None, *, step: str) -> dict[str, Any]:
        """Send ``msg`` and wait for its reply; from now on, replies to earlier messages are stale."""
        self._stale_below = self.send(msg)
        return self.recv(timeout_s, step=step)

    def abandon(self) -> None:
        """Give up the answers to every message sent so far: they are dropped when they arrive."""
        self._stale_below = self._last_seq + 1

    def _require_open(self) -> None:
        if self._sock.closed:
            raise ControlError(f"control client for {self.address} is closed")

    def close(self) -> None:
        """Close the socket without lingering on unsent messages."""
        _close_socket(self._ctx, self._sock)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seed_routing_ids() -> None:
    """Seed libc's ``rand()``, from which libzmq draws a new ROUTER's first anonymous routing id.

    Unseeded, every engine's first id is the same known value, and a stranger that connected
    with the next ids first makes libzmq abort the process on the collision. A secret seed makes
    the ids unguessable (one of 2**32 per engine); reseeding only changes what later rand() calls return.
    """
    libc = ctypes.CDLL(None)
    srand = getattr(libc, "srand", None)
    if srand is not None:
        srand(ctypes.c_uint(int.from_bytes(secrets.token_bytes(4), "little")))
