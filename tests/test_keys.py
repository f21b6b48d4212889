"""Keys, engine metadata and the logger: the small types every other part builds on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey


def _key(model: str = "meta/llama-3", chunk_hash: str = "0123abcd") -> CacheEngineKey:
    return CacheEngineKey("vllm", model, 2, 1, chunk_hash)


def test_key_string_round_trip() -> None:
    key = _key()
    assert key.to_string() == "vllm@meta/llama-3@2@1@0123abcd"
    assert CacheEngineKey.from_string(key.to_string()) == key


def test_key_model_name_may_contain_separator() -> None:
    key = _key(model="org/model@rev@2")
    s = key.to_string()
    assert s == "vllm@org/model@rev@2@2@1@0123abcd"
    back = CacheEngineKey.from_string(s)
    assert back == key
    assert back.model_name == "org/model@rev@2"


def test_key_is_frozen_and_hashable() -> None:
    a, b = _key(), _key()
    assert a == b and hash(a) == hash(b)
    assert len({a, b, _key(chunk_hash="ff")}) == 2
    with pytest.raises(AttributeError):
        a.chunk_hash = "00"  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "vllm",
        "vllm@model@1@0",  # four fields
        "vllm@model@x@0@abcd",  # world size not an int
        "vllm@model@1@-1@abcd",  # negative worker id
        "vllm@model@1@0@ABCD",  # upper-case hash
        "vllm@model@1@0@",  # empty hash
        "vllm@model@0@0@abcd",  # world size zero
        "@model@1@0@abcd",  # empty fmt
        "vllm@@1@0@abcd",  # empty model
    ],
)
def test_key_from_bad_string_names_it(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        CacheEngineKey.from_string(bad)
    assert repr(bad) in str(err.value)


def test_key_rejects_fields_that_break_round_trip() -> None:
    with pytest.raises(ValueError, match="fmt"):
        CacheEngineKey("vl@lm", "m", 1, 0, "ab")
    with pytest.raises(ValueError, match="chunk_hash"):
        CacheEngineKey("vllm", "m", 1, 0, "a@b")


def _meta(**overrides: object) -> LMCacheEngineMetadata:
    args: dict = dict(
        model_name="m",
        world_size=2,
        worker_id=1,
        fmt="vllm",
        kv_dtype=torch.bfloat16,
        kv_shape=(4, 2, 256, 8, 64),
    )
    args.update(overrides)
    return LMCacheEngineMetadata(**args)


def test_metadata_fields_and_derived_sizes() -> None:
    meta = _meta()
    assert meta.use_mla is False
    assert (meta.num_layers, meta.chunk_size, meta.hidden_size) == (4, 256, 512)
    mla = _meta(kv_shape=[4, 1, 256, 1, 576], use_mla=True)
    assert mla.kv_shape == (4, 1, 256, 1, 576)
    assert mla.hidden_size == 576


@pytest.mark.parametrize(
    "field,value",
    [
        ("world_size", 0),
        ("worker_id", 2),
        ("worker_id", -1),
        ("kv_shape", (4, 2, 256, 8)),
        ("kv_shape", (4, 2, 0, 8, 64)),
        ("kv_shape", (4, 1, 256, 8, 64)),  # 1 without use_mla
        ("kv_dtype", "bfloat16"),
        ("fmt", ""),
        ("model_name", ""),
    ],
)
def test_metadata_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _meta(**{field: value})


def test_logger_single_handler_and_level() -> None:
    a = init_logger("lmcache.test_keys.a")
    b = init_logger("lmcache.test_keys.b")
    init_logger("lmcache.test_keys.a")
    top = logging.getLogger("lmcache")
    ours = [h for h in top.handlers if getattr(h, "_lmcache_handler", False)]
    assert len(ours) == 1
    assert (a.name, b.name) == ("lmcache.test_keys.a", "lmcache.test_keys.b")
    assert not top.propagate
    assert init_logger("some_script").name == "lmcache.some_script"


def _run_logging_child(level: str) -> subprocess.CompletedProcess:
    code = (
        "from lmcache.logging import init_logger\n"
        "log = init_logger('lmcache.child')\n"
        "log.debug('debug-line')\n"
        "log.info('info-line')\n"
    )
    env = dict(os.environ, LMCACHE_LOG_LEVEL=level)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )


def test_log_level_from_env_and_bad_value_warns() -> None:
    debug = _run_logging_child("debug")
    assert "debug-line" in debug.stderr and "info-line" in debug.stderr
    assert "LMCache DEBUG" in debug.stderr
    bad = _run_logging_child("loud")
    assert "'loud'" in bad.stderr and "using INFO" in bad.stderr
    assert "info-line" in bad.stderr and "debug-line" not in bad.stderr
