"""The prefiller's side of PD: push the chunks a store just wrote to the request's decoder.

`PDSender.push_stored(engine, spec, tokens, mask, cache_salt)` runs right after the worker's
`engine.store` of a step, with the same tokens and mask, so chunks go out as chunked prefill
computes them (the last step's partial chunk included). Each push waits for the receiver's
reply (bounded by `timeout_s`): when `wait_for_save` returns, the decoder holds the chunks or
has said no. A refusal, a timeout or a dead receiver stops that request's pushes (the decoder
recomputes what it lacks) and never fails the prefill; a receiver that timed out is skipped for
`PEER_RETRY_S` so a dead decoder does not slow every prefill.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

import torch
import zmq

from lmcache.experimental.pd.disagg_spec import DisaggSpec
from lmcache.experimental.pd.wire import Frame, WireError, push_frames, read_reply
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from lmcache.experimental.cache_engine import LMCacheEngine

logger = init_logger(__name__)

PUSH_TIMEOUT_S = 5.0
PEER_RETRY_S = 10.0
MAX_PEERS = 16  # open connections kept (least recently used closed beyond it)
MAX_FAILED_REQUESTS = 1024  # requests remembered as failed (their later chunks are not pushed)


class PushError(RuntimeError):
    """A push that got no usable reply (timeout, transport error, malformed reply)."""


class PushClient:
    """One DEALER connection to a receiver; `push` sends one chunk and waits for its reply."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self._timeout_ms = int(timeout_s * 1000)
        self._seq = 0
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a receiver that is not connected
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(address)
        self._socket = sock

    def push(self, frames_for: Callable[[int], list[Frame]]) -> Optional[str]:
        """Send the frames for the next sequence number; None when taken, else the refusal."""
        self._seq += 1
        seq = self._seq
        try:
            self._socket.send_multipart(frames_for(seq), copy=False)
            deadline = time.monotonic() + self._timeout_ms / 1000
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._socket.poll(left_ms):
                    raise PushError(f"no reply from {self.address} within {self._timeout_ms} ms")
                reply = read_reply(self._socket.recv())
                if reply.seq == seq:  # an older push's late reply is skipped
                    return None if reply.ok else reply.error or "refused"
        except zmq.Again:
            raise PushError(f"{self.address} is not accepting pushes (not listening, or busy)") from None
        except (zmq.ZMQError, WireError) as err:
            raise PushError(f"{self.address}: {err}") from err

    def close(self) -> None:
        self._socket.close()


class PDSender:
    """Pushes stored chunks to the receivers that requests' `disagg_spec`s name."""

    def __init__(self, worker_id: int, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        self._worker_id = worker_id
        self._timeout_s = timeout_s
        self._clients: "OrderedDict[str, PushClient]" = OrderedDict()
        self._down_until: dict[str, float] = {}
        self._failed: "OrderedDict[str, None]" = OrderedDict()

    def _address(self, spec: DisaggSpec) -> str:
        return f"tcp://{spec.receiver_host}:{spec.receiver_init_port + self._worker_id}"

    def _client(self, address: str) -> PushClient:
        client = self._clients.pop(address, None) or PushClient(address, self._timeout_s)
        self._clients[address] = client
        while len(self._clients) > MAX_PEERS:
            self._clients.popitem(last=False)[1].close()
        return client

    def _fail(self, spec: DisaggSpec, address: str, why: str, peer_down: bool) -> None:
        logger.warning("PD push of request %s to %s stopped (the decoder recomputes the rest): %s",
                       spec.req_id, address, why)
        self._failed[spec.req_id] = None
        while len(self._failed) > MAX_FAILED_REQUESTS:
            self._failed.popitem(last=False)
        if peer_down:
            self._down_until[address] = time.monotonic() + PEER_RETRY_S
            client = self._clients.pop(address, None)
            if client is not None:
                client.close()  # a fresh socket next time: no stale replies, no queued frames

    def push_stored(
        self, engine: "LMCacheEngine", spec: DisaggSpec, tokens: torch.Tensor, mask: torch.Tensor, cache_salt: str
    ) -> int:
        """Push the chunks `engine.store(tokens, mask, ...)` covers; the tokens pushed."""
        if spec.req_id in self._failed:
            return 0
        address = self._address(spec)
        if self._down_until.get(address, 0.0) > time.monotonic():
            self._fail(spec, address, "the receiver did not answer recently", peer_down=False)
            return 0
        pushed = 0
        for start, end, key in engine.token_database.process_tokens(tokens, mask, cache_salt=cache_salt):
            obj = engine.storage_manager.get_resident(key)
            if obj is None:
                self._fail(spec, address, f"chunk of tokens [{start}, {end}) is not in CPU memory", peer_down=False)
                break
            try:
                refusal = self._client(address).push(lambda seq: push_frames(seq, spec.req_id, key, obj))
            except PushError as err:
                self._fail(spec, address, str(err), peer_down=True)
                break
            finally:
                obj.ref_count_down()
            if refusal is not None:
                self._fail(spec, address, f"refused: {refusal}", peer_down=False)
                break
            pushed += end - start
        return pushed

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
