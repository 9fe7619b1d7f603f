"""The non-finite screen: torch path and the Triton kernel (under its CPU interpreter) agree."""

from __future__ import annotations

import pytest
import torch

from mxrefit.formats.finite_check import FiniteCheck
from tests.helpers.checks import run_under_triton_interpreter

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (33, 65), (3, 5, 129), (20000,), (1,)]
    out = []
    for i, s in enumerate(shapes):
        dt = DTYPES[i % 3]
        t = torch.randn(s, generator=g).to(dt)
        out.append(t)
    # extremes that are finite: the largest values, subnormals, -0
    out.append(
        torch.tensor([torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max, 1e-40, -0.0], dtype=torch.bfloat16)
    )
    out.append(torch.tensor([65504.0, -65504.0, 6e-8, -0.0], dtype=torch.float16))
    out.append(torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0], dtype=torch.float32))
    return out


def _cases():
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 3, 6):
            yield bad_value, where


def _check_all(first_bad_fn):
    clean = _tensors(0)
    assert first_bad_fn(clean) is None
    for bad_value, where in _cases():
        ts = _tensors(0)
        flat = ts[where].view(-1)
        flat[flat.numel() // 2] = bad_value
        assert first_bad_fn(ts) == where, (bad_value, where)
        ts[7].view(-1)[0] = bad_value  # two bad tensors: the first is named
        assert first_bad_fn(ts) == where


def test_torch_path_finds_the_first_bad_tensor():
    ts = _tensors(0)
    check = FiniteCheck([(tuple(t.shape), t.dtype) for t in ts], "cpu")
    assert check._groups == []  # no interpreter: the torch path
    _check_all(check.first_bad)


def test_a_norm_that_overflows_is_not_taken_for_a_non_finite_tensor():
    big = torch.full((1000,), 3e38, dtype=torch.float32)
    assert not torch.isfinite(torch.linalg.vector_norm(big))
    check = FiniteCheck([((1000,), torch.float32)], "cpu")
    assert check.first_bad([big]) is None


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.unit.test_finite_check import _check_all, _tensors
from mxrefit.formats.finite_check import FiniteCheck
ts = _tensors(0)
check = FiniteCheck([(tuple(t.shape), t.dtype) for t in ts], "cpu")
assert len(check._groups) == 3 and check._rest == [], (check._groups, check._rest)
_check_all(check.first_bad)
print("ok")
"""


def test_triton_kernel_under_the_interpreter_agrees():
    pytest.importorskip("triton")
    run_under_triton_interpreter(_INTERPRETED)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
def test_triton_kernel_on_the_gpu_agrees():
    ts = [t.cuda() for t in _tensors(0)]
    check = FiniteCheck([(tuple(t.shape), t.dtype) for t in ts], "cuda")
    assert len(check._groups) == 3 and check._rest == []

    def first_bad(tensors):
        return check.first_bad([t.cuda() for t in tensors])

    _check_all(first_bad)


_LANES = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _finite_check_triton as k
from mxrefit.formats._common import NO_BAD, bad_flag, first_bad

g = torch.Generator().manual_seed(2)
for dtype, lanes in ((torch.bfloat16, 2), (torch.bfloat16, 4), (torch.float16, 2), (torch.float32, 2)):
    # sizes divisible by lanes; the 2 x 1000 one spans several 64-word chunks with a ragged tail
    ts = [torch.randn(s, generator=g).to(dtype) for s in ((4,), (2, 1000), (12,))]
    scan = k.ScanGroup([t.numel() for t in ts], dtype, torch.device("cpu"), block=16, chunk=64, lanes=lanes)
    flag = bad_flag(torch.device("cpu"))
    scan(ts, flag, [0, 1, 2])
    assert int(flag.item()) == NO_BAD, (dtype, lanes)  # negative control: all finite
    for where in range(3):
        for lane in range(lanes):  # a NaN in every position of a word is seen, not only the lowest
            bad = [t.clone() for t in ts]
            bad[where].view(-1)[bad[where].numel() - lanes + lane] = float("inf")
            flag.fill_(NO_BAD)
            scan(bad, flag, [0, 1, 2])
            assert first_bad(flag) == where, (dtype, lanes, where, lane)
cpu = torch.device("cpu")
for numel, asked, got in ((7, 2, 1), (6, 4, 2), (8, None, 4)):
    assert k.ScanGroup([numel], torch.bfloat16, cpu, 16, chunk=64, lanes=asked).max_lanes == got, (numel, asked)
# a tensor at an odd address is read one element a word for that step and its Inf still seen;
# an aligned one takes the wide word again (the negative control that the narrowing happened)
base = torch.randn(33, generator=g).to(torch.bfloat16)
scan = k.ScanGroup([32], torch.bfloat16, cpu, 16, chunk=64, lanes=4)
flag = bad_flag(cpu)
scan([base[1:]], flag, [0])
assert scan.lanes == 1 and int(flag.item()) == NO_BAD, scan.lanes
base[32] = float("inf")
scan([base[1:]], flag, [0])
assert first_bad(flag) == 0
flag.fill_(NO_BAD)
scan([base[:32].clone()], flag, [0])
assert scan.lanes == 4 and int(flag.item()) == NO_BAD, scan.lanes
try:
    k.ScanGroup([64], torch.bfloat16, cpu, 16, chunk=66, lanes=4)
except ValueError as err:
    assert "divide" in str(err), err
else:
    raise AssertionError("chunks of 66 elements in words of 4 were accepted")
print("ok")
"""


def test_wider_words_flag_every_lane_under_the_interpreter():
    """Several elements per word (the default where sizes and addresses allow): each one's exponent
    tested, the word narrowed where a size or an address does not allow it."""
    pytest.importorskip("triton")
    run_under_triton_interpreter(_LANES)
