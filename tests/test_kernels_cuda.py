"""The CUDA kernels against the CPU kernels, byte for byte, where a GPU and a CUDA build exist.

Every layout, several dtypes and block sizes, both directions, each entry point (whole object,
one layer, a batch of objects, one layer of a batch), the object in device memory and in pinned
host memory. The CPU path is the reference: its own tests check it against a torch oracle.
Skipped on machines without a GPU (CI); `make setup` on a CUDA machine builds with CUDA.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from helpers import Case, bits, make_case

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout

pytestmark = pytest.mark.skipif(
    not (getattr(c_ops, "WITH_CUDA", False) and torch.cuda.is_available()),
    reason="needs a GPU and lmcache.c_ops built with CUDA",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]
LAYOUTS = list(KVLayout)


def _on(tensors: List[torch.Tensor], device: str) -> List[torch.Tensor]:
    """Copies on `device`, one per distinct tensor (CPU_ATTN's K and V lists share theirs)."""
    seen: dict = {}
    return [seen.setdefault(id(t), t.to(device)) for t in tensors]


def _cuda_case(c: Case, pinned_obj: bool) -> Case:
    keys = _on(c.keys, "cuda")
    values = keys if c.layout == KVLayout.CPU_ATTN else _on(c.values, "cuda")
    buffer = c.buffer.pin_memory() if pinned_obj else c.buffer.to("cuda")
    obj = buffer[c.offset:c.offset + c.obj.numel()].view(c.obj.shape)
    return Case(c.layout, c.dtype, c.block_size, c.num_heads, c.head_size, keys, values, c.slots, buffer, c.offset, obj)


def _args(c: Case, to_cache: bool) -> tuple:
    return int(c.layout), c.block_size, c.num_heads, to_cache


def _same(cpu: List[torch.Tensor], gpu: List[torch.Tensor]) -> None:
    torch.cuda.synchronize()
    for want, got in zip(cpu, gpu):
        assert torch.equal(bits(got.cpu()), bits(want))


@pytest.mark.parametrize("pinned_obj", [False, True], ids=["device-obj", "pinned-obj"])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_whole_object_store_and_retrieve(layout, dtype, block_size, pinned_obj):
    cpu = make_case(layout, dtype, block_size=block_size)
    gpu = _cuda_case(cpu, pinned_obj)
    for to_cache in (False, True):
        c_ops.multi_layer_kv_transfer(cpu.obj, cpu.keys, cpu.values, cpu.slots, *_args(cpu, to_cache))
        c_ops.multi_layer_kv_transfer(gpu.obj, gpu.keys, gpu.values, gpu.slots, *_args(gpu, to_cache))
        _same([cpu.buffer, *cpu.keys, *cpu.values], [gpu.buffer, *gpu.keys, *gpu.values])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_single_layer_store_and_retrieve(layout):
    cpu = make_case(layout, torch.bfloat16)
    gpu = _cuda_case(cpu, pinned_obj=False)
    for layer in range(len(cpu.keys)):
        cpu_layer = cpu.obj[:, layer].contiguous()  # [num_kv, tokens, hidden]
        gpu_layer = cpu_layer.to("cuda")
        for to_cache in (False, True):
            for c, obj_layer in ((cpu, cpu_layer), (gpu, gpu_layer)):
                value = None if layout == KVLayout.MLA else c.values[layer]
                c_ops.single_layer_kv_transfer(obj_layer, c.keys[layer], value, c.slots, *_args(c, to_cache))
            _same([cpu_layer, *cpu.keys, *cpu.values], [gpu_layer, *gpu.keys, *gpu.values])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_batches_whole_and_by_layer(layout):
    """Three chunks of one request: slots split into contiguous runs, one object each."""
    cpu = make_case(layout, torch.float16, num_tokens=48, start=0, prefix=3)
    gpu = _cuda_case(cpu, pinned_obj=False)
    cuts = [0, 16, 32, 48]

    def split(c: Case):
        objs = [c.obj[:, :, a:b] for a, b in zip(cuts, cuts[1:])]
        return [o.contiguous() for o in objs], [c.slots[a:b] for a, b in zip(cuts, cuts[1:])]

    cpu_objs, cpu_slots = split(cpu)
    gpu_objs, gpu_slots = split(gpu)
    for to_cache in (False, True):
        c_ops.multi_layer_kv_transfer_batch(cpu_objs, cpu.keys, cpu.values, cpu_slots, *_args(cpu, to_cache))
        c_ops.multi_layer_kv_transfer_batch(gpu_objs, gpu.keys, gpu.values, gpu_slots, *_args(gpu, to_cache))
        _same([*cpu_objs, *cpu.keys, *cpu.values], [*gpu_objs, *gpu.keys, *gpu.values])
        for layer in range(len(cpu.keys)):
            for c, objs, slots in ((cpu, cpu_objs, cpu_slots), (gpu, gpu_objs, gpu_slots)):
                value = None if layout == KVLayout.MLA else c.values[layer]
                c_ops.layer_kv_transfer_batch(objs, layer, c.keys[layer], value, slots, *_args(c, to_cache))
        _same([*cpu_objs, *cpu.keys, *cpu.values], [*gpu_objs, *gpu.keys, *gpu.values])
