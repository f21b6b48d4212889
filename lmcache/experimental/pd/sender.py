"""The prefiller's side of PD: push the chunks a store just wrote to the request's decoder.

`PDSender.push_stored(engine, spec, tokens, mask, cache_salt)` runs right after the worker's
`engine.store` of a step, with the same tokens and mask, so chunks go out as chunked prefill
computes them (the last step's partial chunk included). Each push waits for the receiver's
reply (bounded by `timeout_s`): when `wait_for_save` returns, the decoder holds the chunks or
has said no. A refusal, a timeout or a dead receiver stops that request's pushes (the decoder
recomputes what it lacks) and never fails the prefill; a receiver that timed out is skipped for
`PEER_RETRY_S` so a dead decoder does not slow every prefill.

With a token (`auth.py`) each connection first proves it (and checks that the receiver knows it
too), then signs every push; with `pd_encrypt` it is CURVE-encrypted to the token's decoder too.
A receiver that refuses the token, or that cannot prove it, is an error in this log (a
misconfiguration, not a network blip), and is skipped like a dead one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache.experimental.pd.auth import (
    HANDSHAKE_FAILED_EVENTS,
    HOW_TO_SET,
    PD_AUTH_LABEL,
    check_encryption,
    encrypt_client,
)
from lmcache.experimental.pd.disagg_spec import DisaggSpec
from lmcache.experimental.pd.wire import Frame, PushReply, WireError, auth_frames, push_frames, push_mac, read_reply
from lmcache.logging import init_logger
from lmcache.server.security import AuthRefused, ClientHandshake

if TYPE_CHECKING:
    from lmcache.experimental.cache_engine import LMCacheEngine

logger = init_logger(__name__)

PUSH_TIMEOUT_S = 5.0
PEER_RETRY_S = 10.0
MAX_PEERS = 16  # open connections kept (least recently used closed beyond it)
MAX_FAILED_REQUESTS = 1024  # requests remembered as failed (their later chunks are not pushed)


class PushError(RuntimeError):
    """A push that got no usable reply (timeout, transport error, malformed reply)."""


class PushAuthError(PushError):
    """The receiver refused this sender's token (or has none), or could not prove it knows it."""


