"""Byte checks of what an engine holds against what the trainer sent, through the engine's own checksums."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from mxrefit.formats import fp8_block, mxfp8
from mxrefit.plan.types import Destination

Take = Callable[[str, torch.Tensor], torch.Tensor]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_under_triton_interpreter(script: str, timeout_s: float = 600) -> None:
    """Run ``script`` (given the repository root as its argument) in a fresh Python with
    ``TRITON_INTERPRET=1``, which Triton reads at import, and require it to print "ok"."""
    run = subprocess.run(
        [sys.executable, "-c", script, ROOT],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_parts(dest: Destination, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the engine must hold for ``tensor``: its format's quantize() where it is held quantized, else a cast."""
    src = tensor.detach()
    if dest.format == "mxfp8":
        return mxfp8.quantize(src, backend="torch")
    if dest.format in ("fp8-block", "fp8-block-ue8m0"):
        return fp8_block.quantize(src, use_ue8m0=dest.format == "fp8-block-ue8m0", backend="torch")
    return (src.to(dest.targets[0].dtype),)


def mismatched(
    request: Callable[[dict], dict],
    destinations: dict[str, Destination],
    weights: dict[str, torch.Tensor],
    take: Take | None = None,
) -> list[str]:
    """Names whose engine bytes differ from the expected parts; ``take(name, part)`` gives a
    tensor-parallel rank's slice of a part (whole when None)."""
    ranges, want, names = [], [], []
    for name, dest in destinations.items():
        for tgt, part in zip(dest.targets, expected_parts(dest, weights[name])):
            local = part if take is None else take(name, part)
            ranges.append([tgt.param, tgt.offset, local.numel() * local.element_size()])
            want.append(sha(local))
            names.append(name)
    got = request({"op": "checksum", "ranges": ranges})["sha256"]
    return sorted({n for n, g, w in zip(names, got, want) if g != w})


def engine_matches(sender, weights: dict[str, torch.Tensor]) -> list[str]:
    """For a one-engine Sender: names whose engine bytes differ from the trainer's tensors."""
    return mismatched(lambda m: sender.client.request(m, 30, step="checksums"), sender._tables[1], weights)


def rank_matches(sender, rank: int, weights: dict[str, torch.Tensor], take: Take | None = None) -> list[str]:
    """For a BroadcastSender: the same check against engine rank ``rank`` alone."""
    fan = sender.client

    def request(msg: dict) -> dict:
        fan.send_to(rank, msg)
        return fan.recv_from(rank, time.monotonic() + 30, "checksums")

    return mismatched(request, sender._tables[1], weights, take)
