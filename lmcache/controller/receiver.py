"""The controller's ZeroMQ side: the pull socket (workers' registrations, batches, snapshots) and
the reply socket (heartbeats), served by one thread that also drops silent workers.

A frame that does not decode into a message of `messages.py` is counted and logged (at most
once per `WARN_EVERY_S`, naming the reason), never raised: a stray or hostile sender costs a log
line, not the controller.
"""

from __future__ import annotations

import threading
import time
from typing import Tuple

import msgspec
import zmq

from lmcache.controller.index import ControllerIndex
from lmcache.controller.messages import HEARTBEAT_DECODER, PULL_DECODER, encode
from lmcache.logging import init_logger

logger = init_logger(__name__)

# How long the thread waits for a frame before it looks for silent workers (and for a stop).
POLL_MS = 100
# At most one warning about unreadable frames this often.
WARN_EVERY_S = 10.0
# Frames queued for the controller before ZeroMQ stops taking more from a worker; a worker whose
# batches were refused shows a gap, and is resynced.
RECV_HWM = 100_000


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Receiver:
    """Binds the pull and reply sockets on `host` (`start`), then feeds `index` until `close`."""

    def __init__(self, index: ControllerIndex, host: str, pull_port: int, reply_port: int) -> None:
        self._index = index
        # Its own context, terminated by `close`: ZeroMQ closes sockets in the background, and only
        # the context's end waits for that, so a controller started right after (a restart in the
        # same process) finds the ports free.
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._reply = self._ctx.socket(zmq.ROUTER)
        self._pull.set_hwm(RECV_HWM)
        for sock in (self._pull, self._reply):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            self._pull.bind(tcp_endpoint(host, pull_port))
            self._reply.bind(tcp_endpoint(host, reply_port))
        except zmq.ZMQError:
            self._pull.close()
            self._reply.close()
            self._ctx.term()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-controller-zmq", daemon=True)
        self.unreadable = 0  # frames that decoded into no message
        self._last_warning = 0.0

    @property
    def ports(self) -> Tuple[int, int]:
        """(pull, reply) ports as bound (a port 0 was picked by the system)."""
        return (int(self._pull.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]),
                int(self._reply.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]))

    def start(self) -> "Receiver":
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._reply, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            # Batches first: a heartbeat then finds the batches that left before it applied.
            while self._pull in ready and self._pull.poll(0):
                self._on_pull(self._pull.recv())
            if self._reply in ready:
                while self._reply.poll(0):
                    self._on_reply(self._reply.recv_multipart())
            self._index.expire()
        self._pull.close()
        self._reply.close()

    def _on_pull(self, frame: bytes) -> None:
        try:
            message = PULL_DECODER.decode(frame)
        except msgspec.MsgspecError as err:
            self._unreadable("pull", err)
            return
        self._index.apply(message)

    def _on_reply(self, frames: list) -> None:
        if len(frames) != 2:
            self._unreadable("reply", ValueError(f"{len(frames)} frames, expected an identity and one message"))
            return
        identity, frame = frames
        try:
            beat = HEARTBEAT_DECODER.decode(frame)
        except msgspec.MsgspecError as err:
            self._unreadable("reply", err)
            return
        try:
            self._reply.send_multipart((identity, encode(self._index.heartbeat(beat))), zmq.NOBLOCK)
        except zmq.ZMQError:  # the worker's queue is full or it left: its next heartbeat asks again
            pass

    def _unreadable(self, where: str, err: Exception) -> None:
        self.unreadable += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            logger.warning("controller: unreadable frame on the %s socket (%d so far): %s", where, self.unreadable, err)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._pull.close()
            self._reply.close()
        self._ctx.term()
