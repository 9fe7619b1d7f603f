"""mxrefit: move freshly trained weights into a running inference engine, fast and bit-exact.

The public API: trainer side ``Sender`` (one engine, same host) and ``BroadcastSender`` (engine
ranks on other GPUs or nodes); engine side ``Receiver`` serving an ``Engine`` such as
``TorchEngine``; the formats ``mxfp8`` and ``fp8_block`` (``quantize``/``dequantize``); the
checkpoint writers vLLM starts from; ``QuantRules`` (``DEFAULT_RULES``: which weights a quantized
engine holds quantized); and the errors, all beneath ``MxrefitError``. vLLM plugs in
through ``mxrefit.integrations.vllm`` (docs/vllm.md), TRL through ``mxrefit.integrations.trl``.
"""

from mxrefit.engine.receiver import Receiver
from mxrefit.engine.torch import TorchEngine
from mxrefit.errors import MxrefitError
from mxrefit.formats import fp8_block, mxfp8
from mxrefit.formats._common import NonFiniteError
from mxrefit.plan.build import PlanMismatch, SourceSpec
from mxrefit.plan.eligibility import DEFAULT_RULES, QuantRules
from mxrefit.source.broadcast_sender import BroadcastSender
from mxrefit.source.checkpoint import save_fp8_block_checkpoint, save_mxfp8_checkpoint
from mxrefit.source.sender import RefitError, RefitReport, Sender
from mxrefit.transport.buffers import TransportError
from mxrefit.transport.control import ControlError

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_RULES",
    "BroadcastSender",
    "ControlError",
    "MxrefitError",
    "NonFiniteError",
    "PlanMismatch",
    "QuantRules",
    "Receiver",
    "RefitError",
    "RefitReport",
    "Sender",
    "SourceSpec",
    "TorchEngine",
    "TransportError",
    "fp8_block",
    "mxfp8",
    "save_fp8_block_checkpoint",
    "save_mxfp8_checkpoint",
]
