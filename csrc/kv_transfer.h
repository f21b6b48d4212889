// Device-independent description of one transfer, handed from the bindings (csrc/bindings.cpp,
// which validates every argument) to the CPU and CUDA kernels (which trust it).
#pragma once

#include <cstdint>
#include <vector>

#include "kv_layout.h"

namespace lmcache {

struct TransferPlan {
  PagedGeometry cache;     // per-layer K/V cache geometry
  ObjectGeometry object;   // [num_kv, num_layers, num_tokens, hidden]
  int num_kv;              // 2 (K and V) or 1 (MLA)
  int64_t element_size;    // bytes per element; data moves as bytes of this width
  int64_t num_slots;       // slots per layer cache (num_blocks * block_size)
  bool to_cache;           // true: object -> cache (retrieve); false: cache -> object (store)
};

// Base pointers of every layer's caches: ptrs[kv * num_layers + layer].
using CachePointers = std::vector<char*>;

// CPU kernels (csrc/cpu/kv_transfer_cpu.cpp). `slots` has plan.object.num_tokens entries,
// already checked to be < plan.num_slots; negative entries are skipped.
void kv_transfer_cpu(const TransferPlan& plan, char* object, const CachePointers& caches,
                     const int64_t* slots);

// Instruction set the CPU transposes use: "avx512", "avx2" or "base" (see cpu/transpose.h).
const char* cpu_isa_name();

}  // namespace lmcache
