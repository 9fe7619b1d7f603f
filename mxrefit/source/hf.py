"""A weight stream from a transformers model, plain or sharded with FSDP2.

``HFSource(model)`` yields ``(hf_name, tensor)`` for every parameter in ``named_parameters()``
order. An FSDP2 parameter is a ``DTensor``: its global shape is known without gathering, so
``specs()`` costs nothing, and the stream gathers it with ``full_tensor()`` one parameter at a
time, dropping its reference before gathering the next. Every rank of the FSDP2 group must
iterate the stream in step (the gathers are collectives); only the rank that sends uses the
tensors.

Names are the model's own. transformers 5 holds Qwen3-MoE's routed experts as grouped slabs
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), which mxrefit
quantizes as they are (per expert along K). ``experts="per_expert"`` yields the checkpoint names
instead (``mlp.experts.{e}.{gate,up,down}_proj.weight``, see ``mxrefit.plan.shapes``) as views of the
slab rows, without copying, for engines whose tables use those names.

Parameters that share storage (tied embeddings, also when two names hold distinct ``Parameter``
objects over one storage) are yielded once, under the first name in ``named_parameters``
order, which is the name ``TorchEngine`` keeps; the others are listed in ``aliases()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mxrefit.plan.build import SourceSpec

EXPERT_LAYOUTS = ("as_is", "per_expert")
_GROUPED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _storage_key(param: torch.Tensor) -> tuple:
    local = param.to_local() if isinstance(param, DTensor) else param
    ptr = local.untyped_storage().data_ptr()
    if ptr == 0:  # empty or meta storage: nothing to share, never an alias
        return ("id", id(param))
    return (local.device, ptr, local.storage_offset(), tuple(local.shape), local.stride())


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter, gathered if sharded, detached and contiguous."""
    with torch.no_grad():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return full if full.is_contiguous() else full.contiguous()


class HFSource:
    """``(hf_name, full tensor)`` from a transformers model, one parameter at a time."""

    def __init__(self, model: nn.Module, *, experts: str = "as_is"):
        if experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
        self.model = model
        self.experts = experts

    def _entries(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
        """Unique parameters in order, and {dropped name: kept name}; read afresh every time,
        since FSDP2 swaps the module's parameter objects between sharded and unsharded."""
        kept: list[tuple[str, torch.Tensor]] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            key = _storage_key(param)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
            kept.append((name, param))
        return kept, aliases

    def aliases(self) -> dict[str, str]:
        """Names not streamed because they share storage with an earlier one: {name: streamed name}."""
        return self._entries()[1]

    def _slab(self, name: str) -> re.Match | None:
        """The grouped expert slab ``name`` is, when experts are split per expert."""
        if self.experts != "per_expert":
            return None
        m = _GROUPED.match(name)
        if m is None:
            return None
        owner = self.model.get_submodule(m["base"])
        if getattr(owner, "is_transposed", False):
            raise ValueError(
                f"{name}: the experts of {m['base']!r} are stored transposed ([E, K, N]); "
                f"per-expert names are defined for the [E, N, K] layout only"
            )
        return m

    def specs(self) -> list[SourceSpec]:
        """Every streamed tensor (name, global shape, dtype) in stream order; nothing is gathered."""
        out: list[SourceSpec] = []
        for name, param in self._entries()[0]:
            shape, dtype = tuple(param.shape), param.dtype
            m = self._slab(name)
            if m is None:
                out.append(SourceSpec(name, shape, dtype))
                continue
            for sub, sub_shape in _per_expert_shapes(name, m, shape):
                out.append(SourceSpec(sub, sub_shape, dtype))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._entries()[0]:
            full = _full(param)
            m = self._slab(name)
            if m is None:
                yield name, full
            else:
                yield from _per_expert_views(name, m, full)
            del full  # before the next gather: at most one parameter is held here


def _per_expert_shapes(name: str, m: re.Match, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    if len(shape) != 3 or (m["proj"] == "gate_up_proj" and shape[1] % 2):
        raise ValueError(f"{name}: a grouped expert slab must be [E, N, K] (gate_up_proj with N = 2I), got {shape}")
    e_n, n, k = shape
    base = m["base"]
    if m["proj"] == "down_proj":
        return [(f"{base}.{e}.down_proj.weight", (n, k)) for e in range(e_n)]
    i_ = n // 2
    return [(f"{base}.{e}.{proj}.weight", (i_, k)) for e in range(e_n) for proj in ("gate_proj", "up_proj")]


def _per_expert_views(name: str, m: re.Match, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named row ranges of a slab: ``gate_up_proj[e]`` rows [0, I) are gate, [I, 2I) up."""
    names = _per_expert_shapes(name, m, tuple(full.shape))
    if m["proj"] == "down_proj":
        views = (full[e] for e in range(full.shape[0]))
    else:
        i_ = full.shape[1] // 2
        views = (half for e in range(full.shape[0]) for half in (full[e, :i_], full[e, i_:]))
    for (sub, _), view in zip(names, views):
        yield sub, view
