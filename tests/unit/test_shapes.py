"""Model shapes and the HF tensor list, checked against the published sizes and transformers 5 itself."""

from __future__ import annotations

import math

import pytest
import torch

from mxrefit.plan.shapes import BUILTIN, ModelShape, hf_tensor_specs

LAYOUTS = ("per_expert", "grouped")


def _numel(specs) -> int:
    return sum(math.prod(s) for _, s, _ in specs)


@pytest.mark.parametrize("experts", LAYOUTS)
def test_qwen3_30b_a3b_counts(experts):
    specs = hf_tensor_specs(BUILTIN["qwen3-30b-a3b"], experts=experts)
    want_tensors = 18_867 if experts == "per_expert" else 18_867 - 48 * (128 * 3 - 2)
    assert len(specs) == want_tensors
    assert _numel(specs) == 30_532_122_624
    assert {d for _, _, d in specs} == {torch.bfloat16}


def test_qwen3_235b_and_32b_counts():
    specs = hf_tensor_specs(BUILTIN["qwen3-235b-a22b"])
    assert len(specs) == 36_945
    assert _numel(specs) == pytest.approx(235.1e9, rel=1e-3)
    assert _numel(specs) * 2 / 2**30 == pytest.approx(437.9, abs=0.05)
    dense = hf_tensor_specs(BUILTIN["qwen3-32b"])
    assert len(dense) == 1 + 64 * 11 + 2
    assert _numel(dense) == pytest.approx(32.76e9, rel=1e-3)


def test_ep8_share_is_one_gpu_of_tp8_ep8():
    full, share = BUILTIN["qwen3-235b-a22b"], BUILTIN["qwen3-235b-a22b-ep8"]
    specs = dict((n, s) for n, s, _ in hf_tensor_specs(share))
    p = "model.layers.0"
    assert specs[f"{p}.self_attn.q_proj.weight"] == (8 * 128, 4096)
    assert specs[f"{p}.self_attn.k_proj.weight"] == (128, 4096)
    assert specs[f"{p}.self_attn.o_proj.weight"] == (4096, 8 * 128)
    assert specs[f"{p}.mlp.gate.weight"] == (128, 4096)
    assert f"{p}.mlp.experts.15.down_proj.weight" in specs and f"{p}.mlp.experts.16.down_proj.weight" not in specs
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == (151936 // 8, 4096)
    expert_params = 94 * 128 * 3 * 1536 * 4096
    share_experts = sum(math.prod(s) for n, s in specs.items() if ".experts." in n)
    assert share_experts * 8 == expert_params
    assert full.router_experts == share.router_experts == 128


def _tiny_configs():
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=96
    )
    return {
        "qwen3_moe": Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2, **common),
        "qwen3_moe_tied": Qwen3MoeConfig(
            head_dim=16, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2, tie_word_embeddings=True, **common
        ),
        "qwen3": Qwen3Config(head_dim=16, **common),
        "qwen3_tied": Qwen3Config(head_dim=16, tie_word_embeddings=True, **common),
        "llama": LlamaConfig(**common),
    }


