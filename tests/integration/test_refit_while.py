"""``refit_while`` with one-refit serves (what ``mxrefit_receive`` does by default), against a real
``Receiver`` serving from a thread of this process, as vLLM's worker would."""

from __future__ import annotations

import threading
import time

import pytest

from mxrefit.engine.receiver import Receiver
from mxrefit.engine.torch import TorchEngine
from mxrefit.integrations.vllm.client import refit_while
from mxrefit.source.sender import RefitError, Sender
from tests.helpers import models
from tests.helpers.checks import engine_matches
from tests.helpers.refit_helpers import tiny_weights


@pytest.fixture
def engine():
    receiver = Receiver(TorchEngine(models.tiny_qwen3_moe(seed=1), quant="fp8-block"), timeout_s=30)
    sender = Sender(receiver.address, receiver.token, bucket_bytes=32 << 10, check_finite=False, timeout_s=20)
    yield receiver, sender
    sender.close()
    receiver.close()


def one_refit_serve(receiver: Receiver):
    """A one-refit serve whose return takes a moment, as ``collective_rpc`` does (the answer
    travels back from vLLM's worker): the window in which a trainer can still see it alive."""

    def serve() -> None:
        receiver.serve(refits=1)
        time.sleep(0.5)

    return serve


def _late_inf(sender: Sender) -> dict:
    """Weights with +inf in the last FP8-block source: found while packing, after "begin"."""
    plan = sender.plan_
    name = plan.sources[max(i for i, f in enumerate(plan.formats) if f == "fp8-block")].name
    bad = tiny_weights(52)
    bad[name][-1, -1] = float("inf")
    return bad


def test_a_refit_failing_after_begin_leaves_the_next_serve_alone(engine):
    """The serve that got "begin" ends by itself; a "shutdown" sent after it would end the next
    serve before its refit (the next refit then times out)."""
    receiver, sender = engine
    serve = one_refit_serve(receiver)
    assert refit_while(serve, sender, tiny_weights(51)).version == 1
    begins = sender.begins_sent
    with pytest.raises(RefitError, match="non-finite"):
        refit_while(serve, sender, _late_inf(sender))
    assert sender.begins_sent == begins + 1  # the failure came after "begin": the case at stake
    assert receiver.status()["state"] == "partial"
    t0 = time.perf_counter()
    good = tiny_weights(53)
    assert refit_while(serve, sender, good).version == 2
    assert time.perf_counter() - t0 < 15  # no stale "shutdown" waited for
    assert receiver.status()["state"] == "ready"
    assert engine_matches_serving(receiver, sender, good) == []


def test_a_refit_refused_before_begin_frees_the_serve(engine):
    """NaN found by the screen before any byte moves: no "begin", so the serve is told to end."""
    receiver, sender = engine
    serve = one_refit_serve(receiver)
    assert refit_while(serve, sender, tiny_weights(51)).version == 1
    sender.check_finite = True
    bad = tiny_weights(52)
    next(iter(bad.values()))[0, 0] = float("nan")
    begins = sender.begins_sent
    with pytest.raises(ValueError, match="non-finite|NaN"):
        refit_while(serve, sender, bad)
    assert sender.begins_sent == begins  # refused before "begin"
    assert refit_while(serve, sender, tiny_weights(53)).version == 2


def engine_matches_serving(receiver: Receiver, sender: Sender, weights: dict) -> list[str]:
    """``engine_matches`` while the engine serves (checksums are answered between refits)."""
    thread = threading.Thread(target=receiver.serve, daemon=True)
    thread.start()
    try:
        return engine_matches(sender, weights)
    finally:
        sender.client.request({"op": "shutdown"}, 10.0, step="ending the check's serve")
        thread.join(10)
