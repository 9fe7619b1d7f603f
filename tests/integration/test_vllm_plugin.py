"""The general plugin never harms a vLLM, and the weight-transfer backend speaks every released
interface shape from 0.26 to 0.34.

Each case runs ``mxrefit.integrations.vllm.plugin.register`` in a fresh process whose ``vllm`` is a fake of one
interface shape (``tests/helpers/vllm_fakes.py``, signatures copied from each release's source): the
released shapes must register and carry a trainer round trip through their own factory
(0.26's ``trainer_init(backend, config, init_info)``, 0.33/0.34's cached ``metadata`` and
``iter_full``); shapes no release has, a vLLM without the weight-transfer API and a vLLM that
does not import must log exactly one warning and register nothing, and importing must not raise.
The installed vLLM's real classes are checked against the fake of their own shape.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import vllm_fakes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("mxrefit").addHandler(Keep())
import mxrefit.integrations.vllm.plugin as plugin
plugin.register()
out = {"warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING]}
try:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    out["registered"] = ["mxrefit" in WeightTransferEngineFactory._registry,
                         "mxrefit" in WeightTransferTrainerFactory._registry]
except Exception as err:
    out["registered"] = [False, False]
if all(out["registered"]):
    import torch
    import mxrefit.integrations.vllm.transfer as mx
    from vllm.distributed.weight_transfer.base import ModuleSource

    class Client:
        def __init__(self):
            self.calls = []
        def init_weight_transfer_engine(self, init_info):
            self.calls.append("init_weight_transfer_engine")
            self.init_info = init_info
        def start_weight_update(self):
            self.calls.append("start_weight_update")
        def update_weights(self, update_info):
            self.calls.append("update_weights")
        def finish_weight_update(self):
            self.calls.append("finish_weight_update")

    driven = []
    source_tensors = mx.source_tensors
    def recorded(source):
        names = []
        driven.append(names)
        for name, tensor in source_tensors(source):
            names.append(name)
            yield name, tensor
    mx.source_tensors = recorded
    def refit_while(serve, sender, tensors, *, specs=None, until_shutdown=False):
        for _ in tensors:
            pass
        serve()
    mx.refit_while = refit_while

    model = torch.nn.Linear(4, 2)
    for rank in (0, 1):
        client = Client()
        init = mx.MxrefitTrainerEngine.init_info_cls(rank=rank)
        if sys.argv[1] == "positional-backend":
            engine = WeightTransferTrainerFactory.trainer_init("mxrefit", {"backend": "mxrefit"}, init, client=client,
                                                               source=ModuleSource(model))
        else:
            engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
        engine.send_weights()
        engine.shutdown()
        out[f"rank{rank}"] = {"calls": client.calls, "sender": engine.is_sender,
                              "specs": [s.name for s in engine.specs or []]}
        if rank == 0:
            worker = WeightTransferEngineFactory._registry["mxrefit"]()(None, None, "cpu", None)
            out["worker_address_matches"] = worker.parse_init_info(client.init_info).address == client.init_info["address"]
    out["driven"] = driven
print("PROBE" + json.dumps(out))
"""


def _probe(tmp_path, shape: dict, style: str = "init-info") -> dict:
    root = vllm_fakes.write_fake(str(tmp_path), shape)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, ROOT])}
    proc = subprocess.run([sys.executable, "-c", _PROBE, style], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[0][len("PROBE") :])


@pytest.mark.parametrize("name", sorted(vllm_fakes.SHAPES))
def test_each_released_interface_registers_and_carries_a_refit_round_trip(tmp_path, name):
    out = _probe(tmp_path, vllm_fakes.SHAPES[name], "positional-backend" if name == "0.26" else "init-info")
    assert out["warnings"] == [] and out["registered"] == [True, True]
    assert out["rank0"] == {
        "calls": ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"],
        "sender": True,
        "specs": ["weight", "bias"],
    }
    # a non-sender rank still drives the source (its collectives) and never touches the client
    assert out["rank1"] == {"calls": [], "sender": False, "specs": []}
    assert out["driven"] == [["weight", "bias"], ["weight", "bias"]]
    assert out["worker_address_matches"]


@pytest.mark.parametrize("name", sorted(vllm_fakes.UNSEEN))
def test_an_interface_never_seen_gets_one_warning_and_nothing_registered(tmp_path, name):
    out = _probe(tmp_path, vllm_fakes.UNSEEN[name])
    assert out["registered"] == [False, False]
    assert len(out["warnings"]) == 1 and "not registered" in out["warnings"][0], out["warnings"]


def test_finish_weight_update_follows_the_llm_signature():
    from mxrefit.integrations.vllm.client import LLMClient
    from mxrefit.integrations.vllm.compat import VllmSetupError

    class Llm026:  # LLM.finish_weight_update in 0.26
        def finish_weight_update(self) -> None:
            self.got = ()

    class Llm032:  # 0.27 and later
        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self.got = (weight_version,)

    old, new = Llm026(), Llm032()
    LLMClient(old).finish_weight_update()
    LLMClient(new).finish_weight_update("step-3")
    assert old.got == () and new.got == ("step-3",)
    with pytest.raises(VllmSetupError, match="weight_version"):
        LLMClient(old).finish_weight_update("step-3")


def _shape_of_installed() -> str:
    vllm = pytest.importorskip("vllm")
    for name, shape in vllm_fakes.SHAPES.items():
        if shape["version"] == vllm.__version__:
            return name
    pytest.skip(f"no fake of vLLM {vllm.__version__}'s shape")


@pytest.mark.vllm
@pytest.mark.vllm_matrix
def test_the_fake_of_the_installed_vllm_has_its_signatures(tmp_path):
    """The fakes stay honest: the installed vLLM's classes have the fake's signatures."""
    import importlib

    name = _shape_of_installed()
    root = vllm_fakes.write_fake(str(tmp_path), vllm_fakes.SHAPES[name])
    spec = importlib.util.spec_from_file_location(
        "fake_base", os.path.join(root, "vllm", "distributed", "weight_transfer", "base.py")
    )
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    from vllm.distributed.weight_transfer import base as real

    def params(fn) -> list[tuple[str, object, bool]]:
        return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(fn).parameters.values()]

    for cls, method in [
        ("TrainerWeightTransferEngine", "__init__"),
        ("TrainerWeightTransferEngine", "trainer_init"),
        ("WeightTransferEngine", "__init__"),
    ]:
        assert params(getattr(getattr(real, cls), method)) == params(getattr(getattr(fake, cls), method)), (cls, method)
    for cls in ("TrainerWeightTransferEngine", "WeightTransferEngine"):
        assert getattr(real, cls).__abstractmethods__ == getattr(fake, cls).__abstractmethods__, cls
        assert len(getattr(real, cls).__parameters__) == len(getattr(fake, cls).__parameters__), cls
    assert isinstance(
        inspect.getattr_static(real.ModuleSource, "metadata"), type(inspect.getattr_static(fake.ModuleSource, "metadata"))
    )
