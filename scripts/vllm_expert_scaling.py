"""Engine-side refit time of a real vLLM (CPU build) as the expert count grows: 8, 64, 128.

Per-refit Python work on the engine must not grow with the number of experts: the engine
writes whole fused w13/w2 parameters and processes one module per layer, never an expert at
a time. For each expert count this starts vLLM on a tiny random Qwen3-MoE (hidden 128,
2 layers, moe_intermediate 64), refits it through the worker extension from grouped slabs,
and reports medians of the engine's apply + post-processing time and the whole refit.

    PYTHONPATH=$PWD .venv/bin/python scripts/vllm_expert_scaling.py --json bench-out/vllm_experts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def model_with(experts: int, seed: int):
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
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def run(experts: int, steps: int) -> dict:
    import vllm_models as vm

    from mxrefit.integrations.vllm.client import refit_while
    from mxrefit.source.sender import Sender

    with tempfile.TemporaryDirectory() as path:
        model_with(experts, 0).save_pretrained(path)
        llm = vm.start_llm(path)
        try:
            info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped"})[0]
            units = info["units"]
            sender = Sender(info["address"], bytes.fromhex(info["token"]))
            trainer = model_with(experts, 1)
            weights = {n: p.detach() for n, p in trainer.named_parameters()}
            reports = []
            for i in range(steps + 1):
                with torch.no_grad():
                    for t in weights.values():
                        t.mul_(1.0 + 2.0**-7 * (1 if i % 2 else -1))
                report = refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
                if i:
                    reports.append(report)
            sender.close()
        finally:
            vm.stop_llm(llm)
    med = lambda key: statistics.median(getattr(r, key) for r in reports)  # noqa: E731
    return {
        "experts": experts,
        "trainer_tensors": len(weights),
        "engine_units_processed_per_refit": units,
        "bytes": reports[0].bytes,
        "engine_apply_ms": med("engine_apply_s") * 1e3,
        "engine_process_ms": med("engine_process_s") * 1e3,
        "engine_process_ms_per_MB": med("engine_process_s") * 1e3 / (reports[0].bytes / 1e6),
        "total_ms": med("total_s") * 1e3,
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,64,128")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for e in (int(x) for x in args.experts.split(",")):
        t = time.time()
        rows.append(run(e, args.steps))
        print(json.dumps(rows[-1]), f"({time.time() - t:.0f} s with vLLM start)", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
