"""What every remote store looks like to the remote tier: bytes in, bytes out, keyed by strings.

A connector knows one kind of server (`lm://`, Redis, Redis Cluster) and nothing about KV
caches; the serde turns memory objects into the bytes it moves, and the remote backend adds
the asynchrony, health tracking and backoff.

Errors split in two on purpose:
- a store that answered but would not keep a value (too large, out of memory) is a normal
  outcome: `put` returns False and the caller counts a dropped put;
- a store that could not be reached or did not answer in time raises `RemoteUnavailableError`,
  which the backend turns into "tier down, everything is a miss until it comes back".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    from lmcache.experimental.remote.value_reader import ValueReader

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class Parts:
    """A value stored as its buffers one after the other, sent without joining them where the
    protocol allows (`lm://`): joining a chunk's header and payload copies megabytes while
    holding the GIL, which the put thread - at idle priority, so possibly preempted meanwhile -
    would take from the model's Python thread."""

    buffers: Tuple[Buffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)

    def joined(self) -> bytes:
        return b"".join(self.buffers)


# What a put stores: one buffer, or parts.
Value = Union[Buffer, Parts]


def value_nbytes(value: Value) -> int:
    return value.nbytes if isinstance(value, Parts) else memoryview(value).nbytes


def value_buffers(value: Value) -> Tuple[Buffer, ...]:
    return value.buffers if isinstance(value, Parts) else (value,)


# Called with (index in the keys, the value) for every key found, in order (`batched_get_into`).
Receive = Callable[[int, "ValueReader"], None]


class RemoteUnavailableError(ConnectionError):
    """The remote store could not be reached or did not answer in time."""


class RemoteAuthError(RemoteUnavailableError):
    """The remote store refused our credentials or TLS (or could not prove it is the one we
    trust): to the tier it is down - every lookup a miss, never data - and probed with backoff."""


class RemoteConnector(ABC):
    """A byte store behind a network connection; safe to call from several threads."""

    def exists(self, key: str) -> bool:
        """Whether `key` is stored now."""
        return self.batched_exists([key])[0]

    def get(self, key: str) -> Optional[Buffer]:
        """The value under `key`, or None if absent."""
        return self.batched_get([key])[0]

    def put(self, key: str, value: Value) -> bool:
        """Store `value`; True once the server acknowledged it, False if it refused it."""
        return self.batched_put([(key, value)])[0]

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; True when something was removed."""

    @abstractmethod
    def batched_exists(self, keys: Sequence[str]) -> list[bool]:
        """`exists` for many keys in one round trip (or one pipeline)."""

    @abstractmethod
    def batched_get(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        """`get` for many keys, pipelined; results in the order of `keys`."""

    def batched_get_into(self, keys: Sequence[str], receive: Receive) -> None:
        """`batched_get`, but each found value goes to `receive` as it arrives, which reads it
        where it wants it (no buffer per value where the connector can help it). What `receive`
        leaves unread is skipped. A connection lost midway raises `RemoteUnavailableError`
        after the values already handed over."""
        from lmcache.experimental.remote.value_reader import BufferReader

        for i, value in enumerate(self.batched_get(keys)):
            if value is not None:
                receive(i, BufferReader(value))

    @abstractmethod
    def batched_put(self, items: Sequence[Tuple[str, Value]]) -> list[bool]:
        """`put` for many values, pipelined; one acknowledgement per item, in order."""

    @abstractmethod
    def ping(self) -> None:
        """Raise `RemoteUnavailableError` unless the server answers now."""

    @abstractmethod
    def close(self) -> None:
        """Close every pooled connection; the connector must not be used afterwards."""

    @property
    @abstractmethod
    def url(self) -> str:
        """Where this connector points, for log lines (no credentials)."""
