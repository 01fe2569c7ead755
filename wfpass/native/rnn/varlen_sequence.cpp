// pack_padded_sequence / pad_packed_sequence on the CPU, with the batch's
// reordering folded in.
//
// Eager (and wfpass's Python kernels) sort an unsorted batch with an
// index_select before packing and unsort the padded output with another one
// after padding: two extra copies of the batch, and two more fresh buffers
// whose first touch page-faults on every call (1.6 MB each for a 2-layer
// bidirectional LSTM of hidden 128, batch 16, T=100). Here each row is copied
// once, straight from its place in the caller's batch order: the gather index
// is the PackedSequence's sorted_indices (packing) or unsorted_indices
// (padding), exactly the index_select eager runs, so every value is eager's.
// Padded positions are written once, with the padding value (no fill of the
// whole output first). Rows are copied as bytes: any dtype.
//
// The gradients are the same two copies the other way round: the gradient of
// packing is padding by the inverse permutation (zeros where the input was
// padding), the gradient of padding is packing by the inverse permutation
// (the padded positions' gradient goes nowhere, as in eager).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using at::Tensor;

// The gather index as a checked permutation of [0, B), or empty (identity).
std::vector<int64_t> permutation(const c10::optional<Tensor>& order, int64_t B, const char* what) {
  std::vector<int64_t> idx;
  if (!order.has_value() || !order->defined()) return idx;
  Tensor o = order->to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(o.dim() == 1 && o.size(0) == B, what, ": the batch order has ", o.numel(),
              " entries for a batch of ", B);
  const int64_t* p = o.data_ptr<int64_t>();
  idx.assign(p, p + B);
  std::vector<char> seen(B, 0);
  for (int64_t v : idx) {
    TORCH_CHECK(v >= 0 && v < B && !seen[v], what, ": the batch order is not a permutation of 0..", B - 1);
    seen[v] = 1;
  }
  return idx;
}

std::vector<int64_t> inverse(const std::vector<int64_t>& idx) {
  std::vector<int64_t> inv(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) inv[idx[i]] = static_cast<int64_t>(i);
  return inv;
}

// data[off_t + b] = input[t, col(b)] for b < batch_sizes[t]; input is
// [T, B, *] (or [B, T, *] when batch_first), made contiguous first.
Tensor pack_rows(const Tensor& input, const int64_t* bs, int64_t steps, int64_t rows, bool batch_first,
                 const std::vector<int64_t>& col) {
  Tensor in = input.contiguous();
  const int64_t T = in.size(batch_first ? 1 : 0), B = in.size(batch_first ? 0 : 1);
  std::vector<int64_t> shape = in.sizes().vec();
  shape.erase(shape.begin());
  shape[0] = rows;
  Tensor data = at::empty(shape, in.options());
  const int64_t row = in.numel() / std::max<int64_t>(T * B, 1) * in.element_size();
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(data.data_ptr());
  for (int64_t t = 0; t < steps; ++t) {
    for (int64_t b = 0; b < bs[t]; ++b) {
      const int64_t c = col.empty() ? b : col[b];
      std::memcpy(dst, src + (batch_first ? c * T + t : t * B + c) * row, row);
      dst += row;
    }
  }
  return data;
}

// out[t, j] = data[off_t + col(j)] where col(j) < batch_sizes[t], the
// padding value elsewhere; out is [T, B, *] (or [B, T, *]).
Tensor pad_rows(const Tensor& data_in, const int64_t* bs, int64_t steps, int64_t B, int64_t T, bool batch_first,
                double padding_value, const std::vector<int64_t>& col) {
  Tensor data = data_in.contiguous();
  std::vector<int64_t> shape = data.sizes().vec();
  shape[0] = batch_first ? T : B;
  shape.insert(shape.begin(), batch_first ? B : T);
  Tensor out = at::empty(shape, data.options());
  const int64_t feat = data.numel() / std::max<int64_t>(data.size(0), 1);
  const int64_t row = feat * data.element_size();
  Tensor pad_row = at::full({feat}, padding_value, data.options());
  const char* pad = static_cast<const char*>(pad_row.data_ptr());
  const char* src = static_cast<const char*>(data.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  int64_t off = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t live = t < steps ? bs[t] : 0;
    for (int64_t j = 0; j < B; ++j) {
      const int64_t b = col.empty() ? j : col[j];
      const char* from = b < live ? src + (off + b) * row : pad;
      std::memcpy(dst + (batch_first ? j * T + t : t * B + j) * row, from, row);
    }
    off += live;
  }
  return out;
}

