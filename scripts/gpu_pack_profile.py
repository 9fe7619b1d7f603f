"""Where the trainer's packing time goes on a GPU: the grouped MXFP8 launch over per-expert
tensors vs the same bytes as one slab, the finite screen, and a plain copy, in one run.

    PYTHONPATH=$PWD python3 scripts/gpu_pack_profile.py --json $OUT/pack_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mxrefit.finite_check import FiniteCheck
from mxrefit.formats import _mxfp8_triton as k


def timed(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    e, i_, h = 128, 768, 2048
    shapes = [(i_, h), (i_, h), (h, i_)] * e * args.layers
    srcs = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for s in shapes]
    nbytes = sum(t.numel() * 2 for t in srcs)
    vals = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    scls = torch.empty(nbytes // 64, dtype=torch.uint8, device=dev)
    outs, vo, so = [], 0, 0
    for t in srcs:
        n = t.numel()
        outs.append((vals[vo : vo + n].view(torch.float8_e4m3fn).view(t.shape), scls[so : so + n // 32].view(*t.shape[:-1], -1)))
        vo, so = vo + n, so + n // 32
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=dev)
    rows = {}
    traffic = nbytes + vals.numel() + scls.numel()
    for nb in (64, 128, 256, 512):
        group = k.QuantizeGroup(srcs, outs, device=dev, blocks_per_program=nb)
        s = timed(lambda: group(srcs, 0, bad))
        rows[f"group_nb{nb}"] = {"s": s, "GBps": traffic / s / 1e9}
    slab = torch.randn(len(srcs) * i_ * h, device=dev, dtype=torch.bfloat16).view(-1, h)
    sv = torch.empty(slab.shape, dtype=torch.float8_e4m3fn, device=dev)
    ss = torch.empty(slab.shape[0], h // 32, dtype=torch.uint8, device=dev)
    s = timed(lambda: k.quantize_into(slab, sv, ss, 0))
    rows["one_slab"] = {"s": s, "GBps": traffic / s / 1e9}
    check = FiniteCheck([(tuple(t.shape), t.dtype) for t in srcs], dev)
    s = timed(lambda: check.first_bad(srcs))
    rows["finite_check"] = {"s": s, "GBps_read": nbytes / s / 1e9}
    s = timed(lambda: torch._foreach_norm(srcs))
    rows["foreach_norm"] = {"s": s, "GBps_read": nbytes / s / 1e9}
    a = torch.empty(traffic // 2, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a))
    rows["copy_same_traffic"] = {"s": s, "GBps": traffic / s / 1e9}
    out = {"tensors": len(srcs), "bf16_bytes": nbytes, "traffic_bytes": traffic, "rows": rows}
    print(json.dumps(out, indent=1))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
