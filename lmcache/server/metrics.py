"""The `lm://` server's counters in Prometheus text format (`lmcache_server --metrics-port`).

A collector reads `LMCacheServer.info()` at every scrape, so nothing is counted twice and the
store's hot path is untouched. The HTTP endpoint binds 127.0.0.1: the counters are for a local
scraper (or a tunnel), like the server itself has no authentication.
"""

from __future__ import annotations

import threading
from typing import Iterator, Tuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmcache.server.server import LMCacheServer

METRICS_HOST = "127.0.0.1"
# `info()` key -> (metric name, help); counters are exposed as `<name>_total`.
GAUGES = {
    "entries": ("lmcache_server:entries", "Chunks stored now"),
    "bytes_used": ("lmcache_server:bytes_used", "Bytes of keys and values stored now"),
    "max_bytes": ("lmcache_server:max_bytes", "Bytes the store may hold"),
    "connections": ("lmcache_server:connections", "Open client connections"),
}
COUNTERS = {
    "puts": ("lmcache_server:puts", "Chunks stored"),
    "refused_puts": ("lmcache_server:refused_puts", "Puts refused: larger than the store"),
    "hits": ("lmcache_server:hits", "Gets that found the chunk"),
    "misses": ("lmcache_server:misses", "Gets that did not"),
    "evictions": ("lmcache_server:evictions", "Chunks evicted to make room"),
    "deletes": ("lmcache_server:deletes", "Chunks deleted by clients"),
    "protocol_errors": ("lmcache_server:protocol_errors", "Connections closed for a bad frame"),
    "rejected_connections": ("lmcache_server:rejected_connections", "Connections refused: too many open"),
}


class ServerCollector(Collector):
    """One scrape = one `info()` of the server."""

    def __init__(self, server: LMCacheServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        info = self._server.info()
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=info[key])
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=info[key])


def serve_metrics(server: LMCacheServer, port: int) -> Tuple[WSGIServer, threading.Thread]:
    """Serve `server`'s counters on http://127.0.0.1:`port`/metrics from a daemon thread."""
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    return start_http_server(port, addr=METRICS_HOST, registry=registry)
