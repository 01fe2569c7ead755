// wfpass::packed_linear's CPU kernel in C++: the per-call check and the
// kernel call without Python.
//
// The Python kernel (wfpass/pack/kernel.py) owns the packed copies, decides
// which kernel each row count runs and makes copies again when a parameter
// changed. After each call it hands this file what it decided
// (wfpass::_pack_put): the kernel for (site, M, weight set), a *weak* reference to the
// packed copy, and what the copy was made from (the members' addresses and
// version counters, a sample of the weight's bits). A later call with the
// same site, M and weight set checks exactly what the Python kernel checks and, when
// all of it holds, runs the kernel here; anything else (a new M, a changed
// parameter, a copy Python dropped, members no longer one block, a call
// that needs autograd) goes to the Python kernel (wfpass::packed_linear_slow),
// so there is one source of truth for every decision.
//
// Built and loaded by wfpass/native/__init__.py. Checked on torch 2.13.0.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory_resource>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "linear/direct.h"
#include "rnn/fast_rnn.h"
#include "common/weight_sample.h"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

#include "wfpass_schemas.h"  // the ops' schemas, written by the build from wfpass/native/schemas.py

namespace {

// The entries below live on pages of their own, not on malloc's heap. One
// is made per site and new row count, a few small blocks each, in between
// the large outputs a prefill of varied lengths allocates and frees: on
// glibc's heap each such block kept the freed pages around it from going
// back to the system (RSS before malloc_trim grew ~0.3 MB per new length
// on the bench decoder, 130.6 MB against 50.6 MB with the Python kernel
// alone after 70 lengths). A pool over mmap'd chunks keeps them together.
class PageResource final : public std::pmr::memory_resource {
  void* do_allocate(size_t bytes, size_t align) override {
#if defined(__unix__) || defined(__APPLE__)
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
#else
    return std::pmr::new_delete_resource()->allocate(bytes, align);
#endif
  }
  void do_deallocate(void* p, size_t bytes, size_t align) override {
#if defined(__unix__) || defined(__APPLE__)
    munmap(p, bytes);
#else
    std::pmr::new_delete_resource()->deallocate(p, bytes, align);
#endif
  }
  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }
};

std::pmr::memory_resource* entry_pages() {
  // Never destroyed: the tables below are namespace-scope statics, destroyed
  // at exit after any function-local static, and free into this pool then.
  static auto* pool = new std::pmr::synchronized_pool_resource(
      std::pmr::pool_options{0, 4096}, new PageResource());
  return pool;
}

// A stateless allocator over entry_pages(), so the containers below move and
// compare as with std::allocator.
template <class T>
struct OwnPages {
  using value_type = T;
  OwnPages() = default;
  template <class U>
  OwnPages(const OwnPages<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(entry_pages()->allocate(n * sizeof(T), alignof(T))); }
  void deallocate(T* p, size_t n) { entry_pages()->deallocate(p, n * sizeof(T), alignof(T)); }
};
template <class T, class U>
bool operator==(const OwnPages<T>&, const OwnPages<U>&) { return true; }
template <class T, class U>
bool operator!=(const OwnPages<T>&, const OwnPages<U>&) { return false; }

template <class T>
using Vec = std::vector<T, OwnPages<T>>;
template <class K, class V>
using Map = std::unordered_map<K, V, std::hash<K>, std::equal_to<K>, OwnPages<std::pair<const K, V>>>;

enum Kernel : int64_t { PLAIN = 0, ONEDNN = 1, MKL = 2, BRGEMM = 3, DIRECT = 4 };

// Kernels that read the parameters themselves (no copy to check).
bool copy_free(int64_t kernel) { return kernel == PLAIN || kernel == DIRECT; }

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
  int64_t kernel = PLAIN;
  WeakImpl packed{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  Vec<const void*> ptrs;
  Vec<int64_t> versions;
  int64_t step = 1;  // the sample: every step-th element of the block
  int64_t esize = 0;
  Vec<uint8_t> ref;
};

