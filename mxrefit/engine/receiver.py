"""Engine side of a refit: answers the trainer, applies buckets as batched copies, keeps versions.

The engine holds ``version`` (the last complete refit) and ``state``: ``ready`` when its
weights are exactly that version, ``partial`` when a later refit wrote some buckets and did
not finish (a failed or interrupted refit). A partial engine says so on every status call;
the next complete refit repairs it.

``transactional=True`` lands every refit in a shadow copy of the engine's storage and touches
the engine only at commit, once every bucket arrived (and, with the trainer's ``verify``,
passed its integrity sums): a failed refit then leaves the previous version serving, still
``ready``. Commit writes in place, bucket by bucket with the engine's usual processing, so
parameter addresses (and captured CUDA graphs) stay valid. Its price is the shadow's memory
(the engine's whole storage) and one more copy per refit.

Tables that change: an engine may learn at a refit what its kernels read (a kernel layout) and
then advertise it (``Engine.tables_version``). After each commit the receiver re-reads the tables
if that version moved, and the ``tables`` and ``committed`` replies carry it (``"tables"``), so
the trainer plans again before its next refit. The adopted plan stays adopted meanwhile: its
views are built, and the engine serves it until a new plan replaces it.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from mxrefit.devices import sync_current
from mxrefit.engine.base import Engine
from mxrefit.engine.shards import check_shards, local_nbytes, run_copies, strided
from mxrefit.errors import MxrefitError
from mxrefit.plan.build import (
    WRITE_AHEAD,
    Bucket,
    PlanMismatch,
    RefitPlan,
    align,
    build_plan,
    sources_from_msg,
    tables_to_msg,
)
from mxrefit.transport.base import LandInit, LandPath
from mxrefit.transport.buffers import TransportError
from mxrefit.transport.bytesum import ByteSum
from mxrefit.transport.control import ControlError, ControlServer, PeerTimeout
from mxrefit.transport.direct import allocate
from mxrefit.transport.protocol import MAX_BUFFER_BYTES, MAX_BUFFERS, MAX_PROBLEMS, Malformed, Op, check_int, check_request, text
from mxrefit.transport.registry import decline, land_path_class

log = logging.getLogger("mxrefit.engine.receiver")

_MAX_ERROR_CHARS = 1000
HISTORY_REFITS = 100


@dataclass
class ReceiveStats:
    """Per-refit engine-side timings, seconds."""

    version: int
    fetch_s: float = 0.0
    apply_s: float = 0.0
    process_s: float = 0.0
    after_refit_s: float = 0.0
    buckets: int = 0
    bytes: int = 0
    wall_s: float = 0.0


@dataclass
class _Applier:
    """Pre-built source/destination views of one bucket: applying it is one batched copy."""

    srcs: list[torch.Tensor] = field(default_factory=list)
    dsts: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    @classmethod
    def copies(cls, copies, src_of, dst: dict[str, torch.Tensor]) -> "_Applier":
        """``copies`` = (run, Copy) pairs: each from ``src_of(run, copy)`` into its place in ``dst[run.param]``."""
        app = cls()
        for r, c in copies:
            app.srcs.append(src_of(r, c))
            app.dsts.append(strided(dst[r.param], c.dst, c.dst_pitch, c.rows, c.width))
            app.nbytes += c.rows * c.width
        return app

    @classmethod
    def landing(cls, slot: torch.Tensor | None, bucket: Bucket, copies: list, dst: dict[str, torch.Tensor]) -> "_Applier":
        """A bucket's applier: copies from the ``slot`` its bytes arrive in, or none where they land in place."""
        if slot is None:
            return cls(nbytes=sum(r.nbytes for r in bucket.runs))
        return cls.copies(copies, lambda r, c: strided(slot, c.src, c.src_pitch, c.rows, c.width), dst)

    def __call__(self) -> None:
        if not self.srcs:
            return
        if self.srcs[0].device == self.dsts[0].device:
            torch._foreach_copy_(self.dsts, self.srcs)
        else:
            for d, s in zip(self.dsts, self.srcs):
                d.copy_(s, non_blocking=True)


