"""vLLM's live model as an mxrefit ``Engine``: tables once, staging, vLLM's own post-load processing.

Inside a vLLM worker, ``VllmEngine`` describes the live model as mxrefit tables, built once:
HF tensor names (per-expert or grouped experts) routed to vLLM's fused checkpoint-format
parameters (``mxrefit/integrations/vllm/layout.py``), with shapes and dtypes checked against the
checkpoint-format metadata vLLM records when it builds the model, and the quantized format
read from it too: ModelOpt MXFP8 (``weight`` + uint8 ``weight_scale``) or ``Fp8Config`` block
FP8 (``weight`` + float32 ``weight_scale_inv``, 128x128 tiles). Every refit lands in a
staging pool (``mxrefit/engine/staging.py``; only the layers in flight hold memory), and each
layer, once its bytes are complete, goes through vLLM's own post-load processing — the
same steps as vLLM's layerwise reload (materialize the checkpoint-format layer, run
``process_weights_after_loading``, copy the result into the kernel tensors in place, so
captured graphs stay valid) — minus the per-tensor weight loaders: the fused parameters
arrive whole. Whatever the backend does after loading (Marlin repack on Hopper, FlashInfer
shuffles on Blackwell, MXFP8 emulation or GEMM prepacking on CPU) therefore runs on fresh
checkpoint bytes every refit, and no stale swizzled copy can survive. Modules that alias a
refitted parameter (a tied ``lm_head``) are re-processed with it.

Architectures the tables do not know, or whose live parameters disagree with them, take
vLLM's own loader (``model.load_weights`` inside its layerwise reload) from checkpoint-named
staging, with a warning naming the parameters on that slow path.

On FlashInfer's TRT-LLM MXFP8 MoE backend (Blackwell), MoE layers skip vLLM's three-gather
shuffle: the tables advertise the kernel layout (grouped expert slabs and per-expert
down_proj on their own bytes, per-expert gate/up as the two row ranges of their expert's
shared w13 region) and the trainer's quantize kernel writes it, so the layer's processing is
a copy from staging into the live params; where the sources allow neither, the folded
one-pass layout of ``mxrefit/integrations/vllm/trtllm.py`` runs.
With ``MXREFIT_VERIFY=1`` the first refit also runs vLLM's own processing on the checkpoint
bytes and compares.

vLLM 0.26 to 0.34 differ in some of what this module touches; ``mxrefit/integrations/vllm/compat.py`` holds
one adapter per difference, chosen by feature detection (docs/vllm.md §4).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mxrefit.devices import resolve
from mxrefit.engine.base import Engine
from mxrefit.engine.probed_layout import (
    IdentityVerdict,
    LayoutCache,
    ProbedLayout,
    learn_identity,
    learned_layout_mode,
    tensor_signature,
)
from mxrefit.engine.staging import StagedUnit, StagingPool
from mxrefit.formats import get_format
from mxrefit.formats.block_permutation import BlockPermutation
from mxrefit.formats.kernel_layout import KernelLayout, read_reference
from mxrefit.integrations.vllm.compat import (
    TESTED_VLLM,
    VllmSetupError,
    module_post_load_hooks,
    replays_expert_post_load,
    require_features,
    unstaged_meta_tensors,
    verify_first_refit,
    vllm_version,
)
from mxrefit.integrations.vllm.layout import (
    MXFP8_LAYOUT,
    QUANT_LAYOUTS,
    QuantLayout,
    quantized_param_names,
    scale_param,
    vllm_destinations,
    vllm_params,
    vllm_shards,
)
from mxrefit.integrations.vllm.trtllm import MoeLayout, check_moe_alignment, moe_direct_targets, moe_row_order
from mxrefit.plan.build import SourceSpec, build_plan
from mxrefit.plan.shapes import EXPERT_LAYOUTS, ModelShape
from mxrefit.plan.types import Destination, ParamSpec, Shard, Target
from mxrefit.transport.bytesum import tensor_sha256

log = logging.getLogger("mxrefit.vllm")

BACKEND = "mxrefit"  # the weight-transfer backend's name: WeightTransferConfig(backend="mxrefit")
PROBE_UNQUANTIZED_BYTES = 64 << 20  # the largest unquantized linear whose processing is probed (CUDA, learned layouts)
_NOT_WEIGHTS = ("Attention", "MLAAttention", "RotaryEmbedding")  # modules whose params no trainer tensor feeds


# ---- the live model as tables -------------------------------------------------------------
def checkpoint_specs(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """Every weight parameter as the checkpoint holds it: {name: (shape, dtype, module type)}.

    Read from the metadata vLLM recorded before loading (``record_metadata_for_reloading``),
    not from the live tensors, which post-load processing may have repacked.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = {}
    for mname, module in model.named_modules():
        kind = type(module).__name__
        info = LAYERWISE_INFO.get(module)
        params = info.restore_metadata[0] if info is not None else dict(module.named_parameters(recurse=False))
        for attr, t in params.items():
            name = f"{mname}.{attr}" if mname else attr
            out[name] = (tuple(t.shape), t.dtype, kind)
    return out


FP8_BLOCK_FORMATS = ("fp8-block", "fp8-block-ue8m0")


def _quant_layouts(fp8_block: str) -> tuple[QuantLayout, ...]:
    """The quantized layouts an engine may hold; ``fp8_block`` picks the wire format of block FP8."""
    if fp8_block not in FP8_BLOCK_FORMATS:
        raise VllmSetupError(f"fp8_block must be one of {FP8_BLOCK_FORMATS}, got {fp8_block!r}")
    return MXFP8_LAYOUT, QUANT_LAYOUTS[fp8_block]


def _checkpoint_targets(dests: dict[str, Destination], layouts: tuple[QuantLayout, ...]) -> dict[str, list[tuple[str, Target]]]:
    """{engine param: [(checkpoint tensor name, its target)]}: a quantized destination's second
    target is its scale, named as the checkpoint names it (``x.weight_scale`` / ``_scale_inv``)."""
    by_format = {layout.format: layout for layout in layouts}
    out: dict[str, list[tuple[str, Target]]] = {}
    for name, dest in dests.items():
        for i, t in enumerate(dest.targets):
            out.setdefault(t.param, []).append((name if i == 0 else by_format[dest.format].scale_param(name), t))
    return out


def _scale_pairs(specs: dict, candidates: Iterable[str], layouts: tuple[QuantLayout, ...]) -> dict[str, tuple[QuantLayout, str]]:
    """{values name: (layout, scale name)} for every E4M3 candidate whose sibling scale has a
    layout's suffix and dtype (uint8 ``_scale``: MXFP8; float32 ``_scale_inv``: FP8-block).
    ``specs`` maps names to tuples whose first two items are shape and dtype."""
    out = {}
    for name in candidates:
        if name not in specs or specs[name][1] != torch.float8_e4m3fn:
            continue
        for layout in layouts:
            scale = specs.get(layout.scale_param(name))
            if scale is not None and scale[1] == layout.scale_dtype:
                out[name] = (layout, layout.scale_param(name))
    return out


