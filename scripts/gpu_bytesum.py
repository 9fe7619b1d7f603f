"""What ``--verify``'s integrity sums cost on the GPU: ``mxrefit.transport.bytesum`` over one refit bucket of
Qwen3-30B-A3B's shapes (per-expert FP8 values + E8M0 scales, 512 MiB) and over one flat 512 MiB view,
against the read bandwidth of the same bytes (a float sum) in the same run; launch shapes (32-bit words per
block, warps) swept. ``bytesum_call`` is the whole ``ByteSum()`` call, with its read-back of the two sums.

    PYTHONPATH=$PWD python3 scripts/gpu_bytesum.py --json $OUT/bytesum.json
"""

from __future__ import annotations

import argparse
import functools
import json

import cuda_timing
import torch

from mxrefit.transport import _bytesum_triton as k
from mxrefit.transport.bytesum import ByteSum

timed = functools.partial(cuda_timing.timed, reps=9)


def bucket_views(arena: torch.Tensor) -> list[torch.Tensor]:
    """Expert-shaped runs of a 512 MiB bucket: values (1536 x 2048 B) then scales (1536 x 64 B), repeated."""
    views, at = [], 0
    for n in [1536 * 2048, 1536 * 64] * (arena.numel() // (1536 * 2048 + 1536 * 64)):
        views.append(arena[at : at + n])
        at += n
    return views


def launch(group: k.ByteSumGroup, block: int, warps: int) -> None:
    group.out.zero_()
    k._bytesum_kernel[(group.programs,)](
        group.prog_region,
        group.prog_start,
        group.nbytes_of,
        group.addr_of,
        group.out,
        CHUNK=k.CHUNK,
        BLOCK=block,
        MOD=k.MOD,
        ALIGNED=group.aligned,
        num_warps=warps,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    arena = torch.randint(0, 256, (512 << 20,), dtype=torch.uint8, device=dev)
    n = arena.numel()
    floats = arena.view(torch.float32).clone()
    floats.nan_to_num_(0.0)
    read_s = timed(lambda: floats.sum())
    copy_dst = torch.empty_like(arena)
    copy_s = timed(lambda: copy_dst.copy_(arena))
    rows: dict = {"read_floor": {"s": read_s, "GBps": n / read_s / 1e9}, "copy": {"s": copy_s, "GBps": 2 * n / copy_s / 1e9}}
    for layout, views in (("bucket", bucket_views(arena)), ("flat", [arena])):
        covered = sum(v.numel() for v in views)
        total = ByteSum(views)
        rows[f"{layout}_bytesum_call"] = {
            "s": (s := timed(total)),
            "GBps": covered / s / 1e9,
            "views": len(views),
            "of_read_floor": read_s / s * covered / n,
        }
        group = total._group
        for block in (256, 512, 1024, 2048):  # words
            for warps in (2, 4, 8):
                s = timed(lambda: launch(group, block, warps))
                rows[f"{layout}_kernel_b{block}_w{warps}"] = {
                    "s": s,
                    "GBps": covered / s / 1e9,
                    "of_read_floor": read_s / s * covered / n,
                }
    for name, row in rows.items():
        print(f"{name:32s} {row['s'] * 1e3:8.3f} ms {row['GBps']:8.0f} GB/s", row.get("of_read_floor", ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "bytes": n, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
