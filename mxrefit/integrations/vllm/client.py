"""Trainer side of vLLM's two routes: ``refit_while`` runs a refit while the engine serves it, and
``LLMClient`` speaks vLLM's weight-sync client protocol to an in-process ``vllm.LLM``.

Importing this module registers nothing with vLLM (only ``plugin.register``, vLLM's entry point, does).
"""

from __future__ import annotations

import threading
from typing import Any

from mxrefit.integrations.vllm.compat import finish_weight_update
from mxrefit.integrations.vllm.worker import worker_results
from mxrefit.source.broadcast_sender import BroadcastSender


def refit_while(serve, sender, tensors, *, specs=None, until_shutdown: bool = False):
    """Run ``sender.refit(tensors)`` while ``serve()`` — a blocking call that makes the engine
    serve, e.g. ``llm.collective_rpc("mxrefit_receive")`` — runs in a thread.

    ``sender`` is a ``Sender`` or a ``BroadcastSender`` (anything with ``refit``, ``plan``,
    ``plan_``, ``client`` and ``timeout_s``). The engine answers only while it serves, so a
    first refit plans here too (from ``specs``, required for a stream). Returns the
    RefitReport; re-raises the first error of either side (a ``WorkerError`` when ``serve()``
    returned the answers of workers that failed, see ``worker_results``).

    How the serve ends:
    - ``until_shutdown=False``: ``serve()`` serves one refit (``mxrefit_receive``'s default):
      the engine's serve ends at the refit's "begin", whatever follows (a refit that fails after
      it is aborted there). A refit refused before its "begin" (plan mismatch, NaN/Inf) is ended
      here with a "shutdown", so the worker is free for the next RPC. Only then: a "shutdown"
      sent after a "begin" would reach no serve, wait in the engine's socket and end the next
      one before its refit.
    - ``until_shutdown=True``: ``serve()`` serves until the trainer says "shutdown"
      (``collective_rpc("mxrefit_receive", kwargs={"refits": None})``), and this sends it after
      every refit, complete or failed. Required for a ``BroadcastSender``: after a failure it
      tells every rank to abort and reads each rank's state, which a rank whose one-refit serve
      already ended could not answer.
    """
    if isinstance(sender, BroadcastSender) and not until_shutdown:
        raise ValueError(
            "a BroadcastSender needs the engine ranks to keep serving after a failed refit: pass "
            "until_shutdown=True and serve with mxrefit_receive(refits=None)"
        )
    errors: list[BaseException] = []
    result: list[Any] = []

    def run():
        try:
            result.append(serve())
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    def end_serve(step: str) -> None:
        try:
            sender.client.request({"op": "shutdown"}, 10.0, step=step)
        except Exception:  # noqa: BLE001 - the trainer's own error (or the serve's) is the one to report
            pass

    thread = threading.Thread(target=run, name="mxrefit-serve", daemon=True)
    begins = sender.begins_sent
    thread.start()
    try:
        if sender.plan_ is None and specs is not None:
            sender.plan(specs)
        report = sender.refit(tensors)
    except BaseException:
        # a one-refit serve that got this refit's "begin" ends by itself; one refused before it
        # (plan mismatch, NaN/Inf) still serves: end it so the worker is free for the next RPC
        if until_shutdown or sender.begins_sent == begins:
            end_serve("ending the engine's serve after a refused refit")
        raise
    else:
        if until_shutdown:
            end_serve("ending the engine's serve after the refit")
    finally:
        thread.join(sender.timeout_s + 30)
    if errors:
        raise errors[0]
    if thread.is_alive():
        raise RuntimeError("the engine did not return from serving the refit")
    if result and isinstance(result[0], (list, tuple)):
        worker_results(result[0])
    return report


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM``."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        finish_weight_update(self.llm, weight_version)
