// Python bindings of lmcache.c_ops: argument checks, then dispatch to the CPU or CUDA kernels.
//
// Every check that keeps a kernel inside its buffers lives here, so the kernels can trust the
// TransferPlan they get. Errors are TORCH_CHECKs (RuntimeError in Python) naming the argument.
// The transfers run without the GIL (arguments are converted before it is released), so a
// store on a background thread does not stall the Python threads around it.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checksum.h"
#include "kv_layout.h"
#include "kv_transfer.h"

#ifdef LMCACHE_WITH_CUDA
namespace lmcache {
// CUDA kernels (csrc/cuda/kv_transfer.cu): one launch for all layers on the current stream.
void kv_transfer_cuda(const TransferPlan& plan, char* object, const CachePointers& caches,
                      const at::Tensor& slot_mapping);
}  // namespace lmcache
#endif

namespace lmcache {
namespace {

const char* layout_name(int64_t layout) {
  switch (layout) {
    case kLayoutFlash: return "FLASH";
    case kLayoutCpuIpex: return "CPU_IPEX";
    case kLayoutCpuPacked: return "CPU_PACKED";
    case kLayoutMla: return "MLA";
    case kLayoutCpuAttn: return "CPU_ATTN";
    default: return "unknown";
  }
}

// The full per-layer shape a layout implies for K (kv == kKey) or V.
std::vector<int64_t> layout_shape(const PagedGeometry& g, int kv, int64_t num_blocks) {
  switch (g.layout) {
    case kLayoutCpuIpex:
      return {num_blocks, g.num_heads, g.block_size, g.head_size};
    case kLayoutCpuPacked:
      if (kv == kKey) return {num_blocks, g.num_heads, g.head_size / g.pack, g.block_size, g.pack};
      return {num_blocks, g.num_heads, g.head_size, g.block_size};
    case kLayoutMla:
      return {num_blocks, g.block_size, g.head_size};
    case kLayoutCpuAttn:  // K and V share the tensor
      return {num_blocks, g.num_heads, g.block_size, 2 * g.head_size};
    default:
      return {num_blocks, g.block_size, g.num_heads, g.head_size};
  }
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Checks one layer cache against the layout and returns its slot count.
int64_t check_cache(const at::Tensor& c, const std::string& name, const at::Tensor& obj,
                    const PagedGeometry& g, int kv) {
  TORCH_CHECK(c.defined(), name, " is undefined");
  TORCH_CHECK(c.scalar_type() == obj.scalar_type(), name, " has dtype ", c.scalar_type(),
              " but the object has dtype ", obj.scalar_type());
  TORCH_CHECK(c.is_contiguous(), name, " must be contiguous (got strides ",
              shape_str(c.strides()), ")");
  const int64_t block_elems = g.cache_block_elems();
  TORCH_CHECK(c.numel() > 0 && c.numel() % block_elems == 0, name, " has ", c.numel(),
              " elements, not a multiple of the ", block_elems, " of one ",
              layout_name(g.layout), " block (block_size ", g.block_size, ", hidden ", g.hidden(),
              ")");
  const int64_t num_blocks = c.numel() / block_elems;
  const std::vector<int64_t> full = layout_shape(g, kv, num_blocks);
  // Accepted: the layout's own shape, (num_blocks, block elements) as the CPU backend's
  // kv[0] / kv[1] views are, or flat. Any other shape says the caller meant another layout.
  const bool ok = c.sizes().equals(full) ||
                  (c.dim() == 2 && c.size(0) == num_blocks && c.size(1) == block_elems) ||
                  c.dim() == 1;
  TORCH_CHECK(ok, name, " has shape ", shape_str(c.sizes()), " which contradicts layout ",
              layout_name(g.layout), ": expected ", shape_str(full), " or [", num_blocks, ", ",
              block_elems, "]");
  return num_blocks * g.block_size;
}

// One checked transfer, ready for a kernel.
struct Prepared {
  TransferPlan plan;
  char* object = nullptr;
  CachePointers caches;
  at::Device device = at::kCPU;
  at::Tensor slots;  // contiguous, on the caches' device
  bool empty = false;  // no layers or no tokens: nothing to move
};

// Every check of the single-, multi-layer and batch entry points. `obj` is [num_kv, L, T, hidden].
// layer < 0 moves every layer (key_caches / value_caches hold L caches each); layer >= 0 moves
// that layer of obj only (they hold that layer's one cache each, named without an index).
Prepared prepare(const at::Tensor& obj, const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
                 int64_t layout, int64_t block_size, int64_t num_heads, bool to_cache,
                 const std::string& obj_name, const char* keys_name, const char* values_name,
                 const std::string& slots_name, int64_t layer = -1) {
  Prepared out;
  TORCH_CHECK(layout >= 0 && layout < kNumLayouts, "layout must be 0 (FLASH), 1 (CPU_IPEX), ",
              "2 (CPU_PACKED), 3 (MLA) or 4 (CPU_ATTN), got ", layout);
  const bool mla = layout == kLayoutMla;
  const int num_kv = mla ? 1 : 2;
  TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  TORCH_CHECK(num_heads > 0, "num_heads must be positive, got ", num_heads);
  TORCH_CHECK(!mla || num_heads == 1, "num_heads must be 1 for layout MLA, got ", num_heads);

  TORCH_CHECK(obj.dim() == 4 && obj.size(0) == num_kv, obj_name, " must have shape ",
              mla ? "[1, " : "[2, ", "layers, tokens, hidden] for layout ", layout_name(layout),
              ", got ", shape_str(obj.sizes()));
  TORCH_CHECK(obj.is_contiguous(), obj_name, " must be contiguous (got strides ",
              shape_str(obj.strides()), " for shape ", shape_str(obj.sizes()), ")");
  const int64_t element_size = obj.element_size();
  TORCH_CHECK(element_size == 1 || element_size == 2 || element_size == 4 || element_size == 8,
              obj_name, " has dtype ", obj.scalar_type(), " of ", element_size,
              " bytes; supported element sizes are 1, 2, 4 and 8");
  const int64_t num_layers = obj.size(1);
  const int64_t num_tokens = obj.size(2);
  const int64_t hidden = obj.size(3);
  TORCH_CHECK(hidden > 0 && hidden % num_heads == 0, obj_name, " hidden size ", hidden,
              " is not a multiple of num_heads ", num_heads);
  const int64_t head_size = hidden / num_heads;
  const PagedGeometry g = make_geometry(static_cast<int>(layout), block_size, num_heads,
                                        head_size, element_size);
  TORCH_CHECK(head_size % g.pack == 0, "layout CPU_PACKED needs head_size (", head_size,
              ") to be a multiple of x = 16 / element_size = ", g.pack);

  const bool one_layer = layer >= 0;
  TORCH_CHECK(!one_layer || layer < num_layers, "layer ", layer, " is out of range for ",
              obj_name, " of shape ", shape_str(obj.sizes()), " (", num_layers, " layers)");
  const int64_t moved_layers = one_layer ? 1 : num_layers;
  TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == moved_layers, keys_name, " has ",
              key_caches.size(), " layers but ", obj_name, " has ", num_layers);
  if (mla) {
    TORCH_CHECK(value_caches.empty(), values_name, " must be empty for layout MLA, got ",
                value_caches.size(), " tensors");
  } else {
    TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == moved_layers, values_name, " has ",
                value_caches.size(), " layers but ", obj_name, " has ", num_layers);
  }

  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, slots_name, " must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == num_tokens,
              slots_name, " has shape ", shape_str(slot_mapping.sizes()), " but ", obj_name,
              " has ", num_tokens, " tokens");

