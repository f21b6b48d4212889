"""Who may push KV into a decoder: the push channel's token, its handshake, protected mode and
encryption.

A pushed chunk is served to whichever request's tokens hash to its key, so a decoder that takes
pushes from anyone lets anyone change other users' answers. With a token, a sender proves it
with `lmcache.server.security`'s handshake (HMAC over both sides' nonces, constant-time compare,
each side proving the token to the other) under the PD protocol label, and signs every push with
the session's key (`wire.push_mac`): ZeroMQ hides connections behind routing ids, so each
message carries its own proof, and its sequence number must grow, so a push captured from one
session is refused in any other and in its own.

- `pd_token(config)`: the token (`pd_token_file` if set, else `LMCACHE_PD_TOKEN`), or None.
- `check_protected_mode(host, port, token, no_auth)`: no token beyond loopback is refused
  unless `pd_no_auth`, as the `lm://` server's `--no-auth`.
- `ReceiverAuth`: the decoder's side, per sender routing id: answers handshake steps and checks
  each push's MAC and sequence number before anything of it is parsed or kept.
- `encrypt_server` / `encrypt_client` (`pd_encrypt`): ZeroMQ's CURVE on the socket. The
  decoder's key pair is derived from the token, so a prefiller encrypts only to a token holder;
  each prefiller connection has a fresh key pair (the token handshake inside proves the
  prefiller). A peer failing CURVE is seen only through the socket's monitor
  (`HANDSHAKE_FAILED_EVENTS`).
The sender's side is `sender.PushClient` with a `security.ClientHandshake`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, TypeVar

import zmq
from zmq.utils import z85

from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.pd.wire import PUSH_FRAMES, AuthStep, Frame, push_mac
from lmcache.server.security import AuthRefused, ServerHandshake, is_loopback, token_from

PD_TOKEN_ENV = "LMCACHE_PD_TOKEN"
PD_AUTH_LABEL = b"lmcache-pd-auth-v1|"
# How to give both ends a token, for error messages.
HOW_TO_SET = f"{PD_TOKEN_ENV}=... or pd_token_file (LMCACHE_PD_TOKEN_FILE), the same on prefiller and decoder"
AUTH_REQUIRED = f"authentication required: this decoder takes a token ({HOW_TO_SET})"
# Senders mid-handshake and authenticated senders remembered (least recently used dropped first).
# Apart, so hellos from peers without the token can never push out an authenticated sender.
MAX_PENDING = 64
MAX_SESSIONS = 256

# What a socket's monitor reports for a peer that failed ZeroMQ's own (CURVE) handshake.
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

V = TypeVar("V")


class NoSession(AuthRefused):
    """A push from a peer that has not (or no longer) passed the handshake."""


def pd_token(config: LMCacheEngineConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The push channel's token: the file `pd_token_file` names, else `LMCACHE_PD_TOKEN`, else None."""
    return token_from(config.pd_token_file, "pd_token_file", PD_TOKEN_ENV, environ)


def check_protected_mode(host: str, port: int, token: Optional[bytes], no_auth: bool) -> None:
    """A ValueError for a decoder about to listen beyond loopback without a token (unless `no_auth`)."""
    if token is None and not no_auth and not is_loopback(host):
        raise ValueError(
            f"refusing to listen for PD pushes on {host}:{port} (pd_peer_host) without a token: anyone who "
            f"reaches the port could push KV that this decoder serves to other users' requests. Set "
            f"{HOW_TO_SET}, or set pd_no_auth: true (LMCACHE_PD_NO_AUTH=true) to insist"
        )


def check_encryption(encrypt: bool, token: Optional[bytes]) -> None:
    """A ValueError for `pd_encrypt` without a token (its keys come from the token)."""
    if encrypt and token is None:
        raise ValueError(f"pd_encrypt=True: the push channel's keys come from its token; set {HOW_TO_SET}")


def _server_keys(token: bytes) -> tuple[bytes, bytes]:
    """The decoder's CURVE key pair (public, secret; Z85), a function of the token alone."""
    secret = z85.encode(hmac.new(token, PD_AUTH_LABEL + b"curve-server-key", hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def encrypt_server(socket: zmq.Socket, token: bytes) -> None:
    """Make `socket` (before it binds) a CURVE server with the token's key pair."""
    socket.curve_publickey, socket.curve_secretkey = _server_keys(token)
    socket.curve_server = True


def encrypt_client(socket: zmq.Socket, token: bytes) -> None:
    """Make `socket` (before it connects) encrypt to the token's decoder, with a fresh key pair."""
    socket.curve_serverkey = _server_keys(token)[0]
    socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()


@dataclass
class _Session:
    key: bytes  # the handshake's session key: every push is signed with it
    last_seq: int = 0  # the highest sequence number taken: a push must carry a higher one


class ReceiverAuth:
    """The decoder's sessions, by the sender's ZeroMQ routing id (one thread uses it)."""

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._pending: "OrderedDict[bytes, ServerHandshake]" = OrderedDict()
        self._sessions: "OrderedDict[bytes, _Session]" = OrderedDict()

    def step(self, peer: bytes, message: AuthStep) -> bytes:
        """Answer one handshake step of `peer`: the nonce and proof for a hello, b"" once the
        peer's proof is right; `AuthRefused` when it is wrong."""
        if message.step == "hello":
            self._sessions.pop(peer, None)  # a new handshake ends the old session
            handshake = ServerHandshake(self._token, PD_AUTH_LABEL)
            _, answer = handshake.step(message.data)
            _remember(self._pending, peer, handshake, MAX_PENDING)
            return answer
        handshake = self._pending.pop(peer, None)
        if handshake is None:
            raise AuthRefused("a proof without a hello first")
        if not message.data:
            raise AuthRefused("the peer could not verify this decoder's proof: it has a different token")
        handshake.step(message.data)
        _remember(self._sessions, peer, _Session(handshake.session_key()), MAX_SESSIONS)
        return b""

    def check_push(self, peer: bytes, frames: Sequence[Frame]) -> None:
        """Refuse a push that is not signed by `peer`'s session: `NoSession` without one,
        `AuthRefused` for a missing or wrong MAC."""
        session = self._sessions.get(peer)
        if session is None:
            raise NoSession(AUTH_REQUIRED)
        if len(frames) != PUSH_FRAMES + 1:
            raise AuthRefused(f"a signed push has {PUSH_FRAMES + 1} frames, got {len(frames)}")
        if not hmac.compare_digest(bytes(frames[PUSH_FRAMES]), push_mac(session.key, frames)):
            raise AuthRefused("the push's MAC is wrong (not signed with this session's key)")
        self._sessions.move_to_end(peer)

    def take_seq(self, peer: bytes, seq: int) -> None:
        """Accept `seq` (from a push `check_push` passed) once: a replay is `AuthRefused`."""
        session = self._sessions[peer]
        if seq <= session.last_seq:
            raise AuthRefused(f"replayed push: seq {seq}, this session is at {session.last_seq}")
        session.last_seq = seq


def _remember(table: "OrderedDict[bytes, V]", peer: bytes, value: V, limit: int) -> None:
    table[peer] = value
    table.move_to_end(peer)
    while len(table) > limit:
        table.popitem(last=False)
