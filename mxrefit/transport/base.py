"""The transport interface: one data path, two sides, chosen by name from ``mxrefit.transport.registry``.

A transport moves one plan's encoded bytes from the trainer to the engine. ``Sender`` and
``Receiver`` only call this interface; what differs between transports lives behind it:

- ``SendPath`` (trainer side, one per ``Sender``, re-wired at each plan): ``prepare`` wires it for
  a plan, ``offer`` hands the plan message to the engine(s) and returns the answer, ``adopt``
  takes what the engine answered (its exports, for direct writes), ``part_view``/``run_view``
  give the bytes the encoders write, and per bucket ``acquire`` (before rewriting a slot) and
  ``publish`` (after packing it) let a transport move the bytes (a broadcast) or do nothing
  (shared memory).
- ``LandPath`` (engine side, one per adopted plan): ``open`` checks the plan message's fields and
  opens the trainer's memory, ``arrival`` names where a bucket's bytes arrive (a slot the engine
  copies from, or nothing where the trainer writes the engine's own storage), ``fetch`` brings
  them there before the engine reads them, ``planned`` adds the engine's fields to its answer.

The wire protocol (``mxrefit.transport.protocol``) is unchanged by this split: the plan message
carries ``transport`` = ``LandPath.wire`` (``"direct"`` or ``"buffers"``) and, for buffers, the
owner's description; a ``planned`` answer to direct writes carries ``exports``.

Adding a transport: subclass both sides (``SlotSend`` is the trainer side of any transport with
slots; a new buffer kind in ``mxrefit.transport.factory`` reuses ``BufferSend``/``BufferLand`` of
``mxrefit.transport.buffered``) and add it to ``mxrefit.transport.registry``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from mxrefit.plan.build import Bucket, Part, RefitPlan, Run
from mxrefit.transport.buffers import TransferBuffers


class Control(Protocol):
    """The trainer's control channel as the refit uses it: ``ControlClient`` (one engine) or
    ``ControlFanOut`` (N engine ranks answering as one)."""

    @property
    def address(self) -> str: ...

    def send(self, msg: dict[str, Any]) -> object: ...

    def recv(self, timeout_s: float | None, *, step: str) -> dict[str, Any]: ...

    def request(self, msg: dict[str, Any], timeout_s: float | None, *, step: str) -> dict[str, Any]: ...

    def abandon(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    """What the engine's ``tables`` answer says about its storage."""

    exportable: bool  # it can export the storage behind its destinations (and holds no slices)
    device: str  # its device type ("cuda", "cpu")


@dataclass(frozen=True)
class SendInit:
    """What a trainer-side path is made from, once per transport choice."""

    device: torch.device  # where the trainer's encoders write
    address: str  # the engine(s), for messages
    engine: EngineInfo
    timeout_s: float  # every control answer and every collective wait


@dataclass(frozen=True)
class LandInit:
    """What an engine-side path is opened with, at each plan."""

    device: torch.device  # the engine's device
    engine: str  # the engine's class name, for messages
    exportable: bool  # the engine can export its storage
    sharded: bool  # this engine rank holds slices of some parameters
    max_wait_s: float  # the engine's own bound on any wait the plan message asks for


