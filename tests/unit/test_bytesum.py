"""Integrity sums: the Triton kernel (Triton's CPU interpreter here, the same code as on GPU)
gives the torch path's sums and an independent numpy definition exactly — over aligned regions
(whole words loaded at once) and unaligned ones (words assembled from bytes), of every size
around the kernel's chunk, and where the sums wrap modulo 2**64 — and a flipped, swapped or moved
byte changes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mxrefit.transport.bytesum import MOD, ByteSum

_INTERPRETED = """
import json, sys, torch
from mxrefit.transport import _bytesum_triton as k
from mxrefit.transport.bytesum import ByteSum
g = torch.Generator().manual_seed(int(sys.argv[1]))
store = torch.randint(0, 256, (1 << 19,), dtype=torch.uint8, generator=g)
chunk = 4 * k.CHUNK
sizes = [1, 3, 4, 15, 16, 4095, chunk - 1, chunk, chunk + 1, chunk + 4, 2 * chunk + 7, 70001]
out = []
for gap, aligned in ((3, False), (16, True)):
    at = 16
    for n in sizes:
        at = -(-at // 16) * 16 if aligned else at + (at % 16 == 0)
        s = ByteSum([store[at:at + n]])
        assert s._group is not None and s._group.aligned == aligned, "the Triton path under test"
        out.append([at, n, list(s())])
        at += n + gap
ones = torch.full((1 << 20,), 255, dtype=torch.uint8)
out.append(["0xff", list(ByteSum([ones])())])
out.append(["two regions", list(ByteSum([store[:100003], store[100003:100003 + 9]])())])
print(json.dumps(out))
"""


def _numpy_sums(views: list[torch.Tensor]) -> tuple[int, int]:
    """The definition written out with numpy's wrapping uint64 arithmetic, apart from mxrefit.transport.bytesum."""
    s1 = s2 = np.uint64(0)
    for v in views:
        raw = v.numpy().tobytes()
        raw += b"\0" * (-len(raw) % 4)
        w = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
        k = np.arange(len(w), dtype=np.uint64) % np.uint64(MOD) + np.uint64(1)
        s1 += w.sum(dtype=np.uint64)
        s2 += (w * k).sum(dtype=np.uint64)
    return int(s1), int(s2)


def test_the_triton_kernel_gives_the_torch_and_numpy_sums_exactly():
    seed = 20261203
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED, str(seed)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    g = torch.Generator().manual_seed(seed)
    store = torch.randint(0, 256, (1 << 19,), dtype=torch.uint8, generator=g)
    for at, n, sums in got[:-2]:
        view = store[at : at + n]
        assert tuple(sums) == _numpy_sums([view]) == ByteSum([view])(), f"region of {n} bytes at {at}"
    ones = torch.full((1 << 20,), 255, dtype=torch.uint8)
    wrapped = _numpy_sums([ones])
    exact_s2 = 0xFFFFFFFF * sum(k % MOD + 1 for k in range(1 << 18))
    assert exact_s2 >= 1 << 64 and wrapped[1] == exact_s2 % (1 << 64), "the 0xff region wraps s2 past 2**64"
    assert tuple(got[-2][1]) == wrapped == ByteSum([ones])()
    assert tuple(got[-1][1]) == _numpy_sums([store[:100003], store[100003 : 100003 + 9]])


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
    if change == "move":
        assert after[1] != before[1]  # the offset-weighted sum is what sees a reordering
