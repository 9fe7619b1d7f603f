"""Trainer side: ``Sender`` and ``BroadcastSender`` (send a refit), the weight sources (``hf``,
``megatron``) and the checkpoint writers (``checkpoint``).

A weight source (``WeightSource``) streams a model's tensors under Hugging Face names, one full tensor at a time.

A source gives ``specs()`` (name, global shape, dtype for every tensor, in stream order, without
materializing any) for ``Sender.plan``, and iterates ``(name, tensor)`` pairs in that order,
each a full, contiguous tensor that the source itself no longer references once the next pair
is requested: a sharded model is never gathered whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from mxrefit.plan.build import SourceSpec


class WeightSource(Protocol):
    def specs(self) -> list[SourceSpec]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...