  const at::Device device = moved_layers > 0 ? key_caches[0].device() : obj.device();
  const std::string first_key = std::string(keys_name) + (one_layer ? "" : "[0]");
  CachePointers& caches = out.caches;
  caches.resize(static_cast<size_t>(num_kv * moved_layers));
  int64_t num_slots = -1;
  for (int kv = 0; kv < num_kv; ++kv) {
    const std::vector<at::Tensor>& list = kv == kKey ? key_caches : value_caches;
    const char* list_name = kv == kKey ? keys_name : values_name;
    for (int64_t l = 0; l < moved_layers; ++l) {
      const std::string name =
          std::string(list_name) + (one_layer ? "" : "[" + std::to_string(l) + "]");
      const at::Tensor& c = list[l];
      const int64_t slots = check_cache(c, name, obj, g, kv);
      TORCH_CHECK(c.device() == device, name, " is on ", c.device(), " but ", first_key,
                  " is on ", device);
      TORCH_CHECK(num_slots < 0 || slots == num_slots, name, " holds ", slots,
                  " slots but ", first_key, " holds ", num_slots);
      num_slots = slots;
      caches[kv * moved_layers + l] = static_cast<char*>(c.data_ptr());
    }
  }
  out.device = device;
  out.empty = moved_layers == 0 || num_tokens == 0;
  if (out.empty) return out;

