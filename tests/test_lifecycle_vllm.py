"""The phase drives a real vLLM engine (CPU build) through sleep / wake_up(weights) / wake_up(kv_cache).

vLLM 0.32's CPU worker accepts ``sleep``/``wake_up`` but frees no memory (``CPUWorker.sleep`` logs
"not supported on CPU"), and ``enable_sleep_mode=True`` is refused on CPU. The engine's sleep state
machine is still real: the scheduler pauses, the executor tracks which tags sleep, and
``wake_up`` reports whether the engine is fully awake. This test checks that the phase walks that
state machine in the right order (weights awake and KV cache still asleep while the refit runs) and
that the engine generates the same tokens afterwards. Memory effects are measured on the H200
(scripts/gpu_lifecycle.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest


def _child(out_path: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models
    from vllm import LLM, SamplingParams

    from mxrefit.lifecycle import OptimizerOffloader, prepare_for_generation, prepare_for_training

    work = tempfile.mkdtemp()
    models.tiny_llama(seed=3).save_pretrained(work)
    llm = LLM(model=work, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=64,
              gpu_memory_utilization=0.1, seed=0)
    prompt = [{"prompt_token_ids": [1, 7, 42, 99, 3]}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    before = list(llm.generate(prompt, greedy)[0].outputs[0].token_ids)

    trainer = models.tiny_llama(seed=4, dtype=torch.float32)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 8))
    trainer(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    offloader = OptimizerOffloader(opt)

    seen = {}
    llm.sleep(level=1)
    seen["sleeping_before_phase"] = llm.llm_engine.is_sleeping()

    def refit():
        seen["sleeping_during_refit"] = llm.llm_engine.is_sleeping()
        seen["offloaded_during_refit"] = offloader.offloaded
        return {"version": 1}

    gen = prepare_for_generation(refit, trainer=offloader, engine=llm)
    seen["sleeping_after_phase"] = llm.llm_engine.is_sleeping()
    after = list(llm.generate(prompt, greedy)[0].outputs[0].token_ids)
    train = prepare_for_training(trainer=offloader, engine=llm, sleep_level=1)
    seen["sleeping_after_training_phase"] = llm.llm_engine.is_sleeping()
    seen["offloaded_after_training_phase"] = offloader.offloaded
    with open(out_path, "w") as f:
        json.dump({"seen": seen, "before": before, "after": after, "engine_awake": gen.engine_awake,
                   "generation": gen.as_dict(), "training": vars(train)}, f)


@pytest.mark.vllm
@pytest.mark.slow
def test_phase_walks_a_real_vllm_engine_through_sleep_and_wake():
    pytest.importorskip("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)
        proc = subprocess.run([sys.executable, __file__, out], capture_output=True, text=True, timeout=600, env=env, cwd=root)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out) as f:
            res = json.load(f)
    seen = res["seen"]
    assert seen["sleeping_before_phase"] is True
    assert seen["sleeping_during_refit"] is True  # weights awake, KV cache still asleep
    assert seen["offloaded_during_refit"] is True
    assert seen["sleeping_after_phase"] is False and res["engine_awake"] is True
    assert res["after"] == res["before"] and len(res["before"]) == 8
    assert seen["sleeping_after_training_phase"] is True and seen["offloaded_after_training_phase"] is False
    gen = res["generation"]
    assert all(gen[k] > 0 for k in ("offload_s", "wake_weights_s", "refit_s", "offload_wait_s", "wake_kv_cache_s", "total_s"))
    assert res["training"]["sleep_s"] > 0 and res["training"]["reload_bytes"] == gen["offload_bytes"] > 0


if __name__ == "__main__":
    _child(sys.argv[1])
