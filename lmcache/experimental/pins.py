"""Pins: the chunks a lookup promised, held in CPU memory until the load that needs them.

Between a serving engine's lookup ("N tokens are cached") and its load, a chunk may leave every
tier: the disk tier evicts a file, the remote server evicts, or the CPU tier evicts an idle object
to make room for another read. A pinned lookup (`LMCacheEngine.lookup(..., request_id=R,
pin=True)`) therefore brings every chunk of the prefix into CPU memory and hands the objects to
this registry, which keeps one reference on each under R until `unpin([R])`:
- the CPU tier never evicts an object whose reference count is above its own one reference, so
  a pinned object stays in the tier;
- `StorageManager.get` asks the registry right after the CPU tier, so a retrieve still finds a
  pinned chunk that was removed from every tier.

Operations:
- `pin(request_id, pinned)`: hold these objects for R (taking over the caller's references);
  R's earlier pins are released. False (and nothing held) once the registry is closed.
- `get(key)`: a pinned object for `key` with one reference for the caller, or None.
- `unpin(request_ids)`: release those requests' pins; unknown ids are ignored.
- `close()`: release everything; later `pin` calls release what they are given at once.

Standing pins (the controller's `/pin`) outlive any request: their ids start with
`STANDING_PREFIX`, and `num_standing_requests` tells them from pins a request left behind.

Thread-safe: the scheduler side pins from its thread while the worker loads and unpins from
another. References are dropped outside the lock (a last reference frees into the allocator).
"""

import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from lmcache.experimental.memory_management import MemoryObj
from lmcache.experimental.stats import EngineStats
from lmcache.utils import CacheEngineKey

Pinned = Tuple[CacheEngineKey, MemoryObj]

# The start of a standing pin's request id. No serving engine's request id starts with a NUL
# (vLLM makes its own, or takes one from an HTTP header, which cannot carry a NUL), so the two
# never collide.
STANDING_PREFIX = "\0standing:"


def _release(pinned: Iterable[Pinned]) -> None:
    for _, obj in pinned:
        obj.ref_count_down()


class PinRegistry:
    """Request id -> the (key, object) pairs held for it, plus an index by key."""

    def __init__(self, stats: Optional[EngineStats] = None) -> None:
        self._stats = stats if stats is not None else EngineStats()
        self._lock = threading.Lock()
        self._by_request: Dict[str, List[Pinned]] = {}
        # Every pinned object of a key (two requests may pin two copies of one chunk).
        self._by_key: Dict[CacheEngineKey, List[MemoryObj]] = {}
        self._num_pins = 0
        self._closed = False

    @property
    def num_pins(self) -> int:
        """(request, chunk) pins held right now."""
        with self._lock:
            return self._num_pins

    @property
    def num_requests(self) -> int:
        """Request ids holding at least one pin right now."""
        with self._lock:
            return len(self._by_request)

    @property
    def num_standing_requests(self) -> int:
        """Request ids of standing pins (`STANDING_PREFIX`) holding at least one pin right now."""
        with self._lock:
            return sum(1 for request_id in self._by_request if request_id.startswith(STANDING_PREFIX))

    def pin(self, request_id: str, pinned: Sequence[Pinned]) -> bool:
        """Hold `pinned` for `request_id` instead of whatever it held before.

        The registry takes over one reference of each object from the caller. An empty
        `pinned` just releases the request's old pins. Returns False when closed (the given
        references are released then, nothing is held).
        """
        if not isinstance(request_id, str) or not request_id:
            _release(pinned)
            raise ValueError(f"pin: request_id must be a non-empty str, got {request_id!r}")
        with self._lock:
            if self._closed:
                released, ok = list(pinned), False
            else:
                released, ok = self._drop_locked(request_id), True
                if pinned:
                    self._by_request[request_id] = list(pinned)
                    for key, obj in pinned:
                        self._by_key.setdefault(key, []).append(obj)
                    self._num_pins += len(pinned)
                self._publish_locked()
        _release(released)
        return ok

    def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """A pinned object for `key` (the caller owns one new reference), or None."""
        with self._lock:
            objs = self._by_key.get(key)
            if not objs:
                return None
            obj = objs[0]
            # Under the lock: the pin's own reference cannot be dropped before this one is taken.
            obj.ref_count_up()
            return obj

    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._by_key

    def unpin(self, request_ids: Iterable[str]) -> int:
        """Release the pins of `request_ids` (unknown ids are ignored); the number released."""
        if isinstance(request_ids, (str, bytes)):
            raise TypeError(f"unpin takes a collection of request ids, got the single string {request_ids!r}")
        released: List[Pinned] = []
        with self._lock:
            for request_id in request_ids:
                released.extend(self._drop_locked(request_id))
            if released:
                self._publish_locked()
        _release(released)
        return len(released)

    def close(self) -> int:
        """Release every pin and refuse later ones; the number of pins that were still held."""
        with self._lock:
            self._closed = True
            released = [p for pins in self._by_request.values() for p in pins]
            self._by_request.clear()
            self._by_key.clear()
            self._num_pins = 0
            self._publish_locked()
        _release(released)
        return len(released)

    def _drop_locked(self, request_id: str) -> List[Pinned]:
        pinned = self._by_request.pop(request_id, [])
        for key, obj in pinned:
            objs = self._by_key[key]
            # By identity: two copies of one chunk are different objects with equal contents.
            objs.pop(next(i for i, o in enumerate(objs) if o is obj))
            if not objs:
                del self._by_key[key]
        self._num_pins -= len(pinned)
        return pinned

    def _publish_locked(self) -> None:
        self._stats.set_pins(self._num_pins, len(self._by_request))