  TransferPlan& plan = out.plan;
  plan.cache = g;
  plan.object = ObjectGeometry{num_layers, num_tokens, hidden, one_layer ? layer : 0, moved_layers};
  plan.num_kv = num_kv;
  plan.element_size = element_size;
  plan.num_slots = num_slots;
  plan.to_cache = to_cache;
  out.object = static_cast<char*>(obj.data_ptr());

  if (device.is_cpu()) {
    TORCH_CHECK(obj.device().is_cpu(), obj_name, " is on ", obj.device(),
                " but the caches are on the CPU");
    TORCH_CHECK(slot_mapping.device().is_cpu(), slots_name, " is on ", slot_mapping.device(),
                " but the caches are on the CPU");
    out.slots = slot_mapping.contiguous();
    const int64_t* s = out.slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      TORCH_CHECK(s[t] < num_slots, slots_name, "[", t, "] = ", s[t],
                  " is beyond the cache (", num_slots, " slots = ", num_slots / block_size,
                  " blocks of ", block_size, ")");
    }
    return out;
  }
#ifdef LMCACHE_WITH_CUDA
  if (device.is_cuda()) {
    // The object may be device memory or pinned host memory (reached by the kernel through
    // unified addressing). Slots beyond the cache are skipped on the device: checking them
    // here would need a host synchronization on every call.
    TORCH_CHECK((obj.device() == device) || (obj.device().is_cpu() && obj.is_pinned()),
                obj_name, " must be on ", device, " or in pinned host memory, got ",
                obj.device(), obj.device().is_cpu() ? " (not pinned)" : "");
    out.slots = slot_mapping.to(device, /*non_blocking=*/true).contiguous();
    return out;
  }
  TORCH_CHECK(false, "caches on ", device, " are not supported (CPU or CUDA only)");
#else
  TORCH_CHECK(false, "caches are on ", device,
              " but lmcache.c_ops was built without CUDA support (CPU only)");
#endif
  return out;
}

// Whether a store of `p` writes every byte of its object on the CPU in rows (and head rows) of
// whole 64-bit words: then its kernel can sum the object as it writes it (checksum.h).
bool sums_whole_object(const Prepared& p) {
  if (p.empty || !p.device.is_cpu() || p.plan.to_cache) return false;
  if (p.plan.object.moved_layers != p.plan.object.num_layers) return false;
  if ((p.plan.object.hidden * p.plan.element_size) % 8 != 0) return false;
  if ((p.plan.cache.head_size * p.plan.element_size) % 8 != 0) return false;
  const int64_t* s = p.slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < p.plan.object.num_tokens; ++t) {
    if (s[t] < 0) return false;
  }
  return true;
}

// Runs prepared transfers that share their caches: on the CPU in one parallel loop, on CUDA
// one launch each. With `checksums`, each store whose object the CPU kernel writes whole gets its
// payload checksum (checksum.h); the others get none.
std::vector<std::optional<uint64_t>> run(const std::vector<Prepared>& prepared, bool checksums = false) {
  std::vector<CpuJob> cpu_jobs;
  std::vector<size_t> summed;  // prepared index of each CPU job whose object is summed whole
  bool all_whole = checksums;
  for (size_t i = 0; i < prepared.size(); ++i) {
    const Prepared& p = prepared[i];
    if (p.empty) continue;
    if (p.device.is_cpu()) {
      if (checksums && sums_whole_object(p)) summed.push_back(i);
      else all_whole = false;
      cpu_jobs.push_back(CpuJob{p.plan, p.object, p.slots.data_ptr<int64_t>()});
      continue;
    }
#ifdef LMCACHE_WITH_CUDA
    kv_transfer_cuda(p.plan, p.object, p.caches, p.slots);
#endif
  }
  std::vector<std::optional<uint64_t>> out(checksums ? prepared.size() : 0);
  if (cpu_jobs.empty()) return out;
  if (!all_whole || summed.size() != cpu_jobs.size()) {  // some store not whole: sum none
    kv_transfer_cpu(cpu_jobs, prepared.front().caches);
    return out;
  }
  std::vector<WordSums> sums;
  kv_transfer_cpu(cpu_jobs, prepared.front().caches, &sums);
  for (size_t j = 0; j < summed.size(); ++j) {
    const Prepared& p = prepared[summed[j]];
    const ObjectGeometry& o = p.plan.object;
    const uint64_t nbytes = static_cast<uint64_t>(p.plan.num_kv * o.num_layers * o.num_tokens * o.hidden * p.plan.element_size);
    out[summed[j]] = finish_sums(sums[j], nbytes);
  }
  return out;
}

