"""The reload-side adapters of ``mxrefit/integrations/vllm/compat.py`` against each release's shape.

0.26 and 0.33/0.34 have no build that runs here, so each case imports the adapters in a fresh
process whose ``vllm`` holds fakes of the modules they read, written from each release's
source (``vllm_fakes.RELOAD_SHAPES``): ``meta.SKIP_TENSORS`` (0.26 lacks ``bias``), 0.34's
``finalize_model_weights`` (copied: the hooks mxrefit re-runs must be the ones vLLM runs,
minus modules no refit touched), and the unquantized MoE method's ``_setup_kernel`` (0.32+
run the experts' post-load step on the first build only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import vllm_fakes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = r"""
import json
import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.model_loader import weight_utils
from mxrefit.integrations.vllm import compat as vllm_compat

ran = []

class Hooked(torch.nn.Module):
    def __init__(self, name, *children):
        super().__init__()
        self.name = name
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)

    def process_weights_after_loading(self):
        ran.append(self.name)

qkv = Hooked("qkv", Hooked("inside-quantized"))
qkv.quant_method = QuantizeMethodBase()
runner = Hooked("moe-runner", Hooked("experts"))
model = Hooked("model", Hooked("layer", qkv, runner), Hooked("untouched"))
for hook in vllm_compat.module_post_load_hooks(model, {qkv, runner.c0}):
    hook()
out = {"hooks": ran[:]}
ran.clear()
if hasattr(weight_utils, "finalize_model_weights"):
    weight_utils.finalize_model_weights(model)
    out["vllm_runs"] = ran[:]
linear = torch.nn.Linear(2, 2)
out["unstaged_bias"] = vllm_compat.unstaged_meta_tensors(linear, {"weight": linear.weight})
out["staged_bias"] = vllm_compat.unstaged_meta_tensors(linear, {"weight": linear.weight, "bias": linear.bias})
out["replay_on_reload"] = vllm_compat.replays_expert_post_load(UnquantizedFusedMoEMethod(), True)
out["replay_on_first_build"] = vllm_compat.replays_expert_post_load(UnquantizedFusedMoEMethod(), False)
print("PROBE" + json.dumps(out))
"""


def _probe(tmp_path, name: str) -> dict:
    root = vllm_fakes.write_reload_fake(str(tmp_path), name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, ROOT])}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))[len("PROBE") :])


@pytest.mark.parametrize("name", sorted(vllm_fakes.RELOAD_SHAPES))
def test_reload_adapters_follow_each_release(tmp_path, name):
    out = _probe(tmp_path, name)
    if name == "0.34":
        # the hooks vLLM's finalize runs, children first, minus the subtree no refit touched
        assert out["vllm_runs"] == ["qkv", "experts", "moe-runner", "layer", "untouched", "model"]
        assert out["hooks"] == [h for h in out["vllm_runs"] if h != "untouched"]
    else:
        assert out["hooks"] == [] and "vllm_runs" not in out
    assert out["unstaged_bias"] == (["bias"] if name == "0.26" else [])
    assert out["staged_bias"] == []
    assert out["replay_on_reload"] is (name in ("0.32", "0.34"))
    assert out["replay_on_first_build"] is False
