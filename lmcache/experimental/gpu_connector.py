"""Connectors: copy one chunk between a serving engine's KV caches and a `KV_BLOB` memory object.

A `KV_BLOB` object is `[2, num_layers, num_tokens, hidden]` (`[1, ...]` for MLA, where hidden is
the latent head size). Every copy is one `lmcache.c_ops.multi_layer_kv_transfer` call covering
all layers of the chunk, on the device the KV caches live on (CPU here, CUDA where vLLM has a GPU).

- `VLLMNestedTupleGPUConnector`: per layer a (K, V) pair of `[num_tokens, ...]` tensors holding the
  whole token sequence contiguously (no paging).
- `VLLMPagedMemGPUConnector`: per layer a paged (K, V) pair; the layout is read from the shapes.
- `VLLMPagedMemGPUConnectorV2`: what vLLM hands over today - a list with one tensor per layer
  (flash `(2, num_blocks, block_size, heads, head_size)`, CPU `(2, num_blocks, block_size * heads *
  head_size)`, MLA `(num_blocks, block_size, head_size)` (vLLM 0.32 CPU: `(num_blocks, 1,
  block_size, head_size)`), vLLM 0.3x CPU `(num_blocks, heads, block_size, 2 * head_size)` with
  `layout=CPU_ATTN`) or a (K, V) pair per layer; the layout comes from the `layout=` kwarg or,
  where unambiguous, from the shapes.

`slot_mapping` is a 1-D int64 tensor covering the whole token sequence (`slot_mapping[start:end]`
belongs to the chunk); it may begin with -1s for a prefix the serving engine already has, which
the chunk must not overlap when storing. A slot mapping exactly `end - start` long is taken as the
chunk's own.
"""

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

import lmcache.c_ops as c_ops
from lmcache.experimental.kv_layout import KVLayout, layout_dims, mla_latent_view, split_kv_caches
from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.storage_backend import chunk_format


class GPUConnectorInterface(ABC):
    """Moves the KV of tokens `[start, end)` between the serving engine and a memory object."""

    @abstractmethod
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy the KV of tokens `[start, end)` into `memory_obj` (store)."""

    @abstractmethod
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy `memory_obj` into the KV of tokens `[start, end)` (retrieve)."""

    @abstractmethod
    def get_shape(self, num_tokens: int) -> torch.Size:
        """The memory object shape that holds `num_tokens` tokens."""

    def batched_from_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], *,
        checksums: bool = False, **kwargs: Any
    ) -> Optional[List[Optional[bytes]]]:
        """`from_gpu` for a request's chunks; connectors that copy them in one call override it
        (and, asked for `checksums`, may return each object's payload checksum, computed as they
        wrote it; None: not)."""
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)
        return None

    def batched_to_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        """`to_gpu` for a request's chunks; connectors that copy them in one call override it."""
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)


@dataclass(frozen=True)
class PagedGeometry:
    """How the kernel must address one layer's cache."""

    layout: KVLayout
    block_size: int
    num_heads: int


def _kvcaches(kwargs: dict) -> Sequence[Any]:
    kvcaches = kwargs.get("kvcaches")
    if kvcaches is None:
        raise ValueError("'kvcaches' must be provided in kwargs (the serving engine's KV caches)")
    if len(kvcaches) == 0:
        raise ValueError("'kvcaches' is empty: expected one entry per layer")
    return kvcaches


def _chunk_slots(kwargs: dict, start: int, end: int, device: torch.device) -> torch.Tensor:
    """`slot_mapping[start:end]` as int64 on the caches' device."""
    slot_mapping = kwargs.get("slot_mapping")
    if slot_mapping is None:
        raise ValueError("'slot_mapping' must be provided in kwargs")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError(f"'slot_mapping' must be a 1-D tensor, got {_describe(slot_mapping)}")
    n = slot_mapping.numel()
    if n >= end:
        slots = slot_mapping[start:end]
    elif n == end - start:
        slots = slot_mapping
    else:
        raise ValueError(f"'slot_mapping' has {n} entries; tokens [{start}, {end}) need {end} (or {end - start})")
    return slots.to(device=device, dtype=torch.long)


