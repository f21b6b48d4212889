"""The controller's `/pin` and `/unpin` on one worker: standing pins of prefixes, bounded.

A pin is the engine's own (`StorageManager.pin_prefix`, `lmcache/experimental/pins.py`): the
chunks are held in CPU memory with a reference the CPU tier never evicts, and reads find them
there, whichever location they were read from. The tokens are keyed as the engine keys a store
(`token_database.process_tokens`, the same hashes the controller's `/lookup` computes). Each
(location, prefix) is one pin under a request id of its own (`STANDING_PREFIX`), so a repeated
`/pin` replaces the last one and `/unpin` of the same tokens finds it.

Bounded: the controller's pins hold at most `PIN_SHARE` of the CPU tier's memory. A pinned chunk
cannot be evicted, so pins that filled the tier would leave serving no room to store or load:
every new prefix would be skipped, and the serving engine's own pins (lookup to load) would fail.
Half leaves serving a working set as large as what the operator pinned. A `/pin` beyond the bound
pins what fits and says so in its `num_tokens`; the first one is logged. It reads no more chunks
than could fit (a chunk reserves at least its payload): a long prefix of the disk tier is not read
whole for a few chunks' room. The engine's close releases every pin.

Single-threaded: only the controller client's thread calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.memory_management import MemoryObj
from lmcache.experimental.pins import STANDING_PREFIX
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# The share of the CPU tier's memory the controller's pins may hold (see the module's docstring).
PIN_SHARE = 0.5
GIB = 1 << 30


@dataclass(frozen=True)
class _Pin:
    location: str
    sizes: Dict[CacheEngineKey, int]  # the pinned chunks, in order, and the bytes each reserves
    num_tokens: int


class WorkerPins:
    """The controller's pins on this worker's engine, by (location, prefix)."""

    def __init__(self, engine: LMCacheEngine) -> None:
        self._engine = engine
        total = engine.memory_allocator.total_bytes
        if total is None:  # an allocator without a fixed pool: the configured size
            total = int(engine.config.max_local_cpu_size * GIB)
        self.budget_bytes = int(total * PIN_SHARE)
        shape = engine.gpu_connector.get_shape(engine.config.chunk_size)
        self._chunk_payload = shape.numel() * engine.metadata.kv_dtype.itemsize
        self._pins: Dict[str, _Pin] = {}
        self._warned = False

    def pin(self, location: str, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Keep the longest prefix of `tokens` that `location` holds, chunk by chunk and within
        the bound; the number of tokens pinned. ValueError for a location that is no tier."""
        asked = self._chunks(location, tokens, cache_salt)
        if not asked:
            return 0
        request_id = _request_id(location, asked[-1][1])
        self._pins.pop(request_id, None)  # the registry replaces this id's pins: so does the bound
        held = self._held()
        room = self.budget_bytes - sum(held.values())
        # One chunk more than could fit, so that `fits` sees the bound (and logs it).
        chunks = _at_most_new(asked, held, room // self._chunk_payload + 1)
        sizes: Dict[CacheEngineKey, int] = {}

        def fits(i: int, obj: MemoryObj) -> bool:
            nonlocal room
            key, size = chunks[i][1], obj.get_physical_size()
            if key not in held:
                if size > room:
                    self._bounded(location)
                    return False
                room -= size
            sizes[key] = size
            return True

        storage = self._engine.storage_manager
        count = storage.pin_prefix(request_id, [key for _, key in chunks], [location], fits,
                                   self._engine.metadata.kv_dtype)
        self._engine.publish_metrics()
        if count == 0:
            return 0
        self._pins[request_id] = _Pin(location, sizes, chunks[count - 1][0])
        return chunks[count - 1][0]

    def unpin(self, location: str, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Release what a `pin` of these tokens and location holds; the number of tokens it held
        (0: none)."""
        chunks = self._chunks(location, tokens, cache_salt)
        if not chunks:
            return 0
        request_id = _request_id(location, chunks[-1][1])
        pin = self._pins.pop(request_id, None)
        if pin is None:
            return 0
        self._engine.lookup_unpin([request_id])
        return pin.num_tokens

    def release(self, location: str) -> int:
        """Release every pin of `location` (it was cleared); how many there were."""
        request_ids = [rid for rid, pin in self._pins.items() if pin.location == location]
        for request_id in request_ids:
            del self._pins[request_id]
        self._engine.lookup_unpin(request_ids)
        return len(request_ids)

    def _chunks(self, location: str, tokens: Sequence[int], cache_salt: str) -> List[Tuple[int, CacheEngineKey]]:
        """(end, key) per chunk of `tokens`, keyed as the engine keys a store."""
        tiers = self._engine.storage_manager.tier_names
        if location not in tiers:
            raise ValueError(f"tier={location!r}: expected one of {tiers}")
        return [(end, key) for _, end, key in self._engine.token_database.process_tokens(tokens, cache_salt=cache_salt)]

    def _held(self) -> Dict[CacheEngineKey, int]:
        """The bytes each chunk the controller's pins hold reserves (a chunk two pins share: once)."""
        return {key: size for pin in self._pins.values() for key, size in pin.sizes.items()}

    def _bounded(self, location: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "LMCache controller: a /pin of %s reached the bound of the controller's pins, %d bytes (%d%% of "
                "the CPU tier, which cannot evict what is pinned and needs the rest to serve); it pinned the "
                "prefix that fits and answers that many tokens. /unpin releases room. (Logged once.)",
                location, self.budget_bytes, int(PIN_SHARE * 100),
            )


def _at_most_new(chunks: List[Tuple[int, CacheEngineKey]], held: Dict[CacheEngineKey, int],
                 most: int) -> List[Tuple[int, CacheEngineKey]]:
    """The leading `chunks` with at most `most` that `held` does not hold."""
    new = 0
    for n, (_, key) in enumerate(chunks):
        new += key not in held
        if new > most:
            return chunks[:n]
    return chunks


def _request_id(location: str, last: CacheEngineKey) -> str:
    """The pin's id in the engine's registry: one per (location, prefix), the prefix named by its
    last chunk's key (a rolling hash: it names every token before it)."""
    return f"{STANDING_PREFIX}controller:{location}:{last.chunk_hash}"
