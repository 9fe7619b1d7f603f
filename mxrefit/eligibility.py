"""Which trainer tensors may be quantized: the default rules shared by trainers and engines.

Embeddings, lm_head, the MoE router, norms and biases stay BF16 (vLLM keeps them
unquantized, and lm_head/router belong in the quantization config's ``ignore`` list).
MXFP8: every other 2-D linear weight or 3-D expert slab with K divisible by 32.
FP8-block: every other 2-D linear weight or 3-D expert slab (partial 128x128 tiles are
quantized as vLLM does, so no divisibility is needed).
"""

from __future__ import annotations

import re
from typing import Callable

_ALWAYS_BF16 = re.compile(r"(embed|lm_head|norm|bias|\.mlp\.gate\.weight$|\.router\.)")

Rule = Callable[[str, tuple[int, ...]], bool]


def mxfp8_eligible(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) in (2, 3) and shape[-1] % 32 == 0 and not _ALWAYS_BF16.search(name)


def fp8_block_eligible(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) in (2, 3) and not _ALWAYS_BF16.search(name)


ELIGIBLE: dict[str, Rule] = {"mxfp8": mxfp8_eligible, "fp8-block": fp8_block_eligible, "fp8-block-ue8m0": fp8_block_eligible}
