// wfpass::cudnn_rnn's and wfpass::cudnn_packed_rnn's CUDA kernels in C++
// (the ops, their `_fw` twins and their backwards): the per-call work of the
// Python bodies in wfpass/rnn/cuda/cudnn.py and cudnn_packed.py, which cost
// 110-130 us of host time per call on an H200's host (torch 2.11) against
// about 40 us for eager's whole `aten::lstm`. Per call they find the flat
// buffer the weights are views of, fill the zero states, call ATen's cuDNN
// RNN, and hand the weights' gradients on as one view of cuDNN's gradient
// buffer; the same steps, in the same order, as the Python bodies.
//
// No CUDA headers or toolkit are needed: ATen's `_cudnn_rnn` and
// `_cudnn_rnn_backward` are reached through the dispatcher, and the kernels
// are registered for the CUDA key, so the library builds the same against a
// CPU-only torch (where nothing ever dispatches to them).
//
// What they leave to the Python bodies (registered as
// wfpass::_cudnn_rnn_python and the like, called here through the
// dispatcher): dropout between layers in training, which needs the dropout
// state the Python side keeps per device and reseeds after
// `torch.manual_seed`; and weights that lost cuDNN's layout (a `.data`
// swap), which need flattened copies, as eager makes them.
//
// `_cudnn_flat_buffer` and `_cudnn_grad_buffer` expose the two pointer
// checks on any device, so tests check them against the Python rules on the
// CPU, where no GPU is at hand; `_cudnn_python_bodies` calls the Python
// bodies as the kernels do.
//
// Built and loaded by wfpass/native/__init__.py. Checked on torch
// 2.13.0 (CPU) and 2.15.0 (CUDA 13.2 build).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <utility>
#include <vector>
#include "wfpass_schemas.h"  // the ops' schemas, written by the build from wfpass/native/schemas.py

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Out4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

constexpr int64_t kLstm = 2;  // cuDNN's mode numbers: RNN_RELU 0, RNN_TANH 1, LSTM 2, GRU 3

int64_t weights_per_layer(size_t n, int64_t num_layers, bool bidirectional) {
  return static_cast<int64_t>(n) / (num_layers * (bidirectional ? 2 : 1));
}

// The 1-D buffer the weights are views of, when each sits at its offset in
// cuDNN's layout, contiguous, in one storage and one dtype; else an
// undefined tensor. `offsets`: each weight's element offset from the
// buffer's start, then (optionally) the buffer's size, which can end past
// every weight (cuDNN 9 keeps the bias space of an RNN without biases).
// The rule of cudnn.py's `flat_buffer`.
Tensor flat_buffer(at::TensorList weights, at::IntArrayRef offsets) {
  if (weights.empty() || (offsets.size() != weights.size() && offsets.size() != weights.size() + 1)) return {};
  const Tensor& w0 = weights[0];
  const void* ptr = w0.storage().data();
  const int64_t base = w0.storage_offset() - offsets[0];
  int64_t end = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    if (w.storage().data() != ptr || !w.is_contiguous() || w.scalar_type() != w0.scalar_type() ||
        w.storage_offset() - base != offsets[i])
      return {};
    end = std::max(end, offsets[i] + w.numel());
  }
  if (offsets.size() > weights.size()) end = std::max(end, offsets.back());
  if (base < 0 || (base + end) * static_cast<int64_t>(w0.element_size()) >
                      static_cast<int64_t>(w0.storage().nbytes()))
    return {};
  return at::empty({0}, w0.options()).set_(w0.storage(), base, {end}, {1});
}

// Elements of the flat buffer and of its gradient buffer (cudnn_grads.py's
// `buffer_numel`).
int64_t buffer_numel(at::TensorList weights, at::IntArrayRef offsets) {
  if (offsets.size() > weights.size()) return offsets.back();
  int64_t n = 0;
  if (!offsets.empty()) {
    for (size_t i = 0; i < weights.size() && i < offsets.size(); ++i) n = std::max(n, offsets[i] + weights[i].numel());
    return n;
  }
  for (const Tensor& w : weights) n += w.numel();
  return n;
}

