"""Model shapes, and the list of tensors a trainer holds for them under Hugging Face names.

A refit plan is built from names, shapes and dtypes alone, so the benchmark and the tests can
plan for Qwen3-235B without holding it. ``hf_tensor_specs`` is that list, in the order a
transformers model yields its parameters.

What transformers 5.19 does (checked in ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``
and by building a random ``Qwen3MoeForCausalLM`` on CPU and printing ``named_parameters()``):

- In memory the routed experts of a layer are two slabs on ``Qwen3MoeExperts`` (lines 208-245):
  ``mlp.experts.gate_up_proj`` of shape ``[E, 2I, H]`` and ``mlp.experts.down_proj`` of shape
  ``[E, H, I]``, with no ``.weight`` suffix. They are *not* transposed: the forward computes
  ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` and takes the first chunk as gate, so rows
  ``[0, I)`` of each expert are gate and rows ``[I, 2I)`` are up. The decorator
  ``use_experts_implementation`` keeps ``is_transposed=False`` for this class
  (``integrations/moe.py``), so the other expert kernels read the same layout.
- Within a layer the order is ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, then
  ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, ``mlp.gate.weight`` (the router is
  created after the experts, ``Qwen3MoeSparseMoeBlock.__init__``), then the two layer norms.
- Checkpoints keep one tensor per expert: ``conversion_mapping.py`` (the ``qwen2_moe`` entry,
  which ``qwen3_moe`` reuses) merges ``mlp.experts.*.gate_proj.weight`` and ``*.up_proj.weight``
  with ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)`` into ``gate_up_proj``;
  ``core_model_loading.revert_weight_conversion`` undoes it and yields the checkpoint names.
  ``experts="per_expert"`` lists those names; since a checkpoint's key order is its file's
  (sorted), this module puts them where the slabs stand, expert by expert, each as gate, up,
  down (the order of the transformers-4 ``Qwen3MoeMLP`` modules).

Shards of a model (``qwen3-235b-a22b-ep8``) are described by the same ``ModelShape`` with
per-rank sizes plus ``tp_share``/``ep_share``, the degrees it is one rank's share of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPE = torch.bfloat16
EXPERT_LAYOUTS = ("per_expert", "grouped")
ARCHS = ("qwen3", "llama")


@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix a Qwen3 / Qwen3-MoE / Llama model's tensor list.

    ``intermediate`` is the dense MLP width (0 for a pure MoE, where every layer is sparse).
    ``tp_share`` and ``ep_share`` are 1 for a whole model; for one rank's share they give the
    tensor- and expert-parallel degrees, so that the global vocabulary is ``vocab * tp_share``
    and the replicated router has ``experts * ep_share`` rows. ``dtype`` is what unquantized
    tensors are held in (an engine may run float16 or float32, e.g. on older GPUs or CPU).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0
    moe_intermediate: int = 0
    tied_embeddings: bool = False
    arch: str = "qwen3"
    tp_share: int = 1
    ep_share: int = 1
    dtype: torch.dtype = DTYPE

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"{self.name}: arch must be one of {ARCHS}, got {self.arch!r}")
        if self.experts and self.moe_intermediate <= 0:
            raise ValueError(f"{self.name}: a MoE shape ({self.experts} experts) needs moe_intermediate > 0")
        if not self.experts and self.intermediate <= 0:
            raise ValueError(f"{self.name}: a dense shape needs intermediate > 0")
        if self.tp_share < 1 or self.ep_share < 1:
            raise ValueError(f"{self.name}: tp_share and ep_share must be >= 1")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def router_experts(self) -> int:
        """Rows of the router: every rank keeps the whole router, also under expert parallelism."""
        return self.experts * self.ep_share

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "hf", dtype: torch.dtype = DTYPE) -> "ModelShape":
        """Read a transformers Qwen3Config / Qwen3MoeConfig / LlamaConfig; ``dtype``: the one the
        engine holds unquantized tensors in (the config's own may differ from what it runs).

        Raises ValueError for features the tensor list does not model (biases, dense layers
        mixed into a MoE, shared experts), rather than return a list that is silently wrong.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in ("qwen3", "qwen3_moe", "llama"):
            raise ValueError(f"unsupported model_type {model_type!r}: expected qwen3, qwen3_moe or llama")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError(f"{model_type}: attention/MLP biases are not modelled")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        experts = int(getattr(config, "num_experts", 0) or 0) if model_type == "qwen3_moe" else 0
        if experts:
            if list(getattr(config, "mlp_only_layers", []) or []) or getattr(config, "decoder_sparse_step", 1) != 1:
                raise ValueError("qwen3_moe: dense layers inside a MoE (mlp_only_layers, decoder_sparse_step) are not modelled")
            if getattr(config, "shared_expert_intermediate_size", 0):
                raise ValueError("qwen3_moe: shared experts are not modelled")
        return cls(
            name=name,
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            intermediate=0 if experts else config.intermediate_size,
            experts=experts,
            moe_intermediate=config.moe_intermediate_size if experts else 0,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            arch="llama" if model_type == "llama" else "qwen3",
            dtype=dtype,
        )


_QWEN3_VOCAB = 151936

BUILTIN: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "tiny-qwen3-moe",
            hidden=256,
            layers=4,
            heads=4,
            kv_heads=2,
            head_dim=64,
            vocab=4096,
            intermediate=0,
            experts=8,
            moe_intermediate=128,
        ),
        ModelShape(
            "qwen3-30b-a3b",
            hidden=2048,
            layers=48,
            heads=32,
            kv_heads=4,
            head_dim=128,
            vocab=_QWEN3_VOCAB,
            intermediate=0,
            experts=128,
            moe_intermediate=768,
        ),
        ModelShape(
            "qwen3-32b", hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128, vocab=_QWEN3_VOCAB, intermediate=25600
        ),
        ModelShape(
            "qwen3-235b-a22b",
            hidden=4096,
            layers=94,
            heads=64,
            kv_heads=4,
            head_dim=128,
            vocab=_QWEN3_VOCAB,
            intermediate=0,
            experts=128,
            moe_intermediate=1536,
        ),
        # One GPU's share of Qwen3-235B-A22B served at TP=8 with expert parallelism over the same
        # 8 GPUs (vLLM's --enable-expert-parallel: EP size = TP size = 8, experts not TP-sliced):
        # - attention: 64/8 = 8 query heads (q_proj rows 1024, o_proj columns 1024); the 4 KV heads
        #   are fewer than 8 ranks, so each rank holds 1 whole KV head (replicated on 2 ranks);
        # - experts: 128/8 = 16 whole experts per rank (names use local indices 0..15; rank r
        #   holds global experts 16r..16r+15), each [1536, 4096] / [4096, 1536];
        # - router mlp.gate.weight: replicated, all 128 rows (router_experts = 16 * ep_share);
        # - embed_tokens / lm_head: vocab-parallel, 151936/8 = 18992 rows each;
        # - norms (hidden 4096, q/k norm 128): replicated. The model has no dense MLP layers.
        ModelShape(
            "qwen3-235b-a22b-ep8",
            hidden=4096,
            layers=94,
            heads=8,
            kv_heads=1,
            head_dim=128,
            vocab=_QWEN3_VOCAB // 8,
            intermediate=0,
            experts=16,
            moe_intermediate=1536,
            tp_share=8,
            ep_share=8,
        ),
    )
}


