"""Trainer side of a refit: plan once, then per step encode buckets straight into persistent buffers.

Per step the work is: check the tensors are the planned ones (identity-cached), one
non-finite pass (``torch._foreach_norm``, one launch), then per bucket one grouped MXFP8
launch + one ``_foreach_copy_`` into the bucket's slot, a "ready" message, and the engine's
"applied" answer before that slot is reused two buckets later.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from mxrefit.formats import get_format, mxfp8
from mxrefit.plan import DEFAULT_BUCKET_BYTES, PlanMismatch, RefitPlan, SourceSpec, build_plan, sources_to_msg, tables_from_msg
from mxrefit.transport.buffers import TransferBuffers, create_buffers, default_kind
from mxrefit.transport.control import ControlClient, ControlError

_NO_BAD = 2**31 - 1


class RefitError(RuntimeError):
    """A refit did not complete; ``engine_status`` is what the engine reported (version, state)."""

    def __init__(self, message: str, engine_status: dict | None = None):
        self.engine_status = engine_status
        if engine_status:
            message += f" (engine holds version {engine_status.get('version')}, state {engine_status.get('state')})"
        super().__init__(message)


@dataclass
class RefitReport:
    version: int
    check_s: float = 0.0
    pack_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    engine_apply_s: float = 0.0
    engine_process_s: float = 0.0
    engine_after_refit_s: float = 0.0
    bytes: int = 0
    buckets: int = 0
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Sender:
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
    ):
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.slots = slots
        self.transport = transport or default_kind(self.device)
        self.timeout_s = timeout_s
        self.check_finite = check_finite
        self.client = ControlClient(address, token)
        self.address = address
        self.plan_: RefitPlan | None = None
        self.buffers: TransferBuffers | None = None
        self.engine_status: dict = {}
        self._tables = None
        self._last_sources: list[torch.Tensor] | None = None

    # ---- set-up, once ----------------------------------------------------------------------
    def _request(self, msg: dict, step: str) -> dict:
        reply = self.client.request(msg, self.timeout_s, step=step)
        if reply.get("op") in ("error", "rejected"):
            problems = reply.get("problems") or [reply.get("why", "")]
            if reply.get("kind") == "plan_mismatch":
                raise PlanMismatch(list(problems))
            raise RefitError(f"engine at {self.address} refused {msg['op']!r}: {'; '.join(map(str, problems))}", reply)
        return reply

    def connect(self) -> None:
        reply = self._request({"op": "hello"}, "connecting")
        self._tables = tables_from_msg(reply)
        self.engine_status = {"version": reply["version"], "state": reply["state"]}

    def plan(self, specs: Iterable[SourceSpec]) -> RefitPlan:
        """Build the plan for these trainer tensors, allocate the buffers, and hand both to the engine."""
        if self._tables is None:
            self.connect()
        params, destinations = self._tables
        plan = build_plan(list(specs), params, destinations, bucket_bytes=self.bucket_bytes, slots=self.slots)
        if self.buffers is None or self.buffers.nbytes < plan.bucket_bytes or len(self.buffers.buffers) != plan.slots:
            if self.buffers is not None:
                self.buffers.close()
            self.buffers = create_buffers(self.transport, plan.slots, plan.bucket_bytes, self.device)
        self._request(
            {"op": "plan", "sources": sources_to_msg(plan.sources), "bucket_bytes": plan.bucket_bytes,
             "slots": plan.slots, "digest": plan.digest, "buffers": self.buffers.describe()},
            "sending the plan",
        )
        self.plan_ = plan
        self._build_encoders(plan)
        return plan

    def _build_encoders(self, plan: RefitPlan) -> None:
        bufs = self.buffers.buffers
        self._part_views: dict[int, list[torch.Tensor]] = {}
        for b in plan.buckets:
            for p in b.parts:
                t = p.target
                view = bufs[b.slot][p.offset : p.offset + t.nbytes].view(t.dtype).view(t.shape)
                self._part_views.setdefault(p.source, [None] * 2)[p.role] = view
        self._bucket_encoders = []
        for b in plan.buckets:
            by_format: dict[str, list[int]] = {}
            for i in b.sources:
                by_format.setdefault(plan.formats[i], []).append(i)
            encs = []
            for fmt_name, idx in by_format.items():
                specs = [(plan.sources[i].shape, plan.sources[i].dtype) for i in idx]
                outs = [[v for v in self._part_views[i] if v is not None] for i in idx]
                encs.append((idx, get_format(fmt_name).encoder(specs, outs)))
            self._bucket_encoders.append(encs)
        self._bad = torch.full((1,), _NO_BAD, dtype=torch.int32, device=self.device)

    # ---- every step ------------------------------------------------------------------------
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
        problems = []
        for s, t in zip(plan.sources, srcs):
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                problems.append(f"tensor {s.name!r}: planned {s.shape} {s.dtype}, got {tuple(t.shape)} {t.dtype}")
            elif t.device != self.device:
                problems.append(f"tensor {s.name!r} is on {t.device}, the sender works on {self.device}")
            elif not t.is_contiguous():
                problems.append(f"tensor {s.name!r} is not contiguous (strides {t.stride()})")
        if problems:
            raise PlanMismatch(problems)
        self._last_sources = srcs
        return srcs

    def _first_non_finite(self, srcs: list[torch.Tensor]) -> str | None:
        norms = torch._foreach_norm(srcs)
        finite = torch.isfinite(torch.stack(norms))
        if bool(finite.all()):
            return None
        for i in torch.nonzero(~finite).flatten().tolist():  # a norm can overflow: confirm per tensor
            if not bool(torch.isfinite(srcs[i]).all()):
                return self.plan_.sources[i].name
        return None

    @torch.no_grad()
    def refit(self, tensors: Mapping[str, torch.Tensor], *, version: int | None = None) -> RefitReport:
        """Send every tensor to the engine; returns timings. Raises before any engine write on bad input."""
        t0 = time.perf_counter()
        if self.plan_ is None:
            self.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        plan = self.plan_
        srcs = self._ordered_sources(tensors)
        if self.check_finite:
            bad_name = self._first_non_finite(srcs)
            if bad_name is not None:
                raise mxfp8.NonFiniteError(f"tensor {bad_name!r} holds NaN or Inf; nothing was sent to the engine")
        version = int(self.engine_status.get("version", 0)) + 1 if version is None else version
        report = RefitReport(version, check_s=time.perf_counter() - t0)
        self._request({"op": "begin", "version": version, "digest": plan.digest}, f"starting refit {version}")
        acked = 0
        try:
            for b, encoders in zip(plan.buckets, self._bucket_encoders):
                while acked < b.index - plan.slots + 1:
                    acked = self._await_applied(acked, version, report)
                t = time.perf_counter()
                for idx, encode in encoders:
                    encode([srcs[i] for i in idx], self._bad)
                bad = int(self._bad.item()) if self.device.type == "cuda" else int(self._bad)
                report.pack_s += time.perf_counter() - t
                if bad != _NO_BAD:
                    culprits = [plan.sources[i].name for i in b.sources if not bool(torch.isfinite(srcs[i]).all())]
                    self._abort(version, f"non-finite input in bucket {b.index}")
                    raise RefitError(
                        f"refit {version}: non-finite values in {culprits} found while packing bucket {b.index}; "
                        f"{b.index} earlier buckets had reached the engine", self.engine_status)
                self.client.send({"op": "ready", "version": version, "bucket": b.index})
            while acked < len(plan.buckets):
                acked = self._await_applied(acked, version, report)
            reply = self._request({"op": "commit", "version": version}, f"committing refit {version}")
        except ControlError as err:
            raise RefitError(f"refit {version} failed: {err}", self._status_or_none()) from err
        self.engine_status = {"version": reply["version"], "state": reply["state"]}
        report.engine_apply_s = float(reply.get("apply_s", 0.0))
        report.engine_process_s = float(reply.get("process_s", 0.0))
        report.engine_after_refit_s = float(reply.get("after_refit_s", 0.0))
        report.bytes = sum(b.nbytes for b in plan.buckets)
        report.buckets = len(plan.buckets)
        report.total_s = time.perf_counter() - t0
        return report

    def _await_applied(self, acked: int, version: int, report: RefitReport) -> int:
        t = time.perf_counter()
        reply = self.client.recv(self.timeout_s, step=f"refit {version}, waiting for the engine to apply bucket {acked}")
        report.wait_s += time.perf_counter() - t
        if reply.get("op") != "applied" or int(reply.get("bucket", -1)) != acked:
            raise RefitError(f"refit {version}: engine answered {reply.get('op')!r} {reply.get('problems', '')} while bucket {acked} was in flight", reply)
        return acked + 1

    def _abort(self, version: int, why: str) -> None:
        try:
            reply = self.client.request({"op": "abort", "version": version, "why": why}, self.timeout_s, step="aborting")
            self.engine_status = {"version": reply.get("version"), "state": reply.get("state")}
        except ControlError:
            pass

    def _status_or_none(self) -> dict | None:
        try:
            return self.status()
        except ControlError:
            return None

    def status(self) -> dict:
        reply = self.client.request({"op": "status"}, self.timeout_s, step="asking for status")
        return {k: reply.get(k) for k in ("version", "state", "error")}

    def close(self, *, shutdown_engine: bool = False) -> None:
        if shutdown_engine:
            try:
                self.client.request({"op": "shutdown"}, self.timeout_s, step="shutting the engine down")
            except ControlError:
                pass
        self.client.close()
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
