"""The Engine contract: what the receiving side's model gives mxrefit (tables, storage, hooks).

The tables' types (``Target``, ``Destination``, ``ParamSpec``, ``Shard``) are the plan's own
(``mxrefit/plan/types.py``); an engine builds them, the plan reads them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mxrefit.plan.build import RefitPlan
from mxrefit.plan.types import Destination, ParamSpec, Shard


class Engine(ABC):
    """The receiving side's model: tables once, storage views once, hooks as bytes land.

    Call order on the engine side: ``params``/``destinations`` (at set-up, and again after a
    refit whose ``after_refit`` bumped ``tables_version``), then per adopted plan
    ``prepare(plan)`` followed by ``storage`` for every param (views are built once and kept),
    then per refit ``after_bucket(i)`` after bucket *i*'s bytes landed and ``after_refit`` once
    all did. Engines whose parameters are written as they are need none of the hooks; engines
    that stage checkpoint-format bytes and run post-load processing (vLLM) use all three.
    """

    @abstractmethod
    def params(self) -> dict[str, ParamSpec]:
        """Destination parameters by engine name."""

    @abstractmethod
    def destinations(self) -> dict[str, Destination]:
        """Trainer tensor name -> Destination."""

    @abstractmethod
    def storage(self, param: str) -> torch.Tensor:
        """The parameter's bytes as a flat contiguous uint8 view (written in place)."""

    def prepare(self, plan: "RefitPlan") -> None:
        """A plan was adopted: place any staging memory before ``storage`` views are taken."""

    def after_bucket(self, bucket: int) -> None:
        """Bucket ``bucket`` of the adopted plan landed: process what is now complete."""

    def after_refit(self, version: int) -> None:
        """Post-load processing once every byte of a refit has landed (layout shuffles, ...)."""

    @property
    def tables_version(self) -> int:
        """Bumped by an engine whose ``params``/``destinations`` changed after set-up (e.g. a kernel
        layout learned at a refit, which it can now advertise on its targets); 0 by default.

        The receiver re-reads the tables after each commit when this changed and tells the trainer,
        which plans again before its next refit. Until a new plan is adopted the engine must keep
        serving the adopted one (decide from the plan given to ``prepare``, not from the current
        tables), so a trainer that does not plan again is never served wrong bytes.
        """
        return 0

    def shards(self) -> dict[str, Shard]:
        """Parameters this rank holds only a slice of (``storage`` is then the slice's bytes)."""
        return {}

    def read(self, param: str) -> torch.Tensor:
        """The parameter's bytes as the engine serves them (after any processing), flat uint8."""
        return self.storage(param)

    @property
    def exportable(self) -> bool:
        """Whether ``storage`` views can be exported to the trainer for direct writes."""
        return self.device.type == "cuda"

    @property
    def device(self) -> torch.device:
        first = next(iter(self.params()))
        return self.storage(first).device
