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
import torch

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
    # the stand-in moves 4x4-byte tiles, rows of a tile in turn: 4 rows x 32 bytes is the first whole-block group
    assert {a: t["write_group_bytes"] for a, t in report["kinds"]["dense"]["tensors"].items()} == {
        "weight": 128,
        "weight_scale": None,
    }
    # the same whole-block group seen as units (formats/block_permutation.py): 4 blocks into 2 chunks
    written = report["kinds"]["dense"]["trainer_write"]["weight"]
    assert (written["blocks_per_unit"], written["chunks_per_unit"]) == (4, 2), written
    rows = {name for t in tensors for name, row in t["rows"].items() if "bytes_equal" in row}
    if interpret:  # the trainer-side kernel's bytes against the stand-in's processing (all_equal counts them)
        assert written["write_b128_w4"]["bytes_equal"] is True, written
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


def test_write_group_finds_whole_blocks_and_refuses_a_scatter():
    """The profile's write-group size on known indices: identity (every 32 bytes whole), a permutation of whole
    blocks, the 4-row tile of the CPU stand-in, and a random byte permutation (no size) as the negative control."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_gather_profile", "scripts/gpu_gather_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    n = 4096
    assert profile.write_group_bytes(torch.arange(n)) == 32
    blocks = torch.randperm(n // 32, generator=torch.Generator().manual_seed(0))
    assert profile.write_group_bytes((blocks[:, None] * 32 + torch.arange(32)).reshape(-1)) == 32
    rows = torch.arange(n).view(16, 256)  # 16 rows of 256 bytes, 4-row tiles read down columns of 4-byte words
    assert profile.write_group_bytes(rows.view(4, 4, 64, 4).permute(0, 2, 1, 3).reshape(-1)) == 128  # 8 words x 4 rows
    assert profile.write_group_bytes(torch.randperm(n, generator=torch.Generator().manual_seed(1))) is None
