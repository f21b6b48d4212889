"""Clients dropping their connection at each moment, on vLLM 0.9.2 with an `lm://` server as the
remote tier (the run: tests/client_faults.py)."""

from __future__ import annotations

import pytest
from client_faults import fault_server, run_client_faults

pytestmark = pytest.mark.vllm


def test_clients_dropping_at_any_moment_leave_nothing_held(tiny_model, tmp_path):
    with fault_server(tiny_model, tmp_path, block_size=16, pool=False) as server:
        run_client_faults(server)
