"""The layer sweep's least-squares line (mxrefit.bench.fit)."""

from __future__ import annotations

import random

import pytest

from mxrefit.bench.fit import fit_line


def test_a_known_line_is_recovered():
    xs = [1e9, 2e9, 4e9, 8e9]  # bytes
    ys = [0.003 + x / 4e12 for x in xs]  # 3 ms + bytes at 4 TB/s
    fit = fit_line(xs, ys)
    assert fit.slope_s_per_byte == pytest.approx(1 / 4e12, rel=1e-9)
    assert fit.intercept_s == pytest.approx(0.003, rel=1e-9)
    assert fit.GBps == pytest.approx(4000.0, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.points == 4


def test_noisy_points_give_r2_below_one_and_a_near_line():
    rng = random.Random(0)
    xs = [float(x) for x in range(1, 21)]
    ys = [2.0 + 0.5 * x + rng.gauss(0, 0.3) for x in xs]
    fit = fit_line(xs, ys)
    assert 0.9 < fit.r2 < 1.0
    assert fit.slope_s_per_byte == pytest.approx(0.5, abs=0.05)
    assert fit.intercept_s == pytest.approx(2.0, abs=0.5)


def test_flat_time_is_an_infinite_rate_and_a_perfect_fit():
    fit = fit_line([1.0, 2.0, 3.0], [0.5, 0.5, 0.5])
    assert fit.GBps == float("inf") and fit.intercept_s == 0.5 and fit.r2 == 1.0


@pytest.mark.parametrize("xs, ys", [([1.0], [1.0]), ([2.0, 2.0], [1.0, 3.0]), ([1.0, 2.0], [1.0])])
def test_a_line_needs_two_distinct_points(xs, ys):
    with pytest.raises(ValueError):
        fit_line(xs, ys)
