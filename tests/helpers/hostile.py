"""Hostile peers on real sockets: an engine that answers what a test tells it, engines that turn
their exports against the trainer, and a bare ROUTER for the routing-id attack's negative control.

``FakeEngine`` is a raw zmq ROUTER in a thread speaking the wire format (token, then a msgpack
map); it answers each request with the frames ``answer(msg, seq)`` returns, so a test can send a
real Sender any reply, late replies, floods or garbage.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import msgpack
import zmq

from mxrefit.transport.control import ControlServer, new_token, private_ipc_address


def framed(token: bytes, reply: dict, re: int | None) -> bytes:
    """A reply as the engine frames it: the token, then the map (answering request ``re``)."""
    return token + msgpack.packb({**reply, **({} if re is None else {"re": re})}, use_bin_type=True)


class FakeEngine:
    """``answer(msg, seq) -> list[bytes]``: the frames sent back for each request (raw, already framed)."""

    def __init__(self, answer):
        self.token = new_token()
        self.address = private_ipc_address()
        self.answer = answer
        self.requests: list[dict] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, data = self._sock.recv_multipart()
            msg = msgpack.unpackb(data[len(self.token) :], raw=False)
            seq = msg.pop("seq", None)
            self.requests.append(msg)
            for out in self.answer(msg, seq):
                if self._stop.is_set():
                    return
                self._sock.send_multipart([identity, out])

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(os.path.dirname(self.address[len("ipc://") :]), ignore_errors=True)


def tables_reply() -> dict:
    """The ``tables`` reply a real engine of the tiny MoE (MXFP8) gives, without its status fields."""
    from mxrefit.engine.torch import TorchEngine
    from mxrefit.plan.build import tables_to_msg
    from tests.helpers import models

    engine = TorchEngine(models.tiny_qwen3_moe(seed=1), mxfp8=True)
    return {"op": "tables", **tables_to_msg(engine.params(), engine.destinations()), "exportable": False, "device": "cpu"}


def bare_router(address: str, conn) -> None:
    """A plain libzmq ROUTER (no mxrefit), to show the routing-id attack is real on this libzmq."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    conn.send("bound")
    while True:
        if sock.poll(100):
            sock.recv_multipart()


def serve_forever(conn) -> None:
    """A ControlServer on a private socket directory that never closes it (killed by the test)."""
    server = ControlServer()
    conn.send(server.address)
    while True:
        time.sleep(1)


def _truncate_exports() -> None:
    """Shrink every shm arena this engine exported to 0 bytes (a write past the end is a SIGBUS)."""
    import _posixshmem

    from mxrefit.transport.direct import _SHM_ARENAS

    for name, _size in list(_SHM_ARENAS.values()):
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def serve_hostile_layout(conn, shape, mode: str, third_party: str | None = None) -> None:
    """A real Receiver over exportable storage that turns hostile: ``shrink`` truncates its exported
    segments when a refit begins; ``redirect`` names ``third_party``'s segment in its exports."""
    import logging

    import torch

    from mxrefit.engine.layout import LayoutEngine
    from mxrefit.engine.receiver import Receiver
    from mxrefit.integrations.vllm.layout import vllm_destinations, vllm_params

    logging.basicConfig(level=logging.INFO)

    class HostileReceiver(Receiver):
        def _adopt_plan(self, msg):
            reply = super()._adopt_plan(msg)
            if mode == "redirect" and "exports" in reply:
                reply["exports"]["segments"][0][0] = third_party
            return reply

        def _refit(self, begin):
            if mode == "shrink":
                _truncate_exports()
                time.sleep(0.2)
            return super()._refit(begin)

    params = vllm_params(shape, mxfp8=True)
    engine = LayoutEngine(params, vllm_destinations(shape, mxfp8=True), torch.device("cpu"))
    receiver = HostileReceiver(engine, timeout_s=5)
    conn.send({"address": receiver.address, "token": receiver.token})
    receiver.serve()


def direct_trainer(address: str, token: bytes, shape, conn, transport: str | None = None) -> None:
    """A trainer process (a SIGBUS here must not kill the test): one refit, reports how it ended."""
    import torch

    from mxrefit.bench.run import make_weights
    from mxrefit.plan.build import SourceSpec
    from mxrefit.plan.shapes import hf_tensor_specs
    from mxrefit.source.sender import RefitError, Sender

    specs = [SourceSpec(n, s, dt) for n, s, dt in hf_tensor_specs(shape)]
    sender = Sender(address, token, bucket_bytes=16 << 10, timeout_s=5, transport=transport)
    try:
        sender.refit(make_weights(specs, torch.device("cpu"), seed=1))
        conn.send({"ok": True, "transport": sender.transport})
    except RefitError as err:
        conn.send({"ok": False, "error": str(err)})
    os._exit(0)
