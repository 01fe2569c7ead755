// CPU kernels of wfpass's one-op-per-layer RNN ops, in C++: the same ATen
// calls as their Python kernels (wfpass/rnn/cpu/lstm_layer.py,
// wfpass/rnn/cpu/native_layer.py), without Python's ~20 us a call. The schemas,
// fake implementations and gradient formulas stay in Python; these are
// registered for the CPU key, which takes precedence over the Python
// kernels' CompositeExplicitAutograd registration.
//
// Checked on torch 2.13.0.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/weight_sample.h"
#include "short_lstm.h"
#include "wfpass_schemas.h"  // the ops' schemas, written by the build from wfpass/native/schemas.py

namespace {

using at::Tensor;
using Opt = std::optional<Tensor>;

// The zero state [1, B, H], made here rather than in the graph (a zeros
// kernel Inductor would compile); one tensor serves both states: the
// kernels only read them.
Tensor zero_state(const Tensor& input, int64_t hidden) {
  return at::zeros({1, input.size(1), hidden}, input.options());
}

// ---- An inference call's weights in oneDNN's own layout ----------------------
//
// ATen's oneDNN LSTM layer reorders both weights into oneDNN's layout on
// every call it gets plain weights (tens of microseconds at the sizes RNNs
// run); given weights already in that layout (torch's
// mkldnn::_reorder_mkldnn_rnn_layer_weight, what Inductor's freezing uses) it
// skips the reorder. The Python side (wfpass/rnn/cpu/lstm_pack.py) owns the
// copies, decides which weight pairs may have one (the budget, the report)
// and makes them; it hands each decision here (wfpass::_lstm_pack_put): a
// *weak* reference to the copy and what it was made from (the weight
// tensors themselves, weakly, their version counters, a sample of their bits). An inference call
// whose pair has an entry that still holds runs from the copy; a pair never
// seen, a changed weight or a dropped copy goes to Python
// (wfpass::_lstm_pack_ask), which answers through _lstm_pack_put: one
// source of truth for every decision, as pack.cpp does for linears.
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct PairKey {
  const void* ih;
  const void* hh;
  bool reverse;
  bool operator==(const PairKey& o) const { return ih == o.ih && hh == o.hh && reverse == o.reverse; }
};

struct PairHash {
  size_t operator()(const PairKey& k) const {
    return std::hash<const void*>()(k.ih) * 31 + std::hash<const void*>()(k.hh) * 7 + k.reverse;
  }
};

struct PairEntry {
  int64_t id = 0;  // Python's pair id (0: a pair Python keeps plain)
  // The weight tensors the answer is for: an answer holds only while they
  // live. Addresses alone are not enough: a model made after another one
  // died gets its weights' addresses, and (same seed) their bits.
  WeakImpl self_ih{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  WeakImpl self_hh{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  const c10::TensorImpl* raw_ih = nullptr;
  const c10::TensorImpl* raw_hh = nullptr;
  WeakImpl p_ih{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  WeakImpl p_hh{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  int64_t v_ih = -1, v_hh = -1;
  int64_t step_ih = 1, step_hh = 1, esize = 0;
  std::vector<uint8_t> ref_ih, ref_hh;
};

// Past this many pairs (a process that keeps making models), the ones whose
// copy died and the plain ones go first.
constexpr size_t kMaxPairs = 4096;

std::mutex pack_mu;
std::unordered_map<PairKey, PairEntry, PairHash> pairs;
std::unordered_map<int64_t, int64_t> packed_calls;  // pair id -> calls since the last read

// The weights as plain contiguous float32 / bfloat16 tensors on the CPU:
// the only ones this path serves (a copy is made from their bytes; Python
// allows a pair only where oneDNN's LSTM runs its dtype).
bool servable(const Tensor& w) {
  return w.defined() && w.device().is_cpu() && w.layout() == at::kStrided && w.is_contiguous() &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16);
}

bool holds(const PairEntry& e, const Tensor& w_ih, const Tensor& w_hh) {
  // A live tensor at the address the weak reference's (live) target has is that target.
  if (e.raw_ih != w_ih.unsafeGetTensorImpl() || e.raw_hh != w_hh.unsafeGetTensorImpl() || e.self_ih.expired() ||
      e.self_hh.expired())
    return false;
  return w_ih._version() == e.v_ih && w_hh._version() == e.v_hh &&
         wfpass_sample::equal(w_ih, e.step_ih, e.esize, e.ref_ih) && wfpass_sample::equal(w_hh, e.step_hh, e.esize, e.ref_hh);
}

// The copy for this call's pair, or undefined tensors (the plain weights);
// asks Python once where nothing here answers.
std::pair<Tensor, Tensor> packed_pair(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, bool reverse,
                                      int64_t hidden_size, bool has_biases) {
  if (!servable(w_ih) || !servable(w_hh) || input.scalar_type() != w_ih.scalar_type() ||
      w_hh.scalar_type() != w_ih.scalar_type())
    return {};
  const PairKey key{w_ih.data_ptr(), w_hh.data_ptr(), reverse};
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard<std::mutex> g(pack_mu);
      auto it = pairs.find(key);
      if (it != pairs.end() && holds(it->second, w_ih, w_hh)) {
        const PairEntry& e = it->second;
        if (e.id == 0) return {};
        auto a = e.p_ih.lock();
        auto b = e.p_hh.lock();
        if (a && b) {
          ++packed_calls[e.id];
          return {Tensor(std::move(a)), Tensor(std::move(b))};
        }
      }
    }
    if (attempt == 1) break;
    // Asked outside the lock: Python answers through _lstm_pack_put. A C++
    // program running an exported package has no Python to answer (the op
    // is defined there, with no kernel: examples/export_cpp): the plain
    // weights, as for a pair Python decided not to copy.
    static auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("wfpass::_lstm_pack_ask", "");
    if (!handle.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !handle.hasKernelForDispatchKey(c10::DispatchKey::CPU))
      return {};
    static auto ask = handle.typed<void(const Tensor&, const Tensor&, const Tensor&, bool, int64_t, bool)>();
    ask.call(input, w_ih, w_hh, reverse, hidden_size, has_biases);
  }
  return {};
}

// Python's answer for a pair: its copy (p_ih, p_hh) with the pair's id, or
// none (id 0: this pair runs on its plain weights until a weight changes).
void lstm_pack_put(int64_t id, const Tensor& w_ih, const Tensor& w_hh, bool reverse, const Opt& p_ih,
                   const Opt& p_hh, int64_t sample) {
  if (!servable(w_ih) || !servable(w_hh)) return;
  PairEntry e;
  e.id = (p_ih.has_value() && p_hh.has_value()) ? id : 0;
  if (e.id != 0) {
    e.p_ih = WeakImpl(p_ih->getIntrusivePtr());
    e.p_hh = WeakImpl(p_hh->getIntrusivePtr());
  }
  e.self_ih = WeakImpl(w_ih.getIntrusivePtr());
  e.self_hh = WeakImpl(w_hh.getIntrusivePtr());
  e.raw_ih = w_ih.unsafeGetTensorImpl();
  e.raw_hh = w_hh.unsafeGetTensorImpl();
  e.v_ih = w_ih._version();
  e.v_hh = w_hh._version();
  e.esize = w_ih.element_size();
  e.step_ih = std::max<int64_t>(1, w_ih.numel() / std::max<int64_t>(1, sample));
  e.step_hh = std::max<int64_t>(1, w_hh.numel() / std::max<int64_t>(1, sample));
  wfpass_sample::take(w_ih, e.step_ih, e.esize, e.ref_ih);
  wfpass_sample::take(w_hh, e.step_hh, e.esize, e.ref_hh);
  std::lock_guard<std::mutex> g(pack_mu);
  if (pairs.size() >= kMaxPairs) {
    for (auto it = pairs.begin(); it != pairs.end();)
      it = (it->second.id == 0 || it->second.p_ih.expired() || it->second.self_ih.expired()) ? pairs.erase(it)
                                                                                             : std::next(it);
  }
  pairs[PairKey{w_ih.data_ptr(), w_hh.data_ptr(), reverse}] = std::move(e);
}

// The packed calls of these pairs since the last read; zeroed.
int64_t lstm_pack_take_calls(at::IntArrayRef ids) {
  std::lock_guard<std::mutex> g(pack_mu);
  int64_t n = 0;
  for (int64_t id : ids) {
    auto it = packed_calls.find(id);
    if (it != packed_calls.end()) {
      n += it->second;
      it->second = 0;
    }
  }
  return n;
}

// Forget a pair: its weights died, its copy was dropped, or the budget grew
// (a refused pair is asked again).
void lstm_pack_forget(int64_t id, const std::optional<Tensor>& w_ih, const std::optional<Tensor>& w_hh) {
  std::lock_guard<std::mutex> g(pack_mu);
  for (auto it = pairs.begin(); it != pairs.end();) {
    const bool same_ptrs = w_ih.has_value() && w_hh.has_value() && it->first.ih == w_ih->data_ptr() &&
                           it->first.hh == w_hh->data_ptr();
    it = ((id != 0 && it->second.id == id) || same_ptrs) ? pairs.erase(it) : std::next(it);
  }
  if (id != 0) packed_calls.erase(id);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh,
                                                      const Tensor& b_ih, const Tensor& b_hh, const Opt& hx,
                                                      const Opt& cx, bool reverse, int64_t hidden_size,
                                                      bool has_biases, bool train) {
  // A short inference call (T x batch <= 16 rows) runs wfpass's C++ loop
  // (short_lstm.h says why and what was measured).
  if (!train && wfpass_varlen::takes_short_lstm(input, w_hh, hidden_size)) {
    auto r = wfpass_varlen::short_lstm(input, w_ih, w_hh, has_biases ? Opt(b_ih) : Opt(), has_biases ? Opt(b_hh) : Opt(),
                                       hx, cx, reverse);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), at::empty({0}, input.options().dtype(at::kByte))};
  }
  // Inference: from the pair's copy in oneDNN's layout where it has one.
  // Training reads the parameters (the backward differentiates them, and
  // an optimizer step would make every copy stale).
  std::pair<Tensor, Tensor> packed;
  if (!train) packed = packed_pair(input, w_ih, w_hh, reverse, hidden_size, has_biases);
  const Tensor& wi = packed.first.defined() ? packed.first : w_ih;
  const Tensor& wh = packed.second.defined() ? packed.second : w_hh;
  Tensor zero;
  if (!hx.has_value() || !cx.has_value()) zero = zero_state(input, hidden_size);
  const Tensor& h = hx.has_value() ? *hx : zero;
  const Tensor& c = cx.has_value() ? *cx : zero;
  // oneDNN returns its workspace only with grad mode on. The call goes to
  // the kernel below autograd: with grad mode on, ATen's autograd kernel
  // would record a graph (a MkldnnRnnLayerBackward0 node saving eleven
  // tensors) for inputs that require grad, which no one differentiates:
  // the op is functional, its gradient is wfpass::lstm_layer_backward.
  c10::AutoGradMode grad(train);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto r = at::mkldnn_rnn_layer(input, wi, wh, b_ih, b_hh, h, c, reverse, {}, /*mode=*/2, hidden_size,
                                /*num_layers=*/1, has_biases, /*bidirectional=*/false, /*batch_first=*/false, train);
  Tensor ws = std::get<3>(r);
  if (!ws.defined() || !train) ws = at::empty({0}, input.options().dtype(at::kByte));
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), ws};
}