class PushClient:
    """One DEALER connection to a receiver; `push` sends one chunk and waits for its reply."""

    def __init__(self, address: str, timeout_s: float, token: Optional[bytes] = None, encrypt: bool = False) -> None:
        check_encryption(encrypt, token)
        self.address = address
        self._timeout_ms = int(timeout_s * 1000)
        self._seq = 0
        self._token = token
        self._session_key: Optional[bytes] = None  # set by a passed handshake (with a token)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a receiver that is not connected
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDHWM, 4)
        self._monitor: Optional[zmq.Socket] = None
        if encrypt:
            assert token is not None
            encrypt_client(sock, token)
            self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
        sock.connect(address)
        self._socket = sock

    def push(self, frames_for: Callable[[int], list[Frame]]) -> Optional[str]:
        """Send the frames for the next sequence number; None when taken, else the refusal."""
        if self._token is not None and self._session_key is None:
            self._handshake()
        reply = self._send_push(frames_for)
        if reply.auth_required and self._token is not None:  # the receiver restarted or forgot us
            self._handshake()
            reply = self._send_push(frames_for)
        if reply.auth_required:
            raise PushAuthError(f"{self.address} takes a token and this prefiller has none: set {HOW_TO_SET}")
        return None if reply.ok else reply.error or "refused"

    def _send_push(self, frames_for: Callable[[int], list[Frame]]) -> PushReply:
        self._seq += 1
        frames = frames_for(self._seq)
        if self._session_key is not None:
            frames.append(push_mac(self._session_key, frames))
        return self._exchange(frames)

    def _handshake(self) -> None:
        """Prove the token and check the receiver's proof (`security.ClientHandshake`)."""
        assert self._token is not None
        self._session_key = None
        handshake = ClientHandshake(self._token, PD_AUTH_LABEL)
        self._seq += 1
        reply = self._exchange(auth_frames(self._seq, "hello", handshake.nonce))
        if not reply.ok:
            raise PushAuthError(f"{self.address} refused the token handshake: {reply.error or 'refused'}")
        try:
            proof = handshake.answer(reply.auth)
        except AuthRefused as err:
            # An empty proof tells the receiver (which counts and logs it); a real one could be
            # relayed by an impostor to the decoder it pretends to be.
            self._seq += 1
            try:
                self._exchange(auth_frames(self._seq, "proof", b""))
            except PushError:
                pass  # the receiver's loss: the error below is this sender's news
            raise PushAuthError(f"{self.address} failed the token handshake: {err}; set {HOW_TO_SET}") from None
        self._seq += 1
        reply = self._exchange(auth_frames(self._seq, "proof", proof))
        if not reply.ok:
            raise PushAuthError(f"{self.address} refused this prefiller's token ({reply.error or 'refused'}): "
                                f"set {HOW_TO_SET}")
        self._session_key = handshake.session_key()

    def _exchange(self, frames: list[Frame]) -> PushReply:
        """Send one message (its sequence number is `self._seq`) and wait for its reply."""
        seq = self._seq
        try:
            self._socket.send_multipart(frames, copy=False)
            deadline = time.monotonic() + self._timeout_ms / 1000
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._socket.poll(left_ms):
                    raise PushError(f"no reply from {self.address} within {self._timeout_ms} ms")
                reply = read_reply(self._socket.recv())
                if reply.seq == seq:  # an older message's late reply is skipped
                    return reply
        except zmq.Again:
            if self._encryption_failed():
                raise PushAuthError(f"the encrypted connection to {self.address} failed: the decoder has another "
                                    f"token, or no pd_encrypt (set both the same on prefiller and decoder)") from None
            raise PushError(f"{self.address} is not accepting pushes (not listening, or busy)") from None
        except (zmq.ZMQError, WireError) as err:
            raise PushError(f"{self.address}: {err}") from err

    def _encryption_failed(self) -> bool:
        """Whether the socket's monitor saw ZeroMQ's (CURVE) handshake fail."""
        failed = False
        while self._monitor is not None and self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            failed = True
        return failed

    def close(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close()
        self._socket.close()


class PDSender:
    """Pushes stored chunks to the receivers that requests' `disagg_spec`s name (proving
    `token` to them when given: `auth.pd_token`; encrypted to them with `encrypt`)."""

    def __init__(
        self, worker_id: int, timeout_s: float = PUSH_TIMEOUT_S, token: Optional[bytes] = None, encrypt: bool = False
    ) -> None:
        check_encryption(encrypt, token)
        self._worker_id = worker_id
        self._timeout_s = timeout_s
        self._token = token
        self._encrypt = encrypt
        self._clients: "OrderedDict[str, PushClient]" = OrderedDict()
        self._down: dict[str, tuple[float, str]] = {}  # address -> (skipped until, why)
        self._failed: "OrderedDict[str, None]" = OrderedDict()

    def _address(self, spec: DisaggSpec) -> str:
        return f"tcp://{spec.receiver_host}:{spec.receiver_init_port + self._worker_id}"

    def _client(self, address: str) -> PushClient:
        client = self._clients.pop(address, None) or PushClient(address, self._timeout_s, self._token, self._encrypt)
        self._clients[address] = client
        while len(self._clients) > MAX_PEERS:
            self._clients.popitem(last=False)[1].close()
        return client

    def _fail(self, spec: DisaggSpec, address: str, why: str, peer_down: bool, level: int = logging.WARNING) -> None:
        logger.log(level, "PD push of request %s to %s stopped (the decoder recomputes the rest): %s",
                   spec.req_id, address, why)
        self._failed[spec.req_id] = None
        while len(self._failed) > MAX_FAILED_REQUESTS:
            self._failed.popitem(last=False)
        if peer_down:
            self._down[address] = (time.monotonic() + PEER_RETRY_S, why)
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
        until, why = self._down.get(address, (0.0, ""))
        if until > time.monotonic():
            self._fail(spec, address, f"skipped for {PEER_RETRY_S:g} s after: {why}", peer_down=False)
            return 0
        pushed = 0
        for start, end, key in engine.token_database.process_tokens(tokens, mask, cache_salt=cache_salt):
            obj = engine.storage_manager.get_resident(key)
            if obj is None:
                self._fail(spec, address, f"chunk of tokens [{start}, {end}) is not in CPU memory", peer_down=False)
                break
            try:
                refusal = self._client(address).push(lambda seq: push_frames(seq, spec.req_id, key, obj))
            except PushAuthError as err:
                self._fail(spec, address, str(err), peer_down=True, level=logging.ERROR)
                break
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
