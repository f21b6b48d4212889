"""`lmcache:` Prometheus metrics: the mapping from the engine's counters, on a private registry,
and a real engine publishing into the default one (what vLLM's `/metrics` serves)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import text_clashes
from prometheus_client import REGISTRY, CollectorRegistry

from lmcache.experimental.metrics import ENGINE_COUNTERS, EngineMetrics, EngineObservation
from lmcache.experimental.storage_backend.remote_backend import RemoteStatsSnapshot
from lmcache.experimental.stats import EngineStatsSnapshot, TierStatsSnapshot

LABELS = {"model_name": "m", "worker_id": "0"}


def _value(registry, name, **extra):
    return registry.get_sample_value(name, {**LABELS, **extra})


def test_every_engine_counter_is_published_or_left_out_on_purpose():
    counters = {f.name for f in dataclasses.fields(EngineStatsSnapshot)} - {"tiers", "live_pins", "pinned_requests"}
    left_out = {"store_requested_tokens", "store_skipped_tokens", "pin_failed_tokens", "lookup_requested_tokens"}
    assert counters - left_out == set(ENGINE_COUNTERS)


def test_publish_adds_deltas_and_sets_gauges():
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", 0, registry=registry)
    first = EngineStatsSnapshot(
        retrieve_requests=2, store_requests=1, lookup_requests=3, retrieve_requested_tokens=1000,
        retrieve_hit_tokens=512, stored_tokens=768,
        tiers={"Hot": TierStatsSnapshot(evicted_chunks=1),
               "RemoteBackend": TierStatsSnapshot(bytes_read=10, bytes_written=20, errors=2, rejected_chunks=1)},
    )
    remote = RemoteStatsSnapshot(puts_refused=1, puts_lost=2, times_down=1)
    metrics.publish(EngineObservation(first, {"Hot": 4096, "LocalDiskBackend": 100}, remote))
    assert _value(registry, "lmcache:num_retrieve_requests_total") == 2
    assert _value(registry, "lmcache:num_store_requests_total") == 1
    assert _value(registry, "lmcache:num_lookup_requests_total") == 3
    assert _value(registry, "lmcache:num_requested_tokens_total") == 1000
    assert _value(registry, "lmcache:num_hit_tokens_total") == 512
    assert _value(registry, "lmcache:num_stored_tokens_total") == 768
    assert _value(registry, "lmcache:retrieve_hit_rate") == 0.512
    assert _value(registry, "lmcache:local_cache_usage", tier="Hot") == 4096
    assert _value(registry, "lmcache:local_cache_usage", tier="LocalDiskBackend") == 100
    assert _value(registry, "lmcache:remote_read_bytes_total") == 10
    assert _value(registry, "lmcache:remote_write_bytes_total") == 20
    assert _value(registry, "lmcache:num_evicted_chunks_total", tier="Hot") == 1
    assert _value(registry, "lmcache:num_integrity_misses_total", tier="RemoteBackend") == 1
    assert _value(registry, "lmcache:num_tier_errors_total", tier="RemoteBackend") == 2
    assert _value(registry, "lmcache:num_remote_refused_puts_total") == 1
    assert _value(registry, "lmcache:num_remote_lost_puts_total") == 2
    assert _value(registry, "lmcache:num_remote_tier_down_events_total") == 1

    # A second publish adds only what grew; gauges follow the latest value.
    second = dataclasses.replace(first, retrieve_requests=3, retrieve_hit_tokens=612, retrieve_requested_tokens=1200)
    metrics.publish(EngineObservation(second, {"Hot": 0}, remote))
    assert _value(registry, "lmcache:num_retrieve_requests_total") == 3
    assert _value(registry, "lmcache:num_hit_tokens_total") == 612
    assert _value(registry, "lmcache:num_stored_tokens_total") == 768
    assert _value(registry, "lmcache:num_remote_lost_puts_total") == 2
    assert _value(registry, "lmcache:retrieve_hit_rate") == 0.51
    assert _value(registry, "lmcache:local_cache_usage", tier="Hot") == 0

    metrics.observe_retrieve(0.003)
    metrics.observe_store(0.2)
    assert _value(registry, "lmcache:time_to_retrieve_count") == 1
    assert _value(registry, "lmcache:time_to_retrieve_bucket", le="0.005") == 1
    assert _value(registry, "lmcache:time_to_store_bucket", le="0.1") == 0


def test_two_engines_share_families_under_their_own_labels():
    registry = CollectorRegistry()
    a, b = EngineMetrics("m", 0, registry=registry), EngineMetrics("m", 1, registry=registry)
    a.publish(EngineObservation(EngineStatsSnapshot(stored_tokens=5)))
    b.publish(EngineObservation(EngineStatsSnapshot(stored_tokens=7)))
    assert registry.get_sample_value("lmcache:num_stored_tokens_total", {"model_name": "m", "worker_id": "0"}) == 5
    assert registry.get_sample_value("lmcache:num_stored_tokens_total", {"model_name": "m", "worker_id": "1"}) == 7


def test_a_real_engine_publishes_into_the_default_registry(tmp_path):
    import os

    from helpers import CHUNK, config, geometry, make_engine, prompt, slots_for
    from kv_reference import make_kvcaches

    def value(name, **extra):
        return REGISTRY.get_sample_value(name, {"model_name": "test/model", "worker_id": "0", **extra}) or 0.0

    names = ("lmcache:num_store_requests_total", "lmcache:num_stored_tokens_total", "lmcache:num_hit_tokens_total",
             "lmcache:num_lookup_requests_total", "lmcache:time_to_retrieve_count")
    before = {n: value(n) for n in names}
    misses_before = value("lmcache:num_integrity_misses_total", tier="LocalDiskBackend")
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    engine = make_engine(geo, cfg)
    tokens = prompt(2 * CHUNK)
    source, slots = make_kvcaches(geo), slots_for(geo, 2 * CHUNK)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    assert value("lmcache:local_cache_usage", tier="Hot") > 0
    assert engine.lookup(tokens, request_id="r1", pin=True) == 2 * CHUNK
    assert value("lmcache:live_pins") == 2
    engine.retrieve(tokens, kvcaches=make_kvcaches(geo, seed=3), slot_mapping=slots)
    engine.lookup_unpin(["r1"])
    assert value("lmcache:live_pins") == 0
    engine.close()
    grown = {n: value(n) - before[n] for n in names}
    assert grown == {
        "lmcache:num_store_requests_total": 1, "lmcache:num_stored_tokens_total": 2 * CHUNK,
        "lmcache:num_hit_tokens_total": 2 * CHUNK, "lmcache:num_lookup_requests_total": 1,
        "lmcache:time_to_retrieve_count": 1,
    }
    assert value("lmcache:local_cache_usage", tier="LocalDiskBackend") > 0

    # A corrupted chunk on disk is an integrity miss.
    disk_engine = make_engine(geo, config(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01))
    second = [k for _, _, k in disk_engine.token_database.process_tokens(tokens)][1]
    path = disk_engine.storage_manager.tiers[0].key_to_path(second)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        f.write(b"\x00" * 8 + b"\xff" * 8)
    ret = disk_engine.retrieve(tokens, kvcaches=make_kvcaches(geo, seed=4), slot_mapping=slots)
    assert int(ret.sum()) == CHUNK
    disk_engine.close()
    assert value("lmcache:num_integrity_misses_total", tier="LocalDiskBackend") - misses_before == 1


def test_lmcache_samples_reads_an_exposition_page():
    from prometheus_client import generate_latest

    from lmcache.experimental.metrics import lmcache_samples

    registry = CollectorRegistry()
    for worker in (0, 1):
        m = EngineMetrics("m", worker, registry=registry)
        m.publish(EngineObservation(EngineStatsSnapshot(retrieve_hit_tokens=10), {"Hot": 5}))
        m.observe_retrieve(0.002)
    page = generate_latest(registry).decode() + "vllm:other_total 3.0\n"
    samples = lmcache_samples(page)
    assert samples["lmcache:num_hit_tokens_total"] == 20
    assert samples['lmcache:local_cache_usage{tier="Hot"}'] == 10
    assert samples["lmcache:time_to_retrieve_count"] == 2
    assert samples['lmcache:time_to_retrieve_bucket{le="0.0025"}'] == 2
    assert not any(k.startswith("vllm:") for k in samples)


@pytest.mark.parametrize(
    "args,env,shared",
    [(["serve", "m"], {}, True), (["serve", "m"], {"VLLM_USE_V1": "0"}, False), (["chat"], {}, False),
     (["serve", "m"], {"PROMETHEUS_MULTIPROC_DIR": "/tmp/mine"}, False)],
)
def test_the_cli_shares_metrics_across_processes_for_a_v1_serve(args, env, shared):
    code = (
        "import os, sys\n"
        "from lmcache_vllm.script import share_metrics_across_processes\n"
        f"share_metrics_across_processes({args!r})\n"
        "d = os.environ.get('PROMETHEUS_MULTIPROC_DIR')\n"
        "print(d if d and os.path.isdir(d) and d != '/tmp/mine' else 'unset')\n"
        "import prometheus_client.values as v\n"
        "print(v.ValueClass.__name__)\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "VLLM_USE_V1")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    made, value_class = out.stdout.split()
    assert (made != "unset") == shared, out
    # Multiprocess values only when a directory is set (ours or the user's).
    assert (value_class == "MmapedValue") == ("PROMETHEUS_MULTIPROC_DIR" in env or shared), out


def test_the_grafana_dashboard_queries_only_published_names():
    import re

    from prometheus_client import generate_latest

    from lmcache.server import LMCacheServer, ServerConfig
    from lmcache.server.metrics import ServerCollector

    registry = CollectorRegistry()
    m = EngineMetrics("m", 0, registry=registry)
    tiers = {"Hot": TierStatsSnapshot(evicted_chunks=1, errors=1, rejected_chunks=1),
             "RemoteBackend": TierStatsSnapshot(bytes_read=1, bytes_written=1)}
    remote = RemoteStatsSnapshot(puts_refused=1, puts_lost=1, puts_dropped_queue_full=1, puts_dropped_tier_down=1,
                                 times_down=1)
    m.publish(EngineObservation(EngineStatsSnapshot(**{k: 1 for k in ENGINE_COUNTERS}, tiers=tiers), {"Hot": 1}, remote))
    m.observe_retrieve(0.1)
    m.observe_store(0.1)
    from lmcache.experimental.metrics import record_vllm_hit_tokens
    record_vllm_hit_tokens("m", 1, registry=registry)
    published = set(re.findall(r"^(lmcache:[\w:]+?)(?:\{| )", generate_latest(registry).decode(), re.M))
    server_registry = CollectorRegistry()
    server_registry.register(ServerCollector(LMCacheServer(ServerConfig(port=0))))
    published |= set(re.findall(r"^(lmcache_server:\w+) ", generate_latest(server_registry).decode(), re.M))
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana" / "lmcache.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"lmcache(?:_server)?:\w+", target["expr"])}
    assert queried and queried <= published, queried - published
    assert {"lmcache:num_hit_tokens_total", "lmcache:time_to_retrieve_bucket", "lmcache:local_cache_usage"} <= queried


def test_bench_metrics_agreement_and_dashboard_png(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
    from bench_metrics import agreement, dashboard_png

    from lmcache.integration.vllm.request_log import RequestCounters, RequestStats, format_request_line

    # r1: vLLM had 384 tokens, LMCache loaded 128 more; the engine read the chunk [256, 512) whole.
    log = "\n".join(format_request_line(f"r{i}", RequestStats(600, v, v + n), RequestCounters(n, s), "")
                     for i, (v, n, s) in enumerate([(0, 0, 600), (384, 128, 88), (0, 512, 0)]))
    samples = {"lmcache:num_hit_tokens_total": 128 + 128 + 512, "lmcache:num_stored_tokens_total": 688}
    assert agreement(samples, log, chunk_size=256)["agree"]
    assert not agreement({**samples, "lmcache:num_hit_tokens_total": 640}, log, chunk_size=256)["agree"]
    assert agreement({}, "", chunk_size=256)["agree"]  # counters that never grew are absent
    series = [{"t": t, "samples": {"lmcache:num_hit_tokens_total": 100.0 * t, "lmcache:time_to_retrieve_count": t,
                                   "lmcache:time_to_retrieve_sum": 0.01 * t}} for t in range(4)]
    png = dashboard_png({"lmcache-cpu#1": series}, tmp_path / "d.png", "test")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    assert dashboard_png({"x": []}, tmp_path / "e.png", "empty") is None


def test_the_committed_dashboard_has_no_text_over_text_or_axes():
    # The committed metrics run: a CPU-tier server and two remote-tier processes (a restart).
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    from bench_metrics import dashboard_figure, dashboard_title, scraped_series

    result = json.loads((root / "bench/results/metrics/serving-20261123-164902.json").read_text())
    series = scraped_series(result["processes"])
    assert list(series) == ["lmcache-cpu#1", "lmcache-remote#1", "lmcache-remote#2"]
    assert text_clashes(dashboard_figure(series, dashboard_title(result["started"]))) == []


def test_an_older_observation_published_late_never_counts_twice():
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", 0, registry=registry)
    older, newer, newest = (EngineObservation(EngineStatsSnapshot(stored_tokens=n)) for n in (10, 20, 25))
    for observation in (newer, older, newest):  # two threads' publishes crossed
        metrics.publish(observation)
    assert _value(registry, "lmcache:num_stored_tokens_total") == 25
