"""Trainer and inference engine as Ray actors, refit over a broadcast group (CPU + gloo here).

    pip install 'mxrefit[ray]' transformers && python examples/ray_refit.py

Two engine actors hold one tiny Qwen3-MoE as tensor-parallel ranks 0 and 1 (vLLM's slices,
MXFP8 weights); a trainer actor owns the BF16 model, takes fake optimizer steps and refits both
ranks after each with one ``BroadcastSender``: one gloo broadcast per bucket reaches both, each
keeps its slice. On GPUs, give the actors ``num_gpus=1`` and the sender ``device="cuda"``: the
same code then broadcasts over NCCL. Each step ends with a byte check: every rank's weights
against an engine built directly from the trainer's current weights (quantized and sliced
without the refit path).
"""

from __future__ import annotations

import hashlib

import ray
import torch

TP = 2


def tiny_model(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def digest(engine) -> str:
    """sha256 over every parameter's bytes as the engine holds them."""
    h = hashlib.sha256()
    for name in engine.params():
        h.update(engine.storage(name).numpy().tobytes())
    return h.hexdigest()


@ray.remote(max_concurrency=2)  # one thread serves refits, the other answers the driver
class EngineActor:
    def __init__(self, tp_rank: int):
        from mxrefit import Receiver, TorchEngine

        self.engine = TorchEngine(tiny_model(seed=0), mxfp8=True, tp_rank=tp_rank, tp_size=TP)
        self.receiver = Receiver(self.engine, timeout_s=60)

    def endpoint(self) -> tuple[str, bytes]:
        return self.receiver.address, self.receiver.token

    def serve(self) -> dict:
        """Answer the trainer until it shuts this rank down; returns the final status."""
        try:
            self.receiver.serve()
        finally:
            self.receiver.close()
        return self.receiver.status()

    def digest(self) -> str:
        return digest(self.engine)


@ray.remote
class TrainerActor:
    def __init__(self, engines: list[tuple[str, bytes]]):
        from mxrefit import BroadcastSender

        self.model = tiny_model(seed=1)
        self.sender = BroadcastSender(engines, device="cpu", bucket_bytes=64 << 10, timeout_s=60)

    @torch.no_grad()
    def step(self) -> dict:
        """A stand-in for an optimizer step, then a refit of every engine rank."""
        for p in self.model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
        report = self.sender.refit(dict(self.model.named_parameters()))
        return {"version": report.version, "buckets": report.buckets, "bytes": report.bytes, "total_s": report.total_s}

    def expected_digests(self) -> list[str]:
        """What each rank must hold: an engine built from the current weights, without any refit."""
        import copy

        from mxrefit import TorchEngine

        return [digest(TorchEngine(copy.deepcopy(self.model), mxfp8=True, tp_rank=r, tp_size=TP)) for r in range(TP)]

    def close(self) -> None:
        self.sender.close(shutdown_engine=True)


def main(steps: int = 3) -> list[dict]:
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    try:
        engines = [EngineActor.remote(r) for r in range(TP)]
        endpoints = ray.get([e.endpoint.remote() for e in engines])
        serving = [e.serve.remote() for e in engines]
        trainer = TrainerActor.remote(endpoints)
        results = []
        for _ in range(steps):
            report = ray.get(trainer.step.remote())
            want = ray.get(trainer.expected_digests.remote())
            got = ray.get([e.digest.remote() for e in engines])
            report["exact"] = want == got
            results.append(report)
            print(report)
        ray.get(trainer.close.remote())
        print("final engine status:", ray.get(serving))
        return results
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
