// CPU kernels of wfpass's one-op-per-layer RNN ops, in C++: the same ATen
// calls as their Python kernels (wfpass/rnn/lstm_layer.py,
// wfpass/rnn/native_layer.py), without Python's ~20 us a call. The schemas,
// fake implementations and gradient formulas stay in Python; these are
// registered for the CPU key, which takes precedence over the Python
// kernels' CompositeExplicitAutograd registration.
//
// Checked on torch 2.13.0.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <tuple>

namespace {

using at::Tensor;
using Opt = std::optional<Tensor>;

// The zero state [1, B, H], made here rather than in the graph (a zeros
// kernel Inductor would compile); one tensor serves both states: the
// kernels only read them.
Tensor zero_state(const Tensor& input, int64_t hidden) {
  return at::zeros({1, input.size(1), hidden}, input.options());
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh,
                                                      const Tensor& b_ih, const Tensor& b_hh, const Opt& hx,
                                                      const Opt& cx, bool reverse, int64_t hidden_size,
                                                      bool has_biases, bool train) {
  Tensor zero;
  if (!hx.has_value() || !cx.has_value()) zero = zero_state(input, hidden_size);
  const Tensor& h = hx.has_value() ? *hx : zero;
  const Tensor& c = cx.has_value() ? *cx : zero;
  // oneDNN returns its workspace only with grad mode on.
  c10::AutoGradMode grad(train);
  auto r = at::mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, h, c, reverse, {}, /*mode=*/2, hidden_size,
                                /*num_layers=*/1, has_biases, /*bidirectional=*/false, /*batch_first=*/false, train);
  Tensor ws = std::get<3>(r);
  if (!ws.defined() || !train) ws = at::empty({0}, input.options().dtype(at::kByte));
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), ws};
}

using Grads7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

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

std::tuple<Tensor, Tensor> rnn_layer(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, const Opt& b_ih,
                                     const Opt& b_hh, const Opt& hx, c10::string_view mode, bool reverse) {
  const int64_t H = w_hh.size(1);
  const Tensor h0 = hx.has_value() ? *hx : zero_state(input, H);
  std::vector<Tensor> params{w_ih, w_hh};
  const bool bias = b_ih.has_value();
  if (bias) {
    params.push_back(*b_ih);
    params.push_back(*b_hh);
  }
  const Tensor x = reverse ? input.flip(0) : input;
  std::tuple<Tensor, Tensor> r;
  {
    at::NoGradGuard no_grad;
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

}  // namespace

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("lstm_layer", lstm_layer);
  m.impl("lstm_layer_fw", lstm_layer);
  m.impl("lstm_layer_backward", lstm_layer_backward);
  m.impl("rnn_layer", rnn_layer);
  m.impl("rnn_layer_fw", rnn_layer);
}
