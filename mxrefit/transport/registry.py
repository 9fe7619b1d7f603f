"""The one place that maps a transport's name to its implementation, on both sides.

Trainer side: ``Sender(transport=name)`` makes its path here (``SEND_PATHS``); with no name,
``choose`` takes ``direct`` when the engine can export its storage on the trainer's device type,
else the buffer kind for that device. ``broadcast`` (``mxrefit.transport.broadcast.BroadcastSend``)
is the fourth transport: it needs the fan-out over every engine rank, so ``BroadcastSender``
makes it itself. Engine side: the plan message's ``transport`` field picks the ``LandPath``
(``LAND_PATHS``: ``direct``, or ``buffers`` for every buffer kind, broadcast included).

Adding a transport: implement ``SendPath`` and ``LandPath`` (``mxrefit.transport.base``) and add
a line to each table here; a new buffer kind only needs ``mxrefit.transport.factory`` and a
``BufferSend`` subclass.
"""

from __future__ import annotations

from typing import Any

from mxrefit.transport.base import LandPath, SendInit, SendPath
from mxrefit.transport.broadcast import BroadcastSend
from mxrefit.transport.buffered import BufferLand, BufferSend, CudaIpcSend, ShmSend
from mxrefit.transport.direct import DirectLand, DirectSend
from mxrefit.transport.factory import default_kind

SEND_PATHS: dict[str, type[DirectSend] | type[BufferSend]] = {"direct": DirectSend, "shm": ShmSend, "cuda_ipc": CudaIpcSend}
LAND_PATHS: dict[str, type[LandPath]] = {"buffers": BufferLand, "direct": DirectLand}
NAMES = (*SEND_PATHS, BroadcastSend.name)  # every transport a RefitReport may name


def choose(requested: str | None, init: SendInit) -> str:
    """The transport for this engine: ``requested`` (ValueError if it cannot serve the engine), else
    ``direct`` where it can, else the buffer kind of the trainer's device."""
    if requested is not None:
        why = SEND_PATHS[requested].unfit(init)
        if why is not None:
            raise ValueError(why)
        return requested
    return DirectSend.name if DirectSend.unfit(init) is None else default_kind(init.device)


def send_path(name: str, init: SendInit) -> SendPath:
    """A trainer-side path of transport ``name`` (one of ``SEND_PATHS``)."""
    return SEND_PATHS[name](init)


def land_path_class(msg: dict[str, Any]) -> type[LandPath]:
    """The engine-side path the plan message asks for (``transport``, ``buffers`` when absent); ValueError if unknown."""
    wire = msg.get("transport", "buffers")
    if wire not in LAND_PATHS:
        raise ValueError(f"unknown transport {wire!r:.40}; expected 'buffers' or 'direct'")
    return LAND_PATHS[wire]


def decline(msg: dict[str, Any], why: str) -> None:
    """The engine refused this plan message: tell a trainer that waits on the engine's side (a broadcast rendezvous)."""
    wire = msg.get("transport", "buffers")
    if isinstance(wire, str) and wire in LAND_PATHS:
        LAND_PATHS[wire].decline(msg, why)
