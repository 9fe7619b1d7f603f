"""Least-squares line through (bytes, seconds): what a refit costs per byte and what it costs at none.

A layer sweep (``mxrefit bench --sweep-layers``) times refits of one model at several layer
counts. If the time is ``intercept + slope * bytes``, the slope is the rate the bytes move at
and the intercept is the per-refit cost that no byte causes (Python, launches, round trips);
R² says how well a line explains the points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LineFit:
    """``seconds = intercept_s + slope_s_per_byte * bytes``, fitted to ``points`` points."""

    slope_s_per_byte: float
    intercept_s: float
    r2: float
    points: int

    @property
    def GBps(self) -> float:
        """The slope as a rate: bytes per second / 1e9 (infinite where the time does not grow)."""
        return 1 / self.slope_s_per_byte / 1e9 if self.slope_s_per_byte > 0 else float("inf")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Ordinary least squares of ``ys`` on ``xs``; needs two distinct ``xs``. R² is 1 - residual /
    total sum of squares, and 1 where the ``ys`` do not vary and the line goes through them all."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values against {len(ys)} y values")
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError(f"a line needs at least two distinct x values, got {list(xs)}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LineFit(slope, intercept, r2, n)
