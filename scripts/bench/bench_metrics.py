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
from typing import Dict, List, Mapping, Optional, Sequence

from bench_serving_servers import KIND_COLORS

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


def scraped_series(processes: Mapping[str, Sequence[dict]]) -> Dict[str, List[dict]]:
    """Each server process's scraped series from a result JSON's `processes`, named `<kind>#<n>`."""
    return {f"{kind}#{i + 1}": run["lmcache_metrics"]["series"] for kind, runs in processes.items()
            for i, run in enumerate(runs) if "lmcache_metrics" in run}


def dashboard_title(started: str) -> str:
    return f"lmcache: metrics scraped from /metrics during the run of {started}"


def dashboard_figure(series_by_server: Dict[str, List[dict]], title: str):
    """The dashboard's six panels over every server process's scraped series: a colour per server kind
    (its processes ran one after another), solid and dashed lines for a panel's two series, one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 3, figsize=(16, 8), dpi=90, layout="constrained")
    hit_rate, usage = "lmcache:retrieve_hit_rate", HOT_USAGE
    panels = [
        ("hit (solid) / requested (dashed) tokens per s",
         lambda p: [_rate(p, "lmcache:num_hit_tokens_total"), _rate(p, "lmcache:num_requested_tokens_total")]),
        ("stored tokens per s", lambda p: [_rate(p, "lmcache:num_stored_tokens_total")]),
        ("retrieve hit rate (since start)",
         lambda p: [([x["t"] for x in p], [x["samples"].get(hit_rate, 0) for x in p])]),
        ("CPU tier usage (MiB)", lambda p: [([x["t"] for x in p], [x["samples"].get(usage, 0) / 2**20 for x in p])]),
        ("mean time to retrieve (solid) / store (dashed), ms",
         lambda p: [_mean_latency(p, "lmcache:time_to_retrieve"), _mean_latency(p, "lmcache:time_to_store")]),
        ("remote read (solid) / write (dashed) bytes per s",
         lambda p: [_rate(p, "lmcache:remote_read_bytes_total"), _rate(p, "lmcache:remote_write_bytes_total")]),
    ]
    kinds = list(dict.fromkeys(server.split("#")[0] for server in series_by_server))
    colors = {kind: KIND_COLORS.get(kind, f"C{i}") for i, kind in enumerate(kinds)}
    for ax, (name, lines_of) in zip(axes.flat, panels):
        for server, points in series_by_server.items():
            for (ts, ys), style in zip(lines_of(points), ("-", "--")):
                if ts:
                    ax.plot(ts, ys, style, marker=".", markersize=3, color=colors[server.split("#")[0]])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds since the bench started", fontsize=8)
        ax.grid(alpha=0.3)
    fig.legend([Line2D([], [], color=colors[k], marker=".") for k in kinds], kinds, loc="outside upper center",
               ncol=max(len(kinds), 1), fontsize=9, frameon=False, title=title, title_fontsize=10)
    return fig


def dashboard_png(series_by_server: Dict[str, List[dict]], png_path: Path, title: str) -> Optional[Path]:
    """`dashboard_figure` as a PNG; None when nothing was scraped."""
    if not any(series_by_server.values()):
        return None
    import matplotlib.pyplot as plt

    fig = dashboard_figure(series_by_server, title)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
