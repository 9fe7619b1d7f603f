"""Command line: ``mxrefit bench``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mxrefit.bench.peer import PEERS, unavailable
from mxrefit.bench.report import plot, plot_sweep, print_sweep, print_table
from mxrefit.bench.run import ALL_MODES, CHECK_MODES, FORMATS, MODES, bench, pick_device, resolve_post, resolve_shape
from mxrefit.bench.sweep import parse_layers, sweep
from mxrefit.plan.shapes import BUILTIN


def _mismatched(result: dict[str, Any]) -> bool:
    """Whether any checked column of one bench result found engine bytes unlike the trainer's."""
    return any(r.get("check", {}).get("mismatched") for r in [*result["modes"].values(), *result.get("peers", {}).values()])


def _bench(args: argparse.Namespace) -> int:
    modes = {"both": MODES, "all": ALL_MODES, "checks": CHECK_MODES}.get(args.mode, (args.mode,))
    try:
        post = resolve_post(args.format, args.post)
        layers = parse_layers(args.sweep_layers) if args.sweep_layers else None
        if layers and args.layers is not None:
            raise ValueError("--layers and --sweep-layers both set the layer count: give one")
        for peer in args.peer:
            why = unavailable(peer, pick_device(args.device), resolve_shape(args.model, args.layers), args.format)
            if why:
                raise ValueError(why)
    except (ValueError, RuntimeError) as err:
        print(f"mxrefit bench: {err}", file=sys.stderr)
        return 2
    options: dict[str, Any] = dict(
        model=args.model,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        modes=modes,
        bucket_bytes=args.bucket_mb << 20,
        experts=args.experts,
        post=post,
        progress=not args.no_progress,
        fmt=args.format,
        peers=tuple(args.peer),
        trace=args.trace,
    )
    if layers:
        result = sweep(layers, **options)
        print_sweep(result)
        runs = result["runs"]
    else:
        result = bench(layers=args.layers, **options)
        print_table(result)
        runs = [result]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        (plot_sweep if layers else plot)(result, args.plot)
    return 1 if any(_mismatched(r) for r in runs) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mxrefit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time refits of a built-in model: baseline vs prequant vs the copy floor")
    b.add_argument("--model", default="tiny-qwen3-moe", choices=sorted(BUILTIN))
    b.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    b.add_argument("--steps", type=int, default=5, help="timed refits per mode (medians are reported)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument(
        "--mode",
        default="both",
        choices=(
            "both",
            "all",
            "checks",
            "baseline",
            "prequant",
            "prequant-buffers",
            "prequant-in-step",
            "prequant-fused",
            "prequant-verify",
            "prequant-transactional",
        ),
        help="both = baseline + prequant; all adds prequant-buffers (mxrefit through transfer buffers); "
        "checks = prequant, prequant-in-step (Sender(one_behind=False): each bucket's ready message as soon "
        "as its kernels are queued), prequant-fused (check_finite=False: the non-finite screen runs inside the "
        "encoders, one read of the weights instead of two), prequant-verify (per-bucket integrity sums) "
        "and prequant-transactional (the engine receives into a shadow and commits a complete refit)",
    )
    b.add_argument("--bucket-mb", type=int, default=512, help="transfer bucket size (raised to the largest tensor)")
    b.add_argument(
        "--format",
        default="mxfp8",
        choices=FORMATS,
        help="engine's weight format: MXFP8 (ModelOpt), 128x128 block FP8 (Fp8Config; float32 or "
        "power-of-two scales), or BF16 (no quantization, what most RL stacks serve)",
    )
    b.add_argument(
        "--post",
        default=None,
        choices=("trtllm", "trtllm-staged", "none"),
        help="engine post-load layout: FlashInfer TRT-LLM (MoE shuffle, scale swizzle; MXFP8 only, its "
        "default), written in place by the trainer where the sources allow; trtllm-staged: all of it by "
        "the engine after each refit (the two-pass path); or none (FP8-block's default and only choice)",
    )
    b.add_argument("--layers", type=int, default=None, help="override the model's layer count (size sweeps)")
    b.add_argument(
        "--sweep-layers",
        metavar="N,N,...",
        help="run the bench at each of these layer counts (e.g. 1,2,4,8) and fit, per mode, time = intercept + "
        "traffic / slope by least squares: slope in GB/s, intercept in ms (the per-refit overhead), R²",
    )
    b.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=PEERS,
        help="also run another project's refit on the same tensors in the same run, printed beside mxrefit and the "
        "floor with its memory and a bit-exactness check: checkpoint-engine (MoonshotAI; CUDA only, pip install "
        "'mxrefit[peer]'); vllm (vLLM's own IPC weight-transfer path and mxrefit's, into one real vLLM started "
        "in this process after mxrefit's modes; CUDA only, vLLM 0.26's trainer API, mxfp8 or bf16, Qwen3 and "
        "Qwen3-MoE whole models)",
    )
    b.add_argument("--experts", default="per_expert", choices=("per_expert", "grouped"), help="trainer's expert tensor layout")
    b.add_argument("--json", metavar="PATH", help="write every figure as one JSON object")
    b.add_argument("--plot", metavar="PATH", help="write a PNG of the phase breakdown (needs matplotlib)")
    b.add_argument(
        "--trace",
        metavar="DIR",
        help="after each mode's timed refits, one more under torch.profiler: its Chrome trace written to DIR "
        "and the device's busy time against the span of its work printed (where a refit's device time goes)",
    )
    b.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