def _check_start_end(start: int, end: int) -> None:
    if not 0 <= start < end:
        raise ValueError(f"token range [{start}, {end}) is empty or negative")


def _blob_tensor(memory_obj: MemoryObj, expected: torch.Size, storing: bool) -> torch.Tensor:
    if storing and memory_obj.metadata.fmt != MemoryFormat.KV_BLOB:
        raise ValueError(f"memory object must be in KV_BLOB format, got {memory_obj.metadata.fmt.name}")
    tensor = memory_obj.tensor
    assert tensor is not None, "the memory object has no tensor"
    if tensor.shape != expected:
        raise ValueError(f"memory object has shape {list(tensor.shape)}, this chunk needs {list(expected)}")
    return tensor


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__


class _KVBlobConnector(GPUConnectorInterface):
    """Shared shape logic: `[2, L, T, hidden]` objects, `[1, L, T, hidden]` for MLA."""

    def __init__(self, hidden_dim_size: int, num_layers: int, use_mla: bool = False) -> None:
        if hidden_dim_size <= 0 or num_layers <= 0:
            raise ValueError(
                f"hidden_dim_size ({hidden_dim_size}) and num_layers ({num_layers}) must be positive"
            )
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers
        self.use_mla = use_mla

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1 if self.use_mla else 2, self.num_layers, num_tokens, self.hidden_dim_size])

    def _check_layers(self, kvcaches: Sequence[Any]) -> None:
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"'kvcaches' has {len(kvcaches)} layers, the connector was made for {self.num_layers}")


class VLLMNestedTupleGPUConnector(_KVBlobConnector):
    """KV caches as `((K_0, V_0), (K_1, V_1), ...)` with each tensor `[num_tokens, ...]`, holding
    the whole token sequence in order (token i at row i)."""

    def _flat_caches(self, kwargs: dict) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        kvcaches = _kvcaches(kwargs)
        self._check_layers(kvcaches)
        keys, values = split_kv_caches(kvcaches, KVLayout.FLASH)
        flat: List[List[torch.Tensor]] = [[], []]
        for kind, tensors in enumerate((keys, values)):
            for layer, t in enumerate(tensors):
                if not t.is_contiguous() or t.numel() % self.hidden_dim_size:
                    raise ValueError(
                        f"kvcaches[{layer}][{kind}] must be a contiguous [num_tokens, ...] tensor with "
                        f"{self.hidden_dim_size} elements per token, got shape {tuple(t.shape)}"
                    )
                flat[kind].append(t.view(-1))
        return flat[0], flat[1]

    def _transfer(self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict, to_cache: bool) -> None:
        _check_start_end(start, end)
        keys, values = self._flat_caches(kwargs)
        blob = _blob_tensor(memory_obj, self.get_shape(end - start), storing=not to_cache)
        total = keys[0].numel() // self.hidden_dim_size
        if end > total:
            raise ValueError(f"token range [{start}, {end}) is beyond the {total} tokens in 'kvcaches'")
        # One token per "block": slot i is token i, hidden laid out flat.
        slots = torch.arange(start, end, dtype=torch.long, device=keys[0].device)
        c_ops.multi_layer_kv_transfer(blob, keys, values, slots, int(KVLayout.FLASH), 1, 1, to_cache)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Store tokens `[start, end)` of the nested-tuple 'kvcaches' kwarg into `memory_obj`."""
        self._transfer(memory_obj, start, end, kwargs, to_cache=False)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Write `memory_obj` into tokens `[start, end)` of the nested-tuple 'kvcaches' kwarg."""
        self._transfer(memory_obj, start, end, kwargs, to_cache=True)


