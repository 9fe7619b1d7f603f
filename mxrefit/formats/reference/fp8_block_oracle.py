"""An independent FP8-block reference, written from the formula in float64 and a table search.

It shares no code with ``fp8_block.quantize``: tiles are cut by explicit slicing (no padding),
every float32 operation of the formula is done in float64 and rounded once to float32 (for
one division or product of float32 operands that is the correctly rounded float32 result:
float64 has more than 2 * 24 + 2 bits), the UE8M0 exponent is ``ceil`` of a correctly rounded
float32 ``log2`` (the float32 formula vLLM evaluates), and each value is rounded by searching
the table of all E4M3 values, ties to the even code. Slow and plain on purpose.
"""

from __future__ import annotations

import numpy as np
import torch

from mxrefit.formats.reference.mxfp8_oracle import e4m3_table

_AMAX_FLOOR = np.float32(1e-4)


def _round_to_e4m3(y: np.ndarray) -> np.ndarray:
    table = e4m3_table()
    mag = np.abs(y)
    if (mag >= 464.0).any():  # 464 would round to 480, which E4M3 'fn' does not have
        raise AssertionError("scaled value at or above 464: the scale formula is broken")
    hi = np.clip(np.searchsorted(table, mag, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << 7)


def _ue8m0(s: np.float32) -> np.float32:
    """2**ceil(float32(log2(s))), the log2 correctly rounded to float32 as vLLM's float32 op would be."""
    return np.float32(2.0 ** float(np.ceil(np.float32(np.log2(np.float64(s))))))


def reference_quantize(
    x: torch.Tensor, block: tuple[int, int] = (128, 128), use_ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Return (value bytes uint8 of x.shape, scale_inv float32 [..., ceil(N/bn), ceil(K/bk)])."""
    xf = x.detach().to("cpu", torch.float32).numpy()
    mats = xf.reshape(-1, *xf.shape[-2:])
    bn, bk = block
    n, k = mats.shape[1:]
    nb, kb = -(-n // bn), -(-k // bk)
    codes = np.zeros(mats.shape, dtype=np.uint8)
    scales = np.zeros((mats.shape[0], nb, kb), dtype=np.float32)
    for e in range(mats.shape[0]):
        for i in range(nb):
            for j in range(kb):
                tile = mats[e, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].astype(np.float64)
                amax = max(np.float32(np.abs(tile).max()), _AMAX_FLOOR)
                scale = np.float32(np.float64(amax) / 448.0)
                if use_ue8m0:
                    scale = _ue8m0(scale)
                recip = np.float32(1.0 / np.float64(scale))
                y = (tile * np.float64(recip)).astype(np.float32)
                codes[e, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = _round_to_e4m3(y.astype(np.float64))
                scales[e, i, j] = scale
    return codes.reshape(xf.shape), scales.reshape(*xf.shape[:-2], nb, kb)
