"""vLLM config -> LMCache config, metadata and layout; door settings; request identity and policy."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalKwargs, PlaceholderRange

from lmcache.experimental.kv_layout import KVLayout
from lmcache.integration.vllm import utils
from lmcache.integration.vllm.v1.request_policy import (
    DoorSettings,
    request_config,
    request_identity,
    request_policy,
)
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide

from v1_helpers import RecordingChannel, StepDriver, make_request, make_settings


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    """A real VllmConfig for the tiny model with the LMCache v1 connector (no engine started)."""
    args = EngineArgs(
        model=tiny_model,
        dtype="float32",
        max_model_len=4096,
        kv_transfer_config={
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.chunk_size": 128, "skip_last_n_tokens": 3},
        },
    )
    return args.create_engine_config()


@pytest.fixture
def clean_env(monkeypatch):
    for var in [v for v in list(__import__("os").environ) if v.startswith("LMCACHE_")]:
        monkeypatch.delenv(var)
    return monkeypatch


# ----- config loading -----------------------------------------------------------------------------


def test_extra_config_overrides_the_environment(clean_env):
    clean_env.setenv("LMCACHE_CHUNK_SIZE", "512")
    clean_env.setenv("LMCACHE_SAVE_DECODE_CACHE", "true")
    config = utils.lmcache_get_config({"lmcache.chunk_size": 64, "skip_last_n_tokens": 1})
    assert config.chunk_size == 64 and config.save_decode_cache is True
    assert utils.lmcache_get_config(None).chunk_size == 512


def test_config_file_is_the_base_when_set(clean_env, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 32\nmax_local_cpu_size: 1.5\n")
    clean_env.setenv("LMCACHE_CONFIG_FILE", str(path))
    config = utils.lmcache_get_config({"lmcache.max_local_cpu_size": 2})
    assert (config.chunk_size, config.max_local_cpu_size) == (32, 2.0)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lmcache.chunk_sise": 128}, "unknown config key 'chunk_sise'.*did you mean 'chunk_size'"),
        ({"lmcache.chunk_size": "lots"}, "chunk_size='lots'"),
        ({"lmcache.chunk_size": -4}, "chunk_size=-4"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(clean_env, extra, message):
    with pytest.raises(ValueError, match=message) as info:
        utils.lmcache_get_config(extra)
    assert "kv_connector_extra_config" in str(info.value)


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("", False)])
def test_force_skip_save_words(value, expected):
    assert utils.force_skip_save({"LMCACHE_FORCE_SKIP_SAVE": value}) is expected


def test_force_skip_save_unset_and_bad():
    assert utils.force_skip_save({}) is False
    with pytest.raises(ValueError, match="LMCACHE_FORCE_SKIP_SAVE='sometimes'"):
        utils.force_skip_save({"LMCACHE_FORCE_SKIP_SAVE": "sometimes"})


# ----- vLLM config -> metadata and layout --------------------------------------------------------


def test_metadata_from_a_real_vllm_config(clean_env, vllm_config):
    config = utils.lmcache_get_config(utils.extra_config_of(vllm_config))
    assert config.chunk_size == 128
    meta = utils.create_engine_metadata(vllm_config, config, world_size=2, worker_id=1)
    assert meta.model_name == vllm_config.model_config.model
    assert (meta.world_size, meta.worker_id, meta.fmt) == (2, 1, "vllm")
    assert meta.kv_dtype == torch.float32
    assert meta.kv_shape == (4, 2, 128, 2, 32)  # tiny model: 4 layers, 2 KV heads of 32
    assert utils.worker_rank(vllm_config) == (1, 0)


def test_kv_dtype_follows_kv_cache_dtype(vllm_config):
    config = copy.deepcopy(vllm_config)
    assert utils.kv_cache_dtype(config) == torch.float32
    config.cache_config.cache_dtype = "fp8_e5m2"
    assert utils.kv_cache_dtype(config) == torch.uint8  # vLLM keeps fp8 caches as bytes
    config.cache_config.cache_dtype = "fp4"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        utils.kv_cache_dtype(config)


def test_layout_detection(vllm_config, monkeypatch):
    from vllm.attention.ops import ipex_attn

    monkeypatch.setattr(ipex_attn, "_use_ipex", True)
    assert utils.detect_kv_layout(vllm_config) == KVLayout.CPU_IPEX
    monkeypatch.setattr(ipex_attn, "_use_ipex", False)
    assert utils.detect_kv_layout(vllm_config) == KVLayout.CPU_PACKED
    mla = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    assert utils.detect_kv_layout(mla) == KVLayout.MLA


def test_door_settings_from_vllm(clean_env, vllm_config):
    config = utils.lmcache_get_config(utils.extra_config_of(vllm_config))
    settings = DoorSettings.from_vllm(vllm_config, config)
    assert (settings.chunk_size, settings.block_size, settings.skip_last_n_tokens) == (128, 128, 3)
    assert settings.save_partial_chunks and not settings.force_skip_save and settings.kv_role == "kv_both"
    odd = copy.deepcopy(vllm_config)
    odd.kv_transfer_config.kv_connector_extra_config = {"discard_partial_chunks": True}
    odd.kv_transfer_config.kv_role = "kv_consumer"
    clean_env.setenv("LMCACHE_FORCE_SKIP_SAVE", "1")
    settings = DoorSettings.from_vllm(odd, config)
    assert not settings.save_partial_chunks and settings.force_skip_save and settings.kv_role == "kv_consumer"
    odd.kv_transfer_config.kv_connector_extra_config = {"skip_last_n_tokens": "2"}
    with pytest.raises(ValueError, match="'skip_last_n_tokens'.*'2'"):
        DoorSettings.from_vllm(odd, config)


# ----- request identity ------------------------------------------------------------------------------


def mm_request(req_id, hashes, positions):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        req_id, list(range(4, 600)), [MultiModalKwargs({}) for _ in positions], hashes,
        [PlaceholderRange(offset=o, length=n) for o, n in positions],
        SamplingParams(max_tokens=4), None, 2,
    )


def test_identity_is_a_stable_string_naming_what_shapes_the_kv():
    plain = make_request("a", [5, 6])
    assert request_identity(plain).cache_salt == ""
    lora_a = make_request("b", [5, 6], lora_request=LoRARequest("a", 1, "/p/a"))
    lora_b = make_request("c", [5, 6], lora_request=LoRARequest("b", 1, "/p/a"))
    lora_a_again = make_request("d", [5, 6], lora_request=LoRARequest("a", 7, "/p/a"))
    salt_a = request_identity(lora_a).cache_salt
    assert salt_a == '{"lora":["a","/p/a"]}'
    assert request_identity(lora_a_again).cache_salt == salt_a  # the int id is per-process
    assert request_identity(lora_b).cache_salt != salt_a
    both = make_request("e", [5, 6], lora_request=LoRARequest("a", 1, "/p/a"), cache_salt="t1")
    assert request_identity(both).cache_salt == '{"lora":["a","/p/a"],"salt":"t1"}'


def test_multimodal_inputs_salt_with_hashes_and_positions_or_bypass():
    one = request_identity(mm_request("a", ["img1"], [(10, 50)]))
    moved = request_identity(mm_request("b", ["img1"], [(20, 50)]))
    other = request_identity(mm_request("c", ["img2"], [(10, 50)]))
    assert one.bypass_reason is None and "img1" in one.cache_salt
    assert len({one.cache_salt, moved.cache_salt, other.cache_salt}) == 3
    unhashed = request_identity(mm_request("d", None, [(10, 50)]))
    assert unhashed.bypass_reason is not None and "hashes" in unhashed.bypass_reason


def test_prompt_embeddings_bypass_the_cache():
    request = make_request("a", [5, 6])
    request.prompt_embeds = torch.zeros(2, 8)
    assert request_identity(request).bypass_reason is not None
    policy = request_policy(request, make_settings())
    assert not policy.use_cache and not policy.may_save


def test_bypassed_requests_neither_look_up_nor_store():
    channel = RecordingChannel(hit=lambda tokens, salt: 512)
    side = LMCacheSchedulerSide(make_settings(block_size=16), channel)
    driver = StepDriver(side, 16)
    meta = driver.admit(mm_request("a", None, [(10, 50)]), 596)
    assert channel.lookups == [] and driver.returned["a"] == 0 and meta.requests == []
    meta = driver.admit(mm_request("b", ["img1"], [(10, 50)]), 596)
    assert channel.lookups[0][1] == '{"mm":[["img1",10,50]]}'
    assert meta.requests[0].cache_salt == channel.lookups[0][1]


def test_request_config_reads_only_lmcache_keys(caplog):
    import logging

    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        assert request_config({"lmcache.skip_save": "true", "do_remote_prefill": True}).skip_save
        assert not request_config({"lmcache.skip_save": False}).skip_save
        assert not request_config(None).skip_save
        assert not request_config({"lmcache.skip_sav": True}, "r9").skip_save
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert "request r9" in caplog.text and "'lmcache.skip_sav'" in caplog.text


# ----- start-up refusals --------------------------------------------------------------------------


def test_scheduler_without_a_worker_in_its_uni_process_is_a_clear_error(vllm_config):
    from lmcache.integration.vllm.v1.worker_channel import ChannelError
    from lmcache.integration.vllm.vllm_v1_adapter import connect_worker_channel

    assert vllm_config.parallel_config.distributed_executor_backend == "uni"
    with pytest.raises(ChannelError, match="no LMCache worker side was created here"):
        connect_worker_channel(vllm_config)


def test_pd_role_must_match_kv_role(clean_env, vllm_config):
    from lmcache.experimental.config import LMCacheEngineConfig

    sender = LMCacheEngineConfig.from_defaults(remote_url=None, enable_pd=True, pd_role="sender",
                                               pd_peer_host="127.0.0.1", pd_peer_init_port=7300)
    with pytest.raises(ValueError, match=r"pd_role='sender' needs kv_transfer_config.kv_role='kv_producer', got 'kv_both'"):
        DoorSettings.from_vllm(vllm_config, sender)
    producer = copy.deepcopy(vllm_config)
    producer.kv_transfer_config.kv_role = "kv_producer"
    assert DoorSettings.from_vllm(producer, sender).pd_sender_peer == "127.0.0.1"
    receiver = sender.with_overrides({"pd_role": "receiver"})
    with pytest.raises(ValueError, match="kv_consumer"):
        DoorSettings.from_vllm(producer, receiver)
    assert DoorSettings.from_vllm(producer, receiver.with_overrides({"enable_pd": False})).pd_sender_peer is None
