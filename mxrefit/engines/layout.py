"""An engine made from tables alone: storage for every parameter of a given layout.

Used where the real engine is not at hand (the benchmark's vLLM-layout engine on one GPU,
tests of layouts), so the refit path — plan, buffers, batched copies into fused parameters —
runs exactly as it would against the live model.
"""

from __future__ import annotations

import torch

from mxrefit.engines.base import Destination, Engine, ParamSpec


class LayoutEngine(Engine):
    def __init__(self, params: dict[str, ParamSpec], destinations: dict[str, Destination], device: torch.device | str = "cpu"):
        self._params = dict(params)
        self._destinations = dict(destinations)
        self._device = torch.device(device)
        self.tensors = {n: torch.zeros(p.shape, dtype=p.dtype, device=self._device) for n, p in params.items()}

    def params(self) -> dict[str, ParamSpec]:
        return dict(self._params)

    def destinations(self) -> dict[str, Destination]:
        return dict(self._destinations)

    def storage(self, param: str) -> torch.Tensor:
        return self.tensors[param].reshape(-1).view(torch.uint8)

    @property
    def device(self) -> torch.device:
        return self._device
