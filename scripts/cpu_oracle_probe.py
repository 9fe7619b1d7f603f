"""Is it the refit or the oracle? On a CPU host, one refit of a tiny Qwen3-MoE in vLLM's CPU build,
compared with a fresh vLLM started from the trainer's weights (an independent engine) and with the
HF forward the CPU tests use as their reference (docs/vllm.md, "Tests": the AVX512-BF16/AMX hosts).

    .venv/bin/python scripts/cpu_oracle_probe.py      # prints three verdicts; about a minute
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxrefit import Sender  # noqa: E402
from tests.helpers import vllm_models as vm  # noqa: E402


def main() -> None:
    loaded = tempfile.mkdtemp()
    vm.qwen3_moe(seed=0).save_pretrained(loaded)
    trainer = vm.qwen3_moe(seed=1)
    vm.train_steps(trainer, 8, seed=0)
    llm = vm.start_llm(loaded)
    try:
        info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped"})[0]
        sender = Sender(info["address"], bytes.fromhex(info["token"]))
        vm.refit(llm, sender, trainer)
        refitted = vm.vllm_greedy(llm)
        sender.close()
    finally:
        vm.stop_llm(llm)
    saved = tempfile.mkdtemp()
    trainer.save_pretrained(saved)
    fresh_llm = vm.start_llm(saved)
    try:
        fresh = vm.vllm_greedy(fresh_llm)
    finally:
        vm.stop_llm(fresh_llm)
    hf = vm.hf_greedy(trainer)
    print(f"refitted == fresh vLLM: {refitted == fresh}; fresh vLLM == HF: {fresh == hf}; refitted == HF: {refitted == hf}")


if __name__ == "__main__":
    main()
