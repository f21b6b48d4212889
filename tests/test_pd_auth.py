"""The PD push channel with a token, through real ZeroMQ sockets: prefiller and decoder with the
same token push and load; no token, a wrong token, a receiver that cannot prove the token, a
forged MAC and pushes replayed from a captured authenticated session are refused, counted and
logged (rate-limited) while the receiver keeps serving; protected mode; where the token comes
from; `pd_encrypt` (CURVE): the KV is not on the wire, plain or foreign senders are refused."""

from __future__ import annotations

import logging
import select
import socket
import threading
from typing import Iterator

import pytest
import torch
import zmq
from helpers import CHUNK, key, own_address
from redis_fixture import free_port
from tier_helpers import ENGINE_CHUNK_BYTES, ENGINE_GEO, small_engine, store_prompt

from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.pd.auth import PD_AUTH_LABEL, PD_TOKEN_ENV, pd_token
from lmcache.experimental.pd.disagg_spec import DisaggSpec
from lmcache.experimental.pd.receiver import AUTH_LOG_EVERY
from lmcache.experimental.pd.sender import PDSender
from lmcache.experimental.pd.wire import auth_frames, push_frames, push_mac, read_reply
from lmcache.experimental.storage_backend import LocalCPUBackend
from lmcache.server.security import ClientHandshake

TOKEN, WRONG = b"pd-token-Hq7/z", b"pd-token-wrong"
N = 2 * CHUNK + 3


def receiver_engine(port: int, token: bytes | None = TOKEN, host: str = "127.0.0.1", monkeypatch=None, **overrides):
    """A decoder engine listening on host:port, with `token` in `LMCACHE_PD_TOKEN` as a user sets it."""
    if monkeypatch is not None:
        if token is None:
            monkeypatch.delenv(PD_TOKEN_ENV, raising=False)
        else:
            monkeypatch.setenv(PD_TOKEN_ENV, token.decode())
    return small_engine(64, enable_pd=True, pd_role="receiver", pd_peer_host=host, pd_peer_init_port=port,
                        pd_buffer_size=16 * ENGINE_CHUNK_BYTES, **overrides)


def refusals(engine) -> int:
    return engine.stats().tiers["PDReceiveBuffer"].auth_refusals


def spec(port: int, req_id: str = "r1", host: str = "127.0.0.1") -> DisaggSpec:
    return DisaggSpec(req_id, host, port, port + 1)


@pytest.fixture
def lines() -> Iterator[list[logging.LogRecord]]:
    """The lmcache loggers' records (their tree does not propagate to root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    top = logging.getLogger("lmcache")
    top.addHandler(handler)
    yield records
    top.removeHandler(handler)


def test_same_token_pushes_and_loads(monkeypatch) -> None:
    port = free_port()
    decoder, prefiller = receiver_engine(port, monkeypatch=monkeypatch), small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=5, token=TOKEN)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=1)
        assert sender.push_stored(prefiller, spec(port), tokens, torch.ones(N, dtype=torch.bool), "") == N
        assert decoder.lookup(tokens) == N and refusals(decoder) == 0
    finally:
        sender.close()
        prefiller.close()
        decoder.close()


@pytest.mark.parametrize("token,says", [(None, "takes a token and this prefiller has none"),
                                        (WRONG, "failed the token handshake")])
def test_no_token_or_a_wrong_one_is_refused_counted_and_an_error(monkeypatch, lines, token, says) -> None:
    port = free_port()
    decoder, prefiller = receiver_engine(port, monkeypatch=monkeypatch), small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=5, token=token)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=2)
        assert sender.push_stored(prefiller, spec(port), tokens, torch.ones(N, dtype=torch.bool), "") == 0
        assert decoder.lookup(tokens) == 0 and refusals(decoder) == 1
        errors = [r.getMessage() for r in lines if r.levelno == logging.ERROR]
        assert len(errors) == 1 and says in errors[0] and PD_TOKEN_ENV in errors[0], errors
        refused = [r.getMessage() for r in lines if "refused a peer at 127.0.0.1" in r.getMessage()]
        assert len(refused) == 1 and "(1 refused so far)" in refused[0], refused
        assert not any(TOKEN.decode() in r.getMessage() or WRONG.decode() in r.getMessage() for r in lines)
    finally:
        sender.close()
        prefiller.close()
        decoder.close()


def test_a_prefiller_with_a_token_does_not_push_to_a_decoder_that_cannot_prove_it(monkeypatch, lines) -> None:
    port = free_port()
    decoder, prefiller = receiver_engine(port, token=None, monkeypatch=monkeypatch), small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=5, token=TOKEN)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=3)
        assert sender.push_stored(prefiller, spec(port), tokens, torch.ones(N, dtype=torch.bool), "") == 0
        assert decoder.lookup(tokens) == 0
        assert any("takes no token" in r.getMessage() for r in lines if r.levelno == logging.ERROR)
    finally:
        sender.close()
        prefiller.close()
        decoder.close()


class Captured:
    """A DEALER speaking the push protocol by hand, keeping every message it sent."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sent: list[list[bytes]] = []

    def send(self, frames):
        frames = [bytes(f) for f in frames]
        self.sent.append(frames)
        self.sock.send_multipart(frames)
        return read_reply(self.sock.recv())

    def close(self) -> None:
        self.sock.close()


