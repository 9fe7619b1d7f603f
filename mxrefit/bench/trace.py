"""One refit under ``torch.profiler``: the trainer's device timeline, kernels and the gaps between them.

Why: a refit's phases are host clocks. When the device is the bound, only its own timeline says
whether a bucket's kernels are slower than their bytes or the device idles between buckets (on an
H100 on 2026-12-06 one tree's packing took 10.6 ms per bucket against 0.95 ms in the tree before;
the host clocks could not tell which). The trace covers the trainer's process: the engine runs its
kernels in its own process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

TOP_KERNELS = 8
SPAN_NAME = "mxrefit.refit"  # the refit's range in the trace


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` spans: device work that overlaps is counted once."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def traced_refit(refit: Callable[[], Any], path: Path, device: torch.device) -> dict[str, Any]:
    """Run ``refit`` once under the profiler, write its Chrome trace (chrome://tracing, Perfetto) to
    ``path`` and return what it says: the refit's wall time, the device's busy time within the span
    from its first to its last event, and the kernels that took the most device time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with record_function(SPAN_NAME):
            refit()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    span = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    kernels = sorted(
        ((k.key, k.count, k.self_device_time_total) for k in prof.key_averages() if k.self_device_time_total > 0),
        key=lambda row: -row[2],
    )
    return {
        "path": str(path),
        "refit_ms": wall * 1e3,
        "device_events": len(spans),
        "device_span_ms": span / 1e3,
        "device_busy_ms": busy_us(spans) / 1e3,
        "top_kernels": [{"name": name, "count": count, "ms": us / 1e3} for name, count, us in kernels[:TOP_KERNELS]],
    }
