"""Which trainer tensors are quantized: one rule set that the trainer and the engine share.

vLLM decides per *layer*, from the checkpoint's ModelOpt quantization config
(``hf_quant_config.json``: ``{"quantization": {"quant_algo": "MXFP8", "exclude_modules": [...]}}``):
a linear layer (``lm_head`` and the MoE router included) or a routed-expert block is quantized
unless ``exclude_modules`` names it; embeddings and norms never are. ``QuantRules`` makes that
decision for Hugging Face tensor names, the way vLLM 0.32 makes it
(``ModelOptQuantConfigBase.is_layer_excluded`` in ``layers/quantization/modelopt.py`` and
``is_layer_skipped`` in ``quantization/utils/quant_utils.py``), so that a config written by one
side means the same on the other:

- a tensor is judged by the vLLM layer it lands in: ``q/k/v_proj`` by ``self_attn.qkv_proj``,
  a dense ``gate/up_proj`` by ``mlp.gate_up_proj``, every expert tensor (grouped slab or
  per-expert) by ``mlp.experts``; a pattern that names only some shards of a fused layer is
  refused, as vLLM refuses it;
- a pattern matches a layer name exactly, as a substring, or as an ``fnmatch`` wildcard; a
  trailing ``X*`` also stands for ``X`` and ``X.*`` (vLLM's ``apply_vllm_mapper`` rewrite);
- for the routed experts, a pattern naming something inside them (``...experts.3.up_proj``)
  excludes the whole block, as vLLM's expert rule does;
- ``bf16_first_layers`` / ``bf16_last_layers`` keep whole decoder layers in BF16; they are
  exported as ``model.layers.{i}.*`` patterns, so they need the layer count, taken from names;
- by default ``lm_head`` and the router (``model.layers.*.mlp.gate``) are excluded, which vLLM
  would otherwise quantize; embeddings, norms, biases and 1-D tensors are never quantized.

The engine's tables remain the source of truth (``Destination.format``); ``check_rules`` turns
a disagreement between them and the trainer's rules into a ``PlanMismatch`` naming each tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from mxrefit.plan.build import PlanMismatch
from mxrefit.plan.types import Destination

QUANT_FORMATS = {"MXFP8": "mxfp8"}
DEFAULT_IGNORE = ("lm_head", "model.layers.*.mlp.gate")
LAYERS_PREFIX = "model.layers"
# vLLM's packed_modules_mapping for Qwen3 / Qwen3-MoE / Llama: fused layer -> its HF shards.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SHARD_OF = {shard: fused for fused, shards in FUSED.items() for shard in shards}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?:\d+\.)?(?:gate_up_proj|down_proj|gate_proj|up_proj)(?:\.weight)?$")
_NEVER = re.compile(r"(embed|norm)")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")

Spec = tuple[str, tuple[int, ...]]


def layer_of(name: str) -> str:
    """The vLLM layer (module name) that decides a trainer tensor's precision."""
    m = _EXPERT.match(name)
    if m:
        return m["layer"]
    module = name.removesuffix(".weight")
    owner, _, proj = module.rpartition(".")
    return f"{owner}.{_SHARD_OF[proj]}" if proj in _SHARD_OF else module


def layer_count(names: Iterable[str]) -> int:
    """Decoder layers in a model, from its tensor names (``...layers.{i}...``); 0 if none."""
    indices = [int(m[1]) for n in names if (m := _LAYER_INDEX.search(n))]
    return max(indices) + 1 if indices else 0


def _expand(patterns: Iterable[str]) -> list[str]:
    """vLLM's rewrite of ModelOpt's ``module_path*`` into ``module_path`` and ``module_path.*``."""
    out: list[str] = []
    for p in patterns:
        if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


def _exact(layer: str, patterns: list[str]) -> bool:
    proj = layer.rsplit(".", 1)[-1]
    if proj in FUSED and layer not in patterns:
        shards = [layer.replace(proj, s) in patterns for s in FUSED[proj]]
        if any(shards) and not all(shards):
            named = [s for s, hit in zip(FUSED[proj], shards) if hit]
            raise ValueError(
                f"exclude_modules names {named} but not every shard of the fused layer {layer!r} "
                f"{list(FUSED[proj])}; vLLM refuses a fused layer with mixed precision"
            )
        return all(shards)
    if "experts" in layer and proj not in FUSED:
        return any(layer in p for p in patterns if "experts" in p)
    return layer in patterns


def layer_excluded(layer: str, patterns: Iterable[str]) -> bool:
    """vLLM 0.32's ``is_layer_excluded`` for one layer name: exact (fused shards), substring, wildcard."""
    pats = _expand(patterns)
    if not pats:
        return False
    return _exact(layer, pats) or any(p != layer and p in layer for p in pats) or any(fnmatch(layer, p) for p in pats)


