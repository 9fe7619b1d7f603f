"""What one tensor-parallel rank holds of each Hugging Face weight, by vLLM's rules.

vLLM 0.32 (``model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``,
``fused_moe/``): column-parallel layers (``q/k/v_proj`` fused in ``QKVParallelLinear``,
``gate/up_proj`` in ``MergedColumnParallelLinear``) keep rank r's 1/tp of the output rows of each
projection; row-parallel layers (``o_proj``, ``down_proj``) keep rank r's 1/tp of the input
columns; ``VocabParallelEmbedding`` / ``ParallelLMHead`` keep rank r's 1/tp of the vocabulary
rows; ``FusedMoE`` without expert parallelism slices each expert's intermediate dim (w13: rank
r's share of the gate rows and of the up rows; w2: its columns). Norms and the router are whole
on every rank. A transformers model keeps the projections unfused, so each is its own parameter
and its slice is one piece, except the grouped expert slab ``gate_up_proj [E, 2I, H]`` whose
slice is two pieces (gate share, up share) along dim 1.

Refused rather than modelled: dims that do not split evenly (vLLM replicates KV heads when
there are fewer than ranks, and pads the vocabulary).
"""

from __future__ import annotations

from mxrefit.plan.types import Shard

_COLUMN = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)
_ROW = ("o_proj.weight", "down_proj.weight")


def _share(name: str, extent: int, size: int) -> int:
    if extent % size:
        raise ValueError(f"tensor {name!r}: {extent} does not split evenly over {size} tensor-parallel ranks")
    return extent // size


def _one_piece(dim: int, part: int, rank: int) -> Shard:
    return Shard(dim, part, ((rank * part, (rank + 1) * part, 0),))


def hf_shard(name: str, shape: tuple[int, ...], rank: int, size: int) -> Shard | None:
    """Rank ``rank`` of ``size``'s slice of the HF tensor ``name`` (None: held whole)."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
    if size == 1:
        return None
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] = per expert [gate; up]
        half = shape[1] // 2
        part = _share(name, half, size)
        lo = rank * part
        return Shard(1, 2 * part, ((lo, lo + part, 0), (half + lo, half + lo + part, part)))
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        return _one_piece(2, _share(name, shape[2], size), rank)
    if name.endswith(_COLUMN):
        return _one_piece(0, _share(name, shape[0], size), rank)
    if name.endswith(_ROW):
        last = len(shape) - 1
        return _one_piece(last, _share(name, shape[last], size), rank)
    return None
