"""Clients dropping their connection at each moment, on vLLM 0.32 with the node pool as the remote
tier (the run: tests/client_faults.py). vLLM 0.32 frees an aborted request's blocks when it is
reported loaded: an abort during a background load must be reported only as released (its engine
died on the release report that followed)."""

from __future__ import annotations

import pytest
from client_faults import fault_server, run_client_faults

pytestmark = pytest.mark.vllm


def test_clients_dropping_at_any_moment_leave_nothing_held(tiny_model, tmp_path):
    with fault_server(tiny_model, tmp_path, block_size=128, pool=True) as server:  # its CPU attention: multiples of 32
        run_client_faults(server)
