// The "direct" linear kernel (direct.cpp): Y = X . W^T (+ bias) read from
// the weight as it is, [N, K] row-major, with no copy of it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace wfpass_direct {

// Can direct_linear run here? An x86-64 CPU with AVX-512F, or AVX2 and FMA,
// and WFPASS_DIRECT is not 0 / false / no / off. Asked once per process.
// isa(): "avx512f", "avx2" (also on an AVX-512 CPU with WFPASS_DIRECT=avx2)
// or "".
bool available();
const char* isa();

// Y [M, N] (leading dim ldy) = X [M, K] (leading dim ldx) . W^T, W [N, K]
// (leading dim ldw), + bias[N] on every row where given. Only where
// available() is true.
void direct_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* w, int64_t ldw,
                   const float* bias, float* y, int64_t ldy);

// wfpass::_direct_linear: F.linear(x, w, bias) on direct_linear, every
// shape, dtype and stride checked (a malformed call raises).
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// A member of a group of weights that read the same input: its rows (n of
// them, leading dim ldw, elements of the group's dtype), its float32 bias
// or null, and where its float32 outputs go ([M, n], row-major).
struct GroupMember {
  const void* w;
  int64_t ldw;
  int64_t n;
  const float* bias;
  float* y;
};

// wfpass::linear_group's direct path: x2 [M, K] times every weight, one
// contiguous [M, n_i] output per member, in one pass over all of them. The
// caller (linear.cpp) has checked shapes, dtypes and devices; biases[i] is
// undefined for a member without one. Only where available() is true.
std::vector<at::Tensor> group_op(const at::Tensor& x2, at::TensorList weights, const std::vector<at::Tensor>& biases);

}  // namespace wfpass_direct
