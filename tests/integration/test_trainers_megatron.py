"""The Megatron stream: a tiny Megatron-core model (TP=PP=EP=1) exported through Megatron-Bridge.

Needs the optional extra ``mxrefit[megatron]``; skipped where Megatron-Bridge does not import
(it imports Transformer Engine, whose PyTorch extension only builds with CUDA). On CPU the model
uses Megatron-core's own layers (``local_layer_spec``) on a one-process gloo group.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

bridge_pkg = pytest.importorskip(
    "megatron.bridge", reason="Megatron-Bridge is not installed (optional extra mxrefit[megatron]; it needs Transformer Engine)"
)

from mxrefit.plan.shapes import ModelShape, hf_tensor_specs  # noqa: E402
from mxrefit.source.megatron import MegatronSource  # noqa: E402
from mxrefit.source.sender import Sender  # noqa: E402
from tests.helpers import models  # noqa: E402
from tests.helpers.trainer_procs import EngineProcess, expected_mismatches  # noqa: E402


@pytest.fixture(scope="module")
def process_group():
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdzv", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()


def _megatron_from_hf(hf_model, tmp_path):
    """Save ``hf_model``, build the Megatron model Bridge derives from it, load the HF weights."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    path = str(tmp_path / "hf")
    hf_model.save_pretrained(path)
    bridge = AutoBridge.from_hf_pretrained(path, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = provider.expert_model_parallel_size = 1
    on_cpu = not torch.cuda.is_available()
    if on_cpu:  # no Transformer Engine kernels: Megatron-core's own layers, nothing fused
        provider.transformer_layer_spec = local_layer_spec
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        provider.moe_token_dispatcher_type = "allgather"
        for flag in (
            "gradient_accumulation_fusion",
            "masked_softmax_fusion",
            "bias_activation_fusion",
            "bias_dropout_fusion",
            "apply_rope_fusion",
            "persist_layer_norm",
        ):
            setattr(provider, flag, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=on_cpu, bf16=True)
    bridge.load_hf_weights(model)
    return bridge, model, path


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_tied_llama_streams_checkpoint_tensors_and_refits(process_group, tmp_path):
    hf = models.tiny_llama(seed=31, tied=True)
    bridge, model, path = _megatron_from_hf(hf, tmp_path)
    source = MegatronSource(bridge, model)
    assert source.tied
    specs = source.specs()
    shape = ModelShape.from_hf_config(hf.config)
    assert sorted((s.name, s.shape, s.dtype) for s in specs) == sorted(hf_tensor_specs(shape))
    saved = _checkpoint(path)
    streamed = dict(source)
    assert [s.name for s in specs] == list(streamed) and "lm_head.weight" not in streamed
    # q/k/v come back out of Megatron's per-KV-group interleaved linear_qkv, gate/up out of linear_fc1
    assert all(torch.equal(t.cpu(), saved[n]) for n, t in streamed.items())

    engine = EngineProcess({"kind": "torch", "model": "llama_tied", "mxfp8": True})
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10)
    try:
        sender.plan(specs)
        sender.refit(dict(source))
        dests = sender._tables[1]
    except BaseException:
        engine.stop(sender)
        raise
    got = engine.stop(sender)
    assert expected_mismatches(dests, streamed, got) == []
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Megatron-Bridge exports experts from Transformer Engine's grouped GEMM (linear_fc1.weight{e}); "
    "Megatron-core's CPU SequentialMLP names fail its gather_from_ep_ranks",
)
def test_qwen3_moe_streams_per_expert_checkpoint_tensors_and_refits(process_group, tmp_path):
    hf = models.tiny_qwen3_moe(seed=32)
    bridge, model, path = _megatron_from_hf(hf, tmp_path)
    source = MegatronSource(bridge, model)
    specs = source.specs()
    shape = ModelShape.from_hf_config(hf.config)
    assert sorted((s.name, s.shape, s.dtype) for s in specs) == sorted(hf_tensor_specs(shape, experts="per_expert"))
    saved = _checkpoint(path)
    streamed = {n: t.cpu() for n, t in source}
    assert all(torch.equal(t, saved[n]) for n, t in streamed.items())

    engine = EngineProcess({"kind": "vllm_layout", "model": "moe", "mxfp8": True, "experts": "per_expert"})
    sender = Sender(engine.address, engine.token, bucket_bytes=32 << 10)
    try:
        sender.plan([s for s in specs])
        sender.refit(streamed)
        dests = sender._tables[1]
    except BaseException:
        engine.stop(sender)
        raise
    assert expected_mismatches(dests, streamed, engine.stop(sender)) == []
