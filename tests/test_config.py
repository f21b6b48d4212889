"""`LMCacheEngineConfig`: constructors, parsing, every refusal, env warnings, file precedence."""

import dataclasses
import inspect
import os
import pathlib
import re
from typing import Any, Callable, Dict, List

import pytest

from lmcache.experimental.config import (
    LEGACY_DISK_SIZE_GB,
    NON_FIELD_ENV_VARS,
    LMCacheEngineConfig,
    RemoteUrl,
    env_var_name,
    field_names,
    parse_remote_url,
    prefixed_overrides,
)


SPEC_FROM_DEFAULTS = {
    "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 5.0, "local_disk": None,
    "max_local_disk_size": 0, "remote_url": "lm://localhost:65432", "remote_serde": "naive",
    "save_decode_cache": False, "enable_blending": False, "blend_recompute_ratio": 0.15,
    "blend_min_tokens": 256, "enable_p2p": False, "lookup_url": None, "distributed_url": None,
    "error_handling": False,
}
EXTRA_DEFAULTS = {
    "use_layerwise": False, "enable_async_loading": False, "save_unfull_chunk": True,
    "priority_limit": None, "enable_pd": False, "blend_separator": "[BLEND_SEP]",
    "blend_add_special_in_precomp": False, "remote_password": None,
    "internal_api_server_enabled": False, "internal_api_server_port_start": 6999,
    "internal_api_server_token": None, "pd_role": None, "pd_buffer_size": 1 << 30,
    "pd_buffer_device": "cpu", "pd_peer_host": None, "pd_peer_init_port": None,
    "pd_peer_alloc_port": None, "pd_proxy_host": None, "pd_proxy_port": None, "transfer_channel": None,
    "pd_token_file": None, "pd_no_auth": False, "pd_encrypt": False,
    "mooncake_local_hostname": None, "mooncake_metadata_server": "P2PHANDSHAKE", "mooncake_protocol": "tcp",
    "mooncake_device_name": "", "mooncake_global_segment_size": 3355443200, "mooncake_local_buffer_size": 1 << 30,
    "enable_kv_events": False, "kv_events_endpoint": None, "kv_events_topic": "",
    "enable_controller": False, "lmcache_instance_id": "lmcache_default_instance", "controller_pull_url": None,
    "controller_reply_url": None, "lmcache_worker_ports": None, "lmcache_worker_heartbeat_time": 5.0,
    "p2p_token_file": None, "p2p_no_auth": False,
    "p2p_tls_cert_file": None, "p2p_tls_key_file": None, "p2p_tls_ca_file": None,
}
SPEC_FROM_LEGACY = {
    "chunk_size": 256, "backend": "cpu", "remote_url": "lm://localhost:65432", "remote_serde": "naive",
    "save_decode_cache": False, "enable_blending": False, "blend_recompute_ratio": 0.15,
    "blend_min_tokens": 256, "max_local_disk_size": 0.0, "enable_p2p": False, "lookup_url": None,
    "distributed_url": None, "error_handling": False,
}

