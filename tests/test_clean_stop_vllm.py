"""A clean stop keeps what was stored, through vLLM: the disk tier and Mooncake Store (issue 40).

Instance A serves a prompt and exits right after it, as a user's script does: no sleep, no close
of its own, its last puts still queued to the engine's exit close. Instance B, a new process
whose only copy of the prompt can be in that tier, must hit every token A stored. A's engine
alternates between the v0 door (the engine in the main process, whose exit close once ran after
the executors had stopped: Mooncake lost its queued puts) and the v1 one (in vLLM's engine-core
child, which vLLM kills 5 s after asking it to stop); B runs the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from conftest import random_prompt, run_vllm_job
from helpers import door_steps
from mooncake_fixture import MooncakeMaster, MooncakeStorage

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_TOKENS = 900  # three whole chunks and a partial one
PROMPT = random_prompt(PROMPT_TOKENS, seed=40)
BASE_ENV = {"LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25", "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_CHUNK_SIZE": str(CHUNK)}
V0 = {"env": {"VLLM_USE_V1": "0"}, "llm_kwargs": {}}
V1 = {"env": {"VLLM_USE_V1": "1"}, "llm_kwargs": {"enable_prefix_caching": False}}


@pytest.fixture
def tier_env(request, tmp_path: Path) -> Iterator[dict]:
    """LMCACHE_* settings that put the engine's only lasting copy in the tier named by the param."""
    if request.param == "disk":
        yield {"LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
        return
    master = MooncakeMaster(tmp_path / "master.log").start()
    storage = MooncakeStorage(master, tmp_path / "storage.log").start()
    yield {"LMCACHE_REMOTE_URL": master.url, "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_LOCAL_CPU": "False",
           "LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20)}
    storage.stop()
    master.stop()


def _serve(model: str, door: dict, tier_env: dict) -> tuple[int, str]:
    """(tokens LMCache loaded, log) of PROMPT served once by a new process that then exits."""
    job = {"model": model, "prompts": [PROMPT], "max_tokens": 2, "vllm_module": "lmcache_vllm.vllm",
           "llm_kwargs": door["llm_kwargs"]}
    log = run_vllm_job(job, env={**BASE_ENV, **door["env"], **tier_env}).log
    if door is V0:
        ((_, loaded, _),) = door_steps(log)
    else:
        (line,) = parse_request_lines(log)
        loaded = line.counters.loaded_tokens
    return loaded, log


# Through vLLM: the disk tier (its writer thread) and Mooncake (its executor, which the issue saw
# lose puts); every remote tier's exit without a close is in test_remote_sharing.py, without vLLM
# (two vLLM processes a tier cost a minute of the suite each).
@pytest.mark.parametrize(("tier_env", "a", "b"), [("disk", V1, V0), ("mooncake", V0, V1)],
                         ids=["disk", "mooncake"], indirect=["tier_env"])
def test_a_second_instance_hits_all_the_first_stored_just_before_it_exited(tiny_model, tier_env, a, b):
    loaded, log_a = _serve(tiny_model, a, tier_env)
    closes = [ln for ln in log_a.splitlines() if "tiers closed" in ln]
    assert loaded == 0 and len(closes) == 1 and "none left unwritten" in closes[0], closes
    loaded, log_b = _serve(tiny_model, b, tier_env)
    assert loaded == PROMPT_TOKENS, [ln for ln in log_b.splitlines() if "tier" in ln][-5:]
