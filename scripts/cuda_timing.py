"""Device time of a callable, shared by the H200 profiling scripts (imported as a sibling module)."""

from __future__ import annotations

import statistics

import torch


def timed(fn, reps: int = 7) -> float:
    """Median seconds of ``reps`` calls between CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
