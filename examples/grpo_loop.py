"""A minimal but real GRPO loop: sample with the rollout engine, score, train, refit with mxrefit.

Every step:
1. the rollout engine samples ``--group`` completions per prompt at temperature 1 and returns
   each sampled token's log-probability (vLLM, or HF ``generate`` in an engine process);
2. a verifiable reward is computed from the sampled token ids alone: the fraction of
   completion tokens in a target set (ids divisible by 16: 32 of 512 tokens, ~6% by chance);
3. advantages are normalized within each prompt's group: (r - mean) / (std + eps);
4. the trainer's policy (a tiny transformers Qwen3, random init, float32 master weights)
   takes one AdamW step on a PPO-clipped policy-gradient loss, the ratio taken against the
   engine's sampling log-probabilities;
5. mxrefit refits the new weights into the engine (version = step), and the loop prints the
   step's mean reward and the refit time.

``logp_gap`` is the mean |log p_trainer - log p_engine| over the sampled tokens, measured
before the update: it stays at the level of the engine's precision (BF16 or MXFP8) only if
every refit really landed, so it doubles as an end-to-end check of the refits.

Engines (``--engine``):
- ``vllm``: a ``vllm.LLM`` in this process whose worker runs mxrefit's worker extension;
  refits go through ``collective_rpc("mxrefit_receive")`` (direct writes into the worker's
  staging: shared memory on CPU, CUDA IPC on GPU). ``--format mxfp8`` starts vLLM from a
  ModelOpt MXFP8 checkpoint of the step-0 policy and every refit is quantized on the trainer.
- ``torch``: no vLLM (e.g. the H200 image). An engine process holds the rollout model behind
  mxrefit's ``TorchEngine`` + ``Receiver`` and samples with HF ``generate`` when asked over a
  pipe (msgpack messages). With MXFP8 the engine stores what arrives as E4M3 + scales, the way
  vLLM holds it, and after every refit writes the dequantized weights into the BF16 model that
  ``generate`` runs (what vLLM's emulation kernel does at load), so sampling sees exactly the
  MXFP8 bytes.

Run: ``python examples/grpo_loop.py --engine vllm --steps 20`` (CPU, about two minutes).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

VOCAB = 512
TARGET_EVERY = 16
PROMPT_LEN = 4


# ---- task and policy ---------------------------------------------------------------------
def reward(completion: list[int]) -> float:
    """Fraction of completion tokens in the target set: verifiable from the token ids alone."""
    return sum(t % TARGET_EVERY == 0 for t in completion) / len(completion)


def tiny_qwen3(seed: int) -> torch.nn.Module:
    """A 2-layer Qwen3 built from a config (random init): dense, so vLLM's CPU build runs it in MXFP8 too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
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
    )
    return Qwen3ForCausalLM(cfg).float()


@dataclass
class Group:
    """One prompt's sampled completions and the engine's log-probability of every sampled token."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


# ---- rollout engine 1: vLLM with mxrefit's worker extension --------------------------------
def start_vllm(path: str, device: str, seed: int):
    """A small ``vllm.LLM`` whose worker runs mxrefit's extension (methods called by name)."""
    from vllm import LLM

    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        seed=seed,
        gpu_memory_utilization=0.05 if device == "cpu" else 0.3,
        max_model_len=64,
        max_num_seqs=64,
        worker_extension_cls="mxrefit.integrations.vllm.worker.RefitWorkerExtension",
    )


def vllm_sample(llm, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[Group]:
    """``n`` completions per prompt at temperature 1 and the sampled tokens' log-probabilities."""
    from vllm import SamplingParams

    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=seed + i * n)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        Group(
            [list(c.token_ids) for c in o.outputs], [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in o.outputs]
        )
        for o in outs
    ]


class VllmRollout:
    def __init__(self, path: str, device: str, seed: int):
        from mxrefit import Sender

        self.llm = start_vllm(path, device, seed)
        info = self.llm.collective_rpc("mxrefit_init")[0]  # engine tables built once, control socket opened
        self.sender = Sender(info["address"], bytes.fromhex(info["token"]), device=device)

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[Group]:
        return vllm_sample(self.llm, prompts, n, max_tokens, seed)

    def refit(self, weights: dict[str, torch.Tensor]):
        from mxrefit.integrations.vllm.client import refit_while

        # the worker serves one refit on its own thread while this process sends it
        report = refit_while(lambda: self.llm.collective_rpc("mxrefit_receive"), self.sender, weights)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the previous weights
        return report

    def close(self) -> None:
        self.sender.close()
        self.llm.collective_rpc("mxrefit_close")  # close the worker's refit socket before vLLM stops it
        self.llm.llm_engine.engine_core.shutdown()