# A config where every field differs from its default, to prove each source sets each field.
NON_DEFAULT: Dict[str, Any] = {
    "chunk_size": 128, "local_cpu": False, "max_local_cpu_size": 1.5, "local_disk": "/tmp/lmc-disk",
    "max_local_disk_size": 2.25, "remote_url": "redis://cache.example:6379", "remote_serde": "cachegen",
    "save_decode_cache": True, "enable_blending": True, "blend_recompute_ratio": 0.5,
    "blend_min_tokens": 64, "enable_p2p": True, "lookup_url": "localhost:8100",
    "distributed_url": "localhost:8200", "error_handling": True, "use_layerwise": True,
    "enable_async_loading": True, "save_unfull_chunk": False, "priority_limit": 3, "enable_pd": True,
    "blend_separator": "<sep>", "blend_add_special_in_precomp": True, "remote_password": "s3cret",
    "internal_api_server_enabled": True, "internal_api_server_port_start": 7100,
    "internal_api_server_token": "s3cret-token", "pd_role": "receiver", "pd_buffer_size": 4096,
    "pd_buffer_device": "cpu", "pd_peer_host": "127.0.0.2", "pd_peer_init_port": 7300,
    "pd_peer_alloc_port": 7400, "pd_proxy_host": "127.0.0.3", "pd_proxy_port": 7500, "transfer_channel": "zmq",
    "pd_token_file": "/etc/lmcache/pd-token", "pd_no_auth": True, "pd_encrypt": True,
    "mooncake_local_hostname": "10.0.0.8", "mooncake_metadata_server": "etcd.example:2379",
    "mooncake_protocol": "rdma", "mooncake_device_name": "mlx5_0", "mooncake_global_segment_size": 0,
    "mooncake_local_buffer_size": 65536, "enable_kv_events": True, "kv_events_endpoint": "tcp://*:5557",
    "kv_events_topic": "lmcache", "enable_controller": True, "lmcache_instance_id": "vllm-1",
    "controller_pull_url": "tcp://controller.example:8300", "controller_reply_url": "tcp://controller.example:8400",
    "lmcache_worker_ports": (8500, 8501), "lmcache_worker_heartbeat_time": 2.5,
    "p2p_token_file": "/etc/lmcache/p2p-token", "p2p_no_auth": True,
    "p2p_tls_cert_file": "/etc/lmcache/peer.pem", "p2p_tls_key_file": "/etc/lmcache/peer.key",
    "p2p_tls_ca_file": "/etc/lmcache/ca.pem",
}


def _env_text(value: Any) -> str:
    return "None" if value is None else str(value)


# ----- from_defaults and the dataclass itself ----------------------------------------------------

def test_from_defaults_matches_spec_signature_and_values() -> None:
    params = inspect.signature(LMCacheEngineConfig.from_defaults).parameters
    for name, default in {**SPEC_FROM_DEFAULTS, **EXTRA_DEFAULTS}.items():
        assert params[name].default == default, name
    config = LMCacheEngineConfig.from_defaults()
    for name, default in {**SPEC_FROM_DEFAULTS, **EXTRA_DEFAULTS}.items():
        assert getattr(config, name) == default, name
    assert isinstance(config.max_local_disk_size, float)


def test_extra_field_defaults_agree_with_dataclass() -> None:
    declared = {f.name: f.default for f in dataclasses.fields(LMCacheEngineConfig)
                if f.default is not dataclasses.MISSING}
    assert declared == EXTRA_DEFAULTS
    assert list(field_names()) == list(SPEC_FROM_DEFAULTS) + list(EXTRA_DEFAULTS)


def test_positional_construction_in_spec_order() -> None:
    config = LMCacheEngineConfig(*SPEC_FROM_DEFAULTS.values())
    assert config == LMCacheEngineConfig.from_defaults()


def test_from_defaults_overrides_every_field() -> None:
    config = LMCacheEngineConfig.from_defaults(**NON_DEFAULT)
    assert dataclasses.asdict(config) == NON_DEFAULT


def test_from_defaults_unknown_key_names_it_and_closest_field() -> None:
    with pytest.raises(ValueError, match=r"'chunk_sise'.*128.*'chunk_size'"):
        LMCacheEngineConfig.from_defaults(chunk_sise=128)


def test_config_is_frozen_hashable_and_comparable() -> None:
    a = LMCacheEngineConfig.from_defaults()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.chunk_size = 1  # type: ignore[misc]
    assert a == LMCacheEngineConfig.from_defaults()
    assert len({a, LMCacheEngineConfig.from_defaults(), a.with_overrides({"chunk_size": 64})}) == 2


def test_ints_become_floats_for_sizes() -> None:
    config = LMCacheEngineConfig.from_defaults(max_local_cpu_size=2, local_disk="/tmp/d", max_local_disk_size=1)
    assert config.max_local_cpu_size == 2.0 and isinstance(config.max_local_cpu_size, float)
    assert config.max_local_disk_size == 1.0 and isinstance(config.max_local_disk_size, float)