class Receiver:
    """The engine side. The control server listens on a private Unix socket by default; an engine
    rank on another node than its trainer needs ``address="tcp://<host>:<port>"`` with
    ``allow_remote=True`` (the token then crosses that network in clear)."""

    def __init__(
        self,
        engine: Engine,
        *,
        address: str | None = None,
        token: bytes | None = None,
        tcp: bool = False,
        timeout_s: float = 60.0,
        transactional: bool = False,
        allow_remote: bool = False,
    ):
        self.engine = engine
        self.transactional = transactional
        self.timeout_s = timeout_s
        self.server = ControlServer(address, token=token, tcp=tcp, allow_remote=allow_remote)
        self.version = 0
        self.state = "ready"
        self.last_error: str | None = None
        self.history: deque[ReceiveStats] = deque(maxlen=HISTORY_REFITS)  # bounded: refits run for days
        self._tables_version = engine.tables_version
        self._params = engine.params()
        self._destinations = engine.destinations()
        self._shards = engine.shards()
        check_shards(self._params, self._destinations, self._shards)
        self._plan: RefitPlan | None = None
        self._plan_id: str | None = None
        self._adoption: str | None = None  # the engine's own name for the adopted plan; a begin must echo it
        self._path: LandPath | None = None  # the adopted plan's transport, engine side
        self._appliers: list[_Applier] = []
        self._commits: list[_Applier] = []
        self._sums: list[ByteSum] = []
        self._shadow: torch.Tensor | None = None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def token(self) -> bytes:
        return self.server.token

    def status(self) -> dict:
        """Version and state; ``rejected`` counts frames dropped from strangers or garbage."""
        return {"version": self.version, "state": self.state, "error": self.last_error, "rejected": self.server.rejected}

    # ---- message handling -------------------------------------------------------------
    def serve(self, *, refits: int | None = None, idle_timeout_s: float | None = None) -> None:
        """Answer the trainer until it says shutdown (or ``refits`` refits have ended).

        No message ends this loop but ``shutdown``: whatever a handler raises is logged and answered
        with an ``engine`` error carrying the status (the engine never dies from a message).
        """
        ended = 0
        while refits is None or ended < refits:
            msg = self.server.recv(idle_timeout_s, step="waiting for the next refit")
            op = msg["op"]
            try:
                if op == Op.SHUTDOWN:
                    self._reply({"op": Op.BYE, **self.status()})
                    return
                if op == Op.BEGIN:
                    ended += 1
                    self._refit(msg)
                else:
                    self._answer_setup(msg)
            except Exception as err:
                log.exception("answering %r", op[:40])
                self._fail(f"the engine failed answering {op!r:.40}: {type(err).__name__}: {text(str(err))}")
                self._reply({"op": Op.ERROR, "kind": "engine", "problems": [self.last_error], **self.status()})

    def _answer_setup(self, msg: dict) -> None:
        """Answer a message between refits; a malformed one gets an error reply, never an exception."""
        op = msg["op"]
        try:
            reply = self._setup_reply(op, msg)
        except TransportError as err:
            reply = {"op": Op.ERROR, "kind": "transport", "problems": [str(err)]}
        except Exception as err:  # a bad field from the token holder must not stop the engine
            if isinstance(err, PlanMismatch):
                problems = _bounded(err.problems)
            elif isinstance(err, Malformed):
                problems = [err.why]
            else:
                problems = [f"{op!r:.40}: {type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]]
            if op == Op.PLAN:
                decline(msg, "; ".join(map(str, problems)))
            reply = {"op": Op.ERROR, "kind": "plan_mismatch" if op == Op.PLAN else "bad_request", "problems": problems}
        if reply["op"] == Op.ERROR:
            reply.update(self.status())
        self._reply(reply)

    def _setup_reply(self, op: str, msg: dict) -> dict:
        if op not in (Op.HELLO, Op.PLAN, Op.STATUS, Op.ABORT, Op.CHECKSUM):
            return {"op": Op.ERROR, "kind": "protocol", "problems": [f"unexpected op {op!r:.40} between refits"]}
        check_request(msg)
        if op == Op.HELLO:
            exportable = bool(self.engine.exportable) and not self._shards  # direct writes are whole tensors
            return {
                "op": Op.TABLES,
                **tables_to_msg(self._params, self._destinations),
                **self.status(),
                "exportable": exportable,
                "device": self.engine.device.type,
                "tables": self._tables_version,
            }
        if op == Op.PLAN:
            return self._adopt_plan(msg)
        if op == Op.STATUS:
            return {"op": Op.STATUS, **self.status()}
        if op == Op.ABORT:  # nothing in flight (a refit already ended); a trainer resyncing gets the status
            return {"op": Op.ABORTED, **self.status()}
        return {"op": Op.CHECKSUM, "sha256": self._checksums(msg["ranges"])}

    def _adopt_plan(self, msg: dict) -> dict:
        """Check the trainer's plan against our own, then wire the data path; returns the reply.

        Everything that can refuse a plan (its fields, digest, transport, the trainer's buffers)
        is checked before the engine is touched, so a refused plan leaves the adopted one in place.
        """
        sources = sources_from_msg(msg["sources"])
        bucket_bytes = check_int(msg["bucket_bytes"], "bucket_bytes", 1, MAX_BUFFER_BYTES)
        slots = check_int(msg["slots"], "slots", 1, MAX_BUFFERS)
        # a trainer from before the field may run one behind: it gets the longer window
        write_ahead = check_int(msg.get("write_ahead", WRITE_AHEAD), "write_ahead", 0, WRITE_AHEAD)
        plan = build_plan(
            sources, self._params, self._destinations, bucket_bytes=bucket_bytes, slots=slots, write_ahead=write_ahead
        )
        if plan.digest != msg["digest"]:
            raise ValueError(
                f"plan digest {str(msg['digest'])[:12]} from the trainer differs from the engine's {plan.digest[:12]}"
            )
        transport = land_path_class(msg)
        plan_id = msg.get("plan_id")
        if plan_id is not None and not (isinstance(plan_id, str) and 0 < len(plan_id) <= 64):
            raise ValueError(f"plan_id must be a short string, got {plan_id!r:.40}")
        init = LandInit(
            device=self.engine.device,
            engine=type(self.engine).__name__,
            exportable=bool(self.engine.exportable),
            sharded=bool(self._shards),
            max_wait_s=self.timeout_s,
        )
        refusal = transport.refusal(init)
        if refusal is not None:
            raise ValueError(refusal)
        path = transport.open(msg, plan, init)
        # from here the engine is re-prepared: a failure leaves no plan rather than a stale one
        self._release_data_path()
        self._plan, self._plan_id, self._adoption = None, None, None
        self._path = path
        self.engine.prepare(plan)
        storage = {name: self.engine.storage(name) for name in self._params}
        wrong = [
            f"{n!r}: {t.numel()} bytes, expected {local_nbytes(self._params[n], self._shards.get(n))}"
            for n, t in storage.items()
            if t.numel() != local_nbytes(self._params[n], self._shards.get(n))
        ]
        if wrong:
            raise ValueError(f"engine storage does not match its tables: {'; '.join(wrong[:10])}")
        landing = self._shadow_of(storage) if self.transactional else storage
        copies = [
            [
                (r, c)
                for r in b.runs
                for c in run_copies(r.offset, r.param_offset, r.nbytes, self._params[r.param], self._shards.get(r.param))
            ]
            for b in plan.buckets
        ]
        adoption = secrets.token_hex(16)
        reply: dict = {"op": Op.PLANNED, "digest": plan.digest, "adoption": adoption, **path.planned(landing)}
        self._appliers = [_Applier.landing(path.arrival(b), b, cs, landing) for b, cs in zip(plan.buckets, copies)]
        if self.transactional:
            self._commits = [
                _Applier.copies(cs, lambda r, c: strided(landing[r.param], c.dst, c.dst_pitch, c.rows, c.width), storage)
                for cs in copies
            ]
        if msg.get("verify"):
            self._sums = [ByteSum(self._verified_views(b, landing)) for b in plan.buckets]
        self._plan, self._plan_id, self._adoption = plan, plan_id, adoption
        return reply

    def _verified_views(self, bucket, landing: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """What the integrity sums cover: the landed bytes of each run, or, on a rank holding
        slices (which lands only part of a run), the run's bytes as they arrived in its slot."""
        slot = self._path.arrival(bucket) if self._path is not None else None
        if self._shards and slot is not None:  # a rank holding slices is never written directly
            return [slot[r.offset : r.offset + r.nbytes] for r in bucket.runs]
        return [landing[r.param][r.param_offset : r.param_offset + r.nbytes] for r in bucket.runs]

    def _shadow_of(self, storage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One exportable arena laid out like the engine's storage (reused across plans when it fits)."""
        offsets, total = {}, 0
        for name, t in storage.items():
            offsets[name] = total
            total = align(total + t.numel())
        if self._shadow is None or self._shadow.numel() < total:
            self._shadow = None
            self._shadow = allocate(max(total, 1), self.engine.device)
        return {name: self._shadow[offsets[name] : offsets[name] + t.numel()] for name, t in storage.items()}

    def _release_data_path(self) -> None:
        self._appliers, self._commits, self._sums = [], [], []
        if self._path is not None:
            self._path.close()
            self._path = None

    def _refit(self, begin: dict) -> None:
        version = _int_field(begin, "version")
        adoptions = begin.get("adoptions")
        problem = None
        if version is None:
            problem = f"begin needs an int 'version', got {begin.get('version')!r:.40}"
        elif self._plan is None:
            problem = "no plan: the trainer must send a plan before the first refit"
        elif begin.get("digest") != self._plan.digest:
            problem = "the refit names a different plan than the engine holds"
        elif (
            begin.get("plan_id") != self._plan_id  # the trainer's id for its plan, new at every plan()
            or not isinstance(adoptions, list)
            or self._adoption not in adoptions
        ):  # ours, new at every adoption
            problem = (
                "the engine adopted another plan (and its buffers) since this trainer planned, e.g. from "
                "another trainer holding the token: plan again"
            )
        elif version <= self.version:
            problem = f"stale or duplicate version {version}: the engine already holds version {self.version}"
        if problem is None:
            try:
                check_request(begin)
            except Malformed as bad:
                problem = bad.why
        if problem or version is None:
            self._reply({"op": Op.ERROR, "kind": "refused", "problems": [problem], **self.status()})
            return
        if not self._reply({"op": Op.BEGUN, "version": version}):
            return
        stats = ReceiveStats(version)
        start = time.perf_counter()
        expected = 0
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                left = max(0.0, deadline - time.monotonic())
                msg = self.server.recv(left, step=f"refit to version {version}, waiting for bucket {expected}")
                op = msg["op"]
                if op == Op.STATUS:  # any token holder may ask; it does not extend the trainer's deadline
                    self._reply({"op": Op.STATUS, **self.status()})
                    continue
                deadline = time.monotonic() + self.timeout_s
                try:
                    check_request(msg)
                except Malformed as bad:
                    self._fail(f"refit to version {version}: {bad.why}")
                    self._reply({"op": Op.ERROR, "kind": "protocol", "problems": [self.last_error], **self.status()})
                    return
                if op == Op.READY and msg["bucket"] == expected and msg["version"] == version:
                    t = time.perf_counter()
                    try:
                        self._fetch(expected)
                    except TransportError as err:
                        self._fail(f"refit to version {version}: bucket {expected} did not arrive: {err}")
                        self._release_data_path()
                        self._plan = None  # the data path is gone; the trainer must plan again
                        self._reply({"op": Op.ERROR, "kind": "transport", "problems": [self.last_error], **self.status()})
                        return
                    stats.fetch_s += time.perf_counter() - t
                    t = time.perf_counter()
                    if not self.transactional:
                        self.state = "partial"
                    _engine_step("copy of the bucket into its storage", self._appliers[expected])
                    _engine_step("device synchronize", self._sync)
                    stats.apply_s += time.perf_counter() - t
                    mismatch = self._verify(expected, msg.get("sum"))
                    if mismatch:
                        self._fail(f"refit to version {version}: {mismatch}")
                        self._reply({"op": Op.ERROR, "kind": "integrity", "problems": [self.last_error], **self.status()})
                        return
                    t = time.perf_counter()
                    if not self.transactional:
                        _engine_step("after_bucket", self.engine.after_bucket, expected)
                        _engine_step("device synchronize", self._sync)  # "applied" frees the bucket's staging for the trainer
                    stats.process_s += time.perf_counter() - t
                    stats.bytes += self._appliers[expected].nbytes
                    stats.buckets += 1
                    expected += 1
                    if not self._reply({"op": Op.APPLIED, "bucket": expected - 1}):
                        self._fail(
                            f"refit to version {version}: the trainer at {self.address} disconnected after bucket "
                            f"{expected - 1} of {len(self._appliers)}"
                        )
                        return
                elif op == Op.COMMIT and msg["version"] == version and expected == len(self._appliers):
                    t = time.perf_counter()
                    if self.transactional:
                        self._commit_shadow(stats)
                    self.state = "partial"  # until after_refit returns, the engine's weights are not yet this version
                    _engine_step("after_refit", self.engine.after_refit, version)
                    stats.after_refit_s = time.perf_counter() - t
                    self.version, self.state, self.last_error = version, "ready", None
                    self._reread_tables(version)
                    stats.wall_s = time.perf_counter() - start
                    self.history.append(stats)
                    self._reply(
                        {
                            "op": Op.COMMITTED,
                            **self.status(),
                            "fetch_s": stats.fetch_s,
                            "apply_s": stats.apply_s,
                            "process_s": stats.process_s,
                            "after_refit_s": stats.after_refit_s,
                            "tables": self._tables_version,
                        }
                    )
                    return
                elif op == Op.ABORT:
                    self._fail(f"trainer aborted the refit to version {version}: {str(msg.get('why', ''))[:200]}")
                    self._reply({"op": Op.ABORTED, **self.status()})
                    return
                else:
                    got = {k: msg.get(k) for k in ("op", "version", "bucket")}
                    self._fail(f"refit to version {version}: expected bucket {expected} or commit, got {got!r:.300}")
                    self._reply({"op": Op.ERROR, "kind": "protocol", "problems": [self.last_error], **self.status()})
                    return
        except PeerTimeout:
            self._fail(
                f"refit to version {version} interrupted: no bucket {expected} of {len(self._appliers)} from the "
                f"trainer at {self.address} within the {self.timeout_s:g} s timeout"
            )
        except EngineStepError as err:
            log.error("refit to version %d: %s", version, err, exc_info=err.__cause__)
            self._fail(f"refit to version {version}: {err}")
            self._reply({"op": Op.ERROR, "kind": "engine", "problems": [self.last_error], **self.status()})

    def _reread_tables(self, version: int) -> None:
        """After a commit: take the engine's new tables if it says they changed (``tables_version``).

        The adopted plan stays adopted (its views are built; the engine serves it); the next plan is
        checked against the new tables. Tables that fail their checks are not taken: the refit did
        commit, and the old tables still describe the adopted plan.
        """
        try:
            new = self.engine.tables_version
            if new == self._tables_version:
                return
            params, destinations, shards = self.engine.params(), self.engine.destinations(), self.engine.shards()
            check_shards(params, destinations, shards)
        except Exception:
            log.exception("reading the engine's tables after refit %d failed; keeping tables %d", version, self._tables_version)
            return
        self._params, self._destinations, self._shards = params, destinations, shards
        log.info(
            "engine tables changed after refit %d (version %d -> %d); the next plan uses them", version, self._tables_version, new
        )
        self._tables_version = new

    def _reply(self, msg: dict) -> bool:
        """Answer the trainer; False if it already went away (logged, never fatal here).

        A reply that cannot be sent as it is (over the size limit, say) becomes an ``engine`` error
        naming why, so the trainer still gets one answer per message.
        """
        try:
            self.server.send(msg)
            return True
        except ControlError as err:
            log.warning("could not answer %r: %s", msg.get("op"), err)
            return False
        except (TypeError, ValueError) as err:
            log.error("could not send the %r reply: %s", msg.get("op"), err)
            return self._reply(
                {
                    "op": Op.ERROR,
                    "kind": "engine",
                    "problems": [text(f"the engine's {msg.get('op')!r} reply could not be sent: {err}")],
                    **self.status(),
                }
            )

    def _fetch(self, bucket: int) -> None:
        """Bring the bucket's bytes into our slot where the transport moves them (broadcast)."""
        if self._path is not None and self._plan is not None:
            self._path.fetch(self._plan.buckets[bucket])

    def _sync(self) -> None:
        sync_current(self.engine.device)

    def _verify(self, bucket: int, claimed) -> str | None:
        """Compare the bucket's landed bytes with the trainer's sums; a message if they differ."""
        if not self._sums:
            return None
        got = list(self._sums[bucket]())
        if not isinstance(claimed, list) or not all(_is_int(x) for x in claimed) or claimed != got:
            return f"bucket {bucket} failed its integrity check (trainer sums {claimed}, engine sums {got})"
        return None

    def _commit_shadow(self, stats: ReceiveStats) -> None:
        """Copy the complete shadow into the engine bucket by bucket, processing as usual."""
        self.state = "partial"
        for bucket, commit in enumerate(self._commits):
            t = time.perf_counter()
            _engine_step("commit copy", commit)
            _engine_step("device synchronize", self._sync)
            stats.apply_s += time.perf_counter() - t
            t = time.perf_counter()
            _engine_step("after_bucket", self.engine.after_bucket, bucket)
            _engine_step("device synchronize", self._sync)
            stats.process_s += time.perf_counter() - t

    def _checksums(self, ranges: list) -> list[str | None]:
        """sha256 of the engine's served bytes [offset, offset+n) of each named parameter (None if malformed,
        out of range, or if the engine serves the param in a processed layout with no such bytes)."""
        if not isinstance(ranges, list):
            raise ValueError(f"checksum ranges must be a list of [param, offset, nbytes], got {type(ranges).__name__}")
        return [self._checksum(entry) for entry in ranges]

    def _checksum(self, entry: object) -> str | None:
        if not (isinstance(entry, list) and len(entry) == 3):
            return None
        param, offset, n = entry
        if not (isinstance(param, str) and param in self._params and _is_int(offset) and _is_int(n)) or offset < 0 or n < 0:
            return None
        try:
            data = self.engine.read(param)
        except ValueError:
            return None
        if data is None or offset + n > data.numel():
            return None
        return hashlib.sha256(data[offset : offset + n].cpu().numpy().tobytes()).hexdigest()

    def _fail(self, why: str) -> None:
        self.last_error = why[:_MAX_ERROR_CHARS]
        log.error("%s; engine holds version %d, state %s", self.last_error, self.version, self.state)

    def close(self) -> None:
        self._release_data_path()
        self.server.close()


class EngineStepError(MxrefitError, RuntimeError):
    """Something the engine does during a refit raised (its hooks, the copies, the device)."""


def _engine_step(what: str, fn, *args) -> None:
    """Run one engine-side step of a refit; its failure becomes an error the receiver reports and survives."""
    try:
        fn(*args)
    except Exception as err:
        raise EngineStepError(f"the engine's {what} raised {type(err).__name__}: {str(err)[:300]}") from err


def _bounded(problems: list) -> list[str]:
    """At most MAX_PROBLEMS problems of at most _MAX_ERROR_CHARS each: an error reply stays small."""
    out = [str(p)[:_MAX_ERROR_CHARS] for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        out.append(f"... and {len(problems) - MAX_PROBLEMS} more problems")
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(msg: dict, key: str) -> int | None:
    """``msg[key]`` if it is an int (not a bool), else None: malformed fields fail comparisons instead of raising."""
    value = msg.get(key)
    return value if _is_int(value) else None
