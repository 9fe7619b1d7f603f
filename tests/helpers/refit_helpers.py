"""Parent-side helpers of the two-process tests: an engine process, trainer weights, engine byte checks.

Shared by the refit, fault, fuzz, security and soak tests so each checks engine bytes the
same way: ``engine_matches`` (``tests/helpers/checks.py``) asks the real engine for sha256 of every target
byte range (the ``checksum`` op) and compares with what the trainer's tensors must become.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Callable

import torch

from mxrefit.plan.build import SourceSpec
from mxrefit.source.sender import Sender
from tests.helpers import models
from tests.helpers.checks import engine_matches, sha  # noqa: F401  (re-exported: the byte checks every two-process test uses)
from tests.helpers.engine_proc import serve_tiny

CTX = mp.get_context("spawn")


class EngineProcess:
    """A tiny transformers model behind a real Receiver in a spawned process (``engine_proc.serve_tiny``)."""

    def __init__(
        self,
        model: str = "moe",
        mxfp8: bool = False,
        timeout_s: float = 30.0,
        quant: str | None = None,
        transactional: bool = False,
        fault: dict | None = None,
        post_process: bool = False,
        probe: bool = False,
        tcp: bool = False,
    ):
        self.conn, child = CTX.Pipe()
        self._probe, probe_child = CTX.Pipe() if probe else (None, None)
        options = {
            "quant": quant,
            "transactional": transactional,
            "fault": fault,
            "post_process": post_process,
            "probe_conn": probe_child,
            "tcp": tcp,
        }
        self.proc = CTX.Process(target=serve_tiny, args=(child, model, mxfp8, timeout_s), kwargs=options, daemon=True)
        self.proc.start()
        assert self.conn.poll(180), "engine did not start"
        hello = self.conn.recv()
        self.address, self.token = hello["address"], hello["token"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def probe(self) -> dict:
        """The engine process's own view (gc-tracked object count); needs ``probe=True``."""
        self._probe.send("probe")
        assert self._probe.poll(30), "the engine did not answer the probe"
        return self._probe.recv()

    def stop(self, sender: Sender | None = None) -> None:
        if sender is not None:
            sender.close(shutdown_engine=True)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def engine_digests(sender: Sender) -> dict[tuple[str, int], str]:
    """sha256 of the engine's bytes for every (trainer tensor, part) as the engine holds them now."""
    if sender._tables is None:
        sender.connect()
    _, dests = sender._tables
    keys = [(name, i) for name, dest in dests.items() for i in range(len(dest.targets))]
    ranges = [[t.param, t.offset, t.nbytes] for dest in dests.values() for t in dest.targets]
    got = sender.client.request({"op": "checksum", "ranges": ranges}, 30, step="checksums")["sha256"]
    return dict(zip(keys, got))


def tiny_weights(seed: int, model: str = "moe") -> dict[str, torch.Tensor]:
    """A freshly initialised transformers model's parameters (the engine's model, other values)."""
    m = models.tiny_llama(seed) if model == "llama" else models.tiny_qwen3_moe(seed)
    return {n: p.detach() for n, p in m.named_parameters()}


def trainer_specs(sender: Sender) -> list[SourceSpec]:
    """The trainer tensors the connected engine expects, in its order (value shape = source shape)."""
    if sender._tables is None:
        sender.connect()
    _, dests = sender._tables
    return [SourceSpec(n, tuple(d.targets[0].shape), torch.bfloat16) for n, d in dests.items()]


def random_weights(specs: list[SourceSpec], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for ``specs`` with torch alone, so a trainer process needs no transformers."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        t = torch.randn(s.shape, generator=g, dtype=torch.float32).mul_(0.02)
        if "norm" in s.name:
            t.add_(1.0)
        out[s.name] = t.to(s.dtype)
    return out


def specs_to_plain(specs: list[SourceSpec]) -> list[tuple[str, tuple[int, ...], str]]:
    """Specs as plain data for a spawned process's arguments."""
    return [(s.name, s.shape, str(s.dtype).removeprefix("torch.")) for s in specs]


def specs_from_plain(plain: list[tuple[str, tuple[int, ...], str]]) -> list[SourceSpec]:
    return [SourceSpec(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in plain]


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until ``predicate()`` held; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start
