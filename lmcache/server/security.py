"""Authentication and TLS of the `lm://` protocol, both sides.

The handshake proves a shared token without sending it, and proves it both ways (a client with
a token will not take data from a server that cannot show it knows the token too). It is a
pair of `AUTH` frames right after connecting (after the TLS handshake for `lms://`):

1. client -> server: `AUTH`, payload = 32 random bytes `cn` (the client's nonce);
2. server -> client: `OK`, payload = 32 random bytes `sn` + `HMAC(token, "server" | cn | sn)`;
   a server without a token answers `OK` with no payload (nothing to prove);
3. client -> server: `AUTH`, payload = `HMAC(token, "client" | cn | sn)`;
4. server -> client: `OK`, or `REFUSED` (`{"reason": "auth_failed"}`) and the connection closes.

HMAC-SHA256, compared with `hmac.compare_digest`. The role label keeps the server's proof from
being replayed as the client's. A server with a token answers anything but `AUTH` before step 4
with `ERROR` ("authentication required") and closes: no get, put or exists is served.

`ServerHandshake` and `ClientHandshake` hold the steps without a transport, so the PD push
channel (`lmcache/experimental/pd/auth.py`, over ZeroMQ) runs the same handshake under its own
protocol label; a channel whose messages are not bound to one connection authenticates each
message with the handshake's `session_key`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import ssl
from typing import Mapping, Optional

from lmcache.server.protocol import (
    HEADER_SIZE,
    MAX_AUTH_PAYLOAD_BYTES,
    Op,
    ProtocolError,
    Status,
    parse_header,
    recv_exact,
    send_frame,
)

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
# The server's second AUTH reply: a nonce plus a proof (the protocol's AUTH payload limit).
MAX_AUTH_PAYLOAD = NONCE_BYTES + PROOF_BYTES
assert MAX_AUTH_PAYLOAD == MAX_AUTH_PAYLOAD_BYTES
# Domain separation: a proof made for one protocol is no proof in another.
LM_AUTH_LABEL = b"lmcache-lm-auth-v1|"

# Where the server and the client find their secrets (never a command-line value: `ps` shows those).
SERVER_TOKEN_ENV = "LMCACHE_SERVER_TOKEN"
CLIENT_TOKEN_ENV = "LMCACHE_REMOTE_TOKEN"
CLIENT_CA_ENV = "LMCACHE_REMOTE_TLS_CA"
# The server's answer to a request before the handshake (the client recognises it).
AUTH_REQUIRED = "authentication required: this server takes a token (lm://:TOKEN@host:port or LMCACHE_REMOTE_TOKEN)"


class AuthRefused(Exception):
    """The peer failed the handshake (wrong token, no token, or a server that cannot prove it)."""


def proof(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, label: bytes = LM_AUTH_LABEL) -> bytes:
    """HMAC-SHA256 of the protocol label, the role and both nonces under the token."""
    return hmac.new(token, label + role + b"|" + client_nonce + server_nonce, hashlib.sha256).digest()


def read_token_file(path: str, key: str = "--token-file") -> bytes:
    """The token in `path` (surrounding whitespace dropped); a ValueError naming `key` (the
    option or config key that gave the path) if unreadable or empty."""
    try:
        with open(path, "rb") as handle:
            token = handle.read().strip()
    except OSError as err:
        raise ValueError(f"{key} {path!r} cannot be read: {err.strerror}") from err
    if not token:
        raise ValueError(f"{key} {path!r} is empty")
    return token


def token_from(path: Optional[str], key: str, env_var: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """A channel's token: the file at `path` (the config key `key` names it) if set, else the
    variable `env_var` (surrounding whitespace dropped), else None."""
    if path is not None:
        return read_token_file(path, key)
    env = os.environ if environ is None else environ
    return env.get(env_var, "").strip().encode() or None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`): the only place without a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve anywhere


class ServerHandshake:
    """One connection's side of the handshake on the server; `done` once the peer proved the
    token (at once when the server has none)."""

    def __init__(self, token: Optional[bytes], label: bytes = LM_AUTH_LABEL) -> None:
        self._token = token
        self._label = label
        self.done = token is None
        self._nonces: Optional[tuple[bytes, bytes]] = None

    @property
    def started(self) -> bool:
        """The peer sent its nonce (a peer leaving now could not verify our proof)."""
        return self._nonces is not None

    def step(self, payload: bytes) -> tuple[Status, bytes]:
        """Answer one `AUTH` frame; raises `AuthRefused` when the peer's proof is wrong."""
        if self._token is None:
            return Status.OK, b""
        if self._nonces is None:
            if len(payload) != NONCE_BYTES:
                raise AuthRefused(f"first AUTH frame carries {len(payload)} bytes, expected a {NONCE_BYTES}-byte nonce")
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            self._nonces = (payload, server_nonce)
            return Status.OK, server_nonce + proof(self._token, b"server", payload, server_nonce, self._label)
        expected = proof(self._token, b"client", *self._nonces, self._label)
        if not hmac.compare_digest(expected, payload):
            raise AuthRefused("wrong token")
        self.done = True
        return Status.OK, b""

    def session_key(self) -> bytes:
        """A key only this handshake's two ends know (once `done`, with a token)."""
        assert self.done and self._token is not None and self._nonces is not None
        return proof(self._token, b"session", *self._nonces, self._label)


