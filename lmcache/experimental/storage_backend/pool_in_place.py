"""The node pool's one-copy data path (issue 31): a chunk's memory object is its block in the
pool's arena, so the copy kernel is the only thing that moves its bytes, once each way.

    store:    reserve (one exchange per store) -> the kernel writes the payload into the block,
              behind room for the header, and sums it as it writes (`payload_checksum`) -> the
              put thread writes the header in front of it and commits (one exchange per put
              batch); a payload the kernel did not sum is hashed in place first
    retrieve: lease (one exchange) -> the header and, unless this process knows the commit, the
              payload checksum are checked in place (a mismatch is a miss) -> the kernel reads the
              payload out of the block -> the object's last reference releases the lease (one
              RELEASE when the last goes)
    pin:      a lookup's pins lease the same way and hold the leases until the load (at most
              `MAX_HELD_BATCHES` lookups at once, each keeping a connection; more copy instead)

    block:  | chunk_format header | payload (what the kernel writes or reads) |

Only the `naive` chunk format is written and read this way: its payload is the object's bytes.
A reserved object dropped before its commit is never published (`pool_blocks.ReservedBlocks`).

A committed block is never written again until the server gives it back, so a process checks a
commit's payload once: at its commit (it hashed those bytes itself) or at its first lease here
(`KnownCommits`); later leases of the same block under the same header check the header only.
Hashing the payload on every lease read it from memory twice per hit (check, then copy), the
whole gap between a pool hit and a private CPU tier's. From then on the block is trusted as a
private tier's memory is: a later stray write into it is not caught.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from lmcache.experimental.memory_management import BorrowedMemoryObj, MemoryFormat, MemoryObj, MemoryObjMetadata
from lmcache.experimental.memory_management.objects import payload_size
from lmcache.experimental.remote.connector import RemoteUnavailableError
from lmcache.experimental.remote.pool_blocks import BlockPlace, LeasedBlocks, ReservedBlocks
from lmcache.experimental.remote.pool_connector import PoolConnector
from lmcache.experimental.storage_backend import chunk_format
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# Lease batches a lookup's pins may hold at once: each keeps a connection to the pool until its
# request loads (the connector keeps 4 idle). Pins beyond them copy out of the pool as before.
MAX_HELD_BATCHES = 4

# Commits a process remembers as checked (about 100 bytes each): more than an arena's chunks.
MAX_KNOWN_COMMITS = 1 << 15


@dataclass(frozen=True)
class _Reservation:
    """Where a reserved object's chunk goes: block `index` of `blocks`, header first."""

    blocks: ReservedBlocks
    index: int
    key: str
    header_len: int


@dataclass(frozen=True)
class LeaseOutcome:
    """What a `lease` found: `objs[i]` for `keys[i]` (None: missing, or rejected by the checks)."""

    objs: List[Optional[MemoryObj]]
    rejected: int  # found, but the header or the checksum was wrong: a miss
    hashed: int  # of the objects, those whose payload was hashed (the others' commits were known)


class KnownCommits:
    """Blocks whose payload this process has checked (or written and hashed) under a header:
    (place, block length, header bytes), the `MAX_KNOWN_COMMITS` most recently used. A block
    given back and filled again is known again only under the same header and length (the same
    key and checksum: a chunk written whole by a writer that hashed it)."""

    def __init__(self, capacity: int = MAX_KNOWN_COMMITS) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._known: "OrderedDict[Tuple[BlockPlace, int, bytes], None]" = OrderedDict()

    def add(self, place: BlockPlace, nbytes: int, header: bytes) -> None:
        with self._lock:
            self._known[(place, nbytes, header)] = None
            self._known.move_to_end((place, nbytes, header))
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)

    def __contains__(self, commit: Tuple[BlockPlace, int, bytes]) -> bool:
        with self._lock:
            if commit not in self._known:
                return False
            self._known.move_to_end(commit)
            return True


