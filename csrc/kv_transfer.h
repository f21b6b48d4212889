// Device-independent description of one transfer, handed from the bindings (csrc/bindings.cpp,
// which validates every argument) to the CPU and CUDA kernels (which trust it).
#pragma once

#include <cstdint>
#include <vector>

#include "checksum.h"
#include "kv_layout.h"

namespace lmcache {

struct TransferPlan {
  PagedGeometry cache;     // per-layer K/V cache geometry
  ObjectGeometry object;   // [num_kv, num_layers, num_tokens, hidden] and the layers moved
  int num_kv;              // 2 (K and V) or 1 (MLA)
  int64_t element_size;    // bytes per element; data moves as bytes of this width
  int64_t num_slots;       // slots per layer cache (num_blocks * block_size)
  bool to_cache;           // true: object -> cache (retrieve); false: cache -> object (store)
};

// Base pointers of the moved layers' caches, one per plane: ptrs[kv * moved_layers + j] for the
// j-th moved layer (kv_layout.h: plane_kv, plane_layer).
using CachePointers = std::vector<char*>;

// One object of a CPU transfer: its plan, its bytes and its slots (plan.object.num_tokens
// entries, already checked to be < plan.num_slots; negative entries are skipped).
struct CpuJob {
  TransferPlan plan;
  char* object;
  const int64_t* slots;
};

// CPU kernels (csrc/cpu/kv_transfer_cpu.cpp): every job against the same caches, in ONE
// parallel loop (waking the thread team once per request instead of once per chunk). The jobs
// share the cache geometry and element size. With `sums` (stores only, rows of a multiple of 8
// bytes), (*sums)[j] gets the checksum sums (checksum.h) of the bytes written into job j's
// object, each piece summed while it is in cache.
void kv_transfer_cpu(const std::vector<CpuJob>& jobs, const CachePointers& caches,
                     std::vector<WordSums>* sums = nullptr);

// Instruction set the CPU transposes use: "avx512", "avx2" or "base" (see cpu/transpose.h).
const char* cpu_isa_name();

}  // namespace lmcache
