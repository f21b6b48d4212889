"""The peer-to-peer tier: chunks other instances hold, found in the lookup records and read from
their peer servers (`lmcache/experimental/p2p/`).

- `batched_contains` (what a lookup asks, for the keys no faster tier has) is one Redis round
  trip for all keys (`LookupRecords.holders`, which also drops stale records); the holders it
  found are remembered for `HOLDER_AGE_S`, so the read that follows asks Redis nothing.
- `batched_get_blocking` (what a pinned lookup and a retrieve read) groups the keys by peer and
  reads each peer's chunks in one pipelined exchange, each chunk straight into a CPU-tier object
  and checked on the way (`NaiveSerde.receive`: header, key, dtype, payload checksum).
- Every failure is a miss, never an error: no record, Redis down, a peer unreachable or stalled
  (which then holds nothing for `PEER_DOWN_S`, lookups included; its records go stale with its
  live key), no memory to read into, a chunk the peer no longer has, or one that fails its checks
  (those two have the peer's record deleted, if it still names that peer's run).
- It writes nothing: records are the recorder's job (`p2p/recorder.py`), from the holdings of
  the local tiers; a hit is promoted into the CPU tier by the storage manager like any other.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections import OrderedDict, defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.p2p.records import Holder, LookupDown, LookupRecords
from lmcache.experimental.remote.connector import RemoteAuthError, RemoteUnavailableError
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.remote.serde.base import AllocateFn
from lmcache.experimental.remote.serde.naive import NaiveSerde
from lmcache.experimental.remote.value_reader import ValueReader
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites, StorageBackendInterface
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# Holders a lookup found, kept for the read right after it (and no longer: records change).
HOLDER_AGE_S = 2.0
MAX_REMEMBERED = 4096
# Connections to peers: connectors kept (least recently used closed first), and per connector.
MAX_PEERS = 16
PEER_POOL_SIZE = 2
# A peer that failed is not asked again for this long.
PEER_DOWN_S = 5.0
CONNECT_TIMEOUT_S = 1.0
# The longest a peer may stall (each socket read, not a whole transfer, which may take longer on
# a slow link): a pinned lookup waits on it, and a stalled peer must cost a request little.
READ_TIMEOUT_S = 2.0


class P2PBackend(StorageBackendInterface):
    """Reads chunks from other instances' peer servers; `own_url` is this instance's, never asked."""

    reads_ahead = True

    def __init__(
        self,
        records: LookupRecords,
        own_url: str,
        cpu: LocalCPUBackend,
        dtype: torch.dtype,
        stats: Optional[TierStats] = None,
        token: Optional[bytes] = None,
        tls: Optional[ssl.SSLContext] = None,
    ) -> None:
        """`token`: the peer servers' shared secret; `tls`: the context peers are dialled with
        (None: plaintext), as every instance's peer server speaks it."""
        self._records = records
        self._own_url = own_url
        self._cpu = cpu
        self._dtype = dtype
        self._stats = stats if stats is not None else TierStats()
        self._token = None if token is None else token.decode("utf-8")
        self._tls = tls
        self._serde = NaiveSerde()
        self._lock = threading.Lock()
        self._remembered: "OrderedDict[CacheEngineKey, Tuple[Holder, float]]" = OrderedDict()
        self._peers: "OrderedDict[str, LMServerConnector]" = OrderedDict()
        self._down_until: Dict[str, float] = {}

    # ---- lookups ---------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> List[bool]:
        return [holder is not None for holder in self._holders(keys)]

    def contains_locally(self, key: CacheEngineKey) -> bool:
        return False  # a store never skips a chunk because a peer has it

    def _holders(self, keys: Sequence[CacheEngineKey]) -> List[Optional[Holder]]:
        """Each key's holder (None: a miss), remembered ones first, the rest from Redis; a peer
        that failed lately holds nothing (a lookup must not promise what it cannot read)."""
        now = time.monotonic()
        found: List[Optional[Holder]] = [None] * len(keys)
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._remembered.get(key)
                if entry is not None and now - entry[1] < HOLDER_AGE_S:
                    found[i] = entry[0]
        ask = [i for i, holder in enumerate(found) if holder is None]
        try:
            answers = self._records.holders([keys[i] for i in ask], other_than=self._own_url) if ask else []
        except LookupDown:
            answers = [None] * len(ask)
        with self._lock:
            for i, holder in zip(ask, answers):
                if holder is None:
                    continue
                found[i] = holder
                self._remembered[keys[i]] = (holder, now)
                self._remembered.move_to_end(keys[i])
            while len(self._remembered) > MAX_REMEMBERED:
                self._remembered.popitem(last=False)
            return [h if h is not None and self._down_until.get(h.url, 0.0) <= now else None for h in found]

    # ---- reads -----------------------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Each peer's chunks in one pipelined exchange; the caller owns one reference of each."""
        holders = self._holders(keys)
        with self._lock:
            for key in keys:
                self._remembered.pop(key, None)
        by_peer: Dict[str, List[int]] = defaultdict(list)
        for i, holder in enumerate(holders):
            if holder is not None:
                by_peer[holder.url].append(i)
        results: List[Optional[MemoryObj]] = [None] * len(keys)
        stale: List[int] = []
        for url, slots in by_peer.items():
            answered = self._read_peer(url, [keys[i] for i in slots])
            if answered is None:
                continue  # the peer is unreachable: its records go stale with its live key
            objs, no_memory = answered
            for n, (i, obj) in enumerate(zip(slots, objs)):
                results[i] = obj
                if obj is None and n not in no_memory:  # our memory being full says nothing of the peer
                    stale.append(i)
        if stale:
            try:
                self._records.forget([keys[i] for i in stale], [holders[i] for i in stale])  # type: ignore[misc]
            except LookupDown:
                pass
        return results

    def _read_peer(
        self, url: str, keys: Sequence[CacheEngineKey]
    ) -> Optional[Tuple[List[Optional[MemoryObj]], Set[int]]]:
        """The chunks from the peer at `url` (None where it answered a miss, sent a bad chunk, or
        this instance had no memory to read it into: those indexes come in the set), or None
        when the peer could not be read at all."""
        got: List[Optional[MemoryObj]] = [None] * len(keys)
        no_memory: Set[int] = set()

        def receive(n: int, reader: ValueReader) -> None:
            def allocate(shape: torch.Size, dtype: Optional[torch.dtype], fmt: MemoryFormat) -> Optional[MemoryObj]:
                obj = self._cpu.allocate(shape, dtype, fmt)
                if obj is None:
                    no_memory.add(n)
                return obj

            got[n] = obj = self._decode(keys[n], reader, allocate)
            if obj is not None:
                self._stats.record_read(obj.get_size())
            elif n not in no_memory:
                self._stats.record_rejected()

        try:
            self._peer(url).batched_get_into([key.to_string() for key in keys], receive)
        except RemoteUnavailableError as err:
            self._peer_failed(url, err)
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()
            return None
        return got, no_memory

    def _decode(self, key: CacheEngineKey, reader: ValueReader, allocate: AllocateFn) -> Optional[MemoryObj]:
        try:
            return self._serde.receive(key, reader, allocate, dtype=self._dtype)
        except RemoteUnavailableError:
            raise  # the connection broke: the peer failed, not this chunk
        except Exception as err:  # a chunk we cannot read is a miss, whatever went wrong
            logger.warning("peer chunk %s could not be decoded: %r", key.chunk_hash, err)
            return None

    def _peer(self, url: str) -> LMServerConnector:
        with self._lock:
            connector = self._peers.get(url)
            if connector is not None:
                self._peers.move_to_end(url)
                return connector
            host, _, port = url.rpartition(":")
            connector = LMServerConnector(host.strip("[]"), int(port), timeout=READ_TIMEOUT_S,
                                          lookup_timeout=CONNECT_TIMEOUT_S, pool_size=PEER_POOL_SIZE,
                                          token=self._token, tls=self._tls)
            self._peers[url] = connector
            evicted = self._peers.popitem(last=False)[1] if len(self._peers) > MAX_PEERS else None
        if evicted is not None:
            evicted.close()
        return connector

    def _peer_failed(self, url: str, err: RemoteUnavailableError) -> None:
        now = time.monotonic()
        with self._lock:
            first = self._down_until.get(url, 0.0) <= now
            self._down_until = {u: t for u, t in self._down_until.items() if t > now}
            self._down_until[url] = now + PEER_DOWN_S
        self._stats.record_error()
        if isinstance(err, RemoteAuthError):
            self._stats.record_auth_refusal()
        if first:
            logger.warning("peer %s could not be read (%s): its chunks are misses for %.0f s", url, err, PEER_DOWN_S)

    # ---- writes: none ----------------------------------------------------------------------

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Nothing to write: the recorder records what the local tiers admit."""

    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey) -> bool:
        return False  # a peer's chunk is the peer's

    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        with self._lock:
            peers, self._peers = list(self._peers.values()), OrderedDict()
        for connector in peers:
            connector.close()
        self._records.close()
        return ClosedWrites()
