"""The `lm://` server's counters in Prometheus text format (`lmcache_server --metrics-port`).

A collector reads `LMCacheServer.info()` (what the `INFO` command answers) at every scrape, so
nothing is counted twice and the store's hot path is untouched. Every `INFO` field becomes
`lmcache_server:<field>`: a gauge for the levels and limits below, a counter (`_total`) for the
rest, so a field the server gains later shows up without a change here. The HTTP endpoint binds
127.0.0.1: the counters are for a local scraper (or a tunnel), as the server has no authentication.
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
PREFIX = "lmcache_server:"
# `INFO` fields that are levels now, not counts since start; `max_*` fields (limits) are too.
GAUGE_FIELDS = frozenset(
    {"entries", "bytes_used", "connections", "pending_bytes", "pool_clients", "pool_reservations", "pool_leases"}
)


def is_gauge(field: str) -> bool:
    return field in GAUGE_FIELDS or field.startswith("max_")


class ServerCollector(Collector):
    """One scrape = one `info()` of the server."""

    def __init__(self, server: LMCacheServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        for field, value in sorted(self._server.info().items()):
            doc = f"lm:// server INFO field {field}"
            family = GaugeMetricFamily if is_gauge(field) else CounterMetricFamily
            yield family(PREFIX + field, doc, value=value)


def serve_metrics(server: LMCacheServer, port: int) -> Tuple[WSGIServer, threading.Thread]:
    """Serve `server`'s counters on http://127.0.0.1:`port`/metrics from a daemon thread."""
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    return start_http_server(port, addr=METRICS_HOST, registry=registry)
