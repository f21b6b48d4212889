"""`disagg_spec` parsing: every field checked, errors naming the field; the prefiller's
scheduler-side PD state (`PDRequests`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmcache.experimental.pd.disagg_spec import DisaggSpec, DisaggSpecError, parse_disagg_spec
from lmcache.integration.vllm.v1.pd_requests import PDRequests
from lmcache.integration.vllm.v1.request_state import RequestTracker, SaveSpec

GOOD = {"req_id": "r1", "receiver_host": "127.0.0.1", "receiver_init_port": 7300, "receiver_alloc_port": 7400}


def test_good_spec_parses() -> None:
    spec = parse_disagg_spec(dict(GOOD), "127.0.0.1")
    assert spec == DisaggSpec("r1", "127.0.0.1", 7300, 7400)
    assert spec.receiver_id == "127.0.0.1:7300" and not spec.is_last_prefill and spec.num_transferred_tokens == 0


@pytest.mark.parametrize("field,value", [
    ("req_id", ""), ("req_id", 5), ("req_id", "x" * 300),
    ("receiver_host", 1), ("receiver_host", "10.0.0.9"),
    ("receiver_init_port", "7300"), ("receiver_init_port", 0), ("receiver_init_port", 70000),
    ("receiver_init_port", True), ("receiver_alloc_port", None), ("receiver_alloc_port", 1.5),
])
def test_bad_field_is_named(field: str, value: Any) -> None:
    with pytest.raises(DisaggSpecError, match=field):
        parse_disagg_spec({**GOOD, field: value}, "127.0.0.1")


@pytest.mark.parametrize("field", list(GOOD))
def test_missing_field_is_named(field: str) -> None:
    raw = dict(GOOD)
    del raw[field]
    with pytest.raises(DisaggSpecError, match=f"{field}.*missing"):
        parse_disagg_spec(raw, "127.0.0.1")


@pytest.mark.parametrize("raw", [None, [], "spec", 3])
def test_not_an_object(raw: Any) -> None:
    with pytest.raises(DisaggSpecError, match="disagg_spec"):
        parse_disagg_spec(raw, "127.0.0.1")


def _request(req_id: str, params: Any, output: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, output_token_ids=list(output))


def _tracker(req_id: str, prompt_len: int) -> RequestTracker:
    return RequestTracker(req_id, prompt_len, [1] * prompt_len, [0], 0, "", True)


def test_pd_requests_specs_errors_and_first_token() -> None:
    pd = PDRequests("127.0.0.1")
    pd.admit(_request("a", {"disagg_spec": GOOD, "ret_first_tok": True}, output=(42,)))
    pd.admit(_request("b", {"disagg_spec": {**GOOD, "receiver_host": "evil"}}))
    pd.admit(_request("c", None))
    spec = pd.step_spec(_tracker("a", 20), SaveSpec(skip_leading_tokens=16, num_tokens=20))
    assert spec is not None and spec.is_last_prefill and spec.num_transferred_tokens == 16
    mid = pd.step_spec(_tracker("a", 20), SaveSpec(skip_leading_tokens=0, num_tokens=16))
    assert mid is not None and not mid.is_last_prefill
    assert pd.step_spec(_tracker("b", 20), SaveSpec(0, 20)) is None
    assert pd.step_spec(_tracker("c", 20), SaveSpec(0, 20)) is None
    assert pd.finished(_request("a", {"disagg_spec": GOOD, "ret_first_tok": True}, output=(42,))) == {"first_tok": 42}
    error = pd.finished(_request("b", {}))
    assert error is not None and "receiver_host" in error["disagg_error"] and "pd_peer_host" in error["disagg_error"]
    assert pd.finished(_request("c", None)) is None
    assert len(pd) == 2
    for req_id in "abc":
        pd.forget(req_id)
    assert len(pd) == 0


# ----- the prefiller's scheduler side, driven like vLLM's scheduler ---------------------------------

def test_prefiller_never_looks_up_and_its_stores_carry_the_spec_until_the_last_prefill() -> None:
    from v1_helpers import RecordingChannel, StepDriver, make_request, make_settings

    from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide

    channel = RecordingChannel(hit=lambda tokens, salt: len(tokens))  # a lookup would claim a full hit
    side = LMCacheSchedulerSide(make_settings(kv_role="kv_producer", pd_sender_peer="127.0.0.1"), channel)
    driver = StepDriver(side, block_size=16)
    request = make_request("r", list(range(600)), kv_transfer_params={"disagg_spec": GOOD, "ret_first_tok": True})
    first = driver.admit(request, num_scheduled=256)
    assert channel.lookups == [] and driver.returned["r"] == 0
    (meta,) = first.requests
    assert meta.save_spec is not None and meta.save_spec.num_tokens == 256
    assert meta.disagg_spec is not None and not meta.disagg_spec.is_last_prefill and meta.disagg_spec.req_id == "r1"
    driver.run(request, 256)
    (last,) = driver.run(request, 88).requests
    assert last.save_spec is not None and last.save_spec.num_tokens == 600  # the partial chunk goes too
    assert last.disagg_spec is not None and last.disagg_spec.is_last_prefill
    assert last.disagg_spec.num_transferred_tokens == 512
    request.append_output_token_ids(7)
    assert side.request_finished(request, []) == (False, {"first_tok": 7})
    assert side.num_tracked_requests() == 0


def test_prefiller_with_a_bad_spec_stores_without_pushing_and_reports_the_error() -> None:
    from v1_helpers import RecordingChannel, StepDriver, make_request, make_settings

    from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide

    side = LMCacheSchedulerSide(make_settings(kv_role="kv_producer", pd_sender_peer="127.0.0.1"), RecordingChannel())
    driver = StepDriver(side, block_size=16)
    request = make_request("r", list(range(100)), kv_transfer_params={"disagg_spec": {"req_id": "x"}})
    (meta,) = driver.admit(request, num_scheduled=100).requests
    assert meta.save_spec is not None and meta.disagg_spec is None
    done, params = side.request_finished(request, [])
    assert not done and params is not None and "receiver_host" in params["disagg_error"]