void transfer(const at::Tensor& obj, const std::vector<at::Tensor>& key_caches,
              const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
              int64_t layout, int64_t block_size, int64_t num_heads, bool to_cache,
              const char* obj_name, const char* keys_name, const char* values_name) {
  run({prepare(obj, key_caches, value_caches, slot_mapping, layout, block_size, num_heads,
               to_cache, obj_name, keys_name, values_name, "slot_mapping")});
}

void multi_layer_kv_transfer(const at::Tensor& obj, const std::vector<at::Tensor>& key_caches,
                             const std::vector<at::Tensor>& value_caches,
                             const at::Tensor& slot_mapping, int64_t layout,
                             int64_t block_size, int64_t num_heads, bool to_cache) {
  transfer(obj, key_caches, value_caches, slot_mapping, layout, block_size, num_heads, to_cache,
           "obj", "key_caches", "value_caches");
}

std::vector<std::optional<uint64_t>> multi_layer_kv_transfer_batch(
    const std::vector<at::Tensor>& objs, const std::vector<at::Tensor>& key_caches,
    const std::vector<at::Tensor>& value_caches, const std::vector<at::Tensor>& slot_mappings,
    int64_t layout, int64_t block_size, int64_t num_heads, bool to_cache, bool checksums) {
  TORCH_CHECK(objs.size() == slot_mappings.size(), "objs has ", objs.size(),
              " objects but slot_mappings has ", slot_mappings.size());
  std::vector<Prepared> prepared;
  prepared.reserve(objs.size());
  // Every object is checked before anything moves: a bad one fails the call with nothing written.
  for (size_t i = 0; i < objs.size(); ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    prepared.push_back(prepare(objs[i], key_caches, value_caches, slot_mappings[i], layout,
                               block_size, num_heads, to_cache, "objs" + idx, "key_caches",
                               "value_caches", "slot_mappings" + idx));
  }
  TORCH_CHECK(!(checksums && to_cache), "checksums are computed by stores (to_cache=False) only");
  if (prepared.empty()) return {};
  return run(prepared, checksums);
}

// The payload checksum's sums of a buffer whose first byte is byte `first_byte` of its payload.
std::tuple<uint64_t, uint64_t> checksum_sums(const py::buffer& buf, int64_t first_byte) {
  TORCH_CHECK(first_byte >= 0 && first_byte % 8 == 0, "first_byte must be a multiple of 8 and >= 0, got ",
              first_byte);
  const py::buffer_info info = buf.request();
  TORCH_CHECK(info.ndim <= 1 && (info.ndim == 0 || info.strides[0] == info.itemsize),
              "checksum_sums needs a contiguous buffer");
  const int64_t n = info.size * info.itemsize;
  WordSums s;
  {
    py::gil_scoped_release unlocked;
    s = sum_words(static_cast<const char*>(info.ptr), n, first_byte / 8);
  }
  return {s.mixed, s.plain};
}

uint64_t checksum_finish(uint64_t mixed, uint64_t plain, uint64_t nbytes) {
  WordSums s;
  s.mixed = mixed;
  s.plain = plain;
  return finish_sums(s, nbytes);
}

