// Blocked transposes for the CPU_PACKED layout, whose blocks store a head's tokens as columns:
// the value cache is [head_size][block_size] elements and the key cache [head_size / x]
// [block_size] 16-byte groups, while the object stores tokens as rows. Moving a run of tokens
// is a transpose of elements (V) or of 16-byte units (K).
//
// transpose(src, ss, dst, ds, rows, cols) sets dst[c * ds + r] = src[r * ss + c] (strides in
// units of T). Tiles use the widest vector instructions the CPU has, chosen at run time (the
// build uses no -march flag); what the tiles leave over goes to a smaller tile, then scalar.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "stream.h"

namespace lmcache {
namespace cpu {

// The 16-byte groups of a CPU_PACKED key, moved as units.
struct Unit16 {
  unsigned char b[16];
};

// Tile order. By default the destination's row bands are walked outermost, so each
// destination line is finished in order (the source band, a few KiB, stays in L1). Walking
// the source's bands outermost instead reads it in address order; on the benchmark shape that
// won only for stores from key blocks, whose rows are longer than a cache line.
enum class Order { kDestBands, kSourceBands };

template <typename T>
inline void transpose_scalar(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows,
                             int64_t cols, Order = Order::kDestBands) {
  for (int64_t c = 0; c < cols; ++c) {
    T* d = dst + c * ds;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * ss + c];
  }
}

// B x B tiles through `tile`, the leftover strips through `rest` (a smaller transpose).
template <typename T, int B, typename Tile, typename Rest>
__attribute__((always_inline)) inline void transpose_tiled(const T* src, int64_t ss, T* dst,
                                                           int64_t ds, int64_t rows,
                                                           int64_t cols, Order order,
                                                           Tile tile, Rest rest) {
  const int64_t rb = rows - rows % B, cb = cols - cols % B;
  if (order == Order::kDestBands) {
    for (int64_t c = 0; c < cb; c += B)
      for (int64_t r = 0; r < rb; r += B) tile(src + r * ss + c, ss, dst + c * ds + r, ds);
  } else {
    for (int64_t r = 0; r < rb; r += B)
      for (int64_t c = 0; c < cb; c += B) tile(src + r * ss + c, ss, dst + c * ds + r, ds);
  }
  if (cb < cols) rest(src + cb, ss, dst + cb * ds, ds, rows, cols - cb, order);
  if (rb < rows) rest(src + rb * ss, ss, dst + rb, ds, rows - rb, cb, order);
}

#ifdef LMC_X86

// ---- baseline x86-64 (SSE2) ----

inline void transpose_32_sse(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds,
                             int64_t rows, int64_t cols, Order order) {
  auto tile = [](const uint32_t* s, int64_t ss_, uint32_t* d, int64_t ds_) {
    __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(s));
    __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(s + ss_));
    __m128 e = _mm_loadu_ps(reinterpret_cast<const float*>(s + 2 * ss_));
    __m128 f = _mm_loadu_ps(reinterpret_cast<const float*>(s + 3 * ss_));
    _MM_TRANSPOSE4_PS(a, b, e, f);  // shuffles only: the bits of NaNs survive
    _mm_storeu_ps(reinterpret_cast<float*>(d), a);
    _mm_storeu_ps(reinterpret_cast<float*>(d + ds_), b);
    _mm_storeu_ps(reinterpret_cast<float*>(d + 2 * ds_), e);
    _mm_storeu_ps(reinterpret_cast<float*>(d + 3 * ds_), f);
  };
  transpose_tiled<uint32_t, 4>(src, ss, dst, ds, rows, cols, order, tile,
                               transpose_scalar<uint32_t>);
}

// Three rounds of interleaving (16, 32, 64 bits) turn 8 rows of 8 x 16-bit into 8 columns.
inline void transpose_16_sse(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds,
                             int64_t rows, int64_t cols, Order order) {
  auto tile = [](const uint16_t* s, int64_t ss_, uint16_t* d, int64_t ds_) {
    __m128i x[8], a[8], b[8];
    for (int i = 0; i < 8; ++i)
      x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * ss_));
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
      a[2 * i + 1] = _mm_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      for (int k = 0; k < 2; ++k) {
        b[4 * i + 2 * k] = _mm_unpacklo_epi32(a[4 * i + k], a[4 * i + k + 2]);
        b[4 * i + 2 * k + 1] = _mm_unpackhi_epi32(a[4 * i + k], a[4 * i + k + 2]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * i) * ds_),
                       _mm_unpacklo_epi64(b[i], b[i + 4]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * i + 1) * ds_),
                       _mm_unpackhi_epi64(b[i], b[i + 4]));
    }
  };
  transpose_tiled<uint16_t, 8>(src, ss, dst, ds, rows, cols, order, tile,
                               transpose_scalar<uint16_t>);
}

// ---- AVX2 ----

