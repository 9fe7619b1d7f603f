"""The embedded engine: refit any ``torch.nn.Module`` (e.g. a transformers model) in place.

Destination names are the module's own parameter names, so an HF model receives HF names
as they are. Storage is written in place: parameter objects and their data pointers never
change across refits. Parameters that share storage (tied embeddings) are one destination.

With ``mxfp8=True`` every eligible weight (``mxrefit.eligibility``) is held in the engine's
MXFP8 layout, as vLLM's ModelOpt layers hold it: the parameter ``<attr>`` is replaced by an
E4M3 buffer ``<attr>`` plus a uint8 buffer ``<attr>_scale`` [..., K/32] on the same module,
initialised by quantizing the current weight. Such a module is a weight store (its forward
would see FP8 tensors); ``dequantized_state()`` gives the BF16 view for checks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mxrefit.eligibility import mxfp8_eligible
from mxrefit.engines.base import Destination, Engine, ParamSpec, Target
from mxrefit.formats import mxfp8


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"engine storage must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t.detach().reshape(-1).view(torch.uint8)


class TorchEngine(Engine):
    def __init__(
        self,
        module: nn.Module,
        *,
        mxfp8: bool = False,
        eligible: Callable[[str, tuple[int, ...]], bool] = mxfp8_eligible,
    ):
        self.module = module
        self._tensors: dict[str, torch.Tensor] = {}
        self._destinations: dict[str, Destination] = {}
        seen_storage: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            key = param.untyped_storage().data_ptr()
            if key in seen_storage:
                self.aliases[name] = seen_storage[key]
                continue
            seen_storage[key] = name
            shape = tuple(param.shape)
            if mxfp8 and eligible(name, shape):
                self._hold_as_mxfp8(name, param)
            else:
                self._tensors[name] = param.data
                self._destinations[name] = Destination(name, "bf16", (Target(name, 0, shape, param.dtype),))

    def _hold_as_mxfp8(self, name: str, param: nn.Parameter) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.module.get_submodule(owner_name) if owner_name else self.module
        with torch.no_grad():
            values, scales = mxfp8.quantize(param.data, name=name)
        delattr(owner, attr)
        owner.register_buffer(attr, values)
        owner.register_buffer(f"{attr}_scale", scales)
        shape = tuple(values.shape)
        self._tensors[name] = values
        self._tensors[f"{name}_scale"] = scales
        self._destinations[name] = Destination(
            name,
            "mxfp8",
            (Target(name, 0, shape, values.dtype), Target(f"{name}_scale", 0, tuple(scales.shape), scales.dtype)),
        )

    def params(self) -> dict[str, ParamSpec]:
        return {n: ParamSpec(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items()}

    def destinations(self) -> dict[str, Destination]:
        return dict(self._destinations)

    def storage(self, param: str) -> torch.Tensor:
        return _flat_bytes(self._tensors[param])

    def tensor(self, param: str) -> torch.Tensor:
        return self._tensors[param]

    def dequantized_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Every trainer-named weight as the engine holds it, MXFP8 ones dequantized."""
        out = {}
        for name, dest in self._destinations.items():
            if dest.format == "mxfp8":
                out[name] = mxfp8.dequantize(self._tensors[name], self._tensors[f"{name}_scale"], dtype)
            else:
                out[name] = self._tensors[name]
        return out
