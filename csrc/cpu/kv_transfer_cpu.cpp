// CPU kernels: paged KV cache <-> contiguous object, all moved layers in one parallel loop.
//
// The tokens are cut into runs of consecutive slots inside one block. A work item is one
// (object, moved layer, run, kv); the items of every object of a call are spread over torch's
// intra-op threads in one parallel loop. Addresses come from
// kv_layout.h; what moves per item depends on the layout:
//   FLASH / MLA   a run of n tokens is n whole rows in both cache and object: one memcpy
//   CPU_IPEX      head_size elements per (token, head)
//   CPU_PACKED    per head, a transpose (transpose.h): of 16-byte groups for K, of elements
//                 for V, since the cache keeps a head's tokens as columns
//   CPU_ATTN      K: a transpose of elements per head (tokens as columns); V: as CPU_IPEX
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "kv_transfer.h"
#include "stream.h"
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
  // Stores: source bands won for long cache rows in one all-heads transpose (CPU_PACKED keys);
  // the others go through `transpose_to_rows`. Retrieves: destination bands (CPU_ATTN's
  // per-head transposes measured 1.3-1.4x faster that way at block_size 128).
  const bool long_rows = heads_adjacent && unit_stride * static_cast<int64_t>(sizeof(U)) > 64;
  for (int64_t h = 0; h < calls; ++h) {
    U* c = reinterpret_cast<U*>(cache + (c0 + h * head_stride) * ES);
    U* o = reinterpret_cast<U*>(obj + (run.token * g.hidden() + h * g.head_size) * ES);
    if (p.to_cache) {
      if (!cpu::transpose_into_block<U>(o, row, c, unit_stride, run.count, units))
        cpu::transpose<U>(o, row, c, unit_stride, run.count, units, cpu::Order::kDestBands);
    } else if (long_rows) {  // plain stores: the rows are in cache for a summed store
      cpu::transpose<U>(c, unit_stride, o, row, units, run.count, cpu::Order::kSourceBands);
      cpu::note_written(o, o, run.count * row * static_cast<int64_t>(sizeof(U)));
    } else {
      cpu::transpose_to_rows<U>(c, unit_stride, o, row, units, run.count);
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
    const int64_t bytes = run.count * hidden * ES;
    if (p.to_cache) cpu::stream_bytes(cr, o, bytes);
    else cpu::stream_bytes(o, cr, bytes);
    return;
  }
  if (run_elems == g.head_size) {  // CPU_IPEX, CPU_ATTN V: one head_size row per (token, head)
    // Read the source in address order (that is what the prefetchers reward): for a store the
    // cache (head-major), for a retrieve the object (token-major). Addresses step by strides
    // computed once per run: a division per row cost as much as the row's copy.
    char* c0 = cache + cache_offset(g, kv, run.slot, 0, 0) * ES;
    const int64_t token_step = cache_token_stride(g, kv) * ES;
    const int64_t head_step =
        g.num_heads > 1 ? (cache_offset(g, kv, run.slot, 1, 0) - cache_offset(g, kv, run.slot, 0, 0)) * ES : 0;
    const int64_t bytes = run_elems * ES;
    const int64_t row = hidden * ES;
    if (p.to_cache) {
      for (int64_t j = 0; j < run.count; ++j)
        for (int64_t h = 0; h < g.num_heads; ++h)
          cpu::stream_bytes(c0 + h * head_step + j * token_step, o + j * row + h * bytes, bytes);
    } else {
      for (int64_t h = 0; h < g.num_heads; ++h)
        for (int64_t j = 0; j < run.count; ++j)
          cpu::stream_bytes(o + j * row + h * bytes, c0 + h * head_step + j * token_step, bytes);
    }
    return;
  }
  if (run_elems * ES == 16) return transpose_run<cpu::Unit16, ES>(p, kv, cache, obj, run);
  transpose_run<typename Bytes<ES>::T, ES>(p, kv, cache, obj, run);  // CPU_PACKED V, CPU_ATTN K
}