__attribute__((target("avx2"))) inline void transpose_32_avx2(
    const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds, int64_t rows, int64_t cols,
    Order order) {
  auto tile = [](const uint32_t* s, int64_t ss_, uint32_t* d, int64_t ds_)
                  __attribute__((target("avx2"))) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(s + i * ss_));
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      for (int k = 0; k < 2; ++k) {
        u[4 * i + 2 * k] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + k + 2], 0x44);
        u[4 * i + 2 * k + 1] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + k + 2], 0xEE);
      }
    }
    // u[i] holds columns i and i + 4 of rows 0-3, u[i + 4] the same columns of rows 4-7.
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(reinterpret_cast<float*>(d + i * ds_),
                       _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
      _mm256_storeu_ps(reinterpret_cast<float*>(d + (i + 4) * ds_),
                       _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
  };
  transpose_tiled<uint32_t, 8>(src, ss, dst, ds, rows, cols, order, tile, transpose_32_sse);
}

// 16x16: the SSE2 rounds run on both 128-bit lanes (columns 0-7 and 8-15) of rows 0-7 and of
// rows 8-15, then lane swaps put each column's two halves together.
__attribute__((target("avx2"))) inline void transpose_16_avx2(
    const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds, int64_t rows, int64_t cols,
    Order order) {
  auto tile = [](const uint16_t* s, int64_t ss_, uint16_t* d, int64_t ds_)
                  __attribute__((target("avx2"))) {
    __m256i y[2][8];
    for (int half = 0; half < 2; ++half) {
      __m256i x[8], a[8], b[8];
      for (int i = 0; i < 8; ++i)
        x[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (8 * half + i) * ss_));
      for (int i = 0; i < 4; ++i) {
        a[2 * i] = _mm256_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        for (int k = 0; k < 2; ++k) {
          b[4 * i + 2 * k] = _mm256_unpacklo_epi32(a[4 * i + k], a[4 * i + k + 2]);
          b[4 * i + 2 * k + 1] = _mm256_unpackhi_epi32(a[4 * i + k], a[4 * i + k + 2]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        y[half][2 * i] = _mm256_unpacklo_epi64(b[i], b[i + 4]);
        y[half][2 * i + 1] = _mm256_unpackhi_epi64(b[i], b[i + 4]);
      }
    }
    for (int i = 0; i < 8; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i * ds_),
                          _mm256_permute2x128_si256(y[0][i], y[1][i], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (i + 8) * ds_),
                          _mm256_permute2x128_si256(y[0][i], y[1][i], 0x31));
    }
  };
  transpose_tiled<uint16_t, 16>(src, ss, dst, ds, rows, cols, order, tile, transpose_16_sse);
}

__attribute__((target("avx2"))) inline void transpose_u16_avx2(
    const Unit16* src, int64_t ss, Unit16* dst, int64_t ds, int64_t rows, int64_t cols,
    Order order) {
  auto tile = [](const Unit16* s, int64_t ss_, Unit16* d, int64_t ds_)
                  __attribute__((target("avx2"))) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + ss_));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + ds_),
                        _mm256_permute2x128_si256(a, b, 0x31));
  };
  transpose_tiled<Unit16, 2>(src, ss, dst, ds, rows, cols, order, tile,
                             transpose_scalar<Unit16>);
}

// ---- AVX-512: 4x4 tiles of 16-byte units, four 64-byte rows shuffled as 128-bit lanes ----

__attribute__((target("avx512f"))) inline void transpose_u16_avx512(
    const Unit16* src, int64_t ss, Unit16* dst, int64_t ds, int64_t rows, int64_t cols,
    Order order) {
  auto tile = [](const Unit16* s, int64_t ss_, Unit16* d, int64_t ds_)
                  __attribute__((target("avx512f"))) {
    const __m512i r0 = _mm512_loadu_si512(s), r1 = _mm512_loadu_si512(s + ss_);
    const __m512i r2 = _mm512_loadu_si512(s + 2 * ss_), r3 = _mm512_loadu_si512(s + 3 * ss_);
    const __m512i t0 = _mm512_shuffle_i64x2(r0, r1, 0x44);
    const __m512i t1 = _mm512_shuffle_i64x2(r0, r1, 0xEE);
    const __m512i t2 = _mm512_shuffle_i64x2(r2, r3, 0x44);
    const __m512i t3 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
    _mm512_storeu_si512(d, _mm512_shuffle_i64x2(t0, t2, 0x88));
    _mm512_storeu_si512(d + ds_, _mm512_shuffle_i64x2(t0, t2, 0xDD));
    _mm512_storeu_si512(d + 2 * ds_, _mm512_shuffle_i64x2(t1, t3, 0x88));
    _mm512_storeu_si512(d + 3 * ds_, _mm512_shuffle_i64x2(t1, t3, 0xDD));
  };
  transpose_tiled<Unit16, 4>(src, ss, dst, ds, rows, cols, order, tile, transpose_u16_avx2);
}

enum class Isa { kBase = 0, kAvx2 = 1, kAvx512 = 2 };

