"""The multi-instance benchmark's numbers: per-kind summaries, the issue's targets, and the figure.

- `summarize`: per kind, mean and p90 TTFT per round and overall, throughput, how many turns moved
  to another instance, the hit tokens each instance's `/metrics` counted, and the memory the
  kind's cache held at the end (the instances' own tiers plus the shared store: `store_gauges`).
- `targets` (issue 31): mean TTFT with the pool <= 0.5x the private tiers' and below `lm://`
  sharing's; one copy of each chunk on the machine (the instances hold no private copy and the
  pool holds less than the private tiers' sum). Issue 32: mean TTFT through Mooncake Store
  within 1.5x `lm://` sharing's. Issue 41: routed by `/lookup` (and so with P2P among the
  instances), <= 0.6x round robin over private tiers and <= 1.1x the node pool. Issue 42 (on
  machines of their own, `--link-gbit`): round robin with P2P <= 0.6x the private tiers and no
  worse than Mooncake Store.
- `plot`: TTFT per round, hit tokens and memory, one bar (group) per kind; `replot` draws a run's
  figure again from its JSON.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Mapping, Optional, Sequence

from bench_serving_report import percentile
from bench_serving_servers import KIND_COLORS, P2P_KIND, POOL_KIND, REDIS_KIND, ROUTED_KIND, ROUTED_P2P_KIND, VLLM_KIND
from multi_round_qa import QARecord

PRIVATE_KIND = "lmcache-cpu"
TCP_KIND = "lmcache-remote"
MOONCAKE_KIND = "lmcache-mooncake"
KIND_LABELS = {VLLM_KIND: "vLLM alone", PRIVATE_KIND: "private CPU tiers", POOL_KIND: "node pool (lm+shm)",
               TCP_KIND: "lm:// TCP sharing", MOONCAKE_KIND: "Mooncake Store sharing",
               ROUTED_KIND: "routed by /lookup", ROUTED_P2P_KIND: "routed, with P2P",
               P2P_KIND: "private tiers + P2P", REDIS_KIND: "Redis sharing"}
SHORT_LABELS = {VLLM_KIND: "vLLM\nalone", PRIVATE_KIND: "private\ntiers", POOL_KIND: "node pool\nlm+shm",
                TCP_KIND: "lm://\nTCP", MOONCAKE_KIND: "Mooncake\nStore", ROUTED_KIND: "routed by\n/lookup",
                ROUTED_P2P_KIND: "routed,\nwith P2P", P2P_KIND: "private\n+ P2P", REDIS_KIND: "Redis\nsharing"}
POOL_OVER_PRIVATE_MAX = 0.5
# Issue 41: routing by the controller's /lookup against round robin over the same private tiers,
# and against the node pool.
ROUTED_OVER_PRIVATE_MAX = 0.6
ROUTED_OVER_POOL_MAX = 1.1
MOONCAKE_OVER_TCP_MAX = 1.5
# Issue 42: round robin with P2P among the instances against the same private tiers without it,
# and against Mooncake Store on the same links.
P2P_OVER_PRIVATE_MAX = 0.6
P2P_OVER_MOONCAKE_MAX = 1.0


def ttft_stats(records: Sequence[QARecord]) -> dict:
    values = [r.ttft_s for r in records]
    return {"n": len(values), "ttft_mean_s": statistics.fmean(values), "ttft_p90_s": percentile(values, 90)}


def moved_turns(records: Sequence[QARecord]) -> dict:
    """Turns after a user's first, and how many of them ran on another instance than its last turn."""
    last: dict[int, str] = {}
    later = moved = 0
    for rec in sorted(records, key=lambda r: (r.round, r.start_s)):
        if rec.user in last:
            later += 1
            moved += rec.served_by != last[rec.user]
        last[rec.user] = rec.served_by
    return {"later_turns": later, "on_another_instance": moved}


def summarize_kind(records: Sequence[QARecord], wall_s: float, instances: Sequence[dict],
                   shared: Optional[dict]) -> dict:
    """`instances`: per instance, its final scrape (`instance_counters`); `shared`: the shared
    server's final `lmcache_server:` gauges (None without one)."""
    rounds = sorted({r.round for r in records})
    tokens = sum(r.prompt_tokens + r.output_tokens for r in records)
    private_bytes = sum(i["local_cache_bytes"] for i in instances)
    shared_bytes = shared["bytes_used"] if shared else 0.0
    return {
        **ttft_stats(records),
        "rounds": {str(k): ttft_stats([r for r in records if r.round == k]) for k in rounds},
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "output_tok_s": sum(r.output_tokens for r in records) / wall_s if wall_s > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "moved": moved_turns(records),
        "instances": list(instances),
        "vllm_prefix_hit_tokens": sum(i["vllm_prefix_hits"] for i in instances),
        "lmcache_hit_tokens": sum(i["lmcache_hit_tokens"] for i in instances),
        "memory": {"instances_bytes": private_bytes, "shared_bytes": shared_bytes,
                   "shared_entries": shared["entries"] if shared else None,
                   "total_bytes": private_bytes + shared_bytes},
    }


