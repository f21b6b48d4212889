// Byte copies for the CPU kernels: short inline copies, and non-temporal (streaming) ones.
//
// A chunk's bytes are far more than the caches hold, and a plain store first reads the
// destination line (read-for-ownership), a third memory transfer per byte that a large memcpy
// avoids by streaming. Streamed lines bypass the caches, so they are only worth it where whole
// lines get written; the stores are ordered by `stream_fence()`, which every thread of a
// transfer calls at the end of its share.
#pragma once

#include <cstdint>
#include <cstring>

#include "checksum.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMC_X86 1
#endif

namespace lmcache {
namespace cpu {

// memcpy for the short runs (a head's row, typically 128-512 bytes) copied ~10^5 times per
// call: 64-byte steps inline to plain vector moves instead of a library call each.
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) std::memcpy(d + i, s + i, 64);
  if (i < n) std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

// A store that sums what it writes (`SummedStores`, set on the thread for one item of a
// store; `into` null: not summing): the bytes `stream_bytes` and `note_written` are given are
// added to `into` as words of the payload that starts at `base` (checksum.h), while they are
// still in L1.
struct StoreSums {
  const char* base = nullptr;
  LaneSums* into = nullptr;
};
inline thread_local StoreSums t_store_sums;

struct SummedStores {
  SummedStores(const char* base, LaneSums* into) { t_store_sums = StoreSums{base, into}; }
  ~SummedStores() { t_store_sums = StoreSums{}; }
  SummedStores(const SummedStores&) = delete;
  SummedStores& operator=(const SummedStores&) = delete;
};

// `n` bytes now at `dst` (in the object a summed store writes), summed if the thread sums.
inline void note_written(const void* dst, const void* bytes, int64_t n) {
  const StoreSums& t = t_store_sums;
  if (t.into == nullptr) return;
  add_sums(static_cast<const char*>(bytes), n, (static_cast<const char*>(dst) - t.base) / 8, *t.into);
}

// The same copy with non-temporal stores where `dst` is 16-byte aligned.
inline void copy_streamed(void* dst, const void* src, int64_t n) {
#ifdef LMC_X86
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if ((reinterpret_cast<uintptr_t>(d) & 15) == 0) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    for (; i + 16 <= n; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    }
    if (i < n) std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
    return;
  }
#endif
  copy_bytes(dst, src, n);
}

// `copy_streamed`, and inside `SummedStores` the bytes summed (from `src`, just read: in L1).
inline void stream_bytes(void* dst, const void* src, int64_t n) {
  copy_streamed(dst, src, n);
  note_written(dst, src, n);
}

inline void stream_fence() {
#ifdef LMC_X86
  _mm_sfence();
#endif
}

}  // namespace cpu
}  // namespace lmcache
