"""A learned MXFP8 byte order cut into units of whole blocks, and the kernel that writes it.

The layouts here are built from index arithmetic, not from mxrefit's code: a Marlin-8-bit-like
order (16 of K x 64 of N byte tiles running along N first, each column's 16 bytes interleaved
k, k+8, k+1, k+9, ..., scales transposed and 8x8-permuted in groups of 64), the test suite's
4 KB-tile ``marlin_like`` order, and negative controls. The kernel's bytes are compared with the
two passes it replaces: quantize to the checkpoint layout (mxfp8.quantize, torch path), then move
every byte by the index.
"""

from __future__ import annotations

import pytest
import torch

from mxrefit.formats.block_permutation import BlockPermutation
from tests.helpers.checks import run_under_triton_interpreter

SCALE_PERM = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
K_ORDER = torch.tensor([k + 8 * h for k in range(8) for h in range(2)])  # 0, 8, 1, 9, ..., 7, 15


def marlin8_values(w: torch.Tensor) -> torch.Tensor:
    """(N, K) -> tiles of 16 K x 64 N along N first, each tile stored column by column with K interleaved."""
    n, k = w.shape
    tiles = w.t().reshape(k // 16, 16, n // 64, 64).permute(0, 2, 3, 1)  # (kt, nt, 64 n, 16 k)
    return tiles[..., K_ORDER].reshape(-1)


def marlin8_scales(s: torch.Tensor) -> torch.Tensor:
    """(N, K/32) -> transposed, each group of 64 permuted 8x8."""
    return s.t().reshape(-1, 64)[:, SCALE_PERM].reshape(-1)


def marlin_like_values(w: torch.Tensor) -> torch.Tensor:
    """tests/unit/test_probed_layout.py's order, on an index: 4-byte words along K, 16x64-word tiles, bytes [0, 2, 1, 3]."""
    n, k = w.shape
    words = w.reshape(n, k // 4, 4).permute(1, 0, 2)  # (K/4, N, 4)
    tiles = words.reshape(k // 64, 16, n // 64, 64, 4).permute(0, 2, 1, 3, 4)
    return tiles[..., [0, 2, 1, 3]].reshape(-1)


def index_of(order, rows: int, cols: int) -> torch.Tensor:
    """The gather ``order`` performs: output byte j reads input byte index[j]."""
    return order(torch.arange(rows * cols).view(rows, cols))


def learned(n: int, k: int, values=marlin8_values, scales=marlin8_scales) -> BlockPermutation | str:
    return BlockPermutation.of(index_of(values, n, k), index_of(scales, n, k // 32))


def test_marlin8_order_is_units_of_4_blocks_in_two_tiles():
    """A 64-byte chunk holds 4 columns' halves of a block; the other halves lie in the next K tile."""
    perm = learned(128, 64)
    assert isinstance(perm, BlockPermutation), perm
    assert (perm.blocks_per_unit, perm.chunks_per_unit, perm.units) == (4, 2, 64)
    # the unit's two chunks lie N / 64 = 2 tiles of 1 KB apart
    assert perm.chunk_pattern.tolist() == [0, 2 * 1024]


def test_marlin_like_order_is_units_of_16_blocks():
    """A chunk is one 4-byte K word of 16 columns; a block's 8 words lie in 8 word rows: 16 blocks, 8 chunks."""
    perm = learned(128, 128, values=marlin_like_values)
    assert isinstance(perm, BlockPermutation), perm
    assert (perm.blocks_per_unit, perm.chunks_per_unit) == (16, 8)


@pytest.mark.parametrize(
    "broken, rule",
    [
        ("twice", "not a permutation"),
        ("across", "differ in size"),
        ("scales", "scale order is not a permutation"),
        ("local", "move their bytes differently"),
    ],
)
def test_orders_a_kernel_cannot_write_are_refused_with_the_rule(broken, rule):
    n, k = 128, 64
    idx, sidx = index_of(marlin8_values, n, k), index_of(marlin8_scales, n, k // 32)
    if broken == "twice":
        idx[5] = idx[6]
    elif broken == "across":  # two bytes of different units swapped: those two units merge
        idx[0], idx[-1] = idx[-1].clone(), idx[0].clone()
    elif broken == "scales":
        sidx[3] = sidx[4]
    else:  # two bytes of one chunk of the first unit swapped: that unit differs from the others
        idx[0], idx[1] = idx[1].clone(), idx[0].clone()
    got = BlockPermutation.of(idx, sidx)
    assert isinstance(got, str) and rule in got, got
    assert isinstance(BlockPermutation.of(index_of(marlin8_values, n, k), index_of(marlin8_scales, n, k // 32)), BlockPermutation)


def test_units_of_a_tile_no_program_can_take_are_refused():
    """Units of 6 blocks into 3 chunks (bytes dealt round-robin over 6 blocks) are no power-of-two tile;
    a random byte permutation is one unit over the whole tensor, larger than a program's output."""
    j = torch.arange(192)
    groups = 32
    dealt = (torch.arange(groups)[:, None] * 192 + (j % 6) * 32 + j // 6).reshape(-1)
    got = BlockPermutation.of(dealt, torch.arange(groups * 6))
    assert isinstance(got, str) and "power-of-two tile" in got, got
    shuffled = torch.randperm(
        1 << 14, generator=torch.Generator().manual_seed(5)
    )  # every chunk tied to every other: one 16 KB unit
    got = BlockPermutation.of(shuffled, torch.arange(512))
    assert isinstance(got, str) and "larger than one program" in got, got


def test_reference_writer_equals_the_index_gather():
    """The descriptor's plain-indexing writer puts every byte where the learned index says."""
    n, k, e = 128, 64, 3
    idx, sidx = index_of(marlin8_values, n, k), index_of(marlin8_scales, n, k // 32)
    perm = BlockPermutation.of(idx, sidx)
    assert isinstance(perm, BlockPermutation)
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (e, n, k // 32), dtype=torch.uint8, generator=g)
    ov, os_ = torch.zeros(e, n * k, dtype=torch.uint8), torch.zeros(e, n * k // 32, dtype=torch.uint8)
    perm.write_reference(v, s, ov, os_)
    assert torch.equal(ov, v.reshape(e, -1)[:, idx]) and torch.equal(os_, s.reshape(e, -1)[:, sidx])


_KERNEL = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.formats import _mxfp8_triton as k, mxfp8
from mxrefit.formats._common import NO_BAD, bad_flag
from mxrefit.formats.block_permutation import BlockPermutation
from tests.unit.test_block_permutation import index_of, marlin8_scales, marlin8_values, marlin_like_values

def two_pass(x, idx, sidx):
    v, s = mxfp8.quantize(x, backend="torch")
    e = x.shape[0]
    return v.view(torch.uint8).reshape(e, -1)[:, idx], s.view(torch.uint8).reshape(e, -1)[:, sidx]

g = torch.Generator().manual_seed(3)
for order, n, kk, dtype in ((marlin8_values, 128, 64, torch.bfloat16), (marlin8_values, 64, 128, torch.float16),
                            (marlin_like_values, 128, 128, torch.bfloat16)):
    idx, sidx = index_of(order, n, kk), index_of(marlin8_scales, n, kk // 32)
    perm = BlockPermutation.of(idx, sidx)
    assert isinstance(perm, BlockPermutation), perm
    x = (torch.randn(3, n, kk, generator=g) * torch.logspace(-6 if dtype == torch.bfloat16 else -3, 6 if dtype == torch.bfloat16 else 4, kk)).to(dtype)
    x[1, 7, :32] = 0  # a zero block
    want_v, want_s = two_pass(x, idx, sidx)
    ov, os_ = torch.zeros(3, n * kk, dtype=torch.uint8), torch.zeros(3, n * kk // 32, dtype=torch.uint8)
    bad = bad_flag(torch.device("cpu"))
    k.quantize_permuted(x, perm, ov, os_, 0, bad, blocks_per_program=24)  # units per program that do not divide the units
    assert int(bad.item()) == NO_BAD
    assert torch.equal(ov, want_v), (order.__name__, n, kk, (ov != want_v).sum())
    assert torch.equal(os_, want_s), (order.__name__, n, kk)
    # negative control: one entry of the unit map swapped, and the bytes differ
    local = perm.local.clone()
    local[0], local[1] = perm.local[1], perm.local[0]
    wrong = BlockPermutation(**{**{f: getattr(perm, f) for f in perm.__dataclass_fields__}, "local": local})
    k.quantize_permuted(x, wrong, ov, os_, 0, bad)
    assert not torch.equal(ov, want_v)
    # a NaN in expert 2 is reported as expert 2, the others' bytes still written
    x[2, 5, 9] = float("nan")
    k.quantize_permuted(x, perm, ov, os_, 0, bad)
    assert int(bad.item()) == 2 and torch.equal(ov[:2], want_v[:2])
for wrong_x, rule in ((torch.zeros(2, 64, 128, dtype=torch.bfloat16), "per expert"), (torch.zeros(3, 128, 128), "BF16 or FP16")):
    try:
        k.quantize_permuted(wrong_x, perm, ov, os_, 0, bad)
    except ValueError as err:
        assert rule in str(err), err
    else:
        raise AssertionError(f"a {wrong_x.dtype} source of {tuple(wrong_x.shape)} was written")
print("ok")
"""


def test_kernel_writes_the_two_pass_bytes_under_the_interpreter():
    """The permuted quantize kernel against quantize-then-gather, BF16 and FP16, two orders."""
    pytest.importorskip("triton")
    run_under_triton_interpreter(_KERNEL)
