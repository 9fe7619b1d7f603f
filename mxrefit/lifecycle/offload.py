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

Queueing a copy per storage costs the host ~80 us (the copy, ``record_stream``, the resize; 1,157
storages of Qwen3-30B-A3B took 94 ms on an H200, scripts/gpu_offload_queue.py), so ``offload()``
hands that loop to one worker thread and returns after the cheap part (collect, lay out, detach
the gradients): a refit can start at once. On CUDA the copies run on a side stream that first waits
for work already queued on the current stream, and each storage is freed as soon as its copy is
queued (``record_stream`` keeps the block from being reused before the copy has run). ``wait()``
joins the worker (re-raising what it raised), blocks until the copies are done and returns the
freed blocks to the driver (``empty_cache``), where another process, the engine, can map them.
``reload()`` joins the worker first, then allocates on the current stream, copies on the side stream
and makes the current stream wait for those copies: the host does not wait for the bytes and later
kernels see the restored bytes. Reload stays on the caller's thread, because the current stream
must wait for an event that has already been recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
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
        self._worker: ThreadPoolExecutor | None = None
        self._queued: Future | None = None
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
                raise ValueError(f"{label} shares memory with parameter {param_storage[ptr]!r}; "
                                 "offloading it would free the parameter (the refit's source)")
            if not storage.resizable():
                raise ValueError(f"{label} lives in memory torch cannot resize (shared with numpy via .numpy(), or "
                                 "made by from_blob/frombuffer); it cannot be offloaded")
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
        self.arena = PinnedArena(nbytes, what="optimizer offload arena", available=self.available,
                                 headroom_bytes=self.headroom_bytes)
        self.arena_allocations += 1

    @torch.no_grad()
    def offload(self) -> int:
        """Start the copies to host (the device memory is freed as they are queued); returns the bytes moved."""
        if self.offloaded:
            raise RuntimeError("the optimizer's state is already offloaded; reload() first")
        found, detach = self._collect()
        offsets, total = aligned_layout([s.nbytes() for _, s in found])
        if total:
            self._ensure_arena(total)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for _, p, _ in detach:
            p.grad = None
        self._moved = [_Moved(name, storage, offset, storage.nbytes()) for (name, storage), offset in zip(found, offsets)]
        self._detached = detach
        self.nbytes = sum(m.nbytes for m in self._moved)
        self.offloaded = True
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxrefit-offload")
        self._queued = self._worker.submit(self._queue_offload, self._moved)
        return self.nbytes

    @torch.no_grad()
    def _queue_offload(self, moved: list[_Moved]) -> None:
        """Worker thread: queue each storage's copy into the arena, then free the storage."""
        cuda = self._stream is not None
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext(), on_stream(self._stream):
            for m in moved:
                src = storage_bytes(m.storage)
                self.arena.view(m.offset, m.nbytes).copy_(src, non_blocking=cuda)
                if cuda:
                    src.record_stream(self._stream)
                del src
                m.storage.resize_(0)
            if cuda:
                self._done.record(self._stream)

    def _join(self) -> None:
        """Wait for the worker to have queued every copy; re-raise what it raised."""
        if self._queued is not None:
            queued, self._queued = self._queued, None
            try:
                queued.result()
            except Exception as err:
                raise RuntimeError(f"queueing the offload copies failed: {err}; the optimizer state is partly "
                                   "on the host") from err

    @torch.no_grad()
    def reload(self) -> int:
        """Re-allocate, queue the copies back and re-attach gradients; returns the bytes moved."""
        if not self.offloaded:
            raise RuntimeError("nothing is offloaded; offload() first")
        self._join()
        for name, p, _ in self._detached:
            if p.grad is not None:
                raise RuntimeError(f"a new gradient of {name!r} was written while the optimizer state was offloaded; "
                                   "refusing to overwrite it with the offloaded one")
        cuda = self._stream is not None
        current = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:  # blocks handed to the current stream may still be in use by work queued there
            self._stream.wait_stream(current)
        for m in self._moved:  # allocate, then copy at once: the transfers start while later blocks are allocated
            m.storage.resize_(m.nbytes)  # outside the side stream: the block belongs to the stream that will use it
            dst = storage_bytes(m.storage)
            with on_stream(self._stream):
                dst.copy_(self.arena.view(m.offset, m.nbytes), non_blocking=cuda)
            if cuda:
                dst.record_stream(self._stream)
        if cuda:
            self._done.record(self._stream)
            current.wait_event(self._done)
        for _, p, grad in self._detached:
            p.grad = grad
        self._moved, self._detached = [], []
        self.offloaded = False
        return self.nbytes

    def wait(self, *, release: bool = True) -> None:
        """Block until the queued copies are done; after an offload, hand the freed blocks back to the driver."""
        self._join()
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
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
