"""The node pool soak's figures from its records and samples (`soak_pool.py` runs it): the fixed
set's hit rate per window, each process's memory drift, the server's counters per window, the
targets and the printed table. Nothing here starts a process, so the tests run it as it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

RSS_DRIFT_MAX = 0.05  # the "RSS flat after warm-up"
HIT_RATE_DELTA_MAX = 0.05  # "the same hit rate at the end as after warm-up", in hit-rate points
# Shared pages a process may hold besides the arena (the first sample of an instance holds ~1 MiB);
# a client that mapped the arena twice would be over by the arena's size.
SHARED_SLACK_KIB = 16 * 1024


@dataclass
class SoakRecord:
    """One request."""

    kind: str  # "fixed" or "fresh"
    prompt: int  # its index among its kind
    header_id: str
    request_id: str  # vLLM's, as the instance's log line names it ("" when it failed)
    instance: int  # which instance served it (`route`)
    prompt_tokens: int
    ttft_s: float
    start_s: float  # on the run's clock
    error: str = ""


def window_hit_rates(records: Sequence[SoakRecord], hits: dict[str, int], warmup_s: float, window_s: float,
                     windows: int) -> list[dict]:
    """Per window after the warm-up (by request start): the fixed set's and the fresh prompts'
    LMCache hit tokens over prompt tokens (`hits`: request id -> hit tokens, from the log lines;
    a request without a line is counted in `unlogged`, not in the rate)."""
    out = []
    for w in range(windows):
        t0, t1 = warmup_s + w * window_s, warmup_s + (w + 1) * window_s
        row: dict = {"start_s": t0, "end_s": t1}
        for kind in ("fixed", "fresh"):
            inside = [r for r in records if r.kind == kind and not r.error and t0 <= r.start_s < t1]
            logged = [r for r in inside if r.request_id in hits]
            prompt = sum(r.prompt_tokens for r in logged)
            hit = sum(hits[r.request_id] for r in logged)
            row[kind] = {"requests": len(inside), "unlogged": len(inside) - len(logged), "prompt_tokens": prompt,
                         "hit_tokens": hit, "hit_rate": round(hit / prompt, 4) if prompt else None}
        out.append(row)
    return out


def counter_delta(series: Sequence[dict], name: str, t0: float, t1: float) -> Optional[float]:
    """How much server counter `name` grew between the last samples at or before `t0` and `t1`."""
    def at(t: float) -> Optional[float]:
        before = [s[name] for s in series if s["t"] <= t and s.get(name) is not None]
        return before[-1] if before else None

    a, b = at(t0), at(t1)
    return None if a is None or b is None else b - a


def rss_drift(samples: Sequence[tuple[float, float]], warmup_s: float) -> dict:
    """A memory series (t, KiB) against its first sample at or after `warmup_s`: the largest
    relative distance from it, the largest rise, and where the last sample ended."""
    after = [(t, v) for t, v in samples if t >= warmup_s]
    if not after or after[0][1] <= 0:
        return {"base_kib": None, "max_drift": None, "max_rise": None, "end_drift": None, "samples_after": 0}
    base = after[0][1]
    return {"base_kib": base, "max_drift": round(max(abs(v - base) for _, v in after) / base, 4),
            "max_rise": round(max(v - base for _, v in after) / base, 4),
            "end_drift": round((after[-1][1] - base) / base, 4), "samples_after": len(after)}


def process_memory(samples: Sequence[Sequence[float]], warmup_s: float) -> dict:
    """One process's series ([t, VmRSS, RssAnon, RssFile, RssShmem] in KiB): the drift of its own
    memory (RSS less its shared pages: the arena it maps, which the server's RSS counts too and
    which grows as the process first touches each block, up to the arena's size), the drift of
    its whole RSS, and the most shared pages it held."""
    return {"private": rss_drift([(s[0], s[1] - s[4]) for s in samples], warmup_s),
            "rss": rss_drift([(s[0], s[1]) for s in samples], warmup_s),
            "shmem_max_kib": max((s[4] for s in samples), default=None)}


def soak_targets(evictions_by_warmup: Optional[float], window_evictions: Sequence[Optional[float]],
                 memory: dict[str, dict], arena_kib: float, idle: dict, windows: Sequence[dict],
                 failed_requests: int) -> list[dict]:
    """The issue's targets, each measured and met or not (`memory`: `process_memory` per process)."""
    drifts = [m["private"] for m in memory.values()]
    worst = max((d["max_drift"] for d in drifts if d["max_drift"] is not None), default=None)
    unmeasured = [d for d in drifts if d["max_drift"] is None or d["samples_after"] < 2]
    shared = max((m["shmem_max_kib"] for m in memory.values() if m["shmem_max_kib"] is not None), default=None)
    held = None if idle.get("pool_leases") is None else idle["pool_leases"] + (idle.get("pool_reservations") or 0)
    first = windows[0]["fixed"]["hit_rate"] if windows else None
    last = windows[-1]["fixed"]["hit_rate"] if windows else None
    change = None if first is None or last is None else round(last - first, 4)
    evicting = (evictions_by_warmup is not None and evictions_by_warmup > 0 and bool(window_evictions)
                and all(e is not None and e > 0 for e in window_evictions))
    return [
        {"target": "the pool full and evicting by the end of the warm-up, and in every window after",
         "rule": "> 0 evictions by then, > 0 in every window", "measured": evictions_by_warmup, "met": evicting},
        {"target": "every process's RSS less its shared pages after the warm-up, relative to its first "
                   "sample after it", "rule": f"max |drift| <= {RSS_DRIFT_MAX} for every process", "measured": worst,
         "met": worst is not None and not unmeasured and worst <= RSS_DRIFT_MAX},
        {"target": "every process's shared pages (the arena it maps), KiB",
         "rule": f"<= the arena + {SHARED_SLACK_KIB} KiB", "measured": shared,
         "met": shared is not None and shared <= arena_kib + SHARED_SLACK_KIB},
        {"target": "the pool's leases + reservations at idle", "rule": "== 0", "measured": held, "met": held == 0},
        {"target": "the fixed set's hit rate, last window - first window after the warm-up",
         "rule": f"|change| <= {HIT_RATE_DELTA_MAX} and the first > 0", "measured": change,
         "met": change is not None and first > 0 and abs(change) <= HIT_RATE_DELTA_MAX},
        {"target": "requests that failed", "rule": "== 0", "measured": failed_requests, "met": failed_requests == 0},
    ]


def print_report(summary: dict) -> None:
    print(f"{'window':>13} {'fixed':>6} {'hit rate':>9} {'fresh':>6} {'hit rate':>9} {'evictions':>10}")
    for w in summary["windows"]:
        fx, fr = w["fixed"], w["fresh"]
        print(f"{w['start_s']:>5.0f}-{w['end_s']:<5.0f}s {fx['requests']:>6} {fx['hit_rate']!s:>9} "
              f"{fr['requests']:>6} {fr['hit_rate']!s:>9} {w['evictions']!s:>10}")
    print(f"{'process':28} {'own MiB':>8} {'max drift':>9} {'end':>7} {'RSS MiB':>8} {'max drift':>9} {'shared MiB':>10}")
    for name, m in summary["memory"].items():
        own, rss = m["private"], m["rss"]
        if own["base_kib"] is None:
            print(f"{name:28} (gone before the warm-up ended)")
            continue
        print(f"{name:28} {own['base_kib'] / 1024:>8.0f} {own['max_drift']:>9} {own['end_drift']:>7} "
              f"{rss['base_kib'] / 1024:>8.0f} {rss['max_drift']:>9} {m['shmem_max_kib'] / 1024:>10.0f}")
    for t in summary["targets"]:
        print(f"target [{'MET' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']} (want {t['rule']})")
