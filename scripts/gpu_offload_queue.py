"""Why ``OptimizerOffloader.offload()`` holds the host: queue ~1,150 host<->device copies of ~11 MB
(Qwen3-30B-A3B optimizer state) in several ways and time the host's queueing apart from the copies.

    PYTHONPATH=$PWD python3 scripts/gpu_offload_queue.py --json $OUT/offload_queue.json

Rows (medians of 3): plain D2H / H2D copies into a page-locked ``PinnedArena`` on a side stream;
D2H into torch's own pinned memory; the real offloader (AdamW state + grads) offload / reload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mxrefit.lifecycle import OptimizerOffloader
from mxrefit.lifecycle.arena import PinnedArena, aligned_layout

ELEMS = 1536 * 2048  # fp32 elements of one expert projection's state: 12.6 MB


def timed_queue(queue, reps: int = 3) -> dict:
    """Host seconds spent queueing, and seconds until the copies are done."""
    rows = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        queue()
        queued = time.perf_counter() - t
        torch.cuda.synchronize()
        rows.append((queued, time.perf_counter() - t))
    rows = rows[1:]
    return {"queue_s": statistics.median(r[0] for r in rows), "total_s": statistics.median(r[1] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=1157)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream(dev)
    srcs = [torch.randn(ELEMS, device=dev).view(torch.uint8) for _ in range(args.tensors)]
    offsets, total = aligned_layout([s.numel() for s in srcs])
    arena = PinnedArena(total, what="diagnostic arena")
    rows: dict = {"bytes": total}

    def d2h(dst_of):
        with torch.cuda.stream(side):
            for s, o in zip(srcs, offsets):
                dst_of(o, s.numel()).copy_(s, non_blocking=True)

    def h2d():
        with torch.cuda.stream(side):
            for s, o in zip(srcs, offsets):
                s.copy_(arena.view(o, s.numel()), non_blocking=True)

    rows["d2h_arena"] = timed_queue(lambda: d2h(arena.view))
    rows["h2d_arena"] = timed_queue(h2d)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    rows["d2h_torch_pinned"] = timed_queue(lambda: d2h(lambda o, n: pinned[o : o + n]))
    del pinned
    one = torch.empty(total, dtype=torch.uint8, device=dev)
    rows["d2h_one_copy"] = timed_queue(lambda: arena.view(0, total).copy_(one, non_blocking=True))
    del one, srcs, arena
    torch.cuda.empty_cache()

    params = [torch.nn.Parameter(torch.randn(ELEMS, device=dev)) for _ in range(args.tensors // 3)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    off = OptimizerOffloader(opt)
    for phase in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        off.offload()
        queued = time.perf_counter() - t
        off.wait()
        done = time.perf_counter() - t
        t = time.perf_counter()
        off.reload()
        r_queued = time.perf_counter() - t
        off.wait()
        torch.cuda.synchronize()
        r_done = time.perf_counter() - t
        if phase:
            rows.setdefault("offloader", []).append(
                {
                    "offload_queue_s": queued,
                    "offload_total_s": done,
                    "reload_queue_s": r_queued,
                    "reload_total_s": r_done,
                    "bytes": off.nbytes,
                }
            )
    for name, row in rows.items():
        print(name, row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