def instance_counters(lmcache: Mapping[str, float], vllm_hits: float, vllm_queries: float) -> dict:
    """One instance's final counters from its `/metrics` (`lmcache:` samples and vLLM's prefix cache)."""
    usage = sum(v for k, v in lmcache.items() if k.startswith("lmcache:local_cache_usage"))
    return {
        "vllm_prefix_queries": vllm_queries,
        "vllm_prefix_hits": vllm_hits,
        "lmcache_hit_tokens": lmcache.get("lmcache:num_hit_tokens_total", 0.0),
        "lmcache_stored_tokens": lmcache.get("lmcache:num_stored_tokens_total", 0.0),
        "local_cache_bytes": usage,
    }


# The shared store's gauges: `lmcache_server --metrics-port`'s, or the Mooncake master's.
STORE_GAUGES = {"bytes_used": ("lmcache_server:bytes_used", "master_allocated_bytes"),
                "entries": ("lmcache_server:entries", "master_key_count")}


def store_gauges(metrics_text: str) -> dict:
    """The shared store's `bytes_used` and `entries` from its /metrics (an `lm://` server's or a
    Mooncake master's)."""
    found = {"bytes_used": 0.0, "entries": 0.0}
    for line in metrics_text.splitlines():
        for name, samples in STORE_GAUGES.items():
            if line.split(" ", 1)[0] in samples:
                found[name] = float(line.split()[1])
    return found


def targets(summary: Mapping[str, dict]) -> list[dict]:
    """The issue's targets, each measured (None where a kind did not run) and met or not."""
    def mean(kind: str) -> Optional[float]:
        return summary[kind]["ttft_mean_s"] if kind in summary else None

    pool, private, tcp, mooncake = mean(POOL_KIND), mean(PRIVATE_KIND), mean(TCP_KIND), mean(MOONCAKE_KIND)
    ratio = pool / private if pool is not None and private else None
    out = [
        {"target": "mean TTFT, pool / private CPU tiers", "rule": f"<= {POOL_OVER_PRIVATE_MAX}",
         "measured": ratio, "met": None if ratio is None else ratio <= POOL_OVER_PRIVATE_MAX},
        {"target": "mean TTFT, pool / lm:// TCP sharing", "rule": "< 1",
         "measured": pool / tcp if pool is not None and tcp else None,
         "met": None if pool is None or not tcp else pool < tcp},
        {"target": "mean TTFT, Mooncake Store / lm:// TCP sharing", "rule": f"<= {MOONCAKE_OVER_TCP_MAX}",
         "measured": mooncake / tcp if mooncake is not None and tcp else None,
         "met": None if mooncake is None or not tcp else mooncake / tcp <= MOONCAKE_OVER_TCP_MAX},
    ]
    for kind, what in ((ROUTED_KIND, "routed by /lookup"), (ROUTED_P2P_KIND, "routed by /lookup, with P2P")):
        routed = mean(kind)
        out += [
            {"target": f"mean TTFT, {what} / round robin (private CPU tiers)", "rule": f"<= {ROUTED_OVER_PRIVATE_MAX}",
             "measured": routed / private if routed is not None and private else None,
             "met": None if routed is None or not private else routed / private <= ROUTED_OVER_PRIVATE_MAX},
            {"target": f"mean TTFT, {what} / node pool", "rule": f"<= {ROUTED_OVER_POOL_MAX}",
             "measured": routed / pool if routed is not None and pool else None,
             "met": None if routed is None or not pool else routed / pool <= ROUTED_OVER_POOL_MAX},
        ]
    if POOL_KIND in summary and PRIVATE_KIND in summary:
        mem, priv = summary[POOL_KIND]["memory"], summary[PRIVATE_KIND]["memory"]["total_bytes"]
        out.append({"target": "memory: one copy of each chunk (pool bytes / private tiers' sum; instances hold none)",
                    "rule": "instances 0 B, ratio < 1",
                    "measured": mem["total_bytes"] / priv if priv else None,
                    "met": mem["instances_bytes"] == 0 and bool(priv) and mem["total_bytes"] < priv})
    p2p = mean(P2P_KIND)
    for other, name, most in ((private, "private CPU tiers", P2P_OVER_PRIVATE_MAX),
                              (mooncake, "Mooncake Store sharing", P2P_OVER_MOONCAKE_MAX)):
        ratio = p2p / other if p2p is not None and other else None
        out.append({"target": f"mean TTFT, private tiers + P2P / {name}", "rule": f"<= {most}",
                    "measured": ratio, "met": None if ratio is None else ratio <= most})
    return out


