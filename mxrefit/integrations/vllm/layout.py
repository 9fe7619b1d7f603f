"""vLLM 0.32's parameter layout for Qwen3 / Qwen3-MoE / Llama, and where each HF tensor lands in it.

The tables are computed from a ``ModelShape`` alone, so a plan can be made (and checked) without
an engine. What they encode was read in vLLM 0.32's source (``vllm/`` below) and confirmed by
building the real model modules on CPU (``tests/integration/test_vllm_layout.py`` does it in a subprocess,
compares ``named_parameters()`` and loads bytes through vLLM's own ``load_weights``):

- Names are the HF ones except for the fusions. ``self_attn.qkv_proj.weight`` holds rows
  ``[q; k; v]`` (``QKVParallelLinear``, ``models/qwen3_moe.py:284``, ``qwen3.py:106``,
  ``llama.py:165``; the ``q``/``k``/``v`` shard ids of ``hf_to_vllm_mapper``,
  ``qwen3_moe.py:436``). A dense MLP's ``mlp.gate_up_proj.weight`` holds rows ``[gate; up]``
  (``MergedColumnParallelLinear``, shard 0 = gate_proj, 1 = up_proj).
- Routed experts are nested one level deeper in 0.32: ``FusedMoEFactory`` returns a
  ``MoERunner`` whose child ``routed_experts`` owns the weights
  (``layers/fused_moe/layer.py:383-425``, ``runner/moe_runner.py:272``), so the names are
  ``mlp.experts.routed_experts.w13_weight [E, 2I, H]`` (per expert rows ``[w1=gate; w3=up]``)
  and ``mlp.experts.routed_experts.w2_weight [E, H, I]``. vLLM's loader takes the grouped HF
  slab ``gate_up_proj [E, 2I, H]`` untransposed and splits it with ``chunk(2, dim=1)`` into
  w1, w3 (``layers/fused_moe/routed_experts.py:1047``; Qwen3-MoE passes
  ``is_fused_checkpoint_transposed=False``), the same byte order as ``w13_weight``: a grouped
  slab is one contiguous copy into the whole parameter.
- The router ``mlp.gate.weight [E, H]`` (``GateLinear``, ``qwen3_moe.py:170``) is registered
  before the experts and stays BF16; so do the norms, ``embed_tokens`` and ``lm_head``. vLLM
  quantizes ``lm_head`` and the router unless the checkpoint's ``exclude_modules`` lists them
  (``lm_head``, ``model.layers.*.mlp.gate``): the project's MXFP8 config always does. Which
  other layers stay BF16 is ``mxrefit.plan.eligibility.QuantRules`` (exported as that config).
- ModelOpt MXFP8 (``layers/quantization/modelopt.py``): a linear layer gets ``weight``
  (``float8_e4m3fn [N, K]``) and ``weight_scale`` (``uint8 [N, K/32]``), ``KMxfp8Static``
  (lines 2271-2322); MoE gets ``w13_weight``, ``w2_weight``, ``w13_weight_scale
  [E, 2I, H/32]``, ``w2_weight_scale [E, H, I/32]`` registered in that order
  (``ModelOptMxFp8FusedMoE.create_weights``, lines 1300-1357). ``MXFP8_SCALE_DTYPE`` is
  ``uint8`` (``quantization/utils/mxfp8_utils.py:10``). Every scale parameter is named by its
  values parameter plus ``_scale``.
- The quantized ``Attention`` also gets scalar ``attn.{q,k,v,prob}_scale`` (KV-cache scales,
  ``quantization/kv_cache.py:60-71``). They are not weights: no trainer tensor feeds them and
  they are set from ``kv_cache_quant_algo`` after loading, so they are left out here.
- Tied embeddings: ``lm_head.tie_weights(embed_tokens)`` makes ``lm_head.weight`` the embedding
  parameter (``qwen3_moe.py:587``, ``layers/vocab_parallel_embedding.py:88-92``), so the model
  has no separate ``lm_head.weight`` and the only destination is ``embed_tokens``.
- ``VocabParallelEmbedding`` pads the global vocabulary to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``); padding rows have no source, so such shapes are refused.

- ``Fp8Config`` block FP8 (``weight_block_size: [128, 128]``, ``layers/quantization/fp8.py``):
  a linear layer gets ``weight`` (``float8_e4m3fn [N, K]``) and ``weight_scale_inv``
  (``float32 [ceil(N/128), ceil(K/128)]``, lines 312-339); MoE gets ``w13_weight``,
  ``w2_weight``, ``w13_weight_scale_inv [E, 2·I/128, ceil(H/128)]``, ``w2_weight_scale_inv
  [E, ceil(H/128), I/128]`` (lines 564-633). A fused layer stacks its partitions' scale rows
  (``[q; k; v]``, ``[gate; up]``, per expert ``[w1; w3]``), so every partition but the last
  must start on a 128-row tile: vLLM refuses other shapes (``validate_fp8_block_shape``,
  ``utils/fp8_utils.py:1296``). An expert intermediate size that is not a multiple of 128
  makes vLLM refine the expert scale grid and repeat each checkpoint scale over it
  (``refine_fp8_moe_block_shape``, ``layers/fused_moe/oracle/fp8.py:288``): not modelled
  here, refused by name. ``lm_head`` is never quantized by ``Fp8Config`` (not a
  ``LinearBase``); the router is unless ``ignored_layers`` lists it.

Which quantized format a layout holds is a ``QuantLayout`` (``QUANT_LAYOUTS``): the scale
parameter's suffix and dtype and the block a scale covers; the scale shapes and the scale
offset of every source follow from it, so MXFP8 and FP8-block share one code path.

Byte offsets are into each parameter's row-major storage (``Target`` in ``mxrefit.plan.types``).

Tensor/expert parallelism (``vllm_shards``): every rank describes the WHOLE model with these
tables and gives its slice of each parameter as a ``Shard``, read in the same source:
``QKVParallelLinear`` keeps rank r's 1/tp of the q rows and of the k and v rows — with fewer KV
heads than ranks each rank holds one whole KV head, ``r // (tp / kv_heads)``
(``layers/linear.py:1055``, ``1301-1304``); ``MergedColumnParallelLinear`` its share of the gate
rows and of the up rows; ``RowParallelLinear`` (``o_proj``, ``down_proj``) its 1/tp of the
columns; ``VocabParallelEmbedding``/``ParallelLMHead`` its 1/tp of the (unpadded, see above)
vocabulary rows. Routed experts are TP-sliced per expert (``routed_experts.py:523-600``: w13's
gate half and up half narrowed on dim 1, w2 on dim 2), or with expert parallelism kept whole,
rank r holding experts ``[r E/ep, (r+1) E/ep)`` (``fused_moe/expert_map_manager.py:75``, the
default linear placement). MXFP8 scales follow their values (a K slice counts 32-value blocks);
FP8-block tables are not sharded (a 128-row tile would straddle ranks unless every slice is
whole tiles).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from mxrefit.engine.shards import mxfp8_scale_shard
from mxrefit.formats import fp8_block, mxfp8
from mxrefit.plan.coverage import cover_problems
from mxrefit.plan.eligibility import DEFAULT_RULES, QuantRules
from mxrefit.plan.shapes import ModelShape, hf_tensor_specs
from mxrefit.plan.types import Destination, ParamSpec, Shard, Target

VOCAB_PADDING = 64
EXPERTS = "mlp.experts.routed_experts"
FORMAT_MXFP8 = "mxfp8"
FORMAT_BF16 = "bf16"


@dataclass(frozen=True)
class QuantLayout:
    """How vLLM holds one quantized format: a values param plus ``<values><scale_suffix>``,
    one scale per ``block`` = (rows, cols) of every [N, K] matrix, ragged edges rounded up.

    A source whose values start at row ``r0`` of a matrix starts its scales at row
    ``r0 / block rows`` of that matrix's scales, so a fused partition must start on a block
    row (always true for MXFP8's one-row blocks).
    """

    format: str  # Destination.format of every tensor landing in such a param
    label: str  # for messages
    scale_suffix: str
    value_dtype: torch.dtype
    scale_dtype: torch.dtype
    block: tuple[int, int]
    whole_k_blocks: bool  # K must be a multiple of the block columns (MXFP8) or may be ragged

    def scale_param(self, name: str) -> str:
        return name + self.scale_suffix

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        bn, bk = self.block
        return (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))

    def scale_row(self, matrix_rows: int, row: int) -> int:
        """First scale row (over all leading dims) of a source whose values start at ``row``."""
        matrix, r0 = divmod(row, matrix_rows)
        return matrix * -(-matrix_rows // self.block[0]) + r0 // self.block[0]


MXFP8_LAYOUT = QuantLayout(FORMAT_MXFP8, "MXFP8", "_scale", mxfp8.VALUE_DTYPE, mxfp8.SCALE_DTYPE, (1, mxfp8.BLOCK), True)
FP8_BLOCK_LAYOUT = QuantLayout(
    "fp8-block", "FP8-block", "_scale_inv", fp8_block.VALUE_DTYPE, fp8_block.SCALE_DTYPE, fp8_block.BLOCK, False
)
QUANT_LAYOUTS: dict[str, QuantLayout] = {
    q.format: q for q in (MXFP8_LAYOUT, FP8_BLOCK_LAYOUT, replace(FP8_BLOCK_LAYOUT, format="fp8-block-ue8m0"))
}


def quant_layout(*, mxfp8: bool = False, fmt: str | None = None) -> QuantLayout | None:
    """The layout of the quantized layers: ``fmt`` names it (``"bf16"`` or None: nothing is
    quantized); ``mxfp8=True`` is the older spelling of ``fmt="mxfp8"``."""
    if fmt is None:
        return MXFP8_LAYOUT if mxfp8 else None
    if mxfp8 and fmt != FORMAT_MXFP8:
        raise ValueError(f"mxfp8=True contradicts fmt={fmt!r}")
    if fmt == FORMAT_BF16:
        return None
    try:
        return QUANT_LAYOUTS[fmt]
    except KeyError:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(QUANT_LAYOUTS)}") from None


def scale_param(name: str) -> str:
    """The uint8 scale parameter that goes with an MXFP8 values parameter."""
    return MXFP8_LAYOUT.scale_param(name)


@dataclass(frozen=True)
class _Linear:
    """A quantizable weight: its name, shape, and the rows of the HF tensors fused into each
    of its matrices (vLLM's ``output_partition_sizes``)."""

    name: str
    shape: tuple[int, ...]
    partitions: tuple[int, ...]


def _linear_params(shape: ModelShape) -> list[_Linear]:
    """The engine's quantizable weights, in vLLM's registration order."""
    h, hd = shape.hidden, shape.head_dim
    out: list[_Linear] = []
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        q, kv = shape.heads * hd, shape.kv_heads * hd
        out.append(_Linear(f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h), (q, kv, kv)))
        out.append(_Linear(f"{p}.self_attn.o_proj.weight", (h, q), (h,)))
        if shape.is_moe:
            e, mi = shape.experts, shape.moe_intermediate
            out.append(_Linear(f"{p}.{EXPERTS}.w13_weight", (e, 2 * mi, h), (mi, mi)))
            out.append(_Linear(f"{p}.{EXPERTS}.w2_weight", (e, h, mi), (h,)))
        else:
            im = shape.intermediate
            out.append(_Linear(f"{p}.mlp.gate_up_proj.weight", (2 * im, h), (im, im)))
            out.append(_Linear(f"{p}.mlp.down_proj.weight", (h, im), (h,)))
    return out


def _layer(param: str) -> str:
    """The vLLM layer (module) that owns a weight parameter, as quantization configs name it."""
    if f".{EXPERTS}." in param:
        return param.split(f".{EXPERTS}.")[0] + ".mlp.experts"
    return param.removesuffix(".weight")


def quantized_param_names(shape: ModelShape, rules: QuantRules = DEFAULT_RULES) -> list[str]:
    """The values parameters that are quantized in a quantized engine; each has a scale param.

    These are the linear and expert weights whose layer ``rules`` do not exclude; everything
    else (router, norms, embed_tokens, lm_head, excluded layers) stays BF16.
    """
    return [w.name for w in _linear_params(shape) if not rules.excludes_layer(_layer(w.name), shape.layers)]


def _quantized(shape: ModelShape, layout: QuantLayout | None, quantized: Collection[str] | None, rules: QuantRules) -> set[str]:
    """The values params held quantized: the given subset of the linear weights (a live
    engine's own), else those whose layer ``rules`` quantize."""
    if layout is None:
        return set()
    if quantized is None:
        _check_rules(shape, rules)
        return set(quantized_param_names(shape, rules))
    unknown = set(quantized) - {w.name for w in _linear_params(shape)}
    if unknown:
        raise ValueError(f"{shape.name}: {sorted(unknown)[:5]} are not quantizable linear weights of this layout")
    return set(quantized)


def _check_rules(shape: ModelShape, rules: QuantRules) -> None:
    """This layout keeps lm_head and the router BF16: rules that vLLM would read otherwise are refused.

    The rules decide which layers are quantized; the layout's format (MXFP8, FP8-block) is the
    engine's choice, as in ``eligibility.check_rules``.
    """
    kept = ["lm_head"] + ([f"model.layers.{i}.mlp.gate" for i in range(shape.layers)] if shape.is_moe else [])
    quantized = [layer for layer in kept if not rules.excludes_layer(layer, shape.layers)]
    if quantized:
        raise ValueError(
            f"{shape.name}: the rules (exclude_modules {rules.exclude_modules(shape.layers)}) would make vLLM "
            f"quantize {quantized[:3]}{' ...' if len(quantized) > 3 else ''}; this layout keeps lm_head and the "
            f"MoE router BF16, so the rules must exclude them"
        )


def _check_quantizable(shape: ModelShape, layout: QuantLayout, w: _Linear) -> None:
    """Refuse, naming the rule, a weight vLLM cannot hold in ``layout`` (or that this layout does not model)."""
    bn, bk = layout.block
    if layout.whole_k_blocks and w.shape[-1] % bk:
        raise ValueError(f"{shape.name}: {w.name} has K={w.shape[-1]}, not a multiple of the {layout.label} block {bk}")
    if f".{EXPERTS}." in w.name and shape.moe_intermediate % bn:
        raise ValueError(
            f"{shape.name}: {w.name}: the expert intermediate size per rank ({shape.moe_intermediate}) is not a "
            f"multiple of the {layout.label} block ({bn}); vLLM then refines the expert scale grid and repeats each "
            f"checkpoint scale over it (refine_fp8_moe_block_shape), a refined scale grid mxrefit's tables do not "
            f"support yet"
        )
    ragged = [p for p in w.partitions[:-1] if p % bn]
    if ragged:
        raise ValueError(
            f"{shape.name}: {w.name} fuses partitions of {list(w.partitions)} rows; {layout.label} keeps one scale "
            f"row per {bn} rows, so every partition but the last must be a multiple of {bn} (vLLM refuses this "
            f"layer too: validate_fp8_block_shape)"
        )


def _held_by(layout: QuantLayout | None) -> QuantLayout:
    """The layout of a parameter held quantized (``_quantized`` names none without a layout)."""
    if layout is None:
        raise AssertionError("a parameter held quantized without a quantized layout")
    return layout


def _check(shape: ModelShape, held: set[str], layout: QuantLayout | None) -> None:
    if (shape.vocab * shape.tp_share) % VOCAB_PADDING:
        raise ValueError(
            f"{shape.name}: vLLM pads the vocabulary ({shape.vocab * shape.tp_share}) to a multiple of "
            f"{VOCAB_PADDING}; the padding rows of embed_tokens/lm_head have no trainer tensor, which "
            f"this layout does not model"
        )
    for w in _linear_params(shape):
        if w.name in held:
            _check_quantizable(shape, _held_by(layout), w)


def vllm_params(
    shape: ModelShape,
    *,
    mxfp8: bool = False,
    fmt: str | None = None,
    quantized: Collection[str] | None = None,
    rules: QuantRules = DEFAULT_RULES,
) -> dict[str, ParamSpec]:
    """Every weight parameter of vLLM's model, by name, in ``named_parameters()`` order.

    With a quantized format (``fmt`` = ``"mxfp8"``, ``"fp8-block"``, ``"fp8-block-ue8m0"``;
    ``mxfp8=True`` means ``"mxfp8"``) the layers that ``rules`` quantize hold E4M3 values plus
    the format's scales (see ``QuantLayout``), as vLLM builds them from the checkpoint's config;
    excluded layers keep BF16 weights. ``quantized`` instead names the quantized linear weights
    directly (a live engine's own set).
    """
    layout = quant_layout(mxfp8=mxfp8, fmt=fmt)
    held = _quantized(shape, layout, quantized, rules)
    _check(shape, held, layout)
    h, hd = shape.hidden, shape.head_dim
    linear = {w.name: w.shape for w in _linear_params(shape)}
    out: dict[str, ParamSpec] = {}

    def add(name: str, shp: tuple[int, ...], dtype: torch.dtype = shape.dtype) -> None:
        out[name] = ParamSpec(name, tuple(shp), dtype)

    def add_linear(name: str) -> None:
        shp = linear[name]
        if name in held:
            q = _held_by(layout)
            add(name, shp, q.value_dtype)
            add(q.scale_param(name), q.scale_shape(shp), q.scale_dtype)
        else:
            add(name, shp)

    add("model.embed_tokens.weight", (shape.vocab, h))
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        add_linear(f"{p}.self_attn.qkv_proj.weight")
        add_linear(f"{p}.self_attn.o_proj.weight")
        if shape.arch == "qwen3":
            add(f"{p}.self_attn.q_norm.weight", (hd,))
            add(f"{p}.self_attn.k_norm.weight", (hd,))
        if shape.is_moe:
            add(f"{p}.mlp.gate.weight", (shape.router_experts, h))
            w13, w2 = f"{p}.{EXPERTS}.w13_weight", f"{p}.{EXPERTS}.w2_weight"
            if (w13 in held) != (w2 in held):
                raise ValueError(f"{p}: vLLM quantizes a MoE layer's w13 and w2 together; got only one of them")
            if w13 in held:  # MoE registers both values, then both scales
                q = _held_by(layout)
                add(w13, linear[w13], q.value_dtype)
                add(w2, linear[w2], q.value_dtype)
                add(q.scale_param(w13), q.scale_shape(linear[w13]), q.scale_dtype)
                add(q.scale_param(w2), q.scale_shape(linear[w2]), q.scale_dtype)
            else:
                add(w13, linear[w13])
                add(w2, linear[w2])
        else:
            add_linear(f"{p}.mlp.gate_up_proj.weight")
            add_linear(f"{p}.mlp.down_proj.weight")
        add(f"{p}.input_layernorm.weight", (h,))
        add(f"{p}.post_attention_layernorm.weight", (h,))
    add("model.norm.weight", (h,))
    if not shape.tied_embeddings:
        add("lm_head.weight", (shape.vocab, h))
    return out


def _route(shape: ModelShape, hf_name: str) -> tuple[str, int]:
    """(engine param, first row) for an HF tensor; rows count over all leading dims."""
    hd, mi, im = shape.head_dim, shape.moe_intermediate, shape.intermediate
    if not hf_name.startswith("model.layers."):
        return hf_name, 0
    layer, _, rest = hf_name[len("model.layers.") :].partition(".")
    p = f"model.layers.{layer}"
    attn = {
        "self_attn.q_proj.weight": 0,
        "self_attn.k_proj.weight": shape.heads * hd,
        "self_attn.v_proj.weight": (shape.heads + shape.kv_heads) * hd,
    }
    if rest in attn:
        return f"{p}.self_attn.qkv_proj.weight", attn[rest]
    dense = {"mlp.gate_proj.weight": 0, "mlp.up_proj.weight": im}
    if rest in dense:
        return f"{p}.mlp.gate_up_proj.weight", dense[rest]
    if rest == "mlp.experts.gate_up_proj":
        return f"{p}.{EXPERTS}.w13_weight", 0
    if rest == "mlp.experts.down_proj":
        return f"{p}.{EXPERTS}.w2_weight", 0
    if rest.startswith("mlp.experts."):
        e_str, _, proj = rest[len("mlp.experts.") :].partition(".")
        e = int(e_str)
        if proj == "gate_proj.weight":
            return f"{p}.{EXPERTS}.w13_weight", e * 2 * mi
        if proj == "up_proj.weight":
            return f"{p}.{EXPERTS}.w13_weight", e * 2 * mi + mi
        if proj == "down_proj.weight":
            return f"{p}.{EXPERTS}.w2_weight", e * shape.hidden
        raise ValueError(f"unknown expert tensor {hf_name!r}")
    return hf_name, 0


def vllm_destinations(
    shape: ModelShape,
    *,
    mxfp8: bool = False,
    fmt: str | None = None,
    experts: str = "per_expert",
    quantized: Collection[str] | None = None,
    rules: QuantRules = DEFAULT_RULES,
) -> dict[str, Destination]:
    """For each HF tensor of ``hf_tensor_specs(shape, experts=experts)``, where its bytes go.

    A tensor landing in a quantized parameter (a quantized ``fmt``, its layer not excluded by
    ``rules``) is sent in that format with two targets: its values rows, then its scales at
    the scale rows those values start (one per row for MXFP8, one per 128-row tile for
    FP8-block, whose fused partitions therefore stack tile rows); every other tensor is
    ``"bf16"`` with one target.
    """
    layout = quant_layout(mxfp8=mxfp8, fmt=fmt)
    params = vllm_params(shape, fmt=layout.format if layout else FORMAT_BF16, quantized=quantized, rules=rules)
    quantized = _quantized(shape, layout, quantized, rules)
    out: dict[str, Destination] = {}
    for name, src_shape, _ in hf_tensor_specs(shape, experts=experts):
        param, row = _route(shape, name)
        spec = params.get(param)
        if spec is None:
            raise ValueError(f"{name}: no vLLM parameter {param!r} for it in {shape.name}")
        k = src_shape[-1]
        rows = math.prod(src_shape[:-1])
        param_rows = math.prod(spec.shape[:-1])
        if spec.shape[-1] != k or row + rows > param_rows:
            raise ValueError(
                f"{name}: source {tuple(src_shape)} is not a contiguous row range of {param} {spec.shape} "
                f"(rows {row}..{row + rows}, last dim {k})"
            )
        if param in quantized:
            q = _held_by(layout)
            sname = q.scale_param(param)
            scale_row = q.scale_row(spec.shape[-2], row)
            scale_cols = params[sname].shape[-1]
            targets = (
                Target(param, row * k * q.value_dtype.itemsize, tuple(src_shape), q.value_dtype),
                Target(
                    sname,
                    scale_row * scale_cols * q.scale_dtype.itemsize,
                    q.scale_shape(tuple(src_shape)),
                    q.scale_dtype,
                ),
            )
            out[name] = Destination(name, q.format, targets)
        else:
            dt = shape.dtype
            out[name] = Destination(name, FORMAT_BF16, (Target(param, row * k * dt.itemsize, tuple(src_shape), dt),))
    return out


def coverage_check(params: dict[str, ParamSpec], destinations: dict[str, Destination], *, limit: int = 10) -> None:
    """Raise ValueError unless every byte of every param is written by exactly one target.

    Also refused: a target naming an unknown param, or whose dtype is not the param's (its
    bytes would be read as the wrong type). The message names the first ``limit`` problems.
    """
    ranges: dict[str, list[tuple[int, int, str]]] = {n: [] for n in params}
    problems: list[str] = []
    for dest in destinations.values():
        for t in dest.targets:
            spec = params.get(t.param)
            if spec is None:
                problems.append(f"{dest.name}: target param {t.param!r} does not exist")
                continue
            if t.dtype != spec.dtype:
                problems.append(f"{dest.name}: target dtype {t.dtype} != {t.param} dtype {spec.dtype}")
            ranges[t.param].append((t.offset, t.offset + t.nbytes, dest.name))
    for name, spec in params.items():
        for p in cover_problems(ranges[name], spec.nbytes):
            if p.kind == "overlap":
                problems.append(f"{name}: bytes [{p.start}, {p.end}) written by both {p.earlier} and {p.writer}")
            elif p.kind == "past":
                problems.append(f"{name}: {p.earlier} writes bytes up to {p.end}, past the end ({spec.nbytes})")
            else:
                problems.append(f"{name}: bytes [{p.start}, {p.end}) not covered")
    if problems:
        more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
        raise ValueError(f"coverage check failed: {'; '.join(problems[:limit])}{more}")


def _even(what: str, n: int, ranks: int) -> int:
    if n % ranks:
        raise ValueError(f"{what} ({n}) does not split evenly over {ranks} ranks")
    return n // ranks


def _tp_shards(shape: ModelShape, rank: int, size: int, expert_parallel: bool) -> dict[str, Shard]:
    """Values parameters' slices on rank ``rank`` of ``size`` (see the module docstring)."""
    hd, q_rows = shape.head_dim, shape.heads * shape.head_dim
    q = _even(f"{shape.name}: query heads", shape.heads, size) * hd
    if shape.kv_heads >= size:
        kv_head, kv = rank, _even(f"{shape.name}: KV heads", shape.kv_heads, size) * hd
    else:
        kv_head, kv = rank // _even(f"{shape.name}: ranks per KV head", size, shape.kv_heads), hd
    kv_rows = shape.kv_heads * hd
    qkv = Shard(
        0,
        q + 2 * kv,
        (
            (rank * q, (rank + 1) * q, 0),
            (q_rows + kv_head * kv, q_rows + (kv_head + 1) * kv, q),
            (q_rows + kv_rows + kv_head * kv, q_rows + kv_rows + (kv_head + 1) * kv, q + kv),
        ),
    )

    def rows(n: int, what: str) -> Shard:
        part = _even(what, n, size)
        return Shard(0, part, ((rank * part, (rank + 1) * part, 0),))

    def cols(dim: int, n: int, what: str) -> Shard:
        part = _even(what, n, size)
        return Shard(dim, part, ((rank * part, (rank + 1) * part, 0),))

    def gate_up(dim: int, n: int, what: str) -> Shard:
        part = _even(what, n, size)
        lo = rank * part
        return Shard(dim, 2 * part, ((lo, lo + part, 0), (n + lo, n + lo + part, part)))

    out = {"model.embed_tokens.weight": rows(shape.vocab, f"{shape.name}: vocabulary")}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = rows(shape.vocab, f"{shape.name}: vocabulary")
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj.weight"] = qkv
        out[f"{p}.self_attn.o_proj.weight"] = cols(1, q_rows, f"{shape.name}: o_proj columns")
        if shape.is_moe and expert_parallel:
            out[f"{p}.{EXPERTS}.w13_weight"] = rows(shape.experts, f"{shape.name}: experts")
            out[f"{p}.{EXPERTS}.w2_weight"] = rows(shape.experts, f"{shape.name}: experts")
        elif shape.is_moe:
            out[f"{p}.{EXPERTS}.w13_weight"] = gate_up(1, shape.moe_intermediate, f"{shape.name}: moe_intermediate")
            out[f"{p}.{EXPERTS}.w2_weight"] = cols(2, shape.moe_intermediate, f"{shape.name}: moe_intermediate")
        else:
            out[f"{p}.mlp.gate_up_proj.weight"] = gate_up(0, shape.intermediate, f"{shape.name}: intermediate")
            out[f"{p}.mlp.down_proj.weight"] = cols(1, shape.intermediate, f"{shape.name}: intermediate")
    return out


def vllm_shards(
    shape: ModelShape,
    *,
    mxfp8: bool,
    tp_rank: int,
    tp_size: int,
    expert_parallel: bool = False,
    quantized: Collection[str] | None = None,
    rules: QuantRules = DEFAULT_RULES,
) -> dict[str, Shard]:
    """What tensor-parallel rank ``tp_rank`` of ``tp_size`` holds of each whole parameter of
    ``vllm_params(shape, mxfp8=mxfp8, quantized=quantized, rules=rules)``; ``expert_parallel``:
    experts whole, split over the ranks.

    ``shape`` is the whole model. Parameters not listed (norms, router) are whole on every rank.
    """
    if shape.tp_share != 1 or shape.ep_share != 1:
        raise ValueError(f"{shape.name} is one rank's share already; give the whole model's shape")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if tp_size == 1:
        return {}
    values = _tp_shards(shape, tp_rank, tp_size, expert_parallel)
    params = vllm_params(shape, mxfp8=mxfp8, quantized=quantized, rules=rules)
    out = dict(values)
    for name, shard in values.items():
        if scale_param(name) in params:
            out[scale_param(name)] = mxfp8_scale_shard(shard, len(params[name].shape))
    return out
