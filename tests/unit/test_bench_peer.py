"""`--peer checkpoint-engine` refuses clearly where it cannot run (CPU, no package, not cuda:0).

The run itself needs CUDA and checkpoint-engine: it is not tested here (docs/benchmarks.md)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from mxrefit.bench import peer
from mxrefit.bench.peer import _digests, unavailable


def _fake_importlib(installed: bool, import_error: str | None = None) -> types.SimpleNamespace:
    def import_module(name: str):
        if import_error:
            raise ModuleNotFoundError(import_error)
        return types.ModuleType(name)

    def find_spec(name: str):
        assert name == "checkpoint_engine"
        return object() if installed else None

    return types.SimpleNamespace(util=types.SimpleNamespace(find_spec=find_spec), import_module=import_module)


@pytest.fixture
def cuda_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


def test_on_cpu_without_the_package_both_are_named(monkeypatch):
    monkeypatch.setattr(peer, "importlib", _fake_importlib(installed=False))
    why = unavailable("checkpoint-engine", torch.device("cpu"))
    assert why.startswith("--peer checkpoint-engine cannot run here: it needs CUDA")
    assert "this run's device is cpu" in why
    assert "the package checkpoint-engine is not installed: pip install 'mxrefit[peer]' (checkpoint-engine==0.4.2)" in why


def test_on_cpu_with_the_package_only_cuda_is_missing(monkeypatch):
    monkeypatch.setattr(peer, "importlib", _fake_importlib(installed=True))
    why = unavailable("checkpoint-engine", torch.device("cpu"))
    assert "it needs CUDA" in why and "not installed" not in why


def test_a_broken_install_names_the_missing_module(monkeypatch, cuda_here):
    monkeypatch.setattr(peer, "importlib", _fake_importlib(installed=True, import_error="No module named 'loguru'"))
    why = unavailable("checkpoint-engine", torch.device("cuda", 0))
    assert "checkpoint-engine does not import (No module named 'loguru')" in why and "CUDA" not in why


def test_cuda_without_a_gpu_and_another_gpu_than_the_first(monkeypatch):
    monkeypatch.setattr(peer, "importlib", _fake_importlib(installed=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no CUDA device" in unavailable("checkpoint-engine", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA_VISIBLE_DEVICES=1" in unavailable("checkpoint-engine", torch.device("cuda", 1))


def test_nothing_missing_is_no_refusal(monkeypatch, cuda_here):
    monkeypatch.setattr(peer, "importlib", _fake_importlib(installed=True))
    assert unavailable("checkpoint-engine", torch.device("cuda", 0)) is None


def test_an_unknown_peer():
    assert "unknown peer; known: checkpoint-engine" in unavailable("nccl", torch.device("cpu"))


def test_bench_refuses_before_any_work():
    from mxrefit.bench.run import bench

    with pytest.raises(RuntimeError, match="--peer checkpoint-engine cannot run here: it needs CUDA"):
        bench(device="cpu", peers=("checkpoint-engine",), progress=False)


def test_digests_see_every_byte():
    a = {"w": torch.arange(8, dtype=torch.bfloat16)}
    b = {"w": a["w"].clone()}
    assert _digests(a) == _digests(b)
    b["w"].view(torch.int16)[3] ^= 1
    assert _digests(a) != _digests(b)


def test_the_installed_checkpoint_engine_has_the_calls_the_adapter_makes():
    """Where the package is installed: the signatures of 0.4.2 that mxrefit/bench/peer.py calls."""
    ps = pytest.importorskip("checkpoint_engine.ps")
    worker = pytest.importorskip("checkpoint_engine.worker")
    init = inspect.signature(ps.ParameterServer.__init__).parameters
    assert {"rank", "world_size", "master_addr", "master_port"} <= set(init)
    assert {"named_tensors", "use_shared_memory_pool"} <= set(
        inspect.signature(ps.ParameterServer.register_checkpoint).parameters
    )
    assert "force" in inspect.signature(ps.ParameterServer.unregister_checkpoint).parameters
    assert list(inspect.signature(ps.ParameterServer.update).parameters)[:3] == ["self", "checkpoint_name", "req_func"]
    assert list(inspect.signature(worker.update_weights_from_ipc).parameters)[:4] == ["zmq_ctx", "zmq_handle", "device_id", "run"]