// The weights' gradients as one buffer in the flat buffer's layout
// (cudnn_grads.py's `grad_buffer`): `_cudnn_rnn_backward` writes them into
// one buffer laid out like the weights' and returns views of it, so that
// buffer is the answer, no copy; only views that are not at their offsets
// (never seen) or missing ones are copied into a new buffer.
Tensor grad_buffer(const std::vector<Tensor>& dw, at::TensorList weights, at::IntArrayRef offsets,
                   const Tensor& like) {
  const int64_t n = buffer_numel(weights, offsets);
  bool complete = !dw.empty() && offsets.size() >= dw.size();
  for (const Tensor& g : dw) complete = complete && g.defined();
  if (complete) {
    const Tensor& g0 = dw[0];
    const void* ptr = g0.storage().data();
    const int64_t base = g0.storage_offset() - offsets[0];
    bool in_place = base >= 0 && (base + n) * static_cast<int64_t>(g0.element_size()) <=
                                     static_cast<int64_t>(g0.storage().nbytes());
    for (size_t i = 0; in_place && i < dw.size(); ++i)
      in_place = dw[i].storage().data() == ptr && dw[i].is_contiguous() && dw[i].storage_offset() - base == offsets[i];
    if (in_place) return at::empty({0}, g0.options()).set_(g0.storage(), base, {n}, {1});
  }
  Tensor out = at::zeros({n}, like.options());
  for (size_t i = 0; i < dw.size() && i < offsets.size(); ++i)
    if (dw[i].defined()) out.narrow(0, offsets[i], dw[i].numel()).copy_(dw[i].reshape(-1));
  return out;
}

// `hx` / `cx` with a zero state of `batch` sequences for each missing one
// (cuDNN needs both for an LSTM, `hx` for the others).
std::pair<Tensor, OptTensor> states(const Tensor& like, int64_t batch, const OptTensor& hx, const OptTensor& cx,
                                    int64_t mode, int64_t hidden_size, int64_t proj_size, int64_t num_layers,
                                    bool bidirectional) {
  const int64_t lb = num_layers * (bidirectional ? 2 : 1);
  Tensor h = hx.has_value() && hx->defined() ? *hx
                                             : at::zeros({lb, batch, proj_size ? proj_size : hidden_size}, like.options());
  OptTensor c = cx.has_value() && cx->defined() ? cx : std::nullopt;
  if (!c.has_value() && mode == kLstm) c = at::zeros({lb, batch, hidden_size}, like.options());
  return {h, c};
}

Out4 forward(const Tensor& x, at::IntArrayRef batch_sizes, int64_t batch, at::TensorList weights, const Tensor& buf,
             const OptTensor& hx, const OptTensor& cx, int64_t mode, int64_t hidden_size, int64_t proj_size,
             int64_t num_layers, bool train, bool bidirectional) {
  auto [h, c] = states(x, batch, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional);
  auto r = at::_cudnn_rnn(x, weights, weights_per_layer(weights.size(), num_layers, bidirectional), buf, h, c, mode,
                          hidden_size, proj_size, num_layers, /*batch_first=*/false, /*dropout=*/0.0, train,
                          bidirectional, batch_sizes, /*dropout_state=*/std::nullopt);
  Tensor cy = std::get<2>(r);
  if (!cy.defined() || mode != kLstm) cy = at::empty({0}, x.options());
  Tensor reserve = train ? std::get<3>(r) : at::empty({0}, x.options().dtype(at::kByte));
  return {std::get<0>(r), std::get<1>(r), cy, reserve};
}