def _fast_tables(
    shape: ModelShape, live: dict, experts: str, fp8_block: str = "fp8-block"
) -> tuple[dict[str, ParamSpec], dict[str, Destination], list[str]]:
    """Tables from the known layout, checked against the live checkpoint-format params.

    The format is read from the live params too: E4M3 linear weights with uint8 ``_scale``
    are MXFP8, with float32 ``_scale_inv`` FP8-block (sent as ``fp8_block``).
    """
    pairs = _scale_pairs(live, quantized_param_names(shape), _quant_layouts(fp8_block))
    formats = sorted({layout.format for layout, _ in pairs.values()})
    if len(formats) > 1:
        return {}, {}, [f"{shape.name}: the live model mixes quantized formats {formats}"]
    fmt = formats[0] if formats else "bf16"
    quantized = list(pairs) if pairs else None
    params = vllm_params(shape, fmt=fmt, quantized=quantized)
    dests = vllm_destinations(shape, fmt=fmt, experts=experts, quantized=quantized)
    problems = []
    for name, spec in params.items():
        got = live.get(name)
        if got is None:
            problems.append(f"{name}: in mxrefit's table but not in the live model")
        elif got[0] != spec.shape or got[1] != spec.dtype:
            problems.append(f"{name}: table says {spec.shape} {spec.dtype}, the live model holds {got[0]} {got[1]}")
    for name, (_, _, kind) in live.items():
        if name not in params and kind not in _NOT_WEIGHTS:
            problems.append(f"{name}: a {kind} parameter the table does not know")
    return params, dests, problems


@dataclass(frozen=True)
class TensorParallelRank:
    """Where this worker sits in vLLM's tensor parallelism (experts split whole over the ranks
    with ``expert_parallel``)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False


def tensor_parallel_rank(vllm_config: Any) -> TensorParallelRank:
    """This worker's rank, read from vLLM's parallel state; layouts mxrefit does not model are refused."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise VllmSetupError(
            f"this vLLM runs with pipeline parallel size {parallel.pipeline_parallel_size}; mxrefit's vLLM engine "
            f"needs every worker to hold all layers (PP=1)"
        )
    if parallel.tensor_parallel_size == 1:
        return TensorParallelRank()
    # vLLM flattens MoE tensor parallelism across data and prefill-context parallel ranks
    # (FusedMoEParallelConfig.make), and EPLB or round-robin placement move experts: the
    # slices would no longer be the ones vllm_shards gives
    unmodelled = {
        "data_parallel_size": parallel.data_parallel_size,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
    }
    unmodelled = {k: v for k, v in unmodelled.items() if v != 1}
    if parallel.enable_expert_parallel and parallel.enable_eplb:
        unmodelled["enable_eplb"] = True
    if parallel.enable_expert_parallel and parallel.expert_placement_strategy != "linear":
        unmodelled["expert_placement_strategy"] = parallel.expert_placement_strategy
    if unmodelled:
        raise VllmSetupError(
            f"this vLLM runs tensor parallel size {parallel.tensor_parallel_size} with {unmodelled}; mxrefit models "
            f"tensor parallelism alone, with or without expert parallelism in vLLM's default linear placement"
        )
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    if size != parallel.tensor_parallel_size:
        raise VllmSetupError(f"vLLM's tensor-parallel group has {size} ranks, its config says {parallel.tensor_parallel_size}")
    return TensorParallelRank(get_tensor_model_parallel_rank(), size, bool(parallel.enable_expert_parallel))


def _sharded_tables(
    shape: ModelShape, live: dict, experts: str, tp: TensorParallelRank
) -> tuple[dict[str, ParamSpec], dict[str, Destination], dict[str, Shard], list[str]]:
    """Whole-model tables and this rank's slices, checked against the rank's own checkpoint-format
    params (vLLM records them per rank): every param must be exactly its slice of the whole."""
    pairs = _scale_pairs(live, quantized_param_names(shape), _quant_layouts("fp8-block"))
    sliceless = sorted({layout.format for layout, _ in pairs.values()} - {MXFP8_LAYOUT.format})
    if sliceless:
        return (
            {},
            {},
            {},
            [
                f"{shape.name}: the rank holds {sliceless[0]} weights, whose tensor-parallel slices are not "
                f"modelled (only bf16 and mxfp8 weights can be held in slices)"
            ],
        )
    quantized = list(pairs) or None
    mx = quantized is not None
    params = vllm_params(shape, mxfp8=mx, quantized=quantized)
    dests = vllm_destinations(shape, mxfp8=mx, experts=experts, quantized=quantized)
    shards = vllm_shards(
        shape, mxfp8=mx, tp_rank=tp.rank, tp_size=tp.size, expert_parallel=tp.expert_parallel, quantized=quantized
    )
    problems = []
    for name, spec in params.items():
        want = shards[name].local_shape(spec.shape) if name in shards else spec.shape
        got = live.get(name)
        if got is None:
            problems.append(f"{name}: in mxrefit's table but not in the live model")
        elif got[0] != want or got[1] != spec.dtype:
            problems.append(
                f"{name}: the rank holds {got[0]} {got[1]}, mxrefit expects {want} {spec.dtype} "
                f"(its slice of the whole {spec.shape})"
            )
    for name, (_, _, kind) in live.items():
        if name not in params and kind not in _NOT_WEIGHTS:
            problems.append(f"{name}: a {kind} parameter the table does not know")
    return params, dests, shards, problems


