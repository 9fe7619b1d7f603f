"""Colocated refit between two Ray actors: a trainer and a vLLM engine, mxrefit in between.

The vLLM actor starts ``vllm.LLM`` with mxrefit's worker extension and exposes one generic
method, ``collective_rpc``; the driver asks its worker to open mxrefit's control socket
(``mxrefit_init``), hands address and token to the trainer actor, and for every refit starts
``mxrefit_receive`` on the vLLM actor and ``refit`` on the trainer at once. The bytes go
straight from the trainer's tensors into the vLLM worker's memory (CUDA IPC on one GPU,
shared memory on CPU); Ray only carries the small calls. The training step is
``examples/grpo_loop.py``'s.

Run (needs ``pip install ray``): ``python examples/ray_colocated.py --steps 5``.
On one GPU give each actor half of it: ``--device cuda`` (``num_gpus=0.5`` each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_loop as grpo  # noqa: E402


@ray.remote
class VllmActor:
    def __init__(self, path: str, device: str, seed: int):
        self.llm = grpo.start_vllm(path, device, seed)

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[grpo.Group]:
        return grpo.vllm_sample(self.llm, prompts, n, max_tokens, seed)

    def shutdown(self) -> None:
        self.llm.collective_rpc("mxrefit_close")  # close the worker's refit socket before vLLM stops it
        self.llm.llm_engine.engine_core.shutdown()


@ray.remote
class TrainerActor:
    def __init__(self, device: str, seed: int, lr: float):
        import torch

        self.policy = grpo.tiny_qwen3(seed).to(device)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=0.0)
        self.device = device

    def checkpoint(self, path: str) -> str:
        """The engine's first weights: the step-0 policy, saved where the engine will load it."""
        grpo.save_step0(self.policy, path, "bf16", "vllm")
        return path

    def connect(self, info: dict) -> None:
        from mxrefit import Sender

        self.sender = Sender(info["address"], bytes.fromhex(info["token"]), device=self.device)

    def train(self, prompts: list[list[int]], groups: list[grpo.Group]) -> dict:
        mean_reward, gap, loss = grpo.grpo_update(self.policy, self.optimizer, prompts, groups)
        return {"reward": mean_reward, "logp_gap": gap, "loss": loss}

    def refit(self) -> dict:
        report = self.sender.refit(dict(self.policy.named_parameters()))
        return {"version": report.version, "refit_ms": report.total_s * 1e3, "transport": report.transport}


def refit(trainer, engine) -> dict:
    """One refit: the engine serves it while the trainer sends; both calls run at once."""
    serving = engine.collective_rpc.remote("mxrefit_receive")
    report = ray.get(trainer.refit.remote())
    status = ray.get(serving)[0]
    assert status["version"] == report["version"] and status["state"] == "ready", status
    ray.get(engine.reset_prefix_cache.remote())  # cached KV blocks were computed with the previous weights
    return report


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the per-step record here")
    args = p.parse_args(argv)
    gpus = 0.5 if args.device == "cuda" else 0
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(sys.path[:1] + [os.environ.get("PYTHONPATH", "")]),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
        },
    )
    trainer = TrainerActor.options(num_gpus=gpus).remote(args.device, args.seed, 3e-3)
    path = ray.get(trainer.checkpoint.remote(tempfile.mkdtemp(prefix="ray-colocated-")))
    engine = VllmActor.options(num_gpus=gpus).remote(path, args.device, args.seed)
    info = ray.get(engine.collective_rpc.remote("mxrefit_init"))[0]
    ray.get(trainer.connect.remote(info))
    prompts = [[1, 2, 3, 4], [7, 100, 5, 9], [300, 301, 17, 2], [42, 17, 250, 9]]
    steps = []
    for step in range(1, args.steps + 1):
        groups = ray.get(engine.generate.remote(prompts, 8, 8, seed=1_000 * step))
        stats = ray.get(trainer.train.remote(prompts, groups))
        stats.update(refit(trainer, engine), step=step)
        steps.append(stats)
        print(
            f"step {step}: reward {stats['reward']:.3f}, refit {stats['refit_ms']:.1f} ms "
            f"(version {stats['version']}, {stats['transport']}), logp gap {stats['logp_gap']:.4f}",
            flush=True,
        )
    ray.get(engine.shutdown.remote())
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(steps, f, indent=1)
    return steps


if __name__ == "__main__":
    main()
