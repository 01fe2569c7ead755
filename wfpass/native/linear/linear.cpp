// wfpass::linear_by_rows's CPU kernel in C++: a fused sibling group's
// forward in a graph whose row count is symbolic, choosing per call between
// one GEMM over the whole block (at most max_rows rows) and one GEMM per
// member over its rows of the block, each writing its columns of one output
// (BLAS's leading dimension: no copy for the concatenation). The schema,
// its fake and the Python kernel (for CUDA, or without this library) are in
// wfpass/linear/kernel.py; both give the same output.
//
// Built and loaded by wfpass/native/__init__.py. Checked on torch 2.13.0.
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

}  // namespace

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("linear_by_rows", linear_by_rows);
}
