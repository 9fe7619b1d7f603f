"""Adversarial and real-shaped FP8-block inputs, shared by the CPU tests and the GPU parity script.

Tiles are built one by one and laid out in a grid, so every tile is one chosen case; the
ideas are MXFP8's (``mxfp8_cases``) moved to tiles: amax on, just under and just over
448 * 2**k and 2**k, at the 1e-4 floor, zeros of both signs, subnormals, huge beside tiny.
"""

from __future__ import annotations

import torch

from mxrefit.formats.reference.mxfp8_cases import all_finite_bf16, random_normal, special_blocks

SWEEP_BLOCK = (16, 16)


def tiles_to_matrix(tiles: torch.Tensor, per_row: int = 4) -> torch.Tensor:
    """[T, bn, bk] tiles -> one [bn * ceil(T / per_row), bk * per_row] matrix, tile t at grid (t // per_row, t % per_row)."""
    t, bn, bk = tiles.shape
    rows = -(-t // per_row)
    grid = torch.zeros(rows * per_row, bn, bk, dtype=tiles.dtype)
    grid[:t] = tiles
    return grid.view(rows, per_row, bn, bk).transpose(1, 2).reshape(rows * bn, per_row * bk)


def _tile_with_amax(amax: torch.Tensor, block: tuple[int, int], base: torch.Tensor) -> torch.Tensor:
    tile = (base * amax.float()).to(amax.dtype).view(block)
    tile[0, 0] = amax
    tile[-1, -1] = -amax
    return tile


def _base(block: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Fractions in [-1, 1] in a fixed shuffled order, so a tile holds many mantissas relative to its amax."""
    g = torch.Generator().manual_seed(seed)
    n = block[0] * block[1]
    return torch.linspace(-1, 1, n)[torch.randperm(n, generator=g)]


def amax_sweep(block: tuple[int, int] = SWEEP_BLOCK) -> torch.Tensor:
    """One tile per positive finite BF16 value, that value its amax (32,639 tiles of 16x16)."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    amaxes = bits.view(torch.bfloat16)
    base = _base(block)
    tiles = (base[None, :] * amaxes.float()[:, None]).to(torch.bfloat16).view(-1, *block)
    tiles[:, 0, 0] = amaxes
    tiles[:, -1, -1] = -amaxes
    return tiles_to_matrix(tiles, per_row=64)


def all_bf16_shuffled(seed: int = 1) -> torch.Tensor:
    """Every finite BF16 bit pattern once, shuffled: every value meets a random amax."""
    return all_finite_bf16(seed).reshape(-1, 256)


def boundary_tiles(block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Tiles whose amax sits on, just under and just over 448 * 2**k, 2**k and the 1e-4 floor."""
    anchors = [a for k in range(-133, 128, 3) for a in (448.0 * 2.0**k, 2.0**k)] + [1e-4, 1e-4 / 448, 448e-4]
    base = _base(block, seed=2)
    tiles = []
    for anchor in anchors:
        a = torch.tensor(anchor, dtype=torch.float32).to(dtype)
        if not torch.isfinite(a) or a == 0:
            continue
        int_t = torch.int16 if dtype.itemsize == 2 else torch.int32
        bits = a.view(int_t).to(torch.int64)
        for delta in (-1, 0, 1):
            amax = (bits + delta).to(int_t).view(dtype)
            if torch.isfinite(amax) and amax > 0:
                tiles.append(_tile_with_amax(amax, block, base))
    return tiles_to_matrix(torch.stack(tiles))


def near_power_fp32_tiles(block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """FP32 tiles whose amax / 448 lies a few float32 ulps around 2**k: where a float32 log2 rounds to k."""
    base = _base(block, seed=3)
    tiles = []
    for k in (-22, -20, -13, -9, -4, -2, -1, 0, 1, 2, 3, 5, 9, 17, 40, 100):
        p = torch.tensor(2.0**k, dtype=torch.float32)
        for ulps in (-2, -1, 0, 1, 2, 3, 5, 8):
            scale = (p.view(torch.int32) + ulps).view(torch.float32)
            amax = (scale.double() * 448.0).float()
            tiles.append(_tile_with_amax(amax, block, base))
    return tiles_to_matrix(torch.stack(tiles))


def special_tiles(block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """MXFP8's special 32-blocks (zeros, -0, subnormals, huge beside tiny, BF16 max, E4M3 edges, one nonzero) as whole tiles."""
    n = block[0] * block[1]
    rows = special_blocks()
    return tiles_to_matrix(rows.repeat(1, -(-n // 32))[:, :n].reshape(-1, *block))


def adversarial_suite() -> dict[str, tuple[torch.Tensor, tuple[int, int]]]:
    """Name -> (CPU tensor, block). BF16 unless the name says otherwise; some shapes are ragged."""
    suite = {
        "amax_sweep_16x16": (amax_sweep(), SWEEP_BLOCK),
        "all_bf16_shuffled_16x16": (all_bf16_shuffled(), SWEEP_BLOCK),
        "boundaries": (boundary_tiles(), (128, 128)),
        "boundaries_fp16": (boundary_tiles(dtype=torch.float16), (128, 128)),
        "boundaries_fp32": (boundary_tiles(dtype=torch.float32), (128, 128)),
        "near_power_fp32": (near_power_fp32_tiles(), (128, 128)),
        "special": (special_tiles(), (128, 128)),
    }
    for i, std in enumerate((1e-30, 1e-3, 0.02, 1.0, 1e3, 1e30)):
        suite[f"ragged_normal_std{std:g}"] = (random_normal((300, 260), std, seed=100 + i), (128, 128))
    return suite


REAL_SHAPES = {
    # Qwen3-32B's qkv [(64 + 2 * 8) * 128, 5120] and o_proj, reduced; an expert slab with ragged dims
    "qkv_like": (1280, 640),
    "o_proj_like": (640, 1024),
    "experts_w13_ragged": (4, 2 * 96, 200),
    "experts_w2_ragged": (4, 200, 96),
    "vocab_like_ragged": (1000, 384),
}