using Grads7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Grads6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Grads7 lstm_layer_backward(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const Tensor& b_ih,
                           const Tensor& b_hh, const Opt& hx, const Opt& cx, const Tensor& output, const Tensor& hy,
                           const Tensor& cy, const Opt& grad_output, const Opt& grad_hy, const Opt& grad_cy,
                           bool reverse, int64_t hidden_size, bool has_biases, const Tensor& workspace) {
  Tensor zero;
  if (!hx.has_value() || !cx.has_value()) zero = zero_state(input, hidden_size);
  const Tensor& h = hx.has_value() ? *hx : zero;
  const Tensor& c = cx.has_value() ? *cx : zero;
  auto g = at::mkldnn_rnn_layer_backward(input, w_ih, w_hh, b_ih, b_hh, h, c, output, hy, cy, grad_output, grad_hy,
                                         grad_cy, reverse, /*mode=*/2, hidden_size, /*num_layers=*/1, has_biases,
                                         /*train=*/true, /*bidirectional=*/false, {}, /*batch_first=*/false, workspace);
  // The op's outputs keep its fake's promise (empty_like: dtype and strides
  // of each input) and alias nothing: oneDNN returns some bf16 gradients in
  // float32 (the input's, torch 2.13.0), so copy only where a rule breaks.
  Tensor gs[7] = {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g),
                  std::get<4>(g), std::get<5>(g), std::get<6>(g)};
  const Tensor* refs[7] = {&input, &w_ih, &w_hh, &b_ih, &b_hh, &h, &c};
  const void* seen[7];
  for (int i = 0; i < 7; ++i) {
    const Tensor& ref = *refs[i];
    Tensor& gi = gs[i];
    if (!gi.defined()) {
      gi = at::zeros_like(ref);
    } else {
      bool shared = false;
      for (int j = 0; j < i; ++j) shared |= gi.storage().data() == seen[j];
      if (gi.scalar_type() != ref.scalar_type() || gi.strides() != ref.strides() || shared)
        gi = at::empty_like(ref).copy_(gi);
    }
    seen[i] = gi.storage().data();
  }
  return {gs[0], gs[1], gs[2], gs[3], gs[4], gs[5], gs[6]};
}

