"""A dense FP8-block checkpoint written by ``fp8_block.quantize`` runs in vLLM 0.32's CPU build.

vLLM's CPU block-FP8 linear kernels need AMX (Sapphire Rapids or newer); elsewhere engine start
fails with "Failed to find a kernel that can implement the ScaledMM linear layer". The child
process registers a torch emulation kernel (dequantize with ``fp8_block.dequantize``, then
``F.linear``; ``tests/helpers/fp8_block_emulation.py``) for the CPU platform, as the MXFP8 tests register vLLM's own MXFP8 emulation,
then loads the checkpoint through vLLM's ``Fp8Config`` (``weight_block_size: [128, 128]``):
the parameters are vLLM's block-FP8 ones, their bytes are ours, and its log-probabilities are
those of transformers running the dequantized weights. A second child builds Qwen3-MoE models
(dummy weights) to pin the expert parameters, including vLLM's refined scale grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.helpers import vllm_models as vm

PROMPT = [1, 2, 3, 4]


def _write_checkpoint(path: str) -> dict[str, str]:
    """A tiny random Qwen3 as transformers saves it, linear weights FP8-block; returns sha256 of each tensor."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mxrefit.formats import fp8_block

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        initializer_range=0.2,
    )  # large weights: peaked logits, so log-probabilities discriminate
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(os.path.join(path, "bf16"))
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("_proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = fp8_block.quantize(p, name=name)
        else:
            tensors[name] = p.contiguous()
    os.makedirs(os.path.join(path, "fp8"))
    save_file(tensors, os.path.join(path, "fp8", "model.safetensors"))
    raw = cfg.to_dict()
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    with open(os.path.join(path, "fp8", "config.json"), "w") as f:
        json.dump(raw, f)
    return {n: vm.sha256_of(t) for n, t in tensors.items()}


def _engine_params(worker) -> list:
    return [[n, list(p.shape), str(p.dtype), vm.sha256_of(p.data)] for n, p in worker.model_runner.model.named_parameters()]


def _child(out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process, where the kernel is registered
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from mxrefit.formats import fp8_block
    from tests.helpers.fp8_block_emulation import register_emulation_kernel  # imports vLLM: only in the child

    work = tempfile.mkdtemp()
    sent = _write_checkpoint(work)
    register_emulation_kernel()
    llm = LLM(
        model=os.path.join(work, "fp8"),
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.2,
        max_model_len=256,
        enforce_eager=True,
        distributed_executor_backend="uni",
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0, logprobs=5))
    params = llm.collective_rpc(_engine_params)[0]

    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(work, "fp8", "model.safetensors"))
    tokens = list(out[0].outputs[0].token_ids)
    ref_logprobs = {}
    for kind in ("dequantized", "bf16"):  # transformers on the checkpoint's weights, and on the unquantized ones
        ref = AutoModelForCausalLM.from_pretrained(os.path.join(work, "bf16"), dtype=torch.bfloat16)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if kind == "dequantized" and n + "_scale_inv" in ckpt:
                    p.copy_(fp8_block.dequantize(ckpt[n], ckpt[n + "_scale_inv"]))
            logits = ref(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
        ref_logprobs[kind] = torch.log_softmax(logits, dim=-1)
    # per generated position, for vLLM's top-5 tokens: (vLLM, transformers dequantized, transformers bf16) logprobs
    pairs = [
        [
            [lp.logprob, float(ref_logprobs["dequantized"][i, tok]), float(ref_logprobs["bf16"][i, tok])]
            for tok, lp in step.items()
        ]
        for i, step in enumerate(out[0].outputs[0].logprobs)
    ]
    expected_fused = {}
    for i in range(2):
        p = f"model.layers.{i}"
        for fused, parts in (
            ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
        ):
            for suffix in ("weight", "weight_scale_inv"):
                prefix = p + "." + fused.split(".")[0]
                expected_fused[f"{p}.{fused}.{suffix}"] = vm.sha256_of(
                    torch.cat([ckpt[f"{prefix}.{part}.{suffix}"] for part in parts])
                )
    with open(out_path, "w") as f:
        json.dump({"logprob_pairs": pairs, "params": params, "sent": sent, "fused": expected_fused}, f)


def _moe_child(out_path: str) -> None:
    """Build Qwen3-MoE Fp8Config block models (dummy weights) and record their parameters."""
    from transformers import Qwen3MoeConfig
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests.helpers.fp8_block_emulation import register_emulation_kernel  # imports vLLM: only in the child

    register_emulation_kernel()
    work = tempfile.mkdtemp()
    results = {}
    for n, inter in enumerate((256, 192)):  # 192: not a multiple of 128, vLLM refines the scale grid
        cfg = Qwen3MoeConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=inter,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        d = os.path.join(work, str(n))
        cfg.save_pretrained(d)
        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
            "ignored_layers": ["model.layers.0.mlp.gate"],
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(raw, f)
        vc = EngineArgs(
            model=d, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=128
        ).create_engine_config()
        with set_current_vllm_config(vc):
            if n == 0:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"file://{os.path.join(work, 'dist')}",
                )
                initialize_model_parallel(1, 1)
            with set_default_torch_dtype(torch.bfloat16):
                model = initialize_model(vc)
        results[str(inter)] = [[k, list(p.shape), str(p.dtype)] for k, p in model.named_parameters()]
    with open(out_path, "w") as f:
        json.dump(results, f)


