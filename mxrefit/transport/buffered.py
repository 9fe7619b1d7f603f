"""The "buffers" transports: two persistent slots the trainer allocates once and the engine opens once.

Trainer side ``BufferSend`` (one per buffer kind: ``shm`` between host processes, ``cuda_ipc``
on one GPU; the kinds are in ``mxrefit.transport.factory``): bucket *i* is encoded into slot
*i* % 2 and the engine copies it out while the trainer packs bucket *i + 1*. Engine side
``BufferLand`` serves every kind, ``broadcast`` included: it opens whatever the plan message
describes and copies each bucket from its slot once the kind ``fetch``-ed it.
"""

from __future__ import annotations

from typing import Any

import torch

from mxrefit.plan.build import Bucket, RefitPlan
from mxrefit.transport.base import LandInit, LandPath, SendInit, SlotSend
from mxrefit.transport.buffers import OpenedBuffers, TransferBuffers
from mxrefit.transport.factory import create_buffers, decline_buffers, open_buffers


class BufferSend(SlotSend):
    """Trainer side over slots of one shared-memory kind (``kind``: ``"shm"`` or ``"cuda_ipc"``)."""

    kind: str

    def __init__(self, init: SendInit) -> None:
        super().__init__(init.device)

    def _new_buffers(self, plan: RefitPlan) -> TransferBuffers:
        return create_buffers(self.kind, plan.slots, plan.bucket_bytes, self.device)


class ShmSend(BufferSend):
    name = kind = "shm"


class CudaIpcSend(BufferSend):
    name = kind = "cuda_ipc"


class BufferLand(LandPath):
    """Engine side of every buffer kind: the trainer's slots opened for the plan, each bucket copied from its slot."""

    wire = "buffers"

    def __init__(self, opened: OpenedBuffers) -> None:
        self.opened = opened

    @classmethod
    def open(cls, msg: dict[str, Any], plan: RefitPlan, init: LandInit) -> BufferLand:
        # waits (a broadcast rendezvous) are bounded by this engine's timeout, not the message's
        opened = open_buffers(msg["buffers"], init.device, max_wait_s=init.max_wait_s)
        bufs = opened.buffers
        if len(bufs) != plan.slots or any(b.numel() < plan.bucket_bytes for b in bufs):
            opened.close()
            raise ValueError(f"trainer offered {len(bufs)} buffers, the plan needs {plan.slots} of {plan.bucket_bytes} bytes")
        return cls(opened)

    @classmethod
    def decline(cls, msg: dict[str, Any], why: str) -> None:
        decline_buffers(msg.get("buffers"), why)

    def arrival(self, bucket: Bucket) -> torch.Tensor:
        return self.opened.buffers[bucket.slot]

    def fetch(self, bucket: Bucket) -> None:
        self.opened.fetch(bucket.slot, bucket.nbytes)

    def close(self) -> None:
        self.opened.close()