BAD_VALUES = [
    ("chunk_size", 0), ("chunk_size", -256), ("chunk_size", 256.0), ("chunk_size", "abc"),
    ("chunk_size", True), ("chunk_size", None),
    ("local_cpu", 1), ("local_cpu", "maybe"), ("local_cpu", None),
    ("max_local_cpu_size", -1.0), ("max_local_cpu_size", "lots"), ("max_local_cpu_size", float("nan")),
    ("max_local_cpu_size", float("inf")), ("max_local_cpu_size", True), ("max_local_disk_size", -0.5),
    ("remote_url", "localhost:65432"), ("remote_url", "http://host:80"), ("remote_url", "lm://host"),
    ("remote_url", "lm://host:0"), ("remote_url", "lm://host:65536"), ("remote_url", "lm://host:port"),
    ("remote_url", "lm://:65432"), ("remote_url", "redis://a:1,b:2"), ("remote_url", "redis://a:1/x"),
    ("remote_url", "lm://::1:80"), ("remote_url", 65432),
    ("remote_serde", "json"), ("remote_serde", 1),
    ("blend_recompute_ratio", 1.5), ("blend_recompute_ratio", -0.1), ("blend_min_tokens", -1),
    ("priority_limit", "high"), ("priority_limit", 1.5),
    ("lookup_url", "nohost"), ("distributed_url", "host:99999"),
    ("local_disk", "s3://bucket/dir"), ("local_disk", "file://otherhost/dir"), ("local_disk", 5),
    ("save_unfull_chunk", "sometimes"), ("enable_pd", 0),
    ("pd_role", "prefiller"), ("pd_buffer_size", 0), ("pd_buffer_size", "big"), ("pd_buffer_device", "cuda"),
    ("pd_peer_init_port", 70000), ("pd_peer_alloc_port", 0), ("pd_proxy_port", -1), ("transfer_channel", "nixl"),
    ("enable_kv_events", "maybe"), ("kv_events_endpoint", "tcp://*"), ("kv_events_endpoint", "udp://*:5557"),
    ("kv_events_endpoint", "tcp://*:70000"), ("kv_events_endpoint", "ipc://"),
]


@pytest.mark.parametrize("missing", ["pd_role", "pd_peer_host", "pd_peer_init_port"])
def test_enable_pd_needs_role_and_peer(missing: str) -> None:
    pd = {"enable_pd": True, "pd_role": "receiver", "pd_peer_host": "127.0.0.1", "pd_peer_init_port": 7300}
    del pd[missing]
    with pytest.raises(ValueError, match=rf"{missing}=None: enable_pd=True"):
        LMCacheEngineConfig.from_defaults(**pd)


def test_enable_pd_is_no_longer_refused() -> None:
    config = LMCacheEngineConfig.from_defaults(
        enable_pd=True, pd_role="sender", pd_peer_host="127.0.0.1", pd_peer_init_port=7300
    )
    assert config.enable_pd


def test_pd_sender_refuses_layerwise_naming_it() -> None:
    pd = {"enable_pd": True, "pd_peer_host": "127.0.0.1", "pd_peer_init_port": 7300}
    with pytest.raises(ValueError, match=r"use_layerwise=True: a PD sender"):
        LMCacheEngineConfig.from_defaults(pd_role="sender", use_layerwise=True, **pd)
    assert LMCacheEngineConfig.from_defaults(pd_role="receiver", use_layerwise=True, **pd).use_layerwise


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_bad_value_is_refused_naming_key_and_value(key: str, value: Any) -> None:
    overrides = {key: value}
    if key == "local_disk":
        overrides["max_local_disk_size"] = 1.0
    with pytest.raises(ValueError) as info:
        LMCacheEngineConfig.from_defaults(**overrides)
    message = str(info.value)
    assert key in message
    assert repr(value) in message or str(value) in message


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_bad_value_is_refused_by_with_overrides_too(key: str, value: Any) -> None:
    overrides = {key: value, **({"max_local_disk_size": 1.0} if key == "local_disk" else {})}
    with pytest.raises(ValueError, match=key):
        LMCacheEngineConfig.from_defaults().with_overrides(overrides)