class ClientHandshake:
    """The client's side without a transport: send `nonce`, then `answer` the server's reply."""

    def __init__(self, token: bytes, label: bytes = LM_AUTH_LABEL) -> None:
        self._token = token
        self._label = label
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._server_nonce: Optional[bytes] = None

    def answer(self, payload: bytes) -> bytes:
        """The client's proof for the server's first reply; `AuthRefused` if the server cannot
        show that it knows the token."""
        if len(payload) != MAX_AUTH_PAYLOAD:
            raise AuthRefused("the server takes no token: it cannot prove it knows ours (remove the token or set one on the server)")
        server_nonce, server_proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
        if not hmac.compare_digest(server_proof, proof(self._token, b"server", self.nonce, server_nonce, self._label)):
            raise AuthRefused("the server does not know the token (wrong server, or a different token)")
        self._server_nonce = server_nonce
        return proof(self._token, b"client", self.nonce, server_nonce, self._label)

    def session_key(self) -> bytes:
        """The key `ServerHandshake.session_key` gives the server (after `answer`)."""
        assert self._server_nonce is not None
        return proof(self._token, b"session", self.nonce, self._server_nonce, self._label)


def client_handshake(sock: socket.socket, token: bytes) -> None:
    """Prove `token` to the server on a fresh connection; raises `AuthRefused` (or
    `ProtocolError` / `OSError` for a broken connection)."""
    handshake = ClientHandshake(token)
    send_frame(sock, Op.AUTH, payload=handshake.nonce)
    status, payload = _read_auth_reply(sock)
    if status != Status.OK:
        raise AuthRefused(f"the server answered the handshake with {status.name}")
    send_frame(sock, Op.AUTH, payload=handshake.answer(payload))
    status, _ = _read_auth_reply(sock)
    if status != Status.OK:
        raise AuthRefused("the server refused the token")


def _read_auth_reply(sock: socket.socket) -> tuple[Status, bytes]:
    header = parse_header(recv_exact(sock, HEADER_SIZE, "a handshake reply"), MAX_AUTH_PAYLOAD, is_request=False)
    recv_exact(sock, header.key_len, "a handshake reply key")
    payload = bytes(recv_exact(sock, header.payload_len, "a handshake reply payload"))
    if header.op == Op.ERROR:
        raise AuthRefused(f"the server rejected the handshake: {payload.decode('utf-8', 'replace')}")
    if header.status == Status.REFUSED:
        raise AuthRefused("the server refused the token")
    if header.op != Op.AUTH:
        raise ProtocolError(f"reply to AUTH came back as {header.op.name}")
    return header.status, payload


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """TLS 1.2+ server context from a PEM certificate chain and its key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def client_tls_context(ca_file: Optional[str] = None) -> ssl.SSLContext:
    """TLS context that checks the server's certificate and host name against `ca_file`
    (`LMCACHE_REMOTE_TLS_CA` when None and set, else the system's trust store)."""
    ca_file = ca_file or os.environ.get(CLIENT_CA_ENV, "").strip() or None
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
