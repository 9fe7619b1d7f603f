"""`--sweep-layers` without running refits: the layer list, the per-column lines, the printed tables."""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest
from rich.console import Console

from mxrefit.bench.report import print_sweep
from mxrefit.bench.sweep import FLOOR, fit_runs, parse_layers


def _run(layers: int) -> dict:
    """A bench result whose times are exact lines in the traffic: 2 ms + 1 GB/s, 0.5 ms + 4 GB/s."""
    trainer, engine = layers * 3_000_000, layers * 1_000_000
    traffic = trainer + engine
    return {
        "model": f"tiny-qwen3-moe@{layers}l",
        "format": "mxfp8",
        "post": "trtllm",
        "device_name": "cpu",
        "steps": 2,
        "warmup": 1,
        "trainer_bf16_bytes": trainer,
        "engine_bytes": engine,
        "floor_s": traffic / 40e9,
        "modes": {
            "baseline": {"total_s": 0.002 + traffic / 1e9},
            "prequant": {"total_s": 0.0005 + traffic / 4e9, "transport": "direct", "check": {"mismatched": []}},
        },
    }


def test_parse_layers():
    assert parse_layers("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("4", "2,2", "0,1", "a,b"):
        with pytest.raises(ValueError, match="--sweep-layers"):
            parse_layers(bad)


def test_each_column_gets_its_own_line():
    fits = fit_runs([_run(n) for n in (1, 2, 4, 8)])
    assert list(fits) == ["baseline", "prequant", FLOOR]
    assert fits["baseline"].intercept_s == pytest.approx(0.002) and fits["baseline"].GBps == pytest.approx(1.0)
    assert fits["prequant"].intercept_s == pytest.approx(0.0005) and fits["prequant"].GBps == pytest.approx(4.0)
    assert fits[FLOOR].GBps == pytest.approx(40.0) and abs(fits[FLOOR].intercept_s) < 1e-12


@pytest.mark.parametrize("width", [80, 120])
def test_the_sweep_prints_whole_at(width):
    runs = [_run(n) for n in (1, 2, 4, 8)]
    result = {"layers": [1, 2, 4, 8], "runs": runs, "fits": {k: {**asdict(f), "GBps": f.GBps} for k, f in fit_runs(runs).items()}}
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    print_sweep(result, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width, text
    for word in ("layers", "traffic", "intercept", "slope", "GB/s", "R²", "(direct)", "copy", "floor", "as expected"):
        assert word in text, (word, text)
    prequant = next(line for line in text.splitlines() if line.startswith("│ prequant"))
    assert "0.5" in prequant and " 4 " in prequant and "1.0000" in prequant
