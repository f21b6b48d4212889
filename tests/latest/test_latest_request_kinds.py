"""Every kind of request a vLLM 0.32 server takes, through our cache on each door (the matrix
itself: tests/request_kinds.py): `lmcache_vllm serve` and vLLM's own server with
`LMCacheConnectorV1`, against vLLM alone; and Ctrl-C stops each server cleanly."""

from __future__ import annotations

import pytest
from request_kinds import REFERENCE, Door, MatrixServers, check_metrics_add_up, check_v1_lines, run_matrix

pytestmark = pytest.mark.vllm

DOORS = [REFERENCE, Door("wrapper", "lmcache-cpu"), Door("v1-connector", "lmcache-cpu", door="v1")]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    servers = MatrixServers(tiny_model, DOORS, tmp_path_factory.mktemp("request-kinds"))
    try:
        servers.wait_ready()
        yield servers
    finally:
        codes = servers.stop()
    assert codes == {door.name: 0 for door in DOORS}, codes  # Ctrl-C stops every server cleanly


def test_every_request_kind_equals_vllm_alone_and_loads_where_allowed(servers):
    answers = run_matrix(servers, {door.name: REFERENCE.name for door in DOORS})
    for door in ("wrapper", "v1-connector"):
        check_v1_lines(servers, door, answers)
    check_metrics_add_up(servers, "v1-connector")
