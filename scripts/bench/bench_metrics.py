"""The `lmcache:` metrics a benchmarked server published: sampled from its `/metrics` while it
runs, checked against its per-request log lines, and drawn as the Grafana dashboard's panels.

`bench_serving.py` starts one `MetricsSampler` per server process; `docs/grafana/lmcache.json`
is the dashboard over the same series (`dashboard_png` draws its panels with matplotlib from
what was scraped, so the picture comes from a real run without a Grafana server).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from lmcache.experimental.metrics import lmcache_samples
from lmcache.integration.vllm.request_log import parse_request_lines

MAX_POINTS = 7200  # one scrape a second: two hours per server process, then the oldest go
HOT_USAGE = 'lmcache:local_cache_usage{tier="Hot"}'


def scrape(base_url: str, timeout_s: float = 10.0) -> Dict[str, float]:
    """The `lmcache:` samples on `base_url`/metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as resp:
        return lmcache_samples(resp.read().decode())


class MetricsSampler:
    """Scrapes a server's `/metrics` every `period_s` from a thread; `stop()` returns the points."""

    def __init__(self, base_url: str, clock_zero: float, period_s: float = 1.0) -> None:
        self._url, self._zero, self._period = base_url, clock_zero, period_s
        self._points: List[dict] = []
        self._stop = threading.Event()
        self._errors = 0
        self._thread = threading.Thread(target=self._run, name="bench-metrics", daemon=True)

    def start(self) -> "MetricsSampler":
        self._thread.start()
        return self

    def _sample(self) -> None:
        try:
            samples = scrape(self._url)
        except OSError:
            self._errors += 1
            return
        self._points.append({"t": round(time.perf_counter() - self._zero, 3), "samples": samples})
        del self._points[:-MAX_POINTS]

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def stop(self) -> dict:
        """Stop sampling after one last scrape; the series, the last samples and failed scrapes."""
        self._stop.set()
        self._thread.join()
        self._sample()
        final = self._points[-1]["samples"] if self._points else {}
        return {"series": self._points, "final": final, "failed_scrapes": self._errors}


def agreement(final: Dict[str, float], log_text: str, chunk_size: int) -> dict:
    """The metrics' hit and stored tokens next to what the server's per-request lines imply.

    A line's `loaded_tokens` counts what vLLM gained; the engine's retrieve (`num_hit_tokens`)
    starts on a chunk boundary, so it also reads the part of vLLM's own prefix (V) that shares the
    first loaded chunk: V - floor(V / chunk) * chunk more tokens per loading request. A counter
    that never grew is absent from the page: 0."""
    lines = parse_request_lines(log_text)
    loaded = sum(line.counters.loaded_tokens for line in lines)
    overlap = sum(line.stats.vllm_cached_tokens % chunk_size for line in lines if line.counters.loaded_tokens)
    stored = sum(line.counters.stored_tokens for line in lines)
    hit_metric = final.get("lmcache:num_hit_tokens_total", 0.0)
    stored_metric = final.get("lmcache:num_stored_tokens_total", 0.0)
    return {
        "request_lines": len(lines),
        "log_loaded_tokens": loaded,
        "log_loaded_plus_vllm_overlap": loaded + overlap,
        "metric_hit_tokens": hit_metric,
        "log_stored_tokens": stored,
        "metric_stored_tokens": stored_metric,
        "agree": hit_metric == loaded + overlap and stored_metric == stored,
    }


def _rate(points: List[dict], name: str) -> tuple:
    """(times, per-second increase of counter `name`) between consecutive scrapes."""
    ts, rates = [], []
    for a, b in zip(points, points[1:]):
        dt = b["t"] - a["t"]
        if dt > 0:
            ts.append(b["t"])
            rates.append((b["samples"].get(name, 0.0) - a["samples"].get(name, 0.0)) / dt)
    return ts, rates


def _mean_latency(points: List[dict], name: str) -> tuple:
    """(times, mean seconds of histogram `name` over each scrape interval, where it had samples)."""
    ts, means = [], []
    for a, b in zip(points, points[1:]):
        count = b["samples"].get(f"{name}_count", 0.0) - a["samples"].get(f"{name}_count", 0.0)
        if count > 0:
            total = b["samples"].get(f"{name}_sum", 0.0) - a["samples"].get(f"{name}_sum", 0.0)
            ts.append(b["t"])
            means.append(1000 * total / count)
    return ts, means


def dashboard_png(series_by_server: Dict[str, List[dict]], png_path: Path, title: str) -> Optional[Path]:
    """The dashboard's six panels over every server's scraped series; None when nothing was scraped."""
    if not any(series_by_server.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    panels = [
        ("hit / requested tokens per s", lambda p: [_rate(p, "lmcache:num_hit_tokens_total"),
                                                     _rate(p, "lmcache:num_requested_tokens_total")], ["hit", "requested"]),
        ("stored tokens per s", lambda p: [_rate(p, "lmcache:num_stored_tokens_total")], ["stored"]),
        ("retrieve hit rate (since start)", lambda p: [([x["t"] for x in p],
                                                        [x["samples"].get("lmcache:retrieve_hit_rate", 0) for x in p])], [""]),
        ("CPU tier usage (MiB)", lambda p: [([x["t"] for x in p],
                                             [x["samples"].get(HOT_USAGE, 0) / 2**20 for x in p])], [""]),
        ("mean time to retrieve / store (ms)", lambda p: [_mean_latency(p, "lmcache:time_to_retrieve"),
                                                          _mean_latency(p, "lmcache:time_to_store")], ["retrieve", "store"]),
        ("remote read / write bytes per s", lambda p: [_rate(p, "lmcache:remote_read_bytes_total"),
                                                       _rate(p, "lmcache:remote_write_bytes_total")], ["read", "write"]),
    ]
    for ax, (name, lines_of, labels) in zip(axes.flat, panels):
        for server, points in series_by_server.items():
            for (ts, ys), label in zip(lines_of(points), labels):
                if ts:
                    ax.plot(ts, ys, marker=".", label=f"{server} {label}".strip())
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds since the bench started", fontsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path
