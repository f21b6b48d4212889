"""The status API over real HTTP on a real engine: read-only endpoints for anyone on loopback,
state-changing ones 403 without the configured token and working with it; off by default."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest
from helpers import CHUNK, config, geometry, make_engine, prompt, slots_for
from kv_reference import make_kvcaches
from redis_fixture import free_port

from lmcache.experimental.api_server import masked_config, start_status_api
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.integration.vllm.request_log import RequestCounters, RequestStats, format_request_line
from lmcache.logging import init_logger

TOKEN = "t0ken-for-tests"


def _call(port, path, method="GET", token=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(params=[None, TOKEN], ids=["no-token", "token"])
def api(request):
    geo = geometry()
    cfg = config(internal_api_server_enabled=True, internal_api_server_port_start=free_port(),
                 internal_api_server_token=request.param)
    engine = make_engine(geo, cfg)
    tokens, slots = prompt(2 * CHUNK), slots_for(geo, 2 * CHUNK)
    engine.store(tokens, kvcaches=make_kvcaches(geo), slot_mapping=slots)
    status = start_status_api(engine, worker_id=0)
    assert status is not None and status.port == cfg.internal_api_server_port_start
    yield engine, status, request.param
    status.close()
    engine.close()
    logging.getLogger("lmcache").setLevel(logging.INFO)


def test_read_only_endpoints_answer_everyone(api):
    engine, status, token = api
    assert _call(status.port, "/health") == (200, {"status": "ok"})
    code, cfg = _call(status.port, "/config")
    assert code == 200 and cfg["chunk_size"] == CHUNK
    assert cfg["internal_api_server_token"] == (None if token is None else "***")
    assert TOKEN not in json.dumps(cfg)
    code, usage = _call(status.port, "/usage")
    assert code == 200 and usage["usage_bytes"]["Hot"] > 0 and "Hot" in usage["tiers"]
    init_logger("lmcache.integration.vllm.v1.scheduler_side").info(
        "%s", format_request_line("req-1", RequestStats(600, 0, 512), RequestCounters(512, 88), ""))
    code, recent = _call(status.port, "/requests")
    assert code == 200 and recent["lines"][-1].startswith("LMCache request req-1: prompt_tokens=600")
    assert _call(status.port, "/nothing")[0] == 404


def test_state_changing_endpoints_need_the_token(api):
    engine, status, token = api
    for bad in (None, "wrong-token-123"):
        assert _call(status.port, "/clear?tier=Hot", "POST", bad)[0] == 403
        assert _call(status.port, "/loglevel?level=DEBUG", "POST", bad)[0] == 403
    assert len(engine.storage_manager.tiers[0]) == 2  # nothing was cleared
    if token is None:
        assert _call(status.port, "/clear?tier=Hot", "POST", TOKEN)[0] == 403  # no token configured
        return
    assert _call(status.port, "/clear?tier=Hot", "POST", token) == (200, {"tier": "Hot", "removed_chunks": 2})
    assert len(engine.storage_manager.tiers[0]) == 0
    assert _call(status.port, "/clear?tier=Nope", "POST", token)[0] == 400
    assert _call(status.port, "/loglevel?level=debug", "POST", token) == (200, {"level": "DEBUG"})
    assert logging.getLogger("lmcache").level == logging.DEBUG
    assert _call(status.port, "/loglevel?level=LOUD", "POST", token)[0] == 400


def test_off_by_default_and_a_short_token_is_refused():
    assert LMCacheEngineConfig.from_defaults().internal_api_server_enabled is False
    engine = make_engine(geometry(), config())
    assert start_status_api(engine, worker_id=0) is None
    engine.close()
    with pytest.raises(ValueError, match="internal_api_server_token") as err:
        config(internal_api_server_token="short")
    assert "short" not in str(err.value)
    assert "long-enough" not in repr(config(internal_api_server_token="long-enough-token"))
    assert masked_config(config())["internal_api_server_token"] is None


def test_config_endpoint_hides_every_secret():
    shown = masked_config(config(remote_url="redis://app:pa55word@127.0.0.1:6379", remote_password="other-secret",
                                 internal_api_server_token="long-enough-token"))
    assert shown["remote_password"] == "***" and shown["internal_api_server_token"] == "***"
    assert "pa55word" not in shown["remote_url"] and shown["remote_url"].startswith("redis://app:")
    assert not any(s in repr(shown) for s in ("pa55word", "other-secret", "long-enough-token"))


def test_held_reports_the_engines_pins_and_what_each_door_added(api):
    engine, status, _ = api
    tokens = prompt(2 * CHUNK)
    assert engine.lookup(tokens, request_id="req-1", pin=True) == 2 * CHUNK
    queued = {"background_loads": 1}
    status.add_held("v1 worker", lambda: queued)
    assert _call(status.port, "/held") == (200, {"engine": {"live_pins": 2, "pinned_requests": 1},
                                                 "v1 worker": {"background_loads": 1}})
    engine.lookup_unpin(["req-1"])
    queued["background_loads"] = 0
    assert _call(status.port, "/held") == (200, {"engine": {"live_pins": 0, "pinned_requests": 0},
                                                 "v1 worker": {"background_loads": 0}})
