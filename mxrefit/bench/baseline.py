"""The baseline: a refit as RL stacks do it today, for an A/B in the same run.

BF16 goes over the wire; per step two ping-pong buffers are allocated anew and their handles
exported and opened per bucket; the trainer packs tensor by tensor, and the engine, tensor by
tensor, quantizes to its format (MXFP8 or FP8-block, vLLM's torch path: ``quantize_as``) and
copies into its parameters. With
``post="trtllm"`` the engine then brings its MXFP8 weights into FlashInfer's TRT-LLM layout
expert by expert and step by step (swap, reorder, shuffle, interleave), in place, as
vLLM's loaders did before batching them.
"""

from __future__ import annotations

import math
import time

import torch

from mxrefit.devices import align, sync_current
from mxrefit.engine.base import Engine
from mxrefit.formats import fp8_block, mxfp8
from mxrefit.formats.kernel_layout import gated_reorder_rows, interleaved_size, shuffle_rows, swap_rows
from mxrefit.integrations.vllm.layout import EXPERTS, scale_param
from mxrefit.plan.types import Destination
from mxrefit.source.sender import RefitReport
from mxrefit.transport.control import ControlClient, ControlServer
from mxrefit.transport.factory import create_buffers, default_kind, open_buffers

_OP_BUCKET = "baseline_bucket"
_QUANTIZERS = {
    "mxfp8": lambda x, backend, name: mxfp8.quantize(x, backend=backend, name=name),
    "fp8-block": lambda x, backend, name: fp8_block.quantize(x, backend=backend, name=name),
    "fp8-block-ue8m0": lambda x, backend, name: fp8_block.quantize(x, use_ue8m0=True, backend=backend, name=name),
}


def quantize_as(fmt: str, x: torch.Tensor, *, backend: str = "torch", name: str | None = None) -> tuple[torch.Tensor, ...]:
    """``x`` encoded as format ``fmt``'s parts (values, scales) by that format's quantizer, one
    tensor at a time; ``"bf16"`` is ``x`` itself."""
    if fmt == "bf16":
        return (x,)
    try:
        return _QUANTIZERS[fmt](x, backend, name)
    except KeyError:
        raise ValueError(f"no quantizer for format {fmt!r}; known: {sorted(_QUANTIZERS)}") from None


class BaselineSender:
    def __init__(self, address: str, token: bytes, *, device: torch.device | str, bucket_bytes: int, timeout_s: float = 120.0):
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.client = ControlClient(address, token)
        self.version = 0

    def _buckets(self, tensors: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor, int]]]:
        biggest = max(align(t.numel() * t.element_size()) for t in tensors.values())
        size = max(self.bucket_bytes, biggest)
        buckets: list[list[tuple[str, torch.Tensor, int]]] = [[]]
        used = 0
        for name, t in tensors.items():
            n = align(t.numel() * t.element_size())
            if used + n > size:
                buckets.append([])
                used = 0
            buckets[-1].append((name, t, used))
            used += n
        self.size = size
        return buckets

    def refit(self, tensors: dict[str, torch.Tensor]) -> RefitReport:
        t0 = time.perf_counter()
        self.version += 1
        report = RefitReport(self.version)
        buckets = self._buckets(tensors)
        buffers = create_buffers(default_kind(self.device), 2, self.size, self.device)
        pending: list[int] = []
        try:
            for i, bucket in enumerate(buckets):
                if len(pending) == 2:
                    self._wait(pending.pop(0), report)
                t = time.perf_counter()
                buf = buffers.buffers[i % 2]
                manifest = []
                for name, src, off in bucket:
                    n = src.numel() * src.element_size()
                    buf[off : off + n].view(src.dtype).view(src.shape).copy_(src)
                    manifest.append([name, off, list(src.shape)])
                sync_current(self.device)
                report.pack_s += time.perf_counter() - t
                desc = buffers.describe()
                self.client.send({"op": _OP_BUCKET, "buffers": desc, "slot": i % 2, "tensors": manifest, "bucket": i})
                pending.append(i)
            while pending:
                self._wait(pending.pop(0), report)
        finally:
            buffers.close()
        reply = self.client.request({"op": "commit"}, self.timeout_s, step=f"baseline refit {self.version}, post-processing")
        report.engine_process_s = float(reply.get("process_s", 0.0))
        report.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        report.buckets = len(buckets)
        report.total_s = time.perf_counter() - t0
        return report

    def _wait(self, bucket: int, report: RefitReport) -> None:
        t = time.perf_counter()
        reply = self.client.recv(self.timeout_s, step=f"baseline refit {self.version}, bucket {bucket}")
        report.wait_s += time.perf_counter() - t
        if reply.get("op") != "applied" or reply.get("bucket") != bucket:
            raise RuntimeError(f"baseline engine answered {reply}")
        report.engine_apply_s += float(reply.get("apply_s", 0.0))

    def close(self, *, shutdown_engine: bool = False) -> None:
        if shutdown_engine:
            self.client.request({"op": "shutdown"}, self.timeout_s, step="shutting the baseline engine down")
        self.client.close()


