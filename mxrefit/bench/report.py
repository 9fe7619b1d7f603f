"""Human-readable output of a bench result: a table on the terminal and a phase-breakdown plot."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from mxrefit.bench.sweep import FLOOR, peer_columns, totals, traffic


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _rate(gbps: float) -> str:
    """GB/s with three significant figures below 100 (a CPU's slope is a fraction of one)."""
    return f"{gbps:,.0f}" if gbps >= 100 else f"{gbps:.3g}"


# (row label with its unit, key in a mode's summary, formatter); a phase per row and a mode per
# column, so the width grows with the number of modes, not of phases; where the modes, the peers
# and the floor are still too wide for the terminal, `tables` splits the columns
_ROWS = (
    ("finite check, ms", "check_s", _ms),
    ("quantize/pack, ms", "pack_s", _ms),
    ("wait, ms", "wait_s", _ms),
    ("engine apply, ms", "engine_s", _ms),
    ("post-process, ms", "post_s", _ms),
    ("total, ms", "total_s", _ms),
    ("moved, MB", "bytes", lambda b: f"{b / 1e6:,.1f}"),
    ("rate, GB/s", "GBps", lambda r: f"{r:,.2f}"),
    ("trainer peak+, GiB", "trainer_peak_extra_bytes", lambda b: f"{b / 2**30:.2f}"),
    ("engine peak+, GiB", "engine_peak_extra_bytes", lambda b: f"{b / 2**30:.2f}"),
    ("device peak+, GiB", "device_peak_extra_bytes", lambda b: f"{b / 2**30:.2f}"),
)


# what the short row labels stand for, printed under the table so that no label needs the width
LEGEND = (
    "peak+: peak device memory above what that process held before its first refit (device: every "
    "process on it, sampled each ms, where the engine is a real vLLM); "
    "x copy floor: total / floor; floor: the trainer's BF16 bytes read and the engine's bytes "
    "written once, at the device's copy rate measured in this run"
)


def _header(mode: str, note: str | None) -> str:
    """A column name broken at its hyphens, so a long name takes lines, not width."""
    name = mode.replace("-", "-\n")
    return f"{name}\n({note})" if note else name


def _cell(fmt, m: dict[str, Any], key: str) -> str:
    """A figure, or a dash where a column has no such phase (a peer's own path)."""
    return fmt(m[key]) if key in m else "—"


def columns(result: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every timed column of a result, mxrefit's modes then the peers: name -> (header, summary)."""
    out = {mode: (_header(mode, m.get("transport")), m) for mode, m in result["modes"].items()}
    out.update(
        {
            name: (_header(name, p.get("transport") if name.startswith("mxrefit-") else "peer"), p)
            for name, p in peer_columns(result).items()
        }
    )
    return out


def _table(result: dict[str, Any], cols: list[tuple[str, dict[str, Any]]], title: str | None) -> Table:
    """The row labels, the given columns and the copy floor."""
    table = Table(title=title)
    table.add_column("per refit", no_wrap=True)
    for header, _ in cols:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("copy\nfloor", justify="right", no_wrap=True)
    floor = {
        "total_s": _ms(result["floor_s"]),
        "bytes": f"{(result['trainer_bf16_bytes'] + result['engine_bytes']) / 1e6:,.1f}",
        "GBps": f"{result['copy_GBps']:,.1f}",
    }
    for label, key, fmt in _ROWS:
        if not any(key in m for _, m in cols):
            continue  # a row no column has (the device-wide peak is measured beside a real vLLM only)
        table.add_row(label, *(_cell(fmt, m, key) for _, m in cols), floor.get(key, ""))
    table.add_row("x copy floor", *(f"{m['total_s'] / m.get('floor_s', result['floor_s']):,.1f}" for _, m in cols), "1.0")
    return table


def _fit_width(build: Callable[[list[Any], str | None], Table], cols: list[Any], title: str, width: int) -> list[Table]:
    """``build(cols, title)`` as one table, or split into as few as fit ``width`` columns (each
    keeping the fixed columns ``build`` adds) where all at their natural width would not: rich
    would cut them instead."""
    probe = Console(width=10_000, file=io.StringIO())
    out: list[Table] = []
    group: list[Any] = []
    head: str | None = title
    for col in cols:
        if group and Measurement.get(probe, probe.options, build([*group, col], None)).maximum > width:
            out.append(build(group, head))
            head, group = None, []
        group.append(col)
    out.append(build(group, head))
    return out


def tables(result: dict[str, Any], width: int) -> list[Table]:
    """The bench table for a terminal ``width`` columns wide (split by columns where needed)."""
    title = (
        f"mxrefit bench: {result['model']}, {result.get('format', 'mxfp8')}, post-process "
        f"{result.get('post', 'trtllm')}, {result['device_name']}, {result['tensors']:,} tensors, "
        f"median of {result['steps']} after {result['warmup']} warm-up"
    )
    return _fit_width(lambda cols, head: _table(result, cols, head), list(columns(result).values()), title, width)


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for table in tables(result, console.width):
        console.print(table)
    console.print(LEGEND)
    if "speedup" in result:
        pre, speedup = result["modes"]["prequant"]["total_s"] / result["floor_s"], result["speedup"]
        versus = f"{speedup:.1f}x faster than" if speedup >= 1 else f"{1 / speedup:.1f}x slower than"
        console.print(f"prequant is {versus} baseline; {pre:.1f}x the copy floor")
    for mode, m in result["modes"].items():
        check = m.get("check")
        if check:
            verdict = "identical" if not check["mismatched"] else f"DIFFERENT for {check['mismatched']}"
            console.print(
                f"{mode}: engine bytes vs quantize() of the trainer's tensors: {verdict} "
                f"({check['parts_checked']} parts of {check['tensors_checked']} tensors, one per family; "
                f"{check.get('kernel_layout_params_checked', 0)} params in the kernel layout)"
            )
    for mode, m in result["modes"].items():
        t = m.get("trace")
        if t:
            share = f" ({t['device_busy_ms'] / t['device_span_ms']:.0%})" if t["device_span_ms"] else ""
            top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms x{k['count']}" for k in t["top_kernels"][:3])
            console.print(
                f"{mode} traced refit: {t['refit_ms']:.1f} ms; trainer device busy {t['device_busy_ms']:.1f} of "
                f"{t['device_span_ms']:.1f} ms{share}; top kernels: {top or 'none'}; {t['path']}"
            )
    for name, p in result.get("peers", {}).items():
        check = p["check"]
        verdict = (
            "identical" if not check["mismatched"] else f"DIFFERENT for {len(check['mismatched'])}: {check['mismatched'][:5]}"
        )
        if "mxrefit" in p:
            console.print(_vllm_line(name, p, verdict))
            continue
        console.print(
            f"{name} (its own path, BF16 into a BF16 engine): register {_ms(p['register_s'])} ms (GPU -> pinned host), "
            f"gather_metas {_ms(p['gather_s'])}, update {_ms(p['update_s'])}, unregister {_ms(p['unregister_s'])}; "
            f"{p['pinned_host_bytes'] / 2**30:.2f} GiB pinned host memory; its x copy floor is against its own floor, "
            f"BF16 read + BF16 written: {_ms(p['floor_s'])} ms; received tensors vs the trainer's (sha256): {verdict} "
            f"({check['tensors_checked']:,} tensors)"
        )


def _vllm_line(name: str, p: dict[str, Any], verdict: str) -> str:
    """``--peer vllm``: its phases, both paths' memory, the speedup and the engine-state check."""
    m, speedup = p["mxrefit"], p["speedup"]
    versus = f"{speedup:.1f}x faster than" if speedup >= 1 else f"{1 / speedup:.1f}x slower than"
    quantizer = p["engine"].get("own_quantizer") or {}
    by = f" by {quantizer['function']}" if quantizer else ""
    if quantizer and not quantizer["modelopt_rule"]:
        by += f" ({quantizer['why']})"
    mode = p["engine"].get("learned_layout")
    learned = {"1": ", mxrefit's learned layout", "quantized": ", mxrefit's learned layout", "0": ", learned layout off"}.get(
        mode, ""
    )
    settle = m.get("settle") or {}
    settling = ""
    if not settle.get("settled", True):
        n = settle["refits"] + settle["steady_refits"]
        settling = f"mxrefit's path did NOT settle in {n} refits (the last planned again); its medians are that last refit's; "
    elif settle.get("replans"):
        settling = (
            f"mxrefit's first {settle['refits']} refits settled its layout ({settle['replans']} planned again, "
            f"{_ms(settle['total_s'])} ms in all), its medians are over the {settle['steady_refits']} after; "
        )
    return (
        f"{name} {p['engine']['vllm']} (its own IPC path, one real vLLM for both columns{learned}): start {_ms(p['start_s'])} ms, "
        f"send+load {_ms(p['send_load_s'])} (trainer quantize {_ms(p['trainer_quantize_s'])}{by}), finish {_ms(p['finish_s'])}; "
        f"device peak+ {p['device_peak_extra_bytes'] / 2**30:.2f} GiB, mxrefit's {m['device_peak_extra_bytes'] / 2**30:.2f} GiB; "
        f"{settling}mxrefit into it is {versus} its own path; the engine's params after its own load vs after mxrefit's refit "
        f"of the same weights (sha256): {verdict} ({p['check']['params_checked']:,} params)"
    )


SWEEP_LEGEND = (
    "traffic: the trainer's BF16 bytes read + the engine's bytes written (the floor's bytes); "
    "per column, least squares over the layer counts: time = intercept + traffic / slope; "
    "intercept: what a refit costs beyond its bytes (Python, launches, round trips)"
)


def _sweep_table(sweep: dict[str, Any], names: list[str], title: str | None) -> Table:
    """A row per layer count: its traffic and each column's median total per refit."""
    headers = {name: header for name, (header, _) in columns(sweep["runs"][0]).items()}
    headers[FLOOR] = "copy\nfloor"
    table = Table(title=title)
    table.add_column("layers", justify="right", no_wrap=True)
    table.add_column("traffic\nMB", justify="right", no_wrap=True)
    for name in [*names, FLOOR]:
        table.add_column(f"{headers[name]}\nms", justify="right", no_wrap=True)
    for n, run in zip(sweep["layers"], sweep["runs"]):
        t = totals(run)
        table.add_row(str(n), f"{traffic(run) / 1e6:,.1f}", *(_ms(t[name]) for name in [*names, FLOOR]))
    return table


def print_sweep(sweep: dict[str, Any], console: Console | None = None) -> None:
    """The sweep's times per layer count, then each column's line: intercept, slope, R²."""
    console = console or Console()
    first = sweep["runs"][0]
    title = (
        f"mxrefit bench --sweep-layers: {first['model'].split('@')[0]}, {first.get('format', 'mxfp8')}, "
        f"post-process {first.get('post', 'trtllm')}, {first['device_name']}, total per refit, median of "
        f"{first['steps']} after {first['warmup']} warm-up"
    )
    names = [name for name in sweep["fits"] if name != FLOOR]
    for table in _fit_width(lambda cols, head: _sweep_table(sweep, cols, head), names, title, console.width):
        console.print(table)
    fits = Table(title="time = intercept + traffic / slope, least squares")
    fits.add_column("column", no_wrap=True)
    fits.add_column("intercept\nms", justify="right", no_wrap=True)
    fits.add_column("slope\nGB/s", justify="right", no_wrap=True)
    fits.add_column("R²", justify="right", no_wrap=True)
    fits.add_column("points", justify="right", no_wrap=True)
    for name, f in sweep["fits"].items():
        fits.add_row(name, _ms(f["intercept_s"]), _rate(f["GBps"]), f"{f['r2']:.4f}", str(f["points"]))
    console.print(fits)
    console.print(SWEEP_LEGEND)
    bad = [
        f"{n} layers, {mode}: {m['check']['mismatched']}"
        for n, run in zip(sweep["layers"], sweep["runs"])
        for mode, m in {**run["modes"], **run.get("peers", {})}.items()
        if m.get("check", {}).get("mismatched")
    ]
    checked = sum(1 for run in sweep["runs"] for m in {**run["modes"], **run.get("peers", {})}.values() if m.get("check"))
    console.print(
        f"engine bytes vs the trainer's: DIFFERENT for {bad}"
        if bad
        else f"engine bytes as expected in every checked mode of every layer count ({checked} checks)"
    )


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    phases = [("check_s", "finite check"), ("pack_s", "quantize/pack"), ("wait_s", "wait for engine")]
    # post-processing overlaps the trainer's packing in mxrefit; the bar shows the trainer's wall time
    fig, ax = plt.subplots(figsize=(7, 3 + 0.4 * len(modes)))
    left = [0.0] * len(modes)
    for key, label in phases:
        vals = [result["modes"][m][key] * 1e3 for m in modes]
        ax.barh(modes, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    ax.axvline(result["floor_s"] * 1e3, color="k", linestyle="--", label="copy floor")
    ax.set_xlabel("ms per refit (median)")
    ax.set_title(f"{result['model']} ({result.get('format', 'mxfp8')}) on {result['device_name']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_sweep(sweep: dict[str, Any], path: str) -> None:
    """Each column's totals against traffic, with its fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [traffic(run) / 1e9 for run in sweep["runs"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, f in sweep["fits"].items():
        ys = [totals(run)[name] * 1e3 for run in sweep["runs"]]
        (points,) = ax.plot(xs, ys, "o", label=f"{name}: {f['intercept_s'] * 1e3:.2f} ms + GB / {f['GBps']:,.1f} GB/s")
        line = [(f["intercept_s"] + f["slope_s_per_byte"] * x * 1e9) * 1e3 for x in xs]
        ax.plot(xs, line, "-", color=points.get_color())
    ax.set_xlabel("traffic per refit, GB (trainer BF16 read + engine written)")
    ax.set_ylabel("ms per refit (median)")
    first = sweep["runs"][0]
    ax.set_title(
        f"{first['model'].split('@')[0]} ({first.get('format', 'mxfp8')}) on {first['device_name']}, layers {sweep['layers']}"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
