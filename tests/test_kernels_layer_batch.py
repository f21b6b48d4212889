"""`c_ops.layer_kv_transfer_batch`: one layer of several whole chunk objects `[num_kv, L, T_i,
hidden]` straight to / from that layer's cache (the layer-wise path, no staging copy), byte-exact
with the torch indexing oracle of test_kernels.py in every layout and both directions; the other
layers of the objects and the other layers' caches stay untouched; bad arguments raise before
anything moves."""

from typing import List

import pytest
import torch
from helpers import Case, bits, make_case, random_bytes
from test_kernels import _gather, _indexable, _scatter, clone_caches

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout

DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.float64]
PARTS = [17, 32, 5, 26]  # chunk lengths: odd, block-sized, short; 80 tokens in all
LAYER = 2  # a middle layer of 4


def _case(layout: KVLayout, dtype: torch.dtype) -> Case:
    # start mid-block, a -1 prefix (skipped both ways) inside the first chunk
    return make_case(layout, dtype, num_layers=4, num_tokens=sum(PARTS), num_blocks=16, start=3, prefix=5)


def _objects(c: Case, seed: int, unaligned: int = 1) -> List[torch.Tensor]:
    """Random chunk objects; object `unaligned` is a view at an odd offset inside a bigger buffer."""
    gen = torch.Generator().manual_seed(seed)
    hidden = c.num_heads * c.head_size
    out = []
    for i, n in enumerate(PARTS):
        numel = c.num_kv * len(c.keys) * n * hidden
        pad = 3 if i == unaligned else 0
        buf = random_bytes((numel + pad,), c.dtype, gen)
        out.append(buf[pad:].view(c.num_kv, len(c.keys), n, hidden))
    return out


def _slots(c: Case) -> List[torch.Tensor]:
    return list(torch.split(c.slots, PARTS))


def _call(c: Case, objs, layer, keys, values, slots, to_cache: bool) -> None:
    value = values[layer] if c.num_kv == 2 else None
    c_ops.layer_kv_transfer_batch(objs, layer, keys[layer], value, slots, int(c.layout), c.block_size, c.num_heads,
                                  to_cache)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("to_cache", [False, True], ids=["store", "retrieve"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda layout: layout.name)
def test_one_layer_matches_reference(layout: KVLayout, dtype: torch.dtype, to_cache: bool) -> None:
    c = _case(layout, dtype)
    (_check_retrieve if to_cache else _check_store)(c)


def _check_store(c: Case) -> None:
    objs = _objects(c, seed=1)
    want = [o.clone() for o in objs]
    _call(c, objs, LAYER, c.keys, c.values, _slots(c), False)
    caches = [c.keys, c.values][: c.num_kv]
    for obj, slots in zip(want, _slots(c)):
        valid = slots >= 0
        if not bool(valid.any()):
            continue
        for kv, layer_caches in enumerate(caches):
            rows = _gather(layer_caches[LAYER], c.layout, kv == 1, slots[valid], c.block_size)
            _indexable(obj)[kv, LAYER, valid] = rows
    for got, exp in zip(objs, want):
        _same(got, exp)  # layer LAYER as the oracle says, every other layer as it was


def _check_retrieve(c: Case) -> None:
    objs = _objects(c, seed=2)
    snapshot = [o.clone() for o in objs]
    got_k, got_v = clone_caches(c)
    want_k, want_v = clone_caches(c)
    _call(c, objs, LAYER, got_k, got_v, _slots(c), True)
    for obj, slots in zip(objs, _slots(c)):
        valid = slots >= 0
        for kv, layer_caches in enumerate([want_k, want_v][: c.num_kv]):
            rows = _indexable(obj)[kv, LAYER, valid]
            _scatter(layer_caches[LAYER], c.layout, kv == 1, slots[valid], c.block_size, rows)
    for got, exp in zip(got_k + got_v, want_k + want_v):
        _same(got, exp)  # only layer LAYER's caches changed
    for got, exp in zip(objs, snapshot):
        _same(got, exp)  # the objects are only read


@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda layout: layout.name)
def test_every_layer_in_turn_equals_the_whole_chunk_batch(layout: KVLayout) -> None:
    """A layer-wise store / retrieve of all layers moves exactly what multi_layer_kv_transfer_batch does."""
    c = _case(layout, torch.float32)
    slots = _slots(c)
    args = (int(c.layout), c.block_size, c.num_heads)
    layered, whole = _objects(c, seed=3), _objects(c, seed=4)
    for layer in range(len(c.keys)):
        _call(c, layered, layer, c.keys, c.values, slots, False)
    c_ops.multi_layer_kv_transfer_batch(whole, c.keys, c.values, slots, *args, False)
    # compare only the tokens that have a slot (skipped ones keep each object's own random bytes)
    for got, exp, s in zip(layered, whole, slots):
        _same(got[:, :, s >= 0], exp[:, :, s >= 0])

    sources = _objects(c, seed=5)
    lk, lv = clone_caches(c)
    wk, wv = clone_caches(c)
    for layer in range(len(c.keys)):
        _call(c, sources, layer, lk, lv, slots, True)
    c_ops.multi_layer_kv_transfer_batch(sources, wk, wv if c.num_kv == 2 else [], slots, *args, True)
    for got, exp in zip(lk + lv, wk + wv):
        _same(got, exp)


