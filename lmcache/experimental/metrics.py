"""The engine's counters as Prometheus metrics with upstream LMCache's `lmcache:` names.

`EngineStats` stays the one set of counters; `EngineMetrics.publish` turns a snapshot of it
(plus the tiers' usage and the remote tier's put/health counters) into increments of Prometheus
counters and settings of gauges, remembering what it published last. The engine publishes after
every store, retrieve and lookup, and observes their durations in the two histograms.

The metrics live in `prometheus_client`'s default registry, the one vLLM's `/metrics` serves.
When vLLM runs the engine in another process than its HTTP server, `prometheus_client`'s
multiprocess mode carries them over: every process writes its values to files under
`PROMETHEUS_MULTIPROC_DIR` and the server's collector sums them. That variable must be set before
`prometheus_client` is first imported in any of vLLM's processes: vLLM sets it for its v0 server;
the `lmcache_vllm` CLI sets it for the v1 server (`lmcache_vllm.script`).

Labels as upstream: `model_name` and `worker_id`, plus `tier` on per-tier series.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Tuple

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from lmcache.experimental.stats import EngineStatsSnapshot, TierStatsSnapshot

if TYPE_CHECKING:
    from lmcache.experimental.storage_backend.remote_backend import RemoteStatsSnapshot

LABELS = ("model_name", "worker_id")
TIER_LABELS = (*LABELS, "tier")
REMOTE_TIER = "RemoteBackend"

# Engine counter name -> (metric name, help). Counters expose `<name>_total`, as upstream's do.
ENGINE_COUNTERS: Dict[str, Tuple[str, str]] = {
    "retrieve_requests": ("lmcache:num_retrieve_requests", "Retrieve calls"),
    "store_requests": ("lmcache:num_store_requests", "Store calls"),
    "lookup_requests": ("lmcache:num_lookup_requests", "Lookup calls"),
    "retrieve_requested_tokens": ("lmcache:num_requested_tokens", "Tokens retrieve was asked for"),
    "retrieve_hit_tokens": ("lmcache:num_hit_tokens", "Tokens retrieve loaded from the cache"),
    "lookup_hit_tokens": ("lmcache:num_lookup_hit_tokens", "Prefix tokens lookups found cached"),
    "stored_tokens": ("lmcache:num_stored_tokens", "Tokens newly stored"),
    "store_dropped_tokens": ("lmcache:num_store_dropped_tokens", "Tokens not stored: memory full or a tier failed"),
}
# Tier counter name -> (metric name, help), labelled by tier.
TIER_COUNTERS: Dict[str, Tuple[str, str]] = {
    "evicted_chunks": ("lmcache:num_evicted_chunks", "Chunks a tier dropped to make room"),
    "errors": ("lmcache:num_tier_errors", "Failed tier reads and writes, rejected chunks included"),
    "rejected_chunks": ("lmcache:num_integrity_misses", "Chunks whose bytes failed the checksum/key/shape checks"),
    "auth_refusals": ("lmcache:num_auth_refusals", "Pushes and handshakes refused for a missing or wrong token"),
}
# Remote tier put/health counter name -> (metric name, help).
REMOTE_COUNTERS: Dict[str, Tuple[str, str]] = {
    "puts_refused": ("lmcache:num_remote_refused_puts", "Remote puts the store answered 'no' to"),
    "puts_lost": ("lmcache:num_remote_lost_puts", "Remote puts sent but never acknowledged"),
    "puts_dropped_queue_full": ("lmcache:num_remote_dropped_puts_queue_full", "Remote puts dropped: queue full"),
    "puts_dropped_tier_down": ("lmcache:num_remote_dropped_puts_tier_down", "Remote puts dropped: tier down"),
    "times_down": ("lmcache:num_remote_tier_down_events", "Times the remote tier was marked down"),
}
# Seconds; a CPU-tier chunk copy is milliseconds, a remote read can be a second.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class EngineObservation:
    """Everything one publish reads from an engine."""

    stats: EngineStatsSnapshot
    usage_bytes: Mapping[str, int] = field(default_factory=dict)  # tier name -> bytes held now
    remote: Optional["RemoteStatsSnapshot"] = None


class _Families:
    """The metric objects of one registry (a family may be registered once per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels=LABELS) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.engine = {k: counter(n, d) for k, (n, d) in ENGINE_COUNTERS.items()}
        self.tier = {k: counter(n, d, TIER_LABELS) for k, (n, d) in TIER_COUNTERS.items()}
        self.remote = {k: counter(n, d) for k, (n, d) in REMOTE_COUNTERS.items()}
        self.remote_read_bytes = counter("lmcache:remote_read_bytes", "Payload bytes read from the remote tier")
        self.remote_write_bytes = counter("lmcache:remote_write_bytes", "Payload bytes written to the remote tier")
        self.vllm_hit_tokens = counter("lmcache:num_vllm_hit_tokens", "Prompt tokens vLLM's own prefix cache had")
        self.hit_rate = Gauge(
            "lmcache:retrieve_hit_rate", "Share of requested tokens retrieve loaded, since start",
            LABELS, registry=registry, multiprocess_mode="livemax",
        )
        self.usage = Gauge(
            "lmcache:local_cache_usage", "Bytes a local tier holds now",
            TIER_LABELS, registry=registry, multiprocess_mode="livesum",
        )
        self.live_pins = Gauge(
            "lmcache:live_pins", "Chunks pinned for requests now", LABELS, registry=registry, multiprocess_mode="livesum",
        )
        self.time_to_retrieve = Histogram(
            "lmcache:time_to_retrieve", "Seconds per retrieve call", LABELS, registry=registry, buckets=LATENCY_BUCKETS,
        )
        self.time_to_store = Histogram(
            "lmcache:time_to_store", "Seconds per store call", LABELS, registry=registry, buckets=LATENCY_BUCKETS,
        )


