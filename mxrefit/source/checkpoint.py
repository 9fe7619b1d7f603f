"""Write a quantized checkpoint that vLLM can start from, out of a BF16 transformers model.

Why: a quantized rollout engine must start from a quantized checkpoint (vLLM's ModelOpt
MXFP8 and ``Fp8Config`` block-FP8 layers load quantized bytes), while an RL run starts from a
BF16 policy. These writers store the policy's step-0 weights in exactly the bytes mxrefit's
refits will send later (``mxfp8.quantize`` / ``fp8_block.quantize``, which equal vLLM's own
quantization), decided by the same ``QuantRules`` the refits use, so the engine's first
version and every refit agree.

Layouts written (both: every quantized ``<m>.weight`` becomes ``<m>.weight`` float8_e4m3fn plus
a scale beside it; everything else stays as saved):
- MXFP8 (what ``ModelOptMxFp8Config`` reads): ``<m>.weight_scale`` uint8 [..., K/32];
  ``config.json`` gets ``quantization_config`` with ``quant_algo: MXFP8`` and
  ``exclude_modules`` = ``rules.exclude_modules`` (by default lm_head and the routers), the
  patterns that decided which tensors were quantized; the same block goes to
  ``hf_quant_config.json``.
- FP8-block (what ``Fp8Config`` reads, ``quant_method: fp8``, ``weight_block_size: [128, 128]``,
  dynamic activations): ``<m>.weight_scale_inv`` float32 [..., ceil(N/128), ceil(K/128)].
  ``Fp8Config`` matches ``ignored_layers`` exactly (no wildcards), so the writer lists every
  layer the rules keep BF16 by name (fused layers by their HF shards, experts as
  ``model.layers.{i}.mlp.experts``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from mxrefit.formats import fp8_block, mxfp8
from mxrefit.plan.eligibility import DEFAULT_RULES, FUSED, QuantRules, layer_count, layer_of

SCALE_SUFFIX = "_scale"
FP8_BLOCK_SCALE_SUFFIX = "_scale_inv"

Quantize = Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]


def quant_block(exclude_modules: list[str]) -> dict:
    """The ``quantization_config`` vLLM's ModelOpt MXFP8 loader expects."""
    return {
        "quant_method": "modelopt",
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": exclude_modules},
    }


def fp8_block_config(ignored_layers: list[str]) -> dict:
    """The ``quantization_config`` vLLM's ``Fp8Config`` reads for 128x128 block FP8 (``from_config``:
    ``quant_method``, ``activation_scheme``, ``weight_block_size``, ``ignored_layers``)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fp8_block.BLOCK),
        "ignored_layers": ignored_layers,
    }


def fp8_ignored_layers(specs: list[tuple[str, tuple[int, ...]]], rules: QuantRules = DEFAULT_RULES) -> list[str]:
    """The layers ``rules`` keep BF16 among those vLLM would quantize, by exact name: a fused
    layer by its HF shards (vLLM checks each shard), experts as their ``...mlp.experts`` layer."""
    quantizable = QuantRules(ignore=(), quant_algo=rules.quant_algo).decide(specs)
    decided = rules.decide(specs)
    out: dict[str, None] = {}
    for name, _ in specs:
        if quantizable[name] and not decided[name]:
            layer = layer_of(name)
            out[name.removesuffix(".weight") if layer.rsplit(".", 1)[-1] in FUSED else layer] = None
    return list(out)


def _write_quantized(
    model: torch.nn.Module, path: str, rules: QuantRules, fmt: str, quantize: Quantize, scale_suffix: str
) -> tuple[dict[str, str], list[tuple[str, tuple[int, ...]]]]:
    """Save ``model`` and rewrite its safetensors: every tensor ``rules`` quantize becomes values +
    ``<name><scale_suffix>``. Returns ({name: fmt | "bf16"}, every saved tensor's (name, shape))."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)  # type: ignore[operator]  # a transformers model; nn.Module's stub types attributes as Tensor | Module
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    formats: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    specs = []  # every tensor's name and shape, from the headers: the rules need the layer count
    for fname in files:
        with safe_open(os.path.join(path, fname), "pt") as f:
            specs += [(n, tuple(f.get_slice(n).get_shape())) for n in f.keys()]
    decided = rules.decide(specs)
    for fname in files:
        tensors = load_file(os.path.join(path, fname))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.is_floating_point() and decided[name] and name.endswith(".weight"):
                out[name], out[name + scale_suffix] = quantize(t.contiguous(), name)
                formats[name] = fmt
            else:
                out[name] = t
                formats[name] = "bf16"
        save_file(out, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in out})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = weight_map
        with open(index, "w") as f:
            json.dump(data, f, indent=1)
    return formats, specs


def _set_quantization_config(path: str, block: dict) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = block
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)


def save_mxfp8_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    rules: QuantRules = DEFAULT_RULES,
) -> dict[str, str]:
    """Save ``model`` (a transformers PreTrainedModel) at ``path`` as an MXFP8 checkpoint.

    Returns {tensor name: "mxfp8" | "bf16"} for every weight written (checkpoint names).
    """
    path = os.fspath(path)
    formats, specs = _write_quantized(
        model, path, rules, "mxfp8", lambda t, name: mxfp8.quantize(t, name=name, backend="torch"), SCALE_SUFFIX
    )
    block = quant_block(rules.exclude_modules(layer_count(n for n, _ in specs)))
    _set_quantization_config(path, block)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "mxrefit"}, "quantization": block["quantization"]}, f, indent=1)
    return formats


def save_fp8_block_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    rules: QuantRules = DEFAULT_RULES,
    use_ue8m0: bool = False,
) -> dict[str, str]:
    """Save ``model`` (a transformers PreTrainedModel) at ``path`` as a 128x128 block-FP8
    checkpoint for vLLM's ``Fp8Config``; ``use_ue8m0`` writes power-of-two scales (format
    ``fp8-block-ue8m0``, what the refits send to an engine that re-quantizes to UE8M0).

    Returns {tensor name: "fp8-block" | "fp8-block-ue8m0" | "bf16"} for every weight written.
    """
    path = os.fspath(path)
    fmt = "fp8-block-ue8m0" if use_ue8m0 else "fp8-block"
    formats, specs = _write_quantized(
        model,
        path,
        rules,
        fmt,
        lambda t, name: fp8_block.quantize(t, name=name, use_ue8m0=use_ue8m0, backend="torch"),
        FP8_BLOCK_SCALE_SUFFIX,
    )
    _set_quantization_config(path, fp8_block_config(fp8_ignored_layers(specs, rules)))
    return formats
