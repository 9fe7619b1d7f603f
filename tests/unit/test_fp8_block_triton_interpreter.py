"""The Triton FP8-block kernel under Triton's CPU interpreter (integer rounding, exact there).

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

from mxrefit.formats import fp8_block
from mxrefit.formats.reference.fp8_block_cases import adversarial_suite
from mxrefit.formats.reference.fp8_block_oracle import reference_quantize
from mxrefit.formats.reference.mxfp8_cases import random_normal
from tests.unit.test_fp8_block import _assert_same, _bytes

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
KERNEL_CASES = [
    "boundaries",
    "boundaries_fp16",
    "special",
    "all_bf16_shuffled_16x16",
    "ragged_normal_std1e-30",
    "ragged_normal_std1e+30",
]


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
        timeout=900,
        cwd=os.path.dirname(__file__),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{2 * len(KERNEL_CASES) + 3} passed" in run.stdout, run.stdout[-2000:]


@inside
@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("ue8m0", [False, True], ids=["scale", "ue8m0"])
def test_kernel_matches_oracle(case, ue8m0):
    x, block = adversarial_suite()[case]
    _assert_same(
        _bytes(*fp8_block.quantize(x, block, use_ue8m0=ue8m0, backend="triton")), reference_quantize(x, block, ue8m0), case
    )


@inside
def test_kernel_3d_ragged_experts_and_small_blocks():
    x = random_normal((3, 200, 130), 0.5, seed=9)  # partial row and column tiles in every expert
    x[1] *= 1e-6
    _assert_same(_bytes(*fp8_block.quantize(x, backend="triton")), reference_quantize(x), "ragged experts")
    x16 = random_normal((5, 100, 64), 1e-3, seed=4, dtype=torch.float16)
    got = fp8_block.quantize(x16, (32, 64), use_ue8m0=True, backend="triton")
    _assert_same(_bytes(*got), reference_quantize(x16, (32, 64), True), "fp16, 32x64 blocks")


@inside
def test_kernel_reports_first_non_finite_tile():
    x = torch.ones(2, 300, 260, dtype=torch.bfloat16)
    x[1, 290, 259] = float("inf")
    x[0, 200, 140] = float("nan")
    with pytest.raises(fp8_block.NonFiniteError, match=r"first bad 128x128 tile at \[0, 128:256, 128:256\]"):
        fp8_block.quantize(x, backend="triton", name="w")


@inside
def test_grouped_kernel_many_tensors_one_launch():
    from mxrefit.formats import _fp8_block_triton

    shapes = [(3, 64), (130, 260), (2, 200, 128), (1, 16), (256, 384)]
    sources = [random_normal(s, 10.0 ** (i - 2), seed=20 + i) for i, s in enumerate(shapes)]
    sources[2][1, 40, 7] = float("inf")
    sources[4][200, 3] = float("nan")
    outs = [
        (torch.empty(s, dtype=torch.float8_e4m3fn), torch.empty(fp8_block.scale_shape(s), dtype=torch.float32)) for s in shapes
    ]
    bad = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    group = _fp8_block_triton.QuantizeGroup(sources, outs, (128, 128), False)
    group(sources, bad)
    assert int(bad) == 2  # the first source holding a non-finite value
    for i in (0, 1, 3):
        _assert_same(_bytes(*outs[i]), reference_quantize(sources[i]), f"group member {i}")
    fresh = [random_normal(s, 1.0, seed=40 + i) for i, s in enumerate(shapes)]  # new addresses
    bad.fill_(2**31 - 1)
    group(fresh, bad)
    assert int(bad) == 2**31 - 1
    for i in range(len(shapes)):
        _assert_same(_bytes(*outs[i]), reference_quantize(fresh[i]), f"fresh member {i}")
    ue = _fp8_block_triton.QuantizeGroup(fresh, outs, (128, 128), True)
    ue(fresh, bad)
    for i in range(len(shapes)):
        _assert_same(_bytes(*outs[i]), reference_quantize(fresh[i], use_ue8m0=True), f"ue8m0 member {i}")
    assert not ue._aligned  # K = 260: value rows are not 16-byte aligned, so no alignment hints
    aligned = [0, 2, 3, 4]  # every K a multiple of 16, every address 16-byte aligned: the hinted variant
    group = _fp8_block_triton.QuantizeGroup([fresh[i] for i in aligned], [outs[i] for i in aligned], (128, 128), False)
    group([fresh[i] for i in aligned], bad)
    assert group._aligned
    for i in aligned:
        _assert_same(_bytes(*outs[i]), reference_quantize(fresh[i]), f"aligned member {i}")
