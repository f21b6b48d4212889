"""Every kind of request a vLLM 0.9.2 server takes, through our cache on each door (the matrix
itself: tests/request_kinds.py): `lmcache_vllm serve` (v1 engine), vLLM's own server with
`LMCacheConnectorV1`, and `lmcache_vllm serve` on the v0 engine, against vLLM alone."""

from __future__ import annotations

import pytest
from request_kinds import REFERENCE, Door, check_metrics_add_up, check_v0_lines, check_v1_lines, run_matrix, started

pytestmark = pytest.mark.vllm

DOORS = [
    REFERENCE,
    Door("wrapper", "lmcache-cpu"),
    Door("v1-connector", "lmcache-cpu", door="v1"),
    Door("v0", "lmcache-cpu", env={"VLLM_USE_V1": "0"}),
]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    with started(tiny_model, DOORS, tmp_path_factory.mktemp("request-kinds")) as servers:
        yield servers


def test_every_request_kind_equals_vllm_alone_and_loads_where_allowed(servers):
    # The v0 engine is its own reference: its first send of each kind is a miss (computed whole).
    answers = run_matrix(servers, {"vllm-alone": "vllm-alone", "wrapper": "vllm-alone",
                                   "v1-connector": "vllm-alone", "v0": "v0"})
    for door in ("wrapper", "v1-connector"):
        check_v1_lines(servers, door, answers)
    check_v0_lines(servers.log("v0"))
    check_metrics_add_up(servers, "v1-connector")
