// A sample of a weight's bits: every step-th element, esize bytes each.
// The packed copies' freshness check (pack.cpp: the linears' blocks;
// rnn.cpp: an inference LSTM's pair) compares it on every call, since a
// write through ``.data`` moves no version counter. Templated on the byte
// container: pack.cpp keeps its entries in pages of its own (OwnPages),
// rnn.cpp in a std::vector.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace wfpass_sample {

template <class Bytes>
void take(const at::Tensor& w, int64_t step, int64_t esize, Bytes& out) {
  const auto* base = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t n = w.numel();
  out.clear();
  for (int64_t i = 0; i < n; i += step) out.insert(out.end(), base + i * esize, base + (i + 1) * esize);
}

template <class Bytes>
bool equal(const at::Tensor& w, int64_t step, int64_t esize, const Bytes& ref) {
  const auto* base = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t n = w.numel();
  size_t j = 0;
  for (int64_t i = 0; i < n; i += step, j += esize) {
    if (j + esize > ref.size() || std::memcmp(base + i * esize, ref.data() + j, esize) != 0) return false;
  }
  return j == ref.size();
}

}  // namespace wfpass_sample
