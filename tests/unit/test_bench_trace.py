"""The traced refit's device busy time: spans that overlap count once."""

from __future__ import annotations

import pytest

from mxrefit.bench.trace import busy_us


@pytest.mark.parametrize(
    "spans,busy",
    [
        ([], 0.0),
        ([(0, 10)], 10.0),
        ([(0, 10), (20, 25)], 15.0),  # a gap of 10 is not busy
        ([(0, 10), (5, 15)], 15.0),  # overlapping: 5 counted once
        ([(0, 30), (5, 10), (12, 20)], 30.0),  # nested inside a longer span
        ([(20, 25), (0, 10), (8, 12)], 17.0),  # any order
    ],
)
def test_busy_time_is_the_union_of_the_spans(spans, busy):
    assert busy_us(spans) == busy
    # negative control: the plain sum differs wherever spans overlap, so the union is what was checked
    if any(a < d and c < b for i, (a, b) in enumerate(spans) for c, d in spans[i + 1 :]):
        assert sum(b - a for a, b in spans) != busy
