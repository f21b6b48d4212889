"""Token database: chunk boundaries, masks, and keys that are stable and prefix-consistent."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.token_database import ChunkedTokenDatabase, TokenDatabase
from lmcache.utils import CacheEngineKey

CHUNK = 4
REPO = Path(__file__).resolve().parents[1]


def _meta() -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata("org/model@v1", 2, 1, "vllm", torch.float16, (2, 2, CHUNK, 2, 8))


def _db(chunk: int = CHUNK) -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(SimpleNamespace(chunk_size=chunk), _meta())


def _reference_hashes(tokens: list[int], chunk: int, salt: str = "") -> list[str]:
    """The design's formula written out independently of the module."""
    prev = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    out = []
    for i in range(0, len(tokens), chunk):
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i : i + chunk])
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        out.append(prev.hex())
    return out


def _mask(num_false: int, total: int) -> torch.Tensor:
    m = torch.ones(total, dtype=torch.bool)
    m[:num_false] = False
    return m


def test_is_a_token_database() -> None:
    assert isinstance(_db(), TokenDatabase)


def test_chunk_boundaries_and_partial_last_chunk() -> None:
    tokens = torch.arange(10)
    chunks = list(_db().process_tokens(tokens))
    assert [(s, e) for s, e, _ in chunks] == [(0, 4), (4, 8), (8, 10)]
    exact = list(_db().process_tokens(torch.arange(8)))
    assert [(s, e) for s, e, _ in exact] == [(0, 4), (4, 8)]
    assert list(_db().process_tokens(torch.tensor([], dtype=torch.long))) == []


def test_keys_follow_the_documented_hash() -> None:
    tokens = [5, -1, 70000, 2**31 - 1, 3, 9, 0]
    keys = [k for _, _, k in _db().process_tokens(torch.tensor(tokens))]
    assert [k.chunk_hash for k in keys] == _reference_hashes(tokens, CHUNK)
    meta = _meta()
    for k in keys:
        assert (k.fmt, k.model_name, k.world_size, k.worker_id) == (
            meta.fmt,
            meta.model_name,
            meta.world_size,
            meta.worker_id,
        )
        assert len(k.chunk_hash) == 32
        assert CacheEngineKey.from_string(k.to_string()) == k
    # Pinned value: any change to the hash breaks every cache already on disk or remote.
    pinned = [k.chunk_hash for _, _, k in _db().process_tokens(torch.arange(8))]
    assert pinned == ["de2b1b0617e7d6fda4d4aab2b6241a61", "431ce80d152c6058d44bdae6f5f324c7"]


def test_tensor_dtype_and_list_inputs_agree() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    expected = [k for _, _, k in _db().process_tokens(torch.tensor(tokens, dtype=torch.int64))]
    for variant in (torch.tensor(tokens, dtype=torch.int32), tokens):
        assert [k for _, _, k in _db().process_tokens(variant)] == expected


def test_prefix_property() -> None:
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(0, 50000, (37,), generator=gen)
    long_keys = [k for _, _, k in _db().process_tokens(long)]
    for n in range(CHUNK, 37, CHUNK):
        prefix_keys = [k for _, _, k in _db().process_tokens(long[:n])]
        assert prefix_keys == long_keys[: n // CHUNK]
    # a partial last chunk is keyed by exactly the tokens it holds
    partial = [k for _, _, k in _db().process_tokens(long[:10])]
    assert partial[:2] == long_keys[:2] and partial[2] != long_keys[2]
    # changing one early token changes every later key (rolling hash)
    changed = long.clone()
    changed[1] += 1
    assert all(a != b for a, b in zip(long_keys, (k for _, _, k in _db().process_tokens(changed))))


def test_salt_changes_keys() -> None:
    tokens = torch.arange(12)
    plain = [k for _, _, k in _db().process_tokens(tokens)]
    assert plain == [k for _, _, k in _db().process_tokens(tokens, cache_salt="")]
    lora = [k for _, _, k in _db().process_tokens(tokens, cache_salt="lora:a")]
    other = [k for _, _, k in _db().process_tokens(tokens, cache_salt="lora:b")]
    assert not set(plain) & set(lora) and not set(lora) & set(other)
    assert [k.chunk_hash for k in lora] == _reference_hashes(list(range(12)), CHUNK, "lora:a")


def test_mask_skips_false_prefix_chunks() -> None:
    tokens = torch.arange(14)
    all_chunks = list(_db().process_tokens(tokens))
    for num_false in (0, 4, 8, 12):
        got = list(_db().process_tokens(tokens, _mask(num_false, 14)))
        assert got == [c for c in all_chunks if c[0] >= num_false]
    assert list(_db().process_tokens(torch.arange(8), _mask(8, 8))) == []


@pytest.mark.parametrize(
    "mask,match",
    [
        (_mask(3, 10), "multiple of chunk_size"),
        (_mask(10, 10), "multiple of chunk_size"),
        (torch.tensor([True] * 4 + [False] * 4 + [True] * 2), "FFF...TTT"),
        (torch.tensor([False] * 4 + [True] * 5 + [False]), "FFF...TTT"),
        (_mask(4, 9), "9 entries for 10 tokens"),
        (_mask(4, 11), "11 entries for 10 tokens"),
        (torch.ones(2, 5, dtype=torch.bool), "1-D"),
    ],
)
def test_bad_masks_raise(mask: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _db().process_tokens(torch.arange(10), mask)


def test_bad_tokens_and_config_raise() -> None:
    with pytest.raises(ValueError, match="int32"):
        _db().process_tokens(torch.tensor([2**31]))
    with pytest.raises(ValueError, match="integers"):
        _db().process_tokens(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        _db().process_tokens(torch.zeros(2, 3, dtype=torch.long))
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            ChunkedTokenDatabase(SimpleNamespace(chunk_size=bad), _meta())


def test_prefix_keys_match_process_tokens_lazily() -> None:
    tokens = torch.arange(10)
    db = _db()
    expected = [(e, k) for _, e, k in db.process_tokens(tokens)]
    assert list(db.prefix_keys(tokens)) == expected
    it = db.prefix_keys(tokens, cache_salt="s")
    first = next(it)
    assert first == next(iter((e, k) for _, e, k in db.process_tokens(tokens, cache_salt="s")))


_CHILD = """
import json, sys, torch
from types import SimpleNamespace
from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.token_database import ChunkedTokenDatabase
meta = LMCacheEngineMetadata("org/model@v1", 2, 1, "vllm", torch.float16, (2, 2, 4, 2, 8))
db = ChunkedTokenDatabase(SimpleNamespace(chunk_size=4), meta)
tokens = torch.tensor(json.loads(sys.argv[1]))
print(json.dumps([k.to_string() for _, _, k in db.process_tokens(tokens, cache_salt="x")]))
"""


def test_keys_identical_in_another_process() -> None:
    tokens = [int(t) for t in torch.randint(0, 100000, (23,), generator=torch.Generator().manual_seed(3))]
    here = [k.to_string() for _, _, k in _db().process_tokens(torch.tensor(tokens), cache_salt="x")]
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=REPO,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
