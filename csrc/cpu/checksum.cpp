// csrc/checksum.h's sums: AVX-512 or AVX2 where the CPU kernels use them (transpose.h's ISA, which
// LMCACHE_CPU_ISA caps), else a plain loop.
#include "checksum.h"

#include <cstring>

#include "transpose.h"

#if defined(LMC_X86) && defined(__GNUC__)
#define LMC_CHECKSUM_X86 1
#endif

namespace lmcache {
namespace {

constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;

inline uint64_t mix(uint64_t w, uint64_t key) {
  const uint64_t x = w ^ key;
  return static_cast<uint64_t>(static_cast<uint32_t>(x)) * static_cast<uint64_t>(static_cast<uint32_t>(x >> 32));
}

// Words [0, words) of `p`, the first with key `key`, into lane 0.
void add_scalar(const char* p, int64_t words, uint64_t key, LaneSums& into) {
  uint64_t mixed = 0, plain = 0;
  for (int64_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    mixed += mix(w, key);
    plain += w;
    key += kWordKey;
  }
  into.mixed[0] += mixed;
  into.plain[0] += plain;
}

#ifdef LMC_CHECKSUM_X86
// Lane j of a step holds word i + j: its key is the step's first key + j * kWordKey.
alignas(64) constexpr uint64_t kLaneKeys[8] = {0, kWordKey, 2 * kWordKey, 3 * kWordKey,
                                               4 * kWordKey, 5 * kWordKey, 6 * kWordKey, 7 * kWordKey};

__attribute__((target("avx2"))) int64_t add_avx2(const char* p, int64_t words, uint64_t key, LaneSums& into) {
  __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(into.mixed));
  __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(into.plain));
  __m256i k = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<long long>(key)),
                               _mm256_load_si256(reinterpret_cast<const __m256i*>(kLaneKeys)));
  const __m256i step = _mm256_set1_epi64x(static_cast<long long>(4 * kWordKey));
  int64_t i = 0;
  for (; i + 4 <= words; i += 4) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * i));
    const __m256i x = _mm256_xor_si256(w, k);
    m = _mm256_add_epi64(m, _mm256_mul_epu32(x, _mm256_shuffle_epi32(x, 0xB1)));
    s = _mm256_add_epi64(s, w);
    k = _mm256_add_epi64(k, step);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(into.mixed), m);
  _mm256_store_si256(reinterpret_cast<__m256i*>(into.plain), s);
  return i;
}

// Four sets of eight lanes a step (four independent chains), then one set at a time; lines
// `kPrefetchBytes` ahead asked for as it goes (a piece larger than L2 otherwise waits on memory).
constexpr int64_t kPrefetchBytes = 1024;

__attribute__((target("avx512f"))) int64_t add_avx512(const char* p, int64_t words, uint64_t key, LaneSums& into) {
  const __m512i set = _mm512_set1_epi64(static_cast<long long>(8 * kWordKey));
  const __m512i step = _mm512_set1_epi64(static_cast<long long>(32 * kWordKey));
  __m512i k[4], m[4], s[4];
  k[0] = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(key)), _mm512_load_si512(kLaneKeys));
  m[0] = _mm512_load_si512(into.mixed);
  s[0] = _mm512_load_si512(into.plain);
  for (int j = 1; j < 4; ++j) {
    k[j] = _mm512_add_epi64(k[j - 1], set);
    m[j] = s[j] = _mm512_setzero_si512();
  }
  int64_t i = 0;
  for (; i + 32 <= words; i += 32) {
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(p + 8 * i + 64 * j + kPrefetchBytes, _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(p + 8 * i + 64 * j);
      const __m512i x = _mm512_xor_si512(w, k[j]);
      m[j] = _mm512_add_epi64(m[j], _mm512_mul_epu32(x, _mm512_shuffle_epi32(x, _MM_PERM_CDAB)));
      s[j] = _mm512_add_epi64(s[j], w);
      k[j] = _mm512_add_epi64(k[j], step);
    }
  }
  for (int j = 1; j < 4; ++j) {
    m[0] = _mm512_add_epi64(m[0], m[j]);
    s[0] = _mm512_add_epi64(s[0], s[j]);
  }
  for (; i + 8 <= words; i += 8) {
    const __m512i w = _mm512_loadu_si512(p + 8 * i);
    const __m512i x = _mm512_xor_si512(w, k[0]);
    m[0] = _mm512_add_epi64(m[0], _mm512_mul_epu32(x, _mm512_shuffle_epi32(x, _MM_PERM_CDAB)));
    s[0] = _mm512_add_epi64(s[0], w);
    k[0] = _mm512_add_epi64(k[0], set);
  }
  _mm512_store_si512(into.mixed, m[0]);
  _mm512_store_si512(into.plain, s[0]);
  return i;
}

#endif

}  // namespace

void add_sums(const char* p, int64_t n, int64_t first, LaneSums& into) {
  const int64_t words = n / 8;
  const uint64_t key = static_cast<uint64_t>(first + 1) * kWordKey;
  int64_t done = 0;
#ifdef LMC_CHECKSUM_X86
  const cpu::Isa isa = cpu::transpose_isa();
  if (isa == cpu::Isa::kAvx512) done = add_avx512(p, words, key, into);
  else if (isa == cpu::Isa::kAvx2) done = add_avx2(p, words, key, into);
#endif
  add_scalar(p + 8 * done, words - done, key + static_cast<uint64_t>(done) * kWordKey, into);
  if (n % 8) {  // the payload's last, partial word
    uint64_t w = 0;
    std::memcpy(&w, p + 8 * words, static_cast<size_t>(n % 8));
    into.mixed[0] += mix(w, static_cast<uint64_t>(first + words + 1) * kWordKey);
    into.plain[0] += w;
  }
}

uint64_t finish_sums(const WordSums& s, uint64_t nbytes) {
  const uint64_t p = s.plain * kPrime2;
  uint64_t h = s.mixed ^ ((p << 31) | (p >> 33)) ^ (nbytes * kPrime3);
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace lmcache