# ---- rollout engine 2: a transformers model in an engine process -----------------------------
def _rollout_engine_class():
    from mxrefit import TorchEngine

    class RolloutEngine(TorchEngine):
        """``TorchEngine`` for a model that also generates. BF16: refits write the model's own
        parameters. MXFP8: refits write E4M3 + scales into a weight store (as vLLM holds them);
        ``after_refit`` then puts their dequantized values into the model ``generate`` runs."""

        def __init__(self, model: torch.nn.Module, mxfp8: bool):
            self.generator = model
            super().__init__(copy.deepcopy(model) if mxfp8 else model, mxfp8=mxfp8)
            self.mxfp8 = mxfp8
            self.after_refit(0)

        @torch.no_grad()
        def after_refit(self, version: int) -> None:
            if self.mxfp8:
                params = dict(self.generator.named_parameters())
                for name, value in self.dequantized_state(params[next(iter(params))].dtype).items():
                    params[name].copy_(value)

    return RolloutEngine


@torch.no_grad()
def hf_sample(model: torch.nn.Module, prompt: list[int], n: int, max_tokens: int, seed: int) -> Group:
    """``n`` completions at temperature 1 (no top-k/top-p) and each sampled token's raw log-probability."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=n,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, len(prompt) :]
    logits = torch.stack(out.logits, dim=1).float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    return Group(tokens.tolist(), logprobs.tolist())


def serve_rollouts(conn, path: str, fmt: str, device: str) -> None:
    """The engine process: refits arrive through mxrefit, sampling requests over ``conn`` (msgpack)."""
    import msgpack
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mxrefit import Receiver

    hf_logging.disable_progress_bar()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # the engine's kernels and exports on this GPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    receiver = Receiver(_rollout_engine_class()(model, mxfp8=fmt == "mxfp8"), timeout_s=120)
    conn.send_bytes(msgpack.packb({"address": receiver.address, "token": receiver.token}))
    try:
        while True:
            msg = msgpack.unpackb(conn.recv_bytes())
            if msg["op"] == "generate":
                groups = [
                    hf_sample(model, p, msg["n"], msg["max_tokens"], msg["seed"] + i * msg["n"])
                    for i, p in enumerate(msg["prompts"])
                ]
                conn.send_bytes(msgpack.packb([asdict(g) for g in groups]))
            elif msg["op"] == "refit":
                receiver.serve(refits=1)
                conn.send_bytes(msgpack.packb(receiver.status()))
            else:
                return
    finally:
        receiver.close()


class TorchRollout:
    def __init__(self, path: str, fmt: str, device: str):
        import msgpack

        from mxrefit import Sender

        self.packb, self.unpackb = msgpack.packb, msgpack.unpackb
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_rollouts, args=(child, path, fmt, device), daemon=True)
        self.proc.start()
        hello = self._recv(300)
        self.sender = Sender(hello["address"], hello["token"], device=device)

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise RuntimeError(
                f"the rollout engine process did not answer within {timeout_s:.0f} s (exit code {self.proc.exitcode})"
            )
        return self.unpackb(self.conn.recv_bytes())

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[Group]:
        self.conn.send_bytes(self.packb({"op": "generate", "prompts": prompts, "n": n, "max_tokens": max_tokens, "seed": seed}))
        return [Group(**g) for g in self._recv(300)]

    def refit(self, weights: dict[str, torch.Tensor]):
        self.conn.send_bytes(self.packb({"op": "refit"}))  # the engine starts serving one refit
        report = self.sender.refit(weights)
        status = self._recv(self.sender.timeout_s)
        if status["version"] != report.version or status["state"] != "ready":
            raise RuntimeError(f"engine reports {status} after refit {report.version}")
        return report

    def close(self) -> None:
        self.sender.close()
        self.conn.send_bytes(self.packb({"op": "stop"}))
        self.proc.join(30)


# ---- GRPO ------------------------------------------------------------------------------------
@dataclass
class StepStats:
    step: int
    reward: float
    refit_ms: float
    version: int
    logp_gap: float
    loss: float
    generate_s: float
    train_s: float
    refit_wall_ms: float = 0.0
    transport: str = ""
    refit_bytes: int = 0


def grpo_update(
    policy, optimizer, prompts: list[list[int]], groups: list[Group], *, clip: float = 0.2, eps: float = 1e-6
) -> tuple[float, float, float]:
    """One policy-gradient step on the sampled groups; returns (mean reward, logp gap, loss)."""
    device = next(policy.parameters()).device
    rewards = torch.tensor([[reward(c) for c in g.tokens] for g in groups])  # [P, G]
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)
    seqs = torch.tensor([p + c for p, g in zip(prompts, groups) for c in g.tokens], device=device)
    completion = seqs[:, PROMPT_LEN:]
    old = torch.tensor([lp for g in groups for lp in g.logprobs], device=device)  # engine's, [P*G, T]
    logits = policy(input_ids=seqs).logits[:, PROMPT_LEN - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(2, completion.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old)
    a = adv.reshape(-1, 1).to(device)
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return rewards.mean().item(), (logp.detach() - old).abs().mean().item(), loss.item()


def save_step0(policy, path: str, fmt: str, engine: str) -> None:
    """The engine's first weights: the step-0 policy in BF16 (or as a ModelOpt MXFP8 checkpoint for vLLM)."""
    bf16 = copy.deepcopy(policy).to(torch.bfloat16)
    if fmt == "mxfp8" and engine == "vllm":
        from mxrefit import save_mxfp8_checkpoint

        save_mxfp8_checkpoint(bf16, path)
    else:
        bf16.save_pretrained(path)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    policy = tiny_qwen3(args.seed).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, VOCAB, (args.prompts, PROMPT_LEN), generator=g).tolist()
    workdir = tempfile.mkdtemp(prefix="grpo-")
    save_step0(policy, workdir, args.format, args.engine)
    t0 = time.perf_counter()
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = VllmRollout(workdir, args.device, args.seed)
    else:
        engine = TorchRollout(workdir, args.format, args.device)
    start_s = time.perf_counter() - t0
    weights = dict(policy.named_parameters())  # float32 master weights; the refit writes BF16 or MXFP8
    steps: list[StepStats] = []
    print(f"engine {args.engine} ({args.format}, {args.device}) up in {start_s:.1f} s", flush=True)
    print(f"{'step':>4} {'reward':>7} {'refit_ms':>9} {'version':>7} {'logp_gap':>8}", flush=True)
    try:
        for step in range(1, args.steps + 1):
            t = time.perf_counter()
            groups = engine.generate(prompts, args.group, args.new_tokens, seed=args.seed * 100_003 + step * 1_009)
            gen_s = time.perf_counter() - t
            t = time.perf_counter()
            mean_reward, gap, loss = grpo_update(policy, optimizer, prompts, groups, clip=args.clip)
            train_s = time.perf_counter() - t
            t = time.perf_counter()
            report = engine.refit(weights)
            wall_ms = (time.perf_counter() - t) * 1e3
            s = StepStats(
                step,
                mean_reward,
                report.total_s * 1e3,
                report.version,
                gap,
                loss,
                gen_s,
                train_s,
                wall_ms,
                report.transport,
                report.bytes,
            )
            steps.append(s)
            print(f"{step:>4} {s.reward:>7.3f} {s.refit_ms:>9.1f} {s.version:>7} {s.logp_gap:>8.4f}", flush=True)
    finally:
        engine.close()
    k = min(5, len(steps))
    result = {
        "config": vars(args),
        "engine_start_s": start_s,
        "wall_s": time.perf_counter() - t0,
        "first5_reward": sum(s.reward for s in steps[:k]) / k,
        "last5_reward": sum(s.reward for s in steps[-k:]) / k,
        "median_refit_ms": sorted(s.refit_ms for s in steps)[len(steps) // 2],
        "steps": [asdict(s) for s in steps],
    }
    print(
        f"mean reward: first {k} steps {result['first5_reward']:.3f}, last {k} steps {result['last5_reward']:.3f}; "
        f"median refit {result['median_refit_ms']:.1f} ms ({steps[-1].transport}, {steps[-1].refit_bytes} bytes)"
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "torch"), default="vllm")
    p.add_argument("--format", choices=("bf16", "mxfp8"), default="bf16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (trainer and engine on the same device)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the per-step record here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
