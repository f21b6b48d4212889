"""The controller benchmark (`scripts/bench/bench_controller.py`) in its quick mode: a real
`lmcache_controller`, filled over the workers' ZeroMQ wire and asked over HTTP, so the script
cannot rot between its real runs."""

from __future__ import annotations

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_controller import LOOKUP_SIZES, main  # noqa: E402


def test_quick_run_fills_the_index_checks_every_answer_and_reports_each_case(tmp_path, capsys):
    assert main(["--quick", "--out-dir", str(tmp_path)]) == 0  # 1: a lookup answered wrong
    (path,) = tmp_path.glob("controller-*.json")
    result = json.loads(path.read_text())
    assert result["setup"]["chunks"] == 400 and result["command"].endswith("--quick --out-dir " + str(tmp_path))
    assert sorted(result["cases"]) == sorted(f"{n}-{kind}" for n in LOOKUP_SIZES for kind in ("hit", "miss"))
    for case in result["cases"].values():
        assert case["requests"] == 20 and case["wrong_answers"] == 0
        assert 0 < case["p50_ms"] <= case["p99_ms"] <= case["max_ms"]
    assert result["target"]["met"] is False  # 400 chunks are not the target's 100k
    assert "MISSED" in capsys.readouterr().out
