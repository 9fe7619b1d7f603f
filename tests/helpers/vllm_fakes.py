"""Fakes of vLLM's weight-transfer interface, one per shape released from 0.26 to 0.34, plus
shapes no release has. Class headers and signatures are copied from each release's
``vllm/distributed/weight_transfer/{base,factory}.py`` (0.33.0 and 0.34.0 are identical
there); bodies keep only what the plugin and the trainer engine touch.
``tests/integration/test_vllm_plugin.py`` checks the fake of the installed vLLM against the real classes.

``write_fake(root, shape)`` writes a ``vllm`` package under ``root``; put ``root`` first on
``sys.path`` (a subprocess's PYTHONPATH) to import it instead of a real vLLM.
"""

from __future__ import annotations

import os
import textwrap

_INIT = '__version__ = "{version}"\n'

_PLATFORMS = """
import enum
class PlatformEnum(enum.Enum):
    CUDA = enum.auto()
    CPU = enum.auto()
class _Platform:
    def is_cpu(self):
        return False
current_platform = _Platform()
"""

_BASE_COMMON = """
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Generic, TypeVar

import torch

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")
TTrainerInitInfo = TypeVar("TTrainerInitInfo")
TConfig = TypeVar("TConfig")


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024
    pass


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    pass


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    init_info_cls: type
    update_info_cls: type
    supports_draft_weight_update: bool = True

    def __init__(self, config, vllm_config, device, model) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.device = device
        self.model = model

    def parse_init_info(self, init_dict: dict[str, Any]):
        return self.init_info_cls(**init_dict)

    @abstractmethod
    def init_transfer_engine(self, init_info) -> None: ...

    @abstractmethod
    def start_weight_update(self) -> None: ...

    @abstractmethod
    def finish_weight_update(self) -> None: ...

    @abstractmethod
    def receive_weights(self, update_info) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
{worker_extra}
"""

_SEND_WEIGHTS_0_26 = """
    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None: ...
"""

_SOURCE_ITER = """
class WeightSource(ABC):
    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class ModuleSource(WeightSource):
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self._module.named_parameters()]

    def __iter__(self):
        yield from self._module.named_parameters()
"""

_SOURCE_ITER_FULL = """
class WeightSource(ABC):
    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def iter_full(self):
        raise NotImplementedError

    def iter_local(self):
        raise NotImplementedError


class ModuleSource(WeightSource):
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self._module.named_parameters()]

    def iter_full(self):
        yield from self._module.named_parameters()
"""

# 0.26: the trainer engine is Generic[TConfig, TInitInfo] and takes the config
_TRAINER_0_26 = """
@dataclass
class TrainerInitInfo(WeightTransferInitInfo):
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine(ABC, Generic[TConfig, TInitInfo]):
    init_info_cls: type
    config_cls: type

    def __init__(self, config, *, client, source, is_sender: bool = True) -> None:
        self.config = config
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, config, init_info, *, client, source): ...

    @abstractmethod
    def send_weights(self) -> None: ...
"""

_TRAINER_INFO_0_27 = """
@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string")

    @property
    def is_sender(self) -> bool:
        return self.rank == 0
"""

_TRAINER_0_27 = (
    _TRAINER_INFO_0_27
    + """

class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client, source, is_sender: bool = True) -> None:
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source): ...

    @abstractmethod
    def send_weights(self) -> None: ...
"""
)

_TRAINER_0_32 = (
    _TRAINER_INFO_0_27
    + """

class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source=None): ...

    @abstractmethod
    def send_weights(self) -> None: ...
"""
)

_TRAINER_0_33 = (
    _TRAINER_INFO_0_27
    + """

class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0) -> None:
        self.is_sender = is_sender
        self.rank = rank
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source=None): ...

    @abstractmethod
    def send_weights(self) -> None: ...
"""
)

_FACTORY = """
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine


class _Factory:
    _registry: dict = {{}}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{{name}}' is already registered.")
        cls._registry[name] = lambda: module_path_or_cls


class WeightTransferEngineFactory(_Factory):
    _registry: dict = {{}}

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        return cls._registry[config.backend]()(config, vllm_config, device, model)


class WeightTransferTrainerFactory(_Factory):
    _registry: dict = {{}}
{trainer_init}
"""

# 0.26: trainer_init(backend, config, init_info, ...) and passes config= on
_FACTORY_INIT_0_26 = """
    @classmethod
    def trainer_init(cls, backend, config, init_info, *, client, source):
        return cls._registry[backend]().trainer_init(config=config, init_info=init_info, client=client, source=source)
"""

_FACTORY_INIT_0_27 = """
    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        return cls._registry[init_info.backend]().trainer_init(init_info=init_info, client=client, source=source)
"""

# shapes no release has: what a future vLLM could do
_TRAINER_NEEDS_TRANSPORT = (
    _TRAINER_INFO_0_27
    + """

class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client, source=None, is_sender: bool = True, transport) -> None:
        self.transport = transport

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source=None): ...

    @abstractmethod
    def send_weights(self) -> None: ...
"""
)

_NEW_ABSTRACT = """
    @abstractmethod
    def apply_patch(self, patch) -> None: ...
"""


