"""Trainer side of a refit: plan once, then per step encode buckets straight where they go.

Two data paths, chosen once at ``plan``:
- ``direct`` (when the engine can export its storage: CUDA on the same GPU, or host engines
  whose storage lives in shared memory): every part is encoded straight into the engine's
  own bytes; no buffer on either side, no engine-side copy;
- buffers (``cuda_ipc`` / ``shm``): parts are encoded into two persistent slots and the
  engine applies each bucket as one batched copy.
  For engines on other GPUs or nodes, ``mxrefit.source.broadcast_sender.BroadcastSender`` runs this same
  loop over broadcast buffers: ``publish`` starts a collective per bucket, each engine rank
  ``fetch``-es it into its own slot (``mxrefit.transport.broadcast``).
Per step the work is: check the tensors are the planned ones (identity-cached), one
non-finite screen over every tensor (``mxrefit.formats.finite_check``), then per bucket one grouped
launch per format + a "ready" message; the engine answers "applied" once the bucket's bytes
are in place (and processed, for engines that post-process), and bucket *i* is encoded only
after bucket *i - slots* was applied.

``refit`` also takes a stream of ``(name, tensor)`` pairs in the plan's order (e.g. FSDP2
``full_tensor()`` per parameter): tensors are then pulled bucket by bucket and dropped after
encoding, so the whole model is never materialized. A stream cannot be screened before the
first write; a bad tensor then aborts the refit, which leaves the engine ``partial`` (its
previous version named) until the next complete refit.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from mxrefit.devices import resolve
from mxrefit.errors import MxrefitError
from mxrefit.formats import get_format, mxfp8
from mxrefit.formats._common import NO_BAD, bad_flag, first_bad
from mxrefit.formats.finite_check import FiniteCheck
from mxrefit.plan.build import (
    DEFAULT_BUCKET_BYTES,
    PlanMismatch,
    RefitPlan,
    SourceSpec,
    build_plan,
    sources_to_msg,
    tables_from_msg,
)
from mxrefit.plan.eligibility import QuantRules, check_rules
from mxrefit.transport.buffers import TransferBuffers
from mxrefit.transport.bytesum import ByteSum
from mxrefit.transport.control import ControlClient, ControlError, PeerTimeout
from mxrefit.transport.direct import OpenedExports, open_exports
from mxrefit.transport.factory import KINDS, create_buffers, default_kind
from mxrefit.transport.protocol import Malformed, Op, check_reply

log = logging.getLogger("mxrefit.source.sender")

TRANSPORTS = ("direct", *KINDS)
Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class RefitError(MxrefitError, RuntimeError):
    """A refit did not complete; ``engine_status`` is what the engine reported (version, state)."""

    def __init__(self, message: str, engine_status: dict | None = None):
        self.engine_status = engine_status
        self.reason = message
        if engine_status:
            message += f" (engine holds version {engine_status.get('version')}, state {engine_status.get('state')})"
        super().__init__(message)


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
    extra: dict = field(default_factory=dict)


class Sender:
    """Trainer side of a refit; use from one thread. ``transport``: None (direct when the
    engine can export its storage, else buffers for this device), ``"direct"``, ``"shm"`` or
    ``"cuda_ipc"``."""

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
    ):
        """``verify``: per-bucket integrity sums (``mxrefit.transport.bytesum``) checked by the engine
        before it applies a bucket; a mismatch fails the refit with the bucket named.
        ``rules``: the trainer's own quantization rules; the plan is refused (PlanMismatch naming
        each tensor) where the engine's tables quantize differently."""
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
        self.device = resolve(device)
        self.rules = rules
        self.bucket_bytes = bucket_bytes
        self.slots = slots
        self.requested_transport = transport
        self.transport = ""
        self.timeout_s = timeout_s
        self.check_finite = check_finite
        self.verify = verify
        self.client = self._make_client(address, token)
        self.address = address
        self.plan_: RefitPlan | None = None
        self.buffers: TransferBuffers | None = None
        self.exports: OpenedExports | None = None
        self.engine_status: dict = {}
        self._engine_info: dict = {}
        self._tables = None
        self._plan_id: str | None = None
        self._adoptions: list[str] = []
        self._last_sources: list[torch.Tensor] | None = None
        self._unfinished: int | None = None

    # ---- set-up, once ----------------------------------------------------------------------
    def _make_client(self, address: str, token: bytes) -> ControlClient:
        return ControlClient(address, token)

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

    def connect(self) -> None:
        self._preempt("a trainer connected")
        reply = self._request({"op": Op.HELLO}, "connecting")
        try:
            self._tables = tables_from_msg(reply)
        except Exception as err:  # the engine's tables are its data: any malformation is the engine's error
            raise RefitError(f"engine at {self.address} sent malformed tables: {type(err).__name__}: {err}"[:1000]) from None
        self._engine_info = {"exportable": reply["exportable"], "device": reply["device"]}
        self.engine_status = {"version": reply["version"], "state": reply["state"]}

    def _choose_transport(self) -> str:
        same_kind = self._engine_info.get("device") == self.device.type
        can_direct = self._engine_info.get("exportable") and same_kind
        wanted = self.requested_transport
        if wanted == "direct" and not can_direct:
            raise ValueError(
                f"transport 'direct' needs an engine that exports its storage on this device type "
                f"({self.device.type}); the engine at {self.address} is on {self._engine_info.get('device')} "
                f"and {'can' if self._engine_info.get('exportable') else 'cannot'} export"
            )
        if wanted is None:
            return "direct" if can_direct else default_kind(self.device)
        return wanted

    def plan(self, specs: Iterable[SourceSpec]) -> RefitPlan:
        """Build the plan for these trainer tensors, wire the data path, and hand both to the engine."""
        if self._tables is None:
            self.connect()
        params, destinations = self._tables
        if self.rules is not None:
            check_rules(self.rules, destinations)
        plan = build_plan(list(specs), params, destinations, bucket_bytes=self.bucket_bytes, slots=self.slots)
        transport = self._choose_transport()
        plan_id = secrets.token_hex(8)  # names this adoption: the engine refuses a begin from a trainer planned earlier
        msg = {
            "op": Op.PLAN,
            "plan_id": plan_id,
            "sources": sources_to_msg(plan.sources),
            "bucket_bytes": plan.bucket_bytes,
            "slots": plan.slots,
            "digest": plan.digest,
            "verify": self.verify,
        }
        self._close_data_path(keep_buffers=transport != "direct")
        if transport == "direct":
            msg["transport"] = "direct"
        else:
            self._ensure_buffers(transport, plan)
            msg["transport"] = "buffers"
        reply = self._send_plan(msg)
        if reply["digest"] != plan.digest:
            raise RefitError(f"engine at {self.address} answered the plan with another digest ({reply['digest'][:12]})")
        if transport == "direct":
            if not isinstance(reply.get("exports"), dict):
                raise RefitError(f"engine at {self.address} planned direct writes without exporting its storage")
            try:
                self.exports = open_exports(reply["exports"], self.device if self.device.type == "cuda" else None)
            except (ValueError, LookupError) as err:
                if self.requested_transport is None:  # e.g. an engine of another user: its memory is not ours to write
                    log.warning(
                        "engine at %s exported storage this trainer will not write (%s); using buffers", self.address, err
                    )
                    self._engine_info["exportable"] = False
                    return self.plan(plan.sources)
                raise RefitError(f"engine at {self.address} exported storage this trainer will not write: {err}") from None
        self.transport = transport
        self.plan_, self._plan_id = plan, plan_id
        adoption = reply["adoption"]
        self._adoptions = adoption if isinstance(adoption, list) else [adoption]
        self._last_sources = None
        self._build_encoders(plan)
        return plan

    def _ensure_buffers(self, kind: str, plan: RefitPlan) -> None:
        """Buffers for this plan: the current ones when they fit, else new ones."""
        if self.buffers is None or self.buffers.nbytes < plan.bucket_bytes or len(self.buffers.buffers) != plan.slots:
            self._close_data_path()
            self.buffers = create_buffers(kind, plan.slots, plan.bucket_bytes, self.device)

    def _send_plan(self, msg: dict) -> dict:
        """Hand the plan (and the buffers' description) to the engine; its reply."""
        if msg["transport"] == "buffers":
            msg["buffers"] = self.buffers.describe()
        return self._request(msg, "sending the plan")

    def _close_data_path(self, keep_buffers: bool = False) -> None:
        if self.exports is not None:
            self.exports.close()
            self.exports = None
        if self.buffers is not None and not keep_buffers:
            self.buffers.close()
            self.buffers = None

    def _run_view(self, bucket, run) -> torch.Tensor:
        """The bytes this side writes for one run of a bucket (flat uint8)."""
        if self.transport == "direct":
            return self.exports.tensors[run.param][run.param_offset : run.param_offset + run.nbytes]
        return self.buffers.buffers[bucket.slot][run.offset : run.offset + run.nbytes]

    def _part_view(self, plan: RefitPlan, bucket, part) -> torch.Tensor:
        t = part.target
        if self.transport == "direct":
            flat = self.exports.tensors[t.param][t.offset : t.offset + t.nbytes]
        else:
            flat = self.buffers.buffers[bucket.slot][part.offset : part.offset + t.nbytes]
        return flat.view(t.dtype).view(t.shape)

    def _build_encoders(self, plan: RefitPlan) -> None:
        views: dict[int, list[torch.Tensor | None]] = {}
        for b in plan.buckets:
            for p in b.parts:
                views.setdefault(p.source, [None] * 2)[p.role] = self._part_view(plan, b, p)
        self._bucket_encoders = []
        for b in plan.buckets:
            by_format: dict[str, list[int]] = {}
            for i in b.sources:
                by_format.setdefault(plan.formats[i], []).append(i)
            encs = []
            for fmt_name, idx in by_format.items():
                specs = [(plan.sources[i].shape, plan.sources[i].dtype) for i in idx]
                outs = [[v for v in views[i] if v is not None] for i in idx]
                encs.append((idx, get_format(fmt_name).encoder(specs, outs)))
            self._bucket_encoders.append(encs)
        self._bad = bad_flag(self.device)
        self._sums = [ByteSum([self._run_view(b, r) for r in b.runs]) for b in plan.buckets] if self.verify else []
        self._finite: FiniteCheck | None = None
        self._bucket_checks: dict[int, FiniteCheck] = {}

    # ---- every step ------------------------------------------------------------------------
    def _check_source(self, s: SourceSpec, t: torch.Tensor) -> str | None:
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            return f"tensor {s.name!r}: planned {s.shape} {s.dtype}, got {tuple(t.shape)} {t.dtype}"
        if t.device != self.device:
            return f"tensor {s.name!r} is on {t.device}, the sender works on {self.device}"
        if not t.is_contiguous():
            return f"tensor {s.name!r} is not contiguous (strides {t.stride()})"
        return None

    def _ordered_sources(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        plan = self.plan_
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

    def _stream_bucket(self, stream: Iterator[tuple[str, torch.Tensor]], bucket) -> list[torch.Tensor]:
        """Pull one bucket's tensors from a stream, in plan order, checked like a mapping's."""
        out = []
        for i in bucket.sources:
            spec = self.plan_.sources[i]
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
        written; a stream is checked bucket by bucket (see the module docstring).
        """
        t0 = time.perf_counter()
        streaming = not isinstance(tensors, Mapping)
        if self.plan_ is None:
            if streaming:
                raise ValueError("plan() the stream's specs before the first refit from a stream")
            self.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        plan = self.plan_
        srcs: list[torch.Tensor | None] = [None] * len(plan.sources)
        if not streaming:
            srcs = self._ordered_sources(tensors)
            if self.check_finite and self._finite is None:
                self._finite = FiniteCheck([(s.shape, s.dtype) for s in plan.sources], self.device)
            self._screen(srcs)
        stream = iter(tensors) if streaming else None
        version = int(self.engine_status.get("version", 0)) + 1 if version is None else version
        report = RefitReport(version, transport=self.transport, check_s=time.perf_counter() - t0)
        if self._unfinished is not None:
            self._preempt(f"refit {self._unfinished} did not finish; refit {version} starts")
        self._unfinished = version
        acked = 0
        try:
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
            if self.exports is not None:
                self._verify_exports(version)
            self._bad.fill_(NO_BAD)  # an aborted refit leaves its flag behind
            for b, encoders in zip(plan.buckets, self._bucket_encoders):
                while acked < b.index - plan.slots + 1:
                    acked = self._await_applied(acked, version, report)
                t = time.perf_counter()
                if self.buffers is not None:
                    self.buffers.acquire(b.slot)
                if streaming:
                    for i, x in zip(b.sources, self._pull(stream, b, version, report)):
                        srcs[i] = x
                for idx, encode in encoders:
                    encode([srcs[i] for i in idx], self._bad)
                bad = first_bad(self._bad)
                report.pack_s += time.perf_counter() - t
                if bad is not None:
                    culprits = [plan.sources[i].name for i in b.sources if not bool(torch.isfinite(srcs[i]).all())]
                    self._abort(version, f"non-finite input in bucket {b.index}")
                    raise RefitError(
                        f"refit {version}: non-finite values in {culprits} found while packing bucket {b.index}; "
                        f"{b.index} earlier buckets had reached the engine",
                        self.engine_status,
                    )
                if streaming:
                    for i in b.sources:
                        srcs[i] = None
                if self.buffers is not None:
                    self.buffers.publish(b.slot, b.nbytes)
                self.client.send(self._ready(b, version))
            while acked < len(plan.buckets):
                acked = self._await_applied(acked, version, report)
            reply = self._request({"op": Op.COMMIT, "version": version}, f"committing refit {version}")
        except PeerTimeout as err:  # the engine is gone or stalled: a status probe would wait as long again
            raise RefitError(f"refit {version} failed: {err}") from err
        except ControlError as err:
            raise RefitError(f"refit {version} failed: {err}", self._status_or_none()) from err
        self._unfinished = None
        self.engine_status = {"version": reply["version"], "state": reply["state"]}
        report.engine_fetch_s = float(reply.get("fetch_s", 0.0))
        report.engine_apply_s = float(reply.get("apply_s", 0.0))
        report.engine_process_s = float(reply.get("process_s", 0.0))
        report.engine_after_refit_s = float(reply.get("after_refit_s", 0.0))
        report.bytes = sum(b.nbytes for b in plan.buckets)
        report.buckets = len(plan.buckets)
        report.total_s = time.perf_counter() - t0
        return report

    def _ready(self, bucket, version: int) -> dict:
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
                f"tensor {self.plan_.sources[bad].name!r} holds NaN or Inf; nothing was sent to the engine"
            )

    def _pull(self, stream, bucket, version: int, report: RefitReport) -> list[torch.Tensor]:
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
                    name = self.plan_.sources[bucket.sources[bad]].name
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

    def _verify_exports(self, version: int) -> None:
        """The engine's exported segments are still the ones checked at plan (none shrank); else abort the refit."""
        try:
            self.exports.verify()
        except ValueError as err:
            self._abort(version, "exported storage changed")
            raise RefitError(
                f"refit {version}: engine at {self.address} changed its exported storage: {err}", self.engine_status
            ) from None

    def _abort(self, version: int, why: str) -> None:
        """Tell the engine to stop; skip the "applied" answers still in flight before its "aborted"."""
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
        self._close_data_path()