// Per row count, one entry per weight set, found by the first member's
// address: under regional compilation one graph (one site) runs every
// layer of a model, and each layer's set has its own copy and decision; a
// single entry per row count would send 3 of 4 layers' calls to Python.
constexpr size_t kMaxSets = 1024;  // past this, sets whose copy died go first, then the oldest

struct Site {
  Map<int64_t, Vec<Entry>> by_m;
  int64_t packed_calls = 0, plain_calls = 0, direct_calls = 0;
  int64_t eager_training = -1;  // -1: a compiled graph; 0/1: prepack.training of a wfpass.apply graph
};

std::mutex mu;
Map<int64_t, Site> sites;

// The members as one [rows, ...] block: themselves when there is one
// (contiguous), else proven views of one storage laid end to end
// (contiguous, consecutive addresses), as the layout fuse_linears made.
// Undefined where they are not: the Python kernel concatenates and counts it.
at::Tensor block_of(at::TensorList ts, int64_t rows) {
  if (ts.empty()) return at::Tensor();
  const at::Tensor& t0 = ts[0];
  if (!t0.is_contiguous()) return at::Tensor();
  if (ts.size() == 1) return t0;
  const auto* st = t0.storage().unsafeGetStorageImpl();
  const char* next = static_cast<const char*>(t0.data_ptr());
  int64_t total = 0;
  for (const auto& t : ts) {
    if (!t.is_contiguous() || t.storage().unsafeGetStorageImpl() != st || t.scalar_type() != t0.scalar_type() ||
        static_cast<const char*>(t.data_ptr()) != next)
      return at::Tensor();
    next += t.numel() * t.element_size();
    total += t.size(0);
  }
  if (total != rows) return at::Tensor();
  if (t0.dim() == 1) return t0.as_strided({rows}, {1}, t0.storage_offset());
  const int64_t k = t0.size(1);
  return t0.as_strided({rows, k}, {k, 1}, t0.storage_offset());
}

// Is the copy still what the members hold? Their addresses and version
// counters, and a sample of the block's bits (writes through ``.data``
// bypass the version counter): the Python kernel's check.
bool fresh(const Entry& e, at::TensorList weights, const at::Tensor& block) {
  if (e.ptrs.size() != weights.size()) return false;
  for (size_t i = 0; i < weights.size(); ++i)
    if (weights[i].data_ptr() != e.ptrs[i] || weights[i]._version() != e.versions[i]) return false;
  return wfpass_sample::equal(block, e.step, e.esize, e.ref);
}

bool needs_autograd(const at::Tensor& x, at::TensorList weights) {
  if (!c10::GradMode::is_enabled()) return false;
  if (x.requires_grad()) return true;
  for (const auto& w : weights)
    if (w.requires_grad()) return true;
  return false;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias, int64_t m) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, w, bias, m);
}

// The "brgemm" kernel: oneDNN's small-GEMM ukernel (fast_rnn.cpp) over a
// copy of the weight in panels of 64 columns of W^T. Why beside oneDNN's
// packed linear: the ukernel is made per (shape, row count) too, but
// ~16 KiB of heap each against the 0.56 MiB oneDNN's linear keeps per
// row count, and it skips that op's per-call descriptors (a 384x256
// weight at one row: 7.6 us against 22.3 us, 9.9 us plain; 1 thread, a
// 2-core AMD EPYC with AVX-512, benchmarks/brgemm_kernel.py). float32,
// where fast_loop() is true.

