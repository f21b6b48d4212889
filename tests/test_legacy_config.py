"""Old `lmcache_vllm` configs: upstream's harness files and the wrapper's example load to their
meaning, each old key with one deprecation warning naming the new one; bad old values and old
keys that contradict new ones are refused, naming the key."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Dict, List

import pytest

from lmcache.experimental.config import LEGACY_DISK_SIZE_GB, LMCacheEngineConfig, RemoteUrl

DATA = pathlib.Path(__file__).resolve().parent / "data" / "legacy"

# File -> the fields it must load to (the rest stay at the CPU-only defaults).
EXPECTED: Dict[str, Dict[str, Any]] = {
    "wrapper_example.yaml": {"chunk_size": 256, "local_cpu": True, "local_disk": None, "remote_url": None},
    "local_cpu.yaml": {"local_cpu": True, "max_local_cpu_size": 20.0, "local_disk": None, "remote_url": None,
                       "remote_serde": "cachegen"},
    "local_disk.yaml": {"local_cpu": False, "local_disk": "/local/lmcache-tests",
                        "max_local_disk_size": LEGACY_DISK_SIZE_GB, "remote_url": None,
                        "save_decode_cache": True},
    "remote_cachegen.yaml": {"local_cpu": True, "remote_url": "lm://localhost:65431", "remote_serde": "cachegen"},
    "remote_safetensor.yaml": {"local_cpu": True, "max_local_cpu_size": 4.0, "remote_url": "lm://localhost:65431",
                               "remote_serde": "safetensor"},
    "redis_sentinel_cachegen.yaml": {
        "local_cpu": False, "local_disk": None, "remote_serde": "cachegen", "save_decode_cache": True,
        "remote_url": "redis-sentinel://localhost:26379,localhost:26380,localhost:26381"},
}


def test_every_harness_file_is_covered() -> None:
    assert sorted(p.name for p in DATA.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_harness_files_load_to_their_meaning(name: str, warnings_log: Callable[[], List[str]]) -> None:  # noqa: F811
    config = LMCacheEngineConfig.from_file(str(DATA / name))
    for field, value in EXPECTED[name].items():
        assert getattr(config, field) == value, field
    warnings = warnings_log()
    # One line per old key, naming the field it became.
    assert sum("local_device=" in w and "deprecated" in w for w in warnings) == 1
    assert sum("pipelined_backend=" in w and "ignored" in w for w in warnings) == 1
    assert all("\n" not in w for w in warnings)


def test_sentinel_file_parses_hosts() -> None:
    config = LMCacheEngineConfig.from_file(str(DATA / "redis_sentinel_cachegen.yaml"))
    assert config.remote_address() == RemoteUrl(
        "redis-sentinel", (("localhost", 26379), ("localhost", 26380), ("localhost", 26381)))


@pytest.mark.parametrize("device,fields,phrase", [
    ("cpu", {"local_cpu": True}, "use local_cpu: true"),
    ("CPU", {"local_cpu": True}, "use local_cpu: true"),
    ("cuda", {"local_cpu": True}, "no GPU tier here"),
    ("cuda:1", {"local_cpu": True}, "no GPU tier here"),
    ("None", {"local_cpu": False}, "local_cpu: false"),
    ("null", {"local_cpu": False}, "local_cpu: false"),
    ("file:///tmp/lmc-legacy/", {"local_cpu": False, "local_disk": "/tmp/lmc-legacy", "max_local_disk_size": 20.0},
     "use local_disk"),
])
def test_env_local_device_and_size(device: str, fields: Dict[str, Any], phrase: str,
                                   warnings_log: Callable[[], List[str]]) -> None:  # noqa: F811
    env = {"LMCACHE_LOCAL_DEVICE": device, "LMCACHE_MAX_LOCAL_CACHE_SIZE": "20"}
    config = LMCacheEngineConfig.from_env(env)
    for field, value in fields.items():
        assert getattr(config, field) == value, field
    if fields["local_cpu"]:
        assert config.max_local_cpu_size == 20.0
    warnings = warnings_log()
    assert any(phrase in w for w in warnings), warnings
    # Old variables are known: no "not an LMCache setting" typo warning for them.
    assert not any("not an LMCache setting" in w for w in warnings)


def test_size_alone_is_the_cpu_tier_and_null_device_ignores_it(warnings_log: Callable[[], List[str]]) -> None:  # noqa: F811
    assert LMCacheEngineConfig.from_env({"LMCACHE_MAX_LOCAL_CACHE_SIZE": "3"}).max_local_cpu_size == 3.0
    assert any("use max_local_cpu_size: 3.0" in w for w in warnings_log())
    config = LMCacheEngineConfig.from_env({"LMCACHE_LOCAL_DEVICE": "null", "LMCACHE_MAX_LOCAL_CACHE_SIZE": "3"})
    assert config.local_cpu is False and config.max_local_cpu_size == 5.0
    assert any("ignored" in w and "max_local_cache_size" in w for w in warnings_log())


@pytest.mark.parametrize("serde", ["torch", "fast"])
def test_pickle_era_serdes_become_naive(serde: str, warnings_log: Callable[[], List[str]]) -> None:  # noqa: F811
    config = LMCacheEngineConfig.from_env({"LMCACHE_REMOTE_URL": "lm://h:1", "LMCACHE_REMOTE_SERDE": serde})
    assert config.remote_serde == "naive"
    assert any(f"remote_serde={serde!r}" in w and "naive" in w for w in warnings_log())
    assert LMCacheEngineConfig.from_defaults(remote_serde=serde).remote_serde == "naive"


@pytest.mark.parametrize("env,pattern", [
    ({"LMCACHE_LOCAL_DEVICE": "gpu"}, r"local_device='gpu'.*LMCACHE_LOCAL_DEVICE"),
    ({"LMCACHE_LOCAL_DEVICE": "/plain/path"}, r"local_device='/plain/path'"),
    ({"LMCACHE_MAX_LOCAL_CACHE_SIZE": "lots"}, r"max_local_cache_size='lots'"),
    ({"LMCACHE_MAX_LOCAL_CACHE_SIZE": "-1"}, r"max_local_cache_size='-1'"),
    ({"LMCACHE_PIPELINED_BACKEND": "sometimes"}, r"pipelined_backend='sometimes'"),
    ({"LMCACHE_LOCAL_DEVICE": "cpu", "LMCACHE_LOCAL_CPU": "false"}, r"'local_device'.*'local_cpu'.*both"),
    ({"LMCACHE_MAX_LOCAL_CACHE_SIZE": "2", "LMCACHE_MAX_LOCAL_CPU_SIZE": "3"},
     r"'max_local_cache_size'.*'max_local_cpu_size'.*both"),
])
def test_bad_or_contradicting_old_keys_are_refused(env: Dict[str, str], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LMCacheEngineConfig.from_env(env)


def test_yaml_errors_name_the_file_and_key(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("local_device: 7\n")
    with pytest.raises(ValueError, match=r"old\.yaml.*local_device=7"):
        LMCacheEngineConfig.from_file(str(path))
    path.write_text("local_device: cpu\npipelined_backend: 3\n")
    with pytest.raises(ValueError, match=r"old\.yaml.*pipelined_backend=3"):
        LMCacheEngineConfig.from_file(str(path))


def test_config_file_wins_over_old_variables_too(tmp_path: pathlib.Path,
                                                 warnings_log: Callable[[], List[str]]) -> None:  # noqa: F811
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 128\n")
    config = LMCacheEngineConfig.from_env({"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_LOCAL_DEVICE": "null"})
    assert config.chunk_size == 128 and config.local_cpu is True
    assert any("LMCACHE_LOCAL_DEVICE" in w and "ignored" in w for w in warnings_log())


@pytest.mark.parametrize("url,expected", [
    ("redis-sentinel://a:26379,b:26380", RemoteUrl("redis-sentinel", (("a", 26379), ("b", 26380)))),
    ("redis-sentinel://a:26379/cache-master", RemoteUrl("redis-sentinel", (("a", 26379),), "cache-master")),
    ("redis-sentinel://a:1,[::1]:2/m.1_x/", RemoteUrl("redis-sentinel", (("a", 1), ("::1", 2)), "m.1_x")),
])
def test_sentinel_urls(url: str, expected: RemoteUrl) -> None:
    assert LMCacheEngineConfig.from_defaults(remote_url=url).remote_address() == expected


@pytest.mark.parametrize("url", ["redis-sentinel://a:1/bad name", "redis-sentinel://a:1/x/y", "redis-sentinel://a/m",
                                 "redis://a:1/master"])
def test_bad_sentinel_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="remote_url"):
        LMCacheEngineConfig.from_defaults(remote_url=url)
