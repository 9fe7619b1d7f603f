"""`mxrefit bench --peer vllm`: vLLM's own weight-transfer path and mxrefit's into the same real vLLM.

After mxrefit's own modes, the bench starts vLLM in this process on the same GPU
(``load_format="dummy"`` from a folder holding only config.json, and for MXFP8 the ModelOpt
quantization config, written from the bench's ``ModelShape``; ``config_dir``), with mxrefit's
worker extension and vLLM's IPC weight-transfer backend. The trainer is the bench's own tensors.
Then, on that one engine:
- mxrefit: ``steps`` refits through the worker extension (``Sender`` on the trainer's device),
  more where its layout settles (below);
- vLLM's own path: ``steps`` rounds of ``start_weight_update`` / ``IPCWeightTransferEngine.
  trainer_send_weights`` (packed, CUDA IPC; the checkpoint-format tensors, for MXFP8 quantized on
  the trainer under per-expert ModelOpt names; ``checkpoint_stream``) / ``finish_weight_update``,
  each phase timed. The quantizer is vLLM's own ``mxfp8_e4m3_quantize`` where it writes the
  ModelOpt rule's bytes (what a ModelOpt checkpoint and mxrefit hold); vLLM 0.26's writes other
  bytes (``floor(log2(amax)) + 127``), and there mxrefit's quantizer stands in (``own_quantizer``),
  so the check below compares two transfers of one checkpoint, not two quantizers;
- the check: the engine's parameters as its kernels read them (``mxrefit_kernel_state``: sha256
  of every parameter) after vLLM's own path loaded the last weights, and again after mxrefit
  refitted the same weights, must be equal, byte for byte.
The figures are medians after the first refit of each path (the first learns and builds staging).
With the learned layout (CUDA's default) mxrefit's path settles over more refits: the first lets
vLLM process the bytes and learns its layout, the next plans again to write it from the trainer
(``RefitReport.replanned``). Those settling refits are run, timed and reported apart
(``settle``), and the medians are over ``steps - 1`` refits after the last of them
(``settled_at``), so a median never mixes a one-time learning refit with steady ones.

Written against vLLM 0.26's trainer API (``IPCWeightTransferEngine.trainer_send_weights``);
``scripts/vllm_headline.py`` (issue 22's headline) runs the same pieces. CUDA only:
``unavailable`` says why a run cannot happen instead of failing inside it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mxrefit.devices import first_cuda_problem
from mxrefit.engine.probed_layout import learned_layout_mode
from mxrefit.integrations.vllm.client import refit_while
from mxrefit.plan.eligibility import DEFAULT_RULES
from mxrefit.plan.shapes import ModelShape
from mxrefit.source.checkpoint import quant_block
from mxrefit.source.sender import RefitReport, Sender

PEER = "vllm"
FORMATS = ("mxfp8", "bf16")
EXTENSION = "mxrefit.integrations.vllm.worker.RefitWorkerExtension"
IPC_MODULE = "vllm.distributed.weight_transfer.ipc_engine"
_QWEN3_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645}


def shape_refusal(shape: ModelShape) -> str | None:
    """Why no vLLM config can be written for ``shape``; None when it can."""
    if shape.arch != "qwen3":
        return f"model {shape.name}: a {shape.arch} shape; the vLLM config is written for Qwen3 and Qwen3-MoE shapes"
    if shape.tp_share > 1 or shape.ep_share > 1:
        return (
            f"model {shape.name}: one rank's share of a model served at TP={shape.tp_share}, EP={shape.ep_share}; "
            "the in-process vLLM serves a whole model on one GPU"
        )
    return None


def hf_config(shape: ModelShape, fmt: str = "bf16") -> dict[str, Any]:
    """The config.json vLLM reads for ``shape``: a Qwen3 (dense) or Qwen3-MoE model of its sizes;
    ``fmt="mxfp8"`` adds the ModelOpt MXFP8 block of mxrefit's default rules."""
    why = shape_refusal(shape)
    if why:
        raise ValueError(why)
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if shape.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if shape.is_moe else "qwen3",
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        # a MoE without dense layers reads no intermediate_size; Qwen3's MoE configs hold 8x the experts'
        "intermediate_size": shape.intermediate or 8 * shape.moe_intermediate,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied_embeddings,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(shape.dtype).removeprefix("torch."),
    }
    if shape.is_moe:
        cfg.update(
            num_experts=shape.experts,
            num_experts_per_tok=min(8, shape.experts),
            moe_intermediate_size=shape.moe_intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    cfg.update({k: v for k, v in _QWEN3_TOKENS.items() if v < shape.vocab})
    if fmt == "mxfp8":
        cfg["quantization_config"] = quant_block(DEFAULT_RULES.exclude_modules(shape.layers))
    elif fmt != "bf16":
        raise ValueError(f"the vLLM config is written for {FORMATS}, not {fmt!r}")
    return cfg


def config_dir(path: str | Path, shape: ModelShape, fmt: str) -> str:
    """A folder vLLM starts from with ``load_format="dummy"``: config.json, and for MXFP8 the
    hf_quant_config.json ModelOpt writes beside it. No weights: vLLM fills them at random."""
    os.makedirs(path, exist_ok=True)
    cfg = hf_config(shape, fmt)
    if fmt == "mxfp8":
        quant = {"producer": {"name": "mxrefit"}, "quantization": cfg["quantization_config"]["quantization"]}
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(quant, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return str(path)


def engine_kwargs(path: str, *, gpu_util: float, own_path: bool = True) -> dict[str, Any]:
    """``vllm.LLM`` arguments of the measured engine: dummy weights, no tokenizer, a 2 GiB KV cache,
    FlashAttention, CUDA graphs for batches up to 8, mxrefit's worker extension and, with
    ``own_path``, vLLM's IPC weight-transfer backend."""
    kw: dict[str, Any] = dict(
        model=path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=gpu_util,
        kv_cache_memory_bytes=2 << 30,
        attention_config={"backend": "FLASH_ATTN"},
        worker_extension_cls=EXTENSION,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    if own_path:
        kw["weight_transfer_config"] = {"backend": "ipc"}
    return kw


def free_fraction(device: torch.device | None = None, margin: float = 0.02) -> float:
    """The share of the GPU still free, less ``margin``: vLLM refuses to start where its
    ``gpu_memory_utilization`` asks for more than is free, and the trainer's weights hold the rest."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0.05, int((free / total - margin) * 100) / 100)


class PeakMemory:
    """The device's used memory (every process: the trainer and vLLM's engine) sampled every
    millisecond while the block runs, and the trainer's own allocator peak."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.stop = threading.Event()
        self.base = self.peak = self.trainer_base = 0
        self.extra_gb = self.trainer_extra_gb = self.after_gb = 0.0
        self.extra_bytes = self.trainer_extra_bytes = 0

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self) -> PeakMemory:
        torch.cuda.synchronize(self.device)
        self.base = self.peak = self.used()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.trainer_base = torch.cuda.memory_allocated(self.device)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.used())
        self.extra_bytes = self.peak - self.base
        self.trainer_extra_bytes = torch.cuda.max_memory_allocated(self.device) - self.trainer_base
        self.extra_gb = self.extra_bytes / 1e9
        self.trainer_extra_gb = self.trainer_extra_bytes / 1e9
        self.after_gb = (self.used() - self.base) / 1e9


Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _rule_probe(device: torch.device) -> torch.Tensor:
    """A BF16 [64, 256] tensor whose rows span 2**-20 to 2**20: blocks on which any two MXFP8 scale
    rules that differ anywhere in the weights' range write different bytes."""
    g = torch.Generator().manual_seed(0)
    rows = torch.exp2(torch.linspace(-20, 20, 64)).unsqueeze(1)
    return (torch.randn(64, 256, generator=g) * rows).to(torch.bfloat16).to(device)