// Layer `layer` of several whole objects [num_kv, L, T_i, hidden] (a request's chunks) against
// that layer's caches, straight from / into the objects: one parallel loop on the CPU.
void layer_kv_transfer_batch(const std::vector<at::Tensor>& objs, int64_t layer,
                             const at::Tensor& key_cache,
                             const c10::optional<at::Tensor>& value_cache,
                             const std::vector<at::Tensor>& slot_mappings, int64_t layout,
                             int64_t block_size, int64_t num_heads, bool to_cache) {
  TORCH_CHECK(objs.size() == slot_mappings.size(), "objs has ", objs.size(),
              " objects but slot_mappings has ", slot_mappings.size());
  TORCH_CHECK(layer >= 0, "layer must be >= 0, got ", layer);
  std::vector<at::Tensor> values;
  if (value_cache.has_value() && value_cache->defined()) values.push_back(*value_cache);
  TORCH_CHECK(layout == kLayoutMla || !values.empty(),
              "value_cache is required for every layout but MLA");
  std::vector<Prepared> prepared;
  prepared.reserve(objs.size());
  for (size_t i = 0; i < objs.size(); ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    prepared.push_back(prepare(objs[i], {key_cache}, values, slot_mappings[i], layout, block_size,
                               num_heads, to_cache, "objs" + idx, "key_cache", "value_cache",
                               "slot_mappings" + idx, layer));
  }
  if (!prepared.empty()) run(prepared);
}

void single_layer_kv_transfer(const at::Tensor& obj_layer, const at::Tensor& key_cache,
                              const c10::optional<at::Tensor>& value_cache,
                              const at::Tensor& slot_mapping, int64_t layout,
                              int64_t block_size, int64_t num_heads, bool to_cache) {
  const int64_t num_kv = layout == kLayoutMla ? 1 : 2;
  TORCH_CHECK(obj_layer.dim() == 3 && obj_layer.size(0) == num_kv,
              "obj_layer must have shape [2, tokens, hidden] ([1, tokens, head_size] for MLA)",
              ", got ", shape_str(obj_layer.sizes()));
  TORCH_CHECK(obj_layer.is_contiguous(), "obj_layer must be contiguous (got strides ",
              shape_str(obj_layer.strides()), ")");
  std::vector<at::Tensor> values;
  if (value_cache.has_value() && value_cache->defined()) values.push_back(*value_cache);
  TORCH_CHECK(layout == kLayoutMla || !values.empty(),
              "value_cache is required for every layout but MLA");
  transfer(obj_layer.unsqueeze(1), {key_cache}, values, slot_mapping, layout, block_size,
           num_heads, to_cache, "obj_layer", "key_cache", "value_cache");
}

// Element offsets that kv_layout.h gives for every (token, hidden index) of a slot mapping,
// computed the way the CUDA kernel does (i -> head, dim -> cache_offset). Lets the CPU tests
// check the shared address arithmetic element by element, including where no CPU kernel
// path calls it per element.
at::Tensor cache_offsets(int64_t layout, int64_t kv, const at::Tensor& slot_mapping,
                         int64_t block_size, int64_t num_heads, int64_t head_size,
                         int64_t element_size) {
  TORCH_CHECK(layout >= 0 && layout < kNumLayouts, "layout must be 0..", kNumLayouts - 1,
              ", got ", layout);
  TORCH_CHECK(kv == kKey || kv == kValue, "kv must be 0 (K) or 1 (V), got ", kv);
  TORCH_CHECK(block_size > 0 && num_heads > 0 && head_size > 0,
              "block_size, num_heads and head_size must be positive");
  TORCH_CHECK(element_size == 1 || element_size == 2 || element_size == 4 || element_size == 8,
              "element_size must be 1, 2, 4 or 8, got ", element_size);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping must be a 1-D int64 tensor");
  const PagedGeometry g = make_geometry(static_cast<int>(layout), block_size, num_heads,
                                        head_size, element_size);
  TORCH_CHECK(head_size % g.pack == 0, "head_size must be a multiple of x = ", g.pack);
  const at::Tensor slots = slot_mapping.cpu().contiguous();
  const int64_t n = slots.numel(), hidden = g.hidden();
  at::Tensor out = at::empty({n, hidden}, at::kLong);
  const int64_t* s = slots.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(s[t] >= 0, "slot_mapping[", t, "] is negative");
    for (int64_t i = 0; i < hidden; ++i) {
      const int64_t h = i / head_size;
      o[t * hidden + i] = cache_offset(g, static_cast<int>(kv), s[t], h, i - h * head_size);
    }
  }
  return out;
}

}  // namespace
}  // namespace lmcache

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LMCache kernels: paged KV cache <-> contiguous KV object copies (CPU and CUDA).";
  m.attr("LAYOUT_FLASH") = lmcache::kLayoutFlash;
  m.attr("LAYOUT_CPU_IPEX") = lmcache::kLayoutCpuIpex;
  m.attr("LAYOUT_CPU_PACKED") = lmcache::kLayoutCpuPacked;
  m.attr("LAYOUT_MLA") = lmcache::kLayoutMla;
  m.attr("LAYOUT_CPU_ATTN") = lmcache::kLayoutCpuAttn;
