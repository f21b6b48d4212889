"""What the tests share: cache keys, engines on CPU tensors, kernel transfer cases, real-vLLM runs, plot layout.

Test files import from here (and from `kv_reference`, `v0_inputs`, `v1_helpers`, `redis_fixture`),
never from each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import psutil
import pytest
import torch
from conftest import VLLMJobResult, random_prompt
from kv_reference import Geometry, gather

from lmcache import c_ops
from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.kv_layout import KVLayout, layout_shape
from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.token_database import ChunkedTokenDatabase
from lmcache.integration.vllm.request_log import parse_v0_step_lines
from lmcache.utils import CacheEngineKey

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- keys


def key(i: int, model: str = "m") -> CacheEngineKey:
    """The i-th distinct key of `model` (a 32-hex-digit chunk hash, as real keys have)."""
    return CacheEngineKey("vllm", model, 1, 0, f"{i:032x}")


# ---------------------------------------------------------------- engines on CPU tensors

CHUNK = 8
GB = 1024**3


def geometry(layout=KVLayout.CPU_IPEX, dtype=torch.float32) -> Geometry:
    heads = 1 if layout == KVLayout.MLA else 2
    return Geometry(layout, num_layers=2, num_blocks=16, block_size=4, num_heads=heads, head_size=16, dtype=dtype)


def chunk_bytes(geo: Geometry) -> int:
    hidden = geo.head_size if geo.layout == KVLayout.MLA else geo.hidden
    return geo.num_kv * geo.num_layers * CHUNK * hidden * geo.dtype.itemsize


def config(**overrides) -> LMCacheEngineConfig:
    fields = dict(chunk_size=CHUNK, remote_url=None, max_local_cpu_size=1 / 1024)  # 1 MiB
    fields.update(overrides)
    return LMCacheEngineConfig.from_defaults(**fields)


def metadata(geo: Geometry, chunk_size: int = CHUNK) -> LMCacheEngineMetadata:
    mla = geo.layout == KVLayout.MLA
    kv_shape = (geo.num_layers, 1 if mla else 2, chunk_size, geo.num_heads, geo.head_size)
    return LMCacheEngineMetadata("test/model", 1, 0, "vllm", geo.dtype, kv_shape, mla)


def connector(geo: Geometry) -> VLLMPagedMemGPUConnectorV2:
    mla = geo.layout == KVLayout.MLA
    return VLLMPagedMemGPUConnectorV2(
        geo.head_size if mla else geo.hidden, geo.num_layers, layout=geo.layout, num_kv_heads=geo.num_heads, use_mla=mla
    )


def make_engine(
    geo: Geometry, cfg: LMCacheEngineConfig, *, cpu_bytes: Optional[int] = None, register_as: Optional[str] = None
) -> LMCacheEngine:
    """An engine for `geo`'s caches: CPU memory of `cpu_bytes` (default: the config's size), or
    built and registered by `LMCacheEngineBuilder` under `register_as` (as the doors find it)."""
    meta = metadata(geo, cfg.chunk_size)
    if register_as is not None:
        return LMCacheEngineBuilder.get_or_create(register_as, cfg, meta, connector(geo))
    allocator = HostMemoryAllocator(cpu_bytes if cpu_bytes is not None else int(cfg.max_local_cpu_size * GB))
    return LMCacheEngine(cfg, meta, allocator, ChunkedTokenDatabase(cfg, meta), connector(geo))


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def slots_for(geo: Geometry, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(geo.num_slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.long)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_loaded(geo, source, src_slots, target, dst_slots, upto: int) -> None:
    """Tokens [0, upto) in `target` hold exactly what `source` held for them."""
    assert torch.equal(bits(gather(geo, target, dst_slots[:upto].tolist())), bits(gather(geo, source, src_slots[:upto].tolist())))


# ---------------------------------------------------------------- kernel transfer cases


@dataclass
class Case:
    """One transfer problem: caches, slots and an object placed inside a larger buffer."""

    layout: KVLayout
    dtype: torch.dtype
    block_size: int
    num_heads: int
    head_size: int
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    slots: torch.Tensor
    buffer: torch.Tensor  # flat; obj is a view into it at `offset`
    offset: int
    obj: torch.Tensor

    @property
    def num_kv(self) -> int:
        return 1 if self.layout == KVLayout.MLA else 2


def random_bytes(shape: Tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (any dtype: the kernels move bytes)."""
    es = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * es,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_slots(num_tokens: int, block_size: int, num_blocks: int, start: int, prefix: int,
               gen: torch.Generator) -> torch.Tensor:
    """Slots of tokens at positions start.. in randomly chosen blocks; the first `prefix` are -1."""
    used = (start + num_tokens + block_size - 1) // block_size
    blocks = torch.randperm(num_blocks, generator=gen)[:used]
    pos = torch.arange(start, start + num_tokens)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    slots[:prefix] = -1
    return slots.to(torch.int64)


