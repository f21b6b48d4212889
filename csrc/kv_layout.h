// Address arithmetic of vLLM's paged KV caches and of LMCache's KV_BLOB objects.
//
// This is the only place that knows where an element lives. The CPU kernels (csrc/cpu/) and
// the CUDA kernels (csrc/cuda/) both call these functions, so what the CPU tests prove about
// slots, layouts and object offsets holds for the CUDA path too.
//
// A slot names one token position in the paged cache: slot = block * block_size + offset.
// Per layer, K and V each live in their own tensor (or MLA's single latent tensor), with
// element offsets (in elements, not bytes) given by cache_offset(). Layouts, per K or V cache:
//
//   FLASH      [num_blocks, block_size, heads, head_size]          (GPU flash-attention)
//   CPU_IPEX   [num_blocks, heads, block_size, head_size]          (vLLM CPU with IPEX)
//   CPU_PACKED K [num_blocks, heads, head_size / x, block_size, x]  (vLLM CPU without IPEX,
//              V [num_blocks, heads, head_size, block_size]          x = 16 / element_size)
//   MLA        [num_blocks, block_size, head_size]                  (one latent vector, K only)
//   CPU_ATTN   K and V in ONE tensor [num_blocks, heads, block_size, 2 * head_size] (vLLM >= 0.11
//              CPU attention, ISAs vec/vec16): per block and head, the K half is [head_size]
//              [block_size] (a head's tokens as columns) and the V half [block_size][head_size];
//              the caller passes that tensor as both the K and the V cache of a layer.
//
// The object is a contiguous [num_kv, num_layers, num_tokens, hidden] tensor with
// hidden = heads * head_size and num_kv = 2 (K, V) or 1 (MLA).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LMC_HD __host__ __device__ __forceinline__
#else
#define LMC_HD inline
#endif

namespace lmcache {

// Codes shared with Python (lmcache/experimental/kv_layout.py: KVLayout).
constexpr int kLayoutFlash = 0;
constexpr int kLayoutCpuIpex = 1;
constexpr int kLayoutCpuPacked = 2;
constexpr int kLayoutMla = 3;
constexpr int kLayoutCpuAttn = 4;
constexpr int kNumLayouts = 5;

constexpr int kKey = 0;
constexpr int kValue = 1;

// Shape of one layer's K or V cache, in elements.
struct PagedGeometry {
  int layout;
  int64_t block_size;
  int64_t num_heads;
  int64_t head_size;
  int64_t pack;  // x of CPU_PACKED keys (elements per 16 bytes); 1 for other layouts

  LMC_HD int64_t hidden() const { return num_heads * head_size; }
  LMC_HD int64_t block_elems() const { return block_size * num_heads * head_size; }
  // Elements per block of one cache tensor: CPU_ATTN keeps K and V of a block in one tensor.
  LMC_HD int64_t cache_block_elems() const {
    return layout == kLayoutCpuAttn ? 2 * block_elems() : block_elems();
  }
};

LMC_HD PagedGeometry make_geometry(int layout, int64_t block_size, int64_t num_heads,
                                   int64_t head_size, int64_t element_size) {
  PagedGeometry g;
  g.layout = layout;
  g.block_size = block_size;
  g.num_heads = num_heads;
  g.head_size = head_size;
  g.pack = layout == kLayoutCpuPacked ? 16 / element_size : 1;
  return g;
}

// Element offset of (slot, head h, dim d) inside one layer's K (kv == kKey) or V cache.
LMC_HD int64_t cache_offset(const PagedGeometry& g, int kv, int64_t slot, int64_t h,
                            int64_t d) {
  const int64_t block = slot / g.block_size;
  const int64_t off = slot - block * g.block_size;
  const int64_t base = block * g.cache_block_elems();
  switch (g.layout) {
    case kLayoutCpuAttn: {
      const int64_t half = g.block_size * g.head_size;  // one head's K (or V) in a block
      const int64_t head = base + h * 2 * half;
      return kv == kKey ? head + d * g.block_size + off : head + half + off * g.head_size + d;
    }
    case kLayoutCpuIpex:
      return base + (h * g.block_size + off) * g.head_size + d;
    case kLayoutCpuPacked:
      if (kv == kKey) {
        const int64_t group = d / g.pack;
        return base + ((h * (g.head_size / g.pack) + group) * g.block_size + off) * g.pack +
               (d - group * g.pack);
      }
      return base + (h * g.head_size + d) * g.block_size + off;
    default:  // FLASH and MLA (MLA has one head): token rows are contiguous
      return base + (off * g.num_heads + h) * g.head_size + d;
  }
}

// Length of the runs of consecutive (h, d) elements of one slot that are also consecutive in
// the cache. A run starts at a (h, d) whose flat index h * head_size + d is a multiple of it.
LMC_HD int64_t cache_run_elems(const PagedGeometry& g, int kv) {
  switch (g.layout) {
    case kLayoutCpuIpex:
      return g.head_size;
    case kLayoutCpuPacked:
      return kv == kKey ? g.pack : 1;
    case kLayoutCpuAttn:
      return kv == kKey ? 1 : g.head_size;
    default:
      return g.hidden();
  }
}

// Distance in elements between slot s and slot s + 1 of the same block (same h, d). In every
// layout the block-offset axis sits just outside a slot's run, so the next slot's run starts
// right after this one's: the stride is the run length.
LMC_HD int64_t cache_token_stride(const PagedGeometry& g, int kv) { return cache_run_elems(g, kv); }

// Shape of the contiguous object [num_kv, num_layers, num_tokens, hidden], and the layers a
// transfer moves: [first_layer, first_layer + moved_layers). num_layers is the object's own
// layer count (it sets the offsets); a transfer of every layer has first_layer 0 and
// moved_layers == num_layers, a layer-wise one moves a single layer of a whole object.
struct ObjectGeometry {
  int64_t num_layers;
  int64_t num_tokens;
  int64_t hidden;
  int64_t first_layer;
  int64_t moved_layers;
};

// Element offset of (kv, layer, token, flat hidden index i = h * head_size + d) in the object.
LMC_HD int64_t object_offset(const ObjectGeometry& o, int kv, int64_t layer, int64_t token,
                             int64_t i) {
  return ((kv * o.num_layers + layer) * o.num_tokens + token) * o.hidden + i;
}

// A transfer's planes are its moved (kv, layer) pairs, plane = kv * moved_layers + j for the
// j-th moved layer; the caches it is given are indexed the same way. The object layer of
// plane j is first_layer + j.
LMC_HD int64_t plane_kv(const ObjectGeometry& o, int64_t plane) { return plane / o.moved_layers; }
LMC_HD int64_t plane_layer(const ObjectGeometry& o, int64_t plane) {
  return o.first_layer + plane % o.moved_layers;
}

}  // namespace lmcache
