"""Broadcast transfer buffers: one collective carries each bucket from the trainer to every engine rank.

Why: when trainer and engine do not share a GPU (other GPUs, other nodes) there is no memory to
share. A collective moves the bytes at the fabric's rate — NCCL between GPUs, gloo between CPU
processes, same code — and one broadcast serves every engine rank at once (replicas and
tensor-parallel ranks alike: each rank receives the whole bucket and applies only its slice).
Each side keeps its own two slots for the whole plan. The trainer encodes bucket *i* into slot
*i* % 2 and ``publish`` starts ``broadcast(slot[:nbytes], root=0)`` without waiting, so bucket
*i + 1* is encoded while bucket *i* is on the wire; ``acquire`` waits for a slot's previous
broadcast before the trainer writes it again. The engine's ``fetch`` joins the same broadcast
into its own slot and waits for it; then the engine applies the bucket as with shared memory.

The group. A dedicated process group (trainer rank 0, engine ranks 1..N) built from torch's
backend classes (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) over a ``PrefixStore`` of a
``TCPStore`` that the trainer hosts, and used through the backend object itself, whose ranks
are group ranks. ``init_process_group`` / ``new_group`` are not used: the first would claim the
default group a trainer already has, the second needs that default group to hold every rank, and
both register the group in torch's global state. So the refit group neither needs nor touches
the trainer's own groups.

Rendezvous (each plan makes a new group; a group that failed is never reused). The trainer
sends each engine rank this description in its plan message, then joins as rank 0. A rank marks
``joined/<rank>`` in the store, or ``refused/<rank>`` with its reason when it refused the plan.
The trainer alone decides: ``go`` once every rank joined, ``abandon`` at the first refusal or at
the rendezvous timeout, naming the missing ranks. Only after ``go`` is the backend built (its own
connection step would otherwise hang until its timeout), and a handshake broadcast of the group
id proves the group works; on NCCL it also creates the communicator, which torch does lazily at
the first collective.

Timeouts: the rendezvous has its own; every collective wait is bounded by ``timeout_s``, after
which ``TransportError`` names the step and the group. A failed collective leaves the group
unusable on every rank: the refit fails and the next plan builds a new group. NCCL groups are
built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the caller set it: on a collective error
torch then aborts the communicator instead of tearing the whole (trainer) process down.

The trainer's side of the transport is ``BroadcastSend`` (``mxrefit.transport.base.SendPath``):
a new group at every plan, the plan message sent to each rank with its rank, then ``join``. The
engine side is the buffers transport's (``BufferLand`` opens ``open_broadcast``).

Trust: like any torch.distributed job, the store and the group are unauthenticated; use them on
a trusted network. The store listens only on the given host's address. The token-checked
control channel carries the description; the group id is random, so a rank of an old group
cannot join a new one by mistake. Multi-node gloo/NCCL pick their interface as usual
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import time
from typing import Any, Iterator

import torch
from torch import distributed as dist

from mxrefit.plan.build import RefitPlan
from mxrefit.transport.base import Control, SlotSend
from mxrefit.transport.buffers import OpenedBuffers, TransferBuffers, TransportError
from mxrefit.transport.fanout import ControlFanOut
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, MAX_BUFFERS, check_int, check_keys

log = logging.getLogger("mxrefit.source.broadcast_sender")

BACKENDS = ("gloo", "nccl")
MAX_RANKS = 1 << 16
_POLL_S = 0.02
_GROUP_ID_BYTES = 16
_MAX_WHY_CHARS = 500
_DESC_KEYS = {
    "kind",
    "nbytes",
    "count",
    "backend",
    "host",
    "port",
    "group",
    "world_size",
    "timeout_s",
    "rendezvous_timeout_s",
    "rank",
}


class RendezvousError(TransportError):
    """The refit group could not be formed: a rank did not join in time, refused, or was unreachable."""


def default_backend(device: torch.device | str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


@contextlib.contextmanager
def _nccl_error_handling() -> Iterator[None]:
    """Abort the communicator on errors rather than the process (read by the backend's constructor)."""
    var = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if var in os.environ:
        yield
        return
    os.environ[var] = "2"
    try:
        yield
    finally:
        os.environ.pop(var, None)


def _cut(why: str) -> str:
    """``why`` within _MAX_WHY_CHARS bytes of UTF-8 (what the store carries)."""
    return why.encode()[:_MAX_WHY_CHARS].decode(errors="ignore")


def _check_device(backend: str, device: torch.device) -> None:
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl backend broadcasts between GPUs; this side's buffers would be on {device}")
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(f"the gloo backend broadcasts between CPU processes; this side's buffers would be on {device}")


class _Group:
    """One plan's backend process group, with the bounded waits every collective gets."""

    def __init__(self, backend: str, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float, label: str):
        self.backend, self.rank, self.size, self.device = backend, rank, size, device
        self.timeout_s, self.label = timeout_s, label
        self.failed = False
        # Any: the backend classes' stubs lack the collectives and teardown (broadcast, abort, shutdown) they have
        self.pg: Any
        try:
            if backend == "gloo":
                self.pg = dist.ProcessGroupGloo(store, rank, size, timeout=_td(timeout_s))
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = _td(timeout_s)
                with _nccl_error_handling(), torch.cuda.device(device):
                    self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        except Exception as err:  # the backends raise RuntimeError subclasses with their own text
            raise RendezvousError(
                f"could not connect {label} as rank {rank} of {size} within {timeout_s:g} s: {_first_line(err)}"
            ) from err

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 of ``tensor``'s bytes; returns the backend's work handle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            return self.pg.broadcast([tensor], opts)
        except Exception as err:
            self.failed = True
            raise TransportError(f"could not start a broadcast on {self.label} (rank {self.rank}): {_first_line(err)}") from err

    def wait(self, work: Any, step: str) -> None:
        """Wait at most ``timeout_s`` for ``work``; a failure or timeout leaves the group unusable."""
        try:
            work.wait(_td(self.timeout_s))
        except Exception as err:
            self.failed = True
            raise TransportError(
                f"{step} failed on {self.label} (rank {self.rank} of {self.size}, "
                f"{self.timeout_s:g} s timeout): {_first_line(err)}"
            ) from err

    def handshake(self, group_id: str) -> None:
        """The group's first collective: proves every rank is in the same group (and creates NCCL's communicator)."""
        expected = torch.tensor(list(bytes.fromhex(group_id)), dtype=torch.uint8)
        probe = expected.to(self.device) if self.rank == 0 else torch.zeros_like(expected, device=self.device)
        self.wait(self.broadcast(probe), "the handshake broadcast")
        if not torch.equal(probe.cpu(), expected):
            self.failed = True
            raise RendezvousError(f"{self.label}: the handshake carried a different group id; another group shares the store")

    def close(self) -> None:
        """Tear the group down; a failed group is aborted (a peer may be gone)."""
        try:
            if self.failed:
                self.pg.abort()
            else:
                self.pg.shutdown()
        except Exception as err:  # closing must not mask the failure that led here
            log.warning("closing %s: %s", self.label, _first_line(err))


class RendezvousStore:
    """The trainer's TCPStore, hosted once per session; every plan's group uses a fresh prefix of it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen()
            self.port = sock.getsockname()[1]
            fd = sock.detach()
        except OSError as err:
            sock.close()
            raise RendezvousError(f"cannot listen for the refit rendezvous on {host}:{port}: {err}") from err
        try:
            self.store = dist.TCPStore(host, self.port, None, True, _td(timeout_s), wait_for_workers=False, master_listen_fd=fd)
        except Exception:
            os.close(fd)
            raise
        self.host = host


def _client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, False, _td(timeout_s), wait_for_workers=False)
    except Exception as err:
        raise RendezvousError(
            f"cannot reach the trainer's refit rendezvous at {host}:{port} within {timeout_s:g} s: {_first_line(err)}"
        ) from err


def _group_store(store: dist.Store, group_id: str) -> dist.PrefixStore:
    return dist.PrefixStore(f"mxrefit/{group_id}/", store)


class BroadcastBuffers(TransferBuffers):
    """Trainer side (rank 0): local slots, and the group once ``join`` formed it."""

    kind = "broadcast"

    def __init__(
        self,
        count: int,
        nbytes: int,
        device: torch.device | str,
        *,
        store: RendezvousStore,
        world_size: int,
        backend: str | None = None,
        timeout_s: float = 60.0,
        rendezvous_timeout_s: float = 60.0,
    ):
        check_int(count, "count", 1, MAX_BUFFERS)
        check_int(nbytes, "nbytes", 1, MAX_BUFFER_BYTES)
        check_int(world_size, "world_size", 2, MAX_RANKS)
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check_device(self.backend, self.device)
        self.nbytes, self.world_size = nbytes, world_size
        self.timeout_s, self.rendezvous_timeout_s = timeout_s, rendezvous_timeout_s
        self.store = store
        self.group_id = secrets.token_hex(_GROUP_ID_BYTES)
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self.group: _Group | None = None
        self._works: dict[int, Any] = {}
        self.label = f"the {self.backend} refit group {self.group_id[:8]} at {store.host}:{store.port}"

    def describe(self) -> dict[str, Any]:
        """Everything a rank needs to join, except its rank (the sender adds ``rank``: 1..world_size-1)."""
        return {
            "kind": self.kind,
            "nbytes": self.nbytes,
            "count": len(self.buffers),
            "backend": self.backend,
            "host": self.store.host,
            "port": self.store.port,
            "group": self.group_id,
            "world_size": self.world_size,
            "timeout_s": self.timeout_s,
            "rendezvous_timeout_s": self.rendezvous_timeout_s,
        }

    def join(self, peers: list[str]) -> None:
        """Form the group as rank 0 once every rank joined; ``peers[r - 1]`` names rank r in errors."""
        store = _group_store(self.store.store, self.group_id)
        ranks = range(1, self.world_size)
        deadline = time.monotonic() + self.rendezvous_timeout_s
        pending = set(ranks)
        while pending:
            for r in sorted(pending):
                if store.check([f"refused/{r}"]):
                    why = store.get(f"refused/{r}").decode(errors="replace")
                    self._abandon(store, f"rank {r} ({peers[r - 1]}) refused: {why}")
                if store.check([f"joined/{r}"]):
                    pending.discard(r)
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"rank {r} ({peers[r - 1]})" for r in sorted(pending))
                self._abandon(store, f"{names} did not join within the {self.rendezvous_timeout_s:g} s rendezvous timeout")
            if pending:
                time.sleep(_POLL_S)
        store.set("decision", "go")
        self.group = _Group(self.backend, store, 0, self.world_size, self.device, self.timeout_s, self.label)
        self.group.handshake(self.group_id)

    def _abandon(self, store: dist.Store, why: str) -> None:
        store.set("decision", "abandon:" + _cut(why))
        raise RendezvousError(f"{self.label}: rendezvous abandoned: {why}")

    def acquire(self, slot: int) -> None:
        work = self._works.pop(slot, None)
        if work is not None and self.group is not None:
            self.group.wait(work, f"the broadcast from slot {slot}")

    def publish(self, slot: int, nbytes: int) -> None:
        if self.group is None:
            raise TransportError(f"{self.label} is not formed: join() it before publishing")
        self._works[slot] = self.group.broadcast(self.buffers[slot][:nbytes])

    def discard(self) -> None:
        """A refit stopped midway: broadcasts may still be pending, so closing must abort the group."""
        if self.group is not None:
            self.group.failed = True

    def close(self) -> None:
        self._works = {}
        if self.group is not None:
            self.group.close()
            self.group = None
        self.buffers = []


class BroadcastOpened(OpenedBuffers):
    """Engine side (rank >= 1): its own slots, filled by joining the trainer's broadcasts."""

    kind = "broadcast"

    def __init__(self, buffers: list[torch.Tensor], group: _Group):
        self.buffers, self.group = buffers, group
        self.nbytes = buffers[0].numel()

    def fetch(self, slot: int, nbytes: int) -> None:
        self.group.wait(self.group.broadcast(self.buffers[slot][:nbytes]), f"receiving the broadcast into slot {slot}")

    def close(self) -> None:
        self.group.close()
        self.buffers = []


def _check_desc(desc: dict[str, Any]) -> dict[str, Any]:
    check_keys(desc, _DESC_KEYS)
    check_int(desc["nbytes"], "nbytes", 1, MAX_BUFFER_BYTES)
    check_int(desc["count"], "count", 1, MAX_BUFFERS)
    check_int(desc["port"], "port", 1, 65535)
    world = check_int(desc["world_size"], "world_size", 2, MAX_RANKS)
    check_int(desc["rank"], "rank", 1, world - 1)
    if desc["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {desc['backend']!r:.50}")
    if not isinstance(desc["host"], str) or not 0 < len(desc["host"]) <= 255:
        raise ValueError(f"bad rendezvous host {desc['host']!r:.100}")
    group = desc["group"]
    if not isinstance(group, str) or len(group) != 2 * _GROUP_ID_BYTES or any(c not in "0123456789abcdef" for c in group):
        raise ValueError(f"bad group id {group!r:.100}")
    for key in ("timeout_s", "rendezvous_timeout_s"):
        value = desc[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
            raise ValueError(f"{key} must be a number of seconds in (0, 86400], got {value!r:.50}")
    return desc


def open_broadcast(
    desc: dict[str, Any], device: torch.device | str | None = None, *, max_wait_s: float | None = None
) -> BroadcastOpened:
    """Allocate this rank's slots and join the trainer's group.

    Blocks up to twice the rendezvous timeout (then the handshake), which ``max_wait_s`` (the engine's own timeout)
    caps: the trainer's description cannot make a rank wait longer than the rank allows.
    """
    d = dict(_check_desc(desc))
    if max_wait_s is not None:
        d["rendezvous_timeout_s"] = min(d["rendezvous_timeout_s"], max_wait_s)
        d["timeout_s"] = min(d["timeout_s"], max_wait_s)
    device = torch.device(device or "cpu")
    _check_device(d["backend"], device)
    rank, world = d["rank"], d["world_size"]
    label = f"the {d['backend']} refit group {d['group'][:8]} at {d['host']}:{d['port']}"
    buffers = [torch.empty(d["nbytes"], dtype=torch.uint8, device=device) for _ in range(d["count"])]
    started = time.monotonic()
    store = _group_store(_client_store(d["host"], d["port"], d["rendezvous_timeout_s"]), d["group"])
    store.set(f"joined/{rank}", "1")
    # the trainer decides within one timeout of sending the plans; the whole wait stays within two
    patience = max(0.1, 2 * d["rendezvous_timeout_s"] - (time.monotonic() - started))
    try:
        store.wait(["decision"], _td(patience))
    except Exception as err:
        raise RendezvousError(f"{label}: rank {rank} joined, but the trainer decided nothing within {patience:g} s") from err
    decision = store.get("decision")
    if decision != b"go":
        raise RendezvousError(
            f"{label}: the trainer abandoned the rendezvous: {decision.removeprefix(b'abandon:').decode(errors='replace')}"
        )
    group = _Group(d["backend"], store, rank, world, device, float(d["timeout_s"]), label)
    try:
        group.handshake(d["group"])
    except TransportError:
        group.close()
        raise
    return BroadcastOpened(buffers, group)


def decline_broadcast(desc: Any, why: str) -> None:
    """Best effort: tell the trainer's rendezvous that this rank will not join, so it stops waiting."""
    try:
        d = _check_desc(desc)
        store = _group_store(_client_store(d["host"], d["port"], min(5.0, d["rendezvous_timeout_s"])), d["group"])
        store.set(f"refused/{d['rank']}", _cut(why))
    except Exception as err:  # the trainer then names this rank at its rendezvous timeout instead
        log.warning("could not tell the trainer's rendezvous that this rank refused the plan: %s", _first_line(err))


class BroadcastSend(SlotSend):
    """Trainer side of the broadcast transport over the fan-out to every engine rank (group rank i + 1
    is ``fan``'s rank i): a new group at every plan, one broadcast per bucket."""

    name = "broadcast"

    def __init__(
        self,
        fan: ControlFanOut,
        device: torch.device,
        *,
        backend: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 60.0,
        rendezvous_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(device)
        self.fan = fan
        self.backend = backend or default_backend(device)
        self.timeout_s, self.rendezvous_timeout_s = timeout_s, rendezvous_timeout_s
        self._store_at = (host, port)
        self._store: RendezvousStore | None = None
        self.buffers: BroadcastBuffers | None = None

    def _fits(self, plan: RefitPlan) -> bool:
        return False  # each plan forms a new group: a failed group is never reused

    def _new_buffers(self, plan: RefitPlan) -> BroadcastBuffers:
        if self._store is None:
            self._store = RendezvousStore(*self._store_at, timeout_s=self.rendezvous_timeout_s)
        return BroadcastBuffers(
            plan.slots,
            plan.bucket_bytes,
            self.device,
            store=self._store,
            world_size=len(self.fan.names) + 1,
            backend=self.backend,
            timeout_s=self.timeout_s,
            rendezvous_timeout_s=self.rendezvous_timeout_s,
        )

    def offer(self, control: Control, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The plan to every live rank (each told its rank), then form the group; the ranks' merged answer."""
        fan, group = self.fan, self.buffers
        if group is None:
            raise RuntimeError("the broadcast transport is not wired: plan first")
        desc = group.describe()
        for i in fan.live:
            fan.send_to(i, {**msg, "transport": "buffers", "buffers": {**desc, "rank": i + 1}})
        try:
            group.join(fan.names)
        except RendezvousError:
            fan.abandon()  # the ranks' answers come later (or never); skipped before the next exchange
            raise
        return fan.recv(timeout_s, step="forming the broadcast group")

    def discard(self) -> None:
        if self.buffers is not None:
            self.buffers.discard()

    def close(self) -> None:
        super().close()
        self._store = None  # the rendezvous store stops listening once released
