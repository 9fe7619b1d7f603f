"""Where vLLM 0.26 to 0.34 differ in what mxrefit touches: one small adapter per difference.

Each adapter detects the feature in the installed vLLM (a signature, an attribute, a member
of a set) and never compares version strings; the version appears only in messages. Read
from the released wheels' source (0.26.0, 0.27.1, 0.32.0, 0.33.0, 0.34.0). What is the same
in all of them (the layerwise-reload helpers the engine calls, ``routed_experts`` naming,
ModelOpt MXFP8 and ``Fp8Config`` parameters, ``register_linear_kernel``,
``worker_extension_cls``, ``collective_rpc``, the parallel-state getters) is checked once at
set-up by ``require_features``, so a vLLM that lacks one is refused by name instead of
half-working.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mxrefit.errors import MxrefitError

# vLLM versions whose suites ran here (CPU 0.27.1 and 0.32.0) or on the H200 (0.26.0). Any
# other vLLM gets its first refit verified against vLLM's own loader (``verify_first_refit``).
TESTED_VLLM = ("0.26.0", "0.27.1", "0.32.0")


class VllmSetupError(MxrefitError, ValueError):
    """The engine and the requested refit cannot work together; raised before any weight moves."""


def vllm_version() -> str:
    """The installed vLLM's version, for messages only."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


# ---- what every supported vLLM has --------------------------------------------------------
# (module, names) the engine uses; the same in 0.26 through 0.34
_REQUIRED = (
    ("vllm.model_executor.model_loader.reload", ("initialize_layerwise_reload", "finalize_layerwise_reload")),
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        ("LAYERWISE_INFO", "get_layerwise_info", "_copy_and_restore_kernel_tensors"),
    ),
    ("vllm.model_executor.model_loader.reload.meta", ("restore_layer_on_meta", "materialize_layer", "SKIP_TENSORS")),
    ("vllm.model_executor.model_loader.reload.utils", ("get_layer_params_buffers",)),
    ("vllm.model_executor.model_loader.reload.types", ("LayerReloadingInfo",)),
    ("vllm.model_executor.layers.quantization.base_config", ("QuantizeMethodBase",)),
    (
        "vllm.distributed.parallel_state",
        ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_world_group"),
    ),
)
_RELOAD_INFO_FIELDS = ("restore_metadata", "kernel_tensors", "kernel_non_persistent_buffers", "loaded_weights")


def require_features() -> str:
    """Every vLLM internal the engine uses is there; otherwise VllmSetupError naming the vLLM
    version, the missing feature and the versions that have it. Returns the version."""
    version = vllm_version()
    missing = []
    for module, names in _REQUIRED:
        try:
            mod = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - a broken vLLM is named, not raised through
            missing.append(f"{module} ({type(err).__name__}: {err})")
            continue
        missing += [f"{module}.{name}" for name in names if not hasattr(mod, name)]
    if not missing:
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        fields = getattr(LayerReloadingInfo, "__dataclass_fields__", {})
        missing += [f"LayerReloadingInfo.{f}" for f in _RELOAD_INFO_FIELDS if f not in fields]
    if missing:
        raise VllmSetupError(
            f"vLLM {version} lacks what mxrefit's vLLM engine refits through: {', '.join(missing)}. "
            f"vLLM 0.26 to 0.34 have it (tested: {', '.join(TESTED_VLLM)}); use one of those"
        )
    return version


def verify_first_refit() -> bool:
    """True on a vLLM outside ``TESTED_VLLM``: its first refit is checked byte for byte against
    vLLM's own loader (``VllmEngine``), since no suite ran on it. This membership test is the
    only use of the version beyond messages, and it adds a check, never a code path."""
    return vllm_version() not in TESTED_VLLM


# ---- weight-transfer API: worker side ------------------------------------------------------
def unimplemented_abstract_methods(cls: type) -> list[str]:
    """Abstract methods a backend class leaves open. 0.26 and 0.27 declare a static
    ``trainer_send_weights`` on the worker engine (0.32 dropped it; mxrefit's class defines it);
    a vLLM that adds another would make the backend uninstantiable, so ``register`` names it
    and registers nothing."""
    return sorted(getattr(cls, "__abstractmethods__", ()))


# ---- weight-transfer API: trainer side -----------------------------------------------------
def trainer_engine_kwargs(base: type, *, config: Any, is_sender: bool, rank: int) -> dict[str, Any]:
    """Constructor arguments of vLLM's ``TrainerWeightTransferEngine`` besides client and source.

    0.26: ``__init__(config, *, client, source, is_sender)`` (and its factory passes
    ``config=`` to ``trainer_init``); 0.27-0.32: ``(*, client, source, is_sender)``; 0.33/0.34
    add ``rank=0``. A required parameter mxrefit does not know is refused by name.
    """
    known = {"config": config, "is_sender": is_sender, "rank": rank}
    params = inspect.signature(base.__init__).parameters  # type: ignore[misc]  # the class's own __init__, on purpose
    out = {}
    for name, p in params.items():
        if name in ("self", "client", "source") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in known:
            out[name] = known[name]
        elif p.default is p.empty:
            raise VllmSetupError(
                f"vLLM {vllm_version()}'s TrainerWeightTransferEngine needs '{name}', which mxrefit does not know "
                f"(0.26 to 0.34 take config/is_sender/rank); the worker extension path (RefitWorkerExtension) "
                f"does not use this class"
            )
    return out


