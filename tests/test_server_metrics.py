"""The lm:// server's counters on `--metrics-port` in Prometheus text format, on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_fixture import LMServerProcess, free_port
from tier_helpers import wait_for

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.__main__ import _parse_args
from lmcache.server.metrics import is_gauge, serve_metrics


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_counters_follow_the_store():
    server = LMCacheServer(ServerConfig(port=0, max_size_bytes=1 << 20))
    host, port = server.start_in_thread()
    http, _ = serve_metrics(server, free_port())
    try:
        conn = LMServerConnector(host, port)
        assert conn.put("a", b"x" * 100) and conn.put("b", b"y" * 10)
        assert conn.get("a") is not None and conn.get("missing") is None
        conn.close()
        # The server's thread notices the close a moment later; the page and INFO must agree.
        assert wait_for(lambda: server.info()["connections"] == 0)
        samples, info = _scrape(http.server_port), server.info()
    finally:
        http.shutdown()
        server.shutdown()
    assert samples["lmcache_server:entries"] == 2
    assert samples["lmcache_server:bytes_used"] == 2 + 110
    assert samples["lmcache_server:puts_total"] == 2
    assert samples["lmcache_server:hits_total"] == 1 and samples["lmcache_server:misses_total"] == 1
    # Every field the INFO command reports is on the page: levels as gauges, the rest as counters.
    for field, value in info.items():
        name = f"lmcache_server:{field}" + ("" if is_gauge(field) else "_total")
        assert samples[name] == value, field


def test_cli_serves_metrics_on_loopback_only_when_asked(tmp_path):
    assert _parse_args(["5555"]).metrics_port is None
    with pytest.raises(SystemExit):
        _parse_args(["5555", "--metrics-port", "70000"])
    metrics_port = free_port()
    proc = LMServerProcess(extra_args=["--metrics-port", str(metrics_port)], log_path=tmp_path / "s.log").start()
    try:
        conn = LMServerConnector("127.0.0.1", proc.port)
        assert conn.put("k", b"v")
        conn.close()
        assert _scrape(metrics_port)["lmcache_server:puts_total"] == 1
    finally:
        proc.stop()
    assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in (tmp_path / "s.log").read_text()
