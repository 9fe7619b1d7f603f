"""Adversarial and real-shaped MXFP8 inputs, shared by the CPU tests and the GPU parity script."""

from __future__ import annotations

import torch


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def all_finite_bf16(shuffle_seed: int | None = None) -> torch.Tensor:
    """Every finite BF16 bit pattern once (both signs), as [N, 32] blocks.

    Unshuffled, neighbours have close magnitudes, so each block's amax sits next to its
    values; shuffled, every value meets a random amax.
    """
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    exp = (bits >> 7) & 0xFF
    bits = bits[exp != 0xFF]
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    if shuffle_seed is not None:
        g = torch.Generator().manual_seed(shuffle_seed)
        signed = signed[torch.randperm(signed.numel(), generator=g)]
    x = _bf16_from_bits(signed)
    n = x.numel() // 32 * 32
    return x[:n].reshape(-1, 32)


def boundary_blocks() -> torch.Tensor:
    """Blocks whose amax sits exactly on, just under and just over 448 * 2**k and 2**k."""
    rows = []
    base = torch.linspace(-1, 1, 32, dtype=torch.float32)
    for k in range(-133, 128, 3):
        for anchor in (448.0 * 2.0**k, 2.0**k):
            a = torch.tensor(anchor, dtype=torch.float32).to(torch.bfloat16)
            if not torch.isfinite(a) or a == 0:
                continue
            bits = a.view(torch.int16).to(torch.int32)
            for delta in (-1, 0, 1):
                amax = _bf16_from_bits((bits + delta).clamp(1, 0x7F7F))
                row = (base * amax.float()).to(torch.bfloat16)
                row[7] = amax
                row[19] = -amax
                rows.append(row)
    return torch.stack(rows)


def special_blocks() -> torch.Tensor:
    """Zeros, negative zeros, subnormals alone, huge next to tiny, the largest BF16 values."""
    z = torch.zeros(32, dtype=torch.bfloat16)
    neg_z = -z
    mixed_zero = z.clone()
    mixed_zero[1::2] = neg_z[1::2]
    sub = _bf16_from_bits(torch.arange(1, 33, dtype=torch.int32))
    sub_neg = -_bf16_from_bits(torch.arange(0x60, 0x80, dtype=torch.int32))
    sub_with_tiny_normal = sub.clone()
    sub_with_tiny_normal[0] = _bf16_from_bits(torch.tensor(0x0080))
    huge_tiny = torch.full((32,), 1e-30, dtype=torch.bfloat16)
    huge_tiny[::4] = 1e30
    huge_tiny[1::4] = -3e38
    biggest = torch.full((32,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    biggest[::2] *= -1
    e4m3_edges = torch.tensor([448, -448, 464, 480, 240, 232, 0.001953125, 0.0009765625] * 4, dtype=torch.bfloat16)
    one_nonzero = z.clone()
    one_nonzero[31] = 1e-40
    return torch.stack([z, neg_z, mixed_zero, sub, sub_neg, sub_with_tiny_normal, huge_tiny, biggest, e4m3_edges, one_nonzero])


def random_normal(shape: tuple[int, ...], std: float, seed: int, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def adversarial_suite() -> dict[str, torch.Tensor]:
    """Name -> 2-D BF16 tensor with K a multiple of 32 (CPU)."""
    suite = {
        "all_bf16_sorted": all_finite_bf16(None).reshape(-1, 256),
        "all_bf16_shuffled": all_finite_bf16(1).reshape(-1, 256),
        "boundaries": boundary_blocks(),
        "special": special_blocks(),
    }
    for i, std in enumerate((1e-30, 1e-3, 0.02, 1.0, 1e3, 1e30)):
        suite[f"normal_std{std:g}"] = random_normal((64, 512), std, seed=100 + i)
    return suite