Tensor long_cpu(const Tensor& t) { return t.to(at::kCPU, at::kLong).contiguous(); }

// batch_sizes as a contiguous int64 CPU tensor, checked before any row is
// copied: 1-D, each entry in [0, the one before], summing to `rows` (the
// packed rows the caller reads or writes). A hand-built PackedSequence whose
// data is shorter than sum(batch_sizes) made the copies run past its end
// (eager: "shape ... is invalid"); a negative entry moves the offsets back.
// O(T): nothing per element.
Tensor checked_sizes(const Tensor& batch_sizes, int64_t rows, const char* what, const char* rows_name) {
  TORCH_CHECK(batch_sizes.dim() == 1, what, ": batch_sizes must be 1-D, got ", batch_sizes.dim(), "-D");
  Tensor sizes = long_cpu(batch_sizes);
  const int64_t* bs = sizes.data_ptr<int64_t>();
  const int64_t steps = sizes.size(0);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t sum = 0;
  for (int64_t t = 0; t < steps; ++t) {
    TORCH_CHECK(bs[t] >= 0 && (t == 0 || bs[t] <= bs[t - 1]), what,
                ": batch_sizes must be non-negative and non-increasing, got ", bs[t], " at step ", t,
                t ? " after " : "", t ? std::to_string(bs[t - 1]) : std::string());
    sum = bs[t] > kMax - sum ? kMax : sum + bs[t];  // saturates instead of overflowing
  }
  TORCH_CHECK(sum == rows, what, ": ", rows_name, " has ", rows, " rows, but batch_sizes sums to ", sum);
  return sizes;
}

std::tuple<Tensor, Tensor> pack_padded(const Tensor& input, const Tensor& lengths, bool batch_first,
                                       const c10::optional<Tensor>& order) {
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
              "'lengths' argument should be a 1D CPU int64 tensor, but got ", lengths.dim(), "D ",
              lengths.device().str(), " ", lengths.scalar_type(), " tensor");
  TORCH_CHECK(input.dim() >= 2, "pack_padded_sequence: the input needs a time and a batch dimension");
  const int64_t B = input.size(batch_first ? 0 : 1), T = input.size(batch_first ? 1 : 0);
  TORCH_CHECK(lengths.size(0) == B, "Expected `len(lengths)` to be equal to batch_size, but got ", lengths.size(0),
              " (batch_size=", B, ")");
  Tensor len = lengths.contiguous();
  const int64_t* l = len.data_ptr<int64_t>();
  TORCH_CHECK(B > 0 && l[B - 1] > 0,
              "Length of all samples has to be greater than 0, but found an element in 'lengths' that is <= 0");
  for (int64_t b = 1; b < B; ++b) {
    TORCH_CHECK(l[b - 1] >= l[b], "`lengths` array must be sorted in decreasing order when `enforce_sorted` is "
                "True. You can pass `enforce_sorted=False` to pack_padded_sequence and/or "
                "pack_sequence to sidestep this requirement if you do not need ONNX exportability.");
  }
  TORCH_CHECK(l[0] <= T, "pack_padded_sequence: a length (", l[0], ") is longer than the input's ", T, " steps");
  const int64_t steps = l[0];
  Tensor batch_sizes = at::empty({steps}, at::kLong);
  int64_t* bs = batch_sizes.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t t = 0, b = B; t < steps; ++t) {
    while (b > 0 && l[b - 1] <= t) --b;
    bs[t] = b;
    rows += b;
  }
  auto col = permutation(order, B, "pack_padded_sequence");
  return {pack_rows(input, bs, steps, rows, batch_first, col), batch_sizes};
}