def pick_quantizer(candidate: Quantizer, label: str, device: torch.device) -> tuple[Quantizer, dict[str, Any]]:
    """``candidate`` where its bytes on ``_rule_probe`` equal mxrefit's MXFP8 quantizer (the ModelOpt
    rule, proven equal to vLLM 0.32's function), else mxrefit's quantizer; and what was chosen and why."""
    from mxrefit.formats import mxfp8

    probe = _rule_probe(device)
    want_q, want_s = mxfp8.quantize(probe, backend="torch")
    try:
        q, s = candidate(probe)
        differ = int((s.view(torch.uint8).reshape(want_s.shape) != want_s).sum())
        same = differ == 0 and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        why = f"{differ} of {want_s.numel()} scale bytes differ from the ModelOpt rule's on a probe"
    except Exception as err:  # noqa: BLE001 - any failure means it cannot stand for the checkpoint's quantizer
        same, why = False, f"it failed on a probe: {type(err).__name__}: {err}"
    if same:
        return candidate, {"function": label, "modelopt_rule": True}
    return lambda w: mxfp8.quantize(w), {
        "function": "mxrefit.formats.mxfp8.quantize",
        "modelopt_rule": False,
        "why": f"{label} writes other bytes than a ModelOpt MXFP8 checkpoint holds: {why}",
    }


