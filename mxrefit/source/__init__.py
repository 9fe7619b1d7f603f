"""Trainer side: ``Sender`` and ``BroadcastSender`` (send a refit), the parameter streams (``hf``,
``megatron``) and the checkpoint writers (``checkpoint``).

A parameter stream (``ParamStream``) gives a model's tensors under Hugging Face names, one full tensor at a time.
(Not vLLM's ``WeightSource``, the trainer-side object its weight-transfer engines read; the
vLLM integration adapts that one in ``mxrefit.integrations.vllm.compat``.)

A stream gives ``specs()`` (name, global shape, dtype for every tensor, in stream order, without
materializing any) for ``Sender.plan``, and iterates ``(name, tensor)`` pairs in that order,
each a full, contiguous tensor that the stream itself no longer references once the next pair
is requested: a sharded model is never gathered whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from mxrefit.plan.build import SourceSpec


class ParamStream(Protocol):
    """What ``HFSource`` and ``MegatronSource`` are: ``specs()`` for ``Sender.plan``, then the tensors."""

    def specs(self) -> list[SourceSpec]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...