def _chunk_frames(seq: int, chunk_key):
    cpu = LocalCPUBackend(HostMemoryAllocator(2 * ENGINE_CHUNK_BYTES))
    obj = cpu.allocate(torch.Size([2, ENGINE_GEO.num_layers, CHUNK, ENGINE_GEO.hidden]), ENGINE_GEO.dtype)
    assert obj is not None
    obj.tensor.fill_(seq)
    frames = [bytes(f) for f in push_frames(seq, "r", chunk_key, obj)]
    obj.ref_count_down()
    return frames


def test_pushes_replayed_from_a_captured_session_are_refused(monkeypatch) -> None:
    port = free_port()
    decoder = receiver_engine(port, monkeypatch=monkeypatch)
    buffer = decoder.storage_manager.tiers[-1]
    chunk = key(1, "test/model")
    victim, intruder = Captured(port), Captured(port)
    try:
        # An authenticated session pushes one chunk; everything it sent is captured.
        handshake = ClientHandshake(TOKEN, PD_AUTH_LABEL)
        hello = victim.send(auth_frames(1, "hello", handshake.nonce))
        assert hello.ok and victim.send(auth_frames(2, "proof", handshake.answer(hello.auth))).ok
        frames = _chunk_frames(3, chunk)
        assert victim.send([*frames, push_mac(handshake.session_key(), frames)]).ok
        assert buffer.get_blocking(chunk) is not None and not buffer.contains(chunk)  # claimed: room for a replay
        signed_push = victim.sent[-1]

        # Replayed in its own session: the sequence number is not new.
        reply = victim.send(signed_push)
        assert not reply.ok and "replayed" in reply.error
        # Replayed on another connection, handshake included: the receiver's nonce is new, the proof stale.
        assert intruder.send(victim.sent[0]).ok
        reply = intruder.send(victim.sent[1])
        assert not reply.ok and "wrong token" in reply.error
        reply = intruder.send(signed_push)
        assert not reply.ok and reply.auth_required
        # A push of its own with a forged MAC, or none, on a session it does not have.
        forged = _chunk_frames(9, chunk)
        assert not intruder.send([*forged, b"\0" * 32]).ok and not intruder.send(forged).ok
        assert not buffer.contains(chunk) and refusals(decoder) == 5
        # A MAC from the session over other frames is no MAC for them.
        other = _chunk_frames(4, key(2, "test/model"))
        reply = victim.send([*other, push_mac(handshake.session_key(), frames)])
        assert not reply.ok and "MAC" in reply.error and not buffer.contains(key(2, "test/model"))
        # The session itself goes on.
        assert victim.send([*other, push_mac(handshake.session_key(), other)]).ok
        assert buffer.contains(key(2, "test/model"))
    finally:
        victim.close()
        intruder.close()
        decoder.close()


def test_refusals_are_logged_rate_limited_and_the_receiver_keeps_serving(monkeypatch, lines) -> None:
    port = free_port()
    decoder = receiver_engine(port, monkeypatch=monkeypatch)
    intruder = Captured(port)
    try:
        frames = _chunk_frames(1, key(1, "test/model"))
        for _ in range(AUTH_LOG_EVERY + 1):
            assert intruder.send(frames).auth_required
        logged = [r.getMessage() for r in lines if "refused a peer" in r.getMessage()]
        assert len(logged) == 2 and f"({AUTH_LOG_EVERY + 1} refused so far)" in logged[1], logged
        assert refusals(decoder) == AUTH_LOG_EVERY + 1
    finally:
        intruder.close()
        decoder.close()


def test_protected_mode_a_decoder_beyond_loopback_needs_a_token(monkeypatch) -> None:
    address, port = own_address(), free_port()
    for host in (address, "0.0.0.0"):
        with pytest.raises(ValueError, match=rf"refusing to listen for PD pushes on {host}:{port}") as err:
            receiver_engine(port, token=None, host=host, monkeypatch=monkeypatch)
        assert PD_TOKEN_ENV in str(err.value) and "pd_token_file" in str(err.value) and "pd_no_auth" in str(err.value)
    receiver_engine(port, token=None, host=address, monkeypatch=monkeypatch, pd_no_auth=True).close()
    port = free_port()  # ZeroMQ closes the listener above in the background: the next one binds elsewhere
    # With the token it listens there, and a prefiller with the token pushes to it.
    decoder, prefiller = receiver_engine(port, host=address, monkeypatch=monkeypatch), small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=5, token=TOKEN)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=4)
        assert sender.push_stored(prefiller, spec(port, host=address), tokens, torch.ones(N, dtype=torch.bool), "") == N
        assert decoder.lookup(tokens) == N
    finally:
        sender.close()
        prefiller.close()
        decoder.close()