// A forward-ordered GRU layer (PyTorch's nn.GRUCell formulas): the input
// projection of every step as one GEMM, then per step one recurrent GEMM
// and the gate math in five vectorized ATen calls (ATen's own CPU loop,
// at::gru, spends about a dozen per step; at small batch and hidden sizes
// those calls, not the GEMMs, are most of its time). Returns out [T, B, H];
// the last state is out[T - 1].
Tensor gru_forward(const Tensor& x, const Tensor& w_ih, const Tensor& w_hh, const Opt& b_ih, const Opt& b_hh,
                   const Tensor& h0) {
  const int64_t T = x.size(0), B = x.size(1), I = x.size(2), H = w_hh.size(1);
  const Tensor x2 = x.reshape({T * B, I});
  Tensor gi = (b_ih.has_value() ? at::addmm(*b_ih, x2, w_ih.t()) : at::mm(x2, w_ih.t())).view({T, B, 3 * H});
  // b_hh's reset and update parts enter only through r and z's sums: added
  // to every step's input gates once, so each step's GEMM needs no bias
  // (addmm would copy the bias into its output first, every step).
  if (b_hh.has_value()) gi.narrow(2, 0, 2 * H).add_(b_hh->narrow(0, 0, 2 * H));
  const Tensor b_hn = b_hh.has_value() ? b_hh->narrow(0, 2 * H, H) : Tensor();
  Tensor out = at::empty({T, B, H}, x.options());
  Tensor gh = at::empty({B, 3 * H}, x.options());
  Tensor rz = at::empty({B, 2 * H}, x.options());
  Tensor n = at::empty({B, H}, x.options());
  // Views made once: slicing is a dispatcher call each time.
  const Tensor gh_rz = gh.narrow(1, 0, 2 * H), gh_n = gh.narrow(1, 2 * H, H);
  const Tensor r = rz.narrow(1, 0, H), z = rz.narrow(1, H, H);
  const Tensor gi_rz = gi.narrow(2, 0, 2 * H), gi_n = gi.narrow(2, 2 * H, H);
  const Tensor w_hh_t = w_hh.t();
  Tensor h = h0.reshape({B, H});
  for (int64_t t = 0; t < T; ++t) {
    at::mm_out(gh, h, w_hh_t);
    at::add_out(rz, gi_rz.select(0, t), gh_rz);
    rz.sigmoid_();
    if (b_hn.defined()) gh_n.add_(b_hn);
    at::addcmul_out(n, gi_n.select(0, t), r, gh_n);
    n.tanh_();
    Tensor h_new = out.select(0, t);
    at::lerp_out(h_new, n, h, z);  // (1 - z) * n + z * h
    h = h_new;
  }
  return out;
}

