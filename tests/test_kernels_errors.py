"""lmcache.c_ops rejects bad input with a RuntimeError naming the argument, before writing."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from helpers import Case, bits, make_case, run_multi

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout


def assert_rejected(c: Case, call: Callable[[], None], match: str) -> None:
    """`call` raises RuntimeError matching `match` and leaves caches and object untouched."""
    snapshot = [t.clone() for t in c.keys + c.values] + [c.buffer.clone()]
    with pytest.raises(RuntimeError, match=match):
        call()
    for got, want in zip(c.keys + c.values + [c.buffer], snapshot):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("to_cache", [False, True])
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda layout: layout.name)
def test_slot_beyond_cache(layout: KVLayout, to_cache: bool) -> None:
    c = make_case(layout, torch.float32, num_blocks=12, block_size=16)
    c.slots[-1] = 12 * 16  # one past the last slot
    assert_rejected(c, lambda: run_multi(c, to_cache), r"slot_mapping\[36\] = 192 is beyond the cache")


def test_dtype_mismatch_between_obj_and_caches() -> None:
    c = make_case(KVLayout.FLASH, torch.float16)
    c.keys[1] = c.keys[1].view(torch.bfloat16)
    assert_rejected(c, lambda: run_multi(c, True), r"key_caches\[1\] has dtype BFloat16 but the object has dtype Half")


def test_slot_mapping_length_mismatch() -> None:
    c = make_case(KVLayout.CPU_IPEX, torch.float32)
    c.slots = c.slots[:-1]
    assert_rejected(c, lambda: run_multi(c, True), "slot_mapping has shape .* but obj has 37 tokens")


def test_slot_mapping_must_be_int64() -> None:
    c = make_case(KVLayout.CPU_IPEX, torch.float32)
    c.slots = c.slots.to(torch.int32)
    assert_rejected(c, lambda: run_multi(c, True), "slot_mapping must be int64")


def test_shape_contradicting_layout() -> None:
    """A flash-shaped cache [blocks, block_size, heads, head] passed as CPU_IPEX."""
    c = make_case(KVLayout.FLASH, torch.float32, block_size=16, num_heads=2)
    c.layout = KVLayout.CPU_IPEX
    assert_rejected(c, lambda: run_multi(c, True), r"key_caches\[0\] has shape \[12, 16, 2, 32\] which contradicts layout CPU_IPEX")


def test_packed_key_shape_checked_against_dtype_x() -> None:
    """A packed key viewed with fp32's x = 4 does not pass as a bf16 cache (x = 8)."""
    c = make_case(KVLayout.CPU_PACKED, torch.bfloat16)
    c.keys[0] = c.keys[0].view(12, 2, 8, 16, 4)
    assert_rejected(c, lambda: run_multi(c, True), "contradicts layout CPU_PACKED")


def test_cache_size_not_matching_geometry() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    c.values[2] = c.values[2].view(-1)[:-32]
    assert_rejected(c, lambda: run_multi(c, True), r"value_caches\[2\] has \d+ elements, not a multiple")


def test_layers_with_different_slot_counts() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    c.values[1] = c.values[1][:11]
    assert_rejected(c, lambda: run_multi(c, True), r"value_caches\[1\] holds 176 slots")


def test_non_contiguous_obj() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    c.obj = c.obj.transpose(2, 3).contiguous().transpose(2, 3)
    assert_rejected(c, lambda: run_multi(c, False), "obj must be contiguous")


def test_non_contiguous_cache() -> None:
    c = make_case(KVLayout.CPU_IPEX, torch.float32)
    c.keys[0] = c.keys[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert_rejected(c, lambda: run_multi(c, True), r"key_caches\[0\] must be contiguous")


def test_wrong_number_of_layers() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    assert_rejected(c, lambda: run_multi(c, True, keys=c.keys[:2]), "key_caches has 2 layers but obj has 3")
    assert_rejected(c, lambda: run_multi(c, True, values=c.values[:2]), "value_caches has 2 layers but obj has 3")


def test_mla_rules() -> None:
    c = make_case(KVLayout.MLA, torch.float16)
    assert_rejected(c, lambda: run_multi(c, True, values=c.keys), "value_caches must be empty for layout MLA")
    assert_rejected(
        c,
        lambda: c_ops.multi_layer_kv_transfer(c.obj, c.keys, [], c.slots, int(KVLayout.MLA), c.block_size, 2, True),
        "num_heads must be 1 for layout MLA",
    )


def test_obj_shape_and_hidden() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    assert_rejected(c, lambda: c_ops.multi_layer_kv_transfer(
        c.obj[:1], c.keys, c.values, c.slots, 0, c.block_size, c.num_heads, True), r"obj must have shape \[2, layers")
    assert_rejected(c, lambda: c_ops.multi_layer_kv_transfer(
        c.obj, c.keys, c.values, c.slots, 0, c.block_size, 3, True), "hidden size 64 is not a multiple of num_heads 3")


def test_unknown_layout() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    assert_rejected(c, lambda: c_ops.multi_layer_kv_transfer(
        c.obj, c.keys, c.values, c.slots, len(KVLayout), c.block_size, c.num_heads, True), "layout must be 0")


def test_single_layer_checks() -> None:
    c = make_case(KVLayout.FLASH, torch.float32)
    obj_layer = c.obj[:, 0].contiguous()
    with pytest.raises(RuntimeError, match="value_cache is required"):
        c_ops.single_layer_kv_transfer(obj_layer, c.keys[0], None, c.slots, 0, c.block_size, c.num_heads, True)
    with pytest.raises(RuntimeError, match="obj_layer must have shape"):
        c_ops.single_layer_kv_transfer(c.obj, c.keys[0], c.values[0], c.slots, 0, c.block_size, c.num_heads, True)
    with pytest.raises(RuntimeError, match="obj_layer must be contiguous"):
        c_ops.single_layer_kv_transfer(c.obj[:, 0], c.keys[0], c.values[0], c.slots, 0, c.block_size, c.num_heads, True)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 9999"):
        bad = c.slots.clone()
        bad[0] = 9999
        c_ops.single_layer_kv_transfer(obj_layer, c.keys[0], c.values[0], bad, 0, c.block_size, c.num_heads, True)


def test_packed_head_size_not_multiple_of_x() -> None:
    c = make_case(KVLayout.FLASH, torch.uint8, head_size=8, num_heads=4)
    keys = [k.view(-1) for k in c.keys]
    values = [v.view(-1) for v in c.values]
    assert_rejected(c, lambda: c_ops.multi_layer_kv_transfer(
        c.obj, keys, values, c.slots, int(KVLayout.CPU_PACKED), c.block_size, c.num_heads, True),
        r"needs head_size \(8\) to be a multiple of x = 16 / element_size = 16")


def test_cuda_tensors_without_cuda_build() -> None:
    if c_ops.WITH_CUDA:
        pytest.skip("this build has CUDA: the CPU-only message does not apply")
    c = make_case(KVLayout.FLASH, torch.float32)
    keys = [k.to("meta") for k in c.keys]
    values = [v.to("meta") for v in c.values]
    with pytest.raises(RuntimeError, match="built without CUDA support"):
        c_ops.multi_layer_kv_transfer(c.obj, keys, values, c.slots, 0, c.block_size, c.num_heads, True)