def test_cross_field_rules() -> None:
    with pytest.raises(ValueError, match=r"max_local_disk_size=0\.0.*local_disk"):
        LMCacheEngineConfig.from_defaults(local_disk="/tmp/d")
    with pytest.raises(ValueError, match=r"lookup_url=None.*enable_p2p"):
        LMCacheEngineConfig.from_defaults(enable_p2p=True, distributed_url="h:1")
    with pytest.raises(ValueError, match=r"distributed_url=None.*enable_p2p"):
        LMCacheEngineConfig.from_defaults(enable_p2p=True, lookup_url="h:1")
    with pytest.raises(ValueError, match=r"remote_serde=None"):
        LMCacheEngineConfig.from_defaults(remote_serde=None)
    assert LMCacheEngineConfig.from_defaults(remote_url=None, remote_serde=None).remote_serde is None


@pytest.mark.parametrize("url,expected", [
    ("lm://localhost:65432", RemoteUrl("lm", (("localhost", 65432),))),
    ("redis://10.0.0.5:6379", RemoteUrl("redis", (("10.0.0.5", 6379),))),
    ("rediss://cache.example:6380/", RemoteUrl("rediss", (("cache.example", 6380),))),
    ("redis-cluster://a:7000,b:7001,[::1]:7002",
     RemoteUrl("redis-cluster", (("a", 7000), ("b", 7001), ("::1", 7002)))),
    ("lm://h:1", RemoteUrl("lm", (("h", 1),))),
    ("lm://h:65535", RemoteUrl("lm", (("h", 65535),))),
])
def test_accepted_remote_urls_parse(url: str, expected: RemoteUrl) -> None:
    assert parse_remote_url(url) == expected
    config = LMCacheEngineConfig.from_defaults(remote_url=url)
    assert config.remote_url == url and config.remote_address() == expected


def test_no_remote_tier_has_no_address() -> None:
    assert LMCacheEngineConfig.from_defaults(remote_url=None).remote_address() is None


@pytest.mark.parametrize("given,expected", [
    ("file:///tmp/lmc/disk/", "/tmp/lmc/disk"),
    ("file://localhost/tmp/lmc", "/tmp/lmc"),
    ("file:///tmp/with%20space", "/tmp/with space"),
    ("/tmp/lmc/disk", "/tmp/lmc/disk"),
    ("relative/dir", os.path.abspath("relative/dir")),
    ("~/lmc", os.path.join(os.path.expanduser("~"), "lmc")),
])
def test_local_disk_url_or_path_is_normalised(given: str, expected: str) -> None:
    config = LMCacheEngineConfig.from_defaults(local_disk=given, max_local_disk_size=1)
    assert config.local_disk == expected
    # Normalising is idempotent: a variant keeps the same path.
    assert config.with_overrides({"chunk_size": 64}).local_disk == expected


# ----- from_env -----------------------------------------------------------------------------------

def test_env_default_is_cpu_only() -> None:
    config = LMCacheEngineConfig.from_env({})
    assert config.local_cpu is True
    assert config.remote_url is None and config.local_disk is None
    assert config == LMCacheEngineConfig.from_defaults(remote_url=None)


def test_env_sets_every_field() -> None:
    env = {env_var_name(k): _env_text(v) for k, v in NON_DEFAULT.items()}
    config = LMCacheEngineConfig.from_env(env)
    assert dataclasses.asdict(config) == NON_DEFAULT


def test_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("LMCACHE_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "64")
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "lm://localhost:65432")
    config = LMCacheEngineConfig.from_env()
    assert config.chunk_size == 64 and config.remote_url == "lm://localhost:65432"


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("TRUE", True), ("True", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False), ("NO", False), (" true ", True),
])
def test_env_bool_words(text: str, expected: bool) -> None:
    assert LMCacheEngineConfig.from_env({"LMCACHE_SAVE_DECODE_CACHE": text}).save_decode_cache is expected


