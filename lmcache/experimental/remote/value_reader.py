"""One fetched value as it comes off a connection: read in order, straight into the reader's memory.

A connector hands whoever receives a value a `ValueReader` of exactly the value's length
instead of a buffer it allocated, so a serde can read the chunk header, allocate the memory
object, and `readinto` the payload where it will live. (Issue 18: a fresh buffer per get paid
the first touch of memory new to the process - ~0.13 GB/s in this VM - and then a second copy
into the object.) Whatever the receiver leaves unread, the connector drains, so a rejected
chunk costs its bytes but never the connection's framing.

A connection that breaks or times out in the middle of a value raises
`RemoteUnavailableError`: receivers must let it through (the tier goes down), whatever else
they turn into a miss.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod

from lmcache.experimental.remote.connector import Buffer, RemoteUnavailableError
from lmcache.experimental.storage_backend.chunk_format import HASH_PIECE

_DRAIN_BLOCK = 1 << 20


class ValueReader(ABC):
    """The `size` bytes of one value, read front to back exactly once."""

    # Bytes a receiver asks for per `readinto`: a piece just read is hashed while in cache.
    fill_piece = HASH_PIECE

    def __init__(self, size: int) -> None:
        self.size = size
        self._left = size

    @property
    def remaining(self) -> int:
        """Bytes of the value not read yet."""
        return self._left

    def readinto(self, view: memoryview) -> None:
        """Fill `view` with the next `len(view)` bytes; a ValueError if the value ends first."""
        view = view.cast("B") if view.format != "B" else view
        if view.nbytes > self._left:
            raise ValueError(f"asked for {view.nbytes} bytes, the value has {self._left} left")
        got = 0
        while got < view.nbytes:
            n = self._fill(view[got:])
            got += n
            self._left -= n

    def read(self, n: int) -> bytearray:
        """Up to `n` next bytes (fewer only where the value ends), like a file's `read`."""
        buf = bytearray(min(n, self._left))
        self.readinto(memoryview(buf))
        return buf

    def drain(self) -> None:
        """Skip what is left of the value."""
        if not self._left:
            return
        scratch = memoryview(bytearray(min(self._left, _DRAIN_BLOCK)))
        while self._left:
            self.readinto(scratch[: min(self._left, scratch.nbytes)])

    @abstractmethod
    def _fill(self, view: memoryview) -> int:
        """Read at least one byte into `view`; the number read."""


class BufferReader(ValueReader):
    """A value already in memory (connectors whose client library hands back whole values)."""

    def __init__(self, data: Buffer) -> None:
        self._view = memoryview(data).cast("B")
        super().__init__(self._view.nbytes)

    def _fill(self, view: memoryview) -> int:
        start = self.size - self._left
        view[:] = self._view[start : start + view.nbytes]
        return view.nbytes


class SocketReader(ValueReader):
    """The next `size` bytes of a socket whose timeout the connector set."""

    def __init__(self, sock: socket.socket, size: int, where: str) -> None:
        super().__init__(size)
        self._sock = sock
        self._where = where

    def _fill(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view, view.nbytes)
        except OSError as err:  # a timeout is one too
            raise RemoteUnavailableError(f"{self._where}: {err or type(err).__name__} inside a value") from err
        if n == 0:
            raise RemoteUnavailableError(
                f"{self._where} closed the connection after {self.size - self._left} of {self.size} bytes of a value"
            )
        return n
