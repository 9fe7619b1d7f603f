"""The Triton MXFP8 kernel under Triton's CPU interpreter (integer rounding, exact there).

The interpreter must be switched on before triton is first imported, so the driver test
reruns this file in a fresh interpreter with TRITON_INTERPRET=1; the kernel tests proper
run only there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mxrefit.formats import mxfp8
from mxrefit.formats.reference.mxfp8_cases import adversarial_suite, random_normal
from mxrefit.formats.reference.mxfp8_oracle import reference_quantize
from tests.unit.test_mxfp8 import _assert_same, _bytes

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


def test_kernel_tests_pass_under_the_interpreter():
    if INTERPRETING:
        pytest.skip("this is the subprocess")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(__file__),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "7 passed" in run.stdout, run.stdout[-2000:]


@inside
@pytest.mark.parametrize("case", ["boundaries", "special", "all_bf16_shuffled"])
def test_kernel_matches_oracle(case):
    x = adversarial_suite()[case]
    _assert_same(_bytes(*mxfp8.quantize(x, backend="triton")), reference_quantize(x), case)


@inside
def test_kernel_3d_ragged_tiles_and_fp16():
    x = random_normal((3, 13, 32 * 11), 0.5, seed=9)  # neither rows nor blocks fill a tile
    _assert_same(_bytes(*mxfp8.quantize(x, backend="triton")), reference_quantize(x), "ragged")
    x16 = random_normal((5, 64), 1e-6, seed=4, dtype=torch.float16)
    got = mxfp8.quantize(x16, backend="triton", zero_block_scale_one=True)
    _assert_same(_bytes(*got), reference_quantize(x16, 1), "fp16")


@inside
def test_kernel_reports_first_non_finite_block():
    x = torch.ones(20, 320, dtype=torch.bfloat16)
    x[17, 100] = float("nan")
    x[18, 0] = float("inf")
    with pytest.raises(mxfp8.NonFiniteError, match=r"\[17, 96:128\]"):
        mxfp8.quantize(x, backend="triton")


@inside
@pytest.mark.parametrize("iters", [1, 4])
def test_grouped_kernel_many_tensors_one_launch(iters):
    from mxrefit.formats import _mxfp8_triton

    shapes = [(3, 64), (1, 32), (5, 7 * 32), (2, 4, 160), (300, 64)]
    sources = [random_normal(s, 10.0 ** (i - 2), seed=20 + i) for i, s in enumerate(shapes)]
    sources[2][1, 40] = float("inf")
    sources[4][7, 3] = float("nan")
    outs = [(torch.empty(s, dtype=torch.float8_e4m3fn), torch.empty(mxfp8.scale_shape(s), dtype=torch.uint8)) for s in shapes]
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    group = _mxfp8_triton.QuantizeGroup(sources, outs, blocks_per_program=4, iters=iters)
    assert group.table.programs == sum(-(-s.numel() // 32 // (4 * iters)) for s in sources)
    group(sources, 0, bad)
    assert int(bad) == 2  # the first source holding a non-finite value
    for i in (0, 1, 3):
        _assert_same(_bytes(*outs[i]), reference_quantize(sources[i]), f"group member {i}")
    fresh = [random_normal(s, 1.0, seed=40 + i) for i, s in enumerate(shapes)]  # new addresses
    bad.fill_(2**31 - 1)
    group(fresh, 1, bad)
    assert int(bad) == 2**31 - 1
    for i in range(len(shapes)):
        _assert_same(_bytes(*outs[i]), reference_quantize(fresh[i], 1), f"fresh member {i}")
    fresh[4][7, 3] = float("nan")  # block 14 of source 4: the fourth run of its first program when iters is 4
    group(fresh, 1, bad)
    assert int(bad) == 4
