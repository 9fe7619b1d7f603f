"""Where a refit's GPU time goes: the grouped MXFP8 launch over per-expert tensors (launch
shapes, with and without alignment hints) vs the same bytes as one slab, the finite screen, a
plain copy, and the engine's TRT-LLM layout kernels on one Qwen3-30B-A3B layer, in one run.

``loop_nb*_i*`` rows time the library's grouped kernel alone (issue 23's >= 90% of copy) at each
run length: each program quantizes ITERS runs of NB blocks of one tensor, so the launch-table
loads that precede every program's first read are paid once per ITERS runs (the library's default
is NB 128, ITERS 4); ``group_*`` rows time the library call, its host-side address check
included; every row's bytes are checked against the library call's. ``layout_*`` rows time the
kernel-layout launch (TRT-LLM rows, 128x4 scale tiles) at 1, 2 and 4 runs per program;
``passthrough_*`` rows a BF16 engine's screening copy at several chunk/block sizes against
``_foreach_copy_`` (``passthrough_x2_*`` / ``_x4_*``: BF16 pairs or quads per word); ``scan_*``
rows the finite screen's launch alone at the same widths, against a read of the same bytes.

    PYTHONPATH=$PWD python3 scripts/gpu_pack_profile.py --json $OUT/pack_profile.json
"""

from __future__ import annotations

import argparse
import json

import torch
from cuda_timing import timed

from mxrefit.formats import _mxfp8_triton as k
from mxrefit.formats._triton_common import LaunchTable
from mxrefit.formats.finite_check import FiniteCheck