def figure(summary: Mapping[str, dict], title: str):
    """Mean TTFT per round (p90 as a tick above each bar), and the memory held at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary)
    rounds = sorted({int(k) for s in summary.values() for k in s["rounds"]})
    fig, (ax_t, ax_h, ax_m) = plt.subplots(1, 3, figsize=(15, 5.4), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    width = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        xs = [r + (j - (len(kinds) - 1) / 2) * width for r in rounds]
        per = [summary[kind]["rounds"].get(str(r), {}) for r in rounds]  # a kind cut short lacks some
        means = [x.get("ttft_mean_s", float("nan")) for x in per]
        p90s = [x.get("ttft_p90_s", float("nan")) for x in per]
        color = KIND_COLORS.get(kind, "#333333")
        ax_t.bar(xs, means, width * 0.92, color=color,
                 label=f"{KIND_LABELS.get(kind, kind)}: mean {summary[kind]['ttft_mean_s']:.2f} s")
        ax_t.scatter(xs, p90s, marker="_", s=180, color="black", zorder=3,
                     label="p90" if j == len(kinds) - 1 else None)
    ax_t.set_xticks(rounds, [f"round {r + 1}" for r in rounds])
    ax_t.set_ylabel("TTFT (s)")
    ax_t.set_title("TTFT per round: bars mean, ticks p90")
    ax_t.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=9, frameon=False)
    ax_t.grid(axis="y", alpha=0.3)

    names = [SHORT_LABELS.get(k, k) for k in kinds]
    vllm_hits = [summary[k]["vllm_prefix_hit_tokens"] / 1e3 for k in kinds]
    our_hits = [summary[k]["lmcache_hit_tokens"] / 1e3 for k in kinds]
    ax_h.bar(range(len(kinds)), vllm_hits, color="#bbbbbb", label="vLLM's own prefix cache")
    ax_h.bar(range(len(kinds)), our_hits, bottom=vllm_hits, color=[KIND_COLORS.get(k, "#333333") for k in kinds],
             label="ours (LMCache), in the kind's colour")
    ax_h.set_xticks(range(len(kinds)), names, fontsize=9)
    ax_h.set_ylabel("thousand tokens")
    ax_h.set_title("Hit tokens, all instances\n(from each instance's /metrics)")
    ax_h.set_ylim(0, max([a + b for a, b in zip(vllm_hits, our_hits)] + [1]) * 1.1)
    ax_h.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, fontsize=8, frameon=False)
    ax_h.grid(axis="y", alpha=0.3)

    ours = [k for k in kinds if k != VLLM_KIND]  # vLLM alone keeps no cache outside its fixed KV space
    mib = [summary[k]["memory"]["total_bytes"] / 2**20 for k in ours]
    bars = ax_m.bar(range(len(ours)), mib, color=[KIND_COLORS.get(k, "#333333") for k in ours])
    for bar, value in zip(bars, mib):
        ax_m.annotate(f"{value:.0f}" if value >= 10 else f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax_m.set_xticks(range(len(ours)), [SHORT_LABELS.get(k, k) for k in ours], fontsize=9)
    ax_m.set_ylabel("MiB")
    ax_m.set_title("KV cache memory at the end\n(instances' tiers + shared store)")
    ax_m.set_ylim(0, max(mib + [1]) * 1.18)
    ax_m.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_title(result: Mapping) -> str:
    sizes = result["sizes"]
    machines = result.get("settings", {}).get("machines")
    where = f" on machines of their own, links of {machines['link_gbit']:g} Gbit/s," if machines else ""
    return (f"Multi-instance: {result['instances']} instances{where} behind a round-robin proxy, {sizes['users']} "
            f"users x {sizes['rounds']} rounds ({result['started']}, {result['machine']['cpus']} CPUs)")


def replot(json_path: Path) -> Path:
    """Draw a run's figure again from its JSON, beside it."""
    import json

    result = json.loads(json_path.read_text())
    out = json_path.with_suffix(".png")
    plot(result["summary"], plot_title(result), out)
    return out


def plot(summary: Mapping[str, dict], title: str, out) -> None:
    import matplotlib.pyplot as plt

    fig = figure(summary, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