// What the CPU supports, capped by LMCACHE_CPU_ISA=base|avx2|avx512 when set (read once per
// process; the tests use it to run every tile path on one machine).
inline Isa detect_isa() {
  __builtin_cpu_init();
  Isa isa = Isa::kBase;
  if (__builtin_cpu_supports("avx512f")) isa = Isa::kAvx512;
  else if (__builtin_cpu_supports("avx2")) isa = Isa::kAvx2;
  const char* cap = std::getenv("LMCACHE_CPU_ISA");
  if (cap != nullptr) {
    const Isa limit = std::strcmp(cap, "base") == 0   ? Isa::kBase
                      : std::strcmp(cap, "avx2") == 0 ? Isa::kAvx2
                                                      : Isa::kAvx512;
    if (static_cast<int>(limit) < static_cast<int>(isa)) isa = limit;
  }
  return isa;
}

// The ISA for this process, detected once.
inline Isa transpose_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

#endif  // LMC_X86

// dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols, with the best tiles available.
template <typename T>
void transpose(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols,
               Order order) {
#ifdef LMC_X86
  const Isa isa = transpose_isa();
  if constexpr (sizeof(T) == 16) {
    // 4x4 tiles of 64-byte rows won when walking source bands; walking destination bands,
    // 2x2 tiles of 32-byte rows did better.
    if (isa == Isa::kAvx512 && order == Order::kSourceBands)
      return transpose_u16_avx512(src, ss, dst, ds, rows, cols, order);
    if (isa != Isa::kBase) return transpose_u16_avx2(src, ss, dst, ds, rows, cols, order);
  } else if constexpr (sizeof(T) == 4) {
    if (isa != Isa::kBase) return transpose_32_avx2(src, ss, dst, ds, rows, cols, order);
    return transpose_32_sse(src, ss, dst, ds, rows, cols, order);
  } else if constexpr (sizeof(T) == 2) {
    if (isa != Isa::kBase) return transpose_16_avx2(src, ss, dst, ds, rows, cols, order);
    return transpose_16_sse(src, ss, dst, ds, rows, cols, order);
  }
#endif
  transpose_scalar(src, ss, dst, ds, rows, cols);
}

// `transpose` from a paged cache block into object rows (a store), in bands of `kBandBytes` of
// every object row. The object's rows are `hidden` elements apart, a power of two: written
// straight by tiles, the 8-32 rows a tile spans fall into the same L1 sets and evict each other,
// and plain stores read every destination line first. So each band is transposed into `tile`
// (in L1) and its row segments streamed out with non-temporal stores, while the next band's
// cache rows are prefetched (a block's bytes are contiguous, but tile loads alone leave the
// memory idle while they shuffle). Measured on one core: CPU_ATTN keys 0.74 -> 0.91x (bf16),
// 0.77 -> 0.83x (fp32) of a memcpy; CPU_PACKED values 1.0-1.1x either way. Keys of CPU_PACKED
// (16-byte units, rows of whole lines) did better without it.
constexpr int64_t kBandBytes = 512;
constexpr int64_t kMaxBandTokens = 32;

// Asks for `bytes` from `p` on, one line at a time.
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

template <typename T>
void transpose_to_rows(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols) {
  constexpr int64_t unit = sizeof(T);
  constexpr int64_t band = kBandBytes / unit;  // elements of an object row per band
  alignas(64) static thread_local T tile[band * kMaxBandTokens];
  for (int64_t r0 = 0; r0 < rows; r0 += band) {
    const int64_t br = rows - r0 < band ? rows - r0 : band;
    for (int64_t c0 = 0; c0 < cols; c0 += kMaxBandTokens) {
      const int64_t bc = cols - c0 < kMaxBandTokens ? cols - c0 : kMaxBandTokens;
      const int64_t next = rows - r0 - br < band ? rows - r0 - br : band;
      for (int64_t r = 0; r < next; ++r) prefetch_span(src + (r0 + br + r) * ss + c0, bc * unit);
      transpose(src + r0 * ss + c0, ss, tile, br, br, bc, Order::kDestBands);
      for (int64_t c = 0; c < bc; ++c) stream_bytes(dst + (c0 + c) * ds + r0, tile + c * br, br * unit);
    }
  }
}

// `transpose` from object rows into a paged cache block (a retrieve) whose destination rows
// follow each other with no gap (`ds == rows`: a whole block's tokens), so the block's bytes are
// one contiguous span: bands of it are transposed into `tile` (in L1) and streamed out whole with
// non-temporal stores, sparing the read-for-ownership of every destination line that plain tile
// stores pay. False (nothing moved) when the destination is not such a span.
constexpr int64_t kRetrieveTileBytes = 8192;

template <typename T>
bool transpose_into_block(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols) {
  constexpr int64_t unit = sizeof(T);
  const int64_t row_bytes = rows * unit;
  if (ds != rows || row_bytes > kRetrieveTileBytes) return false;
  alignas(64) static thread_local T tile[kRetrieveTileBytes / unit];
  const int64_t band = kRetrieveTileBytes / row_bytes;  // destination rows per band
  for (int64_t c0 = 0; c0 < cols; c0 += band) {
    const int64_t bc = cols - c0 < band ? cols - c0 : band;
    transpose(src + c0, ss, tile, rows, rows, bc, Order::kDestBands);
    stream_bytes(dst + c0 * ds, tile, bc * row_bytes);
  }
  return true;
}

}  // namespace cpu
}  // namespace lmcache
