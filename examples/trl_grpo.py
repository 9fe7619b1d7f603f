"""TRL's GRPOTrainer with its colocated vLLM refitted through mxrefit (CPU, a few minutes).

A tiny Qwen3 (2 layers, hidden 128, vocabulary 512, 16 warm-up LM steps, FP32 master weights)
with a word-level tokenizer built with ``tokenizers`` (words ``t0`` .. ``t509``, pad, eos), 4
prompts of 4 random words, 4 completions of 8 tokens each, a toy reward (the fraction of completion tokens whose id is
a multiple of 16), ``--steps`` GRPO steps of TRL's real ``GRPOTrainer`` with ``use_vllm=True,
vllm_mode="colocate"``: every step starts with one mxrefit refit of the policy into vLLM.

After training the engine gets one last refit (the final weights) and the script records vLLM's
greedy completions, and the log-probabilities of prompt + completion, after that refit and
after TRL's own parameter walk (MXFP8: quantized as a ModelOpt checkpoint) fed through vLLM's
own ``reload_weights``; and HF's forward over those completions on the trainer's weights as
vLLM holds them (BF16, or MXFP8 round-tripped): its log-probabilities and how far below its
own best choice each greedy token lies.

``--sync``: ``mxrefit`` (``MxrefitGRPOTrainer``), ``trl`` (plain ``GRPOTrainer``, TRL's own
per-tensor ``load_weights``, which fails on vLLM 0.32's CPU build where it prepacks linear
weights, see docs/integrations.md) or
``none`` (mxrefit's engine set-up with refits disabled: vLLM keeps sampling the step-0 weights,
the control the test runs).

    VLLM_CPU_KVCACHE_SPACE=1 python examples/trl_grpo.py --format mxfp8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

VOCAB = 512
TARGET_EVERY = 16
PROMPT_LEN = 4
PAD, EOS = "<pad>", "<eos>"  # ids 510 and 511: the last two words of the vocabulary


def build_policy(path: str, seed: int, warmup_steps: int = 16) -> None:
    """A tiny Qwen3 and its word-level tokenizer, saved as a BF16 checkpoint at ``path``.

    Why ``warmup_steps``: a few AdamW steps on a toy sequence task (after t comes 7t + 3 mod 510)
    make greedy decoding decisive, so vLLM's and HF's greedy tokens can be compared although
    their BF16 kernels round differently (a random init's near-uniform logits tie)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {PAD: VOCAB - 2, EOS: VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=VOCAB - 1,
        pad_token_id=VOCAB - 2,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(warmup_steps):
        seq = [torch.randint(0, VOCAB - 2, (16, 1), generator=g)]
        for _ in range(11):
            seq.append((seq[-1] * 7 + 3) % (VOCAB - 2))
        ids = torch.cat(seq, dim=1)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def reward(completion_ids: list[list[int]], **_) -> list[float]:
    """Fraction of completion tokens whose id is a multiple of 16 (6% by chance)."""
    return [sum(t % TARGET_EVERY == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainer_class(sync: str) -> type:
    if sync == "trl":
        from trl import GRPOTrainer

        return GRPOTrainer
    from mxrefit.integrations.trl import MxrefitGRPOTrainer, MxrefitVLLMGeneration

    if sync == "mxrefit":
        return MxrefitGRPOTrainer

    class StaleGeneration(MxrefitVLLMGeneration):
        def sync_weights(self) -> None:  # refits disabled: the control
            (self.vllm_client if self.mode == "server" else self.llm).reset_prefix_cache()

    class StaleTrainer(MxrefitGRPOTrainer):
        generation_class = StaleGeneration

    return StaleTrainer


def engine_outputs(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """vLLM's greedy completions and its log-probability of every token of prompt + completion."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [
        list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    ]
    seqs = [p + t for p, t in zip(prompts, tokens)]
    scored = llm.generate(
        [{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    logprobs = [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(s) if i > 0] for s, o in zip(seqs, scored)]
    return {"tokens": tokens, "logprobs": logprobs}


@torch.no_grad()
def hf_outputs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> dict:
    """HF's forward over the engine's prompt + completion: its log-probability of every token,
    and how far each completion token lies below HF's own best choice there ("greedy_gap"), so
    a near-tie that the two kernel stacks round apart does not fork the comparison."""
    logprobs, worst = [], 0.0
    for p, c in zip(prompts, completions, strict=True):
        seq = torch.tensor([p + c])
        lp = torch.log_softmax(model(input_ids=seq).logits[0, :-1].float(), dim=-1)
        taken = lp.gather(1, seq[0, 1:].unsqueeze(-1)).squeeze(-1)
        worst = max(worst, (lp.max(dim=-1).values - taken)[len(p) - 1 :].max().item())
        logprobs.append(taken.tolist())
    return {"logprobs": logprobs, "greedy_gap": worst}


@torch.no_grad()
def as_engine_holds(policy: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A BF16 copy of the trainer's policy with the values vLLM computes with (MXFP8: each
    quantized weight dequantized from mxrefit's bytes, which equal vLLM's own quantization)."""
    import copy

    from mxrefit import DEFAULT_RULES, mxfp8

    model = copy.deepcopy(policy).to(torch.bfloat16).eval()
    model.gradient_checkpointing_disable()  # generate needs its KV cache
    if fmt == "mxfp8":
        params = dict(policy.named_parameters())
        quantized = DEFAULT_RULES.decide((n, tuple(p.shape)) for n, p in params.items())
        for name, p in model.named_parameters():
            if quantized[name]:
                p.copy_(mxfp8.dequantize(*mxfp8.quantize(params[name].detach().contiguous(), name=name)))
    return model


def reload_reference(generation, fmt: str) -> None:
    """vLLM's own loader (``reload_weights``) fed TRL's parameter walk; for MXFP8 the walk's
    eligible weights become E4M3 values + scales, as in a ModelOpt MXFP8 checkpoint."""
    from mxrefit import DEFAULT_RULES, mxfp8

    quantized = DEFAULT_RULES.decide((n, tuple(t.shape)) for n, t in generation._iter_named_params())

    def walk() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in generation._iter_named_params():
            if fmt == "mxfp8" and quantized[name]:
                values, scales = mxfp8.quantize(t.contiguous(), name=name)
                yield name, values
                yield name + "_scale", scales  # ModelOpt MXFP8 checkpoints name the scales <weight>_scale
            else:
                yield name, t

    generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": walk()})
    generation.llm.reset_prefix_cache()


def grpo_config(args: argparse.Namespace, workdir: str, **vllm: object):
    """The run's ``GRPOConfig``; ``vllm``: the mode and its settings (``vllm_mode="colocate"``, or
    ``"server"`` with ``vllm_server_base_url``)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        use_vllm=True,
        vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.05,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=args.seed,
        data_seed=args.seed,
        shuffle_dataset=False,
        disable_tqdm=True,
        generation_kwargs={"ignore_eos": True},
        **vllm,
    )


def task(args: argparse.Namespace):
    """The prompts (token ids) and the dataset of their texts."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(0, VOCAB - 2, (args.prompts, PROMPT_LEN), generator=g).tolist()
    return prompt_ids, Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in p) for p in prompt_ids]})


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir = args.workdir or tempfile.mkdtemp(prefix="trl-grpo-")
    policy_path = os.path.join(workdir, "policy")
    build_policy(policy_path, args.seed)
    prompt_ids, dataset = task(args)
    config = grpo_config(args, workdir, vllm_mode="colocate")
    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)  # FP32 master weights
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    # enforce_eager: vLLM's CPU build would otherwise compile its graphs (about 40 s here)
    extra = {} if args.sync == "trl" else {"refit_format": args.format, "llm_kwargs": {"enforce_eager": True}}
    t0 = time.perf_counter()
    trainer = trainer_class(args.sync)(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, **extra
    )
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    generation = trainer.vllm_generation
    generation.sync_weights()  # the final weights: the engine now holds what the last step trained
    result = {
        "config": vars(args),
        "engine_start_s": start_s,
        "train_s": train_s,
        "steps": [h for h in trainer.state.log_history if "loss" in h],
        "refits": [
            {
                "version": r.version,
                "bytes": r.bytes,
                "transport": r.transport,
                "total_s": r.total_s,
                "sync_s": r.extra.get("sync_s"),
            }
            for r in getattr(trainer, "refit_reports", [])
        ],
        "prompts": prompt_ids,
    }
    result["engine"] = engine_outputs(generation.llm, prompt_ids, args.new_tokens)
    result["hf"] = hf_outputs(
        as_engine_holds(trainer.accelerator.unwrap_model(trainer.model), args.format), prompt_ids, result["engine"]["tokens"]
    )
    reload_reference(generation, args.format)
    result["reload"] = engine_outputs(generation.llm, prompt_ids, args.new_tokens)
    if hasattr(generation, "close"):
        generation.close()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sync", choices=("mxrefit", "trl", "none"), default="mxrefit")
    p.add_argument("--format", choices=("bf16", "mxfp8"), default="bf16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--json", help="write the record here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    for s in result["steps"]:
        print(
            f"step {s['step']}: reward {s.get('reward', float('nan')):.3f} "
            f"logp diff max {s.get('sampling/sampling_logp_difference/max', float('nan')):.4f} "
            f"refit version {s.get('mxrefit/version')} {s.get('mxrefit/refit_ms', float('nan')):.1f} ms"
        )
    for ref in ("reload", "hf"):
        pairs = zip(result["engine"]["logprobs"], result[ref]["logprobs"])
        gap = max(abs(a - b) for x, y in pairs for a, b in zip(x, y))
        greedy = (
            f"greedy tokens equal {result['engine']['tokens'] == result[ref]['tokens']}"
            if ref == "reload"
            else f"greedy tokens at most {result['hf']['greedy_gap']:.2e} below HF's best"
        )
        print(f"engine vs {ref}: {greedy}, largest logprob difference {gap:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