class VLLMPagedMemGPUConnector(_KVBlobConnector):
    """Paged KV caches as one (K, V) pair per layer, e.g. flash `[num_blocks, block_size, heads,
    head_size]`; kwargs 'kvcaches' and 'slot_mapping'. The layout is read from the shapes, or
    given with `layout=` / `num_kv_heads=` / `block_size=` when the shapes are ambiguous."""

    def __init__(
        self,
        hidden_dim_size: int,
        num_layers: int,
        *,
        layout: Optional[KVLayout] = None,
        num_kv_heads: Optional[int] = None,
        block_size: Optional[int] = None,
        use_mla: bool = False,
    ) -> None:
        super().__init__(hidden_dim_size, num_layers, use_mla or layout == KVLayout.MLA)
        self.layout = KVLayout(layout) if layout is not None else (KVLayout.MLA if use_mla else None)
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        if num_kv_heads is not None and hidden_dim_size % num_kv_heads:
            raise ValueError(f"hidden_dim_size {hidden_dim_size} is not a multiple of num_kv_heads {num_kv_heads}")

    # ---- layout detection -----------------------------------------------------------------

    def geometry(self, kvcaches: Sequence[Any]) -> PagedGeometry:
        """The layout, block size and head count of these caches (kwargs first, then shapes)."""
        first = kvcaches[0]
        if self.layout == KVLayout.MLA:
            first = mla_latent_view(first)
            if not isinstance(first, torch.Tensor) or first.dim() != 3:
                raise ValueError(
                    f"MLA caches must be (num_blocks, [1,] block_size, head_size) tensors, got {_describe(first)}"
                )
            return PagedGeometry(KVLayout.MLA, self._block_size_or(first.shape[1]), 1)
        if isinstance(first, torch.Tensor):
            return self._geometry_stacked(first)
        if len(first) != 2:
            raise ValueError(f"each kvcaches entry must be a tensor or a (K, V) pair, got {len(first)} items")
        return self._geometry_pair(first[0])

    def _block_size_or(self, found: int) -> int:
        if self.block_size is not None and self.block_size != found:
            raise ValueError(f"block_size={self.block_size} contradicts the cache shape (block size {found})")
        return found

    def _heads(self, found: Optional[int] = None) -> int:
        heads = self.num_kv_heads if self.num_kv_heads is not None else found
        if heads is None:
            raise ValueError("num_kv_heads is needed for this KV cache layout; pass num_kv_heads=")
        if found is not None and heads != found:
            raise ValueError(f"num_kv_heads={heads} contradicts the cache shape ({found} heads)")
        return heads

    def _geometry_stacked(self, t: torch.Tensor) -> PagedGeometry:
        if self.layout == KVLayout.CPU_ATTN:
            # vLLM 0.3x CPU attention: (num_blocks, heads, block_size, 2 * head_size), K and V inside.
            if t.dim() != 4 or t.shape[1] * t.shape[3] != 2 * self.hidden_dim_size:
                raise ValueError(
                    f"a CPU_ATTN cache must be (num_blocks, heads, block_size, 2 * head_size) with "
                    f"heads * head_size = {self.hidden_dim_size}, got shape {tuple(t.shape)}"
                )
            return PagedGeometry(KVLayout.CPU_ATTN, self._block_size_or(t.shape[2]), self._heads(t.shape[1]))
        if t.dim() < 2 or t.shape[0] != 2:
            raise ValueError(f"a per-layer KV cache tensor must stack K and V on dim 0, got shape {tuple(t.shape)}")
        if t.dim() == 5 and self.layout in (None, KVLayout.FLASH):
            # flash: K and V stacked, (2, *flash key shape)
            dims = layout_dims(KVLayout.FLASH, tuple(t.shape[1:]), t.dtype)
            assert dims is not None
            if dims["heads"] * dims["head_size"] != self.hidden_dim_size:
                raise ValueError(f"flash cache shape {tuple(t.shape)} has heads*head_size != {self.hidden_dim_size}")
            return PagedGeometry(KVLayout.FLASH, self._block_size_or(dims["block_size"]), self._heads(dims["heads"]))
        if t.dim() == 3:
            # CPU backend: (2, num_blocks, block_size * heads * head_size); IPEX or packed inside.
            if self.layout not in (KVLayout.CPU_IPEX, KVLayout.CPU_PACKED, KVLayout.FLASH):
                raise ValueError(
                    f"cache shape {tuple(t.shape)} does not tell the layout: pass layout=KVLayout.CPU_IPEX "
                    "or KVLayout.CPU_PACKED (and num_kv_heads=)"
                )
            per_block = t.shape[2]
            if per_block % self.hidden_dim_size:
                raise ValueError(
                    f"cache shape {tuple(t.shape)}: {per_block} is not a multiple of hidden {self.hidden_dim_size}"
                )
            return PagedGeometry(self.layout, self._block_size_or(per_block // self.hidden_dim_size), self._heads())
        raise ValueError(f"cannot read a KV layout from a per-layer cache of shape {tuple(t.shape)}")

    def _geometry_pair(self, k: torch.Tensor) -> PagedGeometry:
        """Every paged layout the key cache's shape can be read as (`kv_layout.layout_dims`), kept
        when it agrees with the hidden size and what the kwargs fixed; exactly one must remain."""
        shape = tuple(k.shape)
        candidates = []
        for layout in (KVLayout.FLASH, KVLayout.CPU_IPEX, KVLayout.CPU_PACKED):
            dims = layout_dims(layout, shape, k.dtype) if self.layout in (None, layout) else None
            if dims is None or dims["heads"] * dims["head_size"] != self.hidden_dim_size:
                continue
            if self.num_kv_heads is not None and dims["heads"] != self.num_kv_heads:
                continue
            if self.block_size is not None and dims["block_size"] != self.block_size:
                continue
            candidates.append(PagedGeometry(layout, dims["block_size"], dims["heads"]))
        if len(candidates) != 1:
            raise ValueError(
                f"key cache shape {shape} ({k.dtype}) fits {len(candidates)} paged layouts of hidden "
                f"{self.hidden_dim_size}; pass layout= (FLASH, CPU_IPEX or CPU_PACKED)"
                + ("" if self.num_kv_heads is not None else ", num_kv_heads=")
                + ("" if self.block_size is not None else " or block_size=")
            )
        return candidates[0]

    # ---- copies ---------------------------------------------------------------------------

    def _caches(self, kwargs: dict) -> Tuple[PagedGeometry, List[torch.Tensor], List[torch.Tensor]]:
        kvcaches = _kvcaches(kwargs)
        self._check_layers(kvcaches)
        geo = self.geometry(kvcaches)
        keys, values = split_kv_caches(kvcaches, geo.layout)
        return geo, keys, values

    def _chunk(
        self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict, to_cache: bool, device: torch.device
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The chunk's object tensor and slots, checked."""
        _check_start_end(start, end)
        slots = _chunk_slots(kwargs, start, end, device)
        if not to_cache and bool((slots < 0).any()):
            raise ValueError(
                f"slot_mapping[{start}:{end}] contains -1: tokens vLLM did not compute cannot be stored"
            )
        return _blob_tensor(memory_obj, self.get_shape(end - start), storing=not to_cache), slots

    def _transfer(self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict, to_cache: bool) -> None:
        geo, keys, values = self._caches(kwargs)
        device = keys[0].device
        blob, slots = self._chunk(memory_obj, start, end, kwargs, to_cache, device)
        staging = self._staging(blob, device)
        if staging is not None and to_cache:
            staging.copy_(blob, non_blocking=True)
        target = blob if staging is None else staging
        c_ops.multi_layer_kv_transfer(
            target, keys, values, slots, int(geo.layout), geo.block_size, geo.num_heads, to_cache
        )
        if staging is not None and not to_cache:
            blob.copy_(staging)

    def _staging(self, blob: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
        """A device buffer to run the kernel on, or None to work on the object directly."""
        return None

    def _stages(self) -> bool:
        """Whether copies go through `_staging`'s buffer (one chunk at a time)."""
        return False

    def _batch(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], kwargs: dict, to_cache: bool,
        checksums: bool = False,
    ) -> Optional[List[Optional[bytes]]]:
        """Every chunk in one kernel call (one parallel loop on the CPU), unless staged. With
        `checksums`, a store on the CPU returns each object's payload checksum, summed by the
        kernel as it wrote the object (None: not computed, e.g. staged through a device buffer)."""
        if len(memory_objs) != len(starts) or len(starts) != len(ends):
            raise ValueError(f"{len(memory_objs)} memory objects for {len(starts)} starts and {len(ends)} ends")
        if not memory_objs:
            return None
        geo, keys, values = self._caches(kwargs)
        device = keys[0].device
        chunks = [self._chunk(o, s, e, kwargs, to_cache, device) for o, s, e in zip(memory_objs, starts, ends)]
        if self._stages():
            for obj, start, end in zip(memory_objs, starts, ends):
                self._transfer(obj, start, end, kwargs, to_cache)
            return None
        digests = c_ops.multi_layer_kv_transfer_batch(
            [blob for blob, _ in chunks], keys, values, [slots for _, slots in chunks],
            int(geo.layout), geo.block_size, geo.num_heads, to_cache, checksums,
        )
        if not checksums:
            return None
        return [None if d is None else chunk_format.checksum_bytes(d) for d in digests]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Store tokens `[start, end)` of 'kvcaches' (slots from 'slot_mapping') into `memory_obj`."""
        self._transfer(memory_obj, start, end, kwargs, to_cache=False)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Write `memory_obj` into the slots 'slot_mapping' gives tokens `[start, end)` in 'kvcaches'."""
        self._transfer(memory_obj, start, end, kwargs, to_cache=True)

    def batched_from_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], *,
        checksums: bool = False, **kwargs: Any
    ) -> Optional[List[Optional[bytes]]]:
        """`from_gpu` of a request's chunks in one kernel call; with `checksums`, each object's
        payload checksum (`chunk_format`), summed as the kernel wrote it, where the kernel could
        (else None). Asked only where a tier uses them: summing makes the copy slower."""
        return self._batch(memory_objs, starts, ends, kwargs, to_cache=False, checksums=checksums)

    def batched_to_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        """`to_gpu` of a request's chunks in one kernel call."""
        self._batch(memory_objs, starts, ends, kwargs, to_cache=True)


class VLLMPagedMemGPUConnectorV2(VLLMPagedMemGPUConnector):
    """vLLM's paged KV caches as a list of per-layer tensors (or (K, V) pairs); full-length slot
    mapping. kwargs: `layout`, `num_kv_heads`, `block_size`, `use_mla`, and for the staging buffer
    `chunk_size`, `dtype`, `device`.

    `use_gpu=True` runs the kernel into a buffer on the caches' device and moves the chunk to or
    from host memory with one copy. The buffer holds `chunk_size` tokens; it is reserved at
    construction when `dtype` and `device` are given, else made on first use, and grows if needed.
    """

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs: Any) -> None:
        known = {"layout", "num_kv_heads", "block_size", "use_mla", "chunk_size", "dtype", "device"}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"VLLMPagedMemGPUConnectorV2: unknown arguments {sorted(unknown)} (known: {sorted(known)})")
        super().__init__(
            hidden_dim_size,
            num_layers,
            layout=kwargs.get("layout"),
            num_kv_heads=kwargs.get("num_kv_heads"),
            block_size=kwargs.get("block_size"),
            use_mla=bool(kwargs.get("use_mla", False)),
        )
        self.use_gpu = use_gpu
        self.chunk_size = int(kwargs.get("chunk_size", 256))
        self._buffer: Optional[torch.Tensor] = None
        if use_gpu and kwargs.get("dtype") is not None and kwargs.get("device") is not None:
            # Reserve the staging buffer now, while the device still has room for it.
            elems = self.get_shape(self.chunk_size).numel()
            self._buffer = torch.empty(elems, dtype=kwargs["dtype"], device=kwargs["device"])
        # The staging buffer is shared: one chunk at a time goes through it.
        self._buffer_lock = threading.Lock()

    def _transfer(self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict, to_cache: bool) -> None:
        if not self.use_gpu:
            super()._transfer(memory_obj, start, end, kwargs, to_cache)
            return
        with self._buffer_lock:
            super()._transfer(memory_obj, start, end, kwargs, to_cache)

    def _stages(self) -> bool:
        return self.use_gpu

    def _staging(self, blob: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
        if not self.use_gpu:
            return None
        need = blob.numel()
        buf = self._buffer
        if buf is None or buf.device != device or buf.dtype != blob.dtype or buf.numel() < need:
            elems = max(need, self.get_shape(self.chunk_size).numel())
            buf = torch.empty(elems, dtype=blob.dtype, device=device)
            self._buffer = buf
        # A prefix of the flat buffer, so the view is contiguous whatever the token count.
        return buf[:need].view(blob.shape)
