"""The passthrough format's fused screen (``check_finite=False``): bytes copied exactly, the
smallest non-finite source index reported; the Triton kernel under its CPU interpreter and the
torch path (foreach copy + ``FiniteCheck``) agree."""

from __future__ import annotations

import pytest
import torch

from mxrefit.formats import Passthrough
from mxrefit.formats._common import NO_BAD, bad_flag, first_bad
from tests.helpers.checks import run_under_triton_interpreter

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BAD_VALUES = (float("nan"), float("inf"), float("-inf"))


def _sources(seed: int) -> list[torch.Tensor]:
    """Each dtype at odd sizes (one spanning several small chunks with a ragged tail), plus finite extremes."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (33, 65), (3, 5, 129), (1,), (2, 1001), (5,)]
    out = [torch.randn(s, generator=g).to(DTYPES[i % 3]) for i, s in enumerate(shapes)]
    out.append(
        torch.tensor([torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max, 1e-40, -0.0], dtype=torch.bfloat16)
    )
    out.append(torch.tensor([65504.0, -65504.0, 6e-8, -0.0], dtype=torch.float16))
    out.append(torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0], dtype=torch.float32))
    return out


def _encoder(srcs: list[torch.Tensor], screen: bool = True):
    dsts = [torch.full_like(s, 7.0) for s in srcs]
    enc = Passthrough().encoder([(tuple(s.shape), s.dtype) for s in srcs], [[d] for d in dsts], screen=screen)
    return enc, dsts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_all(positions=("first", "middle", "last")) -> None:
    clean = _sources(0)
    enc, dsts = _encoder(clean)
    bad = bad_flag(torch.device("cpu"))
    enc(clean, bad)
    assert int(bad.item()) == NO_BAD  # the negative control: all finite, the flag untouched
    assert all(torch.equal(_bits(d), _bits(s)) for d, s in zip(dsts, clean))
    for value in BAD_VALUES:
        for where in range(len(clean)):
            for pos in positions:
                ts = _sources(0)
                flat = ts[where].view(-1)
                flat[{"first": 0, "middle": flat.numel() // 2, "last": -1}[pos]] = value
                bad.fill_(NO_BAD)
                enc(ts, bad)
                assert first_bad(bad) == where, (value, where, pos)
                assert all(torch.equal(_bits(d), _bits(s)) for d, s in zip(dsts, ts)), "every byte is copied either way"
                if where + 2 < len(ts):  # two bad sources: the smaller index is reported
                    ts[where + 2].view(-1)[-1] = value
                    bad.fill_(NO_BAD)
                    enc(ts, bad)
                    assert first_bad(bad) == where, (value, where, pos, "two")


def test_torch_path_copies_and_reports_the_first_bad_source():
    _check_all()


def test_without_screen_the_copy_leaves_bad_untouched():
    """The default sender screened already: the encoder must not spend a second read."""
    ts = _sources(0)
    ts[2].view(-1)[0] = float("nan")
    enc, dsts = _encoder(ts, screen=False)
    bad = bad_flag(torch.device("cpu"))
    enc(ts, bad)
    assert int(bad.item()) == NO_BAD
    assert all(torch.equal(_bits(d), _bits(s)) for d, s in zip(dsts, ts))


def test_a_cast_to_the_engine_dtype_is_screened_on_the_source():
    """An FP32 source into a BF16 destination takes the torch path (the kernel copies same-dtype words)."""
    src = torch.randn(300)
    src[-1] = float("nan")
    dst = torch.zeros(300, dtype=torch.bfloat16)
    enc = Passthrough().encoder([((300,), torch.float32)], [[dst]], screen=True)
    bad = bad_flag(torch.device("cpu"))
    enc([src], bad)
    assert first_bad(bad) == 0 and torch.equal(dst[:-1], src[:-1].bfloat16())


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _passthrough_triton as k
from tests.unit import test_passthrough_screen as t

real = k.CopyGroup
for chunk, block, positions in ((k.CHUNK, 2048, ("last",)), (256, 64, ("first", "middle", "last"))):
    # the small chunks: several programs per tensor, a ragged last chunk and block
    built = []
    def counting(*a, **kw):
        built.append(real(*a, chunk=chunk, block=block, **kw))
        return built[-1]
    k.CopyGroup = counting
    t._check_all(positions)
    assert [g.dtype for g in built] == list(k.DTYPES), built  # every source through the kernel: one launch per dtype
    assert sum(g.table.programs for g in built) == sum(-(-s.numel() // chunk) for s in t._sources(0))
print("ok")
"""


def test_triton_kernel_under_the_interpreter_copies_and_flags():
    pytest.importorskip("triton")
    run_under_triton_interpreter(_INTERPRETED)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