Spec = tuple[str, tuple[int, ...], torch.dtype]


def _layer_specs(shape: ModelShape, i: int, experts: str) -> list[Spec]:
    p = f"model.layers.{i}"
    h, hd, dt = shape.hidden, shape.head_dim, shape.dtype
    out: list[Spec] = [
        (f"{p}.self_attn.q_proj.weight", (shape.heads * hd, h), dt),
        (f"{p}.self_attn.k_proj.weight", (shape.kv_heads * hd, h), dt),
        (f"{p}.self_attn.v_proj.weight", (shape.kv_heads * hd, h), dt),
        (f"{p}.self_attn.o_proj.weight", (h, shape.heads * hd), dt),
    ]
    if shape.arch == "qwen3":
        out += [(f"{p}.self_attn.q_norm.weight", (hd,), dt), (f"{p}.self_attn.k_norm.weight", (hd,), dt)]
    if shape.is_moe:
        e_n, mi = shape.experts, shape.moe_intermediate
        if experts == "grouped":
            out += [
                (f"{p}.mlp.experts.gate_up_proj", (e_n, 2 * mi, h), dt),
                (f"{p}.mlp.experts.down_proj", (e_n, h, mi), dt),
            ]
        else:
            for e in range(e_n):
                q = f"{p}.mlp.experts.{e}"
                out += [
                    (f"{q}.gate_proj.weight", (mi, h), dt),
                    (f"{q}.up_proj.weight", (mi, h), dt),
                    (f"{q}.down_proj.weight", (h, mi), dt),
                ]
        out.append((f"{p}.mlp.gate.weight", (shape.router_experts, h), dt))
    else:
        im = shape.intermediate
        out += [
            (f"{p}.mlp.gate_proj.weight", (im, h), dt),
            (f"{p}.mlp.up_proj.weight", (im, h), dt),
            (f"{p}.mlp.down_proj.weight", (h, im), dt),
        ]
    out += [(f"{p}.input_layernorm.weight", (h,), dt), (f"{p}.post_attention_layernorm.weight", (h,), dt)]
    return out


def hf_tensor_specs(shape: ModelShape, *, experts: str = "per_expert") -> list[Spec]:
    """Every trainer tensor as ``(HF name, shape, shape.dtype)``, layer by layer in transformers' order.

    ``experts`` picks the MoE expert layout: ``"per_expert"`` (checkpoint names, one
    ``[I, H]``/``[I, H]``/``[H, I]`` triple per expert) or ``"grouped"`` (transformers 5's
    in-memory slabs ``[E, 2I, H]`` gate-then-up and ``[E, H, I]``). Dense shapes ignore it.
    ``lm_head.weight`` is absent when the embeddings are tied (it is the same tensor).
    """
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    dt = shape.dtype
    specs: list[Spec] = [("model.embed_tokens.weight", (shape.vocab, shape.hidden), dt)]
    for i in range(shape.layers):
        specs += _layer_specs(shape, i, experts)
    specs.append(("model.norm.weight", (shape.hidden,), dt))
    if not shape.tied_embeddings:
        specs.append(("lm_head.weight", (shape.vocab, shape.hidden), dt))
    return specs
