"""Every kind of request a vLLM 0.32 server takes, through our cache on each door (the matrix
itself: tests/request_kinds.py): `lmcache_vllm serve` and vLLM's own server with
`LMCacheConnectorV1`, against vLLM alone; and Ctrl-C stops each server cleanly."""

from __future__ import annotations

import pytest
from request_kinds import REFERENCE, Door, check_metrics_add_up, check_v1_lines, run_matrix, started

pytestmark = pytest.mark.vllm

DOORS = [REFERENCE, Door("wrapper", "lmcache-cpu"), Door("v1-connector", "lmcache-cpu", door="v1")]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    with started(tiny_model, DOORS, tmp_path_factory.mktemp("request-kinds")) as servers:
        yield servers


def test_every_request_kind_equals_vllm_alone_and_loads_where_allowed(servers):
    answers = run_matrix(servers, {door.name: REFERENCE.name for door in DOORS})
    for door in ("wrapper", "v1-connector"):
        check_v1_lines(servers, door, answers)
    check_metrics_add_up(servers, "v1-connector")
