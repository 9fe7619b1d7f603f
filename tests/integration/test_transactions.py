"""Integrity sums (``verify=True``) and transactional engines, with real processes and faults.

A corrupted bucket is caught by the engine before the refit completes; a transactional
engine whose refit fails (trainer killed, corrupted bucket) keeps serving the previous
version byte for byte, ``ready``, and the next refit lands.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from mxrefit.source.sender import RefitError, Sender
from tests.helpers.engine_proc import dying_trainer, serve_tiny
from tests.helpers.refit_helpers import engine_matches, tiny_weights

CTX = mp.get_context("spawn")


class EngineProc:
    def __init__(self, *, mxfp8: bool = True, transactional: bool = False, timeout_s: float = 20.0):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(
            target=serve_tiny, args=(child, "moe", mxfp8, timeout_s), kwargs={"transactional": transactional}, daemon=True
        )
        self.proc.start()
        assert self.conn.poll(120), "engine did not start"
        hello = self.conn.recv()
        self.address, self.token = hello["address"], hello["token"]

    def stop(self, sender=None) -> None:
        if sender is not None:
            sender.close(shutdown_engine=True)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


class CorruptingSender(Sender):
    """The real sender, with one byte of bucket ``corrupt_bucket`` flipped after its sums were taken."""

    corrupt_bucket = 1

    def _ready(self, bucket, version):
        msg = super()._ready(bucket, version)
        if bucket.index == self.corrupt_bucket:
            view = self.path.run_view(bucket, bucket.runs[0])
            view[view.numel() // 2] ^= 0x5A
        return msg


@pytest.mark.parametrize("transactional", [False, True], ids=["in-place", "transactional"])
def test_verified_refits_land_and_a_corrupted_bucket_is_caught(transactional):
    engine = EngineProc(transactional=transactional)
    good = Sender(engine.address, engine.token, bucket_bytes=32 << 10, verify=True)
    try:
        first = tiny_weights(51)
        good.refit(first)
        assert good.status() == {"version": 1, "state": "ready", "error": None}
        assert engine_matches(good, first) == []
        bad = CorruptingSender(engine.address, engine.token, bucket_bytes=32 << 10, verify=True)
        with pytest.raises(RefitError, match="bucket 1 failed its integrity check"):
            bad.refit(tiny_weights(52))
        bad.close()
        status = good.status()
        assert status["version"] == 1 and "integrity" in status["error"]
        if transactional:  # nothing of refit 2 reached the weights
            assert status["state"] == "ready" and engine_matches(good, first) == []
        else:
            assert status["state"] == "partial"
        good.plan(good.plan_.sources)  # the engine's buffers are this sender's again
        third = tiny_weights(53)
        assert good.refit(third).version == 2
        assert good.status()["state"] == "ready" and engine_matches(good, third) == []
    finally:
        engine.stop(good)


def test_a_transactional_engine_keeps_serving_its_version_when_the_trainer_dies():
    engine = EngineProc(transactional=True, timeout_s=3.0)
    sender = Sender(engine.address, engine.token, bucket_bytes=16 << 10)
    try:
        first = tiny_weights(61)
        sender.refit(first)
        dying = CTX.Process(target=dying_trainer, args=(engine.address, engine.token, "moe", 2))
        dying.start()
        dying.join(120)
        assert dying.exitcode == 17
        t = time.monotonic()
        while sender.status()["error"] is None and time.monotonic() - t < 20:
            time.sleep(0.2)
        status = sender.status()
        assert status["state"] == "ready" and status["version"] == 1 and "timeout" in status["error"]
        assert engine_matches(sender, first) == []  # buckets 0 and 1 of the dead refit never reached the weights
        sender.plan(sender.plan_.sources)
        second = tiny_weights(62)
        assert sender.refit(second).version == 2 and engine_matches(sender, second) == []
    finally:
        engine.stop(sender)