def copy_row(traffic: int, dev: torch.device) -> dict:
    """A device copy moving ``traffic`` bytes (half read, half written): the row every kernel row is read against."""
    a = torch.empty(traffic // 2, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a))
    return {"s": s, "GBps": traffic / s / 1e9}


def loop_rows(srcs: list[torch.Tensor], outs: list, traffic: int, dev: torch.device) -> dict:
    """The library's grouped kernel alone (no host-side address check) at each run length ``iters``
    (runs of ``nb`` blocks per program; the library's default is nb 128, iters 1), its bytes
    compared with the library call's."""
    want_v = torch.cat([o[0].reshape(-1).view(torch.uint8) for o in outs])
    want_s = torch.cat([o[1].reshape(-1) for o in outs])
    n_blocks = [t.numel() // 32 for t in srcs]
    rows = {}
    for nb in (64, 128, 256):
        for iters in (1, 2, 4, 8):
            for warps in (4, 8):
                table = LaunchTable(n_blocks, nb * iters, outs, dev, "MXFP8")
                table.bind(srcs)
                n_of = table.ints(n_blocks, torch.int64)
                bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=dev)
                for o in outs:
                    o[0].view(torch.uint8).fill_(0)
                    o[1].fill_(0)

                def run() -> None:
                    k._group_kernel[(table.programs,)](
                        table.prog_tensor,
                        table.prog_unit,
                        n_of,
                        table.src_addr,
                        *table.out_addr,
                        bad,
                        MIN_BYTE=0,
                        NB=nb,
                        ITERS=iters,
                        INT_ROUND=False,
                        IS_BF16=True,
                        ALIGNED=True,
                        num_warps=warps,
                    )

                run()
                exact = torch.equal(torch.cat([o[0].reshape(-1).view(torch.uint8) for o in outs]), want_v) and torch.equal(
                    torch.cat([o[1].reshape(-1) for o in outs]), want_s
                )
                s = timed(run)
                rows[f"loop_nb{nb}_i{iters}_w{warps}"] = {"s": s, "GBps": traffic / s / 1e9, "bytes_equal": exact}
    return rows


def layout_rows(layers: int, dev: torch.device, e: int = 128, i_: int = 768, h: int = 2048) -> dict:
    """The kernel-layout launch (``_layout_group_kernel``: TRT-LLM rows and 128x4 scale tiles, as the
    trainer writes FlashInfer's MoE layout) on grouped experts (w13 gated, w2) at 1, 2 and 4 runs of
    128 blocks per program, bytes compared with the one-run launch, against a copy of the same traffic."""
    from mxrefit.formats.kernel_layout import KernelLayout, interleaved_size

    srcs, outs, layouts = [], [], []
    for _ in range(layers):
        for m, kk, order in ((2 * i_, h, "trtllm-gated"), (h, i_, "trtllm")):
            srcs.append(torch.randn(e, m, kk, device=dev, dtype=torch.bfloat16) * 0.02)
            values = torch.empty(e, m, kk, dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty(e * interleaved_size(m, kk // 32), dtype=torch.uint8, device=dev)
            outs.append((values, scales))
            layouts.append((KernelLayout(rows=order), KernelLayout(rows=order, tiles="128x4")))
    traffic = sum(t.numel() * 2 for t in srcs) + sum(v.numel() + sc.numel() for v, sc in outs)
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=dev)
    rows: dict = {}
    want = None
    for iters in (1, 2, 4):
        group = k.QuantizeGroup(srcs, outs, device=dev, iters=iters, layouts=layouts)
        for v, sc in outs:
            v.view(torch.uint8).fill_(0)
            sc.fill_(0)
        group(srcs, 0, bad)
        got = [(v.view(torch.uint8).clone(), sc.clone()) for v, sc in outs]
        want = want or got
        exact = all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(got, want))
        s = timed(lambda: group(srcs, 0, bad))
        rows[f"layout_nb128_i{iters}_w4"] = {"s": s, "GBps": traffic / s / 1e9, "bytes_equal": exact}
    rows["copy_layout_traffic"] = copy_row(traffic, dev)
    return rows


def scan_rows(srcs: list[torch.Tensor], nbytes: int, dev: torch.device) -> dict:
    """The finite screen's launch alone (``ScanGroup``, no host sync) at several chunk, block, warp
    and word widths (``_x2``/``_x4``: BF16 pairs or quads per word, chunk and block in elements), each
    checked to flag a NaN planted in the last tensor; ``read_reference`` is a torch reduction over
    the same bytes, a read rate to hold them against (the screen reads, it does not write)."""
    from mxrefit.formats._common import NO_BAD, bad_flag
    from mxrefit.formats._finite_check_triton import ScanGroup

    flat = torch.cat([t.view(-1) for t in srcs])
    s = timed(lambda: torch.amax(flat))
    rows = {"read_reference": {"s": s, "GBps_read": nbytes / s / 1e9}}
    del flat
    poisoned = list(srcs[:-1]) + [srcs[-1].clone()]
    poisoned[-1].view(-1)[-1] = float("nan")
    flag = bad_flag(dev)
    callers = list(range(len(srcs)))
    for lanes in (1, 2, 4):
        for chunk, block in ((16384, 2048), (16384, 4096), (65536, 2048)):
            for warps in (4, 8):
                scan = ScanGroup([t.numel() for t in srcs], torch.bfloat16, dev, block, chunk=chunk, num_warps=warps, lanes=lanes)
                flag.fill_(NO_BAD)
                scan(poisoned, flag, callers)
                flags_nan = int(flag.item()) == len(srcs) - 1
                flag.fill_(NO_BAD)
                s = timed(lambda: scan(srcs, flag, callers))
                rows[f"scan_x{lanes}_c{chunk}_b{block}_w{warps}"] = {
                    "s": s,
                    "GBps_read": nbytes / s / 1e9,
                    "flags_nan": flags_nan,
                    "clean": int(flag.item()) == NO_BAD,
                }
    return rows


def passthrough_rows(srcs: list[torch.Tensor], dev: torch.device) -> dict:
    """A BF16 engine's copy (``CopyGroup``: one launch, screening as it copies) over the same
    tensors at several chunk and block sizes, against ``_foreach_copy_`` and a copy of the same
    traffic (issue 23: >= 90% of the copy rate); every row's bytes compared with the sources."""
    from mxrefit.formats._passthrough_triton import CopyGroup

    nbytes = sum(t.numel() * 2 for t in srcs)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    outs, at = [], 0
    for t in srcs:
        outs.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=dev)
    numels = [t.numel() for t in srcs]
    # (lanes, chunk, block), chunk and block in elements: one element per word at each size, then
    # BF16 pairs (int32) and quads (int64, the library's default where sizes and addresses allow)
    # at the default's bytes per program and per iteration, and at n times both
    shapes = [(1, c, b) for c in (8192, 16384, 65536) for b in (1024, 2048, 4096)]
    shapes += [(n, c, b) for n in (2, 4) for c, b in ((16384, 2048), (16384, 4096), (16384 * n, 1024 * n))]
    rows = {}
    for lanes, chunk, block in shapes:
        for warps in (4, 8):
            group = CopyGroup(
                numels, torch.bfloat16, outs, list(range(len(srcs))), dev, chunk=chunk, block=block, num_warps=warps, lanes=lanes
            )
            flat.zero_()
            group(srcs, bad)
            exact = all(torch.equal(o, t) for o, t in zip(outs, srcs))
            s = timed(lambda: group(srcs, bad))
            width = "" if lanes == 1 else f"x{lanes}_"
            rows[f"passthrough_{width}c{chunk}_b{block}_w{warps}"] = {"s": s, "GBps": 2 * nbytes / s / 1e9, "bytes_equal": exact}
    s = timed(lambda: torch._foreach_copy_(outs, srcs))
    rows["passthrough_foreach_copy"] = {"s": s, "GBps": 2 * nbytes / s / 1e9}
    rows["copy_passthrough_traffic"] = copy_row(2 * nbytes, dev)
    return rows


def trtllm_rows(dev: torch.device) -> dict:
    """The TRT-LLM layout kernels on one Qwen3-30B-A3B layer's experts against a copy of the same bytes."""
    from mxrefit.integrations.vllm import _trtllm_triton as lay
    from mxrefit.integrations.vllm.trtllm import interleaved_size, moe_row_permutation

    rows = {}
    for name, (e, m, kk, gated) in {"w13": (128, 1536, 2048, True), "w2": (128, 2048, 768, False)}.items():
        perm = moe_row_permutation(m, gated).to(dev)
        src = torch.randint(0, 255, (e, m, kk), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        moved = 2 * src.numel()
        rows[f"copy_{name}_values"] = {"s": (s := timed(lambda: dst.copy_(src))), "GBps": moved / s / 1e9}
        for r in (2, 4, 8, 16):
            for block in (128, 256):
                for warps in (4, 8):
                    s = timed(lambda: lay.row_gather(src, dst, perm, rows=r, block=block, num_warps=warps))
                    rows[f"row_gather_{name}_r{r}_b{block}_w{warps}"] = {"s": s, "GBps": moved / s / 1e9}
        c = kk // 32
        ssrc = torch.randint(0, 255, (e, m, c), dtype=torch.uint8, device=dev)
        per = interleaved_size(m, c)
        sdst = torch.zeros(e * per, dtype=torch.uint8, device=dev)
        smoved = ssrc.numel() + sdst.numel()
        for r in (16, 32, 64):
            for warps in (4, 8):
                s = timed(lambda: lay.scale_interleave(ssrc, sdst, perm, per, rows=r, num_warps=warps))
                rows[f"scale_interleave_{name}_r{r}_w{warps}"] = {"s": s, "GBps": smoved / s / 1e9}
    return rows


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
    k.QuantizeGroup(srcs, outs, device=dev)(srcs, 0, bad)
    rows.update(loop_rows(srcs, outs, traffic, dev))
    for nb in (64, 128, 256, 512):
        for warps in (4, 8):
            group = k.QuantizeGroup(srcs, outs, device=dev, blocks_per_program=nb, num_warps=warps)
            for aligned in (True, False):
                group(srcs, 0, bad)
                group._aligned = aligned
                s = timed(lambda: group(srcs, 0, bad))
                rows[f"group_nb{nb}_w{warps}_{'aligned' if aligned else 'unhinted'}"] = {"s": s, "GBps": traffic / s / 1e9}
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
    rows.update(scan_rows(srcs, nbytes, dev))
    rows["copy_same_traffic"] = copy_row(traffic, dev)
    rows.update(passthrough_rows(srcs, dev))
    rows.update(trtllm_rows(dev))
    rows.update(layout_rows(args.layers, dev))
    out = {"tensors": len(srcs), "bf16_bytes": nbytes, "traffic_bytes": traffic, "rows": rows}
    print(json.dumps(out, indent=1))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
