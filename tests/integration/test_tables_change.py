"""An engine whose tables change after a refit (a kernel layout learned there): the trainer plans
again before its next refit, and an engine serves the plan it adopted, so a trainer that does not
plan again still gets the right bytes. A real Receiver serves from a thread of this process (as
vLLM's worker does), over its real control socket and shared-memory buffers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from mxrefit.engine.receiver import Receiver
from mxrefit.engine.torch import TorchEngine
from mxrefit.formats.kernel_layout import KernelLayout, read_reference, row_permutation
from mxrefit.formats.reference.mxfp8_oracle import reference_quantize
from mxrefit.plan.build import RefitPlan
from mxrefit.plan.types import Destination
from mxrefit.source.sender import Sender

E, M, K = 2, 64, 64  # experts, rows per expert (a multiple of the 32-row shuffle block), columns
W = "model.layers.0.mlp.experts.gate_up_proj"  # a grouped expert slab: quantized to MXFP8
NORM = "model.norm.weight"  # passed through as BF16
LAYOUT = KernelLayout(rows="trtllm")


def _module() -> nn.Module:
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(E, M, K, dtype=torch.bfloat16))
    mlp = nn.Module()
    mlp.experts = experts
    layer = nn.Module()
    layer.mlp = mlp
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.ones(K, dtype=torch.bfloat16))
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    model.norm = norm
    root = nn.Module()
    root.model = model
    return root


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        W: torch.randn(E, M, K, generator=g).mul_(0.02 * seed).bfloat16(),
        NORM: torch.randn(K, generator=g).add_(1.0).bfloat16(),
    }


class LearningEngine(TorchEngine):
    """Serves the checkpoint layout; at its first refit it "learns" that its kernel reads ``W``'s rows
    in the TRT-LLM order and from then on advertises that layout on both of ``W``'s targets (tables
    version 1). Which bytes it receives follows the adopted plan: a plan with the layout lands ``W``
    in staging, which ``after_refit`` turns back into the checkpoint bytes it serves."""

    def __init__(self, *, learns: bool = True):
        super().__init__(_module(), quant="mxfp8")
        self.learns = learns
        self.learned = False
        self.adopted: list[KernelLayout | None] = []  # W's layout in each plan given to prepare()
        self.staging: dict[str, torch.Tensor] = {}

    @property
    def tables_version(self) -> int:
        return int(self.learned)

    def destinations(self) -> dict[str, Destination]:
        dests = super().destinations()
        if self.learned:
            dests[W] = replace(dests[W], targets=tuple(replace(t, layout=LAYOUT) for t in dests[W].targets))
        return dests

    def prepare(self, plan: RefitPlan) -> None:
        parts = [p.target for b in plan.buckets for p in b.parts if plan.sources[p.source].name == W]
        self.adopted.append(parts[0].layout)
        self.staging = {t.param: torch.empty_like(self.read(t.param)) for t in parts if t.layout is not None}

    def storage(self, param: str) -> torch.Tensor:
        return self.staging[param] if param in self.staging else super().storage(param)

    def read(self, param: str) -> torch.Tensor:
        return super().storage(param)

    def after_refit(self, version: int) -> None:
        for param, staged in self.staging.items():
            served = self.tensor(param)
            checkpoint = read_reference(LAYOUT, staged, tuple(served.shape), served.dtype)
            super().storage(param).copy_(checkpoint.reshape(-1).view(torch.uint8))
        self.learned = self.learned or self.learns


class OldSender(Sender):
    """A trainer from before the ``tables`` field: it keeps the plan it made, whatever the engine says."""

    def _replan_if_tables_changed(self) -> bool:
        return False


@contextmanager
def serving(engine: LearningEngine) -> Iterator[Receiver]:
    receiver = Receiver(engine, timeout_s=30)
    thread = threading.Thread(target=receiver.serve, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        thread.join(30)
        receiver.close()
    assert not thread.is_alive(), "the receiver did not end on shutdown"


def assert_served(engine: LearningEngine, weights: dict[str, torch.Tensor]) -> None:
    """The engine serves the trainer's tensors: W as the independent MXFP8 oracle quantizes it
    (checkpoint layout), the norm as it is."""
    values, scales = reference_quantize(weights[W])
    assert np.array_equal(engine.read(W).numpy(), values.reshape(-1))
    assert np.array_equal(engine.read(W + "_scale").numpy(), scales.reshape(-1))
    assert torch.equal(engine.tensor(NORM), weights[NORM])


def assert_staged_in_kernel_order(engine: LearningEngine, weights: dict[str, torch.Tensor]) -> None:
    """The trainer wrote W in the kernel's row order (kernel_rows = checkpoint_rows[P]), not the checkpoint's."""
    values, scales = reference_quantize(weights[W])
    p = row_permutation("trtllm", M).numpy()
    assert not np.array_equal(p, np.arange(M))
    assert np.array_equal(engine.staging[W].numpy(), values[:, p].reshape(-1))
    assert np.array_equal(engine.staging[W + "_scale"].numpy(), scales[:, p].reshape(-1))
    assert not np.array_equal(engine.staging[W].numpy(), values.reshape(-1))


@pytest.mark.parametrize("stream", [False, True], ids=["mapping", "stream"])
def test_the_trainer_plans_again_once_the_engine_advertises_a_kernel_layout(stream, caplog):
    engine = LearningEngine()
    with serving(engine) as receiver:
        sender = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            w1 = _weights(1)
            r1 = sender.refit(w1)
            d1 = sender._planned().digest
            assert not r1.replanned and engine.adopted == [None] and engine.learned
            assert sender.tables_version == 0
            assert_served(engine, w1)

            w2 = _weights(2)
            with caplog.at_level(logging.INFO, logger="mxrefit.source.sender"):
                r2 = sender.refit(iter(w2.items()) if stream else w2)
            d2 = sender._planned().digest
            assert r2.replanned and r2.version == 2 and d2 != d1
            assert sender.tables_version == 1
            assert engine.adopted == [None, LAYOUT]
            assert sender._tables is not None and sender._tables[1][W].targets[0].layout == LAYOUT
            assert f"engine tables changed after refit 1; planned again (digest {d1[:12]}→{d2[:12]})" in caplog.text
            assert_staged_in_kernel_order(engine, w2)
            assert_served(engine, w2)

            w3 = _weights(3)
            r3 = sender.refit(iter(w3.items()) if stream else w3)
            assert not r3.replanned and sender._planned().digest == d2 and len(engine.adopted) == 2
            assert_staged_in_kernel_order(engine, w3)
            assert_served(engine, w3)
        finally:
            sender.close(shutdown_engine=True)


def test_an_engine_whose_tables_never_change_is_never_planned_again():
    engine = LearningEngine(learns=False)
    with serving(engine) as receiver:
        sender = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            digests = []
            for seed in (1, 2, 3):
                weights = _weights(seed)
                report = sender.refit(weights)
                assert not report.replanned
                digests.append(sender._planned().digest)
                assert_served(engine, weights)
            assert len(set(digests)) == 1 and engine.adopted == [None] and sender.tables_version == 0
        finally:
            sender.close(shutdown_engine=True)


def test_a_trainer_that_does_not_plan_again_is_served_its_adopted_plan():
    """An old trainer keeps its checkpoint-layout plan after the engine advertised the kernel layout:
    the engine keeps landing W in place and serves the right bytes; a trainer connecting afterwards
    reads the new tables and writes the kernel layout."""
    engine = LearningEngine()
    with serving(engine) as receiver:
        old = OldSender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            for seed in (1, 2, 3):
                weights = _weights(seed)
                report = old.refit(weights)
                assert not report.replanned and report.version == seed
                assert_served(engine, weights)
            assert engine.learned and engine.adopted == [None] and engine.staging == {}
        finally:
            old.close()
        new = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            weights = _weights(4)
            report = new.refit(weights)
            assert report.version == 4 and not report.replanned and new.tables_version == 1
            assert engine.adopted == [None, LAYOUT]
            assert_staged_in_kernel_order(engine, weights)
            assert_served(engine, weights)
        finally:
            new.close(shutdown_engine=True)
