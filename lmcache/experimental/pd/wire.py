"""The frames of one KV push (prefiller -> decoder) and of its reply. No pickle anywhere.

A push is one ZeroMQ multipart message of three frames::

    [ meta: JSON {"v": 1, "seq": n, "req_id": "..."} (<= MAX_META_BYTES) ]
    [ header: a chunk_format header (key, shape, dtype, format, lengths, checksums) ]
    [ payload: the chunk's bytes (checksum checked against the header) ]

and its reply one frame, JSON `{"seq": n, "ok": true}` or `{"seq": n, "ok": false, "error": "..."}`.
The header and payload frames are exactly what the disk and remote tiers store, so a push is
checked by the same code; `read_push` refuses anything else with `WireError` naming what is wrong.

With a token (`auth.py`) a sender first runs the handshake, two one-frame messages
`{"v": 1, "seq": n, "auth": "hello" | "proof", "data": "<hex>"}` (the reply to the hello carries
the receiver's nonce and proof in `"auth"`), and then adds a fourth frame to every push::

    [ mac: HMAC-SHA256(session key, len(meta) | meta | header) ]

The header holds the payload's length and checksum, so the MAC binds the whole push to the
session without hashing the payload twice. A push the receiver wants a handshake for first is
answered with `"auth_required": true`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from lmcache.experimental.memory_management import MemoryObj
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.storage_backend.chunk_format import ChunkHeader
from lmcache.utils import CacheEngineKey

WIRE_VERSION = 1
MAX_META_BYTES = 1024
MAX_REPLY_BYTES = 4096
PUSH_FRAMES = 3
AUTH_STEPS = ("hello", "proof")
MAX_AUTH_DATA_BYTES = 64  # a step carries a nonce or a proof (32 bytes each), hex-encoded

Frame = Union[bytes, bytearray, memoryview]


class WireError(ValueError):
    """A push or reply that does not follow this format."""


@dataclass(frozen=True)
class Push:
    """One checked push: which request, and the chunk (header + verified payload)."""

    seq: int
    req_id: str
    header: ChunkHeader
    payload: memoryview


@dataclass(frozen=True)
class PushReply:
    seq: int
    ok: bool
    error: str = ""
    auth: bytes = b""  # the receiver's answer to a handshake step (its nonce and proof)
    auth_required: bool = False  # no session (yet, or any more): handshake, then push again


@dataclass(frozen=True)
class AuthStep:
    """One handshake message: the client's nonce (`hello`) or its proof (`proof`)."""

    seq: int
    step: str
    data: bytes