std::tuple<Tensor, Tensor> rnn_layer(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const Opt& b_ih,
                                     const Opt& b_hh, const Opt& hx, c10::string_view mode, bool reverse) {
  const int64_t H = w_hh.size(1);
  const Tensor h0 = hx.has_value() ? *hx : zero_state(input, H);
  const bool bias = b_ih.has_value();
  const Tensor x = reverse ? input.flip(0) : input;
  std::tuple<Tensor, Tensor> r;
  const auto dtype = input.scalar_type();
  bool same_dtype = h0.scalar_type() == dtype && w_ih.scalar_type() == dtype && w_hh.scalar_type() == dtype;
  if (bias) same_dtype = same_dtype && b_ih->scalar_type() == dtype && b_hh->scalar_type() == dtype;
  if (mode == "GRU" && (dtype == at::kFloat || dtype == at::kDouble) && same_dtype && input.size(0) > 0) {
    // Half types keep ATen's kernel: its gate math rounds after every op,
    // and eager bf16/fp16 GRUs are what wfpass's results are checked against.
    // Mixed dtypes go to ATen too, which raises eager's error for them.
    at::NoGradGuard no_grad;
    const Tensor out = gru_forward(x.contiguous(), w_ih.contiguous(), w_hh.contiguous(), b_ih, b_hh, h0);
    r = {out, out.select(0, out.size(0) - 1).unsqueeze(0).clone()};  // its own storage, at offset 0
  } else {
    at::NoGradGuard no_grad;
    std::vector<Tensor> params{w_ih, w_hh};  // ATen's layer kernels take the weights as one list
    if (bias) {
      params.push_back(*b_ih);
      params.push_back(*b_hh);
    }
    if (mode == "GRU")
      r = at::gru(x, h0, params, bias, 1, 0.0, false, false, false);
    else if (mode == "RNN_TANH")
      r = at::rnn_tanh(x, h0, params, bias, 1, 0.0, false, false, false);
    else if (mode == "RNN_RELU")
      r = at::rnn_relu(x, h0, params, bias, 1, 0.0, false, false, false);
    else
      TORCH_CHECK_VALUE(false, "wfpass::rnn_layer: mode must be one of ('GRU', 'RNN_TANH', 'RNN_RELU'), got '",
                        mode, "'");
  }
  Tensor out = std::get<0>(r), hy = std::get<1>(r);
  if (reverse) out = out.flip(0);  // a copy: flip never aliases
  // Outputs may not alias each other or an input (torch.library's rule).
  if (hy.storage().data() == out.storage().data()) hy = hy.clone();
  return {out.contiguous(), hy};
}

