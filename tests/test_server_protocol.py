"""The lm:// wire format, without sockets."""

from __future__ import annotations

import struct

import pytest

from lmcache.server.protocol import (
    HARD_MAX_PAYLOAD_BYTES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    Status,
    pack_header,
    parse_header,
)


def _raw(magic=MAGIC, version=PROTOCOL_VERSION, op=Op.GET, status=Status.OK, key_len=3, payload_len=0):
    return HEADER.pack(magic, version, int(op), int(status), key_len, payload_len)


def test_header_round_trip() -> None:
    raw = pack_header(Op.PUT, Status.OK, 17, 123456)
    assert len(raw) == HEADER_SIZE
    header = parse_header(raw, max_payload_bytes=1 << 20, is_request=True)
    assert (header.op, header.status, header.key_len, header.payload_len) == (Op.PUT, Status.OK, 17, 123456)
    reply = parse_header(pack_header(Op.GET, Status.NOT_FOUND, 0, 0), 1 << 20, is_request=False)
    assert reply.status == Status.NOT_FOUND


@pytest.mark.parametrize(
    "raw, reason",
    [
        (_raw(magic=b"XXXX"), "bad magic"),
        (_raw(version=PROTOCOL_VERSION + 1), "protocol version"),
        (struct.pack("!4sBBHIQ", MAGIC, PROTOCOL_VERSION, 99, 0, 3, 0), "unknown op"),
        (struct.pack("!4sBBHIQ", MAGIC, PROTOCOL_VERSION, int(Op.GET), 77, 3, 0), "unknown status"),
        (_raw(key_len=MAX_KEY_BYTES + 1), "key length"),
        (_raw(op=Op.PUT, payload_len=(1 << 20) + 1), "exceeds the frame limit"),
        (_raw(op=Op.GET, payload_len=5), "must not carry a payload"),
        (_raw(op=Op.PING, key_len=2), "must not carry a key"),
        (_raw(op=Op.EXISTS, key_len=0), "without a key"),
        (_raw(op=Op.GET, status=Status.REFUSED), "carries status"),
        (_raw(op=Op.ERROR, key_len=0), "not a request op"),
        (b"LMCS\x01", "header must be"),
    ],
)
def test_bad_request_headers_are_rejected_with_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        parse_header(raw, max_payload_bytes=1 << 20, is_request=True)


def test_hard_limit_caps_any_configured_limit() -> None:
    raw = _raw(op=Op.PUT, payload_len=HARD_MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(ProtocolError, match="frame limit"):
        parse_header(raw, max_payload_bytes=HARD_MAX_PAYLOAD_BYTES * 4, is_request=True)
    with pytest.raises(ProtocolError, match="hard frame limit"):
        pack_header(Op.PUT, Status.OK, 1, HARD_MAX_PAYLOAD_BYTES + 1)
