"""The embedded engine: refit any ``torch.nn.Module`` (e.g. a transformers model) in place.

Destination names are the module's own parameter names, so an HF model receives HF names
as they are. Storage is written in place: parameter objects and their data pointers never
change across refits. Parameters that share storage (tied embeddings) are one destination.

With ``quant`` set, every weight that ``rules`` quantize (``mxrefit.plan.eligibility.QuantRules``,
by default all linear and expert weights but ``lm_head`` and the router) is held quantized, as
vLLM's layers hold it: the parameter ``<attr>`` is replaced by an E4M3 buffer ``<attr>`` plus
a scale buffer on the same module, initialised by quantizing the current weight:
- ``"mxfp8"``: ``<attr>_scale``, uint8 [..., K/32] (ModelOpt MXFP8's name);
- ``"fp8-block"`` / ``"fp8-block-ue8m0"``: ``<attr>_scale_inv``, float32
  [..., ceil(N/128), ceil(K/128)] (``Fp8Config`` block quantization's name; the second sends
  power-of-two scales).
Such a module is a weight store (its forward would see FP8 tensors); ``dequantized_state()``
gives the BF16 view for checks.

With ``tp_size > 1`` the module becomes one tensor-parallel rank's weight store: every weight is
replaced by the slice vLLM's parallel layers would hold on rank ``tp_rank``
(``engines.tensor_parallel``; MXFP8 scales sliced with their values), while the tables still
describe the whole weights, so all ranks share one plan and each applies only its slice
(``shards``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mxrefit.engine.base import Engine
from mxrefit.engine.shards import mxfp8_scale_shard
from mxrefit.engine.tensor_parallel import hf_shard
from mxrefit.formats import fp8_block, mxfp8
from mxrefit.plan.eligibility import DEFAULT_RULES, QuantRules, layer_of
from mxrefit.plan.types import Destination, ParamSpec, Shard, Target


@dataclass(frozen=True)
class _Held:
    """How one quantized format is held: its scale buffer's suffix and its (de)quantizer."""

    scale_suffix: str
    quantize: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


HELD: dict[str, _Held] = {
    "mxfp8": _Held("_scale", lambda w, name: mxfp8.quantize(w, name=name), mxfp8.dequantize),
    "fp8-block": _Held("_scale_inv", lambda w, name: fp8_block.quantize(w, name=name), fp8_block.dequantize),
    "fp8-block-ue8m0": _Held(
        "_scale_inv", lambda w, name: fp8_block.quantize(w, use_ue8m0=True, name=name), fp8_block.dequantize
    ),
}


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"engine storage must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t.detach().reshape(-1).view(torch.uint8)


class TorchEngine(Engine):
    def __init__(
        self,
        module: nn.Module,
        *,
        quant: str | None = None,
        mxfp8: bool = False,
        rules: QuantRules = DEFAULT_RULES,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        """``quant``: None (every parameter as it is), ``"mxfp8"``, ``"fp8-block"`` or
        ``"fp8-block-ue8m0"``; ``mxfp8=True`` is short for ``quant="mxfp8"``. ``rules`` decide
        which weights are quantized (the same rules a trainer can check the plan with).
        ``tp_rank`` of ``tp_size``: hold that tensor-parallel rank's slices (None or MXFP8 weights)."""
        if mxfp8:
            if quant not in (None, "mxfp8"):
                raise ValueError(f"mxfp8=True and quant={quant!r} disagree; pass quant alone")
            quant = "mxfp8"
        if quant is not None and quant not in HELD:
            raise ValueError(f"quant must be None or one of {sorted(HELD)}, got {quant!r}")
        if tp_size > 1 and quant not in (None, "mxfp8"):
            raise ValueError(
                f"tensor-parallel slices of {quant} weights are not modelled (their scale tiles span "
                f"128 rows); use quant=None or 'mxfp8' with tp_size > 1"
            )
        self.module = module
        self.quant = quant
        self.rules = rules
        self._tensors: dict[str, torch.Tensor] = {}
        self._destinations: dict[str, Destination] = {}
        self._shards: dict[str, Shard] = {}
        seen_storage: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        named = list(module.named_parameters(remove_duplicate=False))
        quantized = rules.decide((n, tuple(p.shape)) for n, p in named) if quant is not None else {}
        for name, param in named:
            key = param.untyped_storage().data_ptr()
            if key in seen_storage:
                self.aliases[name] = seen_storage[key]
                continue
            seen_storage[key] = name
            shape = tuple(param.shape)
            if quant is not None and quantized.get(name):
                self._hold_quantized(name, param, quant, HELD[quant])
            else:
                self._tensors[name] = param.data
                self._destinations[name] = Destination(name, "bf16", (Target(name, 0, shape, param.dtype),))
        self._specs = {n: ParamSpec(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items()}
        if tp_size > 1:
            self._keep_slices(tp_rank, tp_size)

    def _keep_slices(self, rank: int, size: int) -> None:
        """Replace each weight by this rank's slice (values and scales alike), as vLLM's TP layers hold them."""
        for name, dest in self._destinations.items():
            shard = hf_shard(name, self._specs[name].shape, rank, size)
            if shard is None:
                continue
            for target in dest.targets:
                param_shard = shard if target.param == name else mxfp8_scale_shard(shard, len(target.shape))
                whole = self._tensors[target.param]
                local = torch.cat(
                    [whole.narrow(param_shard.dim, a, b - a) for a, b, _ in sorted(param_shard.pieces, key=lambda p: p[2])],
                    param_shard.dim,
                )
                self._replace(target.param, local.contiguous())
                self._shards[target.param] = param_shard

    def _replace(self, name: str, tensor: torch.Tensor) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.module.get_submodule(owner_name) if owner_name else self.module
        current = getattr(owner, attr)
        if isinstance(current, nn.Parameter):
            current.data = tensor
        else:
            owner.register_buffer(attr, tensor)
        self._tensors[name] = tensor

    def _hold_quantized(self, name: str, param: nn.Parameter, quant: str, held: _Held) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.module.get_submodule(owner_name) if owner_name else self.module
        try:
            with torch.no_grad():
                values, scales = held.quantize(param.data, name)
        except ValueError as err:
            raise ValueError(
                f"{err}; the rules quantize its layer {layer_of(name)!r}: add it to QuantRules.ignore to keep it BF16"
            ) from None
        delattr(owner, attr)
        owner.register_buffer(attr, values)
        owner.register_buffer(f"{attr}{held.scale_suffix}", scales)
        scale_name = f"{name}{held.scale_suffix}"
        self._tensors[name] = values
        self._tensors[scale_name] = scales
        self._destinations[name] = Destination(
            name,
            quant,
            (Target(name, 0, tuple(values.shape), values.dtype), Target(scale_name, 0, tuple(scales.shape), scales.dtype)),
        )

    def params(self) -> dict[str, ParamSpec]:
        return dict(self._specs)

    def shards(self) -> dict[str, Shard]:
        return dict(self._shards)

    def destinations(self) -> dict[str, Destination]:
        return dict(self._destinations)

    def storage(self, param: str) -> torch.Tensor:
        return _flat_bytes(self._tensors[param])

    def tensor(self, param: str) -> torch.Tensor:
        return self._tensors[param]

    def dequantized_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Every trainer-named weight as the engine holds it, quantized ones dequantized."""
        out = {}
        for name, dest in self._destinations.items():
            if dest.format in HELD:
                values, scales = (self._tensors[t.param] for t in dest.targets)
                out[name] = HELD[dest.format].dequantize(values, scales, dtype)
            else:
                out[name] = self._tensors[name]
        return out
