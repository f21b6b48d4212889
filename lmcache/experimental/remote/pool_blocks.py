"""Blocks of the node pool's arena held across calls: reserved blocks the copy kernel fills in
place before they are committed, leased blocks it reads in place before they are released.

A reservation or a lease belongs to the connection that made it, so a batch keeps that
connection out of the connector's pool until every block of it is done, then hands it back:

    ReservedBlocks: fill block i in place; commit([i, ...]) (pipelined) or abandon(i)
    LeasedBlocks:   read block i in place; release(i) - one RELEASE frame when the last goes

An abandoned reservation (its chunk was never filled, or its put was dropped) is never committed:
the batch closes its connection instead of handing it back, and the server gives back every
block still uncommitted on it (`lmcache.server.pool`), as it does for a client that was killed.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, List, Optional, Sequence, Tuple

from lmcache.experimental.remote.connector import RemoteUnavailableError
from lmcache.experimental.remote.lm_connector import Exchange, Reply, Request
from lmcache.logging import init_logger
from lmcache.server.protocol import MAX_RELEASE_LEASES, POOL_WORD, Op, ProtocolError, Status

logger = init_logger(__name__)

# Where a block lies: (the arena's id, its offset there). The id changes when the server does, so
# a place names one block of one arena for as long as that server runs.
BlockPlace = Tuple[bytes, int]


class HeldConnection:
    """One connection taken out of the pool: exchanges on it one at a time, then it goes back
    (`give_back`) or is closed."""

    def __init__(self, sock: socket.socket, url: str, timeout: float, max_payload: int,
                 give_back: Callable[[socket.socket], None]) -> None:
        self._sock: Optional[socket.socket] = sock
        self._url = url
        self._timeout = timeout
        self._max_payload = max_payload
        self._give_back = give_back
        self.lock = threading.Lock()  # held by the batch around each exchange and state change

    def run(self, requests: Sequence[Request]) -> List[Reply]:
        """One pipelined exchange; a broken or closed connection is `RemoteUnavailableError`."""
        if self._sock is None:
            raise RemoteUnavailableError(f"{self._url}: the connection holding these blocks was closed")
        try:
            return Exchange(self._sock, self._url, None).run(requests, self._timeout, self._max_payload)
        except (OSError, ProtocolError) as err:
            self.finish(keep=False)
            raise RemoteUnavailableError(f"{self._url}: {err}") from err

    def finish(self, keep: bool) -> None:
        """Hand the connection back to the pool (`keep`) or close it; once."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if keep:
            self._give_back(sock)
        else:
            sock.close()


class ReservedBlocks:
    """The blocks one RESERVE exchange got: `blocks[i]` is None where the server refused."""

    def __init__(self, held: HeldConnection, arena_id: bytes, keys: Sequence[bytes],
                 offsets: Sequence[Optional[int]], blocks: Sequence[Optional[memoryview]]) -> None:
        self._held = held
        self._arena_id = arena_id
        self._keys = list(keys)
        self._offsets = list(offsets)
        self.blocks = list(blocks)
        self._open = {i for i, offset in enumerate(offsets) if offset is not None}
        self._abandoned = False
        if not self._open:
            held.finish(keep=True)

    def commit(self, indexes: Sequence[int]) -> List[bool]:
        """Publish these filled blocks (one pipelined exchange); whether the server took each.
        Raises `RemoteUnavailableError` when the connection broke (nothing more is published)."""
        with self._held.lock:
            todo = [i for i in indexes if i in self._open]
            self._open.difference_update(todo)
            try:
                commits = [Request(Op.COMMIT, self._keys[i], POOL_WORD.pack(self._offsets[i])) for i in todo]
                replies = self._held.run(commits) if commits else []
            finally:
                self._finish_if_done()
        ok = {i: reply.status == Status.OK for i, reply in zip(todo, replies)}
        return [ok.get(i, False) for i in indexes]

    def place(self, index: int) -> Optional[BlockPlace]:
        """Where block `index` lies (None where the server refused it)."""
        offset = self._offsets[index]
        return None if offset is None else (self._arena_id, offset)

    def abandon(self, index: int) -> None:
        """Never publish block `index` (a no-op once it was committed)."""
        with self._held.lock:
            if index in self._open:
                self._open.discard(index)
                self._abandoned = True
                self._finish_if_done()

    def _finish_if_done(self) -> None:
        if not self._open:
            self._held.finish(keep=not self._abandoned)


class LeasedBlocks:
    """The blocks one LEASE exchange got: `blocks[i]` is None for a miss."""

    def __init__(self, held: HeldConnection, lease_ids: Sequence[Optional[int]],
                 blocks: Sequence[Optional[memoryview]], places: Sequence[Optional[BlockPlace]],
                 on_done: Optional[Callable[[], None]] = None) -> None:
        """`places[i]`: where `blocks[i]` lies. `on_done` runs once, when the batch has given
        its connection back (or lost it)."""
        self._held = held
        self._ids = list(lease_ids)
        self.blocks = list(blocks)
        self.places = list(places)
        self._on_done = on_done
        self._live = {i for i, lease in enumerate(lease_ids) if lease is not None}
        if not self._live:
            held.finish(keep=True)
            self._done()

    def _done(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()

    def release(self, index: int) -> None:
        """Done reading block `index`; when it was the last, every lease goes in one RELEASE.
        Never raises: a connection that broke took its leases with it."""
        with self._held.lock:
            if index not in self._live:
                return
            self._live.discard(index)
            if self._live:
                return
            ids = [POOL_WORD.pack(lease) for lease in self._ids if lease is not None]
            try:
                self._held.run([Request(Op.RELEASE, payload=b"".join(ids[i : i + MAX_RELEASE_LEASES]))
                                for i in range(0, len(ids), MAX_RELEASE_LEASES)])
                self._held.finish(keep=True)
            except RemoteUnavailableError as err:
                logger.debug("releasing %d leases: %s (the server released them with the connection)", len(ids), err)
            finally:
                self._done()
