"""Integrity sums: the Triton kernel (Triton's CPU interpreter here, the same code as on GPU)
gives the torch path's sums exactly, over regions of every size around the kernel's chunk,
and a flipped, swapped or moved byte changes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mxrefit.bytesum import MOD, ByteSum

_INTERPRETED = """
import json, sys, torch
from mxrefit import _bytesum_triton as k
from mxrefit.bytesum import ByteSum
g = torch.Generator().manual_seed(int(sys.argv[1]))
store = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=g)
sizes = [1, 15, 16, 4095, k.CHUNK - 1, k.CHUNK, k.CHUNK + 1, 2 * k.CHUNK + 7, 70001]
out, at = [], 0
for n in sizes:
    view = store[at:at + n]
    s = ByteSum([view])
    assert s._group is not None, "the Triton path must be the one under test"
    out.append([n, list(s())])
    at += n + 3  # next region starts unaligned
whole = ByteSum([store[:100003], store[100003:100003 + 9]])
out.append(["two regions", list(whole())])
print(json.dumps(out))
"""


def _torch_sums(views: list[torch.Tensor]) -> tuple[int, int]:
    """The definition, written out independently of mxrefit.bytesum."""
    s1 = s2 = 0
    for v in views:
        b = v.to(torch.int64)
        s1 += int(b.sum())
        s2 += int((b * (torch.arange(v.numel()) % MOD + 1)).sum())
    return s1, s2


def test_the_triton_kernel_gives_the_torch_sums_exactly():
    seed = 20261203
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED, str(seed)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    g = torch.Generator().manual_seed(seed)
    store = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=g)
    at = 0
    for n, sums in got[:-1]:
        view = store[at:at + n]
        assert tuple(sums) == _torch_sums([view]) == ByteSum([view])(), f"region of {n} bytes"
        at += n + 3
    assert tuple(got[-1][1]) == _torch_sums([store[:100003], store[100003:100003 + 9]])


@pytest.mark.parametrize("change", ["flip", "swap", "move"])
def test_a_changed_byte_changes_the_sums(change):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(1, 255, (5000,), dtype=torch.uint8, generator=g)
    before = ByteSum([data])()
    if change == "flip":
        data[1234] ^= 0x10
    elif change == "swap":
        a, b = int(data[10]), int(data[4000])
        if a == b:
            data[4000] = (b + 1) % 256
            b = int(data[4000])
        data[10], data[4000] = b, a
    else:  # the bytes land one position late: the same multiset, shifted
        data[1:] = data[:-1].clone()
        data[0] = data[-1]
    after = ByteSum([data])()
    assert after != before
    if change in ("swap", "move"):
        assert after[1] != before[1]  # the offset-weighted sum is what sees a reordering