class InPlaceChunks:
    """Reserves, commits and leases chunks as objects over the pool's arena."""

    def __init__(self, connector: PoolConnector) -> None:
        self._connector = connector
        self._lock = threading.Lock()
        self._reserved: Dict[MemoryObj, _Reservation] = {}  # reserved objects not freed yet
        self._held_batches = 0  # lease batches out with `hold`
        self._known = KnownCommits()

    def holds(self, obj: MemoryObj) -> bool:
        """Whether `obj` is a reserved block of this tier (its put is a commit)."""
        with self._lock:
            return obj in self._reserved

    def reserve(self, keys: Sequence[CacheEngineKey], shapes: Sequence[torch.Size], dtype: torch.dtype) -> List[Optional[MemoryObj]]:
        """An object over a reserved block for each chunk, None where the pool refused.
        Raises `RemoteUnavailableError` when the pool cannot be reached."""
        names = [key.to_string() for key in keys]
        heads = [chunk_format.header_size(name, shape, dtype) for name, shape in zip(names, shapes)]
        sizes = [payload_size(shape, dtype) for shape in shapes]
        blocks = self._connector.reserve([(name, head + size) for name, head, size in zip(names, heads, sizes)])
        objs: List[Optional[MemoryObj]] = []
        for i, block in enumerate(blocks.blocks):
            if block is None:
                objs.append(None)
                continue
            meta = MemoryObjMetadata(torch.Size(shapes[i]), dtype, 0, sizes[i], 1, MemoryFormat.KV_BLOB)
            obj = BorrowedMemoryObj(block[heads[i] :], meta, self._forget)
            with self._lock:
                self._reserved[obj] = _Reservation(blocks, i, names[i], heads[i])
            objs.append(obj)
        return objs

    def commit(self, objs: Sequence[MemoryObj]) -> List[Optional[bool]]:
        """Write each filled reserved object's header in place (its payload hashed now unless the
        kernel summed it: `payload_checksum`) and commit it: True (stored), False (the pool
        refused), None (the connection broke: lost)."""
        with self._lock:
            held = [self._reserved[obj] for obj in objs]
        by_batch: Dict[int, List[int]] = {}
        headers: List[bytes] = []
        for n, (obj, res) in enumerate(zip(objs, held)):
            payload = chunk_format.memory_obj_payload(obj)
            meta = obj.metadata
            header = chunk_format.encode_header(res.key, meta.shape, meta.dtype, meta.fmt, payload, obj.payload_checksum)
            block = res.blocks.blocks[res.index]
            assert block is not None and len(header) == res.header_len
            block[: res.header_len] = header
            headers.append(header)
            by_batch.setdefault(id(res.blocks), []).append(n)
        results: List[Optional[bool]] = [None] * len(objs)
        for members in by_batch.values():
            blocks = held[members[0]].blocks
            try:
                acks = blocks.commit([held[n].index for n in members])
            except RemoteUnavailableError as err:
                logger.warning("node pool: committing %d chunks failed: %s", len(members), err)
                continue
            for n, ok in zip(members, acks):
                results[n] = ok
                place, block = blocks.place(held[n].index), blocks.blocks[held[n].index]
                if ok and place is not None and block is not None:
                    self._known.add(place, block.nbytes, headers[n])
        return results

    def lease(self, keys: Sequence[CacheEngineKey], dtype: torch.dtype, hold: bool = False) -> Optional[LeaseOutcome]:
        """The leading run of chunks the pool has and that pass the checks (done in place), as
        objects over their leased blocks; None from the first chunk that is missing or fails
        on (those after it are released unread). Raises `RemoteUnavailableError` when the pool
        cannot be reached. `hold`: the objects may be kept long (pins); None when
        `MAX_HELD_BATCHES` such batches are out already."""
        names = [key.to_string() for key in keys]
        if hold:
            with self._lock:
                if self._held_batches >= MAX_HELD_BATCHES:
                    return None
                self._held_batches += 1
        try:
            leases = self._connector.lease(names, self._batch_done if hold else None)
        except BaseException:
            if hold:
                self._batch_done()
            raise
        objs: List[Optional[MemoryObj]] = [None] * len(keys)
        rejected = hashed = 0
        for i, block in enumerate(leases.blocks):
            if block is None:
                continue
            if rejected or None in objs[:i]:  # past the first gap: the retrieve stops there
                leases.release(i)
                continue
            objs[i], hashed_now = self._checked(names[i], block, leases.places[i], dtype, leases, i)
            if objs[i] is None:
                rejected += 1
                leases.release(i)
            else:
                hashed += hashed_now
        return LeaseOutcome(objs, rejected, hashed)

    def _checked(self, key: str, block: memoryview, place: Optional[BlockPlace], dtype: torch.dtype,
                 leases: LeasedBlocks, index: int) -> Tuple[Optional[MemoryObj], bool]:
        """An object over the payload of a leased block whose header names `key`, `dtype` and a
        KV blob, whose length adds up and whose payload has the header's checksum (computed
        unless the commit is known); else None (logged). And whether the payload was hashed."""
        header = chunk_format.decode_header(block)
        if header is None or not chunk_format.header_matches(header, key=key, dtype=dtype, fmt=MemoryFormat.KV_BLOB):
            return None, False
        if block.nbytes != header.size + header.payload_len:
            logger.warning("chunk %s: block of %d bytes, header announces %d", key, block.nbytes, header.size + header.payload_len)
            return None, False
        payload = block[header.size :]
        commit = None if place is None else (place, block.nbytes, bytes(block[: header.size]))
        hashed = commit is None or commit not in self._known
        if hashed:
            if not chunk_format.verify_payload(header, payload):
                return None, True
            if commit is not None:
                self._known.add(*commit)
        meta = MemoryObjMetadata(torch.Size(header.shape), dtype, 0, header.payload_len, 1, MemoryFormat.KV_BLOB)
        return BorrowedMemoryObj(payload, meta, lambda _: leases.release(index)), hashed

    def _batch_done(self) -> None:
        with self._lock:
            self._held_batches -= 1

    def _forget(self, obj: BorrowedMemoryObj) -> None:
        """A reserved object's last reference went: never publish it unless it was committed."""
        with self._lock:
            res = self._reserved.pop(obj)
        res.blocks.abandon(res.index)