// The sequential part of a GRU layer's backward (wfpass/rnn/cpu/native_layer.py,
// _gates_backward): the same ATen ops in the same order as its Python loop,
// so the same numbers, without Python's cost per op (four to five ops a
// step, each ~3 us from Python at small sizes). Every factor that does not
// depend on the incoming gradient (k_h [T, B, 3, H], z [T, B, H]) is
// computed before, for all steps at once. Returns (dL/d recurrent gates,
// dL/dh per step, dL/dh0).
std::tuple<Tensor, Tensor, Tensor> gru_grad_loop(const Tensor& k_h, const Tensor& z, const Tensor& w_hh,
                                                 const Opt& grad_output, const Opt& grad_hy) {
  const int64_t T = k_h.size(0), B = k_h.size(1), H = k_h.size(3);
  Tensor dgh = at::empty_like(k_h, at::MemoryFormat::Contiguous);
  Tensor dh_all = at::empty({T, B, H}, k_h.options());
  Tensor carry = grad_hy.has_value() ? grad_hy->select(0, 0) : at::zeros({B, H}, k_h.options());
  for (int64_t t = T - 1; t >= 0; --t) {
    Tensor dh = dh_all.select(0, t);
    if (grad_output.has_value())
      at::add_out(dh, grad_output->select(0, t), carry);
    else
      dh.copy_(carry);
    Tensor dg = dgh.select(0, t);
    at::mul_out(dg, dh.unsqueeze(1), k_h.select(0, t));
    carry = at::addmm(dh * z.select(0, t), dg.view({B, 3 * H}), w_hh);
  }
  return {dgh, dh_all, carry};
}

