"""`--peer vllm`: the config folder vLLM starts from, the checkpoint stream of its own path, and
the refusals where it cannot run (CPU, this vLLM's trainer API, a shape or format it cannot take).

The run itself needs CUDA and a vLLM with 0.26's IPC trainer call: not run here (docs/benchmarks.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mxrefit.bench.peer import unavailable as peer_unavailable
from mxrefit.bench.peer_vllm import (
    SETTLE_MAX,
    checkpoint_stream,
    config_dir,
    hf_config,
    own_quantizer,
    pick_quantizer,
    refit_until_settled,
    settled_at,
    unavailable,
)
from mxrefit.formats import mxfp8
from mxrefit.plan.eligibility import DEFAULT_RULES
from mxrefit.plan.shapes import BUILTIN, ModelShape, hf_tensor_specs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("model", "fmt"), [("qwen3-30b-a3b", "mxfp8"), ("qwen3-32b", "bf16"), ("tiny-qwen3-moe", "mxfp8")])
def test_the_config_folder_reads_back_as_the_shape(tmp_path, model, fmt):
    shape = BUILTIN[model]
    path = config_dir(tmp_path / model, shape, fmt)
    config = transformers.AutoConfig.from_pretrained(path)
    assert ModelShape.from_hf_config(config, name=model) == shape
    assert config.architectures == ["Qwen3MoeForCausalLM" if shape.is_moe else "Qwen3ForCausalLM"]
    if shape.is_moe:
        assert config.num_experts_per_tok == min(8, shape.experts)
    quant = tmp_path / model / "hf_quant_config.json"
    if fmt == "mxfp8":
        block = json.loads(quant.read_text())["quantization"]
        assert block["quant_algo"] == "MXFP8" and block["exclude_modules"] == DEFAULT_RULES.exclude_modules(shape.layers)
        assert json.loads((tmp_path / model / "config.json").read_text())["quantization_config"]["quantization"] == block
    else:
        assert not quant.exists() and getattr(config, "quantization_config", None) is None


def test_the_layer_count_follows_the_bench(tmp_path):
    shape = replace(BUILTIN["qwen3-30b-a3b"], name="qwen3-30b-a3b@24l", layers=24)
    config = transformers.AutoConfig.from_pretrained(config_dir(tmp_path, shape, "mxfp8"))
    assert config.num_hidden_layers == 24 and config.moe_intermediate_size == 768 and config.num_experts == 128


def test_a_shard_preset_is_refused_by_name():
    with pytest.raises(ValueError, match="qwen3-235b-a22b-ep8: one rank's share of a model served at TP=8, EP=8"):
        hf_config(BUILTIN["qwen3-235b-a22b-ep8"])
    llama = ModelShape(
        "tiny-llama", hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=128, intermediate=128, arch="llama"
    )
    with pytest.raises(ValueError, match="tiny-llama: a llama shape"):
        hf_config(llama)
    with pytest.raises(ValueError, match="not 'fp8-block'"):
        hf_config(BUILTIN["qwen3-32b"], "fp8-block")


def test_on_cpu_every_missing_piece_is_named_in_one_line():
    why = unavailable(torch.device("cpu"), BUILTIN["qwen3-235b-a22b-ep8"], "fp8-block")
    assert why.startswith("--peer vllm cannot run here: it needs CUDA") and "\n" not in why
    assert "this run's device is cpu" in why
    assert "--format fp8-block: vLLM's own path is written here for mxfp8 and bf16 checkpoints" in why
    assert "model qwen3-235b-a22b-ep8: one rank's share" in why
    assert peer_unavailable("vllm", torch.device("cpu"), BUILTIN["qwen3-235b-a22b-ep8"], "fp8-block") == why


def test_the_installed_vllm_is_judged_by_its_files():
    """vLLM 0.32 (CPU build here) moved the trainer side to IPCTrainerWeightTransferEngine: named, not run."""
    vllm = pytest.importorskip("vllm")
    ipc = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    why = unavailable(torch.device("cpu"), BUILTIN["qwen3-30b-a3b"], "mxfp8")
    if hasattr(ipc.IPCWeightTransferEngine, "trainer_send_weights"):
        assert "trainer_send_weights" not in why
    else:
        assert f"this vLLM ({vllm.__version__})'s IPC engine has no IPCWeightTransferEngine.trainer_send_weights" in why


def test_an_unknown_peer_lists_both():
    assert "unknown peer; known: checkpoint-engine, vllm" in peer_unavailable("nccl", torch.device("cpu"))


def test_the_bench_refuses_before_any_work():
    from mxrefit.bench.run import bench

    with pytest.raises(RuntimeError, match="--peer vllm cannot run here: it needs CUDA"):
        bench(device="cpu", peers=("vllm",), progress=False)


def _weights(shape: ModelShape, experts: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).mul_(0.02).to(dt) for n, s, dt in hf_tensor_specs(shape, experts=experts)}


def test_the_bf16_stream_is_the_trainer_tensors_as_they_are():
    weights = _weights(replace(BUILTIN["tiny-qwen3-moe"], layers=1), "per_expert")
    stats: dict[str, float] = {}
    assert list(checkpoint_stream(weights, "bf16", stats)) == list(weights.items())
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in weights.values()) and stats["quantize_s"] == 0


@pytest.mark.parametrize("experts", ["grouped", "per_expert"])
def test_the_mxfp8_stream_holds_modelopt_checkpoint_names(experts):
    """Grouped slabs come out as the per-expert tensors a ModelOpt checkpoint holds (gate rows first),
    each quantized tensor with its uint8 ``_scale`` beside it, by vLLM's own quantizer."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

    shape = replace(BUILTIN["tiny-qwen3-moe"], layers=1)
    weights = _weights(shape, experts)
    stream = dict(checkpoint_stream(weights, "mxfp8", {}))
    per_expert = {n: t.shape for n, t, _ in [(n, torch.empty(s), dt) for n, s, dt in hf_tensor_specs(shape)]}
    decided = DEFAULT_RULES.decide(per_expert.items())
    want = {n for n in per_expert} | {n + "_scale" for n, q in decided.items() if q}
    assert set(stream) == want
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    source = weights[gate] if experts == "per_expert" else weights["model.layers.0.mlp.experts.gate_up_proj"][3, :128]
    q, s = mxfp8_e4m3_quantize(source.contiguous())
    assert torch.equal(stream[gate].view(torch.uint8), q.view(torch.uint8))
    assert stream[gate + "_scale"].dtype == torch.uint8 and torch.equal(stream[gate + "_scale"], s.view(torch.uint8))