def _manifest(model_path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of the checkpoint's tensors (safetensors headers; no data read)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise VllmSetupError(f"{model_path}: no safetensors files to learn the checkpoint's tensor names from")
    out = {}
    for f in files:
        with safe_open(os.path.join(model_path, f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()])
    return out


_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def _fallback_tables(manifest: dict, fp8_block: str = "fp8-block") -> tuple[dict[str, ParamSpec], dict[str, Destination]]:
    """One staging param per checkpoint tensor, named as the checkpoint names it; quantized
    pairs become one destination: ``x.weight`` fp8 + ``x.weight_scale`` uint8 (MXFP8) or
    + ``x.weight_scale_inv`` float32 (FP8-block, sent as ``fp8_block``)."""
    params = {name: ParamSpec(name, shape, dtype) for name, (shape, dtype) in manifest.items()}
    pairs = _scale_pairs(manifest, manifest, _quant_layouts(fp8_block))
    scales = {scale for _, scale in pairs.values()}
    dests = {}
    for name, (shape, dtype) in manifest.items():
        if name in scales:
            continue
        if name in pairs:
            layout, scale = pairs[name]
            dests[name] = Destination(
                name,
                layout.format,
                (Target(name, 0, shape, layout.value_dtype), Target(scale, 0, manifest[scale][0], layout.scale_dtype)),
            )
        else:
            dests[name] = Destination(name, "bf16", (Target(name, 0, shape, dtype),))
    return params, dests


# ---- processing one vLLM module -----------------------------------------------------------
def _param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """The module's own parameter ``name`` (KeyError if it has none)."""
    p = module._parameters[name]
    if p is None:
        raise KeyError(f"{type(module).__name__} has no parameter {name!r}")
    return p


def _quant_method(module: torch.nn.Module) -> Any:
    """A vLLM layer's quant method (vLLM is typed as Any here: its classes vary by release)."""
    return getattr(module, "quant_method")


def _process_with_vllm(module: torch.nn.Module, staged: dict[str, torch.Tensor], rebind: bool = False) -> None:
    """vLLM's layerwise reload for one module, fed whole checkpoint-format params instead of loaders.

    ``rebind``: objects the processing built (a MoE kernel, its quant config) hold the new
    parameters it made, which the reload then copies into the kernel tensors; point those
    references at the kernel tensors, so that writing the kernel tensors alone (a learned layout)
    is what every later forward reads."""
    from vllm.model_executor.model_loader.reload.layerwise import _copy_and_restore_kernel_tensors, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    info = get_layerwise_info(module)
    info.kernel_tensors = get_layer_params_buffers(module)
    info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    kernel_params, kernel_buffers = info.kernel_tensors
    for attr in unstaged_meta_tensors(module, staged):
        getattr(module, attr).data.copy_({**kernel_buffers, **kernel_params}[attr])
    for attr, t in staged.items():
        getattr(module, attr).data.copy_(t)
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    qm = _quant_method(module)
    built_before = getattr(qm, "moe_kernel", None) is not None
    plain = _plain_kernel_tensors(module)
    qm.process_weights_after_loading(module)
    if replays_expert_post_load(qm, built_before):
        qm.moe_kernel.fused_experts.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        getattr(module, "update_param_tp_status")()
    info.loaded_weights = [(attr, None) for attr in staged]
    made = {n: t for n, t in module._parameters.items() if t is not None}
    _copy_and_restore_kernel_tensors(module, info)
    info.reset()
    _keep_plain_kernel_tensors(module, plain)
    if rebind:
        kept = {n: t for n, t in module._parameters.items() if t is not None}
        _rebind(
            module,
            {
                id(t): kept[n]
                for n, t in made.items()
                if n in kept
                and kept[n] is not t
                and (t.shape, t.dtype, t.device) == (kept[n].shape, kept[n].dtype, kept[n].device)
            },
        )


def _vllm_objects(module: torch.nn.Module, depth: int = 8) -> Iterator[tuple[tuple[str, ...], Any, str, Any]]:
    """(path, owner, attribute, value) for every attribute of the module (its parameters, buffers
    and submodules aside) and of the vLLM objects it reaches (quant method, kernels, quant
    configs), ``path`` being the attribute names from the module to ``owner``."""
    seen: set[int] = set()

    def visit(owner: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, str, Any]]:
        if id(owner) in seen or len(path) > depth:
            return
        seen.add(id(owner))
        for attr, value in list(vars(owner).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            yield path, owner, attr, value
            if (
                hasattr(value, "__dict__")
                and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
                and type(value).__module__.startswith("vllm.")
            ):
                yield from visit(value, (*path, attr))

    yield from visit(module, ())


def _rebind(module: torch.nn.Module, to: dict[int, torch.Tensor]) -> None:
    for _, owner, attr, value in _vllm_objects(module):
        if isinstance(value, torch.Tensor) and id(value) in to:
            object.__setattr__(owner, attr, to[id(value)])


def _state_beside_params(module: torch.nn.Module, written: Iterable[str]) -> dict[str, torch.Tensor]:
    """Tensors the module's kernels reach besides the parameters a learned layout writes (other
    parameters and buffers, Marlin's workspace, tensors of the quant method's objects): a learned
    layout leaves them as they are, so they must not depend on the weights."""
    written = set(written)
    spans = [
        (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
        for n, p in module._parameters.items()
        if n in written and p is not None
    ]
    others = [((), module, n, t) for n, t in (*module._parameters.items(), *module._buffers.items()) if n not in written]
    out = {}
    for _, owner, attr, value in (*others, *_vllm_objects(module)):
        if isinstance(value, torch.Tensor) and value.numel():
            ptr = value.untyped_storage().data_ptr()
            if not any(start <= ptr < start + size for start, size in spans):
                out[f"{type(owner).__name__}.{attr}@{id(value):x}"] = value
    return out


def _cpu_kernel_digest(module: torch.nn.Module) -> str:
    """sha256 of ``_cpu_kernel_output``; a kernel that cannot run on the probe is named instead
    (a check must not fail the refit it checks)."""
    try:
        return tensor_sha256(_cpu_kernel_output(module))
    except Exception as e:  # noqa: BLE001 - any kernel error: report it, the refit goes on
        log.warning("mxrefit: kernel_state could not run %s's CPU kernel on its probe: %s", type(module).__name__, e)
        return f"not run: {type(e).__name__}: {e}"


@torch.no_grad()
def _cpu_kernel_output(module: torch.nn.Module) -> torch.Tensor:
    """The output of a CPU-dispatched linear's own kernel (``module.cpu_linear``, set by vLLM's
    CPU GEMM dispatch) on a fixed input: what the kernel computes from whatever copy it holds."""
    weight: torch.Tensor = getattr(module, "weight")
    kernel: Callable[..., torch.Tensor] = getattr(module, "cpu_linear")
    sizes = (getattr(module, a, None) for a in ("input_size_per_partition", "input_size", "embedding_dim"))
    features = next((int(v) for v in sizes if v), weight.shape[-1])
    probe = torch.randn(4, features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    return kernel(probe, weight, getattr(module, "bias", None))


def _plain_kernel_tensors(module: torch.nn.Module) -> dict[tuple[str, ...], torch.Tensor]:
    """Tensors post-load processing holds as plain attributes (not parameters or buffers, which
    the reload copies back in place) of the module, its quant method and the vLLM objects they
    hold, by attribute path from the module: Marlin's ``layer.workspace`` (MXFP8/FP8 linear and
    MoE), Humming's ``kernel.locks`` (linear, and its MoE experts'). Processing allocates them
    anew, sometimes with their owner; a CUDA graph captured before a refit still reads the old ones."""
    return {
        (*path, attr): value
        for path, _, attr, value in _vllm_objects(module, depth=3)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    }


def _keep_plain_kernel_tensors(module: torch.nn.Module, before: dict[tuple[str, ...], torch.Tensor]) -> None:
    """Put back every plain kernel tensor processing replaced, refilled with the new contents, so
    its address (and any graph that captured it) survives the refit. One that changed shape,
    dtype or device cannot be kept: named in a warning (re-capture graphs after such a refit)."""
    moved = []
    for path, old in before.items():
        owner: Any = module
        for attr in path[:-1]:
            owner = getattr(owner, attr, None)
        new = getattr(owner, path[-1], None)
        if new is old or not isinstance(new, torch.Tensor):
            continue
        if (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device):
            old.copy_(new)
            setattr(owner, path[-1], old)
        else:
            moved.append(".".join(path))
    if moved:
        log.warning(
            "mxrefit: vLLM's post-load processing re-allocated %s of %s in another shape; a CUDA graph "
            "captured before this refit reads the old tensor",
            ", ".join(moved),
            type(module).__name__,
        )


@contextlib.contextmanager
def _kept_in_place(model: torch.nn.Module) -> Iterator[None]:
    """Every parameter, buffer and plain kernel tensor of ``model`` keeps its tensor (and address)
    through the block, refilled with what the block left there. vLLM's own reload copies
    processed layers back in place, but what runs around it does not always (attention's CPU
    scale copies, the CPU experts' prepack, which ``replace_parameter``s)."""
    before = [(m, dict(m._parameters), dict(m._buffers), _plain_kernel_tensors(m)) for m in model.modules()]
    yield
    moved = []
    for module, params, buffers, plain in before:
        # Any: a module's parameter and buffer dicts, one loop for both
        stores: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ((module._parameters, params), (module._buffers, buffers))
        for store, old_items in stores:
            for name, old in old_items.items():
                new = store.get(name)
                if old is None or new is None or new is old:
                    continue
                if (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device):
                    old.data.copy_(new.data)
                    store[name] = old
                else:
                    moved.append(f"{type(module).__name__}.{name}")
        _keep_plain_kernel_tensors(module, plain)
    if moved:
        log.warning(
            "mxrefit: vLLM's loader re-allocated %s in another shape; a CUDA graph captured before reads the old tensor",
            ", ".join(moved),
        )


def _needs_vllm_processing(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)


def _quantized(module: torch.nn.Module) -> bool:
    return _needs_vllm_processing(module) and not type(module.quant_method).__name__.startswith("Unquantized")


def _unquantized_linear(module: torch.nn.Module) -> bool:
    """An unquantized linear (vLLM's processing of it on CUDA keeps the loaded bytes)."""
    return type(getattr(module, "quant_method", None)).__name__ == "UnquantizedLinearMethod"


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _marlin_mxfp8(module: torch.nn.Module) -> bool:
    """True for a ModelOpt MXFP8 linear on ``MarlinMxfp8LinearKernel`` or MoE on the Marlin
    backend (Hopper): processing that is a pure byte permutation (``engine/probed_layout.py``)."""
    qm = getattr(module, "quant_method", None)
    kind = type(qm).__name__
    if kind == "ModelOptMxFp8LinearMethod":
        return "Marlin" in type(getattr(qm, "kernel", None)).__name__
    if kind == "ModelOptMxFp8FusedMoE":
        backend = getattr(qm, "mxfp8_backend", None)
        return str(getattr(backend, "name", backend)).upper() == "MARLIN"
    return False


def _kernel_tensors(module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's live tensors of the staged attributes (what its processing writes)."""
    return {a: _param(module, a).data for a in staged}


def _apply_written(
    layout: ProbedLayout, staged: dict[str, torch.Tensor], kernel: dict[str, torch.Tensor], written: set[str]
) -> None:
    """The learned gathers, where the trainer wrote a staged tensor in its kernel's order a plain copy."""
    for attr, g in layout.gathers.items():
        if g.source in written:
            kernel[attr].reshape(-1).view(torch.uint8).copy_(staged[g.source].reshape(-1).view(torch.uint8))
        else:
            g(staged[g.source], kernel[attr])


def _processing_key(module: torch.nn.Module, staged: dict[str, torch.Tensor], *backend: object) -> tuple:
    """What a module's processing depends on besides its bytes, for caching what was learned of it:
    the module and quant-method classes, the caller's ``backend`` parts, the default dtype (scales
    pass through it) and the staged and kernel tensors' signatures."""
    return (
        type(module),
        type(module.quant_method),
        *backend,
        torch.get_default_dtype(),
        tensor_signature(staged),
        tensor_signature(_kernel_tensors(module, staged)),
    )


def _described(module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> str:
    """The quant method and staged shapes, as ``learned_layouts`` and the logs name a signature."""
    return f"{type(module.quant_method).__name__} {' '.join(f'{a}{list(t.shape)}' for a, t in staged.items())}"


def _triton_unquantized_experts(module: torch.nn.Module) -> bool:
    """Unquantized MoE experts on the Triton backend of CUDA (not ROCm, which pads them): the one
    unquantized MoE processing read to be a copy at most (vLLM 0.26, ``convert_to_unquantized_kernel_format``)."""
    qm = getattr(module, "quant_method", None)
    backend = getattr(qm, "unquantized_backend", None)
    return (
        type(qm).__name__ == "UnquantizedFusedMoEMethod"
        and str(getattr(backend, "name", backend)).upper() == "TRITON"
        and torch.version.hip is None
    )


def _trtllm_moe(module: torch.nn.Module) -> bool:
    """True for an MXFP8 MoE layer on FlashInfer's TRT-LLM backend (Blackwell)."""
    qm = getattr(module, "quant_method", None)
    backend = getattr(qm, "mxfp8_backend", None)
    return backend is not None and "TRTLLM" in str(getattr(backend, "name", backend)).upper()


@dataclass
class _ModuleUnit:
    name: str
    module: torch.nn.Module
    attrs: dict[str, str]  # attr -> engine param name
    aliases: list[tuple[torch.nn.Module, str, str]]  # (module sharing a param, its attr, our attr)


class VllmEngine(Engine):
    """The live vLLM model of one worker as an mxrefit engine.

    A tensor-parallel rank (TP > 1, PP = 1) describes the WHOLE model — the same tables on
    every rank, so the ranks share one plan — and gives its slices in ``shards()``; it stages
    and processes only its own slices. It is refitted over the broadcast transport
    (``mxrefit.source.broadcast_sender.BroadcastSender``), never by direct writes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: Any,
        device: torch.device | str,
        *,
        experts: str = "per_expert",
        fp8_block: str = "fp8-block",
        verify: bool | None = None,
    ):
        """``fp8_block`` is the wire format when vLLM holds block FP8 (``Fp8Config``): "fp8-block"
        (float32 ``amax / 448`` scales, the checkpoint convention) or "fp8-block-ue8m0"
        (power-of-two scales, what vLLM's DeepGEMM path re-quantizes every weight to after
        loading: one rounding instead of two). MXFP8 and BF16 engines ignore it. ``verify``: check
        the first refit against vLLM's own loader (``_check_against_vllm_loader``); by default on
        with ``MXREFIT_VERIFY=1`` or on a vLLM outside ``TESTED_VLLM``."""
        require_features()
        if experts not in EXPERT_LAYOUTS:
            raise VllmSetupError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
        _quant_layouts(fp8_block)
        self.tp = tensor_parallel_rank(vllm_config)
        self.model = model
        self.model_config = vllm_config.model_config
        self._device = resolve(device)
        if verify is None:
            verify = os.environ.get("MXREFIT_VERIFY") == "1" or verify_first_refit()
        self.verify = verify
        self._verified = False
        # MXREFIT_PROFILE=1: each module's post-load processing timed (a device sync around each), summed
        # per module and quant-method class in ``process_by_kind``: where a refit's processing goes
        self._profile = os.environ.get("MXREFIT_PROFILE") == "1"
        self.process_by_kind: dict[str, float] = {}
        # MXREFIT_LEARNED_LAYOUT (``learned_layout_mode``; on CUDA "1" unless set): Marlin MXFP8 modules take a
        # byte gather learned from vLLM's own processing (engine/probed_layout.py) instead of re-running it; "0"
        # keeps vLLM's processing every refit. "quantized": every quantized module is probed (the probe's
        # checks guard each signature, but state a kernel keeps outside tensors, a oneDNN handle say, is
        # invisible to them): for tests and kernels known to keep none. On CUDA, unquantized linears of up
        # to PROBE_UNQUANTIZED_BYTES are probed too: vLLM's processing of them there leaves the bytes as
        # loaded (a learned identity: a plain copy instead of vLLM's reload of the module, 0.3-0.5 ms each
        # on the H200); on CPU never (the CPU build prepacks them into oneDNN state no probe sees). Not
        # probed: larger ones, embeddings and unquantized MoE experts, since a probe holds ~18 bytes of
        # scratch per byte of the module (int64 codes and sums) beside a full engine (5 GB for a 30B
        # model's embedding), and vLLM's reload of those is rare.
        # Unquantized MoE experts on CUDA's Triton backend, whose processing is a copy at most, are
        # checked instead on their first real refit (``learn_identity``) and then copied plainly.
        learned = learned_layout_mode(self._device.type)
        self._layouts = LayoutCache() if learned in ("1", "quantized") else None
        self._learn_quantized = learned == "quantized"
        self._learn_unquantized = self._device.type == "cuda"
        self._identities: dict[tuple, IdentityVerdict] = {}  # per expert signature, once decided
        self.learned_layouts: dict[str, str] = {}  # per signature: "learned (...)" or "refused: why"
        # the trainer writes the learned Marlin orders itself (``_advertise_orders``) unless MXREFIT_WRITE_ORDER=0
        self._write_orders = self._layouts is not None and os.environ.get("MXREFIT_WRITE_ORDER", "1") != "0"
        self._module_keys: dict[str, tuple] = {}  # module name -> its processing key, once learned
        self._orders: dict[tuple, dict[str, BlockPermutation]] = {}  # per key: staged value attr -> its order
        self._advertised: set[tuple] = set()  # keys whose orders the tables carry
        self._tables_version = 0
        self._written: dict[str, KernelLayout] = {}  # params the adopted plan writes in a learned order
        self._checkpoint_targets: dict[str, list[tuple[str, Target]]] = {}
        self._checkpoint: dict[str, torch.Tensor] | None = None
        self._refused: str | None = None
        live = checkpoint_specs(model)
        self._shards: dict[str, Shard] = {}
        if self.tp.size > 1:
            self._init_rank(live, experts)
            if self.verify:
                log.warning(
                    "mxrefit: vLLM %s, tensor-parallel rank %d: the check against vLLM's own loader runs at "
                    "TP = 1 only (it needs whole checkpoint tensors); this rank is not checked",
                    vllm_version(),
                    self.tp.rank,
                )
            return
        self.slow_path: list[str] = []
        try:
            shape = ModelShape.from_hf_config(
                self.model_config.hf_config, name=str(self.model_config.model), dtype=self.model_config.dtype
            )
            params, dests, problems = _fast_tables(shape, live, experts, fp8_block)
        except ValueError as err:
            problems = [str(err)]
        if problems:
            params, dests = _fallback_tables(_manifest(self.model_config.model), fp8_block)
            self.slow_path = list(params)
            log.warning(
                "mxrefit: %d parameters take vLLM's own loader (slow path): %s%s. Why: %s",
                len(params),
                ", ".join(list(params)[:20]),
                " ..." if len(params) > 20 else "",
                "; ".join(problems[:5]),
            )
        self._params = params
        self._destinations = dests
        self._trtllm_laid_out: dict[str, KernelLayout] = {} if self.slow_path else self._advertise_trtllm_layouts()
        self._laid_out = dict(self._trtllm_laid_out)
        self.units = self._units(live)
        self.pool = StagingPool(params, self.units, self._device)
        self._post_load_hooks = self._hooks()
        if self.verify and not self.slow_path:
            # checkpoint names (per expert) of every byte range, to feed vLLM's own loader
            self._checkpoint_targets = _checkpoint_targets(
                _fast_tables(shape, live, "per_expert", fp8_block)[1], _quant_layouts(fp8_block)
            )

    def _init_rank(self, live: dict, experts: str) -> None:
        """A tensor-parallel rank: whole-model tables, its own slices, staging in local shapes.

        No slow path here: vLLM's loader would need every whole checkpoint tensor staged on
        every rank. Any disagreement between the rank's checkpoint-format params and its
        slices of the tables (an architecture the tables do not know, a tensor-parallel
        layout mxrefit does not model) is refused before any weight moves.
        """
        tp = self.tp
        where = f"tensor-parallel rank {tp.rank} of {tp.size}{' (expert parallel)' if tp.expert_parallel else ''}"
        try:
            shape = ModelShape.from_hf_config(
                self.model_config.hf_config, name=str(self.model_config.model), dtype=self.model_config.dtype
            )
            params, dests, shards, problems = _sharded_tables(shape, live, experts, tp)
        except ValueError as err:
            problems = [str(err)]
        if problems:
            raise VllmSetupError(
                f"{where}: mxrefit's slices of the whole model do not match the parameters this rank holds, so "
                f"this engine cannot be refitted rank by rank: "
                + "; ".join(problems[:8])
                + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
            )
        self.slow_path = []
        self._params = params
        self._destinations = dests
        self._trtllm_laid_out = {}  # a rank's slices of permuted rows are not rows of the checkpoint: no kernel layouts
        self._laid_out = {}
        self._write_orders = False
        self._shards = shards
        self.units = self._units(live)
        self.pool = StagingPool({n: self._local_spec(n) for n in params}, self.units, self._device)
        self._post_load_hooks = self._hooks()

    def _advertise_trtllm_layouts(self) -> dict[str, KernelLayout]:
        """Put FlashInfer's TRT-LLM kernel layout on the targets of every TRT-LLM MoE param whose
        sources cover each expert's rows exactly once (``trtllm.moe_direct_targets``: whole
        experts, or per-expert gate/up rows of a shared w13 region): the trainer's quantize kernel
        then writes the kernel layout, and processing that layer is a plain copy into the live
        params. Returns the layout of each such param as a whole (values: rows; scales: rows and
        tiles), which ``read_reference`` inverts for MXREFIT_VERIFY."""
        laid: dict[str, KernelLayout] = {}
        for name, spec in self._params.items():
            mname, _, attr = name.rpartition(".")
            if attr not in ("w13_weight", "w2_weight") or not _trtllm_moe(self.model.get_submodule(mname)):
                continue
            e, m, k = spec.shape
            try:
                check_moe_alignment(name, m, k)
            except ValueError as err:
                raise VllmSetupError(str(err)) from None
            gated = attr == "w13_weight" and bool(getattr(self.model.get_submodule(mname).moe_config, "is_act_and_mul", True))
            dests = moe_direct_targets(self._destinations, name, m, k, gated)
            if dests is None:
                continue
            self._destinations = dests
            laid[name] = KernelLayout(rows=moe_row_order(gated))
            laid[scale_param(name)] = KernelLayout(rows=moe_row_order(gated), tiles="128x4")
        return laid

    def _as_checkpoint(self, param: str, t: torch.Tensor) -> torch.Tensor:
        """``param``'s staged bytes in the checkpoint layout (the trainer may have written its kernel layout)."""
        layout = self._laid_out.get(param)
        if layout is None:
            return t
        return read_reference(layout, t.reshape(-1).view(torch.uint8), tuple(t.shape), t.dtype)

    def _local_spec(self, name: str) -> ParamSpec:
        """The param as this rank holds it (its slice's shape on a tensor-parallel rank)."""
        spec = self._params[name]
        shard = self._shards.get(name)
        return spec if shard is None else ParamSpec(name, shard.local_shape(spec.shape), spec.dtype)

    # -- units: one per vLLM module (or one for the whole slow path) --
    def _units(self, live: dict) -> list[StagedUnit]:
        if self.slow_path:
            return [StagedUnit("vllm-loader", tuple(self._params), self._load_with_vllm)]
        modules = dict(self.model.named_modules())
        self._module_units: list[_ModuleUnit] = []
        by_module: dict[str, dict[str, str]] = {}
        for name in self._params:
            mname, _, attr = name.rpartition(".")
            by_module.setdefault(mname, {})[attr] = name
        kernel_param_owner: dict[int, list[tuple[str, str]]] = {}
        for mname, module in modules.items():
            for attr, p in module.named_parameters(recurse=False):
                kernel_param_owner.setdefault(id(p), []).append((mname, attr))
        units = []
        for mname, attrs in by_module.items():
            module = modules[mname]
            if _trtllm_moe(module):
                for attr, name in attrs.items():
                    if not attr.endswith("_scale"):
                        spec = self._local_spec(name)
                        try:
                            check_moe_alignment(name, spec.shape[1], spec.shape[2])
                        except ValueError as err:
                            raise VllmSetupError(str(err)) from None
            aliases = []
            for attr in attrs:
                p = module._parameters.get(attr)
                for other, other_attr in kernel_param_owner.get(id(p), []) if p is not None else []:
                    if other != mname and other not in by_module:
                        aliases.append((modules[other], other_attr, attr))
            unit = _ModuleUnit(mname, module, attrs, aliases)
            self._module_units.append(unit)
            units.append(StagedUnit(mname, tuple(attrs.values()), self._processing(unit)))
        return units

    def _hooks(self) -> list:
        """Module-level post-load hooks above the refitted modules (``module_post_load_hooks``);
        on the slow path vLLM's own finalize runs them."""
        if self.slow_path:
            return []
        refitted = {u.module for u in self._module_units}
        refitted |= {other for u in self._module_units for other, _, _ in u.aliases}
        return module_post_load_hooks(self.model, refitted)

    def _processing(self, unit: _ModuleUnit) -> Callable[[dict[str, torch.Tensor]], None]:
        """The unit's staged-processing callback; it looks ``_process`` up at each call."""
        return lambda tensors: self._process(unit, tensors)

    def _process(self, unit: _ModuleUnit, tensors: dict[str, torch.Tensor]) -> None:
        if not self._profile:
            self._process_unit(unit, tensors)
            return
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self._device)
        start = time.perf_counter()
        self._process_unit(unit, tensors)
        if cuda:
            torch.cuda.synchronize(self._device)
        kind = f"{type(unit.module).__name__}/{type(getattr(unit.module, 'quant_method', None)).__name__}"
        self.process_by_kind[kind] = self.process_by_kind.get(kind, 0.0) + time.perf_counter() - start

    def _process_unit(self, unit: _ModuleUnit, tensors: dict[str, torch.Tensor]) -> None:
        staged = {attr: tensors[p] for attr, p in unit.attrs.items()}
        if self._checkpoint is not None:
            for p in unit.attrs.values():
                flat = self._as_checkpoint(p, tensors[p]).reshape(-1).view(torch.uint8)
                for name, t in self._checkpoint_targets.get(p, ()):
                    self._checkpoint[name] = flat[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape).to("cpu", copy=True)
        module = unit.module
        if _trtllm_moe(module):
            self._trtllm_fast_path(module, staged, unit.attrs)
        elif self._layouts is not None and self._probed(module, staged):
            self._learned_layout(self._layouts, unit, staged)
        elif self._layouts is not None and self._learn_unquantized and _triton_unquantized_experts(module):
            self._identity(module, staged)
        elif _needs_vllm_processing(module):
            _process_with_vllm(module, staged)
        else:
            for attr, staged_t in staged.items():
                getattr(module, attr).data.copy_(staged_t)
        for other, other_attr, attr in unit.aliases:
            if _needs_vllm_processing(other):
                _process_with_vllm(other, {other_attr: staged[attr]})

    def _probed(self, module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> bool:
        """Whether the module's processing is learned (``MXREFIT_LEARNED_LAYOUT``, see ``__init__``)."""
        if _marlin_mxfp8(module):
            return True
        if self._learn_quantized and _quantized(module):
            return True
        return self._learn_unquantized and _unquantized_linear(module) and _nbytes(staged) <= PROBE_UNQUANTIZED_BYTES

    def _learned_layout(self, layouts: LayoutCache, unit: _ModuleUnit, staged: dict[str, torch.Tensor]) -> None:
        """Marlin MXFP8 processing as a byte gather learned from vLLM's own processing of the first
        module of each signature (``engine/probed_layout.py``); a signature it refuses keeps vLLM's.
        Where the adopted plan has the trainer write a learned order (``_advertise_orders``), the
        staged bytes are the kernel's already: a plain copy."""
        module = unit.module
        qm = module.quant_method
        kernel = functools.partial(_kernel_tensors, module, staged)
        key = _processing_key(module, staged, type(getattr(qm, "kernel", None)), str(getattr(qm, "mxfp8_backend", "")))
        known = layouts.entries.get(key)
        if isinstance(known, ProbedLayout) and self._written:
            written = {a for a, name in unit.attrs.items() if name in self._written}
            if written:
                _apply_written(known, staged, kernel(), written)
                return
        experts = staged["w13_weight"].shape[0] if "w13_weight" in staged else 1
        result = layouts.run(
            key,
            lambda t: _process_with_vllm(module, t, rebind=True),
            kernel,
            staged,
            experts=experts,
            watch=lambda: _state_beside_params(module, staged),
        )
        if self._write_orders and _marlin_mxfp8(module) and isinstance(result, ProbedLayout):
            self._module_keys[unit.name] = key
        if known is None:
            what = _described(module, staged)
            if isinstance(result, str):
                self.learned_layouts[what] = f"refused: {result}"
                log.warning("mxrefit: no learned layout for %s (%s): vLLM's processing runs every refit", what, result)
            else:
                kernels = ", ".join(f"{a} {k}" for a, k in result.kernels.items())
                self.learned_layouts[what] = f"learned ({result.index_bytes / 2**20:.1f} MiB of index; {kernels})"
                log.info("mxrefit: learned the layout of %s (%.1f MiB of index; %s)", what, result.index_bytes / 2**20, kernels)
                if key in self._module_keys.values():
                    self._learn_orders(key, result, what)

    def _learn_orders(self, key: tuple, layout: ProbedLayout, what: str) -> None:
        """Each learned value gather and its scales' as units a trainer's quantize kernel writes
        (``BlockPermutation``); kept for ``_advertise_orders`` after this refit. A pair that is not
        whole units keeps the engine's gather, named in ``learned_layouts``."""
        orders: dict[str, BlockPermutation] = {}
        refused: list[str] = []
        for attr, g in layout.gathers.items():
            sg = layout.gathers.get(f"{attr}_scale")
            if attr.endswith("_scale") or sg is None:
                continue
            if g.identity or sg.identity or g.source != attr or sg.source != f"{attr}_scale":
                refused.append(f"{attr}: not a permutation of its own values and scales")
                continue
            perm = BlockPermutation.of(g.index, sg.index)
            if isinstance(perm, str):
                refused.append(f"{attr}: {perm}")
            elif not torch.equal(perm.index(), g.index.cpu().to(torch.int64)):
                refused.append(f"{attr}: its units do not reproduce the learned gather")
            elif problem := perm.wire_problem():
                refused.append(f"{attr}: {problem}")
            else:
                orders[attr] = perm
        if orders:
            self._orders[key] = orders
        note = f"; the trainer writes {', '.join(orders)}" if orders else ""
        note += f"; the engine gathers {'; '.join(refused)}" if refused else ""
        self.learned_layouts[what] += note

    def _order_target(self, t: Target, perm: BlockPermutation, role: str) -> Target:
        """``t`` (a checkpoint-layout row range of one expert, or whole experts) as its rows of the
        expert's region in the learned order."""
        spec = self._params[t.param]
        rows, cols = spec.shape[-2], spec.shape[-1] * spec.dtype.itemsize
        expert, rem = divmod(t.offset, rows * cols)
        first, part = divmod(rem, cols)
        m = t.shape[-2]
        if part or first + m > rows or (math.prod(t.shape[:-2]) > 1 and m != rows):
            raise ValueError(f"{t.param}: bytes {t.offset}.. of shape {t.shape} are not rows of one expert")
        layout = KernelLayout(
            row_offset=first, region_rows=rows if m != rows else None, order=f"{perm.digest}:{role}", permutation=perm
        )
        return Target(t.param, expert * rows * cols, t.shape, t.dtype, layout)

    def _advertise_orders(self) -> None:
        """Put the learned orders on the targets of every param they cover (all of its writers, its
        scales' too), if the plan a trainer would build from the new tables is sound; bump the
        tables' version so the receiver re-reads them and the trainer plans again. What cannot be
        advertised keeps the engine's gather, named in the log."""
        by_param: dict[str, BlockPermutation] = {}
        for unit in self._module_units:
            orders = self._orders.get(self._module_keys.get(unit.name, ()), {})
            for attr, perm in orders.items():
                by_param[unit.attrs[attr]] = by_param[unit.attrs[f"{attr}_scale"]] = perm
        self._advertised |= set(self._orders)
        dests = dict(self._destinations)
        bad: set[str] = set()
        fmt = get_format("mxfp8")
        for name, d in self._destinations.items():
            params = {t.param for t in d.targets}
            if not params & by_param.keys():
                continue
            try:
                if d.format != "mxfp8" or len(d.targets) != 2 or not params <= by_param.keys():
                    raise ValueError(f"{name}: not an MXFP8 tensor whose values and scales both have learned orders")
                tv, ts = d.targets
                if tv.layout is not None or ts.layout is not None or by_param[tv.param] is not by_param[ts.param]:
                    raise ValueError(f"{name}: already laid out, or values and scales of different orders")
                new = (self._order_target(tv, by_param[tv.param], "values"), self._order_target(ts, by_param[ts.param], "scales"))
                fmt.check_layouts(name, fmt.parts(tv.shape, tv.dtype), [t.layout for t in new])
                dests[name] = Destination(name, d.format, new)
            except ValueError as err:
                bad |= params
                log.warning("mxrefit: %s keeps the engine's gather: %s", sorted(params), err)
        for name, d in self._destinations.items():
            if {t.param for t in d.targets} & bad:
                dests[name] = d
        if dests == self._destinations:
            return
        try:
            build_plan([SourceSpec(n, d.targets[0].shape, torch.bfloat16) for n, d in dests.items()], self._params, dests)
        except ValueError as err:  # PlanMismatch included
            log.warning("mxrefit: the learned orders stay with the engine: a plan of them fails (%s)", err)
            return
        self._destinations = dests
        self._tables_version += 1
        log.info(
            "mxrefit: the trainer may write %d params in their learned Marlin orders (tables version %d); it plans again",
            sum(1 for p in by_param if p not in bad),
            self._tables_version,
        )

    def _identity(self, module: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
        """Unquantized MoE experts whose processing keeps the bytes (vLLM 0.26's Triton backend on
        CUDA: ``contiguous()`` and a copy into the same storage, which the reload here turns into
        three passes or more): a plain copy once the first module of the signature showed it on real
        weights (``learn_identity``); a refusal keeps vLLM's processing, as does a refit that
        cannot tell (it is tried again on the next)."""
        kernel = functools.partial(_kernel_tensors, module, staged)
        key = _processing_key(module, staged, str(getattr(module.quant_method, "unquantized_backend", "")))
        known = self._identities.get(key)
        if known is not None and known.kept:
            for attr, t in staged.items():
                _param(module, attr).data.copy_(t)
            return
        if known is not None:
            _process_with_vllm(module, staged)
            return
        verdict = learn_identity(
            lambda t: _process_with_vllm(module, t), kernel, staged, watch=lambda: _state_beside_params(module, staged)
        )
        what = _described(module, staged)
        if not verdict.decided:
            log.info("mxrefit: %s: identity not decided on this refit (%s)", what, verdict.reason)
            return
        self._identities[key] = verdict
        if verdict.kept:
            self.learned_layouts[what] = "learned (identity: a plain copy)"
            log.info("mxrefit: %s: vLLM's processing keeps the bytes; a plain copy from now on", what)
        else:
            self.learned_layouts[what] = f"refused: {verdict.reason}"
            log.warning("mxrefit: no identity for %s (%s): vLLM's processing runs every refit", what, verdict.reason)

    def _trtllm_fast_path(self, module: torch.nn.Module, staged: dict[str, torch.Tensor], names: dict[str, str]) -> None:
        """The layer's bytes into FlashInfer's TRT-LLM layout: a plain copy where the trainer wrote that
        layout already (``_advertise_trtllm_layouts``), else one folded gather per param
        (``trtllm.MoeLayout``). With ``MXREFIT_VERIFY=1`` the first layer is also run through vLLM's
        own processing from the checkpoint bytes, and both results must be equal byte for byte."""
        gated = bool(getattr(module.moe_config, "is_act_and_mul", True))
        want = None
        if self.verify and not self._verified:
            _process_with_vllm(module, {a: self._as_checkpoint(names[a], t) for a, t in staged.items()})
            want = {a: getattr(module, a).detach().clone() for a in staged}
        for attr, t in staged.items():
            live = getattr(module, attr).data.view(torch.uint8)
            u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            if names[attr] in self._laid_out:
                live.view(-1).copy_(u8.reshape(-1))
                continue
            e, m, k = t.shape
            MoeLayout(e, m, k, gated and attr.startswith("w13"), t.device, scales=attr.endswith("_scale"))(u8, live)
        if want is not None:
            bad = [a for a, w in want.items() if not torch.equal(w.view(torch.uint8), getattr(module, a).data.view(torch.uint8))]
            if bad:
                raise RuntimeError(f"MXREFIT_VERIFY: the TRT-LLM fast path differs from vLLM's processing for {bad}")
            self._verified = True
            log.info("MXREFIT_VERIFY: TRT-LLM fast path equals vLLM's processing byte for byte")

    def _load_with_vllm(self, tensors: dict[str, torch.Tensor]) -> None:
        """vLLM's own reload of checkpoint-named tensors, plus the unquantized MoE experts'
        post-load step it skips on a reload (``replays_expert_post_load``)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        built = {
            m: getattr(m.quant_method, "moe_kernel", None) is not None for m in self.model.modules() if _needs_vllm_processing(m)
        }
        with _kept_in_place(self.model):
            initialize_layerwise_reload(self.model)
            getattr(self.model, "load_weights")(iter(tensors.items()))  # vLLM's model method
            finalize_layerwise_reload(self.model, self.model_config)
            for module, built_before in built.items():
                if replays_expert_post_load(_quant_method(module), built_before):
                    _quant_method(module).moe_kernel.fused_experts.process_weights_after_loading(module)

    # -- Engine --
    def params(self) -> dict[str, ParamSpec]:
        return dict(self._params)

    def destinations(self) -> dict[str, Destination]:
        return dict(self._destinations)

    def prepare(self, plan) -> None:
        """Place the staging, and note which params this plan's trainer writes in a learned order
        (those get a plain copy; with ``verify`` the first refit under such a plan is checked again)."""
        written = {
            p.target.param: KernelLayout(order=p.target.layout.order, permutation=p.target.layout.permutation)
            for b in plan.buckets
            for p in b.parts
            if p.target.layout is not None and p.target.layout.order is not None
        }
        if written.keys() != self._written.keys():
            self._verified = False
        self._written = written
        self._laid_out = {**self._trtllm_laid_out, **written}
        self.pool.place(plan)

    @property
    def tables_version(self) -> int:
        return self._tables_version

    def storage(self, param: str) -> torch.Tensor:
        return self.pool.storage(param)

    def read(self, param: str) -> torch.Tensor:
        """The live parameter's bytes (a tensor-parallel rank's: its slice), where vLLM serves it in
        the checkpoint's own shape and dtype.

        Processed layouts (repacked, dequantized, prepacked) have no byte-for-byte counterpart
        in the tables: those raise ValueError; check them through ``kernel_state`` instead.
        """
        mname, _, attr = param.rpartition(".")
        live = self.model.get_submodule(mname)._parameters.get(attr)
        spec = self._local_spec(param)
        if live is None or tuple(live.shape) != spec.shape or live.dtype != spec.dtype or not live.is_contiguous():
            raise ValueError(f"{param}: vLLM serves it in a processed layout; no checkpoint bytes to read")
        return live.detach().reshape(-1).view(torch.uint8)

    def kernel_state(self, names: Iterable[str] | None = None) -> dict[str, dict]:
        """sha256, shape and dtype of the live (kernel-format) parameters, for checks from outside.

        vLLM's CPU build may run a linear from a copy packed inside its kernel (oneDNN, AMX
        packed GEMM) and leave ``weight`` empty or unread, so the entry of every module with its
        CPU GEMM dispatch (``cpu_linear``, packed or not) also holds ``kernel_output``, the digest
        of that kernel's output on a fixed input: a stale or wrong packed copy is seen where the
        parameter's bytes cannot show it."""
        wanted = None if names is None else set(names)
        out = {}
        for name, p in self.model.named_parameters():
            if wanted is not None and name not in wanted:
                continue
            out[name] = {"sha256": tensor_sha256(p), "shape": list(p.shape), "dtype": str(p.dtype)}
        for mname, module in self.model.named_modules():
            name = f"{mname}.weight" if mname else "weight"
            if name in out and callable(getattr(module, "cpu_linear", None)):
                out[name]["kernel_output"] = _cpu_kernel_digest(module)
        return out

    def kernel_addresses(self) -> dict[str, int]:
        """``data_ptr`` of every tensor the kernels read (parameters, buffers, and the plain kernel
        tensors of ``_plain_kernel_tensors``), to check that refits keep them (captured graphs)."""
        out = {}
        for mname, module in self.model.named_modules():
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    out[f"{mname}.{attr}"] = t.data_ptr()
            for path, t in _plain_kernel_tensors(module).items():
                out[f"{mname}:{'.'.join(path)}"] = t.data_ptr()
        return out

    def shards(self) -> dict[str, Shard]:
        return dict(self._shards)

    def after_refit(self, version: int) -> None:
        with torch.no_grad():
            for hook in self._post_load_hooks:
                hook()
            if self._checkpoint is not None:
                checkpoint, self._checkpoint = self._checkpoint, None
                self._check_against_vllm_loader(checkpoint)
        if self._write_orders and set(self._orders) - self._advertised:
            self._advertise_orders()

    def _check_against_vllm_loader(self, checkpoint: dict[str, torch.Tensor]) -> None:
        """The first refit's kernel bytes must equal what vLLM's own loader makes of the same
        checkpoint tensors (``model.load_weights`` in its layerwise reload, then its processing).
        On a mismatch the engine keeps vLLM's own result and refuses every later refit."""
        mine = self.kernel_state()
        self._load_with_vllm(checkpoint)
        theirs = self.kernel_state()
        self._verified = True
        bad = sorted(n for n, d in mine.items() if theirs.get(n) != d)
        if bad:
            self._refused = (
                f"vLLM {vllm_version()}: mxrefit's refit differs from vLLM's own loader in {len(bad)} parameters "
                f"({', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}); the engine holds vLLM's own result and "
                f"refuses further refits. mxrefit ran its suites on vLLM {', '.join(TESTED_VLLM)}"
            )
            log.error("mxrefit: %s. All of them: %s", self._refused, ", ".join(bad))
            raise VllmSetupError(self._refused)
        log.info(
            "mxrefit: vLLM %s: the first refit equals vLLM's own loader byte for byte (%d parameters)", vllm_version(), len(mine)
        )

    def after_bucket(self, bucket: int) -> None:
        if self._refused is not None:
            raise VllmSetupError(self._refused)
        if bucket == 0 and self._checkpoint_targets and not self._verified:
            self._checkpoint = {}
        with torch.no_grad():
            self.pool.after_bucket(bucket)

    @property
    def exportable(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self._device
