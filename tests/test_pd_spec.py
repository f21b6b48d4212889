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
