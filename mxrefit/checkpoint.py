"""Write a ModelOpt MXFP8 checkpoint that vLLM can start from, out of a BF16 transformers model.

Why: an MXFP8 rollout engine must start from an MXFP8 checkpoint (vLLM's ModelOpt MXFP8
layers have no online quantization), while an RL run starts from a BF16 policy. This
writes the policy's step-0 weights in exactly the bytes mxrefit's refits will send later
(``mxfp8.quantize``, which equals vLLM's own quantization), decided by the same
``QuantRules`` the refits use, so the engine's first version and every refit agree.

Layout written (what ``ModelOptMxFp8Config`` reads): every eligible ``<m>.weight`` becomes
``<m>.weight`` (float8_e4m3fn) + ``<m>.weight_scale`` (uint8, [..., K/32]); everything else
stays as saved. ``config.json`` gets ``quantization_config`` with ``quant_algo: MXFP8`` and
``exclude_modules`` = ``rules.exclude_modules`` (by default lm_head and the routers), the
patterns that decided which tensors were quantized, and the same block goes to
``hf_quant_config.json``.
"""

from __future__ import annotations

import json
import os

import torch

from mxrefit.eligibility import DEFAULT_RULES, QuantRules, layer_count
from mxrefit.formats import mxfp8

SCALE_SUFFIX = "_scale"


def quant_block(exclude_modules: list[str]) -> dict:
    """The ``quantization_config`` vLLM's ModelOpt MXFP8 loader expects."""
    return {
        "quant_method": "modelopt",
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": exclude_modules},
    }


def save_mxfp8_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    rules: QuantRules = DEFAULT_RULES,
) -> dict[str, str]:
    """Save ``model`` (a transformers PreTrainedModel) at ``path`` as an MXFP8 checkpoint.

    Returns {tensor name: "mxfp8" | "bf16"} for every weight written (checkpoint names).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    model.save_pretrained(path)
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
                values, scales = mxfp8.quantize(t.contiguous(), name=name, backend="torch")
                out[name] = values
                out[name + SCALE_SUFFIX] = scales
                formats[name] = "mxfp8"
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
    block = quant_block(rules.exclude_modules(layer_count(n for n, _ in specs)))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = block
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "mxrefit"}, "quantization": block["quantization"]}, f, indent=1)
    return formats
