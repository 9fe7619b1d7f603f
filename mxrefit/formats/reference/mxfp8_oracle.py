"""An independent MXFP8 reference, written from the formula in float64 and integer arithmetic.

It shares no code with ``mxfp8.quantize``: the scale exponent comes from ``frexp`` (exact),
and each value is rounded by searching the table of all 127 positive E4M3 values, ties to
the even code. Slow and plain on purpose; used by the tests and the GPU parity script.
"""

from __future__ import annotations

import numpy as np
import torch

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def e4m3_table() -> np.ndarray:
    """Value of each non-negative E4M3 code 0..126 (127 is NaN in the 'fn' variant)."""
    codes = np.arange(127)
    exp, man = codes >> 3, codes & 7
    return np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * np.exp2(exp - 7.0))


def _round_to_e4m3(y: np.ndarray) -> np.ndarray:
    table = e4m3_table()
    mag = np.abs(y)
    if (mag > 448.0).any():
        raise AssertionError("scaled value above 448: the scale formula is broken")
    hi = np.clip(np.searchsorted(table, mag, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << 7)


def reference_quantize(x: torch.Tensor, min_byte: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return (value bytes, scale bytes) as uint8 numpy arrays of shapes x.shape and [..., K/32]."""
    xf = x.detach().to("cpu", torch.float32).numpy().astype(np.float64)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // 32, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), _FLOAT32_TINY)
    mant, exp = np.frexp(amax / 448.0)  # amax/448 = mant * 2**exp, mant in [0.5, 1)
    ceil_log2 = np.where(mant == 0.5, exp - 1, exp)
    sb = np.clip(ceil_log2 + 127, min_byte, 254).astype(np.int64)
    scaled = blocks * np.exp2(-(sb - 127.0))[..., None]
    return _round_to_e4m3(scaled).reshape(xf.shape), sb.astype(np.uint8)