def _run_child(mode: str) -> dict:
    pytest.importorskip("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)
        proc = subprocess.run(
            [sys.executable, __file__, mode, out], capture_output=True, text=True, timeout=600, env=env, cwd=root
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def vllm_run() -> dict:
    return _run_child("dense")


@pytest.mark.vllm
def test_vllm_moe_fp8_block_parameters():
    got = _run_child("moe")
    experts = "model.layers.0.mlp.experts.routed_experts"
    f8, f32 = "torch.float8_e4m3fn", "torch.float32"
    for inter, grid in (("256", 128), ("192", 64)):
        params = {n: (tuple(s), d) for n, s, d in got[inter]}
        i = int(inter)
        assert params[f"{experts}.w13_weight"] == ((4, 2 * i, 256), f8)
        assert params[f"{experts}.w2_weight"] == ((4, 256, i), f8)
        assert params[f"{experts}.w13_weight_scale_inv"] == ((4, 2 * -(-i // grid), 256 // grid), f32)
        assert params[f"{experts}.w2_weight_scale_inv"] == ((4, 256 // grid, -(-i // grid)), f32)
        assert params["model.layers.0.mlp.gate.weight"] == ((4, 256), "torch.bfloat16")
        assert params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ((4, 2), f32)


@pytest.mark.vllm
def test_vllm_holds_fp8_block_params_with_our_bytes(vllm_run):
    params = {n: (tuple(s), d, h) for n, s, d, h in vllm_run["params"]}
    layer = "model.layers.0"
    assert params[f"{layer}.self_attn.qkv_proj.weight"][:2] == ((512, 256), "torch.float8_e4m3fn")
    assert params[f"{layer}.self_attn.qkv_proj.weight_scale_inv"][:2] == ((4, 2), "torch.float32")
    assert params[f"{layer}.mlp.down_proj.weight_scale_inv"][:2] == ((2, 5), "torch.float32")
    assert params["lm_head.weight"][1] == "torch.bfloat16" and params["model.embed_tokens.weight"][1] == "torch.bfloat16"
    sent, fused = vllm_run["sent"], vllm_run["fused"]
    for name, (_, _, sha) in params.items():
        if name.endswith(("q_scale", "k_scale", "v_scale", "prob_scale")):
            continue  # KV-cache scales: no checkpoint tensor feeds them
        want = fused.get(name, sent.get(name))
        assert want == sha, f"{name}: vLLM's bytes are not the checkpoint's"


@pytest.mark.vllm
def test_vllm_computes_what_transformers_does_with_the_dequantized_weights(vllm_run):
    """vLLM's top-5 log-probabilities at each of 8 greedy steps, against transformers' on the same tokens:
    close to the run on the dequantized checkpoint, measurably farther from the unquantized weights."""
    triples = [t for step in vllm_run["logprob_pairs"] for t in step]
    to_dequantized = max(abs(v - d) for v, d, _ in triples)
    to_bf16 = max(abs(v - b) for v, _, b in triples)
    assert len(triples) == 40 and to_dequantized < 0.2 and to_bf16 > 4 * to_dequantized, (to_dequantized, to_bf16)


if __name__ == "__main__":
    (_child if sys.argv[1] == "dense" else _moe_child)(sys.argv[2])
