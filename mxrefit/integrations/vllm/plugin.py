"""The ``vllm.general_plugins`` entry point (pyproject.toml): ``register``.

vLLM calls it in every one of its processes; it is the only code that registers anything with
vLLM (the weight-transfer backend, and on CPU builds the MXFP8 emulation linear kernel and AMX
tile permission). Importing this module, or any other of mxrefit's, registers nothing.
"""

from __future__ import annotations

import logging

from mxrefit.integrations.vllm.compat import (
    VllmSetupError,
    trainer_engine_kwargs,
    unimplemented_abstract_methods,
    vllm_version,
)
from mxrefit.integrations.vllm.cpu_amx import ensure_amx_usable
from mxrefit.integrations.vllm.engine import BACKEND

log = logging.getLogger("mxrefit.vllm")


def _register_cpu_mxfp8_emulation() -> None:
    """vLLM 0.32's CPU build registers no MXFP8 linear kernel; its emulation kernel works there."""
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.kernels.linear import _POSSIBLE_MXFP8_KERNELS, register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel

    if EmulationMxfp8LinearKernel not in _POSSIBLE_MXFP8_KERNELS.get(PlatformEnum.CPU, []):
        register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")


def _prepare_cpu_amx() -> None:
    """Only vLLM's CPU build runs AMX tile kernels; GPU builds leave the CPU's state alone."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        ensure_amx_usable()


_REGISTERED = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: the "mxrefit" weight-transfer backend (worker and
    trainer factories) and, on CPU, the MXFP8 emulation linear kernel and AMX tile permission
    (``cpu_amx``: without it vLLM's CPU workers die with SIGILL on AMX hosts). Idempotent.

    vLLM calls general plugins without a guard in every one of its processes, so this never
    raises: on a vLLM whose interfaces it cannot serve (older, newer, broken) it logs one
    warning, leaves nothing registered, and vLLM starts as if mxrefit were not installed.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    added = []
    try:
        _prepare_cpu_amx()
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

        from mxrefit.integrations.vllm import transfer  # imports vLLM: only here, where vLLM asked for it

        worker_cls, trainer_cls = transfer.MxrefitWeightTransferEngine, transfer.MxrefitTrainerEngine
        _check_backend_classes(worker_cls, trainer_cls)
        for factory, cls in ((WeightTransferEngineFactory, worker_cls), (WeightTransferTrainerFactory, trainer_cls)):
            if BACKEND not in factory._registry:
                factory.register_engine(BACKEND, cls)
                added.append(factory)
        _register_cpu_mxfp8_emulation()
    except Exception as err:  # noqa: BLE001 - a plugin must never stop vLLM from starting
        for factory in added:
            factory._registry.pop(BACKEND, None)
        log.warning(
            "mxrefit: not registered with this vLLM (%s), which runs without mxrefit's 'mxrefit' weight-transfer backend: %s: %s",
            _version_or_broken(),
            type(err).__name__,
            err,
        )
        return


def _check_backend_classes(worker_cls: type, trainer_cls: type) -> None:
    """Both backend classes can be built on this vLLM, before anything is registered."""
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

    for cls in (worker_cls, trainer_cls):
        left = unimplemented_abstract_methods(cls)
        if left:
            raise VllmSetupError(
                f"vLLM {vllm_version()}'s {cls.__mro__[1].__name__} declares {left}, which mxrefit does not implement"
            )
    trainer_engine_kwargs(TrainerWeightTransferEngine, config=None, is_sender=True, rank=0)


def _version_or_broken() -> str:
    try:
        return f"vLLM {vllm_version()}"
    except Exception as err:  # noqa: BLE001 - named in the warning
        return f"vLLM does not import: {type(err).__name__}: {err}"
