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
// elements). Plain loop over 8x8 tiles: reads one short row segment, writes one short column.
template <typename T>
void transpose_scalar(const T* src, int64_t src_stride, T* dst, int64_t dst_stride,
                      int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(cols, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c) {
        T* d = dst + c * dst_stride;
        for (int64_t r = r0; r < r1; ++r) d[r] = src[r * src_stride + c];
      }
    }
  }
}

#ifdef LMC_X86
// 4x4 blocks of 32-bit elements with SSE (baseline on x86-64); leftovers go scalar.
void transpose_32(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds, int64_t rows,
                  int64_t cols) {
  const int64_t r4 = rows & ~int64_t(3), c4 = cols & ~int64_t(3);
  for (int64_t r = 0; r < r4; r += 4) {
    for (int64_t c = 0; c < c4; c += 4) {
      __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(src + (r + 0) * ss + c));
      __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(src + (r + 1) * ss + c));
      __m128 e = _mm_loadu_ps(reinterpret_cast<const float*>(src + (r + 2) * ss + c));
      __m128 f = _mm_loadu_ps(reinterpret_cast<const float*>(src + (r + 3) * ss + c));
      _MM_TRANSPOSE4_PS(a, b, e, f);
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (c + 0) * ds + r), a);
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (c + 1) * ds + r), b);
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (c + 2) * ds + r), e);
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (c + 3) * ds + r), f);
    }
  }
  if (c4 < cols) transpose_scalar(src + c4, ss, dst + c4 * ds, ds, rows, cols - c4);
  if (r4 < rows) transpose_scalar(src + r4 * ss, ss, dst + r4, ds, rows - r4, c4);
}

// 8x8 blocks of 16-bit elements with SSE2 unpacks; leftovers go scalar.
void transpose_16(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds, int64_t rows,
                  int64_t cols) {
  const int64_t r8 = rows & ~int64_t(7), c8 = cols & ~int64_t(7);
  for (int64_t r = 0; r < r8; r += 8) {
    for (int64_t c = 0; c < c8; c += 8) {
      __m128i x[8];
      for (int i = 0; i < 8; ++i)
        x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (r + i) * ss + c));
      // Three rounds of interleaving: 16-bit, 32-bit, 64-bit lanes.
      __m128i a0 = _mm_unpacklo_epi16(x[0], x[1]), a1 = _mm_unpackhi_epi16(x[0], x[1]);
      __m128i a2 = _mm_unpacklo_epi16(x[2], x[3]), a3 = _mm_unpackhi_epi16(x[2], x[3]);
      __m128i a4 = _mm_unpacklo_epi16(x[4], x[5]), a5 = _mm_unpackhi_epi16(x[4], x[5]);
      __m128i a6 = _mm_unpacklo_epi16(x[6], x[7]), a7 = _mm_unpackhi_epi16(x[6], x[7]);
      __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
      __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
      __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
      __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
      __m128i y[8] = {_mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4),
                      _mm_unpacklo_epi64(b1, b5), _mm_unpackhi_epi64(b1, b5),
                      _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
                      _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
      for (int i = 0; i < 8; ++i)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c + i) * ds + r), y[i]);
    }
  }
  if (c8 < cols) transpose_scalar(src + c8, ss, dst + c8 * ds, ds, rows, cols - c8);
  if (r8 < rows) transpose_scalar(src + r8 * ss, ss, dst + r8, ds, rows - r8, c8);
}
#endif

template <typename T>
void transpose(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols) {
#ifdef LMC_X86
  if constexpr (sizeof(T) == 4) return transpose_32(src, ss, dst, ds, rows, cols);
  if constexpr (sizeof(T) == 2) return transpose_16(src, ss, dst, ds, rows, cols);
#endif
  transpose_scalar(src, ss, dst, ds, rows, cols);
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
  // CPU_IPEX (head_size runs) and CPU_PACKED K (16-byte runs): per (head, run) a column of
  // `count` runs, token_stride apart in the cache and a row apart in the object.
  const bool sixteen = run_elems * ES == 16;
  for (int64_t i0 = 0; i0 < hidden; i0 += run_elems) {
    const int64_t h = i0 / g.head_size;
    T* cs = c + cache_offset(g, kv, run.slot, h, i0 - h * g.head_size);
    T* os = o + i0;
    const size_t bytes = static_cast<size_t>(run_elems) * ES;
    for (int64_t j = 0; j < run.count; ++j) {
      T* cj = cs + j * token_stride;
      T* oj = os + j * hidden;
      if (sixteen) {  // fixed size: compiles to one 16-byte load/store
        if (p.to_cache) std::memcpy(cj, oj, 16);
        else std::memcpy(oj, cj, 16);
      } else {
        if (p.to_cache) std::memcpy(cj, oj, bytes);
        else std::memcpy(oj, cj, bytes);
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
  // One item is at most a block of one layer's K or V (tens of KiB): a few per grain.
  at::parallel_for(0, items, 4, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t plane = it / num_runs;  // kv * num_layers + layer
      const Run& run = runs[it - plane * num_runs];
      const int kv = static_cast<int>(plane / num_layers);
      const int64_t layer = plane - kv * num_layers;
      char* obj = object + object_offset(p.object, kv, layer, 0, 0) * ES;
      copy_run<ES>(p, kv, caches[plane], obj, run);
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