class SendPath(ABC):
    """Trainer side of a transport. Made once per transport choice by the registry and kept across
    plans (a buffer path keeps its slots while they fit); ``close`` releases it."""

    name: ClassVar[str]  # the transport's name (``Sender(transport=...)``, ``RefitReport.transport``)
    buffers: TransferBuffers | None = None  # the slots, for transports that have them

    @classmethod
    def unfit(cls, init: SendInit) -> str | None:
        """Why this transport cannot serve that engine (the message of a ValueError), else None."""
        return None

    @abstractmethod
    def prepare(self, plan: RefitPlan) -> None:
        """Wire this side for ``plan``, before the plan message goes out."""

    def plan_fields(self) -> dict[str, Any]:
        """This transport's fields of the plan message."""
        return {}

    def offer(self, control: Control, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Hand the plan message, with ``plan_fields``, to the engine(s); the (merged) answer."""
        return control.request({**msg, **self.plan_fields()}, timeout_s, step="sending the plan")

    def adopt(self, reply: dict[str, Any]) -> None:
        """The engine adopted the plan with ``reply`` (checked ``planned``). ``Malformed`` if the reply
        lacks what this transport needs; ValueError or LookupError if what it offers cannot be used."""

    @abstractmethod
    def part_view(self, bucket: Bucket, part: Part) -> torch.Tensor:
        """The flat uint8 bytes this side writes for one encoded part."""

    @abstractmethod
    def run_view(self, bucket: Bucket, run: Run) -> torch.Tensor:
        """The flat uint8 bytes this side writes for one run of a bucket (what ``verify`` sums)."""

    def check(self) -> None:
        """Before each refit: ValueError if what the engine exported changed since ``adopt``."""

    def acquire(self, slot: int) -> None:
        """The trainer is about to write ``slot`` again: wait until nothing still reads it."""

    def publish(self, slot: int, nbytes: int) -> None:
        """The trainer wrote the first ``nbytes`` of ``slot``: start moving them to the engine(s)."""

    def discard(self) -> None:
        """A refit stopped midway: transfers may still be pending; the next plan wires anew."""

    @abstractmethod
    def close(self) -> None:
        """Release this side's memory and views; the engine's memory is never freed from here."""


class LandPath(ABC):
    """Engine side of a transport for one adopted plan."""

    wire: ClassVar[str]  # the plan message's ``transport`` field

    @classmethod
    def refusal(cls, init: LandInit) -> str | None:
        """Why this engine cannot take the transport (the message of a ValueError), else None."""
        return None

    @classmethod
    @abstractmethod
    def open(cls, msg: dict[str, Any], plan: RefitPlan, init: LandInit) -> LandPath:
        """Open the trainer's side described in the plan message; ValueError (or TransportError) if not."""

    @classmethod
    def decline(cls, msg: dict[str, Any], why: str) -> None:
        """The engine refused this plan message: tell a trainer that waits for this side (best effort)."""

    @abstractmethod
    def arrival(self, bucket: Bucket) -> torch.Tensor | None:
        """The flat uint8 slot where ``bucket``'s bytes arrive, or None where the trainer writes the
        engine's own storage (nothing for the engine to copy)."""

    def fetch(self, bucket: Bucket) -> None:
        """Before the engine reads ``bucket``: make its bytes present here (TransportError if not)."""

    def planned(self, landing: dict[str, torch.Tensor]) -> dict[str, Any]:
        """This transport's fields of the ``planned`` answer, given the storage refits land in."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Drop this side's views; never destroys the trainer's memory."""


class SlotSend(SendPath):
    """Trainer side over persistent slots (``TransferBuffers``): bucket *i* is encoded into slot
    *i* % slots, which the engine copies from (shared memory) or receives (a broadcast)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: TransferBuffers | None = None

    @abstractmethod
    def _new_buffers(self, plan: RefitPlan) -> TransferBuffers:
        """Slots for ``plan``."""

    def _fits(self, plan: RefitPlan) -> bool:
        b = self.buffers
        return b is not None and b.nbytes >= plan.bucket_bytes and len(b.buffers) == plan.slots

    def prepare(self, plan: RefitPlan) -> None:
        """The current slots when they fit the plan, else new ones."""
        if not self._fits(plan):
            self._drop_buffers()
            self.buffers = self._new_buffers(plan)

    def _slots(self) -> TransferBuffers:
        if self.buffers is None:
            raise RuntimeError(f"the {self.name} transport is not wired: plan first")
        return self.buffers

    def plan_fields(self) -> dict[str, Any]:
        return {"transport": "buffers", "buffers": self._slots().describe()}

    def part_view(self, bucket: Bucket, part: Part) -> torch.Tensor:
        return self._slots().buffers[bucket.slot][part.offset : part.offset + part.target.nbytes]

    def run_view(self, bucket: Bucket, run: Run) -> torch.Tensor:
        return self._slots().buffers[bucket.slot][run.offset : run.offset + run.nbytes]

    def acquire(self, slot: int) -> None:
        self._slots().acquire(slot)

    def publish(self, slot: int, nbytes: int) -> None:
        self._slots().publish(slot, nbytes)

    def _drop_buffers(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None

    def close(self) -> None:
        self._drop_buffers()
