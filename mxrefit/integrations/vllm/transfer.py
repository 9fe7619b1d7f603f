"""vLLM's weight-transfer API: the "mxrefit" backend, worker side and trainer side.

``WeightTransferConfig(backend="mxrefit")``: ``MxrefitWeightTransferEngine`` (worker side) and
``MxrefitTrainerEngine`` (trainer side, ``WeightTransferTrainerFactory``) follow vLLM's
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``. This module imports vLLM; ``plugin.register`` imports it and puts
both classes into vLLM's factories, nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from mxrefit.engine.receiver import Receiver
from mxrefit.integrations.vllm.client import refit_while
from mxrefit.integrations.vllm.compat import VllmSetupError, source_metadata, source_tensors, trainer_engine_kwargs
from mxrefit.integrations.vllm.engine import BACKEND, VllmEngine
from mxrefit.plan.build import SourceSpec
from mxrefit.source.sender import Sender
from mxrefit.transport.control import new_token, private_ipc_address


@dataclass
class MxrefitInitInfo(WeightTransferInitInfo):
    """Worker side: where to listen and the session token (hex); the trainer makes both."""

    address: str
    token_hex: str
    experts: str = "per_expert"
    timeout_s: float = 120.0
    fp8_block: str = "fp8-block"


@dataclass
class MxrefitUpdateInfo(WeightTransferUpdateInfo):
    """Nothing per round: the plan and buffers travel on mxrefit's own control channel."""


# unsubscripted: the generic parameters differ between vLLM versions (0.26's trainer engine
# takes [TConfig, TInitInfo], later ones [TTrainerInitInfo]) and nothing reads them at run time
class MxrefitWeightTransferEngine(WeightTransferEngine):
    init_info_cls = MxrefitInitInfo
    update_info_cls = MxrefitUpdateInfo
    supports_draft_weight_update = False
    receiver: Receiver | None = None  # set by init_transfer_engine

    def init_transfer_engine(self, init_info: MxrefitInitInfo) -> None:
        self.shutdown()
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            # refused by the last worker alone: vLLM 0.32 reads the workers' answers in order and
            # stops at the first failure (see _answers_on_every_worker), so every answer is read
            from vllm.distributed.parallel_state import get_world_group  # vLLM internals beyond the weight-transfer interface

            world = get_world_group()
            if world.rank_in_group == world.world_size - 1:
                raise VllmSetupError(
                    "the 'mxrefit' weight-transfer backend serves one worker at the one address the trainer "
                    "chose; with tensor parallel size > 1 use the worker extension (RefitWorkerExtension: "
                    "mxrefit_init on every worker) and mxrefit.source.broadcast_sender.BroadcastSender"
                )
            return
        engine = VllmEngine(self.model, self.vllm_config, self.device, experts=init_info.experts, fp8_block=init_info.fp8_block)
        self.receiver = Receiver(
            engine, address=init_info.address, token=bytes.fromhex(init_info.token_hex), timeout_s=init_info.timeout_s
        )

    def _require(self) -> Receiver:
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine must run before start_weight_update")
        return self.receiver

    def start_weight_update(self) -> None:
        self._require()

    def receive_weights(self, update_info: MxrefitUpdateInfo) -> None:
        with torch.no_grad():
            self._require().serve(refits=1)

    def finish_weight_update(self) -> None:
        status = self._require().status()
        if status["state"] != "ready":
            raise RuntimeError(
                f"mxrefit refit did not complete: engine holds version {status['version']}, "
                f"state {status['state']}: {status['error']}"
            )

    def shutdown(self) -> None:
        receiver = self.receiver
        if receiver is not None:
            receiver.close()
            if isinstance(receiver.engine, VllmEngine):  # always: the engine init_transfer_engine built
                receiver.engine.pool.release()
            self.receiver = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """Declared abstract by vLLM 0.26/0.27's worker engine; mxrefit's trainer side is
        ``MxrefitTrainerEngine``."""
        raise NotImplementedError("mxrefit sends through MxrefitTrainerEngine.trainer_init(...).send_weights()")


@dataclass
class MxrefitTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the device the trainer's tensors live on, bucket size, expert layout,
    and the wire format for a block-FP8 engine (``VllmEngine``'s ``fp8_block``)."""

    backend: ClassVar[str] = BACKEND
    device: str = "cpu"
    bucket_bytes: int = 512 << 20
    experts: str = "per_expert"
    timeout_s: float = 120.0
    fp8_block: str = "fp8-block"


class MxrefitTrainerEngine(TrainerWeightTransferEngine):
    """Plans once from the source's metadata, then each ``send_weights`` streams the source
    (one tensor materialized at a time) while the workers serve ``update_weights``."""

    init_info_cls = MxrefitTrainerInitInfo
    specs: list[SourceSpec] | None = None  # read from the source at the first send_weights

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None, config=None):
        """``config``: the ``WeightTransferConfig`` vLLM 0.26's factory passes (later ones pass none)."""
        if source is None:
            raise ValueError("the mxrefit backend needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            **trainer_engine_kwargs(
                TrainerWeightTransferEngine, config=config, is_sender=init_info.is_sender, rank=init_info.rank
            ),
        )
        engine.sender = None
        if engine.is_sender:
            address, token = private_ipc_address(), new_token()
            client.init_weight_transfer_engine(
                {
                    "address": address,
                    "token_hex": token.hex(),
                    "experts": init_info.experts,
                    "timeout_s": init_info.timeout_s,
                    "fp8_block": init_info.fp8_block,
                }
            )
            engine.sender = Sender(
                address, token, device=init_info.device, bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s
            )
        engine.specs = None  # read from the source at the first send: a source may learn its metadata only then
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in source_tensors(self.source):  # non-senders still run the source's collectives
                pass
            return
        if self.specs is None:
            self.specs = [SourceSpec(m.name, tuple(m.shape), m.dtype) for m in source_metadata(self.source)]
        self.client.start_weight_update()
        self.last_report = refit_while(
            lambda: self.client.update_weights({}), self.sender, source_tensors(self.source), specs=self.specs
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if getattr(self, "sender", None) is not None:
            self.sender.close()