// wfpass::rnn_layer_backward (wfpass/rnn/cpu/native_layer.py, _rnn_layer_backward
// and the _gates_backward / _plain_backward it calls): the same ATen calls in
// the same order, so the same bits, without Python's cost per call (some
// forty calls a layer, ~90 us of a GRU layer's backward at T 4, batch 4,
// hidden 64; benchmarks/host_cost.py). A GRU's gates are recomputed for
// every step at once from ``output`` shifted by one step; the sequential
// part is gru_grad_loop.
Grads6 rnn_layer_backward(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const Opt& b_ih,
                          const Opt& b_hh, const Opt& hx, const Tensor& output, const Opt& grad_output,
                          const Opt& grad_hy, c10::string_view mode, bool reverse) {
  const bool gru = mode == "GRU", relu = mode == "RNN_RELU";
  TORCH_CHECK_VALUE(gru || relu || mode == "RNN_TANH",
                    "wfpass::rnn_layer: mode must be one of ('GRU', 'RNN_TANH', 'RNN_RELU'), got '", mode, "'");
  const int64_t T = input.size(0), B = input.size(1), I = input.size(2), H = w_hh.size(1);
  const Tensor h0 = hx.has_value() ? *hx : zero_state(input, H);
  Tensor x = input, out = output;
  Opt gout = grad_output;
  if (reverse) {  // a reversed layer is the forward recurrence over the flipped sequence
    x = x.flip(0);
    out = out.flip(0);
    if (gout.has_value()) gout = gout->flip(0);
  }
  const Tensor h_prev = at::cat({h0, out.slice(0, 0, -1)}, 0);  // the state each step read
  Tensor dgi, dgh, dh0;
  if (gru) {
    const Tensor gi = at::linear(x, w_ih, b_ih).view({T, B, 3, H});
    const Tensor gh = at::linear(h_prev, w_hh, b_hh).view({T, B, 3, H});
    const Tensor gh_n = gh.select(2, 2);
    const Tensor r = at::sigmoid(gi.select(2, 0) + gh.select(2, 0));
    const Tensor z = at::sigmoid(gi.select(2, 1) + gh.select(2, 1));
    const Tensor n = at::tanh(gi.select(2, 2) + r * gh_n);
    const Tensor a_n = at::rsub(z, 1) * at::rsub(n * n, 1);  // through n
    const Tensor k_r = a_n * gh_n * r * at::rsub(r, 1);
    const Tensor k_z = (h_prev - n) * z * at::rsub(z, 1);
    const Tensor k_h = at::stack({k_r, k_z, a_n * r}, 2);  // recurrent side: n's part is scaled by r
    auto loop = gru_grad_loop(k_h, z, w_hh, gout, grad_hy);
    Tensor dgh4 = std::get<0>(loop), dh_all = std::get<1>(loop);
    dh0 = std::get<2>(loop);
    Tensor dgi4 = dgh4.clone();
    Tensor dgi_n = dgi4.select(2, 2);
    at::mul_out(dgi_n, dh_all, a_n);
    dgi = dgi4.view({T * B, 3 * H});
    dgh = dgh4.view({T * B, 3 * H});
  } else {
    const Tensor d_act = relu ? at::gt(out, 0).to(out.scalar_type()) : at::rsub(out * out, 1);
    Tensor dpre = at::empty_like(out);
    Tensor carry = grad_hy.has_value() ? grad_hy->select(0, 0) : at::zeros({B, H}, out.options());
    for (int64_t t = T - 1; t >= 0; --t) {
      const Tensor dh = gout.has_value() ? gout->select(0, t) + carry : carry;
      Tensor dpre_t = dpre.select(0, t);
      at::mul_out(dpre_t, dh, d_act.select(0, t));
      carry = at::mm(dpre_t, w_hh);
    }
    dh0 = carry;
    dgi = dgh = dpre.view({T * B, H});
  }
  Tensor dx = at::mm(dgi, w_ih).view({T, B, I});
  if (reverse) dx = dx.flip(0);
  Tensor dw_ih = at::mm(dgi.t(), x.reshape({T * B, I}));
  Tensor dw_hh = at::mm(dgh.t(), h_prev.reshape({T * B, H}));
  Tensor db_ih, db_hh;
  if (b_ih.has_value()) {
    db_ih = dgi.sum(0);
    db_hh = dgh.sum(0);
  } else {  // no biases: empty placeholders (the autograd formula returns None for them)
    db_ih = at::empty({0}, input.options());
    db_hh = at::empty({0}, input.options());
  }
  return {dx.contiguous(), dw_ih, dw_hh, db_ih, db_hh, dh0.unsqueeze(0).clone()};
}

}  // namespace

// Called only inside wfpass::rnn_layer_backward's kernel (never traced, so
// no fake implementation).
TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def(WFPASS_SCHEMA_lstm_pack_put,
        lstm_pack_put);
  m.def(WFPASS_SCHEMA_lstm_pack_take_calls, lstm_pack_take_calls);
  m.def(WFPASS_SCHEMA_lstm_pack_forget, lstm_pack_forget);
  m.def(WFPASS_SCHEMA_gru_grad_loop,
        gru_grad_loop);
}

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("lstm_layer", lstm_layer);
  m.impl("lstm_layer_fw", lstm_layer);
  m.impl("lstm_layer_backward", lstm_layer_backward);
  m.impl("rnn_layer", rnn_layer);
  m.impl("rnn_layer_fw", rnn_layer);
  m.impl("rnn_layer_backward", rnn_layer_backward);
}