def make_case(layout: KVLayout, dtype: torch.dtype, *, num_layers: int = 3, num_heads: int = 2,
              head_size: int = 32, block_size: int = 16, num_blocks: int = 12, num_tokens: int = 37,
              start: int = 3, prefix: int = 5, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    if layout == KVLayout.MLA:
        num_heads = 1
    hidden = num_heads * head_size
    shape_k = layout_shape(layout, num_blocks, block_size, num_heads, head_size, dtype)
    keys = [random_bytes(shape_k, dtype, gen) for _ in range(num_layers)]
    values: List[torch.Tensor] = []
    if layout == KVLayout.CPU_ATTN:  # one tensor per layer holds K and V
        values = list(keys)
    elif layout != KVLayout.MLA:
        shape_v = layout_shape(layout, num_blocks, block_size, num_heads, head_size, dtype, is_value=True)
        values = [random_bytes(shape_v, dtype, gen) for _ in range(num_layers)]
    slots = make_slots(num_tokens, block_size, num_blocks, start, prefix, gen)
    num_kv = 1 if layout == KVLayout.MLA else 2
    numel = num_kv * num_layers * num_tokens * hidden
    offset = 7 * hidden + 3  # deliberately not a multiple of anything useful
    buffer = random_bytes((offset + numel + 11,), dtype, gen)
    obj = buffer[offset:offset + numel].view(num_kv, num_layers, num_tokens, hidden)
    return Case(layout, dtype, block_size, num_heads, head_size, keys, values, slots, buffer, offset, obj)


def run_multi(c: Case, to_cache: bool, keys: Optional[List[torch.Tensor]] = None,
              values: Optional[List[torch.Tensor]] = None) -> None:
    c_ops.multi_layer_kv_transfer(c.obj, c.keys if keys is None else keys,
                                  c.values if values is None else values, c.slots, int(c.layout),
                                  c.block_size, c.num_heads, to_cache)


# ---------------------------------------------------------------- real vLLM, cache on and off

V0_CHUNK = 256
A = random_prompt(700, seed=11)
B = A[:400] + random_prompt(300, seed=12)  # shares one whole chunk (256 tokens) with A
C = random_prompt(300, seed=13)  # shares nothing
D = A[:600] + random_prompt(100, seed=14)  # shares two whole chunks (512 tokens) with A


def door_steps(log: str) -> List[Tuple[int, int, int]]:
    """(prompt tokens, loaded, computed) per v0 prompt step from position 0, in log order."""
    return [(s.query_tokens, s.loaded_tokens, s.computed_tokens) for s in parse_v0_step_lines(log) if not s.context_tokens]


def logprobs_of(result: VLLMJobResult) -> list:
    (payload,) = [ln for ln in result.log.splitlines() if ln.startswith("RESULT ")][-1:]
    return json.loads(payload[len("RESULT ") :])["logprobs"]


def flat(x) -> list:
    return [v for item in x for v in (flat(item) if isinstance(item, list) else [item])]


def assert_same_generation(cached: VLLMJobResult, plain: VLLMJobResult) -> None:
    """Equal greedy tokens, logprobs equal within float32 noise."""
    assert cached.outputs == plain.outputs
    got, want = flat(logprobs_of(cached)), flat(logprobs_of(plain))
    assert len(got) == len(want) > 0
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-3


def text_clashes(fig) -> List[str]:
    """Every pair of drawn texts that overlap, and every text over a framed axes it does not belong to
    (legends in an axes count as over it) or sticking out of the one it is drawn in (value labels,
    notes), in pixels after layout at the figure's own dpi (the PNG's)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = []  # (text, the axes it is drawn inside or None)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            texts += [(t.label1, None) for t in axis.get_major_ticks() + axis.get_minor_ticks()
                      if t.label1.get_visible() and lo <= t.get_loc() <= hi]
            texts += [(axis.label, None), (axis.get_offset_text(), None)]
        texts += [(ax.title, None)] + [(t, ax) for t in ax.texts]
    texts += [(t, None) for t in fig.texts]
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        texts += [(t, None) for t in (legend.get_title(), *legend.get_texts())]
    texts = [(t, ax, t.get_window_extent(renderer)) for t, ax in texts if t.get_visible() and t.get_text().strip()]
    framed = [ax for ax in fig.axes if ax.axison]
    clashes = []
    for i, (a, _, box_a) in enumerate(texts):
        clashes += [f"{a.get_text()[:40]!r} over {b.get_text()[:40]!r}" for b, _, box_b in texts[i + 1:]
                    if box_a.overlaps(box_b)]
    for t, own, box in texts:
        clashes += [f"{t.get_text()[:40]!r} over the axes {ax.get_title()[:40]!r}" for ax in framed
                    if ax is not own and box.overlaps(ax.get_window_extent(renderer))]
        frame = own.get_window_extent(renderer) if own is not None else None
        if frame is not None and not (frame.x0 <= box.x0 and box.x1 <= frame.x1
                                      and frame.y0 <= box.y0 and box.y1 <= frame.y1):
            clashes.append(f"{t.get_text()[:40]!r} sticks out of the axes {own.get_title()[:40]!r}")
    return clashes


# ---------------------------------------------------------------- network


def own_address() -> str:
    """A non-loopback IPv4 address of this machine (the test is skipped where there is none)."""
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family.name == "AF_INET" and not addr.address.startswith("127."):
                return addr.address
    pytest.skip("this machine has no non-loopback IPv4 address")


# ---------------------------------------------------------------- HTTP JSON APIs (the controller's)


def post_json(url: str, body, token: Optional[str] = None, method: str = "POST", timeout: float = 60) -> tuple:
    """(status, decoded JSON answer) of one call; `body` as JSON (bytes go as they are)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data if method == "POST" else None, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
