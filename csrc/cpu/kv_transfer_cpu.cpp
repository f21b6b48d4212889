// CPU kernels: paged KV cache <-> contiguous object, all layers in one parallel loop.
//
// The tokens are cut into runs of consecutive slots inside one block. A work item is one
// (kv, layer, run); items are spread over torch's intra-op threads. Inside an item every move
// is a contiguous-run copy whose addresses come from kv_layout.h:
//   FLASH / MLA   a run of n tokens is n whole rows in both cache and object: one memcpy
//   CPU_IPEX      head_size elements per (token, head)
//   CPU_PACKED K  x elements (16 bytes) per (token, head, dim group)
//   CPU_PACKED V  the block stores [head_size, block_size] per head: a (tokens x head_size)
//                 transpose, done tile by tile so both sides stay in L1.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kv_transfer.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMC_X86 1
#endif

namespace lmcache {
namespace {

struct Run {
  int64_t token;  // first token of the run in the object
  int64_t slot;   // its slot in the cache
  int64_t count;  // consecutive tokens/slots, all in one block
};

std::vector<Run> make_runs(const int64_t* slots, int64_t num_tokens, int64_t block_size) {
  std::vector<Run> runs;
  int64_t t = 0;
  while (t < num_tokens) {
    if (slots[t] < 0) {
      ++t;
      continue;
    }
    Run r{t, slots[t], 1};
    const int64_t block_end = (slots[t] / block_size + 1) * block_size;
    while (t + r.count < num_tokens && slots[t + r.count] == r.slot + r.count &&
           r.slot + r.count < block_end) {
      ++r.count;
    }
    runs.push_back(r);
    t += r.count;
  }
  return runs;
}

// Element type of a given width: copies move bytes, never convert.
template <int ES>
struct Bytes;
template <>
struct Bytes<1> { using T = uint8_t; };
template <>
struct Bytes<2> { using T = uint16_t; };
template <>
struct Bytes<4> { using T = uint32_t; };
template <>
struct Bytes<8> { using T = uint64_t; };

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols (strides in
// elements): the leftovers of the tiled transposes, and the whole job for 1- and 8-byte types.
template <typename T>
void transpose_scalar(const T* src, int64_t src_stride, T* dst, int64_t dst_stride,
                      int64_t rows, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    T* d = dst + c * dst_stride;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * src_stride + c];
  }
}

// Transpose by B x B tiles, `tile(src, ss, dst, ds)` moving one. The outer loop walks the side
// whose rows are far apart (the object's, `hidden` apart) so each band of its rows is
// finished before the next; the other side (a head's block, a few KiB) stays in L1.
template <typename T, int B, typename Tile>
void transpose_tiled(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols,
                     Tile tile) {
  const int64_t rb = rows - rows % B, cb = cols - cols % B;
  if (ds >= ss) {
    for (int64_t c = 0; c < cb; c += B)
      for (int64_t r = 0; r < rb; r += B) tile(src + r * ss + c, ss, dst + c * ds + r, ds);
  } else {
    for (int64_t r = 0; r < rb; r += B)
      for (int64_t c = 0; c < cb; c += B) tile(src + r * ss + c, ss, dst + c * ds + r, ds);
  }
  if (cb < cols) transpose_scalar(src + cb, ss, dst + cb * ds, ds, rows, cols - cb);
  if (rb < rows) transpose_scalar(src + rb * ss, ss, dst + rb, ds, rows - rb, cb);
}

#ifdef LMC_X86
// 4x4 tile of 32-bit elements with SSE (baseline on x86-64).
inline void tile_32x4(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(src));
  __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(src + ss));
  __m128 e = _mm_loadu_ps(reinterpret_cast<const float*>(src + 2 * ss));
  __m128 f = _mm_loadu_ps(reinterpret_cast<const float*>(src + 3 * ss));
  _MM_TRANSPOSE4_PS(a, b, e, f);
  _mm_storeu_ps(reinterpret_cast<float*>(dst), a);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + ds), b);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 2 * ds), e);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 3 * ds), f);
}

// 8x8 tile of 16-bit elements with SSE2: three rounds of interleaving (16, 32, 64 bits).
inline void tile_16x8(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds) {
  __m128i x[8];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ss));
  const __m128i a0 = _mm_unpacklo_epi16(x[0], x[1]), a1 = _mm_unpackhi_epi16(x[0], x[1]);
  const __m128i a2 = _mm_unpacklo_epi16(x[2], x[3]), a3 = _mm_unpackhi_epi16(x[2], x[3]);
  const __m128i a4 = _mm_unpacklo_epi16(x[4], x[5]), a5 = _mm_unpackhi_epi16(x[4], x[5]);
  const __m128i a6 = _mm_unpacklo_epi16(x[6], x[7]), a7 = _mm_unpackhi_epi16(x[6], x[7]);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  const __m128i y[8] = {_mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4),
                        _mm_unpacklo_epi64(b1, b5), _mm_unpackhi_epi64(b1, b5),
                        _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
                        _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
  for (int i = 0; i < 8; ++i)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * ds), y[i]);
}
#endif

