"""`mxrefit bench` end to end on CPU: both modes, the floor, the byte check, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_cli_runs_and_engine_bytes_match(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    run = subprocess.run(
        [sys.executable, "-m", "mxrefit", "bench", "--steps", "2", "--no-progress", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"baseline", "prequant"}
    pre, base = result["modes"]["prequant"], result["modes"]["baseline"]
    assert pre["check"]["mismatched"] == [] and pre["check"]["tensors_checked"] >= 10
    assert pre["bytes"] < base["bytes"]  # MXFP8 values + scales are fewer bytes than BF16
    assert len(pre["per_step"]) == 2 and result["floor_s"] > 0 and result["copy_GBps"] > 0
    assert "identical" in run.stdout and png.stat().st_size > 1000


def test_bench_with_grouped_expert_slabs(tmp_path):
    out = tmp_path / "grouped.json"
    run = subprocess.run(
        [sys.executable, "-m", "mxrefit", "bench", "--steps", "1", "--mode", "prequant", "--experts", "grouped",
         "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["modes"]["prequant"]["check"]["mismatched"] == []
    assert result["tensors"] < 100  # slabs: far fewer tensors than per-expert names
