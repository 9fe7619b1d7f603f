"""Worker side of the worker-extension route: ``RefitWorkerExtension``'s RPCs, one Receiver per worker.

vLLM mixes ``RefitWorkerExtension`` into its worker (``worker_extension_cls=
"mxrefit.integrations.vllm.worker.RefitWorkerExtension"``); the trainer calls its methods by
name with ``collective_rpc`` and reads the answers with ``worker_results`` / ``rank_endpoints``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from mxrefit.engine.receiver import Receiver
from mxrefit.errors import MxrefitError
from mxrefit.integrations.vllm.compat import VllmSetupError
from mxrefit.integrations.vllm.cpu_amx import amx_safe
from mxrefit.integrations.vllm.engine import TensorParallelRank, VllmEngine

log = logging.getLogger("mxrefit.vllm")


def worker_address(address: str | None, tp: TensorParallelRank) -> str | None:
    """The address this worker binds: ``{ip}`` becomes its host's IP (vLLM's ``get_ip``), ``{rank}``
    its tensor-parallel rank. With TP > 1 every worker gets the same string, so one that names a
    single socket is refused (a second ipc bind would silently take over the first one's path)."""
    if address is None:
        return None
    if tp.size > 1 and "{rank}" not in address and not address.endswith(":*"):
        raise VllmSetupError(
            f"address {address!r} would be bound by all {tp.size} tensor-parallel workers; put '{{rank}}' in it "
            f"or use a tcp address with port '*' (e.g. 'tcp://{{ip}}:*' with allow_remote=True)"
        )
    if "{ip}" in address:
        from vllm.utils.network_utils import get_ip

        address = address.replace("{ip}", get_ip())
    return address.replace("{rank}", str(tp.rank))


class _WorkerRefit:
    """A Receiver serving one vLLM worker's model; refits are served on the worker's thread."""

    def __init__(
        self,
        worker: Any,
        *,
        address: str | None,
        token: bytes | None,
        experts: str,
        timeout_s: float,
        tcp: bool = False,
        fp8_block: str = "fp8-block",
        allow_remote: bool = False,
        verify: bool | None = None,
    ):
        engine = VllmEngine(
            worker.model_runner.get_model(),
            worker.vllm_config,
            worker.device,
            experts=experts,
            fp8_block=fp8_block,
            verify=verify,
        )
        self.engine = engine
        self.receiver = Receiver(
            engine,
            address=worker_address(address, engine.tp),
            token=token,
            timeout_s=timeout_s,
            tcp=tcp,
            allow_remote=allow_remote,
        )

    def info(self) -> dict:
        return {
            "address": self.receiver.address,
            "token": self.receiver.token.hex(),
            "slow_path": len(self.engine.slow_path),
            "units": len(self.engine.units),
            "tp_rank": self.engine.tp.rank,
            "tp_size": self.engine.tp.size,
            "amx_safe": amx_safe(),
            "learned_layouts": dict(self.engine.learned_layouts),
            **self.receiver.status(),
        }

    def receive(self, refits: int | None = 1) -> dict:
        # serving until "shutdown" (refits=None), a trainer that goes silent for the receiver's
        # timeout frees the worker rather than holding its RPC forever
        idle = self.receiver.timeout_s if refits is None else None
        with torch.no_grad():
            self.receiver.serve(refits=refits, idle_timeout_s=idle)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        return self.info()

    def close(self) -> None:
        self.receiver.close()
        self.engine.pool.release()


WORKER_ERROR = "mxrefit_error"


class WorkerError(MxrefitError, RuntimeError):
    """A worker-extension method failed on some of several workers (named, with their errors)."""


def _answers_on_every_worker(method):
    """With several workers, a failure comes back as ``{WORKER_ERROR: "..."}`` instead of raising.

    vLLM 0.32's multiprocess executor stops reading answers at the first worker that raised
    (``collective_rpc`` in ``v1/executor/multiproc_executor.py``; vllm-project/vllm#49972), so
    the other workers' answers stay queued and every later RPC reads a stale one. One worker
    raising is harmless; ``worker_results`` turns the answers back into an error on the trainer.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.vllm_config.parallel_config.world_size == 1:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - answered, so every worker's queue stays in step
            log.exception("mxrefit: %s failed on this worker", method.__name__)
            return {WORKER_ERROR: f"{type(err).__name__}: {err}"}

    return wrapper


def worker_results(results: Sequence[Any]) -> list:
    """``collective_rpc``'s answers of a worker-extension method, or WorkerError naming every
    worker on which it failed."""
    failed = [f"worker {i}: {r[WORKER_ERROR]}" for i, r in enumerate(results) if isinstance(r, dict) and WORKER_ERROR in r]
    if failed:
        raise WorkerError("; ".join(failed))
    return list(results)


def rank_endpoints(infos: Sequence[dict]) -> list[tuple[str, bytes]]:
    """Every worker's (address, token) from ``collective_rpc("mxrefit_init")``, in worker order:
    the ``engines`` argument of ``BroadcastSender``."""
    return [(i["address"], bytes.fromhex(i["token"])) for i in worker_results(infos)]


class RefitWorkerExtension:
    """Mixed into vLLM's worker via ``worker_extension_cls``; call methods by name with
    ``llm.collective_rpc("mxrefit_init", kwargs=...)`` etc. Plain data in and out. With several
    workers (tensor parallel) a method that fails answers ``{WORKER_ERROR: why}`` on that worker
    rather than raising (``worker_results`` raises it on the trainer's side)."""

    _mxrefit: _WorkerRefit | None = None  # set by mxrefit_init on this worker

    @_answers_on_every_worker
    def mxrefit_init(
        self,
        address: str | None = None,
        token_hex: str | None = None,
        experts: str = "per_expert",
        timeout_s: float = 120.0,
        tcp: bool = False,
        fp8_block: str = "fp8-block",
        allow_remote: bool = False,
        verify: bool | None = None,
    ) -> dict:
        """Build the engine tables and open the control socket; returns its address and token (hex).
        ``fp8_block``: the wire format for a block-FP8 engine; ``verify``: check the first refit
        against vLLM's own loader (default: with ``MXREFIT_VERIFY=1`` or on an untested vLLM;
        ``VllmEngine``).

        Every worker answers (``collective_rpc`` returns one dict per worker, with its
        ``tp_rank``/``tp_size``). ``address`` may hold ``{ip}`` and ``{rank}`` (``worker_address``);
        a worker on another node than the trainer binds e.g. ``"tcp://{ip}:*"`` with ``allow_remote=True``.
        """
        if self._mxrefit is not None:
            self._mxrefit.close()
        token = bytes.fromhex(token_hex) if token_hex else None
        self._mxrefit = _WorkerRefit(
            self,
            address=address,
            token=token,
            experts=experts,
            timeout_s=timeout_s,
            tcp=tcp,
            fp8_block=fp8_block,
            allow_remote=allow_remote,
            verify=verify,
        )
        return self._mxrefit.info()

    @_answers_on_every_worker
    def mxrefit_receive(self, refits: int | None = 1) -> dict:
        """Serve the trainer until ``refits`` refits ended (committed, aborted or failed), or with
        ``refits=None`` until the trainer says "shutdown" (``refit_while(..., until_shutdown=True)``)."""
        return self._require().receive(refits)

    @_answers_on_every_worker
    def mxrefit_status(self) -> dict:
        return self._require().info()

    @_answers_on_every_worker
    def mxrefit_kernel_state(self, names: list[str] | None = None) -> dict:
        """{param: {sha256, shape, dtype}} of the live model as its kernels read it."""
        return self._require().engine.kernel_state(names)

    @_answers_on_every_worker
    def mxrefit_kernel_addresses(self) -> dict:
        """{tensor: data_ptr} of everything the kernels read; equal before and after a refit."""
        return self._require().engine.kernel_addresses()

    @_answers_on_every_worker
    def mxrefit_close(self) -> None:
        if self._mxrefit is not None:
            self._mxrefit.close()
            self._mxrefit = None

    def _require(self) -> _WorkerRefit:
        if self._mxrefit is None:
            raise RuntimeError("call collective_rpc('mxrefit_init') first")
        return self._mxrefit