def _floor_rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.26's MXFP8 rule, written out here: scale byte floor(log2(amax)) + 127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    sb = (torch.floor(torch.log2(amax)) + 127).clamp(0, 254)
    q = (blocks / torch.exp2(sb - 127).unsqueeze(-1)).reshape(x.shape).to(torch.float8_e4m3fn)
    return q, sb.to(torch.uint8)


def test_vllms_own_quantizer_is_kept_where_it_writes_the_modelopt_rule():
    pytest.importorskip("vllm")
    quantize, info = own_quantizer(torch.device("cpu"))
    assert info["modelopt_rule"] is True and info["function"].endswith("'s mxfp8_e4m3_quantize"), info
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

    assert quantize is mxfp8_e4m3_quantize


def test_a_quantizer_of_another_rule_is_replaced_by_mxrefits_and_the_reason_named():
    """vLLM 0.26's rule writes other checkpoint bytes: the own path would then load another checkpoint
    than mxrefit refits, and the bench's byte check would compare quantizers, not transfers."""
    quantize, info = pick_quantizer(_floor_rule, "the floor rule", torch.device("cpu"))
    assert info["modelopt_rule"] is False and info["function"] == "mxrefit.formats.mxfp8.quantize"
    assert info["why"].startswith("the floor rule writes other bytes than a ModelOpt MXFP8 checkpoint holds: ")
    differ = int(info["why"].split(": ")[1].split(" of ")[0])
    assert differ > 0
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got, want = quantize(w), mxfp8.quantize(w, backend="torch")
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    stream = dict(checkpoint_stream({"model.layers.0.self_attn.o_proj.weight": w}, "mxfp8", {}, quantize))
    assert torch.equal(stream["model.layers.0.self_attn.o_proj.weight_scale"], want[1])


def test_a_quantizer_that_fails_on_the_probe_is_replaced_and_its_error_named():
    def broken(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("no kernel for this device")

    _, info = pick_quantizer(broken, "broken", torch.device("cpu"))
    assert info["modelopt_rule"] is False
    assert info["why"].endswith("it failed on a probe: RuntimeError: no kernel for this device")


def _scripted(replans: set[int], totals: dict[int, float] | None = None):
    """Refit rows as mxrefit's path reports them: ``replanned`` at the given refits."""
    calls: list[int] = []

    def refit(i: int) -> dict:
        calls.append(i)
        return {"replanned": i in replans, "total_s": (totals or {}).get(i, 0.05)}

    return refit, calls


def test_without_planning_again_the_path_runs_steps_refits_and_the_first_is_the_warm_up():
    refit, calls = _scripted(set())
    rows, settled = refit_until_settled(refit, steps=3)
    assert settled and calls == [0, 1, 2] and settled_at(rows) == 1


def test_the_learning_refits_are_run_apart_and_the_medians_come_after_them():
    # the H100's learned-layout run of 2026-12-07: refit 0 learns vLLM's layout, refit 1 plans again
    # to write it; with `steps` rows only, the median mixed refit 1 (2.5 s) with a steady one (57 ms)
    refit, calls = _scripted({1}, {0: 5.0, 1: 2.52})
    rows, settled = refit_until_settled(refit, steps=3)
    assert settled and calls == [0, 1, 2, 3] and settled_at(rows) == 2
    assert [r["total_s"] for r in rows[settled_at(rows) :]] == [0.05, 0.05]


def test_a_path_that_keeps_planning_again_stops_and_says_so():
    refit, calls = _scripted(set(range(1, 100)))
    rows, settled = refit_until_settled(refit, steps=3)
    assert not settled and len(calls) == 3 + SETTLE_MAX
    assert settled_at(rows) == len(rows) - 1  # its medians are the last refit's


def test_one_step_still_times_a_refit_after_the_warm_up():
    refit, calls = _scripted(set())
    rows, settled = refit_until_settled(refit, steps=1)
    assert settled and calls == [0, 1] and settled_at(rows) == 1


def test_the_open_ended_bar_never_reads_full_before_its_run_returns():
    """The settling refits are not known ahead: five refits against a planned four."""
    from rich.progress import Progress

    from mxrefit.bench.run import advance_open_ended, task_of

    with Progress(disable=True) as bar:
        task = bar.add_task("refits", total=4)
        plain = bar.add_task("negative control", total=4)
        for _ in range(5):
            advance_open_ended(bar, task)
            bar.advance(plain)
            t = task_of(bar, task)
            assert t.total is not None and t.completed < t.total
        assert task_of(bar, plain).finished  # the plain advance reads full early
        bar.update(task, total=task_of(bar, task).completed)
        assert task_of(bar, task).finished
