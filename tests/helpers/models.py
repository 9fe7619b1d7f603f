"""Tiny transformers models with random weights, built from configs (nothing loads from a hub)."""

from __future__ import annotations

import torch


def tiny_qwen3_moe(seed: int, *, experts: int = 4, layers: int = 2, dtype: torch.dtype = torch.bfloat16):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).to(dtype)


def tiny_llama(seed: int, dtype: torch.dtype = torch.bfloat16, *, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).to(dtype)
