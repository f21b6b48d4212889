"""The peer server: this instance's own tiers, served read-only to other instances.

It is the `lm://` server's connection handling (`lmcache.server.server`: typed frames, one
thread per connection, frame and idle timeouts, a bounded connection count, the token handshake
and TLS of `security.py`) with its own answers: `GET` reads the chunk from the local tiers (CPU,
then disk; a disk hit is promoted as any read is) and sends it in the chunk format of
`chunk_format` - header with the payload checksum, then the payload straight from the memory
object, not copied; `EXISTS`, `PING`, `INFO` as usual. `PUT`, `DELETE` and the node pool's ops
are protocol errors: nobody writes into a peer. A client pipelines its `GET`s
(`LMServerConnector.batched_get_into`), so a batch costs one round trip.

Protected mode: on an address other than loopback it takes a token (`p2p_token_file` or
`LMCACHE_P2P_TOKEN`) unless `p2p_no_auth`; the token is never logged. With `p2p_tls_cert_file` and
`p2p_tls_key_file` it speaks TLS only, and readers check its certificate (`p2p_tls_ca_file`).
"""

from __future__ import annotations

import socket
import ssl
from typing import Mapping, Optional

from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.storage_backend.chunk_format import encode_memory_obj_parts
from lmcache.experimental.storage_backend.storage_manager import StorageManager
from lmcache.logging import init_logger
from lmcache.server.protocol import FrameHeader, Op, ProtocolError, Status, pack_header, send_frame
from lmcache.server.security import client_tls_context, is_loopback, server_tls_context, token_from
from lmcache.server.server import LMCacheServer, ServerConfig
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

P2P_TOKEN_ENV = "LMCACHE_P2P_TOKEN"
HOW_TO_SET = f"{P2P_TOKEN_ENV}=... or p2p_token_file (LMCACHE_P2P_TOKEN_FILE), the same on every instance"
# Peers connect a few connections each; past this the longest-idle one is closed.
MAX_PEER_CONNECTIONS = 64
# The lm:// server's own store stays empty here: the smallest it may be.
_NO_STORE_BYTES = 4096


def p2p_token(config: LMCacheEngineConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The peer servers' token: the file `p2p_token_file` names, else `LMCACHE_P2P_TOKEN`, else None."""
    return token_from(config.p2p_token_file, "p2p_token_file", P2P_TOKEN_ENV, environ)


def p2p_client_tls(config: LMCacheEngineConfig) -> Optional[ssl.SSLContext]:
    """The context a reader dials its peers with: TLS where this instance serves TLS (every
    instance alike), checking the peer's certificate and address against `p2p_tls_ca_file`."""
    if config.p2p_tls_cert_file is None:
        return None
    try:
        return client_tls_context(config.p2p_tls_ca_file)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"p2p_tls_ca_file={config.p2p_tls_ca_file!r}: cannot load it: {err}") from None


def served_address(config: LMCacheEngineConfig, worker_id: int) -> str:
    """Where worker `worker_id` serves: `distributed_url`'s host, its port plus the worker id."""
    assert config.distributed_url is not None  # the config checks it with enable_p2p
    host, _, port = config.distributed_url.rpartition(":")
    return f"{host}:{int(port) + worker_id}"


class PeerServer(LMCacheServer):
    """Serves the local tiers of `storage` at `address` (host:port)."""

    def __init__(self, storage: StorageManager, address: str, token: Optional[bytes], no_auth: bool,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if token is None and not no_auth and not is_loopback(host):
            raise ValueError(
                f"refusing to serve peer-to-peer on {address} (distributed_url) without a token: anyone who "
                f"reaches the port could read every cached chunk. Set {HOW_TO_SET}, or set p2p_no_auth: true "
                "(LMCACHE_P2P_NO_AUTH=true) to insist"
            )
        if tls_cert is not None and tls_key is not None:
            try:
                server_tls_context(tls_cert, tls_key)
            except (OSError, ssl.SSLError) as err:
                raise ValueError(f"p2p_tls_cert_file={tls_cert!r}, p2p_tls_key_file={tls_key!r}: cannot load "
                                 f"them: {err}") from None
        super().__init__(ServerConfig(host=host, port=int(port), max_size_bytes=_NO_STORE_BYTES,
                                      max_connections=MAX_PEER_CONNECTIONS, token=token, no_auth=True,
                                      tls_cert=tls_cert, tls_key=tls_key))
        self._storage = storage
        self._local = storage.local_tier_names

    def _handle(self, conn: socket.socket, header: FrameHeader, deadline: float, session: object = None) -> None:
        if header.op in (Op.PING, Op.INFO):
            super()._handle(conn, header, deadline)
            return
        if header.op not in (Op.GET, Op.EXISTS):
            raise ProtocolError(f"{header.op.name}: a peer server is read-only")
        raw = bytes(self._recv_exact(conn, header.key_len, deadline, "the key"))
        conn.settimeout(self.config.frame_timeout_s)
        try:
            key = CacheEngineKey.from_string(raw.decode("utf-8"))
        except ValueError as err:
            raise ProtocolError(f"{header.op.name} of a key that is not a cache key: {err}") from None
        if header.op == Op.EXISTS:
            send_frame(conn, Op.EXISTS, Status.OK if self._storage.contains(key, self._local) else Status.NOT_FOUND)
            return
        obj = self._storage.get(key, self._local)
        if obj is None:
            send_frame(conn, Op.GET, Status.NOT_FOUND)
            return
        try:
            head, payload = encode_memory_obj_parts(key, obj)
            conn.sendall(pack_header(Op.GET, Status.OK, 0, len(head) + payload.nbytes) + head)
            conn.sendall(payload)
        finally:
            obj.ref_count_down()