def own_quantizer(device: torch.device) -> tuple[Quantizer, dict[str, Any]]:
    """The trainer-side MXFP8 quantizer of vLLM's own path (``pick_quantizer`` of vLLM's function)."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

    version = getattr(importlib.import_module("vllm"), "__version__", "unknown")
    return pick_quantizer(mxfp8_e4m3_quantize, f"vLLM {version}'s mxfp8_e4m3_quantize", device)


def checkpoint_stream(
    weights: dict[str, torch.Tensor], fmt: str, stats: dict[str, float], quantize: Quantizer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a trainer hands vLLM's own loader: HF checkpoint names; for MXFP8 the ModelOpt tensors
    (per-expert values + uint8 ``_scale``) quantized here by ``quantize`` (vLLM's own
    ``mxfp8_e4m3_quantize`` by default). Grouped expert slabs (transformers 5) are split into the
    per-expert tensors a checkpoint holds. ``stats``: ``quantize_s`` (time in the quantizer) and
    ``bytes`` (what was yielded) add up."""
    stats.setdefault("quantize_s", 0.0)
    stats.setdefault("bytes", 0)

    def out(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        stats["bytes"] += t.numel() * t.element_size()
        return name, t

    if fmt == "bf16":
        for name, t in weights.items():
            yield out(name, t)
        return
    if quantize is None:
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

        quantize = mxfp8_e4m3_quantize
    chosen: Quantizer = quantize

    def quantized(name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        t0 = time.perf_counter()
        q, s = chosen(w)
        stats["quantize_s"] += time.perf_counter() - t0
        yield out(name, q)
        yield out(name + "_scale", s.view(torch.uint8))

    decided = DEFAULT_RULES.decide((n, tuple(t.shape)) for n, t in weights.items())
    for name, t in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    half = t.shape[1] // 2
                    parts = {"gate_proj": t[e, :half], "up_proj": t[e, half:]}
                else:
                    parts = {"down_proj": t[e]}
                for proj, w in parts.items():
                    yield from quantized(f"{prefix}.{e}.{proj}.weight", w.contiguous())
        elif decided.get(name):
            yield from quantized(name, t)
        else:
            yield out(name, t)


def start_mxrefit(llm: Any, device: torch.device, *, experts: str, **sender_kwargs: Any) -> tuple[Sender, dict[str, Any]]:
    """Open mxrefit's receiver in the engine's worker (``mxrefit_init``) and a Sender to it on the
    trainer's ``device``; returns the Sender and the worker's answer (its token left out)."""
    info = llm.collective_rpc("mxrefit_init", kwargs={"experts": experts})[0]
    sender = Sender(info["address"], bytes.fromhex(info["token"]), device=device, **sender_kwargs)
    return sender, {k: v for k, v in info.items() if k != "token"}


def mxrefit_refit(llm: Any, sender: Sender, weights: dict[str, torch.Tensor]) -> tuple[RefitReport, PeakMemory]:
    """One refit of ``weights`` into the engine while its worker serves it, and the memory it took."""
    with PeakMemory(sender.device) as mem:
        report = refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
    return report, mem


def own_refit(llm: Any, weights: dict[str, torch.Tensor], fmt: str, quantize: Quantizer | None = None) -> dict[str, Any]:
    """One round of vLLM's own IPC path, each phase timed: ``start_weight_update``, the packed
    ``trainer_send_weights`` (the trainer's quantization by ``quantize`` and the engine's load inside
    it), ``finish_weight_update`` (vLLM's post-load processing)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    def send(update_info: Any) -> None:
        llm.update_weights({"update_info": asdict(update_info)})

    stats: dict[str, float] = {"quantize_s": 0.0, "bytes": 0}
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        llm.start_weight_update()
        t1 = time.perf_counter()
        with torch.no_grad():
            IPCWeightTransferEngine.trainer_send_weights(
                checkpoint_stream(weights, fmt, stats, quantize), {"send_mode": send, "packed": True}
            )
        t2 = time.perf_counter()
        llm.finish_weight_update()
        t3 = time.perf_counter()
    return {
        "total_s": t3 - t0,
        "start_s": t1 - t0,
        "send_load_s": t2 - t1,
        "trainer_quantize_s": stats["quantize_s"],
        "finish_s": t3 - t2,
        "bytes": int(stats["bytes"]),
        "trainer_peak_extra_bytes": mem.trainer_extra_bytes,
        "device_peak_extra_bytes": mem.extra_bytes,
        "device_after_bytes": int(mem.after_gb * 1e9),
    }


def shutdown(llm: Any) -> None:
    """Stop the engine's core process and give its memory back before anything else runs."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _ipc_refusal() -> str | None:
    """What keeps vLLM's IPC trainer path from running here, read from the installed files (importing
    vLLM takes seconds and logs): not installed, no IPC engine, not 0.26's trainer call, no ``ray``."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not installed (a CUDA build, 0.26 or later)"
    package = Path(next(iter(spec.submodule_search_locations)))
    found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", _text(package / "_version.py"))
    version = found[1] if found else "of unknown version"  # a vLLM put on the path has no package metadata
    root = package / "distributed" / "weight_transfer"
    ipc = root / "ipc_engine.py"
    if not ipc.is_file():
        return f"this vLLM ({version}) has no {IPC_MODULE} (the IPC weight-transfer engine came with 0.26)"
    if "def trainer_send_weights" not in _text(ipc):
        return (
            f"this vLLM ({version})'s IPC engine has no IPCWeightTransferEngine.trainer_send_weights, "
            "the trainer call of vLLM 0.26 that this peer drives"
        )
    top_level_ray = re.compile(r"^(?:import ray\b|from ray\b)", re.M)
    sources = [root / "__init__.py", root / "base.py", ipc]
    if importlib.util.find_spec("ray") is None and any(top_level_ray.search(_text(p)) for p in sources):
        return f"ray is not installed, and this vLLM ({version})'s {IPC_MODULE} imports it"
    return None


def unavailable(device: torch.device, shape: ModelShape | None = None, fmt: str = "mxfp8") -> str | None:
    """Why ``--peer vllm`` cannot run on ``device`` here for ``shape`` in ``fmt``, every missing
    piece named; None when it can."""
    reasons = []
    why = first_cuda_problem(
        device, "vLLM's IPC weight transfer shares the trainer's GPU tensors by CUDA IPC", "vLLM starts on the first visible GPU"
    )
    if why:
        reasons.append(why)
    if fmt not in FORMATS:
        reasons.append(f"--format {fmt}: vLLM's own path is written here for {' and '.join(FORMATS)} checkpoints")
    if shape is not None:
        why = shape_refusal(shape)
        if why:
            reasons.append(why)
    why = _ipc_refusal()
    if why:
        reasons.append(why)
    elif not reasons:
        try:  # the files said yes: the import is the last word (its own dependencies)
            module = importlib.import_module(IPC_MODULE)
            if not callable(getattr(getattr(module, "IPCWeightTransferEngine", None), "trainer_send_weights", None)):
                reasons.append("vLLM's IPCWeightTransferEngine has no trainer_send_weights (vLLM 0.26's trainer call)")
        except ImportError as err:
            missing = getattr(err, "name", None) or ""
            if missing == "ray" or missing.startswith("ray."):
                reasons.append(f"ray is not installed, and vLLM's {IPC_MODULE} imports it")
            else:
                reasons.append(f"vLLM's {IPC_MODULE} does not import ({err})")
    if not reasons:
        return None
    return f"--peer {PEER} cannot run here: " + "; ".join(reasons)


SETTLE_MAX = 4  # refits beyond ``steps`` that mxrefit's path may take to settle its layout


def settled_at(rows: list[dict[str, Any]]) -> int:
    """The index of the first steady refit: after the first (it learns and builds staging) and
    after the last one that planned again (it wrote a layout learned by the refit before)."""
    last_replan = max((i for i, r in enumerate(rows) if r.get("replanned")), default=0)
    return min(max(1, last_replan + 1), len(rows) - 1) if len(rows) > 1 else 0


def refit_until_settled(refit: Callable[[int], dict[str, Any]], steps: int) -> tuple[list[dict[str, Any]], bool]:
    """``refit(i)`` until ``steps - 1`` refits (at least one) have run after ``settled_at``, or
    ``steps + SETTLE_MAX`` in all; returns the rows and whether the path settled."""
    want = max(1, steps - 1)
    rows: list[dict[str, Any]] = []
    while len(rows) < steps + SETTLE_MAX:
        rows.append(refit(len(rows)))
        if len(rows) > 1 and not rows[-1].get("replanned") and len(rows) - settled_at(rows) >= want:
            return rows, True
    return rows, False


def _median(rows: list[dict[str, Any]], key: str, warm: int = 1) -> float:
    steady = rows[warm:] or rows
    return statistics.median(r[key] for r in steady)


def _mxrefit_row(report: RefitReport, mem: PeakMemory) -> dict[str, Any]:
    return {
        "total_s": report.total_s,
        "check_s": report.check_s,
        "pack_s": report.pack_s,
        "wait_s": report.wait_s,
        "engine_s": report.engine_apply_s,
        "post_s": report.engine_process_s + report.engine_after_refit_s,
        "bytes": report.bytes,
        "buckets": report.buckets,
        "transport": report.transport,
        "replanned": report.replanned,
        "trainer_peak_extra_bytes": mem.trainer_extra_bytes,
        "device_peak_extra_bytes": mem.extra_bytes,
    }


def _summary(rows: list[dict[str, Any]], keys: tuple[str, ...], warm: int = 1) -> dict[str, Any]:
    """Medians after the first ``warm`` refits; peaks as the largest of every refit."""
    out: dict[str, Any] = {k: _median(rows, k, warm) for k in keys}
    out["bytes"] = rows[-1]["bytes"]
    out["GBps"] = out["bytes"] / out["total_s"] / 1e9
    for k in ("trainer_peak_extra_bytes", "device_peak_extra_bytes"):
        out[k] = max(r[k] for r in rows)
    out["per_step"] = rows
    return out


def _compare(own: dict[str, dict], mine: dict[str, dict]) -> dict[str, Any]:
    """The engine's kernel state after vLLM's own path against after mxrefit's refit of the same weights."""
    names = sorted(set(own) | set(mine))
    return {
        "params_checked": len(names),
        "tensors_checked": len(names),
        "mismatched": [n for n in names if own.get(n) != mine.get(n)],
    }


def run_vllm(
    weights: dict[str, torch.Tensor],
    shape: ModelShape,
    device: torch.device,
    *,
    fmt: str,
    experts: str,
    steps: int,
    bucket_bytes: int,
    timeout_s: float,
    step: Callable[[int], None],
    on_step: Callable[[], None] | None = None,
    work: str | None = None,
) -> dict[str, Any]:
    """``steps`` refits by mxrefit, then ``steps`` by vLLM's own path, of ``weights`` into one vLLM
    started here from ``shape``; ``step(i)`` changes the weights before refit ``i`` as the bench's
    modes do; then the bit-exactness check. ``work``: the folder for the config (a temporary one by default)."""
    why = unavailable(device, shape, fmt)
    if why:
        raise RuntimeError(why)
    # vLLM's own IPC path sends torch's rebuild_cuda_tensor arguments (a torch dtype among them) over
    # vLLM's msgspec RPC, which refuses them unless its pickle fallback is allowed; the engine is the
    # bench's own, in this process and its children, so the bench allows it unless the user said otherwise
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="mxrefit_peer_vllm_") as tmp:
        path = config_dir(os.path.join(work or tmp, f"{shape.name.replace('@', '_')}_{fmt}"), shape, fmt)
        kwargs = engine_kwargs(path, gpu_util=free_fraction(device))
        learned = learned_layout_mode(device.type)  # a bad MXREFIT_LEARNED_LAYOUT is named before vLLM starts
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        engine: dict[str, Any] = {
            "vllm": getattr(importlib.import_module("vllm"), "__version__", "unknown"),
            "start_s": time.perf_counter() - t0,
            "kwargs": {k: v for k, v in kwargs.items() if k != "model"},
            "learned_layout": learned,
        }
        try:
            sender, info = start_mxrefit(llm, device, experts=experts, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
            engine["mxrefit_init"] = info

            def refit(i: int) -> dict[str, Any]:
                step(i)
                row = _mxrefit_row(*mxrefit_refit(llm, sender, weights))
                if on_step is not None:
                    on_step()
                return row

            try:
                mine, settled = refit_until_settled(refit, steps)
            finally:
                sender.close()
                llm.collective_rpc("mxrefit_close")
            quantize, engine["own_quantizer"] = own_quantizer(device) if fmt == "mxfp8" else (None, None)
            own = []
            for i in range(steps):
                step(len(mine) + i)
                own.append(own_refit(llm, weights, fmt, quantize))
                if on_step is not None:
                    on_step()
            # the same weights again through mxrefit, into fresh tables (vLLM's own load may have moved params)
            sender, _ = start_mxrefit(llm, device, experts=experts, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
            try:
                after_own = llm.collective_rpc("mxrefit_kernel_state")[0]
                mxrefit_refit(llm, sender, weights)
                after_mxrefit = llm.collective_rpc("mxrefit_kernel_state")[0]
            finally:
                sender.close()
                llm.collective_rpc("mxrefit_close")
        finally:
            shutdown(llm)
    result = _summary(own, ("total_s", "start_s", "send_load_s", "trainer_quantize_s", "finish_s"))
    warm = settled_at(mine)
    result["mxrefit"] = {
        **_summary(mine, ("total_s", "check_s", "pack_s", "wait_s", "engine_s", "post_s"), warm),
        "transport": mine[-1]["transport"],
        "settle": {
            "refits": warm,
            "total_s": sum(r["total_s"] for r in mine[:warm]),
            "replans": sum(bool(r["replanned"]) for r in mine),
            "settled": settled,
            "steady_refits": len(mine) - warm,
        },
    }
    result["speedup"] = result["total_s"] / result["mxrefit"]["total_s"]
    result["check"] = _compare(after_own, after_mxrefit)
    result["engine"] = engine
    return result
