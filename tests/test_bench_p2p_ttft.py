"""The P2P TTFT benchmark's summary (`scripts/bench/bench_p2p_ttft.py`) without servers: which
requests count, the medians, the ratio against the target, and the link's floor. The benchmark
itself needs two vLLM servers in namespaces and runs by hand (docs/benchmarks.md)."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_p2p_ttft import Measurement, link_floor_s, summarize  # noqa: E402


def m(prompt: int, kind: str, ttft_s: float, loaded: int = 3000) -> Measurement:
    return Measurement(prompt, kind, ttft_s, f"cmpl-p{prompt}-{kind}-0", 3000, loaded, 0 if kind == "miss" else loaded)


def test_medians_count_full_hits_only_and_leave_out_the_warm_up():
    measured = [
        m(-1, "miss", 9.0), m(-1, "local", 9.0), m(-1, "p2p", 9.0),  # warm-up: not summarized
        m(0, "miss", 5.0), m(0, "local", 0.10), m(0, "p2p", 0.14),
        m(1, "miss", 5.2), m(1, "p2p", 0.18), m(1, "local", 0.12),
        m(2, "miss", 4.8), m(2, "local", 0.11), m(2, "p2p", 0.50, loaded=2048),  # partial: not a P2P hit
    ]
    got = summarize(measured)
    assert got["median_ttft_s"] == {"miss": 5.0, "local": 0.11, "p2p": pytest.approx(0.16)}
    assert got["counted"] == {"miss": 3, "local": 3, "p2p": 2}
    assert got["not_full_hits"] == ["cmpl-p2-p2p-0"]
    assert got["ratio_p2p_local"] == pytest.approx(0.16 / 0.11)
    assert got["pair_ratios"] == [pytest.approx(1.4), pytest.approx(1.5)]
    assert got["target"]["met"] is True
    assert summarize(measured, target=1.4)["target"]["met"] is False


def test_no_hit_counted_is_no_ratio_and_a_missed_target():
    got = summarize([m(0, "miss", 5.0), m(0, "local", 0.1, loaded=0), m(0, "p2p", 0.1, loaded=-1)])
    assert got["median_ttft_s"]["local"] is None and got["ratio_p2p_local"] is None
    assert got["target"]["met"] is False


def test_link_floor_is_the_bytes_over_the_shaped_rate():
    assert link_floor_s(98_304_000, "10gbit") == pytest.approx(0.0786432)
    assert link_floor_s(125_000, "1mbit") == pytest.approx(1.0)
    assert link_floor_s(1, "none") is None