@pytest.mark.parametrize("text,expected", [("on", True), ("ON", True), ("off", False), (" Off ", False)])
def test_on_and_off_read_alike_in_config_env_and_requests(text: str, expected: bool) -> None:
    """One parser for every switch: LMCACHE_LOCAL_CPU=on as LMCACHE_FORCE_SKIP_SAVE=on."""
    from lmcache.integration.vllm.utils import force_skip_save
    from lmcache.integration.vllm.v1.request_policy import request_config

    assert LMCacheEngineConfig.from_env({"LMCACHE_LOCAL_CPU": text}).local_cpu is expected
    assert force_skip_save({"LMCACHE_FORCE_SKIP_SAVE": text}) is expected
    assert request_config({"lmcache.skip_save": text}).skip_save is expected


def test_bad_bool_word_names_the_key_and_the_words() -> None:
    with pytest.raises(ValueError, match=r"local_cpu='sometimes'.*true/false/1/0/yes/no/on/off"):
        LMCacheEngineConfig.from_env({"LMCACHE_LOCAL_CPU": "sometimes"})


@pytest.mark.parametrize("text", ["None", "none", "NONE", ""])
def test_env_none_for_optional_fields(text: str) -> None:
    env = {"LMCACHE_REMOTE_URL": text, "LMCACHE_PRIORITY_LIMIT": text, "LMCACHE_LOCAL_DISK": text}
    config = LMCacheEngineConfig.from_env(env)
    assert config.remote_url is None and config.priority_limit is None and config.local_disk is None


def test_env_numbers() -> None:
    config = LMCacheEngineConfig.from_env({
        "LMCACHE_CHUNK_SIZE": " 512 ", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
        "LMCACHE_PRIORITY_LIMIT": "-2", "LMCACHE_BLEND_RECOMPUTE_RATIO": "1",
    })
    assert (config.chunk_size, config.max_local_cpu_size, config.priority_limit) == (512, 0.25, -2)
    assert config.blend_recompute_ratio == 1.0


@pytest.mark.parametrize("var,text,field", [
    ("LMCACHE_CHUNK_SIZE", "abc", "chunk_size"),
    ("LMCACHE_CHUNK_SIZE", "256.0", "chunk_size"),
    ("LMCACHE_LOCAL_CPU", "maybe", "local_cpu"),
    ("LMCACHE_LOCAL_CPU", "", "local_cpu"),
    ("LMCACHE_MAX_LOCAL_CPU_SIZE", "-1", "max_local_cpu_size"),
    ("LMCACHE_REMOTE_URL", "lm://host", "remote_url"),
    ("LMCACHE_PRIORITY_LIMIT", "x", "priority_limit"),
])
def test_env_bad_value_names_key_and_value(var: str, text: str, field: str) -> None:
    with pytest.raises(ValueError) as info:
        LMCacheEngineConfig.from_env({var: text})
    assert field in str(info.value) and repr(text) in str(info.value)


def test_env_typo_warns_with_closest_field(warnings_log: Callable[[], List[str]]) -> None:
    config = LMCacheEngineConfig.from_env({"LMCACHE_CHUNK_SIZ": "128", "LMCACHE_MAX_LOCAL_CPU": "2"})
    assert config.chunk_size == 256
    messages = warnings_log()
    assert any("LMCACHE_CHUNK_SIZ " in m and "chunk_size" in m for m in messages), messages
    assert any("LMCACHE_MAX_LOCAL_CPU " in m and "max_local_cpu_size" in m for m in messages), messages


def test_env_var_resembling_nothing_still_warns(warnings_log: Callable[[], List[str]]) -> None:
    LMCacheEngineConfig.from_env({"LMCACHE_QQQQQQQQ": "1"})
    assert any("LMCACHE_QQQQQQQQ" in m for m in warnings_log())