def _quantizable_kind(name: str, shape: tuple[int, ...]) -> bool:
    """Layers vLLM quantizes at all: linear weights and expert slabs; never embeddings, norms, biases."""
    return len(shape) in (2, 3) and not name.endswith(".bias") and not _NEVER.search(name)


@dataclass(frozen=True)
class QuantRules:
    """Which layers are quantized (``quant_algo``) and which stay BF16; see the module docstring."""

    ignore: tuple[str, ...] = DEFAULT_IGNORE
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    quant_algo: str = "MXFP8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.quant_algo not in QUANT_FORMATS:
            raise ValueError(f"quant_algo {self.quant_algo!r} is not supported; known: {sorted(QUANT_FORMATS)}")
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")

    @property
    def format(self) -> str:
        """The wire format of a quantized tensor (``Destination.format``)."""
        return QUANT_FORMATS[self.quant_algo]

    def exclude_modules(self, num_layers: int) -> list[str]:
        """ModelOpt ``exclude_modules``: ``ignore`` plus one ``model.layers.{i}.*`` per BF16 layer."""
        if (self.bf16_first_layers or self.bf16_last_layers) and num_layers <= 0:
            raise ValueError("bf16_first_layers/bf16_last_layers need the layer count; no 'layers.{i}.' tensor names were given")
        kept = sorted(
            set(range(min(self.bf16_first_layers, num_layers)))
            | set(range(max(num_layers - self.bf16_last_layers, 0), num_layers))
        )
        return list(self.ignore) + [f"{LAYERS_PREFIX}.{i}.*" for i in kept]

    def excludes_layer(self, layer: str, num_layers: int) -> bool:
        """Whether the vLLM layer ``layer`` stays BF16 under these rules."""
        return layer_excluded(layer, self.exclude_modules(num_layers))

    def decide(self, specs: Iterable[Spec]) -> dict[str, bool]:
        """``{name: quantized}`` for every ``(name, shape)``; the layer count comes from the names."""
        specs = [(n, tuple(s)) for n, s in specs]
        patterns = self.exclude_modules(layer_count(n for n, _ in specs))
        out: dict[str, bool] = {}
        for name, shape in specs:
            out[name] = _quantizable_kind(name, shape) and not layer_excluded(layer_of(name), patterns)
        return out

    def to_hf_quant_config(self, num_layers: int) -> dict:
        """The ``hf_quant_config.json`` vLLM reads for these rules (ModelOpt's legacy layout)."""
        return {
            "producer": {"name": "mxrefit"},
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": None,
                "exclude_modules": self.exclude_modules(num_layers),
            },
        }

    @classmethod
    def from_hf_quant_config(cls, config: Mapping | str | os.PathLike) -> "QuantRules":
        """Rules from ``hf_quant_config.json`` (a path or its dict) or a config.json ``quantization_config``.

        Accepts ModelOpt's two layouts, as vLLM does: ``{"quantization": {"quant_algo",
        "exclude_modules"}}`` and ``{"quant_algo", "ignore"}``. Layer ranges come back as
        ``ignore`` patterns, which decide exactly as the ranges did.
        """
        data: Mapping[str, Any]
        if isinstance(config, Mapping):
            data = config
        else:
            with open(config) as f:
                data = json.load(f)
        if "quantization" in data:
            section = data["quantization"]
            if not isinstance(section, Mapping):
                raise ValueError("hf_quant_config: 'quantization' must be a mapping")
            algo, ignore = section.get("quant_algo"), section.get("exclude_modules", [])
        else:
            algo, ignore = data.get("quant_algo"), data.get("ignore", [])
        if not algo:
            raise ValueError("hf_quant_config: no 'quant_algo'")
        if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
            raise ValueError(f"hf_quant_config: exclude_modules must be a list of strings, got {ignore!r}")
        return cls(ignore=tuple(ignore), quant_algo=str(algo).upper())


DEFAULT_RULES = QuantRules()


def check_rules(rules: QuantRules, destinations: Mapping[str, Destination]) -> None:
    """Raise PlanMismatch naming every tensor that ``rules`` quantize and the engine holds in BF16,
    or the reverse. Which quantized format (MXFP8, FP8-block) is the engine's choice.

    The layer count is taken from the engine's names, as on the trainer side.
    """
    specs = [(name, d.targets[0].shape) for name, d in destinations.items()]
    try:
        decided = rules.decide(specs)
    except ValueError as err:
        raise PlanMismatch([f"trainer quantization rules: {err}"]) from None
    problems = []
    for name, dest in destinations.items():
        if (dest.format != "bf16") != decided[name]:
            want = "quantize it" if decided[name] else "keep it bf16"
            problems.append(
                f"tensor {name!r} (layer {layer_of(name)!r}): the trainer's rules {want}, the engine holds it as {dest.format}"
            )
    if problems:
        raise PlanMismatch(problems)
