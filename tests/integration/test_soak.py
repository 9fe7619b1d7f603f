"""Soak: 1,000 refits over shared memory with flat memory, descriptors and mappings; a SIGKILLed trainer leaks nothing.

"Flat" (checked from the warm-up sample at refit 100 to the last at refit 1,000; 900 refits):
- open file descriptors and shared-memory mappings: no growth at all, in both processes. A refit
  opens nothing, so any per-refit leak would show as >= 9 by the end;
- memory mappings (``/proc/<pid>/maps`` lines): at most +16, room for malloc arenas coming and
  going, far below the 900 a mapping-per-refit leak would add;
- RSS: growth below max(2 %, 8 MiB) per process, i.e. a leak under ~9 KiB per refit can hide
  here, which is what the object count is for:
- Python objects tracked by the garbage collector: in each process the median growth per
  100-refit interval is at most 10 (a refit that keeps one object alive adds 100 to every
  interval; the median ignores a collection that frees unrelated objects once) and the total
  growth stays below 200.
Samples are printed (``-s``) and written to ``$MXREFIT_SOAK_JSON`` when set (docs/reliability.md).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest
import torch

from mxrefit.source.sender import Sender
from tests.helpers.refit_helpers import EngineProcess, engine_matches, random_weights, trainer_specs, wait_until

pytestmark = pytest.mark.slow

REFITS = 1000
SAMPLE_EVERY = 100
WARMUP = 100
BUCKET = 16 << 10  # five 128 KiB buckets per refit: both slots are reused 500 times each
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for children


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return f.read().splitlines()


def _shm_mapped(pid: int) -> set[str]:
    """Shared-memory files mapped by ``pid``; an unlinked one keeps its ' (deleted)' suffix."""
    return {line.split(maxsplit=5)[5] for line in _maps(pid) if "/dev/shm/" in line}


def _sample(refit: int, trainer: int, engine: EngineProcess) -> dict:
    """Both processes, between refits (the engine idles in recv)."""
    out = {"refit": refit}
    for side, pid in (("trainer", trainer), ("engine", engine.pid)):
        out[side] = {
            "rss": psutil.Process(pid).memory_info().rss,
            "fds": _fds(pid),
            "maps": len(_maps(pid)),
            "shm": sorted(_shm_mapped(pid)),
        }
    out["trainer"]["objects"] = len(gc.get_objects())
    out["engine"]["objects"] = engine.probe()["objects"]
    return out


def _growth(samples: list[dict], side: str, key: str) -> int:
    start = next(s for s in samples if s["refit"] == WARMUP)
    return samples[-1][side][key] - start[side][key]


def _median_interval_growth(samples: list[dict], side: str, key: str) -> float:
    values = [s[side][key] for s in samples if s["refit"] >= WARMUP]
    return statistics.median(b - a for a, b in zip(values, values[1:]))


def test_a_thousand_refits_keep_memory_descriptors_and_mappings_flat(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two busy processes on two cores: spinning op threads only contend
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = EngineProcess(mxfp8=True, timeout_s=30, probe=True)
    sender = Sender(engine.address, engine.token, bucket_bytes=BUCKET, timeout_s=30)
    samples: list[dict] = []
    try:
        weights = random_weights(trainer_specs(sender), 1)
        tensors = list(weights.values())
        start = time.perf_counter()
        for refit in range(1, REFITS + 1):
            with torch.no_grad():
                torch._foreach_mul_(tensors, 1.0 + 2.0**-7 * (1 if refit % 2 else -1))  # a new optimizer step
            report = sender.refit(weights)
            assert report.version == refit and report.buckets == 5
            if refit == 1 or refit % SAMPLE_EVERY == 0:
                assert engine_matches(sender, weights) == [], f"refit {refit}"
                samples.append(_sample(refit, os.getpid(), engine))
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
        engine.stop(sender)
    summary = {"refits": REFITS, "seconds": elapsed, "bucket_bytes": BUCKET, "samples": samples}
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}))
    for s in samples:
        print(s["refit"], {side: {k: v for k, v in s[side].items() if k != "shm"} for side in ("trainer", "engine")})
    if os.environ.get("MXREFIT_SOAK_JSON"):
        with open(os.environ["MXREFIT_SOAK_JSON"], "w") as f:
            json.dump(summary, f, indent=1)
    for side in ("trainer", "engine"):
        warm = next(s for s in samples if s["refit"] == WARMUP)[side]
        assert _growth(samples, side, "fds") == 0, (side, [s[side]["fds"] for s in samples])
        assert all(s[side]["shm"] == warm["shm"] for s in samples if s["refit"] >= WARMUP), side
    assert len(samples[-1]["engine"]["shm"]) == 2, samples[-1]["engine"]["shm"]  # the two slots, nothing else
    for side in ("trainer", "engine"):
        assert _growth(samples, side, "maps") <= 16, (side, [s[side]["maps"] for s in samples])
        assert _growth(samples, side, "rss") < max(0.02 * warm["rss"], 8 << 20), (side, [s[side]["rss"] for s in samples])
        objects = [s[side]["objects"] for s in samples]
        assert _median_interval_growth(samples, side, "objects") <= 10 and _growth(samples, side, "objects") < 200, (
            side,
            objects,
        )


_TRAINER = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.source.sender import Sender
from tests.helpers.refit_helpers import random_weights, trainer_specs

sender = Sender(sys.argv[2], bytes.fromhex(sys.argv[3]), bucket_bytes=16 << 10, timeout_s=30)
weights = random_weights(trainer_specs(sender), 7)
sender.refit(weights)
print(json.dumps({"segments": sender.buffers.describe()["names"], "version": sender.engine_status["version"]}), flush=True)
tensors = list(weights.values())
while True:  # refit until killed
    torch._foreach_mul_(tensors, 1.0)
    sender.refit(weights)
"""


def test_a_sigkilled_trainer_leaves_no_shared_memory_and_the_engine_carries_on():
    """The trainer is its own process tree (its own resource tracker), killed at a random point of its refit loop."""
    engine = EngineProcess(mxfp8=True, timeout_s=3.0)
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, ROOT, engine.address, engine.token.hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    sender = None
    try:
        first = json.loads(trainer.stdout.readline())
        names = first["segments"]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        assert {f"/dev/shm/{n}" for n in names} == _shm_mapped(engine.pid)
        time.sleep(0.5 + (os.getpid() % 10) / 10)  # somewhere in its refit loop
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        gone = wait_until(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names), 10)
        print(f"segments of the killed trainer unlinked {gone:.2f} s after SIGKILL")
        sender = Sender(engine.address, engine.token, bucket_bytes=16 << 10, timeout_s=30)
        status = sender.status()
        assert engine.proc.is_alive() and status["version"] >= first["version"], status
        weights = random_weights(trainer_specs(sender), 8)
        sender.refit(weights)
        assert engine_matches(sender, weights) == []
        assert _shm_mapped(engine.pid) == {f"/dev/shm/{n}" for n in sender.buffers.describe()["names"]}
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.communicate(timeout=30)
        engine.stop(sender)
