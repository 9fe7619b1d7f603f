"""Refit engines that live on other GPUs or nodes: one broadcast per bucket feeds every engine rank.

``BroadcastSender`` is the ``Sender`` (same plan, checks, encoders and bucket loop) with two
parts given: its transport is ``BroadcastSend`` (``mxrefit.transport.broadcast``: a dedicated
gloo/NCCL group, bucket *i + 1* encoded while bucket *i* is on the wire) and its control channel
is a fan-out (``mxrefit.transport.fanout``) over the ``Receiver`` of every engine rank — replicas
and tensor-parallel ranks alike. All ranks give the same whole-model tables (a rank's slices are
in its ``shards()``), so there is one plan, checked by digest on every rank, and the wire carries
each encoded tensor once.

A refit completes only when every rank committed. When it fails (a rank lost, a collective
timed out, a rank refused), every live rank is told to abort and every answer it still owes is
read, so ``RefitError.engine_status`` gives each rank's version and state (``ranks``; a survivor
that applied some buckets says ``partial``, a silent one ``lost``). The failed group is never
reused: the next ``refit`` plans again (a new group) by itself once every rank is live, and a
lost rank is brought back with ``replace_engine`` (e.g. after restarting it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from mxrefit.devices import resolve
from mxrefit.plan.build import DEFAULT_BUCKET_BYTES, RefitPlan, SourceSpec
from mxrefit.plan.eligibility import QuantRules
from mxrefit.source.sender import RefitError, RefitReport, Sender, Tensors
from mxrefit.transport.broadcast import BroadcastSend
from mxrefit.transport.buffers import TransportError
from mxrefit.transport.control import ControlError, PeerTimeout
from mxrefit.transport.fanout import ControlFanOut, combined_status
from mxrefit.transport.protocol import Op


def _rank_summary(status: dict) -> str:
    ranks = status.get("ranks") or []
    return "; ".join(
        f"{r['name']}: " + ("lost" if r["state"] == "lost" else f"version {r['version']} {r['state']}") for r in ranks
    )


class BroadcastSender(Sender):
    """Trainer side for N engine ranks over one broadcast group; use from one thread.

    ``engines``: each rank's (control address, token), in group-rank order (rank i + 1).
    ``host``/``port``: where the ranks reach this trainer's rendezvous store (loopback by
    default; a reachable address for other nodes). ``backend``: "nccl" on CUDA, "gloo" on CPU
    by default. ``timeout_s`` bounds every control answer and every collective;
    ``rendezvous_timeout_s`` bounds forming the group at each plan. ``verify``: per-bucket
    integrity sums, checked by every rank over the bytes that arrived in its slot. ``rules``:
    the trainer's quantization rules, checked against the ranks' tables at plan (as ``Sender``).

    A ``Sender`` whose control channel is a ``ControlFanOut`` and whose transport is
    ``BroadcastSend``; it adds what N ranks need: a plan before a refit whenever a group may have
    broken, every rank's state in a failed refit's error, and ``replace_engine``.
    """

    client: ControlFanOut
    path: BroadcastSend

    def __init__(
        self,
        engines: Sequence[tuple[str, bytes]],
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        timeout_s: float = 60.0,
        rendezvous_timeout_s: float = 60.0,
        check_finite: bool = True,
        verify: bool = False,
        rules: QuantRules | None = None,
    ):
        self._engines = list(engines)
        fan = ControlFanOut(self._engines)
        device = resolve(device)
        path = BroadcastSend(
            fan, device, backend=backend, host=host, port=port, timeout_s=timeout_s, rendezvous_timeout_s=rendezvous_timeout_s
        )
        self._setup(
            ", ".join(a for a, _ in self._engines),
            device=device,
            bucket_bytes=bucket_bytes,
            slots=slots,
            transport=BroadcastSend.name,
            timeout_s=timeout_s,
            check_finite=check_finite,
            verify=verify,
            rules=rules,
            path=path,
        )
        self.client = fan
        self.backend = path.backend
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self._needs_plan = False
        self._recovered: dict | None = None

    # ---- plan: a new group each time -------------------------------------------------------
    def plan(self, specs: Iterable[SourceSpec]) -> RefitPlan:
        """``Sender.plan`` over every rank (each plan forms a new group); RefitError if a rank is lost."""
        self._require_every_rank()
        try:
            plan = super().plan(specs)
        except BaseException:
            self._needs_plan = True  # some ranks may hold the new plan, others not: plan again before a refit
            raise
        self._needs_plan = False
        return plan

    def _require_every_rank(self) -> None:
        if self.client.lost:
            raise RefitError(
                f"engine ranks lost ({self.client.describe_lost()}): restart them and call replace_engine(index, address, token)",
                self.status(),
            )

    def replace_engine(self, index: int, address: str, token: bytes) -> None:
        """Talk to rank ``index`` at a new address (a restarted engine); the next refit plans again."""
        self.client.replace(index, address, token)
        self._engines[index] = (address, token)
        self._tables = None
        self._needs_plan = True

    # ---- refit: one code path, plus recovery ----------------------------------------------
    def refit(self, tensors: Tensors, *, version: int | None = None) -> RefitReport:
        """``Sender.refit`` to every rank; on failure every rank's state is in the RefitError."""
        self._require_every_rank()
        if self.plan_ is None and isinstance(tensors, Mapping):
            self.plan([SourceSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        elif self._needs_plan and self.plan_ is not None and not self._plan_stale:
            # a stale plan (tables changed) is planned again by Sender.refit, which reports it. The
            # merged "committed" carries the first rank's tables version; ranks that then describe
            # different tables fail at connect (tensor-parallel ranks never change theirs: a slice of
            # permuted rows is no row range of the checkpoint)
            self.plan(self.plan_.sources)
        self._recovered = None
        try:
            return super().refit(tensors, version=version)
        except (RefitError, ControlError, TransportError) as err:
            self._needs_plan = True
            self.path.discard()
            status = self._recovered if self._recovered is not None else self._recover(str(err))
            reason = err.reason if isinstance(err, RefitError) else str(err)
            raise RefitError(f"{reason}; ranks: {_rank_summary(status)}", status) from err

    def _recover(self, why: str) -> dict:
        """Tell every live rank to abort, read all it still owes (one deadline), and report each rank."""
        fan = self.client
        for i in fan.live:
            try:
                fan.send_to(i, {"op": Op.ABORT, "why": why[:200]})
            except ControlError as err:
                fan.lose(i, str(err))
        deadline = time.monotonic() + self.timeout_s
        statuses = {}
        step = "aborting every rank after a failed refit"
        for i in fan.live:
            try:
                statuses[i] = fan.drain(i, deadline, step)[-1]
            except PeerTimeout:
                fan.lose(i, f"no answer within {self.timeout_s:g} s while {step}")
            except ControlError as err:
                fan.lose(i, str(err))
        self.engine_status = combined_status(statuses, fan.lost, fan.names)
        self._recovered = self.engine_status
        return self.engine_status

    def _abort(self, version: int, why: str) -> None:
        self._recover(why)

    def _status_or_none(self) -> dict | None:
        return self._recover("the trainer gave up on the refit")

    def status(self) -> dict:
        """Combined status (``ready`` only if every rank is at one version) with each rank's in ``ranks``."""
        fan = self.client
        fan.send({"op": Op.STATUS})
        replies = fan.gather(self.timeout_s, step="asking every rank for its status")
        return combined_status(replies, fan.lost, fan.names)