// One job's runs, where its items begin in the batch's item numbering, and its index in the call.
struct JobRuns {
  const CpuJob* job;
  std::vector<Run> runs;
  int64_t first_item;
  size_t index;
};

template <int ES>
void transfer(const std::vector<JobRuns>& jobs, int64_t items, const CachePointers& caches,
              std::vector<WordSums>* sums) {
  std::mutex sums_lock;
  // One item is at most a block of one layer's K or V (tens of KiB): a few per grain. K and V
  // alternate in item order, so every thread's contiguous share mixes them equally (their
  // costs differ, e.g. CPU_PACKED's V is a transpose).
  auto share = [&](int64_t begin, int64_t end) {
    std::vector<LaneSums> local(sums != nullptr ? jobs.size() : 0);
    size_t j = 0;
    while (j + 1 < jobs.size() && jobs[j + 1].first_item <= begin) ++j;
    for (int64_t it = begin; it < end; ++it) {
      while (j + 1 < jobs.size() && jobs[j + 1].first_item <= it) ++j;
      const TransferPlan& p = jobs[j].job->plan;
      const int64_t num_runs = static_cast<int64_t>(jobs[j].runs.size());
      const int64_t local_item = it - jobs[j].first_item;
      const int kv = static_cast<int>(local_item % p.num_kv);
      const int64_t rest = local_item / p.num_kv;  // moved layer * num_runs + run
      const int64_t moved = rest / num_runs;
      const Run& run = jobs[j].runs[rest - moved * num_runs];
      const int64_t plane = kv * p.object.moved_layers + moved;
      const int64_t plane_byte = object_offset(p.object, kv, plane_layer(p.object, plane), 0, 0) * ES;
      char* obj = jobs[j].job->object + plane_byte;
      // A store summing its objects: every write into them is summed.
      cpu::SummedStores summed(jobs[j].job->object, sums != nullptr ? &local[j] : nullptr);
      copy_run<ES>(p, kv, caches[plane], obj, run);
    }
    cpu::stream_fence();
    if (sums != nullptr) {
      std::lock_guard<std::mutex> hold(sums_lock);
      for (size_t k = 0; k < local.size(); ++k) (*sums)[jobs[k].index].add(local[k].total());
    }
  };
  // A thread that asked for one OpenMP thread (LMCache's own, lmcache/background_threads.py)
  // copies inline: at::parallel_for's per-thread first-use setup is inlined into this library,
  // apart from libtorch's, and would reset the thread to the process's count and open a second
  // OpenMP team - with more OpenMP threads than CPUs libgomp cuts every thread's spin-wait, the
  // model's OpenMP worker included. at::get_num_threads() asks libtorch, which that thread set up.
  if (at::get_num_threads() == 1) {
    share(0, items);
  } else {
    at::parallel_for(0, items, 4, share);
  }
}

}  // namespace

void kv_transfer_cpu(const std::vector<CpuJob>& jobs, const CachePointers& caches,
                     std::vector<WordSums>* sums) {
  std::vector<JobRuns> planned;
  int64_t items = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const CpuJob& job = jobs[i];
    std::vector<Run> runs = make_runs(job.slots, job.plan.object.num_tokens, job.plan.cache.block_size);
    if (runs.empty()) continue;
    const int64_t n = job.plan.num_kv * job.plan.object.moved_layers * static_cast<int64_t>(runs.size());
    planned.push_back(JobRuns{&job, std::move(runs), items, i});
    items += n;
  }
  if (sums != nullptr) sums->assign(jobs.size(), WordSums{});
  if (planned.empty()) return;
  switch (planned.front().job->plan.element_size) {
    case 1: return transfer<1>(planned, items, caches, sums);
    case 2: return transfer<2>(planned, items, caches, sums);
    case 4: return transfer<4>(planned, items, caches, sums);
    case 8: return transfer<8>(planned, items, caches, sums);
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