def test_the_token_comes_from_the_file_key_else_the_variable(tmp_path) -> None:
    config = LMCacheEngineConfig.from_defaults()
    assert pd_token(config, {}) is None and pd_token(config, {PD_TOKEN_ENV: "  "}) is None
    assert pd_token(config, {PD_TOKEN_ENV: " abc\n"}) == b"abc"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    from_file = LMCacheEngineConfig.from_env({"LMCACHE_PD_TOKEN_FILE": str(path), PD_TOKEN_ENV: "abc"})
    assert pd_token(from_file, {PD_TOKEN_ENV: "abc"}) == b"from-file"
    assert "from-file" not in repr(from_file)
    with pytest.raises(ValueError, match=r"pd_token_file '.*missing' cannot be read"):
        pd_token(LMCacheEngineConfig.from_defaults(pd_token_file=str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"pd_token_file '.*empty' is empty"):
        pd_token(LMCacheEngineConfig.from_defaults(pd_token_file=str(tmp_path / "empty")), {})
    assert LMCacheEngineConfig.from_env({"LMCACHE_PD_NO_AUTH": "true"}).pd_no_auth is True


class Relay:
    """A TCP relay on 127.0.0.1 that keeps every byte a client sends through it (what a peer on
    the network path would see)."""

    def __init__(self, upstream_port: int) -> None:
        self.port, self.seen = free_port(), bytearray()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._upstream = upstream_port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._listener.settimeout(0.2)
        pairs: list[tuple[socket.socket, socket.socket]] = []
        while not self._stop.is_set():
            try:
                client = self._listener.accept()[0]
                pairs.append((client, socket.create_connection(("127.0.0.1", self._upstream))))
            except socket.timeout:
                pass
            ends = [s for pair in pairs for s in pair]
            for sock in select.select(ends, [], [], 0.05)[0] if ends else []:
                pair = next((pair for pair in pairs if sock in pair), None)
                if pair is None:
                    continue  # closed below, earlier in this round
                data = sock.recv(1 << 20)
                if not data:  # one end closed: so does the other
                    pairs.remove(pair)
                    pair[0].close()
                    pair[1].close()
                    continue
                if sock is pair[0]:
                    self.seen += data
                (pair[1] if sock is pair[0] else pair[0]).sendall(data)
        for client, server in pairs:
            client.close()
            server.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_encrypted_pushes_load_and_keep_the_kv_off_the_wire(monkeypatch, encrypt) -> None:
    port = free_port()
    decoder = receiver_engine(port, monkeypatch=monkeypatch, pd_encrypt=encrypt)
    prefiller, relay = small_engine(64), Relay(port)
    sender = PDSender(worker_id=0, timeout_s=5, token=TOKEN, encrypt=encrypt)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=5)
        chunk_key = next(prefiller.token_database.process_tokens(tokens))[2]
        chunk = prefiller.storage_manager.get_resident(chunk_key)
        assert chunk is not None
        kv_bytes = bytes(memoryview(chunk.byte_array).cast("B")[1000:1064])
        chunk.ref_count_down()
        pushed = sender.push_stored(prefiller, spec(relay.port), tokens, torch.ones(N, dtype=torch.bool), "")
        assert pushed == N and decoder.lookup(tokens) == N and len(relay.seen) > 2 * ENGINE_CHUNK_BYTES
        # What the path sees: the KV and the chunk's key in the clear without encryption, neither with it.
        assert (kv_bytes in relay.seen) is (not encrypt)
        assert (chunk_key.chunk_hash.encode() in relay.seen) is (not encrypt)
    finally:
        sender.close()
        relay.close()
        prefiller.close()
        decoder.close()


@pytest.mark.parametrize("sender_token,sender_encrypts", [(TOKEN, False), (WRONG, True)])
def test_an_encrypting_decoder_refuses_plain_or_foreign_senders(monkeypatch, lines, sender_token, sender_encrypts):
    port = free_port()
    decoder, prefiller = receiver_engine(port, monkeypatch=monkeypatch, pd_encrypt=True), small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=1, token=sender_token, encrypt=sender_encrypts)
    try:
        tokens, _, _ = store_prompt(prefiller, N, seed=6)
        assert sender.push_stored(prefiller, spec(port), tokens, torch.ones(N, dtype=torch.bool), "") == 0
        assert decoder.lookup(tokens) == 0 and refusals(decoder) >= 1
        assert any("failed the encrypted handshake" in r.getMessage() for r in lines), [r.getMessage() for r in lines]
        if sender_encrypts:  # the prefiller sees its encrypted connection fail: an error naming the cause
            errors = [r.getMessage() for r in lines if r.levelno == logging.ERROR]
            assert any("encrypted connection" in e and "another token" in e for e in errors), errors
    finally:
        sender.close()
        prefiller.close()
        decoder.close()


def test_encryption_needs_a_token(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"pd_encrypt=True: .*LMCACHE_PD_TOKEN"):
        receiver_engine(free_port(), token=None, monkeypatch=monkeypatch, pd_encrypt=True)
    with pytest.raises(ValueError, match=r"pd_encrypt=True"):
        PDSender(worker_id=0, encrypt=True)
