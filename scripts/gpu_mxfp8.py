"""H200 run for the MXFP8 format: Triton/torch parity on fresh inputs, then speed against the copy floor.

    python scripts/gpu_mxfp8.py --json $OUT/mxfp8.json

Parity: every case is quantized by the Triton kernel (hardware rounding and integer rounding),
by the torch path on the GPU, by the torch path on the CPU (which CI proves equal to vLLM's
function) and by the independent oracle; all bytes must agree. Speed: median of timed launches
after warm-up, bytes read + written, against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mxrefit.formats import _mxfp8_triton, mxfp8
from mxrefit.formats.reference.mxfp8_cases import adversarial_suite, random_normal
from mxrefit.formats.reference.mxfp8_oracle import reference_quantize


def median_ms(fn, warmup: int = 3, reps: int = 15, per_graph: int = 1) -> float:
    """Median ms of one call; with per_graph > 1 the calls are replayed from a CUDA graph,
    so small launches are timed without the host's launch gaps."""
    if per_graph > 1:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
        call = graph.replay
    else:
        call = fn
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6  # GB/s, read + written


def triton_bytes(x: torch.Tensor, int_round: bool, min_byte: int = 0):
    v = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(mxfp8.scale_shape(x.shape), dtype=torch.uint8, device=x.device)
    bad = _mxfp8_triton.quantize_into(x, v, s, min_byte, int_round=int_round)
    assert bad is None
    return v.view(torch.uint8).cpu().numpy(), s.cpu().numpy()


def parity(seed: int) -> list[dict]:
    cases = dict(adversarial_suite())
    g = torch.Generator().manual_seed(seed)
    cases["fresh_normal"] = (torch.randn(512, 2048, generator=g) * 0.02).to(torch.bfloat16)
    cases["fresh_bits"] = (
        torch.randint(-(1 << 15), 1 << 15, (2048, 1024), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )
    cases["fresh_bits"] = torch.where(
        torch.isfinite(cases["fresh_bits"]), cases["fresh_bits"], torch.zeros((), dtype=torch.bfloat16)
    )
    cases["w13_like_3d"] = random_normal((8, 1536, 2048), 0.02, seed=seed + 1)
    cases["ragged_3d"] = random_normal((3, 77, 32 * 13), 3.0, seed=seed + 2)
    cases["fp16_normal"] = random_normal((256, 1024), 1e-3, seed=seed + 3, dtype=torch.float16)
    rows = []
    for name, x in cases.items():
        for min_byte in (0, 1):
            want = reference_quantize(x, min_byte)
            cpu = mxfp8.quantize(x, backend="torch", zero_block_scale_one=bool(min_byte))
            xg = x.cuda()
            gpu_torch = mxfp8.quantize(xg, backend="torch", zero_block_scale_one=bool(min_byte))
            results = {
                "torch_cpu": (cpu[0].view(torch.uint8).numpy(), cpu[1].numpy()),
                "torch_cuda": (gpu_torch[0].view(torch.uint8).cpu().numpy(), gpu_torch[1].cpu().numpy()),
                "triton_hw_round": triton_bytes(xg, False, min_byte),
                "triton_int_round": triton_bytes(xg, True, min_byte),
            }
            row = {"case": name, "shape": list(x.shape), "dtype": str(x.dtype), "min_byte": min_byte}
            for impl, (v, s) in results.items():
                row[impl] = {"value_bytes_differ": int((v != want[0]).sum()), "scale_bytes_differ": int((s != want[1]).sum())}
            rows.append(row)
    return rows


def speed(copy_gbs: float) -> list[dict]:
    out = []
    for shape in ((4096, 2048), (151936, 2048), (128, 1536, 2048)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
        v = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(mxfp8.scale_shape(shape), dtype=torch.uint8, device="cuda")
        bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device="cuda")
        nbytes = x.numel() * 2 + x.numel() + x.numel() // 32
        per_graph = max(1, int(2e9 // nbytes))  # ~2 GB of traffic per timed replay
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        variants = {"copy_same_bytes": lambda: dst.copy_(src)}
        for nb in (32, 64, 128, 256):
            for warps in (4, 8):
                variants[f"triton_hw_nb{nb}_w{warps}"] = lambda n=nb, w=warps: _mxfp8_triton.quantize_into(
                    x, v, s, 0, blocks_per_program=n, num_warps=w, int_round=False, bad=bad
                )
        variants["triton_int_nb128_w4"] = lambda: _mxfp8_triton.quantize_into(x, v, s, 0, int_round=True, bad=bad)
        variants["torch_ops"] = lambda: mxfp8._quantize_torch(x, v, s, 0, "x")
        for name, fn in variants.items():
            ms = median_ms(fn, per_graph=1 if name == "torch_ops" else per_graph)
            gbs = nbytes / ms / 1e6
            out.append({"shape": list(shape), "impl": name, "median_ms": ms, "GBps": gbs, "fraction_of_copy": gbs / copy_gbs})
        del x, v, s, src, dst
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": args.seed}
    report["copy_GBps"] = copy_bandwidth()
    print(f"device-to-device copy: {report['copy_GBps']:.0f} GB/s (read + written)")
    report["parity"] = parity(args.seed)
    worst = {}
    for row in report["parity"]:
        for impl in ("torch_cpu", "torch_cuda", "triton_hw_round", "triton_int_round"):
            d = row[impl]["value_bytes_differ"] + row[impl]["scale_bytes_differ"]
            worst[impl] = worst.get(impl, 0) + d
            if d:
                print(f"MISMATCH {impl} {row['case']} min_byte={row['min_byte']}: {row[impl]}")
    report["parity_total_differing_bytes"] = worst
    print("parity, differing bytes summed over all cases:", worst)
    report["speed"] = speed(report["copy_GBps"])
    for r in report["speed"]:
        print(
            f"{str(r['shape']):>18} {r['impl']:>18} {r['median_ms']:8.3f} ms {r['GBps']:7.0f} GB/s {100 * r['fraction_of_copy']:5.1f}% of copy"
        )
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
