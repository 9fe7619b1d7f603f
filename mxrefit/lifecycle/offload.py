"""Slim offload: the optimizer's state and the gradients go to host memory and come back, bit-exact.

Only what the engine needs room for moves; parameters stay, because they are the refit's source.

Device memory is freed per *storage*: each state or gradient storage is copied into the arena and
resized to 0 bytes, then resized back and refilled on reload (FSDP2 frees unsharded parameters the
same way). Tensor objects, their views, shapes and strides, and the optimizer's state dict are never
replaced, so the optimizer and anything else holding these tensors keeps valid references; tensors
that share a storage (gradients that are views of one flat buffer) move once, together. Replacing
``t.data`` was rejected: views taken before the swap would keep pointing at the old memory, and the
tensor's device would change under the optimizer. What does change is the data pointer after a
reload (the caching allocator hands out a new block): a captured CUDA graph of the optimizer step
must be captured again.

A tensor whose storage is empty must not be touched (torch does not check; on CPU that is a
segfault), so while offloaded ``optimizer.step()`` raises, and gradients are detached from their
parameters (``p.grad is None``) and re-attached on reload, which refuses if a new gradient was
written meanwhile. A state tensor that shares memory with a parameter is refused: freeing it would
free the refit's source.

DTensor (FSDP2) state and gradients are offloaded through their local shards. State on another
device than the parameters (torch.optim's CPU step counters) stays where it is.

The arena is sized on the first offload that finds state, and reused while the state fits; it is
replaced (the old one freed first) only when more state appears later, e.g. optimizer state that
torch.optim creates lazily at the first step. ``arena_allocations`` counts this.

On CUDA, copies run on a side stream: ``offload()`` makes it wait for work already queued on the
current stream, queues one copy per storage and frees each storage at once (``record_stream``
keeps the block from being reused before its copy has run), and returns without blocking, so a
refit can run meanwhile. ``wait()`` blocks until the copies are done and returns the freed blocks
to the driver (``empty_cache``), where another process, the engine, can map them. ``reload()``
allocates on the current stream, copies on the side stream and makes the current stream wait for
those copies: the host does not block and later kernels see the restored bytes.

Queueing is not free: ~80 us of host time per storage (94 ms for Qwen3-30B-A3B's 1,157 on an
H200, scripts/gpu_offload_queue.py). Two ways around it were measured in the phase and dropped
(docs/lifecycle.md): a worker thread that queues the copies (the refit beside it slowed from 82
to 310 ms, both threads wanting the interpreter) and one ``torch._foreach_copy_`` with the frees
moved to ``wait()`` (105-113 ms to queue: no faster).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mxrefit.devices import resolve
from mxrefit.lifecycle._tensors import local_storage, on_stream, storage_bytes
from mxrefit.lifecycle.arena import DEFAULT_HEADROOM_BYTES, PinnedArena, aligned_layout, host_available_bytes


@dataclass
class _Moved:
    name: str
    storage: torch.UntypedStorage
    offset: int
    nbytes: int


class OptimizerOffloader:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        grads: bool = True,
        device: torch.device | str | None = None,
        available: Callable[[], int] = host_available_bytes,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    ):
        self.optimizer = optimizer
        self.grads = grads
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        given = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        self.names = []
        for gi, group in enumerate(optimizer.param_groups):
            self.names += [given.get(id(p), f"param_groups[{gi}][{pi}]") for pi, p in enumerate(group["params"])]
        # compared with tensors' devices, which carry an index
        self.device = resolve(device) if device is not None else self.params[0].device
        self.available = available
        self.headroom_bytes = headroom_bytes
        self.arena: PinnedArena | None = None
        self.arena_allocations = 0
        self.offloaded = False
        self.nbytes = 0
        self._moved: list[_Moved] = []
        self._detached: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._done = torch.cuda.Event() if cuda else None
        self._hook = optimizer.register_step_pre_hook(self._refuse_step)

    def _refuse_step(self, optimizer, args, kwargs) -> None:
        if self.offloaded:
            raise RuntimeError("the optimizer's state is offloaded to host memory; call reload() before step()")

    def _collect(self) -> tuple[list[tuple[str, torch.UntypedStorage]], list[tuple[str, torch.Tensor, torch.Tensor]]]:
        param_storage = {local_storage(p).data_ptr(): n for n, p in zip(self.names, self.params)}
        seen: set[int] = set()
        found: list[tuple[str, torch.UntypedStorage]] = []

        def add(label: str, t: torch.Tensor) -> bool:
            if t.device != self.device:  # a DTensor's device is its local shard's
                return False
            storage = local_storage(t)
            ptr = storage.data_ptr()
            if storage.nbytes() == 0 or ptr in seen:
                return True
            if ptr in param_storage:
                raise ValueError(
                    f"{label} shares memory with parameter {param_storage[ptr]!r}; "
                    "offloading it would free the parameter (the refit's source)"
                )
            if not storage.resizable():
                raise ValueError(
                    f"{label} lives in memory torch cannot resize (shared with numpy via .numpy(), or "
                    "made by from_blob/frombuffer); it cannot be offloaded"
                )
            seen.add(ptr)
            found.append((label, storage))
            return True

        detach = []
        for name, p in zip(self.names, self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    add(f"optimizer state {key!r} of {name!r}", value)
            if self.grads and p.grad is not None and add(f"gradient of {name!r}", p.grad):
                detach.append((name, p, p.grad))
        return found, detach

    def _ensure_arena(self, nbytes: int) -> None:
        if self.arena is not None and self.arena.nbytes >= nbytes:
            return
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.arena = PinnedArena(
            nbytes, what="optimizer offload arena", available=self.available, headroom_bytes=self.headroom_bytes
        )
        self.arena_allocations += 1

    def _arena_view(self, offset: int, nbytes: int) -> torch.Tensor:
        if self.arena is None:
            raise RuntimeError("the offload arena is closed")
        return self.arena.view(offset, nbytes)

    @torch.no_grad()
    def offload(self) -> int:
        """Queue the copies to host and free the device memory; returns the bytes moved."""
        if self.offloaded:
            raise RuntimeError("the optimizer's state is already offloaded; reload() first")
        found, detach = self._collect()
        offsets, total = aligned_layout([s.nbytes() for _, s in found])
        if total:
            self._ensure_arena(total)
        side, done = self._stream, self._done
        cuda = side is not None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        moved = []
        with on_stream(side):
            for (name, storage), offset in zip(found, offsets):
                n = storage.nbytes()
                src = storage_bytes(storage)
                self._arena_view(offset, n).copy_(src, non_blocking=cuda)
                if side is not None:
                    src.record_stream(side)
                del src
                storage.resize_(0)
                moved.append(_Moved(name, storage, offset, n))
            if side is not None and done is not None:
                done.record(side)
        for _, p, _ in detach:
            p.grad = None
        self._moved, self._detached = moved, detach
        self.nbytes = sum(m.nbytes for m in moved)
        self.offloaded = True
        return self.nbytes

    @torch.no_grad()
    def reload(self) -> int:
        """Re-allocate, queue the copies back and re-attach gradients; returns the bytes moved."""
        if not self.offloaded:
            raise RuntimeError("nothing is offloaded; offload() first")
        for name, p, _ in self._detached:
            if p.grad is not None:
                raise RuntimeError(
                    f"a new gradient of {name!r} was written while the optimizer state was offloaded; "
                    "refusing to overwrite it with the offloaded one"
                )
        side, done = self._stream, self._done
        cuda = side is not None
        current = torch.cuda.current_stream(self.device) if cuda else None
        if (
            side is not None and current is not None
        ):  # blocks handed to the current stream may still be in use by work queued there
            side.wait_stream(current)
        for m in self._moved:  # allocate, then copy at once: the transfers start while later blocks are allocated
            m.storage.resize_(m.nbytes)  # outside the side stream: the block belongs to the stream that will use it
            dst = storage_bytes(m.storage)
            with on_stream(side):
                dst.copy_(self._arena_view(m.offset, m.nbytes), non_blocking=cuda)
            if side is not None:
                dst.record_stream(side)
        if side is not None and done is not None and current is not None:
            done.record(side)
            current.wait_event(done)
        for _, p, grad in self._detached:
            p.grad = grad
        self._moved, self._detached = [], []
        self.offloaded = False
        return self.nbytes

    def wait(self, *, release: bool = True) -> None:
        """Block until the queued copies are done; after an offload, hand the freed blocks back to the driver."""
        if self._done is not None:
            self._done.synchronize()
            if release and self.offloaded:
                torch.cuda.empty_cache()

    def close(self) -> None:
        """Reload if needed, remove the step hook and free the arena."""
        if self.offloaded:
            self.reload()
            self.wait()
        self._hook.remove()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