def _model(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("key", sorted(_tiny_configs()))
def test_grouped_equals_named_parameters(key):
    cfg = _tiny_configs()[key]
    model = _model(cfg)
    got = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    assert hf_tensor_specs(ModelShape.from_hf_config(cfg), experts="grouped") == got


@pytest.mark.parametrize("key", ["qwen3_moe", "qwen3_moe_tied"])
def test_per_expert_equals_checkpoint_keys(key):
    """Per-expert names are what transformers' checkpoint conversion writes; order expands the slabs in place."""
    from transformers.core_model_loading import revert_weight_conversion

    cfg = _tiny_configs()[key]
    model = _model(cfg)
    params = dict(model.named_parameters())
    saved = revert_weight_conversion(model, {n: p.detach() for n, p in params.items()})
    shape = ModelShape.from_hf_config(cfg)
    per_expert = hf_tensor_specs(shape, experts="per_expert")
    assert {n: tuple(t.shape) for n, t in saved.items()} == {n: s for n, s, _ in per_expert}

    expanded = []
    for n, s, d in hf_tensor_specs(shape, experts="grouped"):
        if n.endswith("mlp.experts.gate_up_proj"):
            continue
        if n.endswith("mlp.experts.down_proj"):
            base = n.removesuffix("down_proj")
            e_n, h, i_ = s
            for e in range(e_n):
                expanded += [
                    (f"{base}{e}.gate_proj.weight", (i_, h), d),
                    (f"{base}{e}.up_proj.weight", (i_, h), d),
                    (f"{base}{e}.down_proj.weight", (h, i_), d),
                ]
            continue
        expanded.append((n, s, d))
    assert per_expert == expanded


def test_grouped_slab_is_gate_rows_then_up_rows():
    """Checkpoint split and the experts' forward both read rows [0, I) of gate_up_proj[e] as gate."""
    from transformers.core_model_loading import revert_weight_conversion

    cfg = _tiny_configs()["qwen3_moe"]
    model = _model(cfg).float()
    experts = model.model.layers[0].mlp.experts
    i_ = cfg.moe_intermediate_size
    saved = revert_weight_conversion(model, {n: p.detach() for n, p in model.named_parameters()})
    p = "model.layers.0.mlp.experts"
    for e in range(cfg.num_experts):
        assert torch.equal(saved[f"{p}.{e}.gate_proj.weight"], experts.gate_up_proj[e, :i_])
        assert torch.equal(saved[f"{p}.{e}.up_proj.weight"], experts.gate_up_proj[e, i_:])
        assert torch.equal(saved[f"{p}.{e}.down_proj.weight"], experts.down_proj[e])

    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    e = 2
    idx = torch.full((5, 1), e, dtype=torch.long)
    with torch.no_grad():
        got = experts(x, idx, torch.ones(5, 1))
        gate, up, down = (saved[f"{p}.{e}.{w}_proj.weight"] for w in ("gate", "up", "down"))
        want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(got, want)


def test_from_hf_config_reads_and_refuses():
    from transformers import LlamaConfig, Qwen3MoeConfig

    cfgs = _tiny_configs()
    moe = ModelShape.from_hf_config(cfgs["qwen3_moe"], name="t")
    assert (moe.name, moe.experts, moe.moe_intermediate, moe.intermediate, moe.head_dim, moe.arch) == ("t", 3, 32, 0, 16, "qwen3")
    llama = ModelShape.from_hf_config(cfgs["llama"])
    assert (llama.arch, llama.head_dim, llama.intermediate, llama.is_moe) == ("llama", 16, 96, False)
    assert ModelShape.from_hf_config(cfgs["qwen3_tied"]).tied_embeddings
    with pytest.raises(ValueError, match="biases"):
        ModelShape.from_hf_config(LlamaConfig(hidden_size=64, num_attention_heads=4, attention_bias=True))
    with pytest.raises(ValueError, match="dense layers"):
        ModelShape.from_hf_config(Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_experts=4, mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="model_type"):
        ModelShape.from_hf_config(type("C", (), {"model_type": "gpt2"})())


def test_builtin_shapes_and_arguments():
    tiny = BUILTIN["tiny-qwen3-moe"]
    assert tiny.is_moe and _numel(hf_tensor_specs(tiny)) < 10_000_000
    assert not BUILTIN["qwen3-32b"].is_moe
    assert all(not s.tied_embeddings for s in BUILTIN.values())
    with pytest.raises(ValueError, match="experts must be"):
        hf_tensor_specs(tiny, experts="stacked")
    with pytest.raises(ValueError, match="arch"):
        ModelShape("x", hidden=64, layers=1, heads=1, kv_heads=1, head_dim=64, vocab=64, intermediate=64, arch="gpt")
    assert hf_tensor_specs(BUILTIN["qwen3-32b"], experts="grouped") == hf_tensor_specs(BUILTIN["qwen3-32b"])
