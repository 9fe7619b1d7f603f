"""A learned MXFP8 order advertised after the first refit, through a real Sender and Receiver.

The engine "learns" at its first refit that its kernel reads an MXFP8 expert slab in a
Marlin-8-bit-like byte order (built by index arithmetic in ``tests/unit/test_block_permutation``,
not by mxrefit), advertises it as a learned order (``KernelLayout.order`` with the
``BlockPermutation``'s tables, which travel in the tables message) and bumps its tables version.
The trainer plans again, receives the tables over the socket and writes the order itself; the
engine reads the checkpoint bytes back by the order's inverse. Checked against the independent
MXFP8 oracle after every refit, and the staged bytes against quantize-then-gather by the index
the order was built from.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from mxrefit.formats.block_permutation import BlockPermutation
from mxrefit.formats.kernel_layout import KernelLayout, read_reference
from mxrefit.formats.reference.mxfp8_oracle import reference_quantize
from mxrefit.plan.types import Destination
from mxrefit.source.sender import Sender
from tests.integration.test_tables_change import NORM, E, K, LearningEngine, M, W, _weights, assert_served, serving
from tests.unit.test_block_permutation import index_of, marlin8_scales, marlin8_values

VALUE_INDEX, SCALE_INDEX = index_of(marlin8_values, M, K), index_of(marlin8_scales, M, K // 32)
PERM = BlockPermutation.of(VALUE_INDEX, SCALE_INDEX)
assert isinstance(PERM, BlockPermutation), PERM


class OrderEngine(LearningEngine):
    """``LearningEngine`` whose learned layout is a learned byte order of W's values and scales."""

    def destinations(self) -> dict[str, Destination]:
        dests = super(LearningEngine, self).destinations()
        if self.learned:
            v, s = dests[W].targets
            dests[W] = replace(
                dests[W],
                targets=(
                    replace(v, layout=KernelLayout(order=f"{PERM.digest}:values", permutation=PERM)),
                    replace(s, layout=KernelLayout(order=f"{PERM.digest}:scales", permutation=PERM)),
                ),
            )
        return dests

    def after_refit(self, version: int) -> None:
        for param, staged in self.staging.items():
            served = self.tensor(param)
            role = "scales" if param.endswith("_scale") else "values"
            layout = KernelLayout(order=f"{PERM.digest}:{role}", permutation=PERM)
            checkpoint = read_reference(layout, staged, tuple(served.shape), served.dtype)
            super(LearningEngine, self).storage(param).copy_(checkpoint.reshape(-1).view(torch.uint8))
        self.learned = self.learned or self.learns


def test_the_trainer_writes_a_learned_order_after_the_engine_advertises_it():
    engine = OrderEngine()
    with serving(engine) as receiver:
        sender = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            w1 = _weights(1)
            assert not sender.refit(w1).replanned and engine.adopted == [None]
            assert_served(engine, w1)
            for seed in (2, 3):
                weights = _weights(seed)
                report = sender.refit(weights)
                assert report.replanned == (seed == 2)
                layout = engine.adopted[-1]
                assert layout is not None and layout.order == f"{PERM.digest}:values" and len(engine.adopted) == 2
                # the tables crossed the socket: the trainer's copy is the engine's order, not a shared object
                got = sender._tables[1][W].targets[0].layout.permutation
                assert got is not PERM and torch.equal(got.index(), PERM.index())
                values, scales = reference_quantize(weights[W])
                want_v = values.reshape(E, -1)[:, VALUE_INDEX.numpy()].reshape(-1)
                want_s = scales.reshape(E, -1)[:, SCALE_INDEX.numpy()].reshape(-1)
                assert np.array_equal(engine.staging[W].numpy(), want_v)
                assert np.array_equal(engine.staging[W + "_scale"].numpy(), want_s)
                assert not np.array_equal(want_v, values.reshape(-1))  # negative control: the order moves bytes
                assert_served(engine, weights)
                assert torch.equal(engine.tensor(NORM), weights[NORM])
        finally:
            sender.close(shutdown_engine=True)


def test_a_sender_that_keeps_its_plan_is_served_it_and_a_new_one_writes_the_order():
    """``follow_tables=False`` (an A/B of the engine's own processing): no re-plan, the engine keeps
    serving the checkpoint-layout plan; a trainer connecting afterwards writes the learned order."""
    engine = OrderEngine()
    with serving(engine) as receiver:
        pinned = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10, follow_tables=False)
        for seed in (1, 2, 3):
            weights = _weights(seed)
            assert not pinned.refit(weights).replanned
            assert_served(engine, weights)
        assert engine.adopted == [None] and engine.learned and pinned.tables_version == 0
        pinned.close()
        sender = Sender(receiver.address, receiver.token, bucket_bytes=16 << 10)
        try:
            weights = _weights(4)
            sender.refit(weights)
            assert engine.adopted[-1] is not None and engine.adopted[-1].order == f"{PERM.digest}:values"
            assert_served(engine, weights)
        finally:
            sender.close(shutdown_engine=True)
