// wfpass::linear_by_rows's CPU kernel in C++: a fused sibling group's
// forward in a graph whose row count is symbolic, choosing per call between
// one GEMM over the whole block (at most max_rows rows) and one GEMM per
// member over its rows of the block, each writing its columns of one output
// (BLAS's leading dimension: no copy for the concatenation). The schema,
// its fake and the Python kernel (for CUDA, or without this library) are in
// wfpass/linear/kernel.py; both give the same output.
//
// wfpass::linear_group's CPU kernel: the sibling linears of an exported
// program (wfpass/deploy/linear.py), each weight where the program holds it
// (AOTInductor packages each constant on its own, so the members are not one
// block there), one contiguous output per member (what each linear gives:
// the views after it stay as cheap as they were). Up to direct_rows rows:
// one pass of the direct kernel over all of them (direct.cpp, group_op);
// more rows, or a CPU without it: one GEMM per member.
//
// Built and loaded by wfpass/native/__init__.py. Checked on torch 2.11.0,
// 2.13.0 and 2.15.0.
#include "direct.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace {

at::Tensor linear_by_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                          at::IntArrayRef sizes, int64_t max_rows) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1), "wfpass::linear_by_rows: input of shape ",
              x.sizes(), " does not match the block of shape ", w.sizes());
  int64_t total = 0;
  for (auto s : sizes) {
    TORCH_CHECK(s >= 0, "wfpass::linear_by_rows: a member of negative size");
    total += s;
  }
  TORCH_CHECK(total == w.size(0), "wfpass::linear_by_rows: the members' sizes sum to ", total,
              ", the block has ", w.size(0), " rows");
  TORCH_CHECK(!b.has_value() || (b->dim() == 1 && b->size(0) == total),
              "wfpass::linear_by_rows: the bias block does not match the weight block");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const int64_t rows = x2.size(0);
  if (rows <= max_rows) return at::linear(x2, w, b).view(shape);
  at::Tensor out = at::empty({rows, total}, x.options());
  int64_t off = 0;
  for (auto s : sizes) {
    at::Tensor o = out.narrow(1, off, s);
    const at::Tensor wm = w.narrow(0, off, s).t();
    if (b.has_value())
      at::addmm_out(o, b->narrow(0, off, s), x2, wm);
    else
      at::mm_out(o, x2, wm);
    off += s;
  }
  return out.view(shape);
}

// params: every member's weight, then the biases of those that have one,
// in member order (has_bias: one entry per member). One list of tensors, not
// optional ones, so that autograd routes each its gradient, and never an
// empty one (AOTInductor's extern call passes an empty list as None,
// torch 2.13).
std::vector<at::Tensor> linear_group(const at::Tensor& x, at::TensorList params, const c10::List<bool>& has_bias,
                                     int64_t direct_rows) {
  const size_t members = has_bias.size();
  const auto bad_count = [&] {
    return c10::str("wfpass::linear_group: expected every member's weight, then its bias where has_bias says so; got ",
                    params.size(), " tensors for ", members, " members");
  };
  TORCH_CHECK(members > 0 && params.size() >= members, bad_count());
  const at::TensorList weights = params.slice(0, members), biases = params.slice(members);
  TORCH_CHECK(x.dim() >= 1, "wfpass::linear_group: the input needs a feature dimension, got shape ", x.sizes());
  const int64_t K = x.size(-1);
  size_t next = 0;
  std::vector<at::Tensor> bs;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == x.scalar_type() && w.device() == x.device(),
                "wfpass::linear_group: weight ", i, " of shape ", w.sizes(), ", ", w.scalar_type(), " on ",
                w.device(), " for an input of shape ", x.sizes(), ", ", x.scalar_type(), " on ", x.device());
    if (has_bias.get(i)) {
      TORCH_CHECK(next < biases.size(), bad_count());
      const at::Tensor& b = biases[next++];
      TORCH_CHECK(b.dim() == 1 && b.size(0) == w.size(0) && b.scalar_type() == x.scalar_type() &&
                      b.device() == x.device(),
                  "wfpass::linear_group: bias ", i, " of shape ", b.sizes(), " for a weight of shape ", w.sizes());
      bs.push_back(b);
    } else {
      bs.emplace_back();
    }
  }
  TORCH_CHECK(next == biases.size(), bad_count());
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t rows = x2.size(0);
  const at::ScalarType dt = x.scalar_type();
  std::vector<at::Tensor> ys;
  if (rows <= direct_rows && wfpass_direct::available() &&
      (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
    ys = wfpass_direct::group_op(x2, weights, bs);
  } else {
    for (size_t i = 0; i < weights.size(); ++i)
      ys.push_back(at::linear(x2, weights[i], bs[i].defined() ? std::optional<at::Tensor>(bs[i]) : std::nullopt));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  for (size_t i = 0; i < ys.size(); ++i) {
    shape.back() = weights[i].size(0);
    ys[i] = ys[i].view(shape);
  }
  return ys;
}

}  // namespace

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("linear_by_rows", linear_by_rows);
  m.impl("linear_group", linear_group);
}
