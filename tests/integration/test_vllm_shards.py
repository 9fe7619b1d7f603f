"""vLLM's tensor/expert-parallel slices of whole-model tables: rank shapes, hand-checked rows, bytes.

The rank shapes are checked against ``vllm_params`` of a rank's share (``tp_share``), which
``tests/integration/test_vllm_layout.py`` checks against vLLM's own modules; the rows against vLLM's
loader rules read in its source (``mxrefit/integrations/vllm/layout.py`` cites the lines).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mxrefit.engine.layout import LayoutEngine
from mxrefit.engine.shards import check_shards, run_copies, strided
from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params, vllm_shards
from mxrefit.plan.shapes import BUILTIN


def _rank_shapes_match(whole, share, *, tp: int, ep: bool, mxfp8: bool = True) -> None:
    params = vllm_params(whole, mxfp8=mxfp8)
    local = vllm_params(share, mxfp8=mxfp8)
    assert list(local) == list(params)
    for rank in range(tp):
        shards = vllm_shards(whole, mxfp8=mxfp8, tp_rank=rank, tp_size=tp, expert_parallel=ep)
        check_shards(params, vllm_destinations(whole, mxfp8=mxfp8), shards)
        for name, spec in params.items():
            got = shards[name].local_shape(spec.shape) if name in shards else spec.shape
            assert got == local[name].shape, (rank, name)


def test_235b_at_tp8_with_expert_parallelism_gives_the_ep8_share_on_every_rank():
    _rank_shapes_match(BUILTIN["qwen3-235b-a22b"], BUILTIN["qwen3-235b-a22b-ep8"], tp=8, ep=True)


def test_30b_at_tp2_slices_experts_per_expert():
    whole = BUILTIN["qwen3-30b-a3b"]
    share = replace(
        whole, name="qwen3-30b-a3b-tp2", heads=16, kv_heads=2, vocab=whole.vocab // 2, moe_intermediate=384, tp_share=2
    )
    _rank_shapes_match(whole, share, tp=2, ep=False)


def test_dense_32b_at_tp4():
    whole = BUILTIN["qwen3-32b"]
    share = replace(whole, name="qwen3-32b-tp4", heads=16, kv_heads=2, vocab=whole.vocab // 4, intermediate=6400, tp_share=4)
    _rank_shapes_match(whole, share, tp=4, ep=False, mxfp8=False)


def test_rows_by_hand():
    big = vllm_shards(BUILTIN["qwen3-235b-a22b"], mxfp8=True, tp_rank=3, tp_size=8, expert_parallel=True)
    # 64 q heads x 128: rank 3 rows [3072, 4096); 4 KV heads < 8 ranks: rank 3 holds KV head 1
    assert big["model.layers.5.self_attn.qkv_proj.weight"].pieces == ((3072, 4096, 0), (8320, 8448, 1024), (8832, 8960, 1152))
    assert big["model.layers.5.mlp.experts.routed_experts.w2_weight_scale"].pieces == ((48, 64, 0),)  # experts 48..63
    assert big["model.layers.5.self_attn.o_proj.weight_scale"].pieces == ((96, 128, 0),)  # columns 3072..4095 / 32
    dense = vllm_shards(BUILTIN["qwen3-32b"], mxfp8=False, tp_rank=1, tp_size=4)
    assert dense["model.layers.0.mlp.gate_up_proj.weight"].pieces == ((6400, 12800, 0), (32000, 38400, 6400))
    assert "model.layers.0.input_layernorm.weight" not in dense and "model.norm.weight" not in dense


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="query heads"):
        vllm_shards(BUILTIN["qwen3-30b-a3b"], mxfp8=True, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="one rank's share"):
        vllm_shards(BUILTIN["qwen3-235b-a22b-ep8"], mxfp8=True, tp_rank=0, tp_size=8)


def test_a_layout_engine_rank_receives_exactly_its_slice_of_whole_parameter_bytes():
    """Whole-param bytes through the rank's copies equal vLLM's narrow() of each loaded piece."""
    shape = replace(BUILTIN["tiny-qwen3-moe"], layers=1, vocab=512)
    params = vllm_params(shape, mxfp8=True)
    for rank in range(2):
        shards = vllm_shards(shape, mxfp8=True, tp_rank=rank, tp_size=2)
        engine = LayoutEngine(params, vllm_destinations(shape, mxfp8=True), "cpu", shards=shards)
        for name, spec in params.items():
            whole = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8)
            storage = engine.storage(name)
            for c in run_copies(0, 0, spec.nbytes, spec, shards.get(name)):
                strided(storage, c.dst, c.dst_pitch, c.rows, c.width).copy_(strided(whole, c.src, c.src_pitch, c.rows, c.width))
            want = whole.view(spec.dtype).view(spec.shape)
            if name in shards:
                s = shards[name]
                want = torch.cat([want.narrow(s.dim, a, b - a) for a, b, _ in s.pieces], s.dim)
            assert torch.equal(storage, want.contiguous().view(-1).view(torch.uint8)), (rank, name)
            assert storage.numel() == math.prod(want.shape) * spec.dtype.itemsize
