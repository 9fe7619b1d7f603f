"""The H200 scripts' CPU modes run here, so a script broken by a change fails CI instead of a
device call (device time is scarce: one soak run was lost on 2026-12-03 to a start-up bug).

Each runs as its own process from the repository root, the way the device runs it, and its JSON
is read back for the correctness it reports (bytes equal, round trips bit-exact); its speed
figures mean nothing on a CPU and are not looked at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: list[str], tmp_path, timeout_s: float = 600) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, f"{args[0]} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


def test_soak_script(tmp_path):
    _run(["scripts/gpu_soak.py", "--smoke", "--refits", "12", "--out", str(tmp_path)], tmp_path)
    report = json.loads((tmp_path / "gpu_soak.json").read_text())
    assert report["ok"] and {"direct", "buffers"} & set(report["runs"])
    assert all(run["bytes_exact"] and all(run["flat"].values()) for run in report["runs"].values())


def test_lifecycle_script(tmp_path):
    out = tmp_path / "lifecycle.json"
    _run(["scripts/gpu_lifecycle.py", "--smoke", "--json", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["bit_exact"] is True and report["phase"]["check"]["mismatched"] == []


def test_broadcast_script(tmp_path):
    out = tmp_path / "broadcast.json"
    _run(["scripts/gpu_broadcast.py", "--smoke", "--json", str(out)], tmp_path)
    configs = json.loads(out.read_text())["configs"]
    assert configs and all(c["check"]["params_checked"] > 0 for c in configs)
    assert all(not bad for c in configs for bad in c["check"]["mismatched"].values())


def test_fp8_block_kernel_script(tmp_path):
    out = tmp_path / "fp8_block.json"
    _run(["scripts/gpu_fp8_block.py", "--smoke", "--json", str(out)], tmp_path)
    differing = json.loads(out.read_text())["parity_total_differing"]
    assert differing and all(n == 0 for n in differing.values()), differing


@pytest.mark.parametrize("interpret", [False, True])
def test_gather_profile_script(tmp_path, interpret, monkeypatch):
    """The torch path; then, under Triton's interpreter, every kernel variant the device call times."""
    if interpret:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "gather.json"
    _run(["scripts/gpu_gather_profile.py", "--smoke", "--json", str(out)], tmp_path)
    report = json.loads(out.read_text())
    tensors = [t for kind in report["kinds"].values() for t in kind["tensors"].values()]
    assert tensors and not any(t["identity"] for t in tensors)  # the stand-ins permute: the gather is exercised
    assert report["all_equal"] is True
    rows = {name for t in tensors for name, row in t["rows"].items() if "bytes_equal" in row}
    if interpret:
        for variant in (
            "gather_b512_w4",
            "gather_b1024_w4_p1",
            "chunked_b1024_c16_w4",
            "chunked_b1024_c16_w4_p1",
            "scatter_b1024_w4",
            "wide4",
        ):
            assert variant in rows, (variant, sorted(rows))
    else:
        assert rows == {"library"}
