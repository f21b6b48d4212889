"""The node pool, server side: the store's arena shared with clients on the same machine.

`lmcache_server --unix-socket PATH` listens on an owner-only (0600) unix socket beside (or
instead of) TCP; with `--socket-group NAME` the socket is 0660 and belongs to that group, so
clients of other users in it may connect too (`bind_unix_listener`). A client there proves the
token as on `lm://` (`security.py`), then asks `MAP` and receives the arena's memfd once
(SCM_RIGHTS) to map it. From then on values never cross the socket, only the small control
frames of `protocol.py`:

    store:  RESERVE key size -> offset;   client writes the value at offset;   COMMIT key offset
    hit:    LEASE key -> id, offset, len; client reads the value at offset;    RELEASE id

The store keeps the index, LRU order, the memory bound and the leases as for TCP clients, who
see the same entries. What a connection holds is its `PoolSession`'s: a reserved block becomes
visible only at its commit and goes back if the connection closes first, and a leased block is
not reused until its lease is released - by `RELEASE`, or when the connection closes, however
it closes (the kernel closes a killed client's socket). Both are bounded per connection.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from typing import Optional

from lmcache.logging import init_logger
from lmcache.server.pool_address import share_with_group, socket_group_id
from lmcache.server.protocol import (
    ARENA_ID_BYTES,
    MAX_RELEASE_LEASES,
    POOL_WORD,
    Op,
    ProtocolError,
    RefusalReason,
    Status,
    pack_header,
    refusal_payload,
    send_frame,
)
from lmcache.server.store import Lease, LRUChunkStore, Reservation

logger = init_logger(__name__)

# Open reservations and leases one connection may hold (a client's batches are far smaller).
MAX_RESERVATIONS = 256
MAX_LEASES = MAX_RELEASE_LEASES
_LEASE_REPLY = struct.Struct("!QQQ")  # lease id, offset, length
_MAP_REPLY = struct.Struct(f"!{ARENA_ID_BYTES}sQ")  # arena id, arena size
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def bind_unix_listener(path: str, group: Optional[str] = None) -> socket.socket:
    """A listening unix socket at `path`, created owner-only (0600), then, with `group`, given to
    that group as 0660. A socket file left by a server that died is replaced; one another server
    still listens on is an error, and so is any other file at `path`."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.EEXIST, f"cannot bind unix socket {path}: a file that is not a socket is there")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # nobody listens: left by a server that died
            else:
                raise OSError(errno.EADDRINUSE, f"cannot bind unix socket {path}: another server listens there")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # born 0600: no window in which others could connect
    try:
        listener.bind(path)
    except OSError as err:
        listener.close()
        raise OSError(err.errno, f"cannot bind unix socket {path}: {err.strerror}") from err
    finally:
        os.umask(old_mask)
    try:
        if group is None:
            os.chmod(path, 0o600)
        else:  # the group is set before the mode opens, so only it ever gets the extra bits
            share_with_group(path, group, 0o660)
            _warn_if_the_group_cannot_pass(path, group)
    except OSError:
        listener.close()
        os.unlink(path)
        raise
    listener.listen(128)
    return listener


def _warn_if_the_group_cannot_pass(path: str, group: str) -> None:
    """The socket's directory is the operator's: say so when its mode keeps the group out."""
    parent = os.path.dirname(os.path.abspath(path))
    info = os.stat(parent)
    if not (info.st_mode & 0o001 or (info.st_gid == socket_group_id(group) and info.st_mode & 0o010)):
        logger.warning("node pool: group %s cannot pass through %s (mode %o, group %d) to reach the socket; "
                       "give the directory to the group (chgrp, chmod g+x)", group, parent,
                       stat.S_IMODE(info.st_mode), info.st_gid)


def peer_pid(conn: socket.socket) -> int:
    """The connecting process's id (for log lines)."""
    pid, _, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid


