"""An engine made from tables alone: storage for every parameter of a given layout.

Used where the real engine is not at hand (the benchmark's vLLM-layout engine on one GPU,
tests of layouts), so the refit path — plan, direct writes or buffers, batched copies into
fused parameters, staged post-processing — runs exactly as it would against a live model.

All directly written parameters live in one exportable arena (one CUDA IPC handle, or one
shared-memory segment on the host), so the trainer can write into them directly. Optional
staged units (``mxrefit.engine.staging``) receive checkpoint-format bytes and write the
kernel tensors when processed, as a real engine's post-load processing would.

With ``shards`` it is one tensor-parallel rank of such an engine: the tables stay whole and each
sharded parameter's storage holds only the rank's slice (e.g. ``integrations.vllm.layout.vllm_shards``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mxrefit.devices import align, resolve
from mxrefit.engine.base import Engine
from mxrefit.engine.shards import local_nbytes
from mxrefit.engine.staging import StagedUnit, StagingPool
from mxrefit.plan.types import Destination, ParamSpec, Shard
from mxrefit.transport.direct import allocate


class LayoutEngine(Engine):
    def __init__(
        self,
        params: dict[str, ParamSpec],
        destinations: dict[str, Destination],
        device: torch.device | str = "cpu",
        *,
        units: Sequence[StagedUnit] = (),
        kernel: dict[str, torch.Tensor] | None = None,
        deferred: bool = False,
        shards: dict[str, Shard] | None = None,
    ):
        """``units`` are staged (their params get no arena storage); ``kernel`` maps a staged
        param to the tensor its processing writes, which ``read`` then returns."""
        self._params = dict(params)
        self._destinations = dict(destinations)
        self._device = resolve(device)
        self._shards = dict(shards or {})
        if self._shards and units:
            raise ValueError("staged units process whole parameters; a rank holding slices cannot stage them")
        self.staging = StagingPool(self._params, units, self._device, deferred=deferred) if units else None
        direct = [n for n in params if not (self.staging and self.staging.staged(n))]
        offsets, sizes, total = {}, {}, 0
        for n in direct:
            offsets[n], sizes[n] = total, local_nbytes(params[n], self._shards.get(n))
            total += align(sizes[n])
        self.arena = allocate(max(total, 1), self._device)
        self.arena.zero_()
        self._storage = {n: self.arena[offsets[n] : offsets[n] + sizes[n]] for n in direct}
        self.tensors = {n: s.view(params[n].dtype).view(self._local_shape(n)) for n, s in self._storage.items()}
        self.kernel = dict(kernel or {})

    def _local_shape(self, name: str) -> tuple[int, ...]:
        shard = self._shards.get(name)
        return self._params[name].shape if shard is None else shard.local_shape(self._params[name].shape)

    def params(self) -> dict[str, ParamSpec]:
        return dict(self._params)

    def shards(self) -> dict[str, Shard]:
        return dict(self._shards)

    def destinations(self) -> dict[str, Destination]:
        return dict(self._destinations)

    def prepare(self, plan) -> None:
        if self.staging is not None:
            self.staging.place(plan)

    def storage(self, param: str) -> torch.Tensor:
        if self.staging is not None and self.staging.staged(param):
            return self.staging.storage(param)
        return self._storage[param]

    def read(self, param: str) -> torch.Tensor:
        if param in self.kernel:
            return self.kernel[param].reshape(-1).view(torch.uint8)
        return self._storage[param]

    def after_bucket(self, bucket: int) -> None:
        if self.staging is not None:
            self.staging.after_bucket(bucket)

    def after_refit(self, version: int) -> None:
        if self.staging is not None:
            self.staging.process_all()

    @property
    def exportable(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self._device
