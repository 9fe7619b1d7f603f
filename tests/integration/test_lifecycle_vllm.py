"""The phase drives a real vLLM engine (CPU build) through sleep / wake_up(weights) / wake_up(kv_cache).

vLLM 0.32's CPU worker accepts ``sleep``/``wake_up`` but frees no memory (``CPUWorker.sleep`` logs
"not supported on CPU"), and ``enable_sleep_mode=True`` is refused on CPU. The engine's sleep state
machine is still real: the scheduler pauses, the executor tracks which tags sleep, and
``wake_up`` reports whether the engine is fully awake. This test runs two phases around real refits
into that engine (mxrefit's vLLM worker extension): the state machine is walked in the right order
(weights awake and KV cache still asleep while the refit runs), the first refit's weights change
the engine's answer, and the second (the original weights) brings it back. Memory effects are measured on the H200
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
    from vllm import LLM, SamplingParams

    from mxrefit.integrations.vllm.client import refit_while
    from mxrefit.lifecycle import OptimizerOffloader, prepare_for_generation, prepare_for_training
    from mxrefit.source.sender import Sender
    from tests.helpers import models

    work = tempfile.mkdtemp()
    models.tiny_llama(seed=3).save_pretrained(work)
    llm = LLM(
        model=work,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        gpu_memory_utilization=0.1,
        seed=0,
        worker_extension_cls="mxrefit.integrations.vllm.worker.RefitWorkerExtension",
    )
    prompt = [{"prompt_token_ids": [1, 7, 42, 99, 3]}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    generate = lambda: list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)  # noqa: E731
    before = generate()
    info = llm.collective_rpc("mxrefit_init")[0]
    sender = Sender(info["address"], bytes.fromhex(info["token"]), timeout_s=120)

    trainer = models.tiny_llama(seed=4, dtype=torch.float32)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 8))
    trainer(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    offloader = OptimizerOffloader(opt)

    seen: dict = {}
    llm.sleep(level=1)
    seen["sleeping_before_phase"] = llm.llm_engine.is_sleeping()
    results = []
    for seed in (4, 3):  # new weights, then the engine's original ones again
        weights = {n: p.detach() for n, p in models.tiny_llama(seed=seed).named_parameters()}

        def refit():
            seen.setdefault("sleeping_during_refit", []).append(llm.llm_engine.is_sleeping())
            seen.setdefault("offloaded_during_refit", []).append(offloader.offloaded)
            return refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)

        gen = prepare_for_generation(refit, trainer=offloader, engine=llm)
        seen.setdefault("sleeping_after_phase", []).append(llm.llm_engine.is_sleeping())
        tokens = generate()
        train = prepare_for_training(trainer=offloader, engine=llm, sleep_level=1)
        seen.setdefault("sleeping_after_training_phase", []).append(llm.llm_engine.is_sleeping())
        seen.setdefault("offloaded_after_training_phase", []).append(offloader.offloaded)
        results.append({"tokens": tokens, "generation": gen.as_dict(), "training": vars(train)})
    with open(out_path, "w") as f:
        json.dump({"seen": seen, "before": before, "results": results}, f)


@pytest.mark.vllm
@pytest.mark.slow
def test_phase_walks_a_real_vllm_engine_through_sleep_and_wake():
    pytest.importorskip("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)
        proc = subprocess.run([sys.executable, __file__, out], capture_output=True, text=True, timeout=600, env=env, cwd=root)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out) as f:
            res = json.load(f)
    seen = res["seen"]
    assert seen["sleeping_before_phase"] is True
    assert seen["sleeping_during_refit"] == [True, True]  # weights awake, KV cache still asleep
    assert seen["offloaded_during_refit"] == [True, True]
    assert seen["sleeping_after_phase"] == [False, False]
    assert seen["sleeping_after_training_phase"] == [True, True] and seen["offloaded_after_training_phase"] == [False, False]
    new_weights, original_weights = res["results"]
    assert len(res["before"]) == 8 and new_weights["tokens"] != res["before"]  # the refit reached the engine
    assert original_weights["tokens"] == res["before"]  # and the original weights bring back its answer
    for r in res["results"]:
        gen = r["generation"]
        assert gen["engine_awake"] is True and gen["refit"]["version"] >= 1
        assert all(gen[k] > 0 for k in ("offload_s", "wake_weights_s", "refit_s", "offload_wait_s", "wake_kv_cache_s", "total_s"))
        assert r["training"]["sleep_s"] > 0 and r["training"]["reload_bytes"] == gen["offload_bytes"] > 0


if __name__ == "__main__":
    _child(sys.argv[1])