def test_triton_kernel_on_the_gpu_copies_and_flags():
    def make(srcs, screen=True):
        return _encoder([s.cuda() for s in srcs], screen)

    def cuda_check():
        clean = [s.cuda() for s in _sources(0)]
        enc, dsts = make(clean)
        bad = bad_flag(torch.device("cuda"))
        enc(clean, bad)
        assert int(bad.item()) == NO_BAD
        assert all(torch.equal(_bits(d), _bits(s)) for d, s in zip(dsts, clean))
        for value in BAD_VALUES:
            for where in range(len(clean)):
                ts = [s.cuda() for s in _sources(0)]
                ts[where].view(-1)[-1] = value
                bad.fill_(NO_BAD)
                enc(ts, bad)
                assert first_bad(bad) == where

    cuda_check()


_LANES = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _passthrough_triton as k
from mxrefit.formats._common import NO_BAD, bad_flag, first_bad

g = torch.Generator().manual_seed(1)
for dtype, lanes in ((torch.bfloat16, 2), (torch.bfloat16, 4), (torch.float16, 2), (torch.float32, 2)):
    # sizes divisible by lanes; the 2 x 1000 one spans several 64-word chunks with a ragged tail
    srcs = [torch.randn(s, generator=g).to(dtype) for s in ((4,), (2, 1000), (12,))]
    outs = [torch.zeros_like(s) for s in srcs]
    group = k.CopyGroup([s.numel() for s in srcs], dtype, outs, [0, 1, 2], torch.device("cpu"), chunk=64, block=16, lanes=lanes)
    bad = bad_flag(torch.device("cpu"))
    group(srcs, bad)
    assert int(bad.item()) == NO_BAD, (dtype, lanes)  # negative control: all finite
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs))
    for where in range(3):
        for lane in range(lanes):  # a NaN in every position of a word is seen, not only the lowest
            ts = [s.clone() for s in srcs]
            ts[where].view(-1)[ts[where].numel() - lanes + lane] = float("nan")
            bad.fill_(NO_BAD)
            group(ts, bad)
            assert first_bad(bad) == where, (dtype, lanes, where, lane)
            assert all(torch.equal(o.view(-1)[:-lanes], s.view(-1)[:-lanes]) for o, s in zip(outs, ts))
cpu = torch.device("cpu")
# the word narrows to what sizes and addresses allow: 7 elements take one a word, 6 take pairs
for numel, asked, got in ((7, 2, 1), (6, 4, 2), (8, None, 4)):
    src, out = torch.randn(numel, generator=g).to(torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    group = k.CopyGroup([numel], torch.bfloat16, [out], [0], cpu, chunk=64, block=16, lanes=asked)
    assert group.max_lanes == got, (numel, asked, group.max_lanes)
    group([src], bad_flag(cpu))
    assert torch.equal(out, src), numel
# a source at an odd address is copied one element a word for that step, and its NaN still seen;
# an aligned one takes the wide word again (the negative control that the narrowing happened)
base = torch.randn(33, generator=g).to(torch.bfloat16)
out = torch.zeros(32, dtype=torch.bfloat16)
group = k.CopyGroup([32], torch.bfloat16, [out], [0], cpu, chunk=64, block=16)
odd = base[1:].clone()
group([base[1:]], bad := bad_flag(cpu))
assert group.lanes == 1 and torch.equal(out, odd) and int(bad.item()) == NO_BAD, group.lanes
base[5] = float("nan")
group([base[1:]], bad := bad_flag(cpu))
assert first_bad(bad) == 0
group([odd], bad := bad_flag(cpu))
assert group.lanes == 4 and torch.equal(out, odd) and int(bad.item()) == NO_BAD, group.lanes
# a destination at an odd address narrows the word for good
dst = torch.zeros(33, dtype=torch.bfloat16)[1:]
assert k.CopyGroup([32], torch.bfloat16, [dst], [0], cpu, chunk=64, block=16).max_lanes == 1
for asked, chunk, rule in ((8, 64, "16, 32 or 64"), (4, 66, "divide")):
    try:
        k.CopyGroup([64], torch.bfloat16, [torch.zeros(64, dtype=torch.bfloat16)], [0], cpu, chunk=chunk, block=16, lanes=asked)
    except ValueError as err:
        assert rule in str(err), err
    else:
        raise AssertionError(f"{asked} elements a word over chunks of {chunk} were accepted")
print("ok")
"""


def test_wider_words_copy_and_flag_every_lane_under_the_interpreter():
    """Several elements per word (the default where sizes and addresses allow): each one's exponent
    tested, the word narrowed where a size or an address does not allow it, bad widths refused."""
    pytest.importorskip("triton")
    run_under_triton_interpreter(_LANES)