Out4 backward(const Tensor& x, at::IntArrayRef batch_sizes, int64_t batch, at::TensorList weights, const Tensor& buf,
              const OptTensor& hx, const OptTensor& cx, const Tensor& output, const OptTensor& grad_output,
              const OptTensor& grad_hy, const OptTensor& grad_cy, const Tensor& reserve, int64_t mode,
              int64_t hidden_size, int64_t proj_size, int64_t num_layers, bool bidirectional, at::IntArrayRef offsets,
              std::array<bool, 4> output_mask) {
  auto [h, c] = states(x, batch, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional);
  const Tensor go = grad_output.has_value() && grad_output->defined() ? *grad_output : at::zeros_like(output);
  auto r = at::_cudnn_rnn_backward(x, weights, weights_per_layer(weights.size(), num_layers, bidirectional), buf, h,
                                   c, output, go, grad_hy, grad_cy, mode, hidden_size, proj_size, num_layers,
                                   /*batch_first=*/false, /*dropout=*/0.0, /*train=*/true, bidirectional, batch_sizes,
                                   /*dropout_state=*/std::nullopt, reserve, output_mask);
  Tensor dx = std::get<0>(r), dhx = std::get<1>(r), dcx = std::get<2>(r);
  Tensor flat = grad_buffer(std::get<3>(r), weights, offsets, x);
  if (!dx.defined() || dx.numel() == 0) dx = at::zeros_like(x);
  if (!dhx.defined() || dhx.numel() == 0) dhx = at::zeros_like(h);
  if (!dcx.defined() || dcx.numel() == 0) dcx = c.has_value() ? at::zeros_like(*c) : at::empty({0}, x.options());
  return {dx, dhx, dcx, flat};
}

// The Python bodies, for what the kernels here leave to them.
using FwSig = Out4(const Tensor&, at::TensorList, const OptTensor&, const OptTensor&, int64_t, int64_t, int64_t,
                   int64_t, bool, bool, at::IntArrayRef, double);
using BwSig = Out4(const Tensor&, at::TensorList, const OptTensor&, const OptTensor&, const Tensor&, const OptTensor&,
                   const OptTensor&, const OptTensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, bool,
                   at::IntArrayRef, std::array<bool, 4>, double);
using PackedFwSig = Out4(const Tensor&, const Tensor&, at::TensorList, const OptTensor&, const OptTensor&, int64_t,
                         int64_t, int64_t, int64_t, bool, bool, at::IntArrayRef, double);
using PackedBwSig = Out4(const Tensor&, const Tensor&, at::TensorList, const OptTensor&, const OptTensor&,
                         const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&, int64_t,
                         int64_t, int64_t, int64_t, bool, at::IntArrayRef, std::array<bool, 4>, double);

template <typename Sig>
c10::TypedOperatorHandle<Sig> python_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The four calls into the Python bodies, one function each: the kernels
// below make them, and so does `python_bodies_op`, which the tests run.
Out4 fw_python(const Tensor& input, at::TensorList weights, const OptTensor& hx, const OptTensor& cx, int64_t mode,
               int64_t hidden_size, int64_t proj_size, int64_t num_layers, bool train, bool bidirectional,
               at::IntArrayRef offsets, double dropout) {
  static const auto op = python_op<FwSig>("wfpass::_cudnn_rnn_python");
  return op.call(input, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets,
                 dropout);
}

Out4 bw_python(const Tensor& input, at::TensorList weights, const OptTensor& hx, const OptTensor& cx,
               const Tensor& output, const OptTensor& grad_output, const OptTensor& grad_hy, const OptTensor& grad_cy,
               const Tensor& reserve, int64_t mode, int64_t hidden_size, int64_t proj_size, int64_t num_layers,
               bool bidirectional, at::IntArrayRef offsets, std::array<bool, 4> output_mask, double dropout) {
  static const auto op = python_op<BwSig>("wfpass::_cudnn_rnn_backward_python");
  return op.call(input, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode, hidden_size, proj_size,
                 num_layers, bidirectional, offsets, output_mask, dropout);
}

Out4 packed_fw_python(const Tensor& data, const Tensor& batch_sizes, at::TensorList weights, const OptTensor& hx,
                      const OptTensor& cx, int64_t mode, int64_t hidden_size, int64_t proj_size, int64_t num_layers,
                      bool train, bool bidirectional, at::IntArrayRef offsets, double dropout) {
  static const auto op = python_op<PackedFwSig>("wfpass::_cudnn_packed_rnn_python");
  return op.call(data, batch_sizes, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional,
                 offsets, dropout);
}

Out4 packed_bw_python(const Tensor& data, const Tensor& batch_sizes, at::TensorList weights, const OptTensor& hx,
                      const OptTensor& cx, const Tensor& output, const OptTensor& grad_output,
                      const OptTensor& grad_hy, const OptTensor& grad_cy, const Tensor& reserve, int64_t mode,
                      int64_t hidden_size, int64_t proj_size, int64_t num_layers, bool bidirectional,
                      at::IntArrayRef offsets, std::array<bool, 4> output_mask, double dropout) {
  static const auto op = python_op<PackedBwSig>("wfpass::_cudnn_packed_rnn_backward_python");
  return op.call(data, batch_sizes, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode, hidden_size,
                 proj_size, num_layers, bidirectional, offsets, output_mask, dropout);
}