at::Tensor panel_pack_op(const at::Tensor& w) {
  TORCH_CHECK(wfpass_fast::fast_loop(),
              "wfpass::_panel_pack: oneDNN's fp32 ukernel is not available on this CPU or build");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "wfpass::_panel_pack: expected a 2-D float32 CPU weight, got ", w.scalar_type(), " of shape ",
              w.sizes());
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  at::Tensor out = at::empty({wfpass_fast::panels_of(N), K, wfpass_fast::kPanel}, wc.options());
  if (N > 0 && K > 0) wfpass_fast::panel_pack(N, K, wc.const_data_ptr<float>(), K, out.data_ptr<float>());
  return out;
}

at::Tensor panel_linear_op(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                           int64_t n) {
  // Every shape is checked: a malformed call must raise, never read past a buffer.
  TORCH_CHECK(wfpass_fast::fast_loop(),
              "wfpass::_panel_linear: oneDNN's fp32 ukernel is not available on this CPU or build");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == wfpass_fast::kPanel && panels.is_contiguous(),
              "wfpass::_panel_linear: panels must be a contiguous float32 CPU tensor [P, K, ", wfpass_fast::kPanel,
              "], got ", panels.sizes());
  const int64_t K = panels.size(1);
  TORCH_CHECK(n >= 0 && wfpass_fast::panels_of(n) == panels.size(0),
              "wfpass::_panel_linear: ", n, " output features do not fill ", panels.size(0), " panels");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
              "wfpass::_panel_linear: input of shape ", x.sizes(), " and dtype ", x.scalar_type(),
              " for a float32 weight with ", K, " input features");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->numel() == n,
                "wfpass::_panel_linear: bias of ", bias->numel(), " elements for ", n, " output features");
    b = bias->contiguous();
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = y.numel() / std::max<int64_t>(1, n);
  if (M == 0 || n == 0) return y;
  if (K == 0) return b.defined() ? y.copy_(b.expand_as(y)) : y.zero_();
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  wfpass_fast::panel_linear(M, n, K, x2.const_data_ptr<float>(), K, panels.const_data_ptr<float>(),
                            b.defined() ? b.const_data_ptr<float>() : nullptr, y.data_ptr<float>(), n);
  return y;
}

at::Tensor slow(const at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t rows, int64_t site) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("wfpass::packed_linear_slow", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, int64_t, int64_t)>();
  return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), x, weights, biases, rows, site);
}

at::Tensor packed_linear(const at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t rows,
                         int64_t site) {
  if (weights.empty() || weights[0].dim() != 2) return slow(x, weights, biases, rows, site);
  const int64_t k = weights[0].size(1);
  const int64_t m = k ? x.numel() / k : 0;
  if (m <= 0) return slow(x, weights, biases, rows, site);
  const at::Tensor block = block_of(weights, rows);
  if (!block.defined()) return slow(x, weights, biases, rows, site);
  std::optional<at::Tensor> bias;
  if (!biases.empty()) {
    at::Tensor b = block_of(biases, rows);
    if (!b.defined()) return slow(x, weights, biases, rows, site);
    bias = b;
  }
  at::Tensor packed;
  int64_t kernel = -1;  // stays -1 where the Python kernel must answer
  {
    // Decide under the lock, call outside it: the Python kernel hands its
    // decision back through _pack_put, which takes the lock.
    std::lock_guard<std::mutex> g(mu);
    auto s = sites.find(site);
    if (s != sites.end()) {
      Site& st = s->second;
      auto it = st.by_m.find(m);
      const Entry* found = nullptr;
      if (it != st.by_m.end() && !(st.eager_training == 0 && needs_autograd(x, weights))) {
        const void* p0 = weights[0].data_ptr();
        for (const Entry& e : it->second)
          if (!e.ptrs.empty() && e.ptrs[0] == p0) {
            found = &e;
            break;
          }
      }
      if (found != nullptr) {
        const Entry& e = *found;
        if (e.kernel == PLAIN) {
          kernel = PLAIN;
          ++st.plain_calls;
        } else if (e.kernel == DIRECT) {
          kernel = DIRECT;
          ++st.direct_calls;
        } else if (fresh(e, weights, block)) {
          auto p = e.packed.lock();
          if (p) {
            packed = at::Tensor(std::move(p));
            kernel = e.kernel;
            ++st.packed_calls;
          }
        }
      }
    }
  }
  if (kernel < 0) return slow(x, weights, biases, rows, site);
  at::Tensor y;
  if (kernel == DIRECT)
    y = wfpass_direct::linear_op(x, block, bias);
  else if (kernel == BRGEMM)
    y = panel_linear_op(x, packed, bias, rows);
  else if (kernel == ONEDNN)
    y = onednn_linear(x, packed, bias);
  else if (kernel == MKL)
    y = mkl_linear(x, packed, block, bias, m);
  else
    y = at::linear(x, block, bias);
  return y.is_contiguous() ? y : y.contiguous();
}