_families_lock = threading.Lock()
_families: "weakref.WeakKeyDictionary[CollectorRegistry, _Families]" = weakref.WeakKeyDictionary()


def _families_for(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        if registry not in _families:
            _families[registry] = _Families(registry)
        return _families[registry]


class EngineMetrics:
    """One engine's view of the metric families: its labels and the counter values published."""

    def __init__(self, model_name: str, worker_id: int, registry: CollectorRegistry = REGISTRY) -> None:
        self._families = _families_for(registry)
        self._labels = {"model_name": model_name, "worker_id": str(worker_id)}
        self._lock = threading.Lock()
        # (counter, tier) -> the engine's count already added to it. Publishes may race (a store
        # and a lookup on two threads), so a count below what was published is ignored rather
        # than taken as the new base: counters only grow.
        self._published: Dict[Tuple[Counter, str], int] = {}

    def observe_retrieve(self, seconds: float) -> None:
        self._families.time_to_retrieve.labels(**self._labels).observe(seconds)

    def observe_store(self, seconds: float) -> None:
        self._families.time_to_store.labels(**self._labels).observe(seconds)

    def _advance(self, counter: Counter, count: int, tier: str = "") -> None:
        done = self._published.get((counter, tier), 0)
        if count > done:
            labelled = counter.labels(**self._labels, tier=tier) if tier else counter.labels(**self._labels)
            labelled.inc(count - done)
            self._published[(counter, tier)] = count

    def publish(self, now: EngineObservation) -> None:
        """Add what the counters gained since the last publish; set the gauges to `now`."""
        f, labels = self._families, self._labels
        with self._lock:
            for name, counter in f.engine.items():
                self._advance(counter, getattr(now.stats, name))
            for tier, snap in now.stats.tiers.items():
                for name, counter in f.tier.items():
                    self._advance(counter, getattr(snap, name), tier)
            remote = now.stats.tiers.get(REMOTE_TIER, TierStatsSnapshot())
            self._advance(f.remote_read_bytes, remote.bytes_read)
            self._advance(f.remote_write_bytes, remote.bytes_written)
            if now.remote is not None:
                for name, counter in f.remote.items():
                    self._advance(counter, getattr(now.remote, name))
            f.hit_rate.labels(**labels).set(now.stats.retrieve_hit_rate)
            f.live_pins.labels(**labels).set(now.stats.live_pins)
            for tier, used in now.usage_bytes.items():
                f.usage.labels(**labels, tier=tier).set(used)


def record_vllm_hit_tokens(model_name: str, tokens: int, registry: CollectorRegistry = REGISTRY) -> None:
    """vLLM's own prefix-cache hit of one request (the v1 scheduler side knows it; rank 0's label)."""
    if tokens > 0:
        _families_for(registry).vllm_hit_tokens.labels(model_name=model_name, worker_id="0").inc(tokens)



def lmcache_samples(exposition: str) -> Dict[str, float]:
    """The `lmcache:` samples of a `/metrics` page, summed over models and workers.

    Keys are the sample name plus its other labels (`lmcache:local_cache_usage{tier="Hot"}`,
    `lmcache:time_to_retrieve_bucket{le="0.01"}`); the bench and the tests read pages with it."""
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if not sample.name.startswith("lmcache:"):
                continue
            rest = sorted((k, v) for k, v in sample.labels.items() if k not in LABELS)
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in rest) + "}" if rest else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out
