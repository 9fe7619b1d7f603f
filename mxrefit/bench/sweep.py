"""`mxrefit bench --sweep-layers`: the same bench at several layer counts, and a line through the times.

Each column (an mxrefit mode, a peer, the copy floor) gets ``total = intercept + slope * traffic``
by least squares (``fit.fit_line``), where traffic is the floor's bytes: the trainer's BF16
bytes read plus the engine's bytes written. The slope as GB/s of traffic is then comparable with
the copy rate of the run; the intercept is what a refit costs beyond its bytes (per-refit Python,
launches, round trips), which the issue asks to show small against the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from mxrefit.bench.fit import LineFit, fit_line
from mxrefit.bench.run import bench

FLOOR = "copy floor"


def parse_layers(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``: positive, at least two distinct counts (a line needs two)."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sweep-layers takes layer counts separated by commas, e.g. 1,2,4,8; got {text!r}") from None
    if any(n < 1 for n in layers) or len(set(layers)) < 2:
        raise ValueError(f"--sweep-layers needs at least two distinct layer counts, each >= 1; got {text!r}")
    return layers


def traffic(run: dict[str, Any]) -> int:
    """The floor's bytes of one bench result: the trainer's BF16 bytes read and the engine's written."""
    return run["trainer_bf16_bytes"] + run["engine_bytes"]


def peer_columns(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The peers' columns of one bench result: each peer's own path, preceded, where the peer is an
    engine mxrefit also refitted (``--peer vllm``), by mxrefit's refits into it (``mxrefit-into-<peer>``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in run.get("peers", {}).items():
        if "mxrefit" in p:
            out[f"mxrefit-into-{name}"] = p["mxrefit"]
        out[name] = p
    return out


def totals(run: dict[str, Any]) -> dict[str, float]:
    """Median seconds per refit of every column of one bench result, the floor last."""
    out = {name: m["total_s"] for name, m in run["modes"].items()}
    out.update({name: p["total_s"] for name, p in peer_columns(run).items()})
    out[FLOOR] = run["floor_s"]
    return out


def fit_runs(runs: Sequence[dict[str, Any]]) -> dict[str, LineFit]:
    """One line per column through (traffic, total) of every run."""
    xs = [float(traffic(r)) for r in runs]
    per_run = [totals(r) for r in runs]
    return {name: fit_line(xs, [t[name] for t in per_run]) for name in per_run[0]}


def sweep(layers: Sequence[int], **bench_kwargs: Any) -> dict[str, Any]:
    """Run ``bench`` once per layer count (same options otherwise) and fit each column's line."""
    runs = [bench(layers=n, **bench_kwargs) for n in layers]
    fits = fit_runs(runs)
    return {
        "layers": list(layers),
        "x": "trainer BF16 bytes read + engine bytes written, per refit",
        "runs": runs,
        "fits": {name: {**asdict(f), "GBps": f.GBps} for name, f in fits.items()},
    }
