"""One trainer, N engine ranks: a control client that talks to every rank and answers as one.

Why: each engine rank runs its own ``Receiver`` (its own control server), yet a refit is one
exchange — plan, begin, ready/applied per bucket, commit — that holds only if every rank
answers alike. ``ControlFanOut`` has the ``ControlClient`` interface the ``Sender`` uses, so the
refit loop stays one code path: a message goes to every live rank, one answer is awaited from
each under one shared deadline, and the answers are merged — the same op, bucket and digest from
all, identical tables (else a ``plan_mismatch`` naming the rank and the first differences), the
slowest rank's timings, and a combined status with each rank's own (``ranks``).

Channels stay in step by counting: a ``Receiver`` answers every message exactly once, so each rank
owes one answer per message sent. Answers to an exchange that was given up (``abandon``) are
skipped before the next one is read; ``drain`` reads all that is owed. A rank silent past the
deadline is *lost*: its client is closed (its late answers can no longer be matched) until
``replace`` gives it a new one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mxrefit.transport.control import ControlClient, ControlError, PeerTimeout
from mxrefit.transport.protocol import REPLIES, Malformed, Op, check_reply

_TIMINGS = ("fetch_s", "apply_s", "process_s", "after_refit_s")
_SAME = ("bucket", "digest")
_SHOWN = 5


def combined_status(statuses: dict[int, dict], lost: dict[int, str], names: Sequence[str]) -> dict:
    """One status for all ranks: ``ready`` only if every rank is live, ready and at one version.

    ``version`` is the newest any rank holds (the next refit must exceed it on every rank);
    ``ranks`` lists each rank's own version, state and error (``lost`` ranks: why).
    """
    ranks: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        if i in lost:
            ranks.append({"engine": i, "name": name, "version": None, "state": "lost", "error": lost[i]})
        elif i in statuses:
            s = statuses[i]
            ranks.append(
                {"engine": i, "name": name, "version": s.get("version"), "state": s.get("state"), "error": s.get("error")}
            )
    versions: list[int] = [r["version"] for r in ranks if r["version"] is not None]
    whole = not lost and all(r["state"] == "ready" for r in ranks) and len(set(versions)) == 1
    errors = [f"{r['name']}: {r['error']}" for r in ranks if r["error"]]
    return {
        "version": max(versions, default=0),
        "state": "ready" if whole else "partial",
        "error": "; ".join(errors) or None,
        "ranks": ranks,
    }


def _table_differences(name: str, mine: dict, first: dict, first_name: str) -> list[str]:
    problems = []
    for key in ("params", "destinations"):
        a = {row[0]: row for row in mine.get(key, [])}
        b = {row[0]: row for row in first.get(key, [])}
        for n in sorted(a.keys() - b.keys()):
            problems.append(f"{name} has {key[:-1]} {n!r}, {first_name} does not")
        for n in sorted(b.keys() - a.keys()):
            problems.append(f"{name} lacks {key[:-1]} {n!r} that {first_name} has")
        for n in sorted(k for k in a.keys() & b.keys() if a[k] != b[k]):
            problems.append(f"{key[:-1]} {n!r} is {a[n][1:]} on {name}, {b[n][1:]} on {first_name}")
        if not problems and list(a) != list(b):
            problems.append(f"{name} lists its {key} in another order than {first_name}")
    if len(problems) > _SHOWN:
        problems = problems[:_SHOWN] + [f"... and {len(problems) - _SHOWN} more differences on {name}"]
    return problems


class ControlFanOut:
    """``ControlClient``'s interface over one client per engine rank; use from one thread."""

    def __init__(self, engines: Sequence[tuple[str, bytes]]):
        if not engines:
            raise ValueError("a fan-out needs at least one engine rank")
        self.clients: list[ControlClient] = []
        self.names: list[str] = []
        self.owed: list[int] = []
        self.skip: list[int] = []
        self.lost: dict[int, str] = {}
        try:
            for i, (address, token) in enumerate(engines):
                self.clients.append(ControlClient(address, token))
                self.names.append(f"engine {i} at {address}")
                self.owed.append(0)
                self.skip.append(0)
        except BaseException:
            self.close()
            raise

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.lost]

    # ---- per rank --------------------------------------------------------------------------
    def send_to(self, i: int, msg: dict[str, Any]) -> None:
        self.clients[i].send(msg)
        self.owed[i] += 1

    def _read(self, i: int, deadline: float, step: str) -> dict[str, Any]:
        if self.owed[i] == 0:
            raise ControlError(f"{self.names[i]} owes no answer while {step}")
        reply = self.clients[i].recv(max(0.0, deadline - time.monotonic()), step=step)
        self.owed[i] -= 1
        return reply

    def recv_from(self, i: int, deadline: float, step: str) -> dict[str, Any]:
        """Rank ``i``'s answer to the oldest exchange not given up (monotonic ``deadline``)."""
        while self.skip[i]:
            self._read(i, deadline, step)
            self.skip[i] -= 1
        return self._read(i, deadline, step)

    def drain(self, i: int, deadline: float, step: str) -> list[dict[str, Any]]:
        """Every answer rank ``i`` still owes, given-up exchanges included, oldest first."""
        replies = []
        while self.owed[i]:
            replies.append(self._read(i, deadline, step))
        self.skip[i] = 0
        return replies

    def lose(self, i: int, why: str) -> None:
        """Stop talking to rank ``i``: its channel can no longer be kept in step."""
        self.lost[i] = why
        self.clients[i].close()

    def describe_lost(self, ranks: Sequence[int] | None = None) -> str:
        return "; ".join(f"{self.names[i]}: {self.lost[i]}" for i in (sorted(self.lost) if ranks is None else ranks))

    def replace(self, i: int, address: str, token: bytes) -> None:
        """A new client for rank ``i`` (a restarted engine, or one that was lost)."""
        client = ControlClient(address, token)
        self.clients[i].close()
        self.clients[i], self.names[i] = client, f"engine {i} at {address}"
        self.owed[i] = self.skip[i] = 0
        self.lost.pop(i, None)

    # ---- all ranks (the ControlClient interface) -------------------------------------------
    @property
    def address(self) -> str:
        return ", ".join(self.names)

    def send(self, msg: dict[str, Any]) -> None:
        for i in self.live:
            self.send_to(i, msg)

    def gather(self, timeout_s: float | None, *, step: str) -> dict[int, dict[str, Any]]:
        """One answer from every live rank within one deadline; ranks silent past it are lost."""
        deadline = time.monotonic() + (1e9 if timeout_s is None else timeout_s)
        replies = {}
        for i in self.live:
            try:
                replies[i] = self.recv_from(i, deadline, step)
            except PeerTimeout:
                self.lose(i, f"no answer within {timeout_s:g} s while {step}")
            except ControlError as err:
                self.lose(i, str(err))
        return replies

    def recv(self, timeout_s: float | None, *, step: str) -> dict[str, Any]:
        """Every live rank's answer, merged; PeerTimeout naming the ranks that fell silent."""
        before = set(self.lost)
        replies = self.gather(timeout_s, step=step)
        silent = sorted(set(self.lost) - before)
        if silent:
            raise PeerTimeout(self.describe_lost(silent))
        if not replies:
            raise ControlError(f"no engine rank is live while {step}: {self.describe_lost()}")
        return self._merge(replies)

    def request(self, msg: dict[str, Any], timeout_s: float | None, *, step: str) -> dict[str, Any]:
        self.send(msg)
        return self.recv(timeout_s, step=step)

    def abandon(self) -> None:
        """The answers owed now belong to an exchange given up: skip them before the next one."""
        for i in self.live:
            self.skip[i] = self.owed[i]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    # ---- merging ---------------------------------------------------------------------------
    def _merge(self, replies: dict[int, dict[str, Any]]) -> dict[str, Any]:
        for i, r in replies.items():
            try:
                check_reply(r, *REPLIES)  # each rank's fields are typed before they are merged
            except Malformed as bad:
                return {"op": Op.ERROR, "kind": "protocol", "problems": [f"{self.names[i]} broke the protocol: {bad.why}"]}
        for i, r in replies.items():
            if r["op"] in (Op.ERROR, Op.REJECTED):
                problems = [f"{self.names[i]}: {p}" for p in (r.get("problems") or [r.get("why", "")])]
                return {**r, "problems": problems, **combined_status(replies, self.lost, self.names)}
        first_i, first = next(iter(replies.items()))
        for key in ("op", *_SAME):
            values = {i: r.get(key) for i, r in replies.items()}
            if len(set(map(repr, values.values()))) > 1:
                said = ", ".join(f"{self.names[i]}: {v!r}" for i, v in values.items())
                return {"op": Op.ERROR, "kind": "protocol", "problems": [f"engine ranks answered different {key}s ({said})"]}
        merged = dict(first)
        if first["op"] == Op.PLANNED:  # each rank names its own adoption; a begin echoes them all
            merged["adoption"] = [r["adoption"] if isinstance(r["adoption"], str) else "" for r in replies.values()]
        if first["op"] == Op.TABLES:
            problems = [
                p
                for i, r in replies.items()
                if i != first_i
                for p in _table_differences(self.names[i], r, first, self.names[first_i])
            ]
            if problems:
                return {
                    "op": Op.ERROR,
                    "kind": "plan_mismatch",
                    "problems": [
                        "engine ranks describe different models; every rank must give the whole-model "
                        "tables (slices go in shards()):",
                        *problems,
                    ],
                }
            merged["exportable"] = all(r.get("exportable") for r in replies.values())
        for key in _TIMINGS:
            if key in first:
                merged[key] = max(float(r.get(key, 0.0)) for r in replies.values())
        if "version" in first and "state" in first:
            merged.update(combined_status(replies, self.lost, self.names))
        return merged
