"""The node pool soak's pure parts (no vLLM): its schedule, the hit rate per window, RSS drift,
server counter deltas and the targets' verdicts. The soak itself is `scripts/bench/soak_pool.py`."""

from __future__ import annotations

import itertools
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from soak_pool import SoakSizes, prompt_text, route, schedule  # noqa: E402
from soak_pool_report import (  # noqa: E402
    SoakRecord, counter_delta, process_memory, rss_drift, soak_targets, window_hit_rates,
)


def rec(kind: str, start_s: float, tokens: int, rid: str, error: str = "") -> SoakRecord:
    return SoakRecord(kind, 0, rid, rid, 0, tokens, 0.1, start_s, error)


def test_schedule_repeats_the_fixed_set_and_never_a_fresh_prompt():
    items = list(itertools.islice(schedule(SoakSizes(fixed_prompts=3, fresh_per_fixed=2)), 18))
    assert items[:6] == [("fixed", 0), ("fresh", 0), ("fresh", 1), ("fixed", 1), ("fresh", 2), ("fresh", 3)]
    assert [i for k, i in items if k == "fixed"] == [0, 1, 2, 0, 1, 2]
    fresh = [i for k, i in items if k == "fresh"]
    assert fresh == list(range(12))
    sizes = SoakSizes(fixed_words=50, fresh_words=60)
    assert prompt_text(sizes, "fixed", 1) == prompt_text(sizes, "fixed", 1) != prompt_text(sizes, "fixed", 2)
    assert len(prompt_text(sizes, "fresh", 0).split()) == 60
    assert prompt_text(sizes, "fresh", 0) != prompt_text(sizes, "fixed", 0)


def test_route_sends_each_fixed_prompt_to_every_instance():
    sizes = SoakSizes(fixed_prompts=4, fresh_per_fixed=1)
    items = list(itertools.islice(schedule(sizes), 400))
    assert [route(sizes, n, 3) for n in range(50)] == [route(sizes, n, 3) for n in range(50)]  # seeded
    for k in range(4):
        assert {route(sizes, n, 2) for n, item in enumerate(items) if item == ("fixed", k)} == {0, 1}
        assert {route(sizes, n, 3) for n, item in enumerate(items) if item == ("fixed", k)} == {0, 1, 2}


def test_window_hit_rate_is_hit_tokens_over_prompt_tokens_of_logged_requests_by_start():
    records = [
        rec("fixed", 5.0, 100, "warm"),  # in the warm-up: no window
        rec("fixed", 10.0, 100, "a"), rec("fixed", 19.9, 300, "b"), rec("fresh", 12.0, 200, "c"),
        rec("fixed", 20.0, 100, "d"), rec("fixed", 25.0, 100, "unlogged"), rec("fixed", 26.0, 100, "e", "boom"),
        rec("fixed", 30.0, 100, "after"),  # past the last window
    ]
    hits = {"warm": 0, "a": 100, "b": 100, "c": 0, "d": 50, "e": 100, "after": 0}
    rows = window_hit_rates(records, hits, warmup_s=10, window_s=10, windows=2)
    assert [(r["start_s"], r["end_s"]) for r in rows] == [(10, 20), (20, 30)]
    assert rows[0]["fixed"] == {"requests": 2, "unlogged": 0, "prompt_tokens": 400, "hit_tokens": 200,
                                "hit_rate": 0.5}
    assert rows[0]["fresh"]["hit_rate"] == 0.0 and rows[0]["fresh"]["requests"] == 1
    assert rows[1]["fixed"] == {"requests": 2, "unlogged": 1, "prompt_tokens": 100, "hit_tokens": 50,
                                "hit_rate": 0.5}
    assert rows[1]["fresh"]["hit_rate"] is None  # nothing to rate


