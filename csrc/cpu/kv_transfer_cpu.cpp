// CPU kernels: paged KV cache <-> contiguous object, all layers in one parallel loop.
//
// The tokens are cut into runs of consecutive slots inside one block. A work item is one
// (layer, run, kv); items are spread over torch's intra-op threads. Addresses come from
// kv_layout.h; what moves per item depends on the layout:
//   FLASH / MLA   a run of n tokens is n whole rows in both cache and object: one memcpy
//   CPU_IPEX      head_size elements per (token, head)
//   CPU_PACKED    per head, a transpose (transpose.h): of 16-byte groups for K, of elements
//                 for V, since the cache keeps a head's tokens as columns
//   CPU_ATTN      K: a transpose of elements per head (tokens as columns); V: as CPU_IPEX
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "kv_transfer.h"
#include "transpose.h"

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

// memcpy for the short runs (a head's row, typically 128-512 bytes) copied ~10^5 times per
// call: 64-byte steps inline to plain vector moves instead of a library call each.
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) std::memcpy(d + i, s + i, 64);
  if (i < n) std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

// A transposed run (CPU_PACKED K and V, CPU_ATTN K) moves units U (16-byte key groups, or
// single elements): the cache block holds [unit index][token] (tokens adjacent, units
// `unit_stride` apart), the object [token][unit index] (rows `hidden` elements apart). In
// CPU_PACKED the heads follow each other along the unit index in both (head h's units start at
// h * head_size / per_unit), so one transpose covers all heads (longer loops measured faster
// than one call per head); CPU_ATTN puts each head's V between its K units and the next head's,
// so there it is one transpose per head.
template <typename U, int ES>
void transpose_run(const TransferPlan& p, int kv, char* cache, char* obj, const Run& run) {
  const PagedGeometry& g = p.cache;
  const int64_t per_unit = static_cast<int64_t>(sizeof(U)) / ES;  // elements per unit
  const int64_t c0 = cache_offset(g, kv, run.slot, 0, 0);
  const int64_t unit_stride = (cache_offset(g, kv, run.slot, 0, per_unit) - c0) / per_unit;
  const int64_t head_units = g.head_size / per_unit;
  const int64_t head_stride = g.num_heads > 1 ? cache_offset(g, kv, run.slot, 1, 0) - c0 : 0;
  const bool heads_adjacent = g.num_heads == 1 || head_stride == head_units * unit_stride * per_unit;
  const int64_t units = heads_adjacent ? g.hidden() / per_unit : head_units;  // per call
  const int64_t calls = heads_adjacent ? 1 : g.num_heads;
  const int64_t row = g.hidden() / per_unit;  // object row length in units
  // Source bands won for long key-block rows in one all-heads transpose (CPU_PACKED); for
  // CPU_ATTN's per-head transposes destination bands measured 1.3-1.4x faster (block_size 128).
  const bool long_rows = heads_adjacent && unit_stride * static_cast<int64_t>(sizeof(U)) > 64;
  for (int64_t h = 0; h < calls; ++h) {
    U* c = reinterpret_cast<U*>(cache + (c0 + h * head_stride) * ES);
    U* o = reinterpret_cast<U*>(obj + (run.token * g.hidden() + h * g.head_size) * ES);
    if (p.to_cache) {
      cpu::transpose<U>(o, row, c, unit_stride, run.count, units, cpu::Order::kDestBands);
    } else {
      cpu::transpose<U>(c, unit_stride, o, row, units, run.count,
                        long_rows ? cpu::Order::kSourceBands : cpu::Order::kDestBands);
    }
  }
}

// Moves one run of one layer's K or V. `cache` and `obj` point at element 0 of the layer's
// cache and of the object's (kv, layer) plane.
template <int ES>
void copy_run(const TransferPlan& p, int kv, char* cache, char* obj, const Run& run) {
  const PagedGeometry& g = p.cache;
  const int64_t hidden = g.hidden();
  const int64_t run_elems = cache_run_elems(g, kv);
  char* o = obj + run.token * hidden * ES;

  if (run_elems == hidden) {  // FLASH, MLA: n tokens are n whole rows on both sides
    char* cr = cache + cache_offset(g, kv, run.slot, 0, 0) * ES;
    const size_t bytes = static_cast<size_t>(run.count * hidden) * ES;
    if (p.to_cache) std::memcpy(cr, o, bytes);
    else std::memcpy(o, cr, bytes);
    return;
  }
  if (run_elems == g.head_size) {  // CPU_IPEX, CPU_ATTN V: one head_size row per (token, head)
    // Read the source in address order (that is what the prefetchers reward): for a store the
    // cache (head-major), for a retrieve the object (token-major).
    const int64_t token_stride = cache_token_stride(g, kv);
    const int64_t bytes = run_elems * ES;
    for (int64_t a = 0; a < (p.to_cache ? run.count : g.num_heads); ++a) {
      for (int64_t b = 0; b < (p.to_cache ? g.num_heads : run.count); ++b) {
        const int64_t j = p.to_cache ? a : b, h = p.to_cache ? b : a;
        char* cj = cache + (cache_offset(g, kv, run.slot, h, 0) + j * token_stride) * ES;
        char* oj = o + (j * hidden + h * g.head_size) * ES;
        if (p.to_cache) copy_bytes(cj, oj, bytes);
        else copy_bytes(oj, cj, bytes);
      }
    }
    return;
  }
  if (run_elems * ES == 16) return transpose_run<cpu::Unit16, ES>(p, kv, cache, obj, run);
  transpose_run<typename Bytes<ES>::T, ES>(p, kv, cache, obj, run);  // CPU_PACKED V, CPU_ATTN K
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

const char* cpu_isa_name() {
#ifdef LMC_X86
  switch (cpu::transpose_isa()) {
    case cpu::Isa::kAvx512: return "avx512";
    case cpu::Isa::kAvx2: return "avx2";
    default: return "base";
  }
#else
  return "base";
#endif
}

}  // namespace lmcache
