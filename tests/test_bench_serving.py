"""The serving benchmark harness: its plans, parsers and numbers, and a `--quick` run on real servers.

No timing is asserted (the machine is shared and noisy): only that the harness sends the same
requests everywhere, parses what servers report, computes its statistics right, and that a quick run
against a real server with our disk tier (restart included) writes a well-formed JSON and PNG.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, VLLM_TEST_ENV
from helpers import text_clashes

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_serving_client import PrefixCounters, parse_prefix_counters  # noqa: E402
from bench_serving_report import (  # noqa: E402
    attach_lmcache_hits, decode_itl, figure, hit_retrieve_gbps, interference, itl_during, percentile, plot,
    plot_title, ratios, replot, summarize, targets,
)
from bench_serving_workloads import (  # noqa: E402
    FIRST_ORDINARY_TOKEN, PhaseTotals, RequestRecord, WorkloadSizes, build_plan, query_order,
)

SMALL = WorkloadSizes(vocab=1024, repeat_prompts=3, prompt_tokens=50, docs=5, doc_tokens=40, question_tokens=4,
                      rounds=3, unique_prompts=4, unique_tokens=30, concurrency=2, interference_rounds=2,
                      interference_prefix_tokens=60, stream_tokens=6, stream_max_tokens=20)


def requests_of(steps):
    return [r for step in steps for r in step.requests]


def test_plans_are_the_same_for_every_build_and_change_with_the_seed():
    for workload in ("repeat", "beyond", "unique"):
        assert build_plan(workload, SMALL) == build_plan(workload, SMALL)
        other = WorkloadSizes(**{**SMALL.__dict__, "seed": 1})
        assert [r.prompt for r in requests_of(build_plan(workload, SMALL))] != [
            r.prompt for r in requests_of(build_plan(workload, other))
        ]


def test_prompts_have_exact_lengths_and_only_ordinary_tokens():
    reqs = requests_of(build_plan("repeat", SMALL) + build_plan("beyond", SMALL) + build_plan("unique", SMALL))
    lengths = {(r.workload, len(r.prompt)) for r in reqs}
    assert lengths == {("repeat", 50), ("beyond", 44), ("unique", 30)}
    assert all(FIRST_ORDINARY_TOKEN <= t < 1024 for r in reqs for t in r.prompt)


def test_repeat_clears_vllm_cache_before_first_and_second_but_not_before_limit():
    steps = build_plan("repeat", SMALL)
    shape = ["reset" if s.reset else s.requests[0].phase for s in steps]
    assert shape == ["reset", "first", "reset", "second", "limit"] * 3
    per_prompt = [requests_of(steps)[i : i + 3] for i in range(0, 9, 3)]
    assert all(len({r.prompt for r in trio}) == 1 for trio in per_prompt)
    assert len({trio[0].prompt for trio in per_prompt}) == 3
    restart = build_plan("restart", SMALL)
    assert [r.prompt for r in requests_of(restart)] == [r.prompt for r in requests_of(steps)]
    assert {r.workload for r in requests_of(restart)} == {"restart"}


def test_beyond_warms_every_document_then_queries_shuffled_rounds_with_fresh_questions():
    order = query_order(SMALL)
    assert len(order) == 15
    for k in range(3):
        assert sorted(order[5 * k : 5 * k + 5]) == list(range(5))
    assert all(a != b for a, b in zip(order, order[1:]))
    reqs = requests_of(build_plan("beyond", SMALL))
    warm, queries = reqs[:5], reqs[5:]
    assert [r.doc for r in warm] == list(range(5)) and [r.doc for r in queries] == order
    for r in reqs:
        assert r.prompt[:40] == warm[r.doc].prompt[:40]
    assert len({r.prompt[40:] for r in reqs}) == len(reqs)


def test_unique_prompts_differ_from_their_first_tokens_and_run_in_concurrent_passes():
    steps = build_plan("unique", SMALL)
    assert steps[0].reset and len(steps) == 1 + SMALL.unique_passes
    assert all(len(st.requests) == 4 and st.concurrency == 2 and st.timed_pass for st in steps[1:])
    # a pass of one request is still a timed pass (its tokens/s feeds the side-by-side ratio)
    single = build_plan("unique", WorkloadSizes(**{**SMALL.__dict__, "unique_prompts": 1, "concurrency": 1}))
    assert all(st.timed_pass and len(st.requests) == 1 for st in single[1:])
    prompts = [r.prompt for r in requests_of(steps)]
    assert len({p[:8] for p in prompts}) == len(prompts) == 4 * SMALL.unique_passes
    assert [r.index for r in requests_of(steps)] == list(range(len(prompts)))


def test_interference_stores_the_prefix_then_loads_it_while_another_request_streams():
    steps = build_plan("interference", SMALL)
    shape = ["reset" if s.reset else s.requests[0].phase + ("+" + s.overlap.phase if s.overlap else "") for s in steps]
    assert shape == ["reset", "store", "reset", "alone", "stream+load"] * 2
    for i in range(2):
        store, alone, during = (steps[5 * i + k] for k in (1, 3, 4))
        assert during.overlap.prompt == store.requests[0].prompt and len(store.requests[0].prompt) == 60
        assert len({alone.requests[0].prompt, during.requests[0].prompt, store.requests[0].prompt}) == 3
        assert alone.requests[0].max_tokens == during.requests[0].max_tokens == 20
    assert steps[1].requests[0].prompt != steps[6].requests[0].prompt


def test_sizes_refuse_requests_longer_than_the_model_length():
    with pytest.raises(ValueError, match="max-model-len"):
        SMALL.validate(max_model_len=48)
    with pytest.raises(ValueError, match="--docs"):
        WorkloadSizes(vocab=1024, docs=0).validate(4096)


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0, 10.0], 90) == pytest.approx(7.6)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_prefix_counters_are_summed_over_label_sets_and_required():
    page = (
        "# HELP vllm:prefix_cache_queries_total x\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1500.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1.408e+03\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 99.0\n'
    )
    assert parse_prefix_counters(page) == PrefixCounters(2000.0, 1408.0)
    with pytest.raises(RuntimeError, match="hits"):
        parse_prefix_counters(page.replace("vllm:prefix_cache_hits_total", "other"))


def test_request_lines_of_the_v1_door_are_attached_by_request_id():
    log = (
        "[2026-01-01 00:00:00] LMCache INFO: LMCache request cmpl-bench-a-0: prompt_tokens=3000 "
        "vllm_cached_tokens=0 lmcache_hit_tokens=2816 loaded_tokens=2816 stored_tokens=184 (scheduler_side.py)\n"
        "INFO noise\n"
        "LMCache request cmpl-bench-b-0-9dd58e56: prompt_tokens=10 vllm_cached_tokens=0 lmcache_hit_tokens=0 "
        "loaded_tokens=0 stored_tokens=0 (not stored: skip_save)\n"  # vLLM 0.32 appends 8 hex digits
    )
    a, b, other = (RequestRecord("s", "w", "p", i, None, rid, 10, 8, 0.1, 0.2, 0.0, None)
                   for i, rid in enumerate(["cmpl-bench-a-0", "cmpl-bench-b-0", "cmpl-other"]))
    assert attach_lmcache_hits([a, b, other], log) == 2
    assert (a.lmcache_hit_tokens, a.lmcache_loaded_tokens, a.lmcache_stored_tokens) == (2816, 2816, 184)
    assert (b.lmcache_hit_tokens, b.lmcache_stored_tokens) == (0, 0) and other.lmcache_hit_tokens is None


def record(server, workload, phase, ttft, prompt=1000, hit=None, i=0):
    return RequestRecord(server, workload, phase, i, None, f"cmpl-{server}-{workload}-{phase}-{i}-0", prompt, 8,
                         ttft, ttft + 0.5, 0.0, 0.0, hit)


def test_summary_ratios_and_targets_from_known_numbers(tmp_path):
    recs = [record("vllm", "repeat", "first", 6.0), record("vllm", "repeat", "second", 6.0),
            record("vllm", "repeat", "limit", 0.1),
            record("vllm", "beyond", "query", 6.0, i=0), record("vllm", "beyond", "query", 4.0, i=1),
            record("vllm-beside-lmcache-cpu", "unique", "unique", 3.0),
            record("lmcache-cpu", "repeat", "first", 6.0, hit=0), record("lmcache-cpu", "repeat", "second", 0.2, hit=1000),
            record("lmcache-cpu", "repeat", "limit", 0.1, hit=1000),
            record("lmcache-cpu", "beyond", "query", 0.5, hit=900, i=0),
            record("lmcache-cpu", "beyond", "query", 1.5, hit=900, i=1),
            record("lmcache-cpu", "unique", "unique", 3.0, hit=0)]
    totals = {"vllm-beside-lmcache-cpu": {("unique", "unique"): PhaseTotals(10.0, PrefixCounters(1000, 0),
                                                                            [90.0, 100.0, 300.0])},
              "lmcache-cpu": {("unique", "unique"): PhaseTotals(12.5, PrefixCounters(1000, 0), [80.0, 50.0, 90.0])}}
    s = summarize(recs, totals)
    beyond = s["lmcache-cpu"]["beyond"]["query"]
    assert beyond["n"] == 2 and beyond["ttft_mean_s"] == pytest.approx(1.0)
    assert beyond["ttft_p50_s"] == pytest.approx(1.0) and beyond["ttft_p90_s"] == pytest.approx(1.4)
    assert beyond["lmcache_hit_rate"] == pytest.approx(0.9)
    assert s["vllm"]["beyond"]["query"]["lmcache_hit_rate"] is None
    alone = s["vllm-beside-lmcache-cpu"]["unique"]["unique"]
    assert alone["throughput_tok_s"] == pytest.approx(100.8) and alone["throughput_tok_s_median"] == pytest.approx(100.0)
    assert s["vllm"]["beyond"]["query"]["throughput_tok_s_passes"] == []
    assert alone["vllm_prefix_hit_rate"] == 0.0
    r = ratios(s)
    assert set(r) == {"lmcache-cpu"}
    cpu = r["lmcache-cpu"]
    assert cpu["beyond_query_ttft"] == pytest.approx(5.0)
    assert cpu["repeat_second_ttft"] == pytest.approx(30.0)
    assert cpu["hit_over_limit"] == pytest.approx(2.0)
    # side by side: the median of the pass pairs' ratios 90/80, 100/50, 300/90
    assert cpu["unique_throughput"] == pytest.approx(2.0)
    assert cpu["restart_first_ttft"] is None
    verdicts = {t["target"].split(":")[0]: t["met"] for t in targets(r)}
    assert verdicts == {"beyond": True, "repeat": False, "unique": False}
    out = tmp_path / "plot.png"
    plot(s, r, "test", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_the_committed_serving_plot_has_no_text_over_text_or_axes(tmp_path):
    # The latest full run: six servers, every panel filled, the ratio table below.
    result = json.loads((ROOT / "bench/results/latest.json").read_text())
    fig = figure(result["summary"], result["ratios_vllm_over_ours"], plot_title(result), result["interference"])
    assert text_clashes(fig) == []
    # Redrawing a run from its JSON writes the PNG beside it (this older run scraped no metrics).
    (tmp_path / "run.json").write_text((ROOT / "bench/results/latest-vllm0.32.0.json").read_text())
    assert replot(tmp_path / "run.json") == [tmp_path / "run.png"]
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layerwise_target_compares_our_two_hits_without_a_vllm_alone_run():
    recs = [record("lmcache-cpu", "repeat", "second", 0.05, hit=1000),
            record("lmcache-cpu-layerwise", "repeat", "second", 0.04, hit=1000)]
    r = ratios(summarize(recs, {}))
    [layerwise] = [t for t in targets(r) if t["target"] == "repeat: layer-wise hit TTFT / without"]
    assert layerwise["measured"] == pytest.approx(0.8) and layerwise["met"] is True


def test_hit_retrieve_rate_sums_every_process_of_a_kind_and_is_judged_against_memcpy():
    def run(seconds: float, loaded: int) -> dict:
        return {"lmcache_metrics": {"final": {"lmcache:time_to_retrieve_sum": seconds},
                                    "agreement": {"log_loaded_tokens": loaded}}}

    processes = {"lmcache-disk": [run(0.5, 1000), run(0.5, 3000)],  # first run and the restart
                 "lmcache-cpu": [run(0.0, 0)],  # nothing loaded: no rate
                 "vllm": [{}]}
    gbps = hit_retrieve_gbps(processes, kv_bytes_per_token=1_000_000)
    assert gbps == {"lmcache-disk": pytest.approx(4.0)}
    rows = [t for t in targets({}, None, {"lmcache-disk": 0.5, "lmcache-remote": 0.9})
            if t["target"] == "repeat: retrieve inside our hits / memcpy"]
    assert [(t["server"], t["met"]) for t in rows] == [("lmcache-disk", False), ("lmcache-remote", True)]


@pytest.mark.vllm
def test_quick_run_on_a_real_server_writes_sane_json_and_png(tmp_path):
    """`--quick`: tiny model, our server with the disk tier, every workload including the restart;
    and `interference` on the slow lm:// tier with asynchronous loading."""
    env = {**os.environ, **VLLM_TEST_ENV, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_serving.py"), "--quick",
                           "--servers", "lmcache-disk,lmcache-remote-slow-async", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    stamped = sorted(tmp_path.glob("serving-*.json"))
    assert len(stamped) == 1 and (tmp_path / "latest.json").read_text() == stamped[0].read_text()
    for png in (tmp_path / "latest.png", stamped[0].with_suffix(".png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(stamped[0].read_text())
    assert result["schema"] == "lmcache-bench-serving/1" and result["errors"] == {}
    assert result["servers"] == ["lmcache-disk", "lmcache-remote-slow-async"]
    summary = result["summary"]["lmcache-disk"]
    expected = {"repeat": {"first", "second", "limit"}, "beyond": {"warmup", "query"}, "unique": {"unique"},
                "restart": {"first", "second", "limit"}}
    assert {w: set(p) for w, p in summary.items()} == expected
    sizes = result["sizes"]
    assert summary["repeat"]["second"]["n"] == sizes["repeat_prompts"]
    assert summary["beyond"]["query"]["n"] == sizes["docs"] * sizes["rounds"]
    assert summary["unique"]["unique"]["n"] == sizes["unique_prompts"] * sizes["unique_passes"]
    assert len(summary["unique"]["unique"]["throughput_tok_s_passes"]) == sizes["unique_passes"]
    for phases in summary.values():
        for x in phases.values():
            assert 0 < x["ttft_min_s"] <= x["ttft_p50_s"] <= x["ttft_p90_s"] <= x["ttft_max_s"]
            assert x["ttft_mean_s"] <= x["latency_mean_s"] and x["throughput_tok_s"] > 0
            assert 0.0 <= x["lmcache_hit_rate"] <= 1.0
            assert x["vllm_prefix_hit_rate"] is None or 0.0 <= x["vllm_prefix_hit_rate"] <= 1.0
    # Our cache has to show up in the numbers: nothing cached on the first send, all of it on
    # the second (vLLM's own cache was cleared), and after the restart from the disk tier.
    assert summary["repeat"]["first"]["lmcache_hit_tokens"] == 0
    for workload in ("repeat", "restart"):
        second = summary[workload]["second"]
        assert second["lmcache_loaded_tokens"] > 0 and second["lmcache_hit_rate"] >= 0.9
    assert summary["restart"]["first"]["lmcache_hit_rate"] >= 0.9
    assert summary["repeat"]["second"]["vllm_prefix_hit_rate"] == 0.0
    assert summary["repeat"]["limit"]["vllm_prefix_hit_rate"] > 0.0
    hit = result["hit_retrieve"]  # the copy inside our hits, against a memcpy of the same run
    assert hit["memcpy_gbps"] > 0 and hit["gbps"]["lmcache-disk"] > 0
    assert hit["over_memcpy"]["lmcache-disk"] == pytest.approx(hit["gbps"]["lmcache-disk"] / hit["memcpy_gbps"])
    assert len(result["requests"]) == sum(x["n"] for server in result["summary"].values() for p in server.values()
                                          for x in p.values())
    # the restart ran on a second process, `unique` on a third beside a vLLM alone (passes in turn)
    assert len(result["processes"]["lmcache-disk"]) == 3 and len(result["processes"]["vllm"]) == 1
    alone = result["summary"]["vllm-beside-lmcache-disk"]["unique"]["unique"]
    assert alone["n"] == summary["unique"]["unique"]["n"] and alone["lmcache_hit_tokens"] is None
    assert result["ratios_vllm_over_ours"]["lmcache-disk"]["unique_throughput"] > 0
    assert len(result["processes"]["lmcache-remote-slow-async"]) == 1
    for runs in result["processes"].values():
        for run in runs:
            assert run["exit_code"] is not None and run["ready_s"] > 0
            cpu = run["cpu_while_measured"]
            assert cpu["our_cpu_s"] > 0 and 0.0 <= cpu["foreign_share"] <= 1.0
    # interference: the prefix stored by the first send loads from the slow lm:// tier, in the
    # background (the worker's loader thread), while the other request streams.
    slow = result["summary"]["lmcache-remote-slow-async"]
    assert {w: set(p) for w, p in slow.items()} == {"interference": {"store", "alone", "stream", "load"}}
    assert slow["interference"]["store"]["lmcache_hit_tokens"] == 0
    assert slow["interference"]["load"]["lmcache_hit_rate"] >= 0.9 and slow["interference"]["load"]["lmcache_loaded_tokens"] > 0
    (round_,) = result["interference"]["lmcache-remote-slow-async"]["rounds"]
    assert round_["itl_alone_s"] > 0 and round_["itl_with_load_s"] > 0 and round_["load_hit_tokens"] == 512
    log = open(result["processes"]["lmcache-remote-slow-async"][0]["log"]).read()
    assert re.search(r"background load done, (\d+) leading tokens ready of \1 promised", log), log[-3000:]
    assert [t["met"] is not None for t in result["targets"] if t["target"].startswith("interference")] == [True]


def test_inter_token_latency_alone_and_across_a_load_window():
    times = [(1.0, 1), (1.1, 2), (1.2, 3), (2.0, 5), (2.1, 6)]  # two tokens merged into one chunk at 2.0
    assert decode_itl(times) == pytest.approx(1.1 / 5)
    # A load from 1.15 s to 1.9 s: from the chunk at 1.1 to the first one at or after 1.9 (2.0): 0.9 s / 3.
    assert itl_during(times, 1.15, 1.9) == (pytest.approx(0.3), True)
    assert itl_during(times, 1.15, 3.0) == (pytest.approx(1.0 / 4), False)  # the stream ended first
    with pytest.raises(ValueError):
        decode_itl([(1.0, 1)])


def test_interference_rounds_ratios_and_target():
    def rec(server, phase, i, start, ttft, times, hit=None):
        return RequestRecord(server, "interference", phase, i, None, f"cmpl-{server}-{phase}-{i}-0", 60, 20, ttft,
                             ttft + 1, start, None, hit, hit, 0, token_times=times)

    alone = [(0.0, 1), (1.0, 11)]  # 0.1 s per token
    records = []
    for server, stall in (("lmcache-remote-slow", 1.0), ("lmcache-remote-slow-async", 0.0)):
        for i in range(3):
            stream = [(10.0, 1), (10.5, 5), (10.5 + 0.1 * 6 + stall, 11)]  # load window 10.6 - 11.0
            records += [rec(server, "store", i, 0.0, 5.0, [(5.0, 1)]), rec(server, "alone", i, 6.0, 0.05, alone),
                        rec(server, "stream", i, 9.9, 0.1, stream), rec(server, "load", i, 10.6, 0.4, [], hit=60)]
    itl = interference(records)
    slow, fast = itl["lmcache-remote-slow"], itl["lmcache-remote-slow-async"]
    assert fast["ratio_median"] == pytest.approx(1.0) and slow["ratio_median"] == pytest.approx(16 / 6 / 1.0)
    assert [r["covered"] for r in fast["rounds"]] == [True] * 3 and fast["rounds"][0]["load_hit_tokens"] == 60
    verdict = [t for t in targets({}, itl) if t["target"].startswith("interference")]
    assert [(t["server"], t["met"]) for t in verdict] == [("lmcache-remote-slow-async", True)]


def test_mode_kinds_add_their_switch_to_their_tier_and_keep_a_disk_of_their_own():
    from bench_serving_servers import ServerSettings, remote_server_launch, tier_env

    settings = ServerSettings(model="m", max_model_len=1024, block_size=16, num_kv_blocks=8, chunk_size=256,
                              cpu_tier_gb=1, disk_tier_gb=1, remote_tier_gb=1, disk_dir="/d")
    layerwise = tier_env("lmcache-cpu-layerwise", settings, None)
    assert layerwise == {**tier_env("lmcache-cpu", settings, None), "LMCACHE_USE_LAYERWISE": "True"}
    disk, disk_async = tier_env("lmcache-disk", settings, None), tier_env("lmcache-disk-async", settings, None)
    assert disk_async["LMCACHE_ENABLE_ASYNC_LOADING"] == "True"
    assert disk_async["LMCACHE_LOCAL_DISK"] == "file:///d/lmcache-disk-async" != disk["LMCACHE_LOCAL_DISK"]
    slow, slow_async = (tier_env(k, settings, 5555) for k in ("lmcache-remote-slow", "lmcache-remote-slow-async"))
    assert slow == tier_env("lmcache-remote", settings, 5555) and slow["LMCACHE_REMOTE_URL"] == "lm://127.0.0.1:5555"
    assert slow_async == {**slow, "LMCACHE_ENABLE_ASYNC_LOADING": "True"}
    argv = remote_server_launch("lmcache-remote-slow-async", 5555, settings, None).argv
    assert argv[argv.index("--delay-ms") + 1] == "100"  # only the slow kinds' lm:// server answers late
    assert "--delay-ms" not in remote_server_launch("lmcache-remote", 5555, settings, None).argv


def test_mooncake_kind_starts_a_master_and_a_storage_process_and_joins_as_a_pure_client():
    from bench_serving_servers import PERSISTENT_KINDS, ServerSettings, mooncake_launches, server_launch, tier_env

    settings = ServerSettings(model="m", max_model_len=1024, block_size=16, num_kv_blocks=8, chunk_size=256,
                              cpu_tier_gb=0.5, disk_tier_gb=0.5, remote_tier_gb=0.5, disk_dir="/d")
    env = tier_env("lmcache-mooncake", settings, 5555)
    # The same tier settings as lm://'s kind but the URL, plus a client that lends no memory.
    lm = tier_env("lmcache-remote", settings, 5555)
    assert {k: v for k, v in env.items() if not k.startswith("LMCACHE_MOONCAKE_")} == {
        **lm, "LMCACHE_REMOTE_URL": "mooncakestore://127.0.0.1:5555"}
    assert env["LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "0"
    assert env["LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE"] == str(500_000_000)
    with pytest.raises(ValueError, match="mooncake_master"):
        tier_env("lmcache-mooncake", settings, None)
    assert server_launch("lmcache-mooncake", settings, 8000, ROOT / "x.log", 5555).env["LMCACHE_REMOTE_URL"] \
        == "mooncakestore://127.0.0.1:5555"
    master, storage = mooncake_launches(5555, 6666, settings, ROOT / "logs")
    assert os.path.basename(master.argv[0]) == "mooncake_master" and "--rpc_port=5555" in master.argv
    assert os.path.basename(storage.argv[0]) == "mooncake_client"
    assert {"--master_server_address=127.0.0.1:5555", "--port=6666", "--global_segment_size=500MB",
            "--protocol=tcp"} <= set(storage.argv)
    assert master.log_path != storage.log_path and "lmcache-mooncake" in PERSISTENT_KINDS


def test_mooncake_hit_target_is_its_hit_ttft_over_lm_s_in_the_same_run():
    recs = [record("lmcache-remote", "repeat", "second", 0.10, hit=1000),
            record("lmcache-mooncake", "repeat", "second", 0.12, hit=1000)]
    r = ratios(summarize(recs, {}))
    [row] = [t for t in targets(r) if t["server"] == "lmcache-mooncake" and "lm://" in t["target"]]
    assert row["measured"] == pytest.approx(1.2) and row["met"] is True and row["rule"] == "<= 1.5"


def test_observed_cost_target_is_the_cpu_tiers_two_side_by_side_ratios():
    """Issue 41's cost: the no-reuse ratio with KV events + controller over the one without."""
    blank = {"beyond_query_ttft": None, "hit_over_limit": None, "hit_ttft_s": None}
    r = {"lmcache-cpu": {**blank, "unique_throughput": 1.00},
         "lmcache-cpu-observed": {**blank, "unique_throughput": 1.02}}
    [row] = [t for t in targets(r) if t["server"] == "lmcache-cpu-observed" and "controller" in t["target"]]
    assert row["measured"] == pytest.approx(1.02) and row["met"] is False and row["rule"] == "<= 1.01"
    r["lmcache-cpu-observed"]["unique_throughput"] = 1.005
    [row] = [t for t in targets(r) if t["server"] == "lmcache-cpu-observed" and "controller" in t["target"]]
    assert row["met"] is True


def test_observed_kind_reports_to_a_controller_and_publishes_kv_events():
    from bench_serving_servers import OBSERVED_KIND, ServerSettings, controller_env, controller_launch, tier_env

    settings = ServerSettings(model="m", max_model_len=1024, block_size=16, num_kv_blocks=8, chunk_size=256,
                              cpu_tier_gb=1, disk_tier_gb=1, remote_tier_gb=1, disk_dir="/d")
    env = tier_env(OBSERVED_KIND, settings, None)
    assert env["LMCACHE_ENABLE_KV_EVENTS"] == "True" and env["LMCACHE_LOCAL_CPU"] == "True"
    assert controller_env("i", 5, 6) == {"LMCACHE_ENABLE_CONTROLLER": "true", "LMCACHE_LMCACHE_INSTANCE_ID": "i",
                                         "LMCACHE_CONTROLLER_PULL_URL": "127.0.0.1:5",
                                         "LMCACHE_CONTROLLER_REPLY_URL": "127.0.0.1:6"}
    spec = controller_launch(1, 2, 3, ROOT / "c.log")
    assert spec.argv[1:] == ["-m", "lmcache.controller", "--host", "127.0.0.1", "--port", "1",
                             "--monitor-ports", '{"pull": 2, "reply": 3}']


def test_a_sigterm_to_the_benchmark_runs_its_cleanup():
    """The servers run in sessions of their own, so only the driver's `finally` blocks stop them:
    a SIGTERM must reach those blocks instead of killing the driver at once."""
    script = (
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts' / 'bench')!r})\n"
        "from bench_serving_servers import stop_servers_on_sigterm\n"
        "stop_servers_on_sigterm()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "finally:\n"
        "    print('servers stopped', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "servers stopped" and proc.returncode == 128 + 15, proc.stderr[-2000:]