Out4 cudnn_rnn_fw(const Tensor& input, at::TensorList weights, const OptTensor& hx, const OptTensor& cx, int64_t mode,
                  int64_t hidden_size, int64_t proj_size, int64_t num_layers, bool train, bool bidirectional,
                  at::IntArrayRef offsets, double dropout) {
  const Tensor buf = train && dropout > 0 ? Tensor() : flat_buffer(weights, offsets);
  if (!buf.defined())
    return fw_python(input, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets,
                     dropout);
  return forward(input, {}, input.size(1), weights, buf, hx, cx, mode, hidden_size, proj_size, num_layers, train,
                 bidirectional);
}

Out4 cudnn_rnn_backward(const Tensor& input, at::TensorList weights, const OptTensor& hx, const OptTensor& cx,
                        const Tensor& output, const OptTensor& grad_output, const OptTensor& grad_hy,
                        const OptTensor& grad_cy, const Tensor& reserve, int64_t mode, int64_t hidden_size,
                        int64_t proj_size, int64_t num_layers, bool bidirectional, at::IntArrayRef offsets,
                        std::array<bool, 4> output_mask, double dropout) {
  const Tensor buf = dropout > 0 ? Tensor() : flat_buffer(weights, offsets);
  if (!buf.defined())
    return bw_python(input, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode, hidden_size,
                     proj_size, num_layers, bidirectional, offsets, output_mask, dropout);
  return backward(input, {}, input.size(1), weights, buf, hx, cx, output, grad_output, grad_hy, grad_cy, reserve,
                  mode, hidden_size, proj_size, num_layers, bidirectional, offsets, output_mask);
}

// A PackedSequence's batch sizes, read on the host as cuDNN takes them.
std::vector<int64_t> sizes_of(const Tensor& batch_sizes) {
  TORCH_CHECK(batch_sizes.dim() == 1 && batch_sizes.scalar_type() == at::kLong && batch_sizes.device().is_cpu(),
              "wfpass::cudnn_packed_rnn: batch_sizes must be a 1-D CPU int64 tensor (a PackedSequence's), got a ",
              batch_sizes.dim(), "-D ", batch_sizes.device().type(), " ", batch_sizes.scalar_type(), " tensor");
  const Tensor s = batch_sizes.contiguous();
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
}

Out4 cudnn_packed_rnn_fw(const Tensor& data, const Tensor& batch_sizes, at::TensorList weights, const OptTensor& hx,
                         const OptTensor& cx, int64_t mode, int64_t hidden_size, int64_t proj_size, int64_t num_layers,
                         bool train, bool bidirectional, at::IntArrayRef offsets, double dropout) {
  const Tensor buf = train && dropout > 0 ? Tensor() : flat_buffer(weights, offsets);
  if (!buf.defined())
    return packed_fw_python(data, batch_sizes, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train,
                            bidirectional, offsets, dropout);
  const std::vector<int64_t> sizes = sizes_of(batch_sizes);
  return forward(data, sizes, sizes.empty() ? 0 : sizes[0], weights, buf, hx, cx, mode, hidden_size, proj_size,
                 num_layers, train, bidirectional);
}

Out4 cudnn_packed_rnn_backward(const Tensor& data, const Tensor& batch_sizes, at::TensorList weights,
                               const OptTensor& hx, const OptTensor& cx, const Tensor& output,
                               const OptTensor& grad_output, const OptTensor& grad_hy, const OptTensor& grad_cy,
                               const Tensor& reserve, int64_t mode, int64_t hidden_size, int64_t proj_size,
                               int64_t num_layers, bool bidirectional, at::IntArrayRef offsets,
                               std::array<bool, 4> output_mask, double dropout) {
  const Tensor buf = dropout > 0 ? Tensor() : flat_buffer(weights, offsets);
  if (!buf.defined())
    return packed_bw_python(data, batch_sizes, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode,
                            hidden_size, proj_size, num_layers, bidirectional, offsets, output_mask, dropout);
  const std::vector<int64_t> sizes = sizes_of(batch_sizes);
  return backward(data, sizes, sizes.empty() ? 0 : sizes[0], weights, buf, hx, cx, output, grad_output, grad_hy,
                  grad_cy, reserve, mode, hidden_size, proj_size, num_layers, bidirectional, offsets, output_mask);
}

