"""Human-readable output of a bench result: a table on the terminal and a phase-breakdown plot."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=max(120, Console().width))
    title = (f"mxrefit bench — {result['model']}, {result.get('format', 'mxfp8')}, post-process "
             f"{result.get('post', 'trtllm')}, on {result['device_name']} ({result['tensors']:,} tensors, "
             f"median of {result['steps']} steps after {result['warmup']} warm-up)")
    table = Table(title=title)
    for col in ("mode", "check ms", "quantize/pack ms", "wait ms", "engine update ms", "post-process ms", "total ms",
                "bytes moved", "GB/s", "peak extra GiB (trainer/engine)"):
        table.add_column(col, justify="right")
    for mode, m in result["modes"].items():
        mem = f"{m.get('trainer_peak_extra_bytes', 0) / 2**30:.2f} / {m.get('engine_peak_extra_bytes', 0) / 2**30:.2f}"
        label = f"{mode} ({m['transport']})" if m.get("transport") else mode
        table.add_row(label, _ms(m["check_s"]), _ms(m["pack_s"]), _ms(m["wait_s"]), _ms(m["engine_s"]), _ms(m["post_s"]),
                      _ms(m["total_s"]), f"{m['bytes'] / 1e6:,.1f} MB", f"{m['GBps']:.2f}", mem)
    table.add_row("floor", "", "", "", "", "", _ms(result["floor_s"]),
                  f"{(result['trainer_bf16_bytes'] + result['engine_bytes']) / 1e6:,.1f} MB r+w", f"{result['copy_GBps']:.1f} copy", "")
    console.print(table)
    if "speedup" in result:
        console.print(f"prequant is {result['speedup']:.1f}x faster than baseline; "
                      f"{result['modes']['prequant']['total_s'] / result['floor_s']:.1f}x the copy floor")
    for mode, m in result["modes"].items():
        check = m.get("check")
        if check:
            verdict = "identical" if not check["mismatched"] else f"DIFFERENT for {check['mismatched']}"
            console.print(f"{mode}: engine bytes vs quantize() of the trainer's tensors: {verdict} "
                          f"({check['parts_checked']} parts of {check['tensors_checked']} tensors, one per family; "
                          f"{check.get('kernel_layout_params_checked', 0)} params in the kernel layout)")


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