class BaselineReceiver:
    """Opens each bucket's handles anew and loads tensor by tensor, quantizing on the engine."""

    def __init__(self, engine: Engine, *, timeout_s: float = 120.0, post: list[str] | None = None):
        """``post``: the quantized values params to bring into the TRT-LLM layout after each refit."""
        self.engine = engine
        self.post = post or []
        self.server = ControlServer()
        self.timeout_s = timeout_s
        self.destinations: dict[str, Destination] = engine.destinations()
        self.storage = {name: engine.storage(name) for name in engine.params()}

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def token(self) -> bytes:
        return self.server.token

    def _typed(self, param: str) -> torch.Tensor:
        spec = self.engine.params()[param]
        return self.storage[param].view(spec.dtype).view(spec.shape)

    def _view(self, target) -> torch.Tensor:
        return self.storage[target.param][target.offset : target.offset + target.nbytes].view(target.dtype).view(target.shape)

    def serve(self) -> None:
        while True:
            msg = self.server.recv(None, step="waiting for a baseline bucket")
            if msg.get("op") == "shutdown":
                self.server.send({"op": "bye"})
                return
            t = time.perf_counter()
            if msg.get("op") == "commit":
                for name in self.post:
                    per_expert_trtllm(name, self._typed(name), self._typed(scale_param(name)))
                sync_current(self.engine.device)
                self.server.send({"op": "committed", "process_s": time.perf_counter() - t})
                continue
            opened = open_buffers(msg["buffers"], self.engine.device)
            try:
                buf = opened.buffers[int(msg["slot"])]
                for name, off, shape in msg["tensors"]:
                    dest = self.destinations[name]
                    n = 2 * math.prod(shape)  # the baseline ships bfloat16
                    src = buf[off : off + n].view(torch.bfloat16).view(shape)
                    for target, part in zip(dest.targets, quantize_as(dest.format, src, name=name)):
                        self._view(target).copy_(part)
                sync_current(self.engine.device)
            finally:
                opened.close()
            self.server.send({"op": "applied", "bucket": msg["bucket"], "apply_s": time.perf_counter() - t})

    def close(self) -> None:
        self.server.close()


def per_expert_trtllm(name: str, values: torch.Tensor, scales: torch.Tensor) -> None:
    """In place, one expert and one step at a time: the post-load loop users run today."""
    if f"{EXPERTS}." not in name:
        rows, cols = scales.shape
        if interleaved_size(rows, cols) != rows * cols:
            raise ValueError(f"{name}: in-place swizzle needs scale rows % 128 == 0 and cols % 4 == 0")
        scales.view(-1).copy_(scales.view(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
        return
    gated = name.endswith("w13_weight")
    m = values.shape[1]
    steps = ([swap_rows(m), gated_reorder_rows(m)] if gated else []) + [shuffle_rows(m)]
    steps = [s.to(values.device) for s in steps]
    v8 = values.view(torch.uint8)
    c = scales.shape[2]
    for e in range(values.shape[0]):
        for idx in steps:
            v8[e].copy_(v8[e][idx])
            scales[e].copy_(scales[e][idx])
        scales[e].view(-1).copy_(scales[e].view(m // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