// The pointer checks alone, on any device, for the tests: the flat buffer
// as a list of none or one tensor, the gradient buffer as a tensor.
std::vector<Tensor> flat_buffer_op(at::TensorList weights, at::IntArrayRef offsets) {
  Tensor buf = flat_buffer(weights, offsets);
  if (!buf.defined()) return {};
  return {buf};
}

Tensor grad_buffer_op(at::TensorList dw, at::TensorList weights, at::IntArrayRef offsets, const Tensor& like) {
  return grad_buffer(std::vector<Tensor>(dw.begin(), dw.end()), weights, offsets, like);
}

// The four calls into the Python bodies, through the functions the kernels
// above call them with (typed, through the dispatcher, which does not check
// a typed signature against a schema defined in Python), for a unidirectional LSTM
// of `weights` (4 per layer) over `x` [T, B, I] and the packed `data` of
// `batch_sizes`: the tests run them on the CPU with ATen's cuDNN calls
// stubbed, so the argument passing is checked where no GPU is at hand.
std::vector<Tensor> python_bodies_op(const Tensor& x, const Tensor& data, const Tensor& batch_sizes,
                                     at::TensorList weights, at::IntArrayRef offsets) {
  const int64_t hidden = weights[1].size(1), layers = static_cast<int64_t>(weights.size()) / 4;
  const std::array<bool, 4> mask{true, true, true, true};
  std::vector<Tensor> got;
  auto keep = [&got](const Out4& r) {
    got.insert(got.end(), {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)});
  };
  const Out4 fw = fw_python(x, weights, std::nullopt, std::nullopt, kLstm, hidden, 0, layers, true, false, offsets, 0.0);
  keep(fw);
  keep(bw_python(x, weights, std::nullopt, std::nullopt, std::get<0>(fw), std::get<0>(fw), std::nullopt, std::nullopt,
                 std::get<3>(fw), kLstm, hidden, 0, layers, false, offsets, mask, 0.0));
  const Out4 pfw = packed_fw_python(data, batch_sizes, weights, std::nullopt, std::nullopt, kLstm, hidden, 0, layers,
                                    true, false, offsets, 0.0);
  keep(pfw);
  keep(packed_bw_python(data, batch_sizes, weights, std::nullopt, std::nullopt, std::get<0>(pfw), std::get<0>(pfw),
                        std::nullopt, std::nullopt, std::get<3>(pfw), kLstm, hidden, 0, layers, false, offsets, mask,
                        0.0));
  return got;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def(WFPASS_SCHEMA_cudnn_flat_buffer);
  m.def(WFPASS_SCHEMA_cudnn_grad_buffer);
  m.def(WFPASS_SCHEMA_cudnn_python_bodies);
}

TORCH_LIBRARY_IMPL(wfpass, CompositeExplicitAutograd, m) {
  m.impl("_cudnn_flat_buffer", flat_buffer_op);
  m.impl("_cudnn_grad_buffer", grad_buffer_op);
  m.impl("_cudnn_python_bodies", python_bodies_op);
}

// The schemas, fakes and gradient formulas are registered in Python
// (wfpass/rnn/cuda/); these kernels take the CUDA key, before the Python
// bodies registered for every backend (CompositeExplicitAutograd).
TORCH_LIBRARY_IMPL(wfpass, CUDA, m) {
  m.impl("cudnn_rnn", cudnn_rnn_fw);
  m.impl("cudnn_rnn_fw", cudnn_rnn_fw);
  m.impl("cudnn_rnn_backward", cudnn_rnn_backward);
  m.impl("cudnn_packed_rnn", cudnn_packed_rnn_fw);
  m.impl("cudnn_packed_rnn_fw", cudnn_packed_rnn_fw);
  m.impl("cudnn_packed_rnn_backward", cudnn_packed_rnn_backward);
}
