"""The controller's picture of the cluster: which worker holds which chunk at which location.

Operations:
- `ControllerIndex.apply(message)`: a worker's `Register`, `Batch`, `Snapshot` or `Deregister`.
- `ControllerIndex.heartbeat(beat)`: the reply a worker's heartbeat gets.
- `ControllerIndex.expire()`: drop the workers that missed `missed_heartbeats` periods.
- `ControllerIndex.lookup(tokens)`: per instance, how long a prefix it holds and where.

How the picture stays right (resync):
- A worker's batches are numbered by its holdings stream and arrive in order on one PUSH
  socket; a batch whose `first_seq` is not where the last one ended means batches were lost
  (the controller's queue overflowed, or the worker's own stream did), so the worker is marked
  stale and its next heartbeat's reply asks for a `Snapshot`, which replaces everything known
  of it. Batches that arrive while a snapshot is awaited are ignored: the snapshot covers them.
- A lost *last* batch leaves no later batch to show the gap, so each heartbeat carries where the
  worker's batches end (`sent_seq`); a heartbeat travels on another socket and may overtake its
  batch, so a lag is only believed when the next heartbeat finds the stream still short of it.
  Either way the picture converges within two heartbeat periods of the loss.
- A `Register` (a new worker, or an instance restarted with a new `boot_id`) voids what was
  known of that worker; the worker follows it with a `Snapshot`. A controller that restarted
  knows nobody: its first heartbeat reply tells each worker to register again.
- While stale, a worker's last picture still answers `/lookup` (mostly right, and a router only
  uses the answer as a hint: a miss on the instance recomputes).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from lmcache.controller.messages import (
    ADMIT,
    CLEAR,
    Batch,
    Deregister,
    Heartbeat,
    HeartbeatReply,
    PullMessage,
    Register,
    Snapshot,
)
from lmcache.experimental.token_database import TokensLike, prefix_chunk_hashes
from lmcache.logging import init_logger

logger = init_logger(__name__)

# Heartbeat periods a worker may miss before it is dropped.
DEFAULT_MISSED_HEARTBEATS = 3

WorkerId = Tuple[str, int]  # (instance_id, worker_id)


@dataclass
class WorkerState:
    """What the controller knows of one worker."""

    info: Register
    held: Dict[str, Set[str]] = field(default_factory=dict)  # location -> chunk hashes
    expected_seq: Optional[int] = None  # where the next batch must start; None: awaiting a snapshot
    stale: bool = False  # a gap was seen: a snapshot is wanted
    lagging_seq: Optional[int] = None  # a heartbeat's `sent_seq` the batches had not reached yet
    last_seen: float = 0.0  # monotonic time of the last message
    registration_time: float = field(default_factory=time.time)  # wall clock, as upstream shows it
    last_heartbeat_time: float = 0.0  # wall clock of the last heartbeat (0: none yet)
    resyncs: int = 0  # snapshots applied

    def holds(self, chunk_hash: str) -> List[str]:
        return [location for location, hashes in self.held.items() if chunk_hash in hashes]


@dataclass(frozen=True)
class Match:
    """One instance's answer to a lookup: its longest held prefix, in tokens, and where."""

    instance_id: str
    location: str  # the location that holds the longest prefix on its own
    matched_prefix_len: int  # tokens of the prefix held in any location (what a retrieve loads)


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as `/query_worker_info` shows it."""

    instance_id: str
    worker_id: int
    ip: Optional[str]  # where it takes commands (None: it takes none), as upstream's ip and port
    port: Optional[int]
    registration_time: float  # wall clock
    last_heartbeat_time: float  # wall clock; 0: none yet
    world_size: int
    model_name: str
    chunk_size: int
    command_url: Optional[str]
    heartbeat_s: float
    seconds_since_heard: float
    stale: bool
    resyncs: int
    num_chunks: Dict[str, int]  # per location


class ControllerIndex:
    """Every registered worker's holdings; one lock (the ZeroMQ thread writes, HTTP threads read)."""

    def __init__(self, missed_heartbeats: int = DEFAULT_MISSED_HEARTBEATS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if missed_heartbeats < 1:
            raise ValueError(f"missed_heartbeats must be at least 1, got {missed_heartbeats}")
        self._missed = missed_heartbeats
        self._clock = clock
        self._lock = threading.Lock()
        # Insertion order is registration order: ties in `lookup` go to the earlier instance.
        self._workers: "OrderedDict[WorkerId, WorkerState]" = OrderedDict()
        self.ignored = 0  # messages of unknown workers, old boots or awaited snapshots
        self._warned: Set[WorkerId] = set()  # workers two processes were heard as

    # ----- the workers' stream ----------------------------------------------------------------

    def apply(self, message: PullMessage) -> None:
        with self._lock:
            if isinstance(message, Register):
                self._register(message)
                return
            state = self._current(message.instance_id, message.worker_id, message.boot_id)
            if state is None:
                self.ignored += 1
                return
            state.last_seen = self._clock()
            if isinstance(message, Batch):
                self._apply_batch(state, message)
            elif isinstance(message, Snapshot):
                state.held = {location: set(hashes) for location, hashes in message.holdings.items()}
                state.expected_seq, state.stale, state.lagging_seq = message.next_seq, False, None
                state.resyncs += 1
            elif isinstance(message, Deregister):
                del self._workers[(message.instance_id, message.worker_id)]
                logger.info("controller: %s worker %d deregistered", message.instance_id, message.worker_id)

    def _register(self, message: Register) -> None:
        wid = (message.instance_id, message.worker_id)
        old = self._workers.pop(wid, None)
        if old is not None and old.info.boot_id != message.boot_id:
            logger.info("controller: %s worker %d restarted: its holdings are resynced", *wid)
        elif old is None:
            logger.info("controller: %s worker %d registered (model %s, chunk size %d)",
                        *wid, message.model_name, message.chunk_size)
        self._workers[wid] = WorkerState(message, last_seen=self._clock())

    def _current(self, instance_id: str, worker_id: int, boot_id: str) -> Optional[WorkerState]:
        state = self._workers.get((instance_id, worker_id))
        return state if state is not None and state.info.boot_id == boot_id else None

    def _apply_batch(self, state: WorkerState, batch: Batch) -> None:
        if state.expected_seq is None or state.stale:
            self.ignored += 1
            return
        if batch.first_seq != state.expected_seq:
            logger.warning("controller: %s worker %d: batch starts at event %d, expected %d: resync asked",
                           state.info.instance_id, state.info.worker_id, batch.first_seq, state.expected_seq)
            state.stale = True
            return
        for op in batch.operations:
            hashes = state.held.setdefault(op.location, set())
            if op.op_type == ADMIT:
                hashes.add(op.key)
            elif op.op_type == CLEAR:
                hashes.clear()
            else:
                hashes.discard(op.key)
        state.expected_seq = batch.next_seq

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        """Whether the worker is known, and whether a snapshot is wanted (see the module docstring)."""
        with self._lock:
            state = self._current(beat.instance_id, beat.worker_id, beat.boot_id)
            if state is None:
                self._warn_if_shared(beat)
                return HeartbeatReply(beat.beat, registered=False, resync=False)
            state.last_seen, state.last_heartbeat_time = self._clock(), time.time()
            if state.expected_seq is None or state.stale:
                return HeartbeatReply(beat.beat, registered=True, resync=True)
            if state.expected_seq >= beat.sent_seq:
                state.lagging_seq = None
            elif state.lagging_seq is not None and state.expected_seq < state.lagging_seq:
                logger.warning("controller: %s worker %d: batches up to event %d never arrived: resync asked",
                               beat.instance_id, beat.worker_id, state.lagging_seq)
                state.stale = True
                return HeartbeatReply(beat.beat, registered=True, resync=True)
            else:
                state.lagging_seq = beat.sent_seq
            return HeartbeatReply(beat.beat, registered=True, resync=False)

    def _warn_if_shared(self, beat: Heartbeat) -> None:
        """Two live processes under one (instance, worker) keep voiding each other's holdings by
        registering in turn; say so once per worker (a restarted instance's old boot is silent)."""
        wid = (beat.instance_id, beat.worker_id)
        state = self._workers.get(wid)
        if state is not None and self._clock() - state.last_seen < state.info.heartbeat_s and wid not in self._warned:
            self._warned.add(wid)
            logger.warning("controller: two processes report as %s worker %d (boots %s and %s): give each instance "
                           "its own lmcache_instance_id", *wid, state.info.boot_id, beat.boot_id)

    def expire(self) -> List[WorkerId]:
        """Drop the workers silent for `missed_heartbeats` of their heartbeat periods."""
        now = self._clock()
        with self._lock:
            gone = [wid for wid, s in self._workers.items() if now - s.last_seen > self._missed * s.info.heartbeat_s]
            for wid in gone:
                del self._workers[wid]
        for instance_id, worker_id in gone:
            logger.warning("controller: %s worker %d missed %d heartbeats: dropped", instance_id, worker_id, self._missed)
        return gone

    # ----- questions --------------------------------------------------------------------------

    def lookup(self, tokens: TokensLike, cache_salt: str = "") -> List[Match]:
        """Every instance holding a prefix of `tokens`, the longest first (ties: earlier
        registered first). An instance with several workers (tensor parallel) holds what all of
        them hold. Tokens are hashed once per chunk size, outside the lock, as the instances hash
        them (`prefix_chunk_hashes`); the walk under the lock is one set probe per chunk."""
        with self._lock:
            sizes = {s.info.chunk_size for s in self._workers.values()}
        hashes = {size: list(prefix_chunk_hashes(tokens, size, cache_salt)) for size in sizes}
        per_instance: Dict[str, List[Tuple[int, str]]] = {}
        with self._lock:
            for state in self._workers.values():
                size = state.info.chunk_size
                if size not in hashes:  # registered since: rare, hashed under the lock
                    hashes[size] = list(prefix_chunk_hashes(tokens, size, cache_salt))
                per_instance.setdefault(state.info.instance_id, []).append(_held_prefix(state.held, hashes[size]))
        matches = []
        for instance_id, found in per_instance.items():
            length, location = min(found)
            if length > 0:
                matches.append(Match(instance_id, location, length))
        return sorted(matches, key=lambda m: -m.matched_prefix_len)

    def workers(self, instance_id: str, worker_ids: Optional[Iterable[int]] = None) -> List[WorkerInfo]:
        """The registered workers of `instance_id` (all, or those of `worker_ids`)."""
        now = self._clock()
        wanted = None if worker_ids is None else set(worker_ids)
        with self._lock:
            return [self._info(s, now) for (inst, wid), s in self._workers.items()
                    if inst == instance_id and (wanted is None or wid in wanted)]

    @staticmethod
    def _info(state: WorkerState, now: float) -> WorkerInfo:
        i = state.info
        ip, port = _host_port(i.command_url)
        return WorkerInfo(
            instance_id=i.instance_id, worker_id=i.worker_id, ip=ip, port=port,
            registration_time=state.registration_time, last_heartbeat_time=state.last_heartbeat_time,
            world_size=i.world_size, model_name=i.model_name, chunk_size=i.chunk_size, command_url=i.command_url,
            heartbeat_s=i.heartbeat_s, seconds_since_heard=round(now - state.last_seen, 3),
            stale=state.stale or state.expected_seq is None, resyncs=state.resyncs,
            num_chunks={location: len(hashes) for location, hashes in state.held.items()},
        )

    def command_urls(self, instance_id: str) -> Dict[int, Optional[str]]:
        """worker id -> the URL it takes commands on (None: it takes none)."""
        with self._lock:
            return {wid: s.info.command_url for (inst, wid), s in self._workers.items() if inst == instance_id}


def _held_prefix(held: Dict[str, Set[str]], chunks: Iterable[Tuple[int, str]]) -> Tuple[int, str]:
    """(tokens of the prefix held chunk by chunk in any location, the location that holds the
    longest prefix by itself): a retrieve reads each chunk from the fastest tier that has it."""
    matched, runs, unbroken = 0, dict.fromkeys(held, 0), set(held)
    for end, chunk_hash in chunks:
        where = {location for location, hashes in held.items() if chunk_hash in hashes}
        if not where:
            break
        matched = end
        unbroken &= where
        for location in unbroken:
            runs[location] = end
    return matched, max(runs, key=runs.__getitem__) if runs else ""


def _host_port(url: Optional[str]) -> Tuple[Optional[str], Optional[int]]:
    """`tcp://HOST:PORT` -> (HOST, PORT); None -> (None, None)."""
    if url is None:
        return None, None
    host, _, port = url[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)
