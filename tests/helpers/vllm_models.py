"""Tiny policies for the real-vLLM tests: built from configs, trained for real on a toy task,
and compared with vLLM's greedy tokens and prompt logprobs."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 512
PROMPTS = [[1, 2, 3, 4], [7, 100, 5], [300, 301], [42, 17, 250, 9, 11]]


def qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def qwen3_dense(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def qwen3_dense_fp8(seed: int):
    """A dense Qwen3 vLLM can hold in 128x128 block FP8: q and k partitions of 256 and 128 rows,
    gate/up of 640 (every fused partition starts on a tile); hidden 320 leaves partial edge tiles."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=320,
        intermediate_size=640,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def qwen2(seed: int):
    """An architecture mxrefit's layout tables do not know (biases on q/k/v): vLLM's loader path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def train_steps(model, steps: int, *, seed: int, lr: float = 3e-3) -> None:
    """Real AdamW steps on a toy objective: after token t comes (7t + 3) mod V.

    A handful of steps makes greedy decoding mostly decisive; where a near-tie remains, kernels
    that round differently may still break it apart, hence ``greedy_gap``.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (16, 1), generator=g)
        seq = [start]
        for _ in range(11):
            seq.append((seq[-1] * 7 + 3) % VOCAB)
        ids = torch.cat(seq, dim=1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def model_logits(model, ids: list[int]) -> torch.Tensor:
    """The HF model's float32 logits at every position of one sequence."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_prompt_logprobs(model, prompts=PROMPTS) -> list[list[float]]:
    out = []
    for p in prompts:
        logits = model_logits(model, p)
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(p[1:]).view(-1, 1)).view(-1)
        out.append(lp.tolist())
    return out


def vllm_greedy(llm, prompts=PROMPTS, new_tokens: int = 8) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=new_tokens, temperature=0), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def vllm_prompt_logprobs(llm, prompts=PROMPTS) -> list[list[float]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    result = []
    for p, o in zip(prompts, outs):
        result.append([o.prompt_logprobs[i][tok].logprob for i, tok in enumerate(p) if i > 0])
    return result


def dequantized_copy(model, fmt: str = "mxfp8"):
    """The trainer model as an engine holding ``fmt`` ("mxfp8", "fp8-block", "fp8-block-ue8m0")
    holds it: eligible weights through that format's quantize/dequantize."""
    from mxrefit.formats import fp8_block, mxfp8
    from mxrefit.plan.eligibility import DEFAULT_RULES

    roundtrip = {
        "mxfp8": lambda w: mxfp8.dequantize(*mxfp8.quantize(w, backend="torch")),
        "fp8-block": lambda w: fp8_block.dequantize(*fp8_block.quantize(w, backend="torch")),
        "fp8-block-ue8m0": lambda w: fp8_block.dequantize(*fp8_block.quantize(w, use_ue8m0=True, backend="torch")),
    }[fmt]
    ref = copy.deepcopy(model)
    quantized = DEFAULT_RULES.decide((n, tuple(p.shape)) for n, p in ref.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if quantized[name]:
                p.copy_(roundtrip(p.detach()))
    return ref


def start_llm(path: str, worker_extension_cls: str = "mxrefit.integrations.vllm.worker.RefitWorkerExtension", **kwargs):
    from vllm import LLM

    return LLM(
        model=path,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        worker_extension_cls=worker_extension_cls,
        **kwargs,
    )


def stop_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


LOGPROB_ATOL = 0.08  # BF16 end to end through two different kernel stacks


def sha256_of(t: torch.Tensor) -> str:
    """Digest of a tensor's raw bytes, for byte-identity checks across processes."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def refit(llm, sender, model):
    """One refit of a running vLLM (worker extension) from the model's current parameters."""
    from mxrefit.integrations.vllm.client import refit_while

    weights = {n: p.detach() for n, p in model.named_parameters()}
    return refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)


@torch.no_grad()
def greedy_gap(reference, completions: list[list[int]], prompts=PROMPTS) -> float:
    """How far below the reference's best token (in its log-probability) the worst of the given
    completion tokens lies, the reference reading each prompt + completion as it stands.

    Two kernel stacks that round differently may break a near-tie each their own way and go on
    to different continuations, so greedy tokens are not compared token by token with a forward
    of another stack: each token is checked to be the reference's greedy choice up to rounding
    (``LOGPROB_ATOL``) at the point where the engine chose it.
    """
    worst = 0.0
    for p, c in zip(prompts, completions, strict=True):
        if not c:
            continue
        logits = model_logits(reference, p + c)[len(p) - 1 : -1]
        lp = torch.log_softmax(logits, dim=-1)
        gaps = lp.max(dim=-1).values - lp.gather(1, torch.tensor(c).view(-1, 1)).view(-1)
        gap = gaps.max().item()
        assert math.isfinite(gap), f"the reference's log-probabilities over {p} + {c} are not finite"
        worst = max(worst, gap)
    return worst


def assert_matches(llm, reference) -> None:
    """vLLM's greedy tokens are the reference's greedy choices (``greedy_gap``) and its prompt
    logprobs are within LOGPROB_ATOL of the reference's."""
    tokens = vllm_greedy(llm)
    gap = greedy_gap(reference, tokens)
    assert gap < LOGPROB_ATOL, f"a greedy token of vLLM lies {gap:.3f} below the reference's best choice"
    got, want = vllm_prompt_logprobs(llm), hf_prompt_logprobs(reference)
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst < LOGPROB_ATOL, f"prompt logprobs differ by up to {worst:.3f}"


def assert_same_as_fresh(
    llm, start: Callable[[], Any], init: dict | None = None, kernel: bool = True, generate: bool = True
) -> None:
    """The independent oracle: a second, fresh vLLM that ``start`` launches from the same
    weights saved as a checkpoint (same format and settings) must give exactly the refitted
    engine's greedy tokens and prompt logprobs, and (``kernel``) the same kernel state on every
    worker: each parameter's bytes, and the outputs of kernels that hold packed copies
    (``VllmEngine.kernel_state``). Same kernels and same weights: equal, not close.
    ``generate=False`` compares the kernel state only (an engine that cannot generate)."""
    run = (lambda e: (vllm_greedy(e), vllm_prompt_logprobs(e))) if generate else (lambda e: None)
    served = run(llm)
    state = llm.collective_rpc("mxrefit_kernel_state") if kernel else None
    fresh = start()
    try:
        fresh_served = run(fresh)
        if kernel:
            fresh.collective_rpc("mxrefit_init", kwargs=init or {})
            fresh_state = fresh.collective_rpc("mxrefit_kernel_state")
    finally:
        stop_llm(fresh)
    if served is not None:
        assert served[0] == fresh_served[0], "greedy tokens differ from a fresh vLLM started from the same weights"
        assert served[1] == fresh_served[1], "prompt logprobs differ from a fresh vLLM started from the same weights"
    if kernel:
        for rank, (mine, theirs) in enumerate(zip(state, fresh_state, strict=True)):
            unrun = sorted(n for n, d in mine.items() if str(d.get("kernel_output", "")).startswith("not run"))
            assert not unrun, f"worker {rank}: the kernels of {unrun} did not run on kernel_state's probe"
            differ = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
            assert not differ, f"worker {rank}: kernel state differs from a fresh vLLM's in {differ}"
