// An eval-mode LSTM layer call over few rows on wfpass's C++ loop, for
// wfpass::lstm_layer_fw (rnn.cpp), whose kernel is otherwise oneDNN's LSTM
// layer. Why: the loop reads the weights as they are there
// (varlen_rnn.cpp, reads_weights_as_is), and at every point of at most
// kShortLstmRows rows (T x batch) it measured 1.21-15x faster than
// oneDNN's layer: LSTM, hidden = input = 64 / 128 / 256 / 512, T 1-16,
// batch 1-16, no grad, 1 and 2 threads, Intel Xeon with AVX-512 and AMX
// (benchmarks/rnn/bench_rnn_as_is.py --lstm-layer,
// docs/results/rnn_short_calls.md), and 1.27-43x on an AMD EPYC with
// AVX-512, no AMX (rnn_short_calls_amd.md); at 32 rows and more it lost at some
// sizes in an earlier sweep (0.73x at hidden 256, T 64, batch 1, 2 threads). The decision is
// taken on each call's real sizes, so a graph or program whose T is
// symbolic gets it for every T that comes; the op's fake and outputs are
// the same either way.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace wfpass_varlen {

constexpr int64_t kShortLstmRows = 16;

// Is the short path in use in this process: the loop and the direct
// kernel, WFPASS_RNN_AS_IS not 0 / false / no / off (read once).
bool short_lstm_on();

// Does this call take short_lstm? float32 on the CPU, [T, B, I] with T x B
// in 1..kShortLstmRows, no projection, short_lstm_on().
bool takes_short_lstm(const at::Tensor& input, const at::Tensor& w_hh, int64_t hidden_size);

// The layer on the loop: (output [T, B, H], h_n [1, B, H], c_n [1, B, H]),
// dense, as oneDNN's layer returns them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> short_lstm(const at::Tensor& input, const at::Tensor& w_ih,
                                                          const at::Tensor& w_hh, const std::optional<at::Tensor>& b_ih,
                                                          const std::optional<at::Tensor>& b_hh,
                                                          const std::optional<at::Tensor>& hx,
                                                          const std::optional<at::Tensor>& cx, bool reverse);

}  // namespace wfpass_varlen