SHAPES: dict[str, dict] = {
    "0.26": {
        "version": "0.26.0",
        "worker_extra": _SEND_WEIGHTS_0_26,
        "source": _SOURCE_ITER,
        "trainer": _TRAINER_0_26,
        "factory_init": _FACTORY_INIT_0_26,
    },
    "0.27": {
        "version": "0.27.1",
        "worker_extra": _SEND_WEIGHTS_0_26,
        "source": _SOURCE_ITER,
        "trainer": _TRAINER_0_27,
        "factory_init": _FACTORY_INIT_0_27,
    },
    "0.32": {
        "version": "0.32.0",
        "worker_extra": "",
        "source": _SOURCE_ITER,
        "trainer": _TRAINER_0_32,
        "factory_init": _FACTORY_INIT_0_27,
    },
    "0.33": {
        "version": "0.34.0",
        "worker_extra": "",
        "source": _SOURCE_ITER_FULL,
        "trainer": _TRAINER_0_33,
        "factory_init": _FACTORY_INIT_0_27,
    },
}

# never released: the plugin must log one warning and register nothing
UNSEEN: dict[str, dict] = {
    "trainer-needs-unknown-argument": {**SHAPES["0.33"], "version": "0.99.0", "trainer": _TRAINER_NEEDS_TRANSPORT},
    "worker-gains-abstract-method": {**SHAPES["0.33"], "version": "0.99.0", "worker_extra": _NEW_ABSTRACT},
    "no-weight-transfer-module": {**SHAPES["0.33"], "version": "0.20.0", "drop": "distributed/weight_transfer"},
    "vllm-does-not-import": {**SHAPES["0.33"], "version": "0.99.0", "broken": True},
}


def write_fake(root: str, shape: dict) -> str:
    """A fake ``vllm`` package of ``shape`` under ``root``; returns ``root``."""
    files = {
        "__init__.py": _INIT.format(version=shape["version"])
        + ('raise RuntimeError("undefined symbol: _ZN3c10 (a vLLM built for another torch)")\n' if shape.get("broken") else ""),
        "platforms/__init__.py": _PLATFORMS,
        "distributed/__init__.py": "",
        "distributed/weight_transfer/__init__.py": "",
        "distributed/weight_transfer/base.py": _BASE_COMMON.format(worker_extra=shape["worker_extra"])
        + shape["source"]
        + shape["trainer"],
        "distributed/weight_transfer/factory.py": _FACTORY.format(trainer_init=shape["factory_init"]),
    }
    drop = shape.get("drop")
    for rel, text in files.items():
        if drop and rel.startswith(drop):
            continue
        path = os.path.join(root, "vllm", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
    return root


# ---- the reload side: what the engine's adapters read (meta.SKIP_TENSORS, weight_utils,
# the unquantized MoE method's _setup_kernel), per release ----------------------------------

_QUANT_BASE = """
class QuantizeMethodBase:
    def process_weights_after_loading(self, layer):
        pass
"""

# 0.34's weight_utils.finalize_model_weights, minus the device-offload context
_FINALIZE_0_34 = """
def finalize_model_weights(model, target_device=None):
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    seen = set()

    def children_first(module):
        quantized = isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        for child in [] if quantized else module.children():
            if child not in seen:
                seen.add(child)
                yield from children_first(child)
        yield module

    for module in children_first(model):
        if isinstance(module, QuantizeMethodBase):
            continue
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()
"""

# _setup_kernel's tail: 0.32-0.34 run the experts' post-load step on the first build only;
# 0.26/0.27 have no such step
_SETUP_0_26 = """
class UnquantizedFusedMoEMethod:
    moe_kernel = None

    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        if not is_weight_update:
            self.moe_kernel = object()
"""

_SETUP_0_32 = """
class UnquantizedFusedMoEMethod:
    moe_kernel = None

    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        if not is_weight_update:
            self._init_moe_kernel(layer)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
"""

_SKIP_0_26 = 'SKIP_TENSORS = {"_expert_map", "expert_mask", "e_score_correction_bias"}\n'
_SKIP_0_27 = (
    'SKIP_LOAD_TENSORS = {"_expert_map", "expert_mask", "e_score_correction_bias"}\nSKIP_TENSORS = SKIP_LOAD_TENSORS | {"bias"}\n'
)

RELOAD_SHAPES: dict[str, dict[str, str]] = {
    "0.26": {"skip": _SKIP_0_26, "finalize": "", "setup": _SETUP_0_26},
    "0.27": {"skip": _SKIP_0_27, "finalize": "", "setup": _SETUP_0_26},
    "0.32": {"skip": _SKIP_0_27, "finalize": "", "setup": _SETUP_0_32},
    "0.34": {"skip": _SKIP_0_27, "finalize": _FINALIZE_0_34, "setup": _SETUP_0_32},
}


def write_reload_fake(root: str, name: str) -> str:
    """A fake ``vllm`` holding the reload-side modules of release ``name`` under ``root``."""
    shape = RELOAD_SHAPES[name]
    files = {
        "__init__.py": _INIT.format(version=name + ".0"),
        "model_executor/__init__.py": "",
        "model_executor/model_loader/__init__.py": "",
        "model_executor/model_loader/reload/__init__.py": "",
        "model_executor/model_loader/reload/meta.py": shape["skip"],
        "model_executor/model_loader/weight_utils.py": shape["finalize"],
        "model_executor/layers/__init__.py": "",
        "model_executor/layers/quantization/__init__.py": "",
        "model_executor/layers/quantization/base_config.py": _QUANT_BASE,
        "model_executor/layers/fused_moe/__init__.py": "",
        "model_executor/layers/fused_moe/unquantized_fused_moe_method.py": shape["setup"],
    }
    for rel, text in files.items():
        path = os.path.join(root, "vllm", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
    return root
