"""The plan: layout, runs, floors, digests, and mismatches refused with every offending name."""

from __future__ import annotations

import pytest
import torch

from mxrefit.engine.torch import TorchEngine
from mxrefit.plan.build import ALIGN, PlanMismatch, SourceSpec, build_plan, tables_from_msg, tables_to_msg
from mxrefit.plan.types import Destination, ParamSpec, Target
from tests.helpers.models import tiny_qwen3_moe


def _specs(module: torch.nn.Module) -> list[SourceSpec]:
    return [SourceSpec(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()]


@pytest.fixture(scope="module")
def moe():
    return tiny_qwen3_moe(seed=0)


@pytest.mark.parametrize("quant", [None, "mxfp8", "fp8-block"])
def test_every_target_byte_is_placed_once_and_runs_are_merged(moe, quant):
    specs = _specs(moe)
    engine = TorchEngine(tiny_qwen3_moe(seed=1), quant=quant)
    plan = build_plan(specs, engine.params(), engine.destinations(), bucket_bytes=64 << 10)
    assert len(plan.buckets) > 3
    covered = {name: torch.zeros(p.nbytes, dtype=torch.int32) for name, p in engine.params().items()}
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes
        assert all(r.offset % ALIGN == 0 for r in b.runs)
        for r in b.runs:
            covered[r.param][r.param_offset : r.param_offset + r.nbytes] += 1
        assert len(b.runs) <= len(b.parts)
    assert all(bool((c == 1).all()) for c in covered.values()), "some engine byte is written zero or two times"
    if quant:
        assert any(d.format == quant for d in engine.destinations().values())
        assert engine.destinations()["model.embed_tokens.weight"].format == "bf16"
        assert engine.destinations()["lm_head.weight"].format == "bf16"


def test_a_tensor_larger_than_the_bucket_raises_the_bucket_size(moe):
    specs = _specs(moe)
    engine = TorchEngine(tiny_qwen3_moe(seed=1))
    biggest = max(p.numel() * p.element_size() for p in moe.parameters())
    plan = build_plan(specs, engine.params(), engine.destinations(), bucket_bytes=1024)
    assert plan.bucket_bytes >= biggest
    assert all(b.nbytes <= plan.bucket_bytes for b in plan.buckets)


def test_digest_is_deterministic_and_sensitive(moe):
    specs = _specs(moe)
    engine = TorchEngine(tiny_qwen3_moe(seed=1), mxfp8=True)
    a = build_plan(specs, engine.params(), engine.destinations(), bucket_bytes=1 << 20)
    b = build_plan(specs, engine.params(), engine.destinations(), bucket_bytes=1 << 20)
    c = build_plan(specs, engine.params(), engine.destinations(), bucket_bytes=2 << 20)
    assert a.digest == b.digest != c.digest


def test_tables_round_trip_through_msgpack():
    import msgpack

    engine = TorchEngine(tiny_qwen3_moe(seed=1), mxfp8=True)
    msg = msgpack.unpackb(msgpack.packb(tables_to_msg(engine.params(), engine.destinations())), raw=False)
    params, dests = tables_from_msg(msg)
    assert params == engine.params() and dests == engine.destinations()


def test_mismatches_list_every_offending_name(moe):
    engine = TorchEngine(tiny_qwen3_moe(seed=1), mxfp8=True)
    specs = {s.name: s for s in _specs(moe)}
    dropped = "model.layers.0.post_attention_layernorm.weight"
    del specs[dropped]
    specs["model.layers.0.extra.weight"] = SourceSpec("model.layers.0.extra.weight", (4, 4), torch.bfloat16)
    o = "model.layers.1.self_attn.o_proj.weight"
    specs[o] = SourceSpec(o, (specs[o].shape[0], specs[o].shape[1] + 32), torch.bfloat16)
    q = "model.layers.1.self_attn.q_proj.weight"
    specs[q] = SourceSpec(q, specs[q].shape, torch.float8_e4m3fn)
    with pytest.raises(PlanMismatch) as err:
        build_plan(list(specs.values()), engine.params(), engine.destinations())
    text = str(err.value)
    assert len(err.value.problems) == 4, err.value.problems
    for name in (dropped, "model.layers.0.extra.weight", o, q):
        assert name in text
    assert "missing" in text and "unexpected" in text and "bfloat16, float16 or float32" in text


def test_k_not_divisible_by_32_is_refused_for_mxfp8():
    params = {"w": ParamSpec("w", (4, 48), torch.float8_e4m3fn), "w_scale": ParamSpec("w_scale", (4, 1), torch.uint8)}
    dests = {
        "w": Destination("w", "mxfp8", (Target("w", 0, (4, 48), torch.float8_e4m3fn), Target("w_scale", 0, (4, 1), torch.uint8)))
    }
    with pytest.raises(PlanMismatch, match="not a multiple of 32"):
        build_plan([SourceSpec("w", (4, 48), torch.bfloat16)], params, dests)


def test_fp8_block_parts_must_match_the_engine_scale_shape():
    params = {
        "w": ParamSpec("w", (200, 130), torch.float8_e4m3fn),
        "w_scale_inv": ParamSpec("w_scale_inv", (1, 1), torch.float32),
    }
    dests = {
        "w": Destination(
            "w", "fp8-block", (Target("w", 0, (200, 130), torch.float8_e4m3fn), Target("w_scale_inv", 0, (1, 1), torch.float32))
        )
    }
    with pytest.raises(
        PlanMismatch, match=r"'w'.*scales would be \(2, 2\) torch.float32, the engine's 'w_scale_inv' takes \(1, 1\)"
    ):
        build_plan([SourceSpec("w", (200, 130), torch.bfloat16)], params, dests)
    with pytest.raises(PlanMismatch, match=r"tensor 'w': FP8-block prequantization needs a bfloat16, float16 or float32"):
        build_plan([SourceSpec("w", (200, 130), torch.int8)], params, dests)


def test_targets_outside_their_parameter_are_refused():
    params = {"p": ParamSpec("p", (8, 32), torch.bfloat16)}
    dests = {"a": Destination("a", "bf16", (Target("p", 8 * 32 * 2 - 64, (1, 64), torch.bfloat16),))}
    with pytest.raises(PlanMismatch, match="outside"):
        build_plan([SourceSpec("a", (1, 64), torch.bfloat16)], params, dests)


def test_tied_embeddings_are_one_destination():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    engine = TorchEngine(model)
    assert "lm_head.weight" not in engine.destinations()
    assert engine.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_cover_problems_names_each_kind_and_passes_an_exact_cover():
    from mxrefit.plan.coverage import CoverProblem, cover_problems

    assert list(cover_problems([(4, 10, "b"), (0, 4, "a")], 10)) == []  # exact, in any order
    got = list(cover_problems([(0, 4, "a"), (3, 6, "b"), (8, 9, "c")], 12))
    assert got == [
        CoverProblem("overlap", 3, 4, "a", "b"),
        CoverProblem("gap", 6, 8, "b", "c"),
        CoverProblem("tail", 9, 12, "c"),
    ]
    assert list(cover_problems([(0, 14, "a")], 12)) == [CoverProblem("past", 12, 14, "a")]
    assert list(cover_problems([], 3)) == [CoverProblem("tail", 0, 3, "")]
