"""Human-readable output of a bench result: a table on the terminal and a phase-breakdown plot."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


# (row label with its unit, key in a mode's summary, formatter); a phase per row and a mode per
# column, so the width grows with the number of modes, not of phases: four modes and the floor
# read in an 80-column terminal without cut headers
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
)


def _header(mode: str, transport: str | None) -> str:
    """A mode name broken at its hyphens, so a long name takes lines, not width."""
    name = mode.replace("-", "-\n")
    return f"{name}\n({transport})" if transport else name


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    title = (
        f"mxrefit bench: {result['model']}, {result.get('format', 'mxfp8')}, post-process "
        f"{result.get('post', 'trtllm')}, {result['device_name']}, {result['tensors']:,} tensors, "
        f"median of {result['steps']} after {result['warmup']} warm-up"
    )
    table = Table(title=title)
    table.add_column("per refit", no_wrap=True)
    modes = result["modes"]
    for mode, m in modes.items():
        table.add_column(_header(mode, m.get("transport")), justify="right", no_wrap=True)
    table.add_column("copy\nfloor", justify="right", no_wrap=True)
    floor = {
        "total_s": _ms(result["floor_s"]),
        "bytes": f"{(result['trainer_bf16_bytes'] + result['engine_bytes']) / 1e6:,.1f}",
        "GBps": f"{result['copy_GBps']:.1f}",
    }
    for label, key, fmt in _ROWS:
        table.add_row(label, *(fmt(m.get(key, 0)) for m in modes.values()), floor.get(key, ""))
    table.add_row("x copy floor", *(f"{m['total_s'] / result['floor_s']:,.1f}" for m in modes.values()), "1.0")
    console.print(table)
    console.print(
        "floor: the trainer's BF16 bytes read and the engine's bytes written once, at the device's copy rate measured in this run"
    )
    if "speedup" in result:
        console.print(
            f"prequant is {result['speedup']:.1f}x faster than baseline; "
            f"{result['modes']['prequant']['total_s'] / result['floor_s']:.1f}x the copy floor"
        )
    for mode, m in modes.items():
        check = m.get("check")
        if check:
            verdict = "identical" if not check["mismatched"] else f"DIFFERENT for {check['mismatched']}"
            console.print(
                f"{mode}: engine bytes vs quantize() of the trainer's tensors: {verdict} "
                f"({check['parts_checked']} parts of {check['tensors_checked']} tensors, one per family; "
                f"{check.get('kernel_layout_params_checked', 0)} params in the kernel layout)"
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