def test_rss_drift_is_measured_from_the_first_sample_after_the_warm_up():
    samples = [(0, 500), (10, 900), (20, 1000), (30, 1040), (40, 970), (50, 1010)]
    assert rss_drift(samples, warmup_s=20) == {"base_kib": 1000, "max_drift": 0.04, "max_rise": 0.04,
                                               "end_drift": 0.01, "samples_after": 4}
    assert rss_drift(samples, warmup_s=15)["base_kib"] == 1000  # the first one at or after it
    assert rss_drift([(0, 1000), (30, 900)], warmup_s=20)["max_drift"] == 0.0  # one sample: nothing moved
    assert rss_drift(samples, warmup_s=60)["max_drift"] is None


def test_process_memory_leaves_the_shared_arena_pages_out_of_the_own_drift():
    # [t, VmRSS, RssAnon, RssFile, RssShmem]: the arena pages touched grow, the rest holds
    samples = [[0, 1000, 800, 200, 0], [10, 1300, 800, 200, 300], [20, 1500, 810, 200, 490]]
    got = process_memory(samples, warmup_s=10)
    assert got["private"]["base_kib"] == 1000 and got["private"]["max_drift"] == 0.01
    assert got["rss"]["base_kib"] == 1300 and got["rss"]["max_drift"] == round(200 / 1300, 4)
    assert got["shmem_max_kib"] == 490


def test_counter_delta_takes_the_last_samples_at_or_before_each_end():
    series = [{"t": 0, "evictions": 0}, {"t": 10, "evictions": 5}, {"t": 20, "evictions": None},
              {"t": 30, "evictions": 12}]
    assert counter_delta(series, "evictions", 10, 30) == 7
    assert counter_delta(series, "evictions", 12, 25) == 0  # no sample between: nothing seen
    assert counter_delta(series, "evictions", -1, 30) is None


def mem(drift: float, shared: float = 100.0, samples_after: int = 10) -> dict:
    return {"private": {"max_drift": drift, "samples_after": samples_after}, "shmem_max_kib": shared}


def flat() -> dict:
    return {"server x 1": mem(0.01, shared=1000.0), "instance-0 python 2": mem(0.03)}


def windows(first: float, last: float) -> list[dict]:
    return [{"fixed": {"hit_rate": first}}, {"fixed": {"hit_rate": 0.5}}, {"fixed": {"hit_rate": last}}]


def verdicts(**kw) -> list[bool]:
    args = dict(evictions_by_warmup=10, window_evictions=[3, 4, 5], memory=flat(), arena_kib=1000.0,
                idle={"pool_leases": 0, "pool_reservations": 0}, windows=windows(0.9, 0.87), failed_requests=0)
    args.update(kw)
    return [t["met"] for t in soak_targets(**args)]


def test_targets_pass_a_steady_run_and_each_catches_its_own_failure():
    assert verdicts() == [True] * 6
    assert verdicts(evictions_by_warmup=0)[0] is False
    assert verdicts(window_evictions=[3, 0, 5])[0] is False  # stopped evicting: no churn in that window
    assert verdicts(memory={**flat(), "instance-1 python 3": mem(0.051)})[1] is False
    assert verdicts(memory={**flat(), "x": mem(0.0, samples_after=1)})[1] is False  # not watched after warm-up
    assert verdicts(memory={**flat(), "instance-1 python 3": mem(0.0, shared=1000.0 + 16 * 1024 + 1)})[2] is False
    assert verdicts(idle={"pool_leases": 1, "pool_reservations": 0})[3] is False
    assert verdicts(idle={"pool_leases": 0, "pool_reservations": 2})[3] is False
    assert verdicts(idle={"pool_leases": None})[3] is False
    assert verdicts(windows=windows(0.9, 0.84))[4] is False  # decayed
    assert verdicts(windows=windows(0.6, 0.9))[4] is False  # not the same either way
    assert verdicts(windows=windows(0.0, 0.0))[4] is False  # never hit: no pool at all
    assert verdicts(windows=windows(0.9, None))[4] is False  # no fixed request in the last window
    assert verdicts(failed_requests=1)[5] is False
    measured = soak_targets(10, [1], flat(), 1000.0, {"pool_leases": 0, "pool_reservations": 0},
                            windows(0.9, 0.87), 0)
    assert [t["measured"] for t in measured] == [10, 0.03, 1000.0, 0, -0.03, 0]