template <typename T>
void transpose(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols) {
#ifdef LMC_X86
  if constexpr (sizeof(T) == 4) {
    return transpose_tiled<T, 4>(src, ss, dst, ds, rows, cols, tile_32x4);
  } else if constexpr (sizeof(T) == 2) {
    return transpose_tiled<T, 8>(src, ss, dst, ds, rows, cols, tile_16x8);
  }
#endif
  transpose_scalar(src, ss, dst, ds, rows, cols);
}

// memcpy for the short runs (a head's row, typically 128-512 bytes) copied ~10^5 times per
// call: 64-byte steps inline to plain vector moves instead of a library call each.
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) std::memcpy(d + i, s + i, 64);
  if (i < n) std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

// Moves one run of one layer's K or V. `cache` and `obj` point at element 0 of the layer's
// cache and of the object's (kv, layer) plane.
template <int ES>
void copy_run(const TransferPlan& p, int kv, char* cache, char* obj, const Run& run) {
  using T = typename Bytes<ES>::T;
  const PagedGeometry& g = p.cache;
  const int64_t hidden = g.hidden();
  const int64_t run_elems = cache_run_elems(g, kv);
  const int64_t token_stride = cache_token_stride(g, kv);
  T* c = reinterpret_cast<T*>(cache);
  T* o = reinterpret_cast<T*>(obj) + run.token * hidden;

  if (run_elems == hidden && token_stride == hidden) {  // FLASH, MLA: whole rows
    T* cr = c + cache_offset(g, kv, run.slot, 0, 0);
    const size_t bytes = static_cast<size_t>(run.count * hidden) * ES;
    if (p.to_cache) std::memcpy(cr, o, bytes);
    else std::memcpy(o, cr, bytes);
    return;
  }
  if (run_elems == 1) {  // CPU_PACKED V: per head, cache [head_size][block_size] vs object rows
    const int64_t dim_stride = cache_dim_stride(g, kv);
    for (int64_t h = 0; h < g.num_heads; ++h) {
      T* ch = c + cache_offset(g, kv, run.slot, h, 0);
      T* oh = o + h * g.head_size;
      if (p.to_cache) transpose<T>(oh, hidden, ch, dim_stride, run.count, g.head_size);
      else transpose<T>(ch, dim_stride, oh, hidden, g.head_size, run.count);
    }
    return;
  }
  // CPU_IPEX (one head_size run per token and head) and CPU_PACKED K (head_size / x runs of
  // 16 bytes, block_size * x apart). Token-major within a head, so each object row segment is
  // written (or read) whole before the next: the rows are `hidden` apart, often a multiple of
  // 4 KiB, and revisiting many of them would thrash one L1 set.
  const int64_t groups = g.head_size / run_elems;
  for (int64_t h = 0; h < g.num_heads; ++h) {
    T* ch = c + cache_offset(g, kv, run.slot, h, 0);
    const int64_t group_stride =
        groups > 1 ? cache_offset(g, kv, run.slot, h, run_elems) - (ch - c) : 0;
    T* oh = o + h * g.head_size;
    for (int64_t j = 0; j < run.count; ++j) {
      T* cj = ch + j * token_stride;
      T* oj = oh + j * hidden;
      if (run_elems * ES == 16) {  // fixed size: one 16-byte load and store per group
        for (int64_t k = 0; k < groups; ++k) {
          if (p.to_cache) std::memcpy(cj + k * group_stride, oj + k * run_elems, 16);
          else std::memcpy(oj + k * run_elems, cj + k * group_stride, 16);
        }
      } else {
        const int64_t bytes = run_elems * ES;
        for (int64_t k = 0; k < groups; ++k) {
          if (p.to_cache) copy_bytes(cj + k * group_stride, oj + k * run_elems, bytes);
          else copy_bytes(oj + k * run_elems, cj + k * group_stride, bytes);
        }
      }
    }
  }
}

template <int ES>
void transfer(const TransferPlan& p, char* object, const CachePointers& caches,
              const std::vector<Run>& runs) {
  const int64_t num_layers = p.object.num_layers;
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  const int64_t items = p.num_kv * num_layers * num_runs;
  // One item is at most a block of one layer's K or V (tens of KiB): a few per grain. K and V
  // alternate in item order, so every thread's contiguous share mixes them equally (their
  // costs differ, e.g. CPU_PACKED's V is a transpose).
  at::parallel_for(0, items, 4, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int kv = static_cast<int>(it % p.num_kv);
      const int64_t rest = it / p.num_kv;  // layer * num_runs + run
      const int64_t layer = rest / num_runs;
      const Run& run = runs[rest - layer * num_runs];
      char* obj = object + object_offset(p.object, kv, layer, 0, 0) * ES;
      copy_run<ES>(p, kv, caches[kv * num_layers + layer], obj, run);
    }
  });
}

}  // namespace

void kv_transfer_cpu(const TransferPlan& plan, char* object, const CachePointers& caches,
                     const int64_t* slots) {
  const std::vector<Run> runs =
      make_runs(slots, plan.object.num_tokens, plan.cache.block_size);
  if (runs.empty()) return;
  switch (plan.element_size) {
    case 1: return transfer<1>(plan, object, caches, runs);
    case 2: return transfer<2>(plan, object, caches, runs);
    case 4: return transfer<4>(plan, object, caches, runs);
    case 8: return transfer<8>(plan, object, caches, runs);
    default: break;  // the bindings only admit the sizes above
  }
}

}  // namespace lmcache
