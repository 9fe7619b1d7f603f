"""A weight stream from a Megatron-core model through Megatron-Bridge (``pip install 'mxrefit[megatron]'``).

Megatron-Bridge's ``AutoBridge.export_hf_weights(model)`` gathers the tensor-, pipeline- and
expert-parallel shards of one Megatron parameter at a time and converts it to its Hugging Face
tensors (``model_bridge.stream_weights_megatron_to_hf``): the fused ``linear_qkv``, interleaved
per KV group (each group's query heads, then its key head, then its value head), becomes
``q_proj``/``k_proj``/``v_proj`` (``QKVMapping``); an expert's ``linear_fc1`` (rows
``[gate; up]``) becomes ``gate_proj``/``up_proj`` (``GatedMLPMapping``), and ``linear_fc2``
``down_proj``. Names are the checkpoint's, so MoE experts come per expert
(``mlp.experts.{e}.gate_proj.weight``), matching ``vllm_destinations(experts="per_expert")``.
Every rank receives every full tensor (the gathers are collectives): all ranks iterate, one sends.

``MegatronSource`` adds what a refit needs:

- ``specs()``: Bridge knows output shapes only by converting, so the first call runs one export
  pass and keeps (name, shape, dtype), dropping each tensor before the next; later calls reuse
  it. It is collective like the stream: every rank calls it.
- With tied embeddings (``share_embeddings_and_output_weights``) Bridge yields
  ``model.embed_tokens.weight`` and, when the checkpoint lists one, a cloned ``lm_head.weight``;
  the clone is skipped, since a tied engine has one destination for both (as with ``HFSource``).
- Tensors are made contiguous (a converted tensor can be a view of a fused parameter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mxrefit.plan.build import SourceSpec

TIED_COPY = "lm_head.weight"


def _unwrap(module: Any) -> Any:
    """The Megatron model inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _tied(models: list) -> bool:
    inner = _unwrap(models[0])
    config = getattr(inner, "config", None)
    fallback = bool(getattr(inner, "share_embeddings_and_output_weights", False))
    return bool(getattr(config, "share_embeddings_and_output_weights", fallback))


class MegatronSource:
    """``(hf_name, full tensor)`` from ``bridge.export_hf_weights(model)``, one at a time.

    ``bridge`` is a Megatron-Bridge ``AutoBridge`` (made from the HF checkpoint or config the
    model was built from); ``model`` a Megatron-core model or its list of virtual-pipeline chunks.
    """

    def __init__(self, bridge: Any, model: Any):
        self.bridge = bridge
        self.models = model if isinstance(model, list) else [model]
        self.tied = _tied(self.models)
        self._specs: list[SourceSpec] | None = None

    def specs(self) -> list[SourceSpec]:
        if self._specs is None:
            self._specs = [SourceSpec(name, tuple(t.shape), t.dtype) for name, t in self]
        return list(self._specs)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.bridge.export_hf_weights(self.models, cpu=False, show_progress=False):
            if self.tied and name == TIED_COPY:
                continue
            yield name, tensor if tensor.is_contiguous() else tensor.contiguous()
            del tensor
