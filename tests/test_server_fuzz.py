"""Property-based fuzzing of the `lm://` frame parser, alone and inside a running server.

- `parse_header` on any bytes: a `FrameHeader` within the limits, or `ProtocolError`; nothing else.
- A server fed a stream of valid requests with one corrupted frame somewhere (flipped bytes,
  truncation, junk): every request before the corruption is answered exactly as a model of the
  store says (never wrong bytes), every reply is a well-formed frame, the server closes the
  connection once the client stops sending (never a hang), and other clients are unaffected.
"""

from __future__ import annotations

import itertools
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.protocol import (
    HARD_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    Op,
    ProtocolError,
    Status,
    TruncatedFrameError,
    pack_header,
    parse_header,
    recv_exact,
    refusal_limit,
)

FRAME_LIMIT = 1 << 16
_stream_ids = itertools.count()


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 4), st.booleans(), st.integers(0, HARD_MAX_PAYLOAD_BYTES))
def test_parse_header_returns_a_bounded_header_or_raises_protocol_error(raw: bytes, is_request: bool, limit: int) -> None:
    try:
        header = parse_header(raw, limit, is_request=is_request)
    except ProtocolError:
        return
    assert len(raw) == HEADER_SIZE
    assert header.key_len <= MAX_KEY_BYTES and header.payload_len <= min(limit, HARD_MAX_PAYLOAD_BYTES)
    if is_request:
        assert header.op != Op.ERROR and header.status == Status.OK


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.from_regex(rb'\{"max_payload_bytes": ?-?[0-9]{1,25}\}', fullmatch=True)))
def test_a_refusal_payload_names_a_positive_limit_or_none(payload: bytes) -> None:
    limit = refusal_limit(payload)
    assert limit is None or (isinstance(limit, int) and limit > 0)
    assert refusal_limit(b"[" * 100_000) is None


@pytest.fixture(scope="module")
def server():
    srv = LMCacheServer(
        ServerConfig(port=0, max_size_bytes=64 << 20, max_payload_bytes=FRAME_LIMIT, frame_timeout_s=2.0)
    )
    srv.start_in_thread()
    canary = LMServerConnector(*srv.address)
    assert canary.put("canary", b"c" * 5000)
    canary.close()
    yield srv
    srv.shutdown()


# One request: (op, key index, payload) over a small key space, so gets and deletes hit.
requests = st.lists(
    st.tuples(
        st.sampled_from([Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.PING]),
        st.integers(0, 3),
        st.binary(max_size=300),
    ),
    min_size=1,
    max_size=12,
)
corruptions = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("cut"), st.integers(1, 10_000)),
    st.tuples(st.just("junk"), st.binary(min_size=1, max_size=64)),
)


def _frame(op: Op, key: bytes, payload: bytes) -> bytes:
    if op == Op.PING:
        return pack_header(op, Status.OK, 0, 0)
    body = payload if op == Op.PUT else b""
    return pack_header(op, Status.OK, len(key), len(body)) + key + body


def _expected(model: dict, op: Op, key: bytes, payload: bytes) -> tuple[Status, bytes]:
    if op == Op.PUT:
        model[key] = payload
        return Status.OK, b""
    if op == Op.GET:
        return (Status.OK, model[key]) if key in model else (Status.NOT_FOUND, b"")
    if op == Op.EXISTS:
        return (Status.OK if key in model else Status.NOT_FOUND), b""
    if op == Op.DELETE:
        return (Status.OK if model.pop(key, None) is not None else Status.NOT_FOUND), b""
    return Status.OK, b""


def _corrupt(frame: bytes, how) -> bytes:
    kind, arg = how
    if kind == "flip":
        bad = bytearray(frame)
        for pos, mask in arg:
            bad[pos % len(bad)] ^= mask
        return bytes(bad)
    if kind == "cut":
        return frame[: arg % len(frame)]
    return arg


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests, st.integers(0, 12), corruptions)
def test_a_corrupted_stream_never_yields_wrong_bytes_or_a_hang(server, reqs, where: int, how) -> None:
    prefix = f"s{next(_stream_ids)}-".encode()  # a key space of this example's own
    model: dict = {}
    frames, expected = [], []
    for op, k, payload in reqs:
        key = prefix + str(k).encode()
        frames.append(_frame(op, key, payload))
        expected.append((op, *_expected(model, op, key, payload)))
    where = min(where, len(frames) - 1)
    stream = b"".join(frames[:where]) + _corrupt(frames[where], how) + b"".join(frames[where + 1 :])
    with socket.create_connection(server.address, timeout=10) as sock:
        try:
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server already refused a bad frame and closed: what it answered is read below
        replies = []
        try:
            while True:
                header = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), HARD_MAX_PAYLOAD_BYTES, is_request=False)
                recv_exact(sock, header.key_len, "reply key")
                body = bytes(recv_exact(sock, header.payload_len, "reply payload"))
                replies.append((header.op, header.status, body))
        except TruncatedFrameError as err:
            assert "after 0 of" in str(err), f"server cut a reply short: {err}"  # clean EOF only
        except ConnectionResetError:
            pass
    for got, (op, status, body) in zip(replies[:where], expected[:where]):
        assert got == (op, status, body)
    for op, status, body in replies[where:]:
        assert op != Op.ERROR or status == Status.BAD_REQUEST
    check = LMServerConnector(*server.address)
    try:
        assert bytes(check.get("canary")) == b"c" * 5000
    finally:
        check.close()