def test_env_known_variables_do_not_warn(warnings_log: Callable[[], List[str]]) -> None:
    env = {var: "1" for var in NON_FIELD_ENV_VARS if var != "LMCACHE_CONFIG_FILE"}
    env.update({"LMCACHE_CHUNK_SIZE": "128", "OTHER_VAR": "x", "VLLM_LMCACHE_THING": "y"})
    LMCacheEngineConfig.from_env(env)
    assert warnings_log() == []
    assert {"LMCACHE_CONFIG_FILE", "LMCACHE_LOG_LEVEL", "LMCACHE_FORCE_SKIP_SAVE",
            "LMCACHE_USE_EXPERIMENTAL", "LMCACHE_TRACK_USAGE"} <= set(NON_FIELD_ENV_VARS)


def test_config_file_wins_over_field_variables(tmp_path: pathlib.Path,
                                               warnings_log: Callable[[], List[str]]) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 64\nsave_decode_cache: true\n")
    env = {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CHUNK_SIZE": "512", "LMCACHE_ENABLE_PD": "true"}
    config = LMCacheEngineConfig.from_env(env)
    assert config == LMCacheEngineConfig.from_file(str(path))
    assert (config.chunk_size, config.save_decode_cache, config.enable_pd) == (64, True, False)
    ignored = [m for m in warnings_log() if "ignored" in m]
    assert ignored and "LMCACHE_CHUNK_SIZE" in ignored[0] and "LMCACHE_ENABLE_PD" in ignored[0]


def test_config_file_env_pointing_nowhere_is_an_error(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "absent.yaml")
    with pytest.raises(ValueError, match="absent.yaml"):
        LMCacheEngineConfig.from_env({"LMCACHE_CONFIG_FILE": missing})


# ----- from_file ----------------------------------------------------------------------------------

def test_from_file_sets_every_field(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "all.yaml"
    lines = [f"{k}: {'null' if v is None else v}" for k, v in NON_DEFAULT.items()]
    path.write_text("\n".join(lines) + "\n")
    assert dataclasses.asdict(LMCacheEngineConfig.from_file(str(path))) == NON_DEFAULT


def test_from_file_starts_from_cpu_only_defaults(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "small.yaml"
    path.write_text("chunk_size: 128\nlocal_disk: file:///tmp/lmc-yaml/\nmax_local_disk_size: 5\n")
    config = LMCacheEngineConfig.from_file(str(path))
    assert config == LMCacheEngineConfig.from_defaults(
        chunk_size=128, remote_url=None, local_disk="/tmp/lmc-yaml", max_local_disk_size=5.0)


@pytest.mark.parametrize("body,pattern", [
    ("chunk_size: 128\nremote_ulr: lm://h:1\n", r"'remote_ulr'.*lm://h:1.*'remote_url'"),
    ("chunk_size: abc\n", r"chunk_size='abc'"),
    ("chunk_size: 0\n", r"chunk_size=0"),
    ("max_local_cpu_size: -2\n", r"max_local_cpu_size=-2"),
    ("local_cpu: 3\n", r"local_cpu=3"),
    ("remote_url: redis://nohostport\n", r"remote_url='redis://nohostport'"),
    ("remote_serde: gzip\n", r"remote_serde='gzip'"),
    ("blend_recompute_ratio: 2\n", r"blend_recompute_ratio=2"),
    ("- chunk_size\n- 128\n", r"mapping.*list"),
    ("just a string\n", r"mapping.*str"),
    ("", r"mapping.*NoneType"),
    ("chunk_size: [unclosed\n", r"not valid YAML"),
    ("1: 2\n", r"unknown config key 1"),
])
def test_from_file_refusals(tmp_path: pathlib.Path, body: str, pattern: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=pattern):
        LMCacheEngineConfig.from_file(str(path))


def test_from_file_missing_or_unreadable(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"nope\.yaml.*cannot be read"):
        LMCacheEngineConfig.from_file(str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="cannot be read"):
        LMCacheEngineConfig.from_file(str(tmp_path))  # a directory


# ----- from_legacy --------------------------------------------------------------------------------

def test_from_legacy_matches_spec_signature() -> None:
    params = inspect.signature(LMCacheEngineConfig.from_legacy).parameters
    assert {name: p.default for name, p in params.items()} == SPEC_FROM_LEGACY


@pytest.mark.parametrize("backend,local_cpu,disk,remote", [
    ("cpu", True, False, False),
    ("local_cpu", True, False, False),
    ("local_disk", False, True, False),
    ("disk", False, True, False),
    ("local_cpu_disk", True, True, False),
    ("remote", False, False, True),
    ("local_cpu_remote", True, False, True),
    ("local_disk_remote", False, True, True),
    ("local_cpu_disk_remote", True, True, True),
])
def test_from_legacy_backend_mapping(backend: str, local_cpu: bool, disk: bool, remote: bool,
                                     tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = LMCacheEngineConfig.from_legacy(backend=backend, chunk_size=128)
    assert config.local_cpu is local_cpu
    assert config.local_disk == (str(tmp_path / "lmcache" / "local_disk") if disk else None)
    assert config.max_local_disk_size == (LEGACY_DISK_SIZE_GB if disk else 0.0)
    assert config.remote_url == ("lm://localhost:65432" if remote else None)
    assert config.chunk_size == 128


def test_from_legacy_url_backend_and_pass_through() -> None:
    config = LMCacheEngineConfig.from_legacy(
        backend="redis://cache:6379", remote_serde="cachegen", save_decode_cache=True,
        enable_blending=True, blend_recompute_ratio=0.3, blend_min_tokens=32, error_handling=True)
    assert config.remote_url == "redis://cache:6379" and config.local_cpu is False
    assert config.local_disk is None
    assert (config.remote_serde, config.save_decode_cache, config.enable_blending) == ("cachegen", True, True)
    assert (config.blend_recompute_ratio, config.blend_min_tokens, config.error_handling) == (0.3, 32, True)


def test_from_legacy_explicit_disk_size_and_errors() -> None:
    assert LMCacheEngineConfig.from_legacy(backend="local_disk", max_local_disk_size=1.5).max_local_disk_size == 1.5
    with pytest.raises(ValueError, match=r"backend='gpu'"):
        LMCacheEngineConfig.from_legacy(backend="gpu")
    with pytest.raises(ValueError, match=r"remote_url=None.*'remote'"):
        LMCacheEngineConfig.from_legacy(backend="remote", remote_url=None)
    with pytest.raises(ValueError, match=r"backend='lm://nowhere'"):
        LMCacheEngineConfig.from_legacy(backend="lm://nowhere")


# ----- overrides (the v1 door's extra config) ------------------------------------------------------

def test_with_overrides_returns_a_checked_copy() -> None:
    base = LMCacheEngineConfig.from_env({})
    changed = base.with_overrides({"chunk_size": 128, "save_unfull_chunk": "false", "priority_limit": 5})
    assert (changed.chunk_size, changed.save_unfull_chunk, changed.priority_limit) == (128, False, 5)
    assert base.chunk_size == 256 and base.save_unfull_chunk is True
    assert base.with_overrides({}) == base


def test_with_overrides_unknown_key_names_source_key_and_hint() -> None:
    with pytest.raises(ValueError, match=r"extra config.*'save_decode_cach'.*'save_decode_cache'"):
        LMCacheEngineConfig.from_env({}).with_overrides({"save_decode_cach": True}, source="extra config")


def test_prefixed_overrides_strip_prefix_and_feed_with_overrides() -> None:
    extra = {"lmcache.chunk_size": 128, "lmcache.save_decode_cache": True, "skip_last_n_tokens": 1,
             "discard_partial_chunks": False, "lmcache_chunk_size": 1, 5: "x"}
    assert prefixed_overrides(extra) == {"chunk_size": 128, "save_decode_cache": True}
    config = LMCacheEngineConfig.from_env({}).with_overrides(prefixed_overrides(extra))
    assert config.chunk_size == 128 and config.save_decode_cache is True
    with pytest.raises(ValueError, match=r"'bogus'"):
        LMCacheEngineConfig.from_env({}).with_overrides(prefixed_overrides({"lmcache.bogus": 1}))


def test_p2p_urls_are_checked_and_enable_p2p_is_built():
    config = LMCacheEngineConfig.from_defaults(enable_p2p=True, lookup_url="rediss://:pw@redis.lan:6380/2",
                                               distributed_url="10.0.0.5:8200")
    assert config.enable_p2p and "pw" not in repr(config)
    with pytest.raises(ValueError, match=r"lookup_url=.*single Redis"):
        LMCacheEngineConfig.from_defaults(lookup_url="lm://h:1")
    with pytest.raises(ValueError, match=r"distributed_url='0.0.0.0:8200'.*wildcard"):
        LMCacheEngineConfig.from_defaults(distributed_url="0.0.0.0:8200")


def test_blending_needs_layerwise_and_a_separator():
    with pytest.raises(ValueError, match=r"enable_blending=True needs use_layerwise=True"):
        LMCacheEngineConfig.from_defaults(enable_blending=True)
    with pytest.raises(ValueError, match=r"blend_separator=''"):
        LMCacheEngineConfig.from_defaults(enable_blending=True, use_layerwise=True, blend_separator="")
    with pytest.raises(ValueError, match=r"LMCACHE_ENABLE_BLENDING|enable_blending"):
        LMCacheEngineConfig.from_env({"LMCACHE_ENABLE_BLENDING": "true"})
    config = LMCacheEngineConfig.from_env({"LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_USE_LAYERWISE": "1"})
    assert (config.blend_recompute_ratio, config.blend_min_tokens, config.blend_separator) == (0.15, 256, "[BLEND_SEP]")


def test_controller_keys_by_upstreams_names_and_the_older_ones(tmp_path) -> None:
    env = {"LMCACHE_ENABLE_CONTROLLER": "true", "LMCACHE_LMCACHE_INSTANCE_ID": "vllm-0",
           "LMCACHE_CONTROLLER_PULL_URL": "localhost:8300", "LMCACHE_CONTROLLER_REPLY_URL": "tcp://127.0.0.1:8400",
           "LMCACHE_LMCACHE_WORKER_PORTS": "8500,8501", "LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME": "2"}
    config = LMCacheEngineConfig.from_env(env)
    assert (config.lmcache_instance_id, config.controller_pull_url, config.controller_reply_url) == (
        "vllm-0", "tcp://localhost:8300", "tcp://127.0.0.1:8400")
    assert config.lmcache_worker_ports == (8500, 8501) and config.lmcache_worker_heartbeat_time == 2.0
    assert LMCacheEngineConfig.cpu_only_defaults().lmcache_worker_heartbeat_time > 0  # heartbeats on by default
    path = tmp_path / "c.yaml"
    path.write_text("enable_controller: true\ncontroller_url: 10.0.0.1:8300\ncontroller_reply_url: 10.0.0.1:8400\n"
                    "lmcache_worker_port: 8500\n")
    old = LMCacheEngineConfig.from_file(str(path))
    assert (old.controller_pull_url, old.lmcache_worker_ports) == ("tcp://10.0.0.1:8300", (8500,))
    path.write_text("controller_url: a:1\ncontroller_pull_url: a:1\n")
    with pytest.raises(ValueError, match="'controller_url' and the field 'controller_pull_url'"):
        LMCacheEngineConfig.from_file(str(path))
    for fields, says in [
        ({"enable_controller": True}, "controller_pull_url=None: enable_controller=True needs"),
        ({"controller_pull_url": "redis://a:1"}, "controller_pull_url='redis://a:1': expected HOST:PORT"),
        ({"controller_reply_url": "a"}, "controller_reply_url='a': expected host:port"),
        ({"lmcache_worker_ports": "85x"}, "lmcache_worker_ports='85x': expected integers"),
        ({"lmcache_worker_ports": [0]}, "port 0 is not in 1..65535"),
        ({"lmcache_worker_heartbeat_time": 0}, "lmcache_worker_heartbeat_time=0.0: seconds, above 0"),
        ({"lmcache_instance_id": "a b"}, "lmcache_instance_id='a b'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            LMCacheEngineConfig.from_defaults(**fields)