def _json_object(frame: Frame, limit: int, what: str) -> dict[str, Any]:
    data = bytes(frame)
    if len(data) > limit:
        raise WireError(f"{what} frame of {len(data)} bytes is over {limit}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"{what} frame is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{what} frame is not a JSON object")
    return obj


def _int_field(obj: dict[str, Any], name: str, what: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError(f"{what} field {name!r}={value!r}: expected an int >= 0")
    return value


def push_frames(seq: int, req_id: str, key: CacheEngineKey, obj: MemoryObj) -> list[Frame]:
    """The frames pushing `obj` under `key` (the payload frame is a view, not a copy)."""
    meta = json.dumps({"v": WIRE_VERSION, "seq": seq, "req_id": req_id}).encode()
    payload = chunk_format.memory_obj_payload(obj)
    header = chunk_format.encode_header(key, obj.metadata.shape, obj.metadata.dtype, obj.metadata.fmt, payload,
                                        obj.payload_checksum)
    return [meta, header, payload]


def peek_seq(frames: Sequence[Frame]) -> int:
    """The sequence number a message claims (0 if none): a refusal's reply carries it, so the
    sender matches it to its push; nothing else of a refused message is read."""
    try:
        return _int_field(_json_object(frames[0], MAX_META_BYTES, "meta"), "seq", "meta")
    except (WireError, IndexError):
        return 0


def push_mac(session_key: bytes, frames: Sequence[Frame]) -> bytes:
    """The MAC frame of a push under `session_key` (over its meta and header frames)."""
    meta, header = bytes(frames[0]), bytes(frames[1])
    return hmac.new(session_key, len(meta).to_bytes(4, "big") + meta + header, hashlib.sha256).digest()


def auth_frames(seq: int, step: str, data: bytes) -> list[Frame]:
    """The one frame of handshake step `step` ("hello": the nonce, "proof": the proof)."""
    return [json.dumps({"v": WIRE_VERSION, "seq": seq, "auth": step, "data": data.hex()}).encode()]


def read_auth(frames: Sequence[Frame]) -> Optional[AuthStep]:
    """The handshake step in `frames`, None when they are not one (a push), or `WireError`."""
    if len(frames) != 1:
        return None
    meta = _json_object(frames[0], MAX_META_BYTES, "auth")
    if meta.get("v") != WIRE_VERSION:
        raise WireError(f"auth field 'v'={meta.get('v')!r}: this receiver speaks version {WIRE_VERSION}")
    step, data = meta.get("auth"), meta.get("data")
    if step not in AUTH_STEPS:
        raise WireError(f"auth field 'auth'={step!r}: expected one of {AUTH_STEPS}")
    if not isinstance(data, str) or len(data) > 2 * MAX_AUTH_DATA_BYTES:
        raise WireError("auth field 'data': expected a short hex string")
    try:
        raw = bytes.fromhex(data)
    except ValueError:
        raise WireError("auth field 'data' is not hex") from None
    return AuthStep(_int_field(meta, "seq", "auth"), step, raw)


def read_push(frames: Sequence[Frame]) -> Push:
    """The checked push in `frames`, or `WireError` (never a partly trusted chunk)."""
    if len(frames) != PUSH_FRAMES:
        raise WireError(f"a push has {PUSH_FRAMES} frames, got {len(frames)}")
    meta = _json_object(frames[0], MAX_META_BYTES, "meta")
    if meta.get("v") != WIRE_VERSION:
        raise WireError(f"meta field 'v'={meta.get('v')!r}: this receiver speaks version {WIRE_VERSION}")
    seq = _int_field(meta, "seq", "meta")
    req_id = meta.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise WireError(f"meta field 'req_id'={req_id!r}: expected a non-empty string")
    header_frame = memoryview(frames[1]).cast("B")
    if header_frame.nbytes > chunk_format.MAX_HEADER_BYTES:
        raise WireError(f"header frame of {header_frame.nbytes} bytes is over {chunk_format.MAX_HEADER_BYTES}")
    header = chunk_format.decode_header(header_frame)
    if header is None or header.size != header_frame.nbytes:
        raise WireError("header frame is not one chunk_format header")
    payload = memoryview(frames[2]).cast("B")
    if not chunk_format.verify_payload(header, payload):
        raise WireError(f"chunk {header.key}: payload length or checksum does not match its header")
    return Push(seq, req_id, header, payload)


def reply_frame(reply: PushReply) -> bytes:
    body: dict[str, Any] = {"seq": reply.seq, "ok": reply.ok}
    if reply.error:
        body["error"] = reply.error[:1000]
    if reply.auth:
        body["auth"] = reply.auth.hex()
    if reply.auth_required:
        body["auth_required"] = True
    return json.dumps(body).encode()


def read_reply(frame: Frame) -> PushReply:
    obj = _json_object(frame, MAX_REPLY_BYTES, "reply")
    ok = obj.get("ok")
    if not isinstance(ok, bool):
        raise WireError(f"reply field 'ok'={ok!r}: expected a bool")
    error = obj.get("error", "")
    auth = obj.get("auth", "")
    try:
        auth_bytes = bytes.fromhex(auth) if isinstance(auth, str) else b""
    except ValueError:
        raise WireError("reply field 'auth' is not hex") from None
    return PushReply(_int_field(obj, "seq", "reply"), ok, error if isinstance(error, str) else repr(error),
                     auth_bytes, obj.get("auth_required") is True)