std::tuple<Tensor, Tensor> pad_packed(const Tensor& data, const Tensor& batch_sizes, bool batch_first,
                                      double padding_value, int64_t total_length,
                                      const c10::optional<Tensor>& order) {
  TORCH_CHECK(data.dim() >= 1, "pad_packed_sequence: data must have a row dimension, got a 0-D tensor");
  Tensor sizes = checked_sizes(batch_sizes, data.size(0), "pad_packed_sequence", "data");
  const int64_t steps = sizes.size(0);
  TORCH_CHECK(steps > 0, "pad_packed_sequence: an empty batch");
  const int64_t* bs = sizes.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(total_length < 0 || total_length >= steps,
                    "Expected total_length to be at least the length of the longest sequence in input, but got "
                    "total_length=", total_length, " and max sequence length being ", steps);
  const int64_t B = bs[0], T = total_length < 0 ? steps : total_length;
  // Each sequence's length, in sorted order (as eager returns them before unsorting).
  Tensor lengths = at::empty({B}, at::kLong);
  int64_t* l = lengths.data_ptr<int64_t>();
  for (int64_t b = 0, t = steps; b < B; ++b) {
    while (t > 0 && bs[t - 1] <= b) --t;
    l[b] = t;
  }
  auto col = permutation(order, B, "pad_packed_sequence");
  return {pad_rows(data, bs, steps, B, T, batch_first, padding_value, col), lengths};
}

// d(pack)/d(input): the packed gradient padded back (zeros at the padding),
// into the caller's batch order.
Tensor pack_padded_backward(const Tensor& grad, const Tensor& batch_sizes, c10::SymIntArrayRef input_size,
                            bool batch_first, const c10::optional<Tensor>& order) {
  const char* what = "pack_padded_sequence's backward";
  TORCH_CHECK(input_size.size() >= 2 && grad.dim() == static_cast<int64_t>(input_size.size()) - 1, what,
              ": grad must be the packed data of an input of ", input_size.size(), " dimensions, got ",
              grad.dim(), "-D");
  for (size_t k = 2; k < input_size.size(); ++k)
    TORCH_CHECK(grad.size(k - 1) == input_size[k].expect_int(), what, ": grad has shape ", grad.sizes(),
                ", the input's features are ", c10::SymIntArrayRef(input_size).slice(2));
  Tensor sizes = checked_sizes(batch_sizes, grad.size(0), what, "grad");
  const int64_t B = input_size[batch_first ? 0 : 1].expect_int(), T = input_size[batch_first ? 1 : 0].expect_int();
  // The rows are written into a [T, B] grid: batch_sizes must fit it.
  TORCH_CHECK(sizes.size(0) <= T && (sizes.size(0) == 0 || sizes.data_ptr<int64_t>()[0] == B), what,
              ": batch_sizes (", sizes.size(0), " steps, first ", sizes.size(0) ? sizes.data_ptr<int64_t>()[0] : 0,
              ") does not describe an input of ", T, " steps and ", B, " sequences");
  auto col = permutation(order, B, what);
  return pad_rows(grad, sizes.data_ptr<int64_t>(), sizes.size(0), B, T, batch_first, 0.0,
                  col.empty() ? col : inverse(col));
}

// d(pad)/d(data): the padded gradient packed again (its padded positions
// dropped), read from the caller's batch order.
Tensor pad_packed_backward(const Tensor& grad, const Tensor& batch_sizes, c10::SymInt rows, bool batch_first,
                           const c10::optional<Tensor>& order) {
  const char* what = "pad_packed_sequence's backward";
  TORCH_CHECK(grad.dim() >= 2, what, ": grad must have a time and a batch dimension, got ", grad.dim(), "-D");
  Tensor sizes = checked_sizes(batch_sizes, rows.expect_int(), what, "the packed data");
  const int64_t* bs = sizes.data_ptr<int64_t>();
  const int64_t B = sizes.size(0) > 0 ? bs[0] : 0;
  // Rows are read from grad's [T, B] grid: batch_sizes must fit it.
  const int64_t Tg = grad.size(batch_first ? 1 : 0), Bg = grad.size(batch_first ? 0 : 1);
  TORCH_CHECK(sizes.size(0) <= Tg && B == Bg, what, ": grad has ", Tg, " steps and ", Bg,
              " sequences, batch_sizes ", sizes.size(0), " steps and ", B, " sequences");
  auto col = permutation(order, B, what);
  return pack_rows(grad, bs, sizes.size(0), rows.expect_int(), batch_first, col.empty() ? col : inverse(col));
}

}  // namespace

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("pack_padded", pack_padded);
  m.impl("pad_packed", pad_packed);
  m.impl("pack_padded_backward", pack_padded_backward);
  m.impl("pad_packed_backward", pad_packed_backward);
}
