"""The short form of `scripts/bench/soak_server.py`: a real server process under mixed load with idle
and drip-feeding sockets; every get is correct or a miss, every client served, RSS under its
bound. The full form (200 clients, 60 s) is run by hand: `scripts/bench/soak_server.py`."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from soak_server import check_value, make_value, run_soak  # noqa: E402


def test_values_prove_their_key_and_write() -> None:
    value = make_value("k1", 7, 100)
    assert check_value("k1", value)
    assert not check_value("k2", value)
    assert not check_value("k1", value[:-1] + bytes([value[-1] ^ 1]))
    assert not check_value("k1", make_value("k1", 8, 100)[:20] + value[20:])


def test_short_soak_with_idle_and_drip_feeding_sockets(tmp_path) -> None:
    report = run_soak(
        duration_s=4, clients=24, idle=12, drip=4, max_size_mb=64, frame_timeout_s=1.5, idle_timeout_s=2.0,
        log=tmp_path / "server.log",
    )
    assert report.gets_wrong == 0 and report.client_errors == 0, report.errors
    assert report.clients_served == 24 and report.gets_correct > 0 and report.puts_ok > 0
    assert report.oversize_refused > 0 and report.server_info["refused_too_large"] == 0  # refused client-side
    assert report.server_info["frame_timeouts"] >= 4  # the drip feeders were cut at their deadline
    assert report.server_info["idle_timeouts"] >= 12 and report.drip_reconnects >= 4
    assert report.rss_peak_bytes < report.rss_bound_bytes, report
    assert report.passed