def source_metadata(source: Any) -> list:
    """A ``WeightSource``'s parameter list: a method in 0.26-0.32, a ``cached_property`` in
    0.33/0.34 (reading it returns the list)."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A ``WeightSource``'s full tensors: ``iter(source)`` in 0.26-0.32; 0.33/0.34 drop
    ``__iter__`` for ``iter_full()`` (whole tensors) and ``iter_local()`` (this rank's pieces,
    which mxrefit's plan does not take)."""
    implements = getattr(source, "implements_iter_full", None)
    if implements is None:
        return iter(source)
    if not implements():
        raise VllmSetupError(
            f"{type(source).__name__} yields only local pieces (iter_local); mxrefit's trainer engine sends whole "
            f"tensors: give the source an iter_full (vLLM {vllm_version()}'s ModuleSource has one)"
        )
    return source.iter_full()


def finish_weight_update(llm: Any, weight_version: str | None) -> None:
    """``LLM.finish_weight_update``: 0.26 takes no argument; 0.27+ take ``weight_version`` and
    record it. A version asked of a vLLM that cannot record it is refused, not dropped."""
    if "weight_version" in inspect.signature(llm.finish_weight_update).parameters:
        llm.finish_weight_update(weight_version)
    elif weight_version is None:
        llm.finish_weight_update()
    else:
        raise VllmSetupError(
            f"vLLM {vllm_version()}'s LLM.finish_weight_update records no weight_version (0.27 and later do); call it without one"
        )


# ---- layerwise reload ----------------------------------------------------------------------
def unstaged_meta_tensors(module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> list[str]:
    """Tensors of ``module`` that ``restore_layer_on_meta`` sends to meta and no staged tensor
    refills: ``materialize_layer`` returns them uninitialised. 0.26's ``SKIP_TENSORS`` lacks
    ``bias`` (0.27+ keep the bias off meta), so there a bias no trainer tensor feeds (an
    aliasing module's) must be refilled from the kernel tensor it had."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    if "bias" in SKIP_TENSORS or "bias" in staged:
        return []
    return ["bias"] if isinstance(getattr(module, "bias", None), torch.Tensor) else []


def module_post_load_hooks(model: torch.nn.Module, refitted: set[torch.nn.Module]) -> list[Callable[[], None]]:
    """The module-level post-load hooks a refit of ``refitted`` must re-run, children first.

    0.34's ``finalize_layerwise_reload`` ends in ``weight_utils.finalize_model_weights``: every
    module that is not a quantization method nor inside a quantized layer runs its own
    no-argument ``process_weights_after_loading`` (e.g. ``MoERunner`` refills its fused
    router + shared-expert gate in place). mxrefit processes modules itself, so it re-runs the
    hooks of the refitted modules and of their ancestors. 0.26-0.33 have no such step.
    """
    try:
        from vllm.model_executor.model_loader.weight_utils import finalize_model_weights  # noqa: F401
    except ImportError:
        return []
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    hooks: list[Callable[[], None]] = []
    seen: set[torch.nn.Module] = set()

    def walk(module: torch.nn.Module) -> bool:
        """True when ``module`` or a module below it is refitted; a shared module runs once."""
        quantized = isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        touched = module in refitted
        for child in [] if quantized else module.children():
            if child not in seen:
                seen.add(child)
                touched = walk(child) or touched
        hook = getattr(module, "process_weights_after_loading", None)
        if touched and callable(hook) and not isinstance(module, QuantizeMethodBase):
            hooks.append(hook)
        return touched

    walk(model)
    return hooks


def replays_expert_post_load(quant_method: Any, built_before: bool) -> bool:
    """Whether a reload must replay an unquantized MoE's experts' own post-load step.

    0.32-0.34's ``UnquantizedFusedMoEMethod._setup_kernel`` runs
    ``moe_kernel.fused_experts.process_weights_after_loading`` (CPU: pad and prepack into the
    grouped-GEMM layout) only when it first builds the kernel, so a reload leaves the experts
    unpacked and the CPU kernel computes garbage; mxrefit replays it. 0.26/0.27's method has no
    such step (its CPU path prepacks on every call): replaying there would run a step the first
    load never ran. ``built_before``: the kernel existed before this processing.
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return (
        built_before and isinstance(quant_method, UnquantizedFusedMoEMethod) and _setup_runs_expert_post_load(type(quant_method))  # type: ignore[arg-type]  # classes hash; typeshed's type[Any] does not say so
    )


@functools.cache
def _setup_runs_expert_post_load(cls: type) -> bool:
    setup = getattr(cls, "_setup_kernel", None)
    return setup is not None and "fused_experts.process_weights_after_loading" in inspect.getsource(setup)