def test_no_objects_is_a_no_op() -> None:
    c = _case(KVLayout.FLASH, torch.float32)
    c_ops.layer_kv_transfer_batch([], 0, c.keys[0], c.values[0], [], int(c.layout), c.block_size, c.num_heads, True)


def _rejects(c: Case, objs, call, match: str) -> None:
    """`call` raises RuntimeError matching `match`; caches and objects are untouched."""
    snapshot = [t.clone() for t in c.keys + c.values + list(objs)]
    with pytest.raises(RuntimeError, match=match):
        call()
    for got, want in zip(c.keys + c.values + list(objs), snapshot):
        _same(got, want)


@pytest.mark.parametrize("to_cache", [False, True])
def test_bad_layer_index(to_cache: bool) -> None:
    c = _case(KVLayout.CPU_IPEX, torch.float32)
    objs, slots = _objects(c, seed=6), _slots(c)
    args = (int(c.layout), c.block_size, c.num_heads, to_cache)
    _rejects(c, objs, lambda: c_ops.layer_kv_transfer_batch(objs, 4, c.keys[0], c.values[0], slots, *args),
             r"layer 4 is out of range for objs\[0\] of shape \[2, 4, 17, 64\] \(4 layers\)")
    _rejects(c, objs, lambda: c_ops.layer_kv_transfer_batch(objs, -1, c.keys[0], c.values[0], slots, *args),
             "layer must be >= 0, got -1")
    # an object with fewer layers than the others: named, and nothing moved for the earlier ones
    short = list(objs)
    short[2] = objs[2][:, :2].contiguous()
    _rejects(c, objs, lambda: c_ops.layer_kv_transfer_batch(short, 3, c.keys[3], c.values[3], slots, *args),
             r"layer 3 is out of range for objs\[2\] of shape \[2, 2, 5, 64\] \(2 layers\)")


def test_mismatched_shapes_and_arguments() -> None:
    c = _case(KVLayout.FLASH, torch.float32)
    objs, slots = _objects(c, seed=7), _slots(c)
    args = (int(c.layout), c.block_size, c.num_heads, True)
    k, v = c.keys[1], c.values[1]

    def call(o=objs, s=slots, key=k, value=v):
        return lambda: c_ops.layer_kv_transfer_batch(o, 1, key, value, s, *args)

    _rejects(c, objs, call(s=slots[:3]), "objs has 4 objects but slot_mappings has 3")
    _rejects(c, objs, call(s=[slots[0], slots[2], slots[1], slots[3]]),
             r"slot_mappings\[1\] has shape \[5\] but objs\[1\] has 32 tokens")
    wrong_hidden = list(objs)
    wrong_hidden[3] = torch.zeros(2, 4, 26, 48)
    _rejects(c, objs, call(o=wrong_hidden), r"key_cache has 16384 elements, not a multiple of the 768 of one FLASH block \(block_size 16, hidden 48\)")
    wrong_kv = list(objs)
    wrong_kv[1] = objs[1][:1].contiguous()
    _rejects(c, objs, call(o=wrong_kv), r"objs\[1\] must have shape \[2, layers, tokens, hidden\]")
    strided = list(objs)
    strided[0] = torch.zeros(2, 4, 40, 64)[:, :, :17]
    _rejects(c, objs, call(o=strided), r"objs\[0\] must be contiguous")
    wrong_dtype = list(objs)
    wrong_dtype[2] = objs[2].to(torch.float64)
    _rejects(c, objs, call(o=wrong_dtype), r"key_cache has dtype Float but the object has dtype Double")
    _rejects(c, objs, call(value=None), "value_cache is required for every layout but MLA")
    _rejects(c, objs, call(key=k.view(-1)[: k.numel() // 2].view(k.shape[0] // 2, *k.shape[1:]).permute(0, 2, 1, 3)),
             r"key_cache must be contiguous")
    _rejects(c, objs, call(value=c.values[1][:8]), r"value_cache holds 128 slots but key_cache holds 256")
    bad = [s.clone() for s in slots]
    bad[3][4] = 16 * 16
    _rejects(c, objs, call(s=bad), r"slot_mappings\[3\]\[4\] = 256 is beyond the cache")


def test_mla_takes_no_value_cache() -> None:
    c = _case(KVLayout.MLA, torch.float32)
    objs, slots = _objects(c, seed=8), _slots(c)
    args = (int(c.layout), c.block_size, c.num_heads, True)
    _rejects(c, objs, lambda: c_ops.layer_kv_transfer_batch(objs, 1, c.keys[1], c.keys[0], slots, *args),
             "value_cache must be empty for layout MLA")
    two = [torch.zeros(2, 4, n, 32) for n in PARTS]
    _rejects(c, objs, lambda: c_ops.layer_kv_transfer_batch(two, 1, c.keys[1], None, slots, *args),
             r"objs\[0\] must have shape \[1, layers, tokens, hidden\] for layout MLA")
