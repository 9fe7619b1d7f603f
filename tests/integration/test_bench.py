"""`mxrefit bench` end to end on CPU: both modes, the floor, the byte check, JSON and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mxrefit.bench.run import resolve_shape, run_mode


def bench(*args: str, timeout_s: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m mxrefit bench ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "mxrefit", "bench", *args], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_bench_cli_runs_and_engine_bytes_match(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    run = bench("--steps", "2", "--no-progress", "--json", str(out), "--plot", str(png))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"baseline", "prequant"}
    pre, base = result["modes"]["prequant"], result["modes"]["baseline"]
    assert pre["check"]["mismatched"] == [] and pre["check"]["tensors_checked"] >= 10
    assert pre["bytes"] < base["bytes"]  # MXFP8 values + scales are fewer bytes than BF16
    assert len(pre["per_step"]) == 2 and result["floor_s"] > 0 and result["copy_GBps"] > 0
    assert "identical" in run.stdout and png.stat().st_size > 1000


def test_bench_with_grouped_expert_slabs(tmp_path):
    out = tmp_path / "grouped.json"
    run = bench("--steps", "1", "--mode", "prequant", "--experts", "grouped", "--no-progress", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["modes"]["prequant"]["check"]["mismatched"] == []
    assert result["tensors"] < 100  # slabs: far fewer tensors than per-expert names


def test_bench_checks_modes_price_verify_and_transactions(tmp_path):
    """`--mode checks`: plain, ready messages in step, the fused non-finite screen, per-bucket integrity
    sums, and a transactional engine, each bit-exact."""
    out = tmp_path / "checks.json"
    run = bench("--steps", "1", "--mode", "checks", "--post", "none", "--no-progress", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["prequant", "prequant-in-step", "prequant-fused", "prequant-verify", "prequant-transactional"]
    assert all(m["check"]["mismatched"] == [] for m in modes.values())
    assert [m["one_behind"] for m in modes.values()] == [True, False, True, True, True]
    assert [m["check_finite"] for m in modes.values()] == [True, True, False, True, True]
    assert [m["verify"] for m in modes.values()] == [False, False, False, True, False]
    assert [m["engine_transactional"] for m in modes.values()] == [False, False, False, False, True]


def test_bench_fp8_block_engine_bytes_match(tmp_path):
    """The FP8-block engine layout (Fp8Config: values + float32 scale_inv per 128x128 tile), no post-process:
    both modes run, and the engine's bytes are fp8_block.quantize's (baseline quantizes on the engine)."""
    out = tmp_path / "fp8.json"
    run = bench("--format", "fp8-block", "--steps", "2", "--no-progress", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["format"], result["post"]) == ("fp8-block", "none")
    pre, base = result["modes"]["prequant"], result["modes"]["baseline"]
    assert pre["check"]["mismatched"] == [] and pre["check"]["tensors_checked"] >= 10
    assert pre["check"]["kernel_layout_params_checked"] == 0
    assert pre["bytes"] < base["bytes"] and len(pre["per_step"]) == 2
    assert "fp8-block" in run.stdout and "identical" in run.stdout


def test_bench_fp8_block_ue8m0_grouped(tmp_path):
    out = tmp_path / "ue8m0.json"
    run = bench(
        "--format",
        "fp8-block-ue8m0",
        "--steps",
        "1",
        "--mode",
        "prequant",
        "--experts",
        "grouped",
        "--no-progress",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["format"] == "fp8-block-ue8m0" and result["modes"]["prequant"]["check"]["mismatched"] == []


def test_bench_refuses_trtllm_post_for_fp8_block():
    run = bench("--format", "fp8-block", "--post", "trtllm", "--no-progress", timeout_s=120)
    assert run.returncode == 2
    assert "post 'trtllm' is FlashInfer's TRT-LLM MXFP8 layout; fp8-block has no post-process here" in run.stderr


def test_bench_bf16_engine_and_a_table_that_reads_in_80_columns(tmp_path):
    """`--format bf16` (what most RL stacks serve): both modes move the BF16 bytes, the engine's
    bytes are the trainer's, and the table fits 80 and 120 columns with no header or cell cut."""
    from rich.console import Console

    from mxrefit.bench.report import print_table

    out = tmp_path / "bf16.json"
    run = bench("--format", "bf16", "--steps", "1", "--no-progress", "--json", str(out), env={**os.environ, "COLUMNS": "80"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["format"], result["post"]) == ("bf16", "none")
    pre, base = result["modes"]["prequant"], result["modes"]["baseline"]
    assert pre["check"]["mismatched"] == [] and pre["check"]["tensors_checked"] >= 10
    assert base["bytes"] == result["trainer_bf16_bytes"] == result["engine_bytes"]
    assert 0 <= pre["bytes"] - base["bytes"] < 512 * result["tensors"]  # only the runs' 512-byte alignment
    assert "…" not in run.stdout and "quantize/pack, ms" in run.stdout and "identical" in run.stdout
    # the widest table the CLI prints: four modes (--mode all / checks add two) and the floor
    for name in ("prequant-buffers", "prequant-transactional"):
        result["modes"][name] = {**pre, "transport": "buffers"}
    for width in (80, 120):
        console = Console(width=width, record=True, file=open(os.devnull, "w"))
        print_table(result, console)
        text = console.export_text()
        assert "…" not in text, text
        assert max(len(line) for line in text.splitlines()) <= width
        for word in ("transactional", "buffers", "(direct)", "copy", "floor", "trainer peak+, GiB", "x copy floor"):
            assert word in text, (word, text)


def test_bench_layer_sweep_fits_a_line_per_mode(tmp_path):
    """`--sweep-layers 1,2`: one bench per layer count, more traffic at more layers, a line per
    column (prequant and the floor) with its intercept and slope, engine bytes checked in each run."""
    out = tmp_path / "sweep.json"
    run = bench(
        "--sweep-layers",
        "1,2",
        "--mode",
        "prequant",
        "--steps",
        "1",
        "--no-progress",
        "--json",
        str(out),
        env={**os.environ, "COLUMNS": "80"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layers"] == [1, 2] and [r["model"] for r in result["runs"]] == ["tiny-qwen3-moe@1l", "tiny-qwen3-moe@2l"]
    assert result["runs"][0]["engine_bytes"] < result["runs"][1]["engine_bytes"]
    assert set(result["fits"]) == {"prequant", "copy floor"} and result["fits"]["prequant"]["points"] == 2
    assert all(r["modes"]["prequant"]["check"]["mismatched"] == [] for r in result["runs"])
    assert "intercept" in run.stdout and "R²" in run.stdout and "…" not in run.stdout


def test_bench_refuses_a_sweep_of_one_layer_count():
    run = bench("--sweep-layers", "4", "--no-progress", timeout_s=120)
    assert run.returncode == 2 and "--sweep-layers needs at least two distinct layer counts" in run.stderr


def test_bench_peer_checkpoint_engine_refuses_on_cpu_without_a_traceback():
    run = bench("--device", "cpu", "--peer", "checkpoint-engine", "--no-progress", timeout_s=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--peer checkpoint-engine cannot run here: it needs CUDA" in run.stderr
    assert "this run's device is cpu" in run.stderr


def test_bench_peer_vllm_refuses_on_cpu_in_one_line():
    """Every missing piece in one line, before any work: the device, and a shape it cannot describe."""
    run = bench("--device", "cpu", "--peer", "vllm", "--model", "qwen3-235b-a22b-ep8", "--no-progress", timeout_s=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("mxrefit bench: --peer vllm cannot run here: it needs CUDA")
    assert "this run's device is cpu" in run.stderr and "model qwen3-235b-a22b-ep8: one rank's share" in run.stderr
    assert run.stdout == ""


def test_bench_traces_one_refit_per_mode(tmp_path):
    """`--trace DIR`: one more refit per mode under torch.profiler, its Chrome trace holding the refit's range,
    and the device figures (none on a CPU) in the JSON and the printout."""
    out, folder = tmp_path / "trace.json", tmp_path / "traces"
    run = bench("--steps", "1", "--mode", "prequant", "--no-progress", "--json", str(out), "--trace", str(folder))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    t = json.loads(out.read_text())["modes"]["prequant"]["trace"]
    events = json.loads((folder / "trace_tiny-qwen3-moe_prequant.json").read_text())["traceEvents"]
    assert t["path"] == str(folder / "trace_tiny-qwen3-moe_prequant.json")
    assert [e for e in events if e.get("name") == "mxrefit.refit"], "the refit's range is in the trace"
    assert t["refit_ms"] > 0 and t["device_events"] == t["device_busy_ms"] == 0
    assert "prequant traced refit:" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine process fails here by asking for CUDA on a host without it")
def test_an_engine_process_that_dies_fails_the_bench_at_once():
    """The engine process dies before it serves (here: no CUDA to bind; on an H100 on 2026-12-06, out
    of memory): the bench raises at once naming it, where it used to wait 600 s for a hello."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"prequant engine process exited \(code 1\) before it served"):
        run_mode(
            "prequant",
            resolve_shape("tiny-qwen3-moe"),
            torch.device("cuda"),
            {},
            steps=1,
            warmup=0,
            bucket_bytes=1 << 20,
            timeout_s=30,
            experts="per_expert",
            post="none",
        )
    assert time.monotonic() - start < 120
