"""`c_ops.multi_layer_kv_transfer_batch`: a request's chunks in one call, byte-exact with one
call per chunk, in every layout; aligned objects (the non-temporal store path) and unaligned
ones (the plain copy path) alike; every argument checked before anything moves."""

from typing import List

import pytest
import torch
from helpers import bits, make_case, random_bytes

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout

DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.float64]


def _objects(c, parts: List[int], aligned: bool, seed: int) -> List[torch.Tensor]:
    """Objects for consecutive pieces of the case's slots: 64-byte aligned, or each at an odd
    element offset inside a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    hidden = c.num_heads * c.head_size
    out = []
    for n in parts:
        shape = (c.num_kv, len(c.keys), n, hidden)
        numel = c.num_kv * len(c.keys) * n * hidden
        pad = 0 if aligned else 3
        buf = random_bytes((numel + pad + 64,), c.dtype, gen)
        if aligned:
            shift = (-buf.data_ptr() % 64) // buf.element_size()
            pad = shift
        out.append(buf[pad : pad + numel].view(shape))
    return out


def _split(slots: torch.Tensor, parts: List[int]) -> List[torch.Tensor]:
    pieces, at = [], 0
    for n in parts:
        pieces.append(slots[at : at + n].contiguous())
        at += n
    return pieces


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda layout: layout.name)
def test_batch_equals_one_call_per_chunk(layout: KVLayout, dtype: torch.dtype, aligned: bool) -> None:
    c = make_case(layout, dtype, num_tokens=80, num_blocks=16, start=0, prefix=0)
    parts = [32, 16, 32]
    slots = _split(c.slots, parts)
    args = (int(c.layout), c.block_size, c.num_heads)

    # store: the batch writes what one call per chunk writes
    batch_objs = _objects(c, parts, aligned, seed=1)
    single_objs = [o.clone() for o in batch_objs]
    c_ops.multi_layer_kv_transfer_batch(batch_objs, c.keys, c.values, slots, *args, False)
    for obj, s in zip(single_objs, slots):
        c_ops.multi_layer_kv_transfer(obj, c.keys, c.values, s, *args, False)
    for got, want in zip(batch_objs, single_objs):
        assert torch.equal(bits(got), bits(want))

    # retrieve: fresh objects written back into copies of the caches, both ways
    sources = _objects(c, parts, aligned, seed=2)

    def caches():
        keys = [t.clone() for t in c.keys]
        values = list(keys) if layout == KVLayout.CPU_ATTN else [t.clone() for t in c.values]
        return keys, values

    bk, bv = caches()
    sk, sv = caches()
    c_ops.multi_layer_kv_transfer_batch(sources, bk, bv, slots, *args, True)
    for obj, s in zip(sources, slots):
        c_ops.multi_layer_kv_transfer(obj, sk, sv, s, *args, True)
    for got, want in zip(bk + bv, sk + sv):
        assert torch.equal(bits(got), bits(want))
    # and what was written is what the objects held (round trip)
    back = [torch.empty_like(o) for o in sources]
    c_ops.multi_layer_kv_transfer_batch(back, bk, bv, slots, *args, False)
    for got, want in zip(back, sources):
        assert torch.equal(bits(got), bits(want))


def test_a_bad_object_fails_the_call_before_anything_moves() -> None:
    c = make_case(KVLayout.CPU_IPEX, torch.float32, num_tokens=48, start=0, prefix=0)
    parts = [16, 32]
    slots = _split(c.slots, parts)
    objs = _objects(c, parts, True, seed=3)
    before = objs[0].clone()
    objs[1] = objs[1].to(torch.float64)  # dtype contradicts the caches
    with pytest.raises(RuntimeError, match=r"objs\[1\]|dtype"):
        c_ops.multi_layer_kv_transfer_batch(objs, c.keys, c.values, slots, int(c.layout), c.block_size, c.num_heads, False)
    assert torch.equal(bits(objs[0]), bits(before))
    with pytest.raises(RuntimeError, match=r"slot_mappings"):
        c_ops.multi_layer_kv_transfer_batch(objs[:1], c.keys, c.values, slots, int(c.layout), c.block_size, c.num_heads, False)
    bad = [slots[0], slots[1].clone()]
    bad[1][3] = 10**9
    with pytest.raises(RuntimeError, match=r"slot_mappings\[1\]\[3\]"):
        c_ops.multi_layer_kv_transfer_batch(
            _objects(c, parts, True, seed=4), c.keys, c.values, bad, int(c.layout), c.block_size, c.num_heads, False
        )
    c_ops.multi_layer_kv_transfer_batch([], c.keys, c.values, [], int(c.layout), c.block_size, c.num_heads, False)
