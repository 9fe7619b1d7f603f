"""Trainer side of a refit: plan once, then per step encode buckets straight where they go.

Two data paths, chosen once at ``plan`` (``mxrefit.transport.registry``) and used through one
interface (``mxrefit.transport.base.SendPath``):
- ``direct`` (when the engine can export its storage: CUDA on the same GPU, or host engines
  whose storage lives in shared memory): every part is encoded straight into the engine's
  own bytes; no buffer on either side, no engine-side copy;
- buffers (``cuda_ipc`` / ``shm``): parts are encoded into two persistent slots and the
  engine applies each bucket as one batched copy.
  For engines on other GPUs or nodes, ``mxrefit.source.broadcast_sender.BroadcastSender`` runs this same
  loop over broadcast buffers: ``publish`` starts a collective per bucket, each engine rank
  ``fetch``-es it into its own slot (``mxrefit.transport.broadcast``).
Per step the work is: check the tensors are the planned ones (identity-cached), one
non-finite screen over every tensor (``mxrefit.formats.finite_check``; with ``check_finite=False``
the encoders screen in the same pass instead), then per bucket one grouped
launch per format + a "ready" message; the engine answers "applied" once the bucket's bytes
are in place (and processed, for engines that post-process), and bucket *i* is encoded only
after bucket *i - slots* was applied. With ``one_behind=True``, direct writes from a mapping send
their "ready" messages one bucket behind and start bucket *i* once *i - slots - 1* was applied
(``RefitPlan.window``; such a trainer's plan carries the extra bucket, ``write_ahead``, so the
engine's staging keeps each layer's region that bucket longer, and only for it).

``refit`` also takes a stream of ``(name, tensor)`` pairs in the plan's order (e.g. FSDP2
``full_tensor()`` per parameter): tensors are then pulled bucket by bucket and dropped after
encoding, so the whole model is never materialized. A stream cannot be screened before the
first write; a bad tensor then aborts the refit, which leaves the engine ``partial`` (its
previous version named) until the next complete refit.

The engine's tables may change after a refit (a kernel layout it learned there, now advertised on
its targets; ``Engine.tables_version``): its "committed" reply then carries a new ``tables``
version, and the next ``refit`` reads the tables again and plans the same sources again before
anything else (``RefitReport.replanned``). Until then the engine serves the plan it adopted.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mxrefit.devices import resolve
from mxrefit.errors import MxrefitError
from mxrefit.formats import get_format, mxfp8
from mxrefit.formats._common import NO_BAD, first_bad
from mxrefit.formats.finite_check import FiniteCheck
from mxrefit.formats.kernel_layout import KernelLayout
from mxrefit.plan.build import (
    DEFAULT_BUCKET_BYTES,
    WRITE_AHEAD,
    Bucket,
    PlanMismatch,
    RefitPlan,
    SourceSpec,
    build_plan,
    sources_to_msg,
    tables_from_msg,
)
from mxrefit.plan.eligibility import QuantRules, check_rules
from mxrefit.plan.types import Destination, ParamSpec
from mxrefit.transport.base import Control, EngineInfo, SendInit, SendPath
from mxrefit.transport.buffers import TransferBuffers
from mxrefit.transport.bytesum import ByteSum
from mxrefit.transport.control import ControlClient, ControlError, PeerTimeout
from mxrefit.transport.protocol import Malformed, Op, check_reply
from mxrefit.transport.registry import SEND_PATHS, choose, send_path

log = logging.getLogger("mxrefit.source.sender")

TRANSPORTS = tuple(SEND_PATHS)  # what Sender(transport=...) takes; BroadcastSender brings its own
Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class RefitError(MxrefitError, RuntimeError):
    """A refit did not complete; ``engine_status`` is what the engine reported (version, state)."""

    def __init__(self, message: str, engine_status: dict | None = None):
        self.engine_status = engine_status
        self.reason = message
        if engine_status:
            message += f" (engine holds version {engine_status.get('version')}, state {engine_status.get('state')})"
        super().__init__(message)


class _BucketFlags:
    """Per-bucket non-finite cells.

    Bucket i's encoders ``atomic_min`` into cell i % 2. Read at once, a cell waits for every kernel
    queued so far. Marked (the one-behind sender), the cell is copied to pinned host memory behind
    bucket i's kernels and an event recorded, so the host learns whether bucket i was finite as soon
    as its own kernels are done, while bucket i + 1's run on (on CPU the kernels have run already)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cells = torch.full((2,), NO_BAD, dtype=torch.int32, device=device)
        self.cuda = device.type == "cuda"
        self.host = torch.full((2,), NO_BAD, dtype=torch.int32, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.marked = [False, False]

    def cell(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s cell, cleared and unmarked (an aborted refit leaves its flag, and its mark, behind:
        a stream's refit after an aborted one-behind refit must not read the old bucket's copy)."""
        c = self.cells[i % 2 : i % 2 + 1]
        c.fill_(NO_BAD)
        self.marked[i % 2] = False
        return c

    def mark(self, i: int) -> None:
        """After bucket ``i``'s kernels were queued: its cell's value travels to the host behind them."""
        if self.cuda:
            k = i % 2
            self.host[k : k + 1].copy_(self.cells[k : k + 1], non_blocking=True)
            self.events[k].record(torch.cuda.current_stream(self.device))
            self.marked[k] = True

    def first_bad(self, i: int) -> int | None:
        """The first non-finite unit bucket ``i``'s kernels met, or None; waits for those kernels only
        if the bucket was marked, else for everything queued."""
        k = i % 2
        if self.marked[k]:
            self.events[k].synchronize()
            return first_bad(self.host[k : k + 1])
        return first_bad(self.cells[k : k + 1])


@dataclass
class RefitReport:
    version: int
    transport: str = ""
    check_s: float = 0.0
    pack_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    engine_fetch_s: float = 0.0
    engine_apply_s: float = 0.0
    engine_process_s: float = 0.0
    engine_after_refit_s: float = 0.0
    bytes: int = 0
    buckets: int = 0
    replanned: bool = False  # the engine's tables changed after an earlier refit: this one planned again first
    extra: dict = field(default_factory=dict)


class Sender:
    """Trainer side of a refit; use from one thread. ``transport``: None (direct when the
    engine can export its storage, else buffers for this device), ``"direct"``, ``"shm"`` or
    ``"cuda_ipc"`` (``mxrefit.transport.registry``).

    The refit talks to the engine through ``client`` (a ``mxrefit.transport.base.Control``) and
    moves bytes through ``path`` (a ``SendPath``); neither depends on which transport it is. A
    subclass for other engine topologies (``BroadcastSender``) sets both up with ``_setup`` and may
    override two hooks: ``_abort`` (stop a refit the engine side is in, learning its status) and
    ``_status_or_none`` (the engine side's status after a refit failed on the control channel).
    """

    client: Control
    path: SendPath | None
    follow_tables: bool = True

    def __init__(
        self,
        address: str,
        token: bytes,
        *,
        device: torch.device | str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        transport: str | None = None,
        timeout_s: float = 60.0,
        check_finite: bool = True,
        verify: bool = False,
        rules: QuantRules | None = None,
        one_behind: bool = True,
        follow_tables: bool = True,
    ):
        """``check_finite``: True (default) screens every source for NaN/Inf in a pass of its own
        before any byte moves, so bad input changes no engine byte (the sources are read twice);
        False screens while encoding (the fused screen, one read): a non-finite source aborts
        the refit naming it, the engine stays ``partial`` at its last complete version, and the
        next good refit repairs it.
        ``verify``: per-bucket integrity sums (``mxrefit.transport.bytesum``) checked by the engine
        before it applies a bucket; a mismatch fails the refit with the bucket named.
        ``rules``: the trainer's own quantization rules; the plan is refused (PlanMismatch naming
        each tensor) where the engine's tables quantize differently.
        ``one_behind`` (default): direct writes from a mapping send each bucket's "ready" one bucket
        behind, so the device runs bucket i + 1's kernels while the host waits for bucket i's (H100,
        2026-12-06, one run: Qwen3-30B-A3B at 24 layers 32.5 ms against 43.0 in step; into a real
        vLLM 65.6 against 71.5 ms); the engine keeps one more bucket of staging for it. False sends
        each bucket's "ready" as soon as it is queued (the bench's ``prequant-in-step`` mode).
        ``follow_tables`` (default): when the engine's tables change after a refit (a kernel order it
        learned), plan again before the next refit; False keeps the first plan, which the engine
        goes on serving (A/B runs of the engine's own processing against the trainer's write)."""
        self.follow_tables = follow_tables
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
        self._setup(
            address,
            device=device,
            bucket_bytes=bucket_bytes,
            slots=slots,
            transport=transport,
            timeout_s=timeout_s,
            check_finite=check_finite,
            verify=verify,
            rules=rules,
            one_behind=one_behind,
        )
        self.client = ControlClient(address, token)

    def _setup(
        self,
        address: str,
        *,
        device: torch.device | str,
        bucket_bytes: int,
        slots: int,
        transport: str | None,
        timeout_s: float,
        check_finite: bool,
        verify: bool,
        rules: QuantRules | None,
        path: SendPath | None = None,
        one_behind: bool = True,
    ) -> None:
        """Everything but the control channel, which the caller sets as ``client`` next. ``path``:
        a transport this sender always uses (``BroadcastSender``); else one is chosen at each plan."""
        self.device = resolve(device)
        self.rules = rules
        self.bucket_bytes = bucket_bytes
        self.slots = slots
        self.requested_transport = transport
        self.transport = ""
        self.timeout_s = timeout_s
        self.check_finite = check_finite
        self.verify = verify
        self.one_behind = one_behind
        self.address = address
        self.plan_: RefitPlan | None = None
        self.path = path
        self._pinned = path is not None
        self.engine_status: dict = {}
        self._engine: EngineInfo | None = None
        self._tables: tuple[dict[str, ParamSpec], dict[str, Destination]] | None = None
        self._tables_version = 0  # the engine's tables version ``_tables`` were read at
        self._engine_tables = 0  # the latest version the engine reported (hello or commit)
        self._plan_tables = 0  # the version ``plan_`` was built from
        self._tables_changed_at: int | None = None  # the refit whose commit reported the latest change
        self._plan_id: str | None = None
        self._adoptions: list[str] = []
        self._last_sources: list[torch.Tensor] | None = None
        self._unfinished: int | None = None
        self.begins_sent = 0  # "begin" messages sent, so a caller knows whether a failed refit reached the engine
        self._bucket_encoders: list[list[tuple[list[int], Any]]] = []
        self._sums: list[ByteSum] = []
        self._finite: FiniteCheck | None = None
        self._bucket_checks: dict[int, FiniteCheck] = {}

    @property
    def tables_version(self) -> int:
        """The engine's tables version (``Engine.tables_version``) this sender's tables were read at;
        0 before ``connect`` or from an engine that does not say."""
        return self._tables_version

    @property
    def _plan_stale(self) -> bool:
        """The engine reported tables newer than those the plan was built from."""
        return self.plan_ is not None and self._plan_tables != self._engine_tables

    @property
    def buffers(self) -> TransferBuffers | None:
        """The transport's slots, for transports that have them (None for direct writes)."""
        return self.path.buffers if self.path is not None else None

    # ---- set-up, once ----------------------------------------------------------------------
    _ANSWERS = {
        Op.HELLO: (Op.TABLES,),
        Op.PLAN: (Op.PLANNED,),
        Op.BEGIN: (Op.BEGUN,),
        Op.COMMIT: (Op.COMMITTED,),
        Op.STATUS: (Op.STATUS,),
        Op.SHUTDOWN: (Op.BYE,),
    }

    def _request(self, msg: dict, step: str) -> dict:
        reply = self.client.request(msg, self.timeout_s, step=step)
        return self._checked(self._valid(reply, *self._ANSWERS[msg["op"]]), msg["op"])

    def _valid(self, reply: dict, *expected: str) -> dict:
        """``reply`` if it is one of the ``expected`` kinds (or an error) with well-typed fields, else RefitError."""
        try:
            return check_reply(reply, *expected)
        except Malformed as bad:
            raise RefitError(f"engine at {self.address} broke the protocol: {bad.why}") from None

    def _checked(self, reply: dict, op: str) -> dict:
        """The engine's reply to ``op``; PlanMismatch or RefitError if it refused."""
        if reply["op"] in (Op.ERROR, Op.REJECTED):
            problems = reply.get("problems") or [reply.get("why", "")]
            if reply.get("kind") == "plan_mismatch":
                raise PlanMismatch(list(problems))
            raise RefitError(f"engine at {self.address} refused {op!r}: {'; '.join(map(str, problems))}", reply)
        return reply

    def _preempt(self, why: str) -> None:
        """End whatever refit the engine may still be waiting on (ours that failed, or a dead trainer's).

        Fire and forget: the engine answers 'aborted' with its status, an answer given up at once
        (``abandon``), so this costs no round trip and no timeout.
        """
        self.client.send({"op": Op.ABORT, "why": why})
        self.client.abandon()
        self._unfinished = None

    def connect(self) -> tuple[dict[str, ParamSpec], dict[str, Destination]]:
        """Say hello: the engine's tables (also kept for ``plan``), its storage and its status."""
        self._preempt("a trainer connected")
        reply = self._request({"op": Op.HELLO}, "connecting")
        try:
            tables = tables_from_msg(reply)
        except Exception as err:  # the engine's tables are its data: any malformation is the engine's error
            raise RefitError(f"engine at {self.address} sent malformed tables: {type(err).__name__}: {err}"[:1000]) from None
        self._tables = tables
        self._tables_version = self._engine_tables = reply.get("tables", 0)
        self._engine = EngineInfo(exportable=reply["exportable"], device=reply["device"])
        self.engine_status = {"version": reply["version"], "state": reply["state"]}
        return tables

    def _wire(self) -> SendPath:
        """The transport for the next plan: the pinned one, else the registry's choice (the current path if unchanged)."""
        if self._pinned and self.path is not None:
            return self.path
        engine = self._engine if self._engine is not None else EngineInfo(exportable=False, device="")
        init = SendInit(self.device, self.address, engine, self.timeout_s)
        name = choose(self.requested_transport, init)
        if self.path is None or self.path.name != name:
            self._close_path()
            self.path = send_path(name, init)
        return self.path

    def plan(self, specs: Iterable[SourceSpec]) -> RefitPlan:
        """Build the plan for these trainer tensors, wire the data path, and hand both to the engine.

        Reads the engine's tables first (``connect``) unless the ones held are the engine's latest."""
        held = self._tables if self._tables_version == self._engine_tables else None
        params, destinations = held if held is not None else self.connect()
        if self.rules is not None:
            check_rules(self.rules, destinations)
        write_ahead = WRITE_AHEAD if self.one_behind else 0
        plan = build_plan(
            list(specs), params, destinations, bucket_bytes=self.bucket_bytes, slots=self.slots, write_ahead=write_ahead
        )
        path = self._wire()
        plan_id = secrets.token_hex(8)  # names this adoption: the engine refuses a begin from a trainer planned earlier
        msg = {
            "op": Op.PLAN,
            "plan_id": plan_id,
            "sources": sources_to_msg(plan.sources),
            "bucket_bytes": plan.bucket_bytes,
            "slots": plan.slots,
            "write_ahead": plan.write_ahead,
            "digest": plan.digest,
            "verify": self.verify,
        }
        path.prepare(plan)
        reply = self._checked(self._valid(path.offer(self.client, msg, self.timeout_s), Op.PLANNED), Op.PLAN)
        if reply["digest"] != plan.digest:
            raise RefitError(f"engine at {self.address} answered the plan with another digest ({reply['digest'][:12]})")
        try:
            path.adopt(reply)
        except Malformed as bad:
            raise RefitError(f"engine at {self.address} {bad.why}") from None
        except (ValueError, LookupError) as err:
            if self.requested_transport is None and self._engine is not None:
                # e.g. an engine of another user: its memory is not ours to write
                log.warning("engine at %s exported storage this trainer will not write (%s); using buffers", self.address, err)
                self._engine = replace(self._engine, exportable=False)
                return self.plan(plan.sources)
            raise RefitError(f"engine at {self.address} exported storage this trainer will not write: {err}") from None
        self.transport = path.name
        self.plan_, self._plan_id, self._plan_tables = plan, plan_id, self._tables_version
        adoption = reply["adoption"]
        self._adoptions = adoption if isinstance(adoption, list) else [adoption]
        self._last_sources = None
        self._build_encoders(plan, path)
        return plan

    def _close_path(self) -> None:
        if self.path is not None:
            self.path.close()
            if not self._pinned:
                self.path = None

    def _build_encoders(self, plan: RefitPlan, path: SendPath) -> None:
        views: dict[int, list[torch.Tensor | None]] = {}
        layouts: dict[int, list[KernelLayout | None]] = {}
        for b in plan.buckets:
            for p in b.parts:
                views.setdefault(p.source, [None] * 2)[p.role] = p.target.view(path.part_view(b, p))
                layouts.setdefault(p.source, [None] * 2)[p.role] = p.target.layout
        self._bucket_encoders = []
        for b in plan.buckets:
            by_format: dict[str, list[int]] = {}
            for i in b.sources:
                by_format.setdefault(plan.formats[i], []).append(i)
            encs = []
            for fmt_name, idx in by_format.items():
                specs = [(plan.sources[i].shape, plan.sources[i].dtype) for i in idx]
                outs = [[v for v in views[i] if v is not None] for i in idx]
                kernel_layouts = [layouts[i][: len(outs[n])] for n, i in enumerate(idx)]
                encoder = get_format(fmt_name).encoder(
                    specs, outs, screen=not self.check_finite, layouts=kernel_layouts if any(map(any, kernel_layouts)) else None
                )
                encs.append((idx, encoder))
            self._bucket_encoders.append(encs)
        self._flags = _BucketFlags(self.device)
        self._sums = [ByteSum([path.run_view(b, r) for r in b.runs]) for b in plan.buckets] if self.verify else []
        self._finite = None
        self._bucket_checks = {}

    # ---- every step ------------------------------------------------------------------------
    def _check_source(self, s: SourceSpec, t: torch.Tensor) -> str | None:
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            return f"tensor {s.name!r}: planned {s.shape} {s.dtype}, got {tuple(t.shape)} {t.dtype}"
        if t.device != self.device:
            return f"tensor {s.name!r} is on {t.device}, the sender works on {self.device}"
        if not t.is_contiguous():
            return f"tensor {s.name!r} is not contiguous (strides {t.stride()})"
        return None

    def _planned(self) -> RefitPlan:
        if self.plan_ is None:
            raise RuntimeError("no plan: call plan() first")
        return self.plan_

    def _ordered_sources(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        plan = self._planned()
        if len(tensors) != len(plan.sources):
            names = set(tensors)
            planned = {s.name for s in plan.sources}
            problems = [f"unexpected tensor {n!r}" for n in sorted(names - planned)]
            problems += [f"missing tensor {n!r}" for n in sorted(planned - names)]
            raise PlanMismatch(problems)
        try:
            srcs = [tensors[s.name] for s in plan.sources]
        except KeyError as err:
            raise PlanMismatch([f"missing tensor {err.args[0]!r}"]) from None
        last = self._last_sources
        if last is not None and all(a is b for a, b in zip(srcs, last)):
            return srcs
        problems = [p for s, t in zip(plan.sources, srcs) if (p := self._check_source(s, t)) is not None]
        if problems:
            raise PlanMismatch(problems)
        self._last_sources = srcs
        return srcs

    def _stream_bucket(self, stream: Iterator[tuple[str, torch.Tensor]], bucket: Bucket) -> list[torch.Tensor]:
        """Pull one bucket's tensors from a stream, in plan order, checked like a mapping's."""
        out = []
        plan = self._planned()
        for i in bucket.sources:
            spec = plan.sources[i]
            try:
                name, t = next(stream)
            except StopIteration:
                raise PlanMismatch([f"missing tensor {spec.name!r}: the stream ended early"]) from None
            if name != spec.name:
                raise PlanMismatch([f"stream yielded {name!r} where the plan has {spec.name!r} (streams must follow plan order)"])
            problem = self._check_source(spec, t.detach())
            if problem:
                raise PlanMismatch([problem])
            out.append(t.detach())
        return out

    @torch.no_grad()
    def refit(self, tensors: Tensors, *, version: int | None = None) -> RefitReport:
        """Send every tensor to the engine; returns timings.

        A mapping is checked whole (names, shapes, NaN/Inf) before any engine byte is
        written; a stream is checked bucket by bucket (see the module docstring). If the engine's
        tables changed after an earlier refit, the plan's sources are planned again first.
        """
        t0 = time.perf_counter()
        replanned = self._replan_if_tables_changed()
        stream: Iterator[tuple[str, torch.Tensor]] | None = None
        if not isinstance(tensors, Mapping):
            if self.plan_ is None:
                raise ValueError("plan() the stream's specs before the first refit from a stream")
            stream = iter(tensors)
        elif self.plan_ is None:
            self.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        plan, path = self._planned(), self._path()
        srcs: list[torch.Tensor | None] = [None] * len(plan.sources)
        if isinstance(tensors, Mapping):
            checked = self._ordered_sources(tensors)
            if self.check_finite and self._finite is None:
                self._finite = FiniteCheck([(s.shape, s.dtype) for s in plan.sources], self.device)
            self._screen(checked)
            srcs = list(checked)
        version = int(self.engine_status.get("version", 0)) + 1 if version is None else version
        report = RefitReport(version, transport=self.transport, check_s=time.perf_counter() - t0, replanned=replanned)
        if self._unfinished is not None:
            self._preempt(f"refit {self._unfinished} did not finish; refit {version} starts")
        self._unfinished = version
        acked = 0
        try:
            self.begins_sent += 1
            self._request(
                {
                    "op": Op.BEGIN,
                    "version": version,
                    "digest": plan.digest,
                    "plan_id": self._plan_id,
                    "adoptions": self._adoptions,
                },
                f"starting refit {version}",
            )
            self._check_path(path, version)
            # with one_behind, direct writes from a mapping finish each bucket one behind: bucket i's ready
            # message waits on its own kernels only, while bucket i + 1's are already queued, so the device
            # need not idle between buckets for the host's turn-around (on the H200 on 2026-12-05, with a
            # host sync per bucket, packing ran at ~55% of the copy rate against 84-97% for the kernels
            # alone). The wait below lags one too (``plan.window``), and the engine's staging keeps a layer's
            # region that one bucket longer (the plan's ``write_ahead``), since the trainer writes that far
            # ahead of "applied". A stream finishes each bucket at once (it holds one bucket's tensors at
            # a time); so do slots, where bucket i + 1's slot is free only once bucket i + 1 - slots was
            # applied. Their plans still carry the write-ahead (a slightly larger pool, never a short one).
            behind = self.one_behind and stream is None and path.buffers is None
            window = plan.window if behind else plan.slots
            pending: Bucket | None = None
            for b in plan.buckets:
                while acked < b.index - window + 1:
                    acked = self._await_applied(acked, version, report)
                t = time.perf_counter()
                path.acquire(b.slot)
                if stream is not None:
                    for i, x in zip(b.sources, self._pull(stream, b, version, report)):
                        srcs[i] = x
                cell = self._flags.cell(b.index)
                for idx, encode in self._bucket_encoders[b.index]:
                    encode([srcs[i] for i in idx], cell)
                if behind:
                    self._flags.mark(b.index)
                report.pack_s += time.perf_counter() - t
                if behind:
                    if pending is not None:
                        self._finish(pending, srcs, version, report)
                    pending = b
                    continue
                self._finish(b, srcs, version, report)
                if stream is not None:
                    for i in b.sources:
                        srcs[i] = None
            if pending is not None:
                self._finish(pending, srcs, version, report)
            while acked < len(plan.buckets):
                acked = self._await_applied(acked, version, report)
            reply = self._request({"op": Op.COMMIT, "version": version}, f"committing refit {version}")
        except PeerTimeout as err:  # the engine is gone or stalled: a status probe would wait as long again
            raise RefitError(f"refit {version} failed: {err}") from err
        except ControlError as err:
            raise RefitError(f"refit {version} failed: {err}", self._status_or_none()) from err
        self._unfinished = None
        self.engine_status = {"version": reply["version"], "state": reply["state"]}
        if reply.get("tables", self._engine_tables) != self._engine_tables:
            self._engine_tables, self._tables_changed_at = reply["tables"], version
        report.engine_fetch_s = float(reply.get("fetch_s", 0.0))
        report.engine_apply_s = float(reply.get("apply_s", 0.0))
        report.engine_process_s = float(reply.get("process_s", 0.0))
        report.engine_after_refit_s = float(reply.get("after_refit_s", 0.0))
        report.bytes = sum(b.nbytes for b in plan.buckets)
        report.buckets = len(plan.buckets)
        report.total_s = time.perf_counter() - t0
        return report

    def _replan_if_tables_changed(self) -> bool:
        """Read the engine's tables again and plan the same sources again if they changed since the
        plan was built, so this refit writes what the engine now asks for (e.g. a kernel layout)."""
        if not self.follow_tables or not self._plan_stale or self.plan_ is None:
            return False
        old, after = self.plan_.digest, self._tables_changed_at or self.engine_status.get("version")
        self.connect()
        new = self.plan(self.plan_.sources).digest
        log.info("engine tables changed after refit %s; planned again (digest %s→%s)", after, old[:12], new[:12])
        return True

    def _finish(self, b: Bucket, srcs: list[torch.Tensor | None], version: int, report: RefitReport) -> None:
        """Once bucket ``b``'s kernels are done: abort if they met a non-finite value, else hand it to the engine."""
        t = time.perf_counter()
        bad = self._flags.first_bad(b.index)
        report.pack_s += time.perf_counter() - t
        if bad is not None:
            plan = self._planned()
            culprits = [plan.sources[i].name for i in b.sources if not _finite(srcs[i])]
            self._abort(version, f"non-finite input in bucket {b.index}")
            raise RefitError(
                f"refit {version}: non-finite values in {culprits} found while packing bucket {b.index}; "
                f"{b.index} earlier buckets had reached the engine",
                self.engine_status,
            )
        self._path().publish(b.slot, b.nbytes)
        self.client.send(self._ready(b, version))

    def _ready(self, bucket: Bucket, version: int) -> dict:
        """The bucket's "ready" message, with its integrity sums when verifying."""
        ready = {"op": Op.READY, "version": version, "bucket": bucket.index}
        if self._sums:
            ready["sum"] = list(self._sums[bucket.index]())
        return ready

    def _screen(self, srcs: list[torch.Tensor]) -> None:
        """Raise NonFiniteError naming the first tensor holding NaN/Inf (nothing written yet)."""
        if self._finite is None:
            return
        bad = self._finite.first_bad(srcs)
        if bad is not None:
            raise mxfp8.NonFiniteError(
                f"tensor {self._planned().sources[bad].name!r} holds NaN or Inf; nothing was sent to the engine"
            )

    def _pull(
        self, stream: Iterator[tuple[str, torch.Tensor]], bucket: Bucket, version: int, report: RefitReport
    ) -> list[torch.Tensor]:
        """A stream's tensors for one bucket; bad input aborts the refit (earlier buckets landed)."""
        try:
            tensors = self._stream_bucket(stream, bucket)
            if self.check_finite:
                t = time.perf_counter()
                if bucket.index not in self._bucket_checks:
                    self._bucket_checks[bucket.index] = FiniteCheck([(tuple(x.shape), x.dtype) for x in tensors], self.device)
                bad = self._bucket_checks[bucket.index].first_bad(tensors)
                report.check_s += time.perf_counter() - t
                if bad is not None:
                    name = self._planned().sources[bucket.sources[bad]].name
                    raise mxfp8.NonFiniteError(f"tensor {name!r} holds NaN or Inf")
        except (PlanMismatch, mxfp8.NonFiniteError) as err:
            self._abort(version, f"bad input in bucket {bucket.index}: {err}")
            raise RefitError(f"refit {version} stopped at bucket {bucket.index}: {err}", self.engine_status) from err
        return tensors

    def _await_applied(self, acked: int, version: int, report: RefitReport) -> int:
        t = time.perf_counter()
        reply = self.client.recv(self.timeout_s, step=f"refit {version}, waiting for the engine to apply bucket {acked}")
        report.wait_s += time.perf_counter() - t
        try:
            reply = check_reply(reply, Op.APPLIED)
        except Malformed as bad:
            raise RefitError(
                f"refit {version}: engine at {self.address} broke the protocol while bucket {acked} was in flight: {bad.why}"
            ) from None
        if reply["op"] != Op.APPLIED or reply["bucket"] != acked:
            why = reply.get("problems") or reply.get("why", "")
            status = reply if "version" in reply and "state" in reply else None
            raise RefitError(f"refit {version}: engine answered {reply['op']!r} {why} while bucket {acked} was in flight", status)
        return acked + 1

    def _path(self) -> SendPath:
        if self.path is None:
            raise RuntimeError("no data path: call plan() first")
        return self.path

    def _check_path(self, path: SendPath, version: int) -> None:
        """What the engine exported is still what was checked at plan (no segment shrank); else abort the refit."""
        try:
            path.check()
        except ValueError as err:
            self._abort(version, "exported storage changed")
            raise RefitError(
                f"refit {version}: engine at {self.address} changed its exported storage: {err}", self.engine_status
            ) from None

    def _abort(self, version: int, why: str) -> None:
        """Tell the engine to stop; skip the "applied" answers still in flight before its "aborted".

        A hook: ``BroadcastSender`` aborts every rank and reads all each still owes."""
        try:
            self.client.send({"op": Op.ABORT, "version": version, "why": why})
            deadline = time.monotonic() + self.timeout_s
            while True:
                reply = check_reply(
                    self.client.recv(max(0.0, deadline - time.monotonic()), step="aborting"), Op.APPLIED, Op.ABORTED
                )
                if reply["op"] != Op.APPLIED:
                    break
            if "version" in reply and "state" in reply:
                self.engine_status = {"version": reply["version"], "state": reply["state"]}
            self._unfinished = None
        except (ControlError, Malformed):
            pass

    def _status_or_none(self) -> dict | None:
        """The engine's status after a refit failed on the control channel, None if it does not answer (a hook)."""
        try:
            return self.status()
        except ControlError:
            return None

    def status(self) -> dict:
        reply = self._valid(self.client.request({"op": Op.STATUS}, self.timeout_s, step="asking for status"), Op.STATUS)
        return {k: reply.get(k) for k in ("version", "state", "error")}

    def close(self, *, shutdown_engine: bool = False) -> None:
        if shutdown_engine:
            try:
                self.client.request({"op": Op.SHUTDOWN}, self.timeout_s, step="shutting the engine down")
            except ControlError:
                pass
        self.client.close()
        self._close_path()


def _finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t).all())