#ifdef LMCACHE_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("_cache_offsets", &lmcache::cache_offsets,
        "Debug/test helper: [T, hidden] element offsets of each slot's (head, dim) in one "
        "layer's K (kv=0) or V (kv=1) cache, from csrc/kv_layout.h.",
        py::arg("layout"), py::arg("kv"), py::arg("slot_mapping"), py::arg("block_size"),
        py::arg("num_heads"), py::arg("head_size"), py::arg("element_size"));
  m.def("cpu_isa", &lmcache::cpu_isa_name,
        "Vector instruction set of the CPU transposes (CPU_PACKED): avx512, avx2 or base. "
        "LMCACHE_CPU_ISA caps it.");
  m.def("multi_layer_kv_transfer", &lmcache::multi_layer_kv_transfer,
        "Copy the tokens named by slot_mapping between every layer's paged K/V caches and a "
        "contiguous [2, layers, tokens, hidden] object ([1, layers, tokens, head_size] for MLA). "
        "to_cache=False stores (cache -> obj), True retrieves (obj -> cache); slots < 0 are "
        "skipped.",
        py::arg("obj"), py::arg("key_caches"), py::arg("value_caches"), py::arg("slot_mapping"),
        py::arg("layout"), py::arg("block_size"), py::arg("num_heads"), py::arg("to_cache"),
        py::call_guard<py::gil_scoped_release>());
  m.def("multi_layer_kv_transfer_batch", &lmcache::multi_layer_kv_transfer_batch,
        "multi_layer_kv_transfer for several objects (a request's chunks) against the same "
        "caches, slot_mappings[i] for objs[i]: one parallel loop on the CPU. Every argument is "
        "checked before anything is copied. checksums=True (stores): the payload checksum of "
        "each object (chunk format 5, summed as the kernel writes it), None for an object not "
        "written whole on the CPU (then for all); returns [] otherwise.",
        py::arg("objs"), py::arg("key_caches"), py::arg("value_caches"),
        py::arg("slot_mappings"), py::arg("layout"), py::arg("block_size"), py::arg("num_heads"),
        py::arg("to_cache"), py::arg("checksums") = false, py::call_guard<py::gil_scoped_release>());
  m.def("checksum_sums", &lmcache::checksum_sums,
        "(mixed, plain) sums of the payload checksum (csrc/checksum.h) over a contiguous buffer "
        "that starts at byte first_byte (a multiple of 8) of its payload; sums of pieces add up "
        "mod 2**64.",
        py::arg("buf"), py::arg("first_byte") = 0);
  m.def("checksum_finish", &lmcache::checksum_finish,
        "The payload checksum (u64) of a payload of nbytes bytes from its summed (mixed, plain).",
        py::arg("mixed"), py::arg("plain"), py::arg("nbytes"));
  m.def("layer_kv_transfer_batch", &lmcache::layer_kv_transfer_batch,
        "One layer of multi_layer_kv_transfer_batch: layer `layer` of every whole object "
        "objs[i] ([2, layers, tokens_i, hidden], [1, ...] for MLA with value_cache None) "
        "against that layer's key_cache / value_cache, with no staging copy: one parallel loop "
        "on the CPU. Every argument is checked before anything is copied.",
        py::arg("objs"), py::arg("layer"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mappings"), py::arg("layout"), py::arg("block_size"), py::arg("num_heads"),
        py::arg("to_cache"), py::call_guard<py::gil_scoped_release>());
  m.def("single_layer_kv_transfer", &lmcache::single_layer_kv_transfer,
        "One layer of multi_layer_kv_transfer: obj_layer is [2, tokens, hidden] "
        "([1, tokens, head_size] for MLA, with value_cache None).",
        py::arg("obj_layer"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("layout"), py::arg("block_size"), py::arg("num_heads"),
        py::arg("to_cache"), py::call_guard<py::gil_scoped_release>());
}
