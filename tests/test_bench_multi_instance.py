"""The multi-instance benchmark's pieces without a vLLM engine: the round-robin proxy on real
aiohttp servers on loopback (routing, streaming pass-through, limits), the seeded multi-round QA
plan, and the numbers the report derives from records and scrapes."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from conftest import ROOT
from helpers import text_clashes

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_multi_instance_report import (  # noqa: E402
    figure, instance_counters, moved_turns, plot_title, store_gauges, summarize_kind, targets,
)
from bench_serving_client import SERVED_BY_HEADER, stream_chat  # noqa: E402
from bench_serving_servers import KIND_COLORS  # noqa: E402
from multi_round_qa import QARecord, QARunner, QASizes, next_turn_moves, qa_plan  # noqa: E402
from round_robin_proxy import ProxyLimits, ProxyThread, RoundRobinProxy  # noqa: E402

SMALL = QASizes(users=5, rounds=3, system_words=40, context_words=30, question_words=5, answer_words=4)


# ---- the plan ----

def test_plan_is_seeded_the_same_for_every_kind_and_changes_with_the_seed():
    assert qa_plan(SMALL) == qa_plan(QASizes(**SMALL.__dict__))
    other = qa_plan(QASizes(**{**SMALL.__dict__, "seed": 1}))
    assert [t.messages for r in qa_plan(SMALL) for t in r] != [t.messages for r in other for t in r]


def test_plan_has_users_by_rounds_with_a_shared_system_prompt_and_a_growing_history():
    plan = qa_plan(SMALL)
    assert [[(t.round, t.user) for t in turns] for turns in plan] == [
        [(r, u) for u in range(5)] for r in range(3)]
    systems = {t.messages[0] for turns in plan for t in turns}
    assert len(systems) == 1 and next(iter(systems))[0] == "system"
    assert len(next(iter(systems))[1].split()) == 40
    contexts = {t.user: t.messages[1] for turns in plan for t in turns}
    assert len(set(contexts.values())) == 5  # each user its own context
    for u in range(5):
        turns = [plan[r][u] for r in range(3)]
        for r, turn in enumerate(turns):
            assert len(turn.messages) == 2 + 2 * r + 1
            assert [m[0] for m in turn.messages[2:]] == ["user", "assistant"] * r + ["user"]
            if r:  # the previous prompt is this one's start: question, then its seeded answer
                assert turn.messages[: len(turns[r - 1].messages)] == turns[r - 1].messages
        assert turns[0].messages[1] == contexts[u]
    assert SMALL.longest_prompt_words() == 40 + 30 + 3 * 5 + 2 * 4
    assert plan[2][0].as_json()[-1]["role"] == "user"


def test_next_turn_moves_only_when_users_are_not_a_multiple_of_instances():
    assert next_turn_moves(5, 2) and next_turn_moves(5, 3) and next_turn_moves(4, 3)
    assert not next_turn_moves(4, 2) and not next_turn_moves(6, 3) and not next_turn_moves(5, 1)
    with pytest.raises(ValueError, match="--users"):
        QASizes(users=0).validate()


# ---- the proxy, on real servers ----

def fake_backend(name: str, chunk_delay_s: float = 0.0) -> web.Application:
    """A chat endpoint that streams three SSE events slowly, naming itself in the text."""
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Seen-Id":
                                           request.headers.get("X-Request-Id", "")})
        await resp.prepare(request)
        n_messages = len(body["messages"])
        for k in range(3):
            usage = {"prompt_tokens": n_messages, "completion_tokens": k + 1}
            event = {"choices": [{"delta": {"content": f"{name}{k}"}}], "usage": usage}
            await resp.write(f"data: {__import__('json').dumps(event)}\n\n".encode())
            await asyncio.sleep(chunk_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_proxy_round_robins_and_streams_chunks_through_as_they_come():
    async def go():
        backends = [await serve(fake_backend(n, chunk_delay_s=0.1)) for n in ("a", "b", "c")]
        proxy = RoundRobinProxy([url for _, url in backends])
        port = await proxy.start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/health") as resp:
                    assert resp.status == 200
                served, firsts, lasts = [], [], []
                for k in range(7):
                    start = time.perf_counter()
                    async with session.post(f"{base}/v1/chat/completions", json={"messages": [{}]},
                                            headers={"X-Request-Id": f"r{k}"}) as resp:
                        assert resp.status == 200 and resp.headers["X-Seen-Id"] == f"r{k}"
                        served.append(resp.headers[SERVED_BY_HEADER])
                        text = b""
                        async for chunk in resp.content.iter_any():
                            if not text:
                                firsts.append(time.perf_counter() - start)
                            text += chunk
                        lasts.append(time.perf_counter() - start)
                    assert text.count(b"data:") == 4 and text.endswith(b"data: [DONE]\n\n")
                    assert f"{'abc'[k % 3]}0".encode() in text
                comp = await stream_chat(session, base, "m", [{"role": "user", "content": "x"}], 3, "q", start)
        finally:
            await proxy.stop()
            for runner, _ in backends:
                await runner.cleanup()
        return served, firsts, lasts, comp, list(proxy.routed)

    served, firsts, lasts, comp, routed = asyncio.run(go())
    assert served == ["0", "1", "2", "0", "1", "2", "0"]
    assert routed == [0, 1, 2, 0, 1, 2, 0, 1]
    # Streamed, not buffered: the first event arrives well before the backend's last one.
    assert all(last >= 0.3 for last in lasts)
    assert all(first < last / 2 for first, last in zip(firsts, lasts)), (firsts, lasts)
    assert comp.served_by == "1" and comp.output_tokens == 3 and comp.ttft_s < comp.latency_s / 2
    assert comp.request_id == "chatcmpl-q"


def test_proxy_is_bounded_and_reports_a_dead_backend():
    async def go():
        slow, slow_url = await serve(fake_backend("s", chunk_delay_s=0.4))
        proxy = RoundRobinProxy([slow_url], ProxyLimits(max_in_flight=1, queue_timeout_s=0.2))
        port = await proxy.start()
        base = f"http://127.0.0.1:{port}"
        dead = RoundRobinProxy(["http://127.0.0.1:9"], ProxyLimits(connect_timeout_s=2))
        dead_port = await dead.start()
        try:
            async with aiohttp.ClientSession() as session:
                async def one():
                    async with session.post(f"{base}/v1/chat/completions", json={"messages": []}) as resp:
                        await resp.read()
                        return resp.status
                statuses = sorted(await asyncio.gather(one(), one()))
                async with session.post(f"http://127.0.0.1:{dead_port}/v1/chat/completions", json={}) as resp:
                    dead_status = resp.status
                async with session.get(f"http://127.0.0.1:{dead_port}/health") as resp:
                    dead_health = resp.status
        finally:
            for p in (proxy, dead):
                await p.stop()
            await slow.cleanup()
        return statuses, dead_status, dead_health

    statuses, dead_status, dead_health = asyncio.run(go())
    assert statuses == [200, 503]  # one slot: the second waited past its queue timeout
    assert dead_status == 502 and dead_health == 503


def test_runner_through_a_proxy_thread_moves_each_users_next_turn():
    """The runner sends the plan in order through the threaded proxy: with 5 users on 2 instances
    every later turn runs on the other instance, and a record per turn comes back."""
    async def backends():
        return [await serve(fake_backend(n)) for n in ("a", "b")]

    loop = asyncio.new_event_loop()
    started = loop.run_until_complete(backends())
    import threading
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = ProxyThread([url for _, url in started])
    try:
        base = proxy.start()
        runner = QARunner("k", base, "m", time.perf_counter())
        asyncio.run(runner.run(qa_plan(SMALL), 3))
    finally:
        proxy.stop()
        for r, _ in started:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    recs = runner.records
    assert [(r.round, r.user) for r in recs] == [(k, u) for k in range(3) for u in range(5)]
    assert [r.served_by for r in recs] == [str(k % 2) for k in range(15)]
    assert moved_turns(recs) == {"later_turns": 10, "on_another_instance": 10}
    assert recs[-1].prompt_tokens == 2 + 2 * 2 + 1  # the fake counts messages
    assert runner.wall_s > 0


# ---- the report ----

def rec(server, user, rnd, ttft, served_by="0"):
    return QARecord(server, user, rnd, f"id{user}{rnd}", served_by, 100, 10, ttft, ttft + 0.5, float(rnd * 10 + user))


def test_summary_targets_and_figure(tmp_path):
    inst = instance_counters({"lmcache:num_hit_tokens_total": 512.0, 'lmcache:local_cache_usage{tier="Hot"}': 4096.0},
                             100.0, 400.0)
    assert inst == {"vllm_prefix_queries": 400.0, "vllm_prefix_hits": 100.0, "lmcache_hit_tokens": 512.0,
                    "lmcache_stored_tokens": 0.0, "local_cache_bytes": 4096.0}
    none = instance_counters({}, 0.0, 0.0)
    summary = {
        "vllm": summarize_kind([rec("vllm", u, r, 2.0) for u in range(2) for r in range(2)], 10.0, [none, none], None),
        "lmcache-cpu": summarize_kind([rec("lmcache-cpu", u, r, 1.0 + r) for u in range(2) for r in range(2)],
                                      8.0, [inst, inst], None),
        "lmcache-pool": summarize_kind([rec("lmcache-pool", u, r, 0.5) for u in range(2) for r in range(2)],
                                       4.0, [none, none], {"bytes_used": 5000.0, "entries": 3.0}),
        "lmcache-remote": summarize_kind([rec("lmcache-remote", u, r, 0.8) for u in range(2) for r in range(2)],
                                         5.0, [none, none], {"bytes_used": 5000.0, "entries": 3.0}),
        "lmcache-mooncake": summarize_kind([rec("lmcache-mooncake", u, r, 1.0) for u in range(2) for r in range(2)],
                                           5.0, [none, none], {"bytes_used": 6000.0, "entries": 3.0}),
        "lmcache-routed": summarize_kind([rec("lmcache-routed", u, r, 0.54) for u in range(2) for r in range(2)],
                                         4.0, [inst, inst], None),
    }
    cpu = summary["lmcache-cpu"]
    assert cpu["ttft_mean_s"] == pytest.approx(1.5) and cpu["rounds"]["1"]["ttft_mean_s"] == pytest.approx(2.0)
    assert cpu["throughput_tok_s"] == pytest.approx(4 * 110 / 8.0)
    assert cpu["lmcache_hit_tokens"] == 1024.0 and cpu["memory"]["total_bytes"] == 8192.0
    by_name = {t["target"].split(",")[0].split(":")[0]: t for t in targets(summary)}
    ttft_targets = [t for t in targets(summary) if t["target"].startswith("mean TTFT")]
    assert ttft_targets[0]["measured"] == pytest.approx(0.5 / 1.5) and ttft_targets[0]["met"] is True
    assert ttft_targets[1]["measured"] == pytest.approx(0.5 / 0.8) and ttft_targets[1]["met"] is True
    assert ttft_targets[2]["measured"] == pytest.approx(1.0 / 0.8) and ttft_targets[2]["met"] is True
    assert ttft_targets[3]["measured"] == pytest.approx(0.54 / 1.5) and ttft_targets[3]["met"] is True
    assert ttft_targets[4]["measured"] == pytest.approx(0.54 / 0.5) and ttft_targets[4]["met"] is True
    assert by_name["memory"]["measured"] == pytest.approx(5000 / 8192) and by_name["memory"]["met"] is True
    # Slower than private tiers by half, or holding a private copy: missed.
    summary["lmcache-pool"] = summarize_kind([rec("lmcache-pool", 0, 0, 1.4)], 1.0, [inst], {"bytes_used": 1.0,
                                                                                             "entries": 1.0})
    summary["lmcache-mooncake"] = summarize_kind([rec("lmcache-mooncake", 0, 0, 1.3)], 1.0, [none], None)
    # Routed: 0.93 s is over 0.6x round robin's 1.5 s, and 1.6 s over 1.1x the pool's 1.4 s.
    summary["lmcache-routed"] = summarize_kind([rec("lmcache-routed", 0, 0, 0.93)], 1.0, [inst], None)
    assert [t["met"] for t in targets(summary)] == [False, False, False, False, True, None, None, False, None, None]
    summary["lmcache-routed"] = summarize_kind([rec("lmcache-routed", 0, 0, 1.6)], 1.0, [inst], None)
    assert [t["met"] for t in targets(summary)][3:5] == [False, False]
    summary["lmcache-routed-p2p"] = summarize_kind([rec("lmcache-routed-p2p", 0, 0, 0.8)], 1.0, [inst], None)
    assert [t["met"] for t in targets(summary)][5:7] == [True, True]  # 0.8 / 1.5 and 0.8 / 1.4
    assert [t["met"] for t in targets({"vllm": summary["vllm"]})] == [None] * 9
    # Issue 42, the last two: private tiers + P2P against the private tiers (1.5 s) and Mooncake (1.3 s).
    summary["lmcache-p2p"] = summarize_kind([rec("lmcache-p2p", 0, 0, 0.9)], 1.0, [inst], None)
    p2p = targets(summary)[-2:]
    assert [t["measured"] for t in p2p] == [pytest.approx(0.9 / 1.5), pytest.approx(0.9 / 1.3)]
    assert [t["met"] for t in p2p] == [True, True]
    summary["lmcache-p2p"] = summarize_kind([rec("lmcache-p2p", 0, 0, 1.35)], 1.0, [inst], None)
    assert [t["met"] for t in targets(summary)[-2:]] == [False, False]
    fig = figure(summary, "t")
    fig.savefig(tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_store_gauges_of_an_lm_server_and_a_mooncake_master():
    # Lines as `lmcache_server --metrics-port` and `mooncake_master`'s /metrics write them.
    lm = "# TYPE lmcache_server:bytes_used gauge\nlmcache_server:bytes_used 4096.0\nlmcache_server:entries 2.0\n"
    master = ("master_allocated_bytes 1048576\nmaster_total_capacity_bytes 67108864\n"
              'segment_allocated_bytes{segment="127.0.0.1:12948"} 1048576\nmaster_key_count 4\n')
    assert store_gauges(lm) == {"bytes_used": 4096.0, "entries": 2.0}
    assert store_gauges(master) == {"bytes_used": 1048576.0, "entries": 4.0}
    assert store_gauges("") == {"bytes_used": 0.0, "entries": 0.0}


def test_every_kind_has_a_colour_of_its_own():
    assert len(set(KIND_COLORS.values())) == len(KIND_COLORS)


@pytest.mark.parametrize("run", ["multi-instance-20261127-021505", "multi-instance-20261127-020706",
                                 "multi-instance-20261127-040801", "multi-instance-20261128-182510",
                                 "multi-instance-20261128-212003", "multi-instance-20261128-212838",
                                 "multi-instance-20261129-014540", "multi-instance-20261129-015612"])
def test_the_committed_figures_have_no_text_over_text_or_axes(run):
    import json

    result = json.loads((ROOT / "bench" / "results" / f"{run}.json").read_text())
    assert text_clashes(figure(result["summary"], plot_title(result))) == []


# ---- routing by the controller's /lookup ----

def test_kv_aware_router_sends_a_prompt_to_its_longest_prefix_and_falls_back_to_round_robin(tiny_model):
    """A real controller answers `/lookup` for chunks one instance reported; the router sends a
    prompt it holds there, and round robins one nobody holds, one whose held prefix leaves more
    than the threshold to compute, an unreadable body and a lookup that fails."""
    from kv_aware_router import KvAwareRouter
    from redis_fixture import free_port

    from lmcache.controller.messages import Register, Snapshot
    from lmcache.controller.server import Controller, ControllerSettings
    from lmcache.experimental.token_database import prefix_chunk_hashes

    chunk = 16
    held = [{"role": "user", "content": " ".join(["alpha beta gamma"] * 40)}]
    longer = held + [{"role": "assistant", "content": "delta " * 30}, {"role": "user", "content": "epsilon " * 60}]
    other = [{"role": "user", "content": "zeta eta theta " * 20}]
    controller = Controller(ControllerSettings(port=0, pull_port=free_port(), reply_port=free_port())).start()
    try:
        base = "http://%s:%d" % controller.http_address
        router = KvAwareRouter(base, ["i0", "i1", "i2"], tiny_model, threshold=32)
        tokens = router.tokens(json.dumps({"messages": held}).encode())
        assert len(tokens) > 3 * chunk
        controller.index.apply(Register("i2", 0, 1, "b1", "vllm", "m", chunk, heartbeat_s=5.0))
        controller.index.apply(Snapshot("i2", 0, "b1", 1, {"Hot": [h for _, h in prefix_chunk_hashes(tokens, chunk)]}))
        turn = iter(range(100))

        async def go(bodies, router):
            async with aiohttp.ClientSession() as session:
                return [await router.choose(session, body, lambda: next(turn) % 3) for body in bodies]

        bodies = [json.dumps({"messages": m}).encode() for m in (held, other, longer, held)] + [b"{not json"]
        chosen = asyncio.run(go(bodies, router))
        assert chosen == [2, 0, 1, 2, 2], router.stats
        assert (router.stats.by_cache, router.stats.no_match, router.stats.short_match,
                router.stats.unreadable) == (2, 1, 1, 1)
        dead = KvAwareRouter(f"http://127.0.0.1:{free_port()}", ["i0", "i1", "i2"], tiny_model, threshold=32)
        assert asyncio.run(go(bodies[:1], dead)) == [0] and dead.stats.lookup_failed == 1
        with pytest.raises(ValueError, match="threshold"):
            KvAwareRouter(base, ["i0"], tiny_model, threshold=-1)
    finally:
        controller.close()
