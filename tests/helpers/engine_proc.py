"""Process entry points for the two-process tests: an engine behind a real Receiver, trainers that fail (see tests/helpers/faults.py)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import replace

import torch

SWIZZLED = "_swizzled"


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """The 128x4-tile layout vLLM gives MXFP8 scales after loading (docs/DESIGN), per leading index, flat."""
    rows, cols = scales.shape[-2:]
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = []
    for s in scales.reshape(-1, rows, cols):
        padded = torch.zeros(rp, cp, dtype=torch.uint8)
        padded[:rows, :cols] = s
        out.append(padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
    return torch.cat(out)


def _post_processing_engine(module, mxfp8: bool):
    """A TorchEngine that, like vLLM after loading, derives a swizzled copy of every MXFP8 scale in ``after_refit``.

    The copies are extra parameters (``<scale>_swizzled``) no trainer tensor targets, so the
    checksum op can read them: a refit that left them stale would show.
    """
    from mxrefit.engine.torch import TorchEngine
    from mxrefit.plan.types import ParamSpec

    class PostProcessingEngine(TorchEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.derived = {f"{n}{SWIZZLED}": swizzle_scales(t) for n, t in self._tensors.items() if n.endswith("_scale")}

        def params(self):
            derived = {n: ParamSpec(n, tuple(t.shape), t.dtype) for n, t in self.derived.items()}
            return {**super().params(), **derived}

        def storage(self, param):
            if param in self.derived:
                return self.derived[param].view(torch.uint8)
            return super().storage(param)

        def after_refit(self, version):
            for name, out in self.derived.items():
                out.copy_(swizzle_scales(self._tensors[name.removesuffix(SWIZZLED)]))

    return PostProcessingEngine(module, mxfp8=mxfp8)


def _answer_probes(conn) -> None:
    """Thread: report this process's count of gc-tracked objects whenever asked (the soak's leak check)."""
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        conn.send({"objects": len(gc.get_objects())})


def serve_tiny(
    conn,
    model: str,
    mxfp8: bool,
    timeout_s: float,
    tcp: bool = False,
    quant: str | None = None,
    transactional: bool = False,
    tp: tuple[int, int] = (0, 1),
    die_in_refit: tuple[int, int] | None = None,
    fault: dict | None = None,
    post_process: bool = False,
    probe_conn=None,
) -> None:
    """A tiny transformers model behind a Receiver; ``tp`` = (rank, size) keeps that TP rank's slices.

    ``die_in_refit`` = (n, bucket): exit abruptly once bucket ``bucket`` of the n-th refit landed,
    before the engine acknowledges it (a rank killed mid-refit).
    """
    from mxrefit.engine.receiver import Receiver
    from mxrefit.engine.torch import TorchEngine
    from tests.helpers import models
    from tests.helpers.faults import faulty_engine

    class MortalEngine(TorchEngine):
        refits = 0

        def after_bucket(self, bucket: int) -> None:
            if die_in_refit == (self.refits + 1, bucket):
                os._exit(17)

        def after_refit(self, version: int) -> None:
            self.refits += 1

    logging.basicConfig(level=logging.INFO)
    module = models.tiny_llama(seed=1) if model == "llama" else models.tiny_qwen3_moe(seed=1)
    if fault is not None:
        engine = faulty_engine(module, mxfp8, fault)
    elif post_process:
        engine = _post_processing_engine(module, mxfp8)
    else:
        engine = MortalEngine(module, mxfp8=mxfp8, quant=quant, tp_rank=tp[0], tp_size=tp[1])
    receiver = Receiver(engine, timeout_s=timeout_s, tcp=tcp, transactional=transactional)
    if probe_conn is not None:
        threading.Thread(target=_answer_probes, args=(probe_conn,), daemon=True).start()
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        receiver.close()
        conn.send(receiver.status())


def dying_trainer(address: str, token: bytes, model: str, die_after_acks: int, transport: str | None = None) -> None:
    """Plans, starts a refit, and exits abruptly once ``die_after_acks`` buckets were applied."""
    import os

    from mxrefit.source.sender import Sender
    from tests.helpers import models

    class DyingSender(Sender):
        def _await_applied(self, acked, version, report):
            if acked >= die_after_acks:
                os._exit(17)
            return super()._await_applied(acked, version, report)

    module = models.tiny_llama(seed=5) if model == "llama" else models.tiny_qwen3_moe(seed=5)
    sender = DyingSender(address, token, bucket_bytes=16 << 10, transport=transport)
    sender.refit(dict(module.named_parameters()))


def faulty_trainer(
    address: str, token: bytes, plain_specs: list, seeds: list[int], fault: dict, bucket_bytes: int, timeout_s: float
) -> None:
    """A trainer process that refits once per seed and is killed at the point ``fault`` names."""
    from mxrefit.source.sender import Sender
    from tests.helpers.faults import FaultyClient
    from tests.helpers.refit_helpers import random_weights, specs_from_plain

    specs = specs_from_plain(plain_specs)
    sender = Sender(address, token, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    sender.client.close()
    sender.client = FaultyClient(address, token, fault)
    for seed in seeds:
        sender.refit(random_weights(specs, seed))
    os._exit(0)


def _slowed(process, delay_s: float):
    def slow(tensors):
        time.sleep(delay_s)
        process(tensors)

    return slow


def serve_layout(
    conn,
    shape,
    post: bool,
    timeout_s: float,
    experts: str = "per_expert",
    device: str = "cpu",
    transactional: bool = False,
    direct_layout: bool = True,
    process_delay_s: float = 0.0,
) -> None:
    """An engine process holding vLLM's MXFP8 layout of ``shape`` in exportable memory
    (direct writes), optionally in the TRT-LLM kernel layout: written in place by the trainer
    where the sources allow (``direct_layout``), post-processed from staging elsewhere.
    ``process_delay_s`` makes each layer's processing that much slower (a busy device), so a
    trainer writing over staged bytes not yet processed shows up on every run, not by chance."""
    from mxrefit.engine.layout import LayoutEngine
    from mxrefit.engine.receiver import Receiver
    from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params
    from mxrefit.integrations.vllm.trtllm import vllm_mxfp8_kernel_tables

    logging.basicConfig(level=logging.INFO)
    from mxrefit.devices import resolve

    dev = resolve(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    params = vllm_params(shape, mxfp8=True)
    dests = vllm_destinations(shape, mxfp8=True, experts=experts)
    if post:
        k = vllm_mxfp8_kernel_tables(shape, params, dests, dev, direct=direct_layout)
        units = [replace(u, process=_slowed(u.process, process_delay_s)) for u in k.units] if process_delay_s else k.units
        engine = LayoutEngine(k.params, k.destinations, dev, units=units, kernel=k.kernel)
    else:
        engine = LayoutEngine(params, dests, dev)
    receiver = Receiver(engine, timeout_s=timeout_s, transactional=transactional)
    conn.send({"address": receiver.address, "token": receiver.token})
    try:
        receiver.serve()
    finally:
        receiver.close()
        conn.send({**receiver.status(), "staging_bytes": engine.staging.pool_bytes if engine.staging else 0})


def dying_broadcast_trainer(conn, die_at_publish: int) -> None:
    """A BroadcastSender that, at its ``die_at_publish``-th bucket, announces the bucket to every
    rank and exits abruptly instead of broadcasting it (the trainer dies mid-transfer). It
    readies itself first, then takes the engines' (address, token) list from ``conn``."""
    import os
    import time

    from mxrefit.source.broadcast_sender import BroadcastSender
    from tests.helpers import models

    class DyingBroadcastSender(BroadcastSender):
        published = 0

        def plan(self, specs):
            plan = super().plan(specs)
            publish = self.buffers.publish

            def publish_or_die(slot: int, nbytes: int) -> None:
                self.published += 1
                if self.published == die_at_publish:
                    self.client.send({"op": "ready", "version": 1, "bucket": die_at_publish - 1})
                    time.sleep(1.0)  # let the announcement leave (zmq sends in the background)
                    os._exit(17)
                publish(slot, nbytes)

            self.buffers.publish = publish_or_die
            return plan

    module = models.tiny_qwen3_moe(seed=5)
    engines = conn.recv()
    sender = DyingBroadcastSender([tuple(e) for e in engines], bucket_bytes=16 << 10, timeout_s=30, rendezvous_timeout_s=30)
    sender.refit(dict(module.named_parameters()))
