"""The family matrix's shared run: one engine per model family through LMCache, checked against
the engine's own cold round.

Each family runs two short prompts sharing a 256-token prefix (one LMCache chunk), twice, in one
engine with vLLM's own prefix cache off. In round 1 nothing is cached yet, so every token is
computed as a cache-off engine computes it (storing only reads the KV caches); round 2 loads every
prompt whole from LMCache. Round 2's greedy tokens and logprobs must equal round 1's, and the
hits must be the expected ones: prompt B hits A's chunk in round 1, both hit fully in round 2.
"""

from __future__ import annotations

from conftest import random_prompt
from test_v1_e2e import LMCACHE_ENV, LOGPROB_TOLERANCE, Run, connector_kwargs, hits, run

SHARED = random_prompt(256, seed=31)
PROMPT_A = SHARED + random_prompt(44, seed=32)
PROMPT_B = SHARED + random_prompt(60, seed=33)
PROMPTS = [PROMPT_A, PROMPT_B]
# (prompt tokens, vLLM-cached, LMCache hit, loaded, stored) per request, rounds 1 and 2.
EXPECTED_HITS = [(300, 0, 0, 0, 300), (316, 0, 256, 256, 60), (300, 0, 300, 300, 0), (316, 0, 316, 316, 0)]
# GPT-2's 1024 learned positions bound every family's context here.
MAX_MODEL_LEN = 1024


def check_family(model: str, llm_kwargs: dict | None = None, env: dict | None = None) -> Run:
    """Run `model` through vLLM's LMCacheConnectorV1 and check tokens, logprobs and hits."""
    kwargs = {**connector_kwargs(prefix_caching=False), "max_model_len": MAX_MODEL_LEN, **(llm_kwargs or {})}
    result = run(model, PROMPTS, kwargs, {**LMCACHE_ENV, **(env or {})}, rounds=2)
    cold, warm = result.outputs
    assert cold[0] != cold[1], "the model ignores its prompt; this check could not fail"
    assert warm == cold, (
        f"greedy tokens loaded from LMCache differ from the cold (cache-off) round: cold {cold}, warm {warm}; "
        f"hits {hits(result.lines)} (expected {EXPECTED_HITS})"
    )
    for i in range(len(PROMPTS)):
        diff = max(abs(a - b) for a, b in zip(result.logprobs[1][i], result.logprobs[0][i]))
        assert diff <= LOGPROB_TOLERANCE, f"prompt {i}: logprobs differ by {diff}"
    assert hits(result.lines) == EXPECTED_HITS
    return result
