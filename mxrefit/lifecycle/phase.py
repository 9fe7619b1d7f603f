"""The colocated phase around a refit: make room, wake the engine, move weights, give the engine its KV cache.

``prepare_for_generation`` runs, and times, each part:

1. ``trainer.offload()``: queue the copies of optimizer state and gradients to host memory;
2. ``engine.wake_up(tags=["weights"])``: the engine maps its weight memory again;
3. ``refit()``: the weights move (mxrefit's ``Sender.refit``; its own report is kept whole);
4. ``trainer.wait()``: the offload copies finish and the freed blocks go back to the driver;
5. ``engine.wake_up(tags=["kv_cache"])``: the engine takes the room the trainer made.

With ``overlap=True`` (default) the offload copies run during 2-3, on their own stream; that
assumes the engine's weights fit beside the trainer's optimizer state and only the KV cache needs
the room the offload makes, which is the case the slim offload is for. ``overlap=False`` finishes
the offload (4) before the engine wakes. ``prepare_for_training`` is the inverse: the engine sleeps,
then the optimizer state is reloaded. If a part raises (a refused refit, say), the phase stops
there and re-raises; the offloader stays consistent (``reload()`` is queued after any copy still
in flight), so the caller can bring the state back and retry.

The engine is anything with ``sleep(level)`` and ``wake_up(tags)``: vLLM's ``LLM`` (0.32:
``sleep(level=1, mode="abort")``, ``wake_up(tags=None) -> bool`` where the bool says whether the
engine is fully awake), or its engine core. This module does not import vLLM.

Timings are host ``perf_counter`` spans; after each part the device's *current* stream is
synchronized, never the whole device, so the offload's side-stream copies are not waited for
until step 4 and the time they hide behind 2-3 does not appear anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from mxrefit.devices import sync_current


class SleepableEngine(Protocol):
    def sleep(self, level: int = 1) -> Any: ...

    def wake_up(self, tags: list[str] | None = None) -> Any: ...


class Offloadable(Protocol):
    def offload(self) -> int: ...

    def reload(self) -> int: ...

    def wait(self, *, release: bool = True) -> None: ...


@dataclass
class PhaseReport:
    """``prepare_for_generation``: seconds per part, in the order they ran (see the module docstring)."""

    offload_s: float = 0.0
    wake_weights_s: float = 0.0
    refit_s: float = 0.0
    offload_wait_s: float = 0.0
    wake_kv_cache_s: float = 0.0
    total_s: float = 0.0
    offload_bytes: int = 0
    engine_awake: bool | None = None
    refit: Any = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # a dataclass refit report (RefitReport) becomes a nested dict


@dataclass
class TrainingPhaseReport:
    """``prepare_for_training``: the engine sleeps, the optimizer state comes back."""

    sleep_s: float = 0.0
    reload_s: float = 0.0
    reload_wait_s: float = 0.0
    total_s: float = 0.0
    reload_bytes: int = 0


class _Clock:
    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.last = time.perf_counter()

    def lap(self, *, sync: bool = True) -> float:
        if sync:
            sync_current(self.device)
        now = time.perf_counter()
        span, self.last = now - self.last, now
        return span

    def total(self) -> float:
        return time.perf_counter() - self.start


def _device(device: torch.device | str | None, trainer: object | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return getattr(trainer, "device", torch.device("cpu"))


def prepare_for_generation(
    refit: Callable[[], Any],
    *,
    trainer: Offloadable | None = None,
    engine: SleepableEngine | None = None,
    overlap: bool = True,
    device: torch.device | str | None = None,
) -> PhaseReport:
    """Run the phase between the optimizer step and the next rollout; ``refit()`` returns its report."""
    clock = _Clock(_device(device, trainer))
    report = PhaseReport()
    if trainer is not None:
        report.offload_bytes = trainer.offload()
        report.offload_s = clock.lap()
        if not overlap:
            trainer.wait()
            report.offload_wait_s = clock.lap()
    if engine is not None:
        engine.wake_up(tags=["weights"])
        report.wake_weights_s = clock.lap()
    report.refit = refit()
    report.refit_s = clock.lap()
    if trainer is not None and overlap:
        trainer.wait()
        report.offload_wait_s = clock.lap()
    if engine is not None:
        awake = engine.wake_up(tags=["kv_cache"])
        report.engine_awake = awake if isinstance(awake, bool) else None
        report.wake_kv_cache_s = clock.lap()
    report.total_s = clock.total()
    return report


def prepare_for_training(
    *,
    trainer: Offloadable | None = None,
    engine: SleepableEngine | None = None,
    sleep_level: int = 1,
    wait: bool = True,
    device: torch.device | str | None = None,
) -> TrainingPhaseReport:
    """Put the engine to sleep, then bring the optimizer state back.

    With ``wait=False`` the reload copies are left running (the current stream already waits for
    them, so training kernels see the restored state) and ``reload_wait_s`` stays 0."""
    clock = _Clock(_device(device, trainer))
    report = TrainingPhaseReport()
    if engine is not None:
        engine.sleep(level=sleep_level)
        report.sleep_s = clock.lap()
    if trainer is not None:
        report.reload_bytes = trainer.reload()
        report.reload_s = clock.lap(sync=False)  # the current stream waits for the reload copies
        if wait:
            trainer.wait()
            report.reload_wait_s = clock.lap()
    report.total_s = clock.total()
    return report
