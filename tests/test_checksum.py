"""The payload checksum of chunk format 5 (csrc/checksum.h, `chunk_format.payload_checksum`):
its sums against a reference written here from the definition, pieces that add up in any order
and size, changes a checksum must see, every vector path (LMCACHE_CPU_ISA caps), and the copy
kernel's stores summing exactly what they write, in every layout."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Tuple

import numpy as np
import pytest
import torch
from helpers import make_case
from test_kernels_batch import DTYPES, _objects, _split

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.storage_backend import chunk_format

KEY = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def reference_sums(data: bytes, first_byte: int = 0) -> Tuple[int, int]:
    """(mixed, plain) by the definition: words w_i (the last zero-padded), i from the payload's
    start; mixed adds lo32(x) * hi32(x) for x = w_i ^ ((i + 1) * KEY), plain adds w_i."""
    words = np.frombuffer(data + bytes(-len(data) % 8), dtype="<u8")
    index = np.arange(first_byte // 8 + 1, first_byte // 8 + 1 + len(words), dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = words ^ (index * np.uint64(KEY))
        mixed = int(((x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32))).sum(dtype=np.uint64))
    return mixed, int(words.sum(dtype=np.uint64))


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_sums_follow_the_definition_for_every_length_and_start() -> None:
    for n in list(range(0, 140)) + [1000, 4096 + 5, 65536 + 3]:
        data = _bytes(n, seed=n)
        for first in (0, 8, 4096):
            assert c_ops.checksum_sums(data, first) == reference_sums(data, first), (n, first)


def test_pieces_add_up_in_any_order_and_the_hasher_takes_any_sizes() -> None:
    data = _bytes(100_003, seed=1)
    cuts = [0, 8, 104, 4096, 70_000, 100_000]
    pieces = [c_ops.checksum_sums(data[a:b], a) for a, b in zip(cuts, cuts[1:])]
    pieces.append(c_ops.checksum_sums(data[100_000:], 100_000))
    total = tuple(sum(p[i] for p in reversed(pieces)) & MASK for i in range(2))
    assert total == c_ops.checksum_sums(data, 0)
    assert chunk_format.payload_checksum(data) == chunk_format.checksum_bytes(c_ops.checksum_finish(*total, len(data)))

    hasher = chunk_format.payload_hasher()
    for a, b in zip([0, 3, 5, 13, 4099, 4100], [3, 5, 13, 4099, 4100, len(data)]):
        hasher.update(memoryview(data)[a:b])
    assert hasher.digest() == chunk_format.payload_checksum(data)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        c_ops.checksum_sums(data, 3)


def test_a_flipped_bit_swapped_words_or_another_length_change_the_checksum() -> None:
    data = bytearray(_bytes(4096, seed=2))
    want = chunk_format.payload_checksum(data)
    for bit in (0, 7, 31, 32, 63, 8 * 4095 + 7):
        data[bit // 8] ^= 1 << (bit % 8)
        assert chunk_format.payload_checksum(data) != want, bit
        data[bit // 8] ^= 1 << (bit % 8)
    swapped = data[8:16] + data[0:8] + data[16:]
    assert chunk_format.payload_checksum(swapped) != want
    assert chunk_format.payload_checksum(data + b"\0") != want  # a zero byte more is another payload
    zeros = bytes(64)
    assert chunk_format.payload_checksum(zeros) != chunk_format.payload_checksum(zeros[:56])


def _store(layout: KVLayout, dtype: torch.dtype, aligned: bool, slots_of=None) -> Tuple[List[torch.Tensor], list]:
    c = make_case(layout, dtype, num_tokens=80, num_blocks=16, start=0, prefix=0)
    parts = [32, 16, 32]
    slots = _split(c.slots if slots_of is None else slots_of(c.slots), parts)
    objs = _objects(c, parts, aligned, seed=5)
    sums = c_ops.multi_layer_kv_transfer_batch(objs, c.keys, c.values, slots, int(c.layout), c.block_size,
                                               c.num_heads, False, True)
    return objs, sums


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda layout: layout.name)
def test_a_store_sums_what_it_writes(layout: KVLayout, dtype: torch.dtype, aligned: bool) -> None:
    objs, sums = _store(layout, dtype, aligned)
    assert len(sums) == len(objs)
    for obj, digest in zip(objs, sums):
        payload = obj.contiguous().view(torch.uint8).numpy().tobytes()
        assert chunk_format.checksum_bytes(digest) == chunk_format.payload_checksum(payload)


def test_a_store_that_skips_tokens_or_splits_words_sums_nothing_and_a_retrieve_cannot_sum() -> None:
    def one_skipped(slots: torch.Tensor) -> torch.Tensor:
        slots = slots.clone()
        slots[40] = -1
        return slots

    _, sums = _store(KVLayout.CPU_IPEX, torch.float32, True, one_skipped)
    assert sums == [None, None, None]
    c = make_case(KVLayout.CPU_IPEX, torch.uint8, num_heads=2, head_size=4, num_tokens=16, start=0, prefix=0)
    sums = c_ops.multi_layer_kv_transfer_batch(_objects(c, [16], True, seed=7), c.keys, c.values, [c.slots],
                                               int(c.layout), c.block_size, c.num_heads, False, True)
    assert sums == [None]  # 4-byte head rows: not whole words
    c = make_case(KVLayout.CPU_IPEX, torch.float32, num_tokens=16, start=0, prefix=0)
    with pytest.raises(RuntimeError, match="stores"):
        c_ops.multi_layer_kv_transfer_batch(_objects(c, [16], True, seed=6), c.keys, c.values, [c.slots],
                                            int(c.layout), c.block_size, c.num_heads, True, True)


@pytest.mark.skipif("LMCACHE_CPU_ISA" in os.environ, reason="already running under an ISA cap")
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_narrower_vector_paths_give_the_same_sums(isa: str) -> None:
    env = {**os.environ, "LMCACHE_CPU_ISA": isa, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "definition or add_up or store_sums and (CPU_PACKED or CPU_IPEX)"],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
