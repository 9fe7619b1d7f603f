"""Which trainer tensors may be MXFP8: the default rule shared by trainers and engines.

Embeddings, lm_head, the MoE router, norms and biases stay BF16 (vLLM keeps them
unquantized, and lm_head/router belong in the quantization config's ``ignore`` list);
every other 2-D linear weight or 3-D expert slab with K divisible by 32 is eligible.
"""

from __future__ import annotations

import re

_ALWAYS_BF16 = re.compile(r"(embed|lm_head|norm|bias|\.mlp\.gate\.weight$|\.router\.)")


def mxfp8_eligible(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) in (2, 3) and shape[-1] % 32 == 0 and not _ALWAYS_BF16.search(name)
