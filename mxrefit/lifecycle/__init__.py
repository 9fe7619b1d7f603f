"""Colocated lifecycle around a refit: slim offload, reference-model swap, and the phase that ties them.

In synchronous colocated RL the refit sits inside ``prepare_for_generation``: the trainer makes
room on the GPU, the engine wakes, the weights move, the engine gets its KV cache back; then
``prepare_for_training`` undoes it. The pieces, one module each:

- ``arena``: ``PinnedArena``, host memory allocated once at the size of what it will hold,
  page-locked with ``cudaHostRegister`` (exact size; torch's pinned allocator would round up to a
  power of two), 512-byte aligned views, and ``HostMemoryError`` before allocating when host
  memory is short. Plain host memory when there is no CUDA, through the same code.
- ``offload``: ``OptimizerOffloader`` moves optimizer state and gradients (DTensor: local shards)
  to an arena and back, per storage (resized to 0 and back: tensor identities kept), on a side
  stream so a refit can run meanwhile; parameters stay, they are the refit's source.
- ``reference``: ``ReferenceSwap`` puts reference weights held in an arena into the live
  parameters in place (identity and data pointers kept) and back, bit-exact, with both copy
  directions overlapped.
- ``phase``: ``prepare_for_generation`` / ``prepare_for_training`` call the offloader, the engine's
  ``sleep(level)`` / ``wake_up(tags)`` (vLLM's signatures; vLLM is not imported) and the refit in
  order, and time every part (``PhaseReport``, ``TrainingPhaseReport``; the refit's own report
  is kept inside).

Decisions and measurements: docs/lifecycle.md.
"""

from mxrefit.lifecycle.arena import HostMemoryError, PinnedArena, host_available_bytes
from mxrefit.lifecycle.offload import OptimizerOffloader
from mxrefit.lifecycle.phase import (
    PhaseReport,
    SleepableEngine,
    TrainingPhaseReport,
    prepare_for_generation,
    prepare_for_training,
)
from mxrefit.lifecycle.reference import ReferenceMismatch, ReferenceSwap

__all__ = [
    "HostMemoryError",
    "OptimizerOffloader",
    "PhaseReport",
    "PinnedArena",
    "ReferenceMismatch",
    "ReferenceSwap",
    "SleepableEngine",
    "TrainingPhaseReport",
    "host_available_bytes",
    "prepare_for_generation",
    "prepare_for_training",
]
