// The payload checksum of chunk format 5 (lmcache/experimental/storage_backend/chunk_format.py):
// sums over the payload's 64-bit words that add up piece by piece.
//
// A payload is read as little-endian 64-bit words w_i, i counted from its first byte (a last
// partial word is zero-padded). Two sums mod 2^64 are kept: `mixed` adds lo32(x) * hi32(x) for
// x = w_i ^ ((i + 1) * kWordKey) (so a word's place counts: moved words change it), `plain` adds
// w_i (so any single flipped bit changes it). Sums of disjoint pieces add up to the payload's, in
// any order and on any thread: the copy kernel sums each piece of a chunk while the piece is in
// its cache, with no second pass over the payload. Its job is catching corruption, not forgery.
#pragma once

#include <cstdint>

namespace lmcache {

constexpr uint64_t kWordKey = 0x9E3779B97F4A7C15ull;

struct WordSums {
  uint64_t mixed = 0;
  uint64_t plain = 0;

  void add(const WordSums& o) {
    mixed += o.mixed;
    plain += o.plain;
  }
};

// Sums kept in eight lanes, so that many short pieces (a kernel's rows) are added without
// folding the vectors each time; `total()` folds them.
struct alignas(64) LaneSums {
  uint64_t mixed[8] = {};
  uint64_t plain[8] = {};

  WordSums total() const {
    WordSums s;
    for (int i = 0; i < 8; ++i) {
      s.mixed += mixed[i];
      s.plain += plain[i];
    }
    return s;
  }
};

// Adds the sums of `n` bytes at `p` whose first word is word `first` of the payload. `n` is a
// multiple of 8 unless the bytes end the payload.
void add_sums(const char* p, int64_t n, int64_t first, LaneSums& into);

inline WordSums sum_words(const char* p, int64_t n, int64_t first) {
  LaneSums lanes;
  add_sums(p, n, first, lanes);
  return lanes.total();
}

// The 64-bit checksum of a payload of `nbytes` bytes from its sums.
uint64_t finish_sums(const WordSums& s, uint64_t nbytes);

}  // namespace lmcache