class PoolSession:
    """One unix connection's reservations and leases; `close()` gives back whatever is left."""

    def __init__(self, store: LRUChunkStore, arena_id: bytes, max_payload_bytes: int) -> None:
        assert store.arena.fd is not None, "a pool needs the store's arena in shared memory"
        self._store = store
        self._arena_id = arena_id
        self._max_payload = max_payload_bytes
        self._reserved: dict[int, tuple[bytes, Reservation]] = {}  # offset -> (key, block)
        self._leases: dict[int, Lease] = {}
        self._next_lease = 1

    @property
    def holds(self) -> tuple[int, int]:
        """(open reservations, live leases)."""
        return len(self._reserved), len(self._leases)

    def handle(self, conn: socket.socket, op: Op, key: bytes, payload: bytes) -> Optional[RefusalReason]:
        """Answer one pool request; the refusal reason of a refused RESERVE (for the counters).
        A request that makes no sense on this connection is a `ProtocolError`."""
        if op == Op.MAP:
            self._map(conn, payload)
        elif op == Op.RESERVE:
            return self._reserve(conn, key, _word(payload, op))
        elif op == Op.COMMIT:
            self._commit(conn, key, _word(payload, op))
        elif op == Op.LEASE:
            self._lease(conn, key)
        elif op == Op.RELEASE:
            self._release(conn, payload)
        else:
            raise ProtocolError(f"op {op.name} is not a pool op")
        return None

    def close(self) -> None:
        """The connection is gone: uncommitted blocks go back, leases are released."""
        for _, reservation in self._reserved.values():
            self._store.cancel(reservation)
        self._reserved.clear()
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()

    def _map(self, conn: socket.socket, known: bytes) -> None:
        arena = self._store.arena
        frame = pack_header(Op.MAP, Status.OK, 0, _MAP_REPLY.size) + _MAP_REPLY.pack(self._arena_id, arena.capacity)
        if known == self._arena_id:  # mapped already (an earlier connection): no descriptor
            conn.sendall(frame)
            return
        assert arena.fd is not None
        sent = socket.send_fds(conn, [frame], [arena.fd])
        conn.sendall(frame[sent:])

    def _reserve(self, conn: socket.socket, key: bytes, size: int) -> Optional[RefusalReason]:
        reason: Optional[RefusalReason] = None
        reservation = None
        if size > self._max_payload:
            reason = RefusalReason.TOO_LARGE
        elif not self._store.fits(len(key), size):
            reason = RefusalReason.OVER_STORE
        elif len(self._reserved) >= MAX_RESERVATIONS:
            reason = RefusalReason.BUSY
        else:
            reservation = self._store.reserve(size)
            if reservation is None:
                reason = RefusalReason.BUSY
        if reservation is None:
            assert reason is not None
            send_frame(conn, Op.RESERVE, Status.REFUSED, payload=refusal_payload(reason, self._max_payload))
            return reason
        self._reserved[reservation.block] = (key, reservation)
        send_frame(conn, Op.RESERVE, Status.OK, payload=POOL_WORD.pack(reservation.block))
        return None

    def _commit(self, conn: socket.socket, key: bytes, offset: int) -> None:
        held = self._reserved.pop(offset, None)
        if held is None or held[0] != key:
            if held is not None:
                self._reserved[offset] = held
            raise ProtocolError(f"COMMIT of a block this connection did not reserve for that key (offset {offset})")
        ok = self._store.put(key, held[1])  # a refused reservation is given back by the store
        status = Status.OK if ok else Status.REFUSED
        send_frame(conn, Op.COMMIT, status, payload=None if ok else refusal_payload(RefusalReason.BUSY, self._max_payload))

    def _lease(self, conn: socket.socket, key: bytes) -> None:
        if len(self._leases) >= MAX_LEASES:
            send_frame(conn, Op.LEASE, Status.REFUSED, payload=refusal_payload(RefusalReason.BUSY, self._max_payload))
            return
        lease = self._store.get(key)
        if lease is None:
            send_frame(conn, Op.LEASE, Status.NOT_FOUND)
            return
        lease_id = self._next_lease
        self._next_lease += 1
        self._leases[lease_id] = lease
        send_frame(conn, Op.LEASE, Status.OK, payload=_LEASE_REPLY.pack(lease_id, lease.block, lease.view.nbytes))

    def _release(self, conn: socket.socket, payload: bytes) -> None:
        if len(payload) % POOL_WORD.size:
            raise ProtocolError(f"RELEASE payload of {len(payload)} bytes is not a list of lease ids")
        for (lease_id,) in POOL_WORD.iter_unpack(payload):
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise ProtocolError(f"RELEASE of lease {lease_id}, which this connection does not hold")
            lease.release()
        send_frame(conn, Op.RELEASE, Status.OK)


def _word(payload: bytes, op: Op) -> int:
    if len(payload) != POOL_WORD.size:
        raise ProtocolError(f"{op.name} carries {len(payload)} bytes, expected one {POOL_WORD.size}-byte integer")
    return POOL_WORD.unpack(payload)[0]