// What the Python kernel decided for (site, M): the kernel, and for a packed
// one the copy and what it was made from (read off the members now, right
// after the Python kernel checked or made the copy).
void pack_put(int64_t site, int64_t m, int64_t kernel, const std::optional<at::Tensor>& packed,
              at::TensorList weights, int64_t rows, int64_t sample, int64_t eager_training) {
  if (weights.empty()) return;
  Entry e;
  e.kernel = kernel;
  // Every entry knows its weight set (the first address finds it); a
  // plain or direct one needs nothing more: it reads whatever the
  // parameters hold (packed_linear checks they are still one block).
  e.ptrs.push_back(weights[0].data_ptr());
  if (!copy_free(kernel)) {
    const at::Tensor block = block_of(weights, rows);
    if (!packed.has_value() || !block.defined()) return;  // the Python kernel keeps answering
    e.packed = WeakImpl(packed->getIntrusivePtr());
    e.ptrs.clear();
    for (const auto& w : weights) {
      e.ptrs.push_back(w.data_ptr());
      e.versions.push_back(w._version());
    }
    e.esize = block.element_size();
    e.step = std::max<int64_t>(1, block.numel() / sample);
    wfpass_sample::take(block, e.step, e.esize, e.ref);
  }
  std::lock_guard<std::mutex> g(mu);
  Site& st = sites[site];
  st.eager_training = eager_training;
  Vec<Entry>& sets = st.by_m[m];
  for (Entry& old : sets)
    if (old.ptrs[0] == e.ptrs[0]) {
      old = std::move(e);
      return;
    }
  if (sets.size() >= kMaxSets) {
    sets.erase(std::remove_if(sets.begin(), sets.end(),
                              [](const Entry& x) { return !copy_free(x.kernel) && x.packed.expired(); }),
               sets.end());
    if (sets.size() >= kMaxSets) sets.erase(sets.begin());
  }
  sets.push_back(std::move(e));
}

// The calls the C++ kernel counted since the last time, as [packed, plain,
// direct]; zeroed.
std::vector<int64_t> pack_take_counts(int64_t site) {
  std::lock_guard<std::mutex> g(mu);
  auto s = sites.find(site);
  if (s == sites.end()) return {0, 0, 0};
  std::vector<int64_t> out{s->second.packed_calls, s->second.plain_calls, s->second.direct_calls};
  s->second.packed_calls = s->second.plain_calls = s->second.direct_calls = 0;
  return out;
}

// Forget a site's entries: its graph died, or a copy was dropped.
void pack_forget(int64_t site) {
  std::lock_guard<std::mutex> g(mu);
  sites.erase(site);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def(WFPASS_SCHEMA_pack_put,
        pack_put);
  m.def(WFPASS_SCHEMA_pack_take_counts, pack_take_counts);
  m.def(WFPASS_SCHEMA_pack_forget, pack_forget);
  m.def(WFPASS_SCHEMA_panel_pack);
  m.def(WFPASS_SCHEMA_panel_linear);
}

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_train", packed_linear);
  m.impl("_panel_pack", panel_pack_op);
  m.impl("_panel_linear", panel_linear_op);
}
