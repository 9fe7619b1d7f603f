"""Faults injected into the real components by subclassing them (never a mock of the protocol).

- ``faulty_engine``: a TorchEngine whose ``after_bucket`` hook kills the engine process or stalls
  it, after a bucket's bytes landed and before the receiver answers ``applied``.
- ``FaultyClient``: the trainer's real ControlClient, which at one chosen message (refit r, op,
  n-th of that op in the refit) dies, stalls, drops, truncates, duplicates, reorders or alters it
  on the real socket.
- ``record``: keeps a copy of every frame a real client sends, to replay or mutate real traffic.
"""

from __future__ import annotations

import os
import time

from mxrefit.transport.control import ControlClient

KILLED_TRAINER_EXIT = 17
KILLED_ENGINE_EXIT = 23


def faulty_engine(module, mxfp8: bool, fault: dict):
    """``fault``: {"refit": r, "bucket": b, "action": "die" | "hang" | "raise", "seconds": s}, or
    {"refit": r, "action": "raise_after_refit"}. Refits are counted from 1 at their first bucket."""
    from mxrefit.engine.torch import TorchEngine

    class FaultyEngine(TorchEngine):
        refits_started = 0

        def after_bucket(self, bucket: int) -> None:
            if bucket == 0:
                self.refits_started += 1
            if self.refits_started == fault["refit"] and bucket == fault.get("bucket"):
                if fault["action"] == "die":
                    os._exit(KILLED_ENGINE_EXIT)
                if fault["action"] == "raise":
                    raise RuntimeError(f"injected failure in after_bucket({bucket})")
                time.sleep(fault["seconds"])

        def after_refit(self, version: int) -> None:
            if self.refits_started == fault["refit"] and fault["action"] == "raise_after_refit":
                raise RuntimeError(f"injected failure in after_refit({version})")

    return FaultyEngine(module, mxfp8=mxfp8)


class _TruncatingSocket:
    """Wraps a zmq socket for one send: the frame goes out cut to ``keep`` bytes."""

    def __init__(self, sock, keep: float):
        self._sock, self._keep = sock, keep

    def send(self, frame: bytes, *args, **kwargs):
        return self._sock.send(frame[: int(len(frame) * self._keep)], *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class FaultyClient(ControlClient):
    """``fault``: {"refit": r (1-based, counted by this client's begins), "op": op, "nth": n, "action": a, ...}.

    Actions: ``die_before`` / ``die_after`` (``os._exit``; ``delay_s`` after sending), ``hang``
    (sleep ``seconds`` then send), ``drop``, ``truncate`` (first half of the frame),
    ``duplicate``, ``swap_next`` (send the following message first), ``stale_version``
    (version - 1), ``commit_instead`` (a commit where this message was due).
    """

    def __init__(self, address: str, token: bytes, fault: dict, **kwargs):
        super().__init__(address, token, **kwargs)
        self.fault = fault
        self.refits = 0
        self.counts: dict[str, int] = {}
        self.held: dict | None = None
        self.fired = False

    def _fires(self, msg: dict) -> bool:
        op = msg["op"]
        if op == "begin":
            self.refits += 1
            self.counts = {}
        nth = self.counts.get(op, 0)
        self.counts[op] = nth + 1
        f = self.fault
        return not self.fired and self.refits == f.get("refit", 1) and op == f["op"] and nth == f["nth"]

    def send(self, msg: dict):
        if self.held is not None:
            held, self.held = self.held, None
            super().send(msg)
            return super().send(held)
        if not self._fires(msg):
            return super().send(msg)
        self.fired = True
        action = self.fault["action"]
        if action == "die_before":
            os._exit(KILLED_TRAINER_EXIT)
        if action == "hang":
            time.sleep(self.fault["seconds"])
        elif action == "drop":
            return None
        elif action == "truncate":
            sock, self._sock = self._sock, _TruncatingSocket(self._sock, 0.5)
            try:
                return super().send(msg)
            finally:
                self._sock = sock
        elif action == "duplicate":
            super().send(msg)
        elif action == "swap_next":
            self.held = msg
            return None
        elif action == "stale_version":
            msg = {**msg, "version": msg["version"] - 1}
        elif action == "commit_instead":
            msg = {"op": "commit", "version": msg["version"]}
        sent = super().send(msg)
        if action == "die_after":
            time.sleep(self.fault.get("delay_s", 0.0))
            os._exit(KILLED_TRAINER_EXIT)
        return sent


class RecordingSocket:
    """Wraps a client's zmq socket and keeps a copy of every frame it sends (to replay or mutate real traffic)."""

    def __init__(self, sock):
        self._sock = sock
        self.frames: list[bytes] = []

    def send(self, frame: bytes, *args, **kwargs):
        self.frames.append(bytes(frame))
        return self._sock.send(frame, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def record(client: ControlClient) -> RecordingSocket:
    """Start recording what ``client`` sends; returns the recorder (its ``frames``)."""
    recorder = RecordingSocket(client._sock)
    client._sock = recorder
    return recorder
