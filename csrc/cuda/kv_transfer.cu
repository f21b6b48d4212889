// CUDA kernels: paged KV cache <-> contiguous object, every layer in one launch.
//
// Grid: x = token, y = plane = kv * moved_layers + j, the j-th moved layer (kv_layout.h). The threads of a CUDA block walk the token's
// hidden row in units of up to 16 bytes; the unit never spans two contiguous runs of the
// cache (kv_layout.h: cache_run_elems), so one unit is one aligned vector load and store.
// FLASH, MLA and CPU_IPEX rows are contiguous on both sides, so consecutive threads touch
// consecutive addresses (coalesced). The CPU layouts are supported for completeness; they do
// not occur on GPUs in vLLM.
//
// Layer base pointers travel as a device array, so one launch covers all layers. The object
// may be device memory or pinned host memory (unified addressing). Slots outside
// [0, num_slots) are skipped here, which also keeps a bad slot from writing out of bounds
// without a host synchronization to check it.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kv_layout.h"
#include "kv_transfer.h"

namespace lmcache {
namespace {

template <typename U>
__global__ void kv_transfer_kernel(TransferPlan p, char* __restrict__ object,
                                   char* const* __restrict__ caches,
                                   const int64_t* __restrict__ slots) {
  const int64_t token = blockIdx.x;
  const int64_t plane = blockIdx.y;  // kv * moved_layers + j
  const int64_t slot = slots[token];
  if (slot < 0 || slot >= p.num_slots) return;

  const int kv = static_cast<int>(plane_kv(p.object, plane));
  const int64_t layer = plane_layer(p.object, plane);
  const PagedGeometry& g = p.cache;
  const int64_t es = p.element_size;
  const int64_t unit_elems = static_cast<int64_t>(sizeof(U)) / es;
  const int64_t units = p.object.hidden / unit_elems;
  char* cache = caches[plane];
  char* obj_row = object + object_offset(p.object, kv, layer, token, 0) * es;

  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    const int64_t i = u * unit_elems;
    const int64_t h = i / g.head_size;
    U* c = reinterpret_cast<U*>(cache + cache_offset(g, kv, slot, h, i - h * g.head_size) * es);
    U* o = reinterpret_cast<U*>(obj_row + i * es);
    if (p.to_cache) {
      *c = *o;
    } else {
      *o = *c;
    }
  }
}

template <typename U>
void launch(const TransferPlan& p, char* object, char* const* caches, const int64_t* slots,
            cudaStream_t stream) {
  const int64_t units = p.object.hidden * p.element_size / static_cast<int64_t>(sizeof(U));
  const int64_t warps = (units + 31) / 32;
  const int threads = static_cast<int>(std::min<int64_t>(512, std::max<int64_t>(32, warps * 32)));
  const dim3 grid(static_cast<unsigned>(p.object.num_tokens),
                  static_cast<unsigned>(p.num_kv * p.object.moved_layers));
  kv_transfer_kernel<U><<<grid, threads, 0, stream>>>(p, object, caches, slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

}  // namespace

void kv_transfer_cuda(const TransferPlan& plan, char* object, const CachePointers& caches,
                      const at::Tensor& slot_mapping) {
  TORCH_CHECK(plan.num_kv * plan.object.moved_layers <= 65535,
              "too many layers for one launch: ", plan.object.moved_layers);
  const c10::cuda::CUDAGuard guard(slot_mapping.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // Widest unit (bytes) that divides a contiguous run and to which every base is aligned.
  const int64_t run_bytes = cache_run_elems(plan.cache, kKey) * plan.element_size;
  const int64_t v_run_bytes =
      plan.num_kv == 2 ? cache_run_elems(plan.cache, kValue) * plan.element_size : run_bytes;
  int64_t unit = 16;
  auto fits = [&](int64_t b) {
    if (run_bytes % b != 0 || v_run_bytes % b != 0 || !aligned(object, b)) return false;
    for (char* c : caches)
      if (!aligned(c, b)) return false;
    return true;
  };
  while (unit > plan.element_size && !fits(unit)) unit /= 2;

  // Layer pointers as a device array: a pageable host->device async copy is staged before it
  // returns, so the host tensor may go away, and the stream does not wait.
  at::Tensor host_ptrs = at::empty({static_cast<int64_t>(caches.size())}, at::kLong);
  int64_t* hp = host_ptrs.data_ptr<int64_t>();
  for (size_t i = 0; i < caches.size(); ++i) hp[i] = reinterpret_cast<int64_t>(caches[i]);
  at::Tensor dev_ptrs = host_ptrs.to(slot_mapping.device(), /*non_blocking=*/true);
  char* const* table = reinterpret_cast<char* const*>(dev_ptrs.data_ptr<int64_t>());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();

  switch (unit) {
    case 16: return launch<uint4>(plan, object, table, slots, stream);
    case 8: return launch<uint2>(plan, object, table, slots, stream);
    case 4: return launch<uint32_t>(plan, object, table, slots, stream);
    case 2: return launch<uint16_t>(plan, object, table, slots, stream);
    default: return launch<uint8_t>(plan, object, table, slots, stream);
  }
}

}  // namespace lmcache
