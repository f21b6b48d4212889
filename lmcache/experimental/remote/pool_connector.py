"""Client of the node pool (`lm+shm:///PATH`): an `lm://` server's arena, mapped into this process.

The server (`lmcache.server.pool`) listens on a unix socket and hands every new client its
arena's memfd once; values are then written and read in place, and only small control frames
cross the socket, pipelined as on `lm://` in windows of `PIPELINE_WINDOW` values (so one
connection holds at most that many reservations or leases):

    put:  RESERVE each value -> offsets; copy each value into its block; COMMIT each
    get:  LEASE each key -> (lease, offset, length); the serde reads each value from the
          mapping into its memory object (checksum checked); RELEASE the leases

The remote tier can also hold blocks across calls (`reserve`, `lease`: `pool_blocks.py`), so the
copy kernel writes a stored chunk straight into its block and reads a hit straight out of it.

A value is visible to others only after its commit, and a leased block is not reused before its
release, so a reader never sees half a value or another value's bytes; the chunk's own checksum
still checks every read (a corrupt or foreign value is a miss). Leases live for one exchange on
one connection; a connection that breaks takes its leases and uncommitted blocks with it (the
server frees them when it sees the socket close).

Each connection knows the arena it was given (`PoolSocket.arena`): a restarted server has a new
arena (its id differs), which the first new connection maps; the old mapping goes away with the
last connection that used it.

A fresh mapping faults on the first touch of each 4 KiB page (shared memory gets no huge pages
here), and on a fresh arena each fault also allocates and zeroes the page: the first stores into a
new pool ran at 0.19-0.22x memcpy. So a connector maps the arena as it is created (a server not up
yet is mapped by the first call instead) and each new mapping is faulted in, front first, on a background thread
(`PoolArena.prefault_in_background`), while vLLM is still starting. Everything else - the pool of connections, the retry of a broken
pooled connection, the token handshake, frame limits, `RemoteAuthError` - is `lm_connector`'s.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading
from typing import Callable, Optional, Sequence, Tuple

import numpy

from lmcache import page_advice
from lmcache.experimental.config import POOL_SCHEME, RemoteUrl
from lmcache.experimental.remote.connector import (
    Buffer,
    Receive,
    RemoteAuthError,
    RemoteUnavailableError,
    Value,
    value_buffers,
    value_nbytes,
)
from lmcache.experimental.remote.lm_connector import (
    PIPELINE_WINDOW,
    Exchange,
    LMServerConnector,
    Request,
    key_bytes,
    open_session,
)
from lmcache.experimental.remote.pool_blocks import BlockPlace, HeldConnection, LeasedBlocks, ReservedBlocks
from lmcache.experimental.remote.value_reader import BufferReader, ValueReader
from lmcache.logging import init_logger
from lmcache.server.pool import MAX_LEASES, MAX_RESERVATIONS
from lmcache.server.security import AUTH_REQUIRED
from lmcache.server.protocol import (
    ARENA_ID_BYTES,
    HEADER_SIZE,
    POOL_WORD,
    Op,
    ProtocolError,
    Status,
    parse_header,
    recv_exact,
    send_frame,
)

logger = init_logger(__name__)

GB = 1 << 30
_MAP_REPLY = struct.Struct(f"!{ARENA_ID_BYTES}sQ")
_LEASE_REPLY = struct.Struct("!QQQ")
# The longest answer MAP may get (an error's reason included).
_MAX_REPLY = 4096


class PoolArena:
    """One server's arena as mapped here, checked before it is touched: sealed against shrinking
    (so no access can ever fault past its end) and as large as the server says."""

    def __init__(self, fd: int, size: int, arena_id: bytes) -> None:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ProtocolError("the pool's arena is not sealed against shrinking: refusing to map it")
        if os.fstat(fd).st_size < size:
            raise ProtocolError(f"the pool's arena has {os.fstat(fd).st_size} bytes, the server announced {size}")
        self.id = arena_id
        self.size = size
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self._array = numpy.frombuffer(self._map, dtype=numpy.uint8)

    def prefault_in_background(self) -> None:
        """Fault the whole mapping in, front first (the server hands out blocks from the front),
        without changing a byte, on a background thread that ends with the mapping."""
        def done(faulted: bool, seconds: float) -> None:
            logger.info("pool arena %s: %.2f GiB mapped and faulted in here in %.2f s (%.2f s/GiB)%s",
                        self.id.hex()[:8], self.size / GB, seconds, seconds / max(self.size / GB, 1e-9),
                        "" if faulted else "; refused by the kernel (< 5.14?): pages fault on first use")

        page_advice.BackgroundPrefault(self._array.ctypes.data, self.size, "lmcache-pool-prefault",
                                       owner=self._map, on_end=done).start()

    def block(self, offset: int, length: int) -> memoryview:
        """The bytes at `offset`; a `ProtocolError` if they are not all inside the arena."""
        if offset + length > self.size:
            raise ProtocolError(f"block [{offset}, {offset + length}) is outside the {self.size}-byte arena")
        return memoryview(self._array[offset : offset + length])

    def write(self, offset: int, value: Value) -> None:
        """Copy `value`'s buffers one after the other into the block at `offset` (numpy lets the
        GIL go while it copies: the model thread keeps running)."""
        target = self._array[offset : offset + value_nbytes(value)]
        if target.nbytes != value_nbytes(value):
            raise ProtocolError(f"block at {offset} for {value_nbytes(value)} bytes is outside the {self.size}-byte arena")
        pos = 0
        for part in value_buffers(value):
            view = memoryview(part).cast("B")
            numpy.copyto(target[pos : pos + view.nbytes], numpy.frombuffer(view, dtype=numpy.uint8))
            pos += view.nbytes


class PoolSocket(socket.socket):
    """A connection to the pool and the arena it was given."""

    arena: PoolArena


def map_arena(sock: socket.socket, known: Optional[PoolArena]) -> PoolArena:
    """Ask `MAP` on a fresh connection: `known` if the server still has that arena, else the
    arena whose descriptor came along, mapped (the descriptor itself is closed again)."""
    send_frame(sock, Op.MAP, payload=known.id if known is not None else None)
    data, fds, _, _ = socket.recv_fds(sock, HEADER_SIZE, 1)
    try:
        if not data:
            raise ProtocolError("the pool closed the connection before answering MAP")
        raw = bytes(data) + bytes(recv_exact(sock, HEADER_SIZE - len(data), "a MAP reply header"))
        header = parse_header(raw, _MAX_REPLY, is_request=False)
        payload = bytes(recv_exact(sock, header.payload_len, "a MAP reply"))
        if header.op == Op.ERROR and payload == AUTH_REQUIRED.encode():
            raise RemoteAuthError(AUTH_REQUIRED)
        if header.op != Op.MAP or header.status != Status.OK or len(payload) != _MAP_REPLY.size:
            raise ProtocolError(f"MAP answered {header.op.name} {header.status.name}: {payload[:200]!r}")
        arena_id, size = _MAP_REPLY.unpack(payload)
        if known is not None and arena_id == known.id:
            return known
        if len(fds) != 1:
            raise ProtocolError("the pool announced a new arena but sent no descriptor for it")
        arena = PoolArena(fds[0], size, arena_id)
        arena.prefault_in_background()
        return arena
    finally:
        for fd in fds:
            os.close(fd)


class PoolConnector(LMServerConnector):
    """`lm+shm:///PATH`: values written and read in the server's arena, in place."""

    def __init__(
        self,
        path: str,
        timeout: float = 10.0,
        lookup_timeout: float = 1.0,
        pool_size: int = 4,
        token: Optional[str] = None,
        **limits: int,
    ) -> None:
        # The TCP address is never dialled: `_dial` below connects to the unix socket instead.
        super().__init__("localhost", 0, timeout, lookup_timeout, pool_size, token=token, **limits)
        self._path = path
        self._url = RemoteUrl(POOL_SCHEME, (), password=token, socket=path).display()
        self._arena: Optional[PoolArena] = None  # the newest arena mapped
        self._arena_lock = threading.Lock()
        self._map_early()

    def _map_early(self) -> None:
        """Map the arena now (one idle connection, a local connect: a millisecond), so it is
        faulted in while vLLM starts; a server not up yet is mapped by the first call instead."""
        try:
            sock, _ = self._pool.acquire()
        except RemoteUnavailableError as err:
            logger.debug("node pool %s not mapped at start: %s", self.url, err)
            return
        self._pool.release(sock)

    def _dial(self) -> socket.socket:
        sock = PoolSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._lookup_timeout)
        try:
            sock.connect(self._path)
        except OSError as err:
            sock.close()
            raise RemoteUnavailableError(f"cannot connect to {self.url}: {err}") from err
        open_session(sock, self._path, self._secret)
        try:
            with self._arena_lock:
                sock.arena = self._arena = map_arena(sock, self._arena)
        except RemoteAuthError:
            sock.close()
            raise
        except (OSError, ProtocolError) as err:
            sock.close()
            raise RemoteUnavailableError(f"cannot map the pool's arena at {self.url}: {err}") from err
        return sock

    def batched_get(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        values: list[Optional[Buffer]] = [None] * len(keys)

        def keep(i: int, reader: ValueReader) -> None:
            values[i] = reader.read(reader.remaining)

        self.batched_get_into(keys, keep)
        return values

    def batched_get_into(self, keys: Sequence[str], receive: Receive) -> None:
        """Lease a window of keys, hand each found value to `receive` as a reader of its block,
        release the window's leases; next window."""
        if not keys:
            return
        handed = 0

        def work(sock: socket.socket) -> None:
            nonlocal handed
            assert isinstance(sock, PoolSocket)
            exchange = Exchange(sock, self.url, None)
            for start in range(0, len(keys), PIPELINE_WINDOW):
                window = [Request(Op.LEASE, key_bytes(k)) for k in keys[start : start + PIPELINE_WINDOW]]
                leases: list[bytes] = []
                for i, reply in enumerate(exchange.run(window, self._timeout, self._max_payload), start):
                    if reply.status != Status.OK:
                        continue  # NOT_FOUND, or REFUSED (this connection holds its most): a miss
                    lease_id, offset, length = _LEASE_REPLY.unpack(bytes(reply.payload or b""))
                    leases.append(POOL_WORD.pack(lease_id))
                    block = sock.arena.block(offset, length)
                    handed += 1
                    receive(i, BufferReader(block))
                if leases:
                    exchange.run([Request(Op.RELEASE, payload=b"".join(leases))], self._timeout, self._max_payload)

        self._on_connection(work, self._timeout, lambda: handed > 0)

    def reserve(self, items: Sequence[Tuple[str, int]]) -> ReservedBlocks:
        """Reserve a block of each (key, size) in one pipelined exchange, for the caller to fill
        in place and commit (`pool_blocks`). A block the server refuses (pool full, too large,
        too many open reservations) is None: the caller stores that value another way."""
        slots = self._slots_within_limit(items)
        if len(slots) > MAX_RESERVATIONS:
            slots = slots[:MAX_RESERVATIONS]
        keys = [key_bytes(key) for key, _ in items]

        def work(sock: socket.socket) -> ReservedBlocks:
            assert isinstance(sock, PoolSocket)
            held = HeldConnection(sock, self.url, self._timeout, self._max_payload, self._pool.release)
            offsets: list[Optional[int]] = [None] * len(items)
            blocks: list[Optional[memoryview]] = [None] * len(items)
            requests = [Request(Op.RESERVE, keys[i], POOL_WORD.pack(items[i][1])) for i in slots]
            try:
                for i, reply in zip(slots, Exchange(sock, self.url, None).run(requests, self._timeout, self._max_payload)):
                    if reply.status != Status.OK:
                        self._note_refusal(reply.payload)
                        continue
                    (offset,) = POOL_WORD.unpack(bytes(reply.payload or b""))
                    offsets[i], blocks[i] = offset, sock.arena.block(offset, items[i][1])
            except BaseException:
                held.finish(keep=False)  # whatever it reserved goes back with it
                raise
            return ReservedBlocks(held, sock.arena.id, keys, offsets, blocks)

        return self._on_connection(work, self._timeout, lambda: False, keep=True)

    def lease(self, keys: Sequence[str], on_done: Optional[Callable[[], None]] = None) -> LeasedBlocks:
        """Lease each key's block in one pipelined exchange, for the caller to read in place and
        release (`pool_blocks`); a missing key (or one over this connection's leases) is None.
        `on_done`: `LeasedBlocks`'."""
        requests = [Request(Op.LEASE, key_bytes(k)) for k in keys[:MAX_LEASES]]

        def work(sock: socket.socket) -> LeasedBlocks:
            assert isinstance(sock, PoolSocket)
            held = HeldConnection(sock, self.url, self._timeout, self._max_payload, self._pool.release)
            ids: list[Optional[int]] = [None] * len(keys)
            blocks: list[Optional[memoryview]] = [None] * len(keys)
            places: list[Optional[BlockPlace]] = [None] * len(keys)
            try:
                for i, reply in enumerate(Exchange(sock, self.url, None).run(requests, self._timeout, self._max_payload)):
                    if reply.status == Status.OK:
                        ids[i], offset, length = _LEASE_REPLY.unpack(bytes(reply.payload or b""))
                        blocks[i] = sock.arena.block(offset, length)
                        places[i] = (sock.arena.id, offset)
            except BaseException:
                held.finish(keep=False)  # its leases go with it
                raise
            return LeasedBlocks(held, ids, blocks, places, on_done)

        return self._on_connection(work, self._timeout, lambda: False, keep=True)

    def batched_put(self, items: Sequence[Tuple[str, Value]]) -> list[bool]:
        """Reserve a block per value of a window, copy each value in, commit them; next window.
        One copy per value, no socket payload."""
        results: list[bool] = [False] * len(items)
        if not items:
            return results
        slots = self._slots_within_limit([(key, value_nbytes(value)) for key, value in items])

        def work(sock: socket.socket) -> None:
            assert isinstance(sock, PoolSocket)
            exchange = Exchange(sock, self.url, None)
            for start in range(0, len(slots), PIPELINE_WINDOW):
                window = slots[start : start + PIPELINE_WINDOW]
                reserve = [Request(Op.RESERVE, key_bytes(items[i][0]), POOL_WORD.pack(value_nbytes(items[i][1]))) for i in window]
                commits: list[Request] = []
                committed: list[int] = []
                for slot, reply in zip(window, exchange.run(reserve, self._timeout, self._max_payload)):
                    if reply.status != Status.OK:
                        self._note_refusal(reply.payload)
                        continue
                    (offset,) = POOL_WORD.unpack(bytes(reply.payload or b""))
                    sock.arena.write(offset, items[slot][1])
                    commits.append(Request(Op.COMMIT, key_bytes(items[slot][0]), POOL_WORD.pack(offset)))
                    committed.append(slot)
                for slot, reply in zip(committed, exchange.run(commits, self._timeout, self._max_payload)):
                    results[slot] = reply.status == Status.OK

        if slots:
            self._on_connection(work, self._timeout, lambda: False)
        return results
