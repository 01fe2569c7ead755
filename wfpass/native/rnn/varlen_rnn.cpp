// CPU kernels of wfpass::packed_layer and wfpass::packed_layer_backward:
// one layer and one direction of an LSTM / GRU / plain RNN over a packed
// batch (PackedSequence layout). The op, its fakes, its autograd formula and
// its Python kernels are in wfpass/rnn/cpu/packed_layer_py.py and packed_layer_py_backward.py, which says what it
// computes and lays out the workspace. For fp32 on an AVX-512 CPU the
// steps run on raw pointers (fast_rnn.cpp: oneDNN's small-GEMM ukernel and
// vectorized gate math; 2.0x faster on the bench's LSTM layer, training),
// which agree with the Python kernels to rounding. Elsewhere (bf16, fp16,
// other CPUs, WFPASS_FAST_LOOP=0) these are the Python kernels' steps, the
// same ATen calls in the same order (the same numbers, bit for bit, checked
// in tests/test_packed_layer.py), without Python's few microseconds per call:
// ~10 calls a step, so the C++ kernels take 0.55-0.6x the Python ones'
// time at hidden 16, batch 4, and 0.85-0.9x at hidden 128, batch 16, where
// the GEMMs dominate (T = 100, one thread, benchmarks/bench_packed_layer.py's
// lengths).
//
// What keeps the loop short: every buffer allocated before it, the input
// projection of all steps done as one GEMM straight into the workspace, and
// per step an in-place addmm_ into the live rows plus the gate math in
// place. The only per-step objects are the narrow() views of the live rows.
//
// Checked on torch 2.13.0.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "fast_rnn.h"
#include "../linear/direct.h"
#include "short_lstm.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>
#include "wfpass_schemas.h"  // the ops' schemas, written by the build from wfpass/native/schemas.py

namespace {

using at::Tensor;
using Opt = std::optional<Tensor>;

enum class Mode { LSTM, GRU, RNN_TANH, RNN_RELU };

Mode parse_mode(c10::string_view mode) {
  if (mode == "LSTM") return Mode::LSTM;
  if (mode == "GRU") return Mode::GRU;
  if (mode == "RNN_TANH") return Mode::RNN_TANH;
  if (mode == "RNN_RELU") return Mode::RNN_RELU;
  TORCH_CHECK_VALUE(false, "wfpass::packed_layer: mode must be one of ('LSTM', 'GRU', 'RNN_TANH', 'RNN_RELU'), got '",
                    mode, "'");
  return Mode::LSTM;  // not reached: the check throws
}

int64_t gate_count(Mode mode) {
  return mode == Mode::LSTM ? 4 : mode == Mode::GRU ? 3 : 1;
}

int64_t workspace_width(Mode mode, int64_t H) {
  return mode == Mode::LSTM ? 6 * H : mode == Mode::GRU ? 4 * H : 0;
}

// batch_sizes read once, checked, with its row offsets.
struct Steps {
  std::vector<int64_t> bs, off;
  int64_t T = 0, N = 0, B = 0;
};

// RuntimeError, as eager's packed RNN raises for data rows that do not
// match batch_sizes: every step's rows are read at these offsets.
Steps read_steps(const Tensor& batch_sizes, int64_t N) {
  TORCH_CHECK(batch_sizes.dim() == 1 && batch_sizes.scalar_type() == at::kLong && batch_sizes.is_cpu(),
              "wfpass::packed_layer: batch_sizes must be a 1-D int64 CPU tensor (a PackedSequence's)");
  const Tensor b = batch_sizes.contiguous();
  const int64_t* p = b.data_ptr<int64_t>();
  Steps s;
  s.T = b.numel();
  s.bs.assign(p, p + s.T);
  s.off.resize(s.T);
  bool ok = s.T > 0;
  int64_t acc = 0;
  for (int64_t t = 0; t < s.T && ok; ++t) {
    ok = s.bs[t] >= 1 && (t == 0 || s.bs[t] <= s.bs[t - 1]);
    s.off[t] = acc;
    acc += s.bs[t];
    ok = ok && acc <= N;  // stops the sum before it could overflow
  }
  TORCH_CHECK(ok && acc == N, "wfpass::packed_layer: batch_sizes must be positive, non-increasing and sum to "
              "data.shape[0] = ", N, " (data's rows); got ", s.T, " steps, starting at ", s.T ? s.bs[0] : 0);
  s.N = N;
  s.B = s.bs[0];
  return s;
}

void check_args(Mode mode, const Opt& w_hr, const Opt& c0) {
  TORCH_CHECK_VALUE(mode == Mode::LSTM || (!w_hr.has_value() && !c0.has_value()),
                    "wfpass::packed_layer: w_hr and c0 are LSTM arguments, got one for another mode");
}

// A tensor read at data's dtype and device (the raw-pointer loop reads
// float pointers; the transposed weights would convert silently).
void check_like(const Tensor& t, const Tensor& data, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == data.scalar_type() && t.device() == data.device(), op, ": ", name, " is ",
              t.scalar_type(), " on ", t.device(), ", data ", data.scalar_type(), " on ", data.device());
}

// A state or its gradient ([L, B, W], where given), checked before a row of
// it is read: RuntimeError, eager's type for an h0 of the wrong batch or
// hidden size. B is batch_sizes[0].
void check_state(const Opt& s, const Tensor& data, int64_t L, int64_t B, int64_t W, const char* op,
                 const char* name) {
  if (!s.has_value()) return;
  TORCH_CHECK(s->dim() == 3 && s->size(0) == L && s->size(1) == B && s->size(2) == W, op, ": ", name,
              " must have shape (", L, ", ", B, ", ", W, ") (batch_sizes[0] = ", B, " sequences), got ", s->sizes());
  check_like(*s, data, op, name);
}

// h0 as [B, W] (zeros where None: made here, not in the graph).
Tensor initial_state(const Opt& s, const Tensor& data, int64_t B, int64_t W, const char* name) {
  if (!s.has_value()) return at::zeros({B, W}, data.options());
  check_state(s, data, 1, B, W, "wfpass::packed_layer", name);
  return s->select(0, 0);
}

// The weights against each other and against data [N, I], before any is
// read: a packed batch whose feature size was not the RNN's input_size ran
// the input GEMM over rows of the wrong length (eager: "input.size(-1) must
// be equal to input_size" / "mat1 and mat2 shapes cannot be multiplied").
// Returns (H, H_out).
std::pair<int64_t, int64_t> check_weights(Mode mode, const Tensor& data, const Tensor& w_ih, const Tensor& w_hh,
                                          const Opt& b_ih, const Opt& b_hh, const Opt& w_hr) {
  const char* op = "wfpass::packed_layer";
  TORCH_CHECK(data.dim() == 2, op, ": data must be 2-D (a PackedSequence's rows), got ", data.dim(), "-D");
  const int64_t G = gate_count(mode);
  TORCH_CHECK(w_ih.dim() == 2 && w_ih.size(0) > 0 && w_ih.size(0) % G == 0, op, ": w_ih must be 2-D with ", G,
              " rows a hidden unit, got ", w_ih.sizes());
  const int64_t H = w_ih.size(0) / G;
  TORCH_CHECK(data.size(1) == w_ih.size(1), op, ": data: input.size(-1) must be equal to input_size. Expected ",
              w_ih.size(1), " (w_ih's columns), got ", data.size(1));
  int64_t Hout = H;
  if (w_hr.has_value()) {
    TORCH_CHECK(w_hr->dim() == 2 && w_hr->size(1) == H, op, ": w_hr must have shape (proj_size, ", H, "), got ",
                w_hr->sizes());
    Hout = w_hr->size(0);
    check_like(*w_hr, data, op, "w_hr");
  }
  TORCH_CHECK(w_hh.dim() == 2 && w_hh.size(0) == G * H && w_hh.size(1) == Hout, op, ": w_hh must have shape (",
              G * H, ", ", Hout, "), got ", w_hh.sizes());
  check_like(w_ih, data, op, "w_ih");
  check_like(w_hh, data, op, "w_hh");
  for (const auto& [b, name] : {std::make_pair(&b_ih, "b_ih"), std::make_pair(&b_hh, "b_hh")}) {
    if (!b->has_value()) continue;
    TORCH_CHECK((*b)->dim() == 1 && (*b)->size(0) == G * H, op, ": ", name, " must have shape (", G * H, "), got ",
                (*b)->sizes());
    check_like(**b, data, op, name);
  }
  return {H, Hout};
}

// The backward's own inputs: out [N, H_out], and the gradients where given.
void check_grads(Mode mode, const Tensor& data, const Steps& s, int64_t H, int64_t Hout, const Tensor& out,
                 const Opt& grad_out, const Opt& grad_hn, const Opt& grad_cn) {
  const char* op = "wfpass::packed_layer_backward";
  TORCH_CHECK(out.dim() == 2 && out.size(0) == s.N && out.size(1) == Hout, op, ": out must have shape (", s.N, ", ",
              Hout, "), got ", out.sizes());
  check_like(out, data, op, "out");
  if (grad_out.has_value()) {
    TORCH_CHECK(grad_out->dim() == 2 && grad_out->size(0) == s.N && grad_out->size(1) == Hout, op,
                ": grad_out must have shape (", s.N, ", ", Hout, "), got ", grad_out->sizes());
    check_like(*grad_out, data, op, "grad_out");
  }
  check_state(grad_hn, data, 1, s.B, Hout, op, "grad_hn");
  if (mode == Mode::LSTM) check_state(grad_cn, data, 1, s.B, H, op, "grad_cn");
}

// One step in processing order: its rows r0 : r0 + n; the first m rows of
// the state it reads are rows p0 : p0 + m of the step before it, the rest
// rows m : n of the initial state (packed_layer.py, _schedule).
using Step = wfpass_fast::Step;

std::vector<Step> schedule(const Steps& s, bool reverse) {
  std::vector<Step> out;
  out.reserve(s.T);
  for (int64_t k = 0; k < s.T; ++k) {
    const int64_t t = reverse ? s.T - 1 - k : k;
    if (!reverse)
      out.push_back({s.off[t], s.bs[t], t ? s.off[t - 1] : 0, t ? s.bs[t] : 0});
    else {
      const bool last = t == s.T - 1;
      out.push_back({s.off[t], s.bs[t], last ? 0 : s.off[t + 1], last ? 0 : s.bs[t + 1]});
    }
  }
  return out;
}

// The [n, W] state a step reads: a view where it is one block, else its
// two pieces copied into buf (a reversed step where sequences join).
Tensor prev_state(const Tensor& states, const Tensor& init, const Tensor& buf, const Step& st) {
  if (st.m == st.n) return states.narrow(0, st.p0, st.n);
  if (st.m == 0) return init.narrow(0, 0, st.n);
  buf.narrow(0, 0, st.m).copy_(states.narrow(0, st.p0, st.m));
  buf.narrow(0, st.m, st.n - st.m).copy_(init.narrow(0, st.m, st.n - st.m));
  return buf.narrow(0, 0, st.n);
}

// [1, B, W]: each sequence's state after its last step (packed_layer.py, _final).
Tensor final_state(const Tensor& states, const Steps& s, bool reverse) {
  Tensor fin = at::empty({1, s.B, states.size(1)}, states.options());
  Tensor f = fin.select(0, 0);
  if (reverse) {
    f.copy_(states.narrow(0, 0, s.B));
    return fin;
  }
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t m = t + 1 < s.T ? s.bs[t + 1] : 0;
    if (m < s.bs[t]) f.narrow(0, m, s.bs[t] - m).copy_(states.narrow(0, s.off[t] + m, s.bs[t] - m));
  }
  return fin;
}

// Where the state each packed row's step read lives (packed_layer.py,
// _prev_index): index [N], the row of the per-row states it read (0 where it
// read the initial state instead), and first [B], the packed row where
// sequence b read the initial state.
std::pair<Tensor, Tensor> prev_index(const Steps& s, bool reverse) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  Tensor index = at::empty({s.N}, opts), first = at::empty({s.B}, opts);
  int64_t* p = index.data_ptr<int64_t>();
  int64_t* q = first.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t nxt = t + 1 < s.T ? s.bs[t + 1] : 0;
    for (int64_t j = 0; j < s.bs[t]; ++j) {
      const int64_t row = s.off[t] + j;
      const bool init = reverse ? j >= nxt : t == 0;
      p[row] = init ? 0 : reverse ? s.off[t + 1] + j : s.off[t - 1] + j;
      if (init) q[j] = row;
    }
  }
  return {index, first};
}

// [N, W]: the state each packed row read.
Tensor gather(const Tensor& states, const Tensor& init, const std::pair<Tensor, Tensor>& where) {
  return states.index_select(0, where.first).index_copy_(0, where.second, init);
}

// a[lo : lo + len] + b[lo : lo + len] for the biases given (undefined if none).
Tensor bias_sum(const Opt& a, const Opt& b, int64_t lo, int64_t len) {
  if (a.has_value() && b.has_value()) return at::add(a->narrow(0, lo, len), b->narrow(0, lo, len));
  if (a.has_value()) return a->narrow(0, lo, len);
  if (b.has_value()) return b->narrow(0, lo, len);
  return Tensor();
}

// oneDNN's linear (mkldnn::_linear_pointwise, what Inductor's CPU linears
// call), for the big GEMMs over all N rows: on this AMD CPU ATen's mm (MKL)
// ran them 2-4x slower (packed_layer_py.py, use_onednn, says the same
// rule: fp32, oneDNN on). Private op name, checked on torch 2.11.0-2.15.0.
const c10::OperatorHandle* onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op.has_value() ? &*op : nullptr;
}

bool use_onednn(const Tensor& x) {
  return x.scalar_type() == at::kFloat && at::globalContext().userEnabledMkldnn() && onednn_linear_op() != nullptr;
}

// x @ w.T (+ b): x [M, K], w [N, K], contiguous copies where they are not;
// the bias too: oneDNN's op reads it as contiguous whatever its stride (a
// GRU's b_ih[2H:] of a strided bias gave wrong values; torch 2.13).
Tensor onednn_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  torch::jit::Stack stack;
  stack.emplace_back(x.contiguous());
  stack.emplace_back(w.contiguous());
  stack.emplace_back(b.defined() ? c10::IValue(b.contiguous()) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<c10::Scalar>>());
  stack.emplace_back(std::string(""));
  onednn_linear_op()->callBoxed(&stack);
  return stack[0].toTensor();
}

// oneDNN's GEMMs over the N packed rows run in blocks of kRowBlock rows,
// the last padded with zero rows to a multiple of kRowPad: oneDNN keeps a
// primitive per shape (ideep's cache and its own, 1,024 entries each, ~0.5
// MB a shape here), and N changes with every batch (docs/rnn.md,
// "Memory"). Blocked, a GEMM has at most 1 + kRowBlock / kRowPad shapes.
// packed_layer_py.py (ROW_BLOCK, onednn_rows) blocks the same way: the
// Python kernels' bits.
constexpr int64_t kRowBlock = 256, kRowPad = 64;

int64_t padded_rows(int64_t r) {
  return r == kRowBlock ? r : (r + kRowPad - 1) / kRowPad * kRowPad;
}

// x @ w.T (+ b) over the rows of x [N, K], in row blocks; into out [N, M]
// where given, else fresh.
Tensor onednn_rows(const Tensor& x, const Tensor& w, const Tensor& b, Tensor out = Tensor()) {
  const Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t N = xc.size(0);
  if (!out.defined()) out = at::empty({N, wc.size(0)}, x.options());
  for (int64_t r0 = 0; r0 < N; r0 += kRowBlock) {
    const int64_t r = std::min(kRowBlock, N - r0), rp = padded_rows(r);
    Tensor xs = xc.narrow(0, r0, r);
    if (rp != r) {
      Tensor p = at::zeros({rp, xc.size(1)}, xc.options());
      p.narrow(0, 0, r).copy_(xs);
      xs = p;
    }
    out.narrow(0, r0, r).copy_(onednn_linear(xs, wc, b).narrow(0, 0, r));
  }
  return out;
}

// t[r0 : r0 + r].T, contiguous, with zero columns up to rp.
Tensor t_block(const Tensor& t, int64_t r0, int64_t r, int64_t rp) {
  if (rp == r) return t.narrow(0, r0, r).t().contiguous();
  Tensor o = at::zeros({t.size(1), rp}, t.options());
  o.narrow(1, 0, r).copy_(t.narrow(0, r0, r).t());
  return o;
}

// a.T @ b for each b over the N rows of a [N, G] and b [N, K]: [G, K]
// each, in row blocks summed in order.
std::vector<Tensor> onednn_t_rows(const Tensor& a, std::initializer_list<Tensor> bs) {
  std::vector<Tensor> outs;
  const int64_t N = a.size(0);
  if (N == 0) {
    for (const Tensor& b : bs) outs.push_back(at::zeros({a.size(1), b.size(1)}, a.options()));
    return outs;
  }
  outs.resize(bs.size());
  for (int64_t r0 = 0; r0 < N; r0 += kRowBlock) {
    const int64_t r = std::min(kRowBlock, N - r0), rp = padded_rows(r);
    const Tensor at_ = t_block(a, r0, r, rp);
    size_t i = 0;
    for (const Tensor& b : bs) {
      Tensor p = onednn_linear(at_, t_block(b, r0, r, rp), Tensor());
      if (r0 == 0)
        outs[i] = p;
      else
        outs[i].add_(p);
      ++i;
    }
  }
  return outs;
}

// The raw-pointer loop (fast_rnn.cpp) for fp32 where the CPU and oneDNN's
// ukernel allow; the ATen calls below otherwise (bf16, other CPUs).
bool fast(const Tensor& data) {
  return data.scalar_type() == at::kFloat && wfpass_fast::fast_loop() && use_onednn(data);
}

float* fp(const Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

// out = data @ w.T (+ bias), over all N rows, into a column block of the
// workspace (the ATen path; lean_forward has the raw-pointer one).
void project(Tensor out, const Tensor& bias, const Tensor& data, const Tensor& w) {
  if (use_onednn(data))
    onednn_rows(data, w, bias, out);
  else if (bias.defined())
    at::addmm_out(out, bias, data, w.t());
  else
    at::mm_out(out, data, w.t());
}

// a @ w over all rows with the fast loop's GEMM (a [N, K] with unit column
// stride, w [K, M]), into out when given (adding to it), else a new tensor.
Tensor rows_times(const Tensor& a, const Tensor& w, Tensor out = Tensor()) {
  const bool add = out.defined();
  if (!add) out = at::empty({a.size(0), w.size(1)}, a.options());
  const Tensor x = a.stride(1) == 1 ? a : a.contiguous(), wc = w.contiguous();
  wfpass_fast::gemm_rows(x.size(0), wc.size(1), x.size(1), fp(x), x.stride(0), fp(wc), wc.size(1), nullptr, fp(out),
                         out.size(1), add);
  return out;
}

// Temporaries that never leave a call (the backward's gates' gradients,
// gathered states and the transposes its weight GEMMs read; an inference
// call's workspace), carved from one
// buffer each thread keeps between calls: fresh blocks of megabytes cost
// page faults on every call, as glibc hands them back to the system (the
// bench's packed LSTM training step: 2,900 faults a step, 31.8 ms against
// 26.8 ms with glibc keeping its memory). Up to 64 MiB is kept; a larger
// call takes a fresh block.
class Scratch {
 public:
  Scratch(int64_t numel, const at::TensorOptions& opts) {
    constexpr int64_t kKeep = (int64_t{64} << 20) / 4;
    thread_local Tensor kept;
    if (numel > kKeep) {
      buf_ = at::empty({numel}, opts);
      return;
    }
    if (!kept.defined() || kept.numel() < numel || kept.scalar_type() != opts.dtype().toScalarType())
      kept = at::empty({numel}, opts);
    buf_ = kept;
  }
  // n floats of the buffer as a raw pointer: no view made (the lean
  // forward's temporaries; fp32 only).
  float* floats(int64_t n) {
    TORCH_CHECK(used_ + n <= buf_.numel(), "wfpass::packed_layer: scratch overrun");
    float* p = buf_.data_ptr<float>() + used_;
    used_ += n;
    return p;
  }
  // n floats of the buffer, zeroed.
  float* zeros(int64_t n) {
    float* p = floats(n);
    std::memset(p, 0, n * sizeof(float));
    return p;
  }
  Tensor take(at::IntArrayRef sizes) {
    const int64_t n = c10::multiply_integers(sizes);
    TORCH_CHECK(used_ + n <= buf_.numel(), "wfpass::packed_layer: scratch overrun");
    Tensor t = buf_.narrow(0, used_, n).view(sizes);
    used_ += n;
    return t;
  }

 private:
  Tensor buf_;
  int64_t used_ = 0;
};

// Scratch floats t_rows_times takes for x [N, K] and g [N, G].
int64_t t_rows_scratch(int64_t N, int64_t K, int64_t G) {
  return std::max(wfpass_fast::tn_scratch(N, K) + K * G, wfpass_fast::tn_scratch(N, G));
}

// Does t_rows_times run g.T @ x directly (g's rows copied transposed) rather
// than (x.T @ g).T? Where that copies fewer floats, counting the final
// transpose twice (ATen's strided copy_ ran at ~2 ns a float, the loop's own
// copy below it).
bool direct_tn(int64_t N, int64_t K, int64_t G) {
  return N * G <= N * K + 2 * K * G;
}

// g.T @ x over all N rows on the fast loop's GEMM, on raw pointers: g [N, G]
// (leading dim ldg), x [N, K] (ldx), unit column strides; written into
// `into` [G, K] contiguous; tmp: t_rows_scratch(N, K, G) floats.
// Computed as (x.T @ g).T in blocks of 64 rows (fast_rnn.cpp, gemm_tn_rows:
// no kernel, cache entry or primitive per N, as oneDNN's linear made;
// only x, the narrower side, copied transposed).
//
// Where the rows are few (a small full batch: T * B rows), g's rows copied
// transposed cost less than x's plus the [K, G] -> [G, K] transpose at the
// end, which ATen's strided copy_ made the dearest part of a small LSTM's
// backward (a 2-layer LSTM at T 16, batch 1, hidden 128: 265 -> 216 us a
// layer's training call; measured): there the GEMM runs as g.T @ x
// directly into [G, K] (direct_tn).
void t_rows_raw(int64_t N, int64_t K, int64_t G, const float* g, int64_t ldg, const float* x, int64_t ldx,
                float* into, float* tmp) {
  if (direct_tn(N, K, G)) {
    wfpass_fast::gemm_tn_rows(N, G, K, g, ldg, x, ldx, into, K, tmp);
    return;
  }
  float* ct = tmp + wfpass_fast::tn_scratch(N, K);
  wfpass_fast::gemm_tn_rows(N, K, G, x, ldx, g, ldg, ct, G, tmp);
  wfpass_fast::transpose(K, G, ct, G, into, K);
}

// The same into a fresh [G, K] (its temporaries fresh too: a caller may
// hold the thread's scratch buffer).
Tensor t_rows_times(const Tensor& g, const Tensor& x) {
  const Tensor gc = g.stride(1) == 1 ? g : g.contiguous(), xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t N = xc.size(0), K = xc.size(1), G = gc.size(1);
  Tensor into = at::empty({G, K}, x.options());
  const Tensor tmp = at::empty({t_rows_scratch(N, K, G)}, x.options());
  t_rows_raw(N, K, G, fp(gc), gc.stride(0), fp(xc), xc.stride(0), fp(into), fp(tmp));
  return into;
}

// d_data = dg @ w_ih, d_w_ih = dg.T @ data, d_w_hh = dg.T @ h_prev: each one
// GEMM over the N rows (LSTM, RNN).
std::tuple<Tensor, Tensor, Tensor> weight_grads(const Tensor& dg, const Tensor& data, const Tensor& h_prev,
                                                const Tensor& w_ih) {
  if (fast(data)) return {rows_times(dg, w_ih), t_rows_times(dg, data), t_rows_times(dg, h_prev)};
  if (!use_onednn(data)) return {at::mm(dg, w_ih), at::mm(dg.t(), data), at::mm(dg.t(), h_prev)};
  const std::vector<Tensor> d_w = onednn_t_rows(dg, {data, h_prev});
  return {onednn_rows(dg, w_ih.t(), Tensor()), d_w[0], d_w[1]};
}

using Fw = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// [1, B, W]: each sequence's state after its last step, from rows of
// `states` (leading dim ld): final_state's copies on raw pointers.
Tensor final_rows(const float* states, int64_t ld, int64_t W, const Steps& s, bool reverse,
                  const at::TensorOptions& opts) {
  Tensor fin = at::empty({1, s.B, W}, opts);
  float* f = fin.data_ptr<float>();
  const auto row = [&](int64_t j, int64_t r) { std::memcpy(f + j * W, states + r * ld, W * sizeof(float)); };
  if (reverse) {
    for (int64_t j = 0; j < s.B; ++j) row(j, j);
    return fin;
  }
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t m = t + 1 < s.T ? s.bs[t + 1] : 0;
    for (int64_t j = m; j < s.bs[t]; ++j) row(j, s.off[t] + j);
  }
  return fin;
}

// A [rows, cols] fp32 matrix with unit column stride: t, or a contiguous copy.
Tensor unit_cols(const Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// Does a forward read its weights as they are, through the direct linear
// kernel (linear/direct.h), rather than from the transposes oneDNN's
// ukernel takes (W^T, made on every call)? The transposes cost a fixed
// time that grows as H^2 (2 x [4H, H] floats for an LSTM: 55 us of a 56 us
// call at H 128, T 1, batch 1; 365 us at H 256), while below H 512 the
// ukernel's steps are faster than the direct kernel's once the weight sits
// in cache. So the direct kernel takes short calls over few rows, T <= H /
// 16 steps and T x batch <= H^2 / 512 rows, and every call of a batch up to
// 16 at H >= 512, where its steps were faster too (its threads split each
// step's GEMM; the ukernel's step runs on one). Measured on the layer op
// alone (LSTM and GRU, H = I = 64 / 128 / 256 / 512, T 1-64, batch 1-16, 1
// and 2 threads, Intel Xeon with AVX-512 and AMX:
// benchmarks/rnn/bench_rnn_as_is.py, docs/results/rnn_as_is.md): inside
// the bound 1.02-12x faster, outside it 0.56-1.42x (a few shapes just past
// the bound win; none inside it loses). A projection (proj_size) keeps the
// transposes.
// transposes. WFPASS_RNN_AS_IS=0 (false, no, off) turns it off, =all takes
// it for every call (the benchmark's two sides); read once per process.
enum class AsIs { rule, off, all };
AsIs as_is_setting() {
  const char* env = std::getenv("WFPASS_RNN_AS_IS");
  std::string v(env != nullptr ? env : "");
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "0" || v == "false" || v == "no" || v == "off") return AsIs::off;
  if (v == "all") return AsIs::all;
  return AsIs::rule;
}

bool reads_weights_as_is(int64_t T, int64_t B, int64_t N, int64_t H) {
  static const AsIs setting = as_is_setting();
  if (setting == AsIs::off || !wfpass_direct::available()) return false;
  return setting == AsIs::all || (H >= 512 && B <= 16) || (T * 16 <= H && N * 512 <= H * H);
}

// One layer and direction's forward on the raw-pointer loop (fast(data)),
// after layer_forward's checks: the same arithmetic, in the same order, as
// the ATen path's projection and fast_rnn.cpp's steps, with the per-call
// ATen calls cut to the outputs' allocations. Before, the call made ~35
// ATen calls around the arithmetic (the workspace's column views, the
// biases' sum, zero initial states, the transposes' scratch views, the
// final states' row copies), each 0.3-1 us through the dispatcher: about
// half of a small layer's call (hidden 16, T 1, batch 1: 26 us). The
// temporaries (the inference workspace, the transposed weights, the summed
// bias, zero initial states, the reversed direction's state rows) are raw
// pointers into the thread's scratch buffer.
Fw lean_forward(Mode mode, const Steps& s, bool reverse, bool train, const Tensor& data, const Tensor& w_ih,
                const Tensor& w_hh, const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                const Tensor& into, int64_t H, int64_t Hout) {
  const bool lstm = mode == Mode::LSTM, gru = mode == Mode::GRU, proj = w_hr.has_value();
  const int64_t N = s.N, B = s.B, I = data.size(1), G = gate_count(mode) * H, K = workspace_width(mode, H);
  const auto opts = data.options();
  const std::vector<Step> steps = schedule(s, reverse);
  const Tensor x = unit_cols(data), wi = unit_cols(w_ih), wh = unit_cols(w_hh);
  const Tensor wr = proj ? unit_cols(*w_hr) : Tensor();
  const Tensor bi = b_ih.has_value() ? b_ih->contiguous() : Tensor(), bh = b_hh.has_value() ? b_hh->contiguous() : Tensor();
  const Tensor hs = h0.has_value() ? h0->select(0, 0).contiguous() : Tensor();
  const Tensor cs = lstm && c0.has_value() ? c0->select(0, 0).contiguous() : Tensor();
  const bool sum = bi.defined() && bh.defined();
  const bool as_is = !proj && reads_weights_as_is(static_cast<int64_t>(steps.size()), B, N, H);
  Scratch sc((train ? 0 : N * K) + (as_is ? 0 : I * G) + (as_is ? B * G : Hout * G) +
                 (proj ? H * Hout + B * H : 0) + (sum ? G : 0) +
                 (hs.defined() ? 0 : B * Hout) + (lstm && !cs.defined() ? B * H : 0) +
                 (reverse ? B * Hout + (lstm ? B * H : 0) : 0),
             opts);
  const Tensor ws_out = train ? at::empty({N, K}, opts) : Tensor();
  float* ws = train ? ws_out.data_ptr<float>() : sc.floats(N * K);
  float* wih_t = as_is ? nullptr : sc.floats(I * G);
  wfpass_fast::Recurrent rec;
  if (as_is) {
    rec.w = fp(wh);
    rec.ldw = wh.stride(0);
    rec.tmp = sc.floats(B * G);
  } else {
    float* whh_t = sc.floats(Hout * G);
    wfpass_fast::transpose(G, Hout, fp(wh), wh.stride(0), whh_t, G);
    rec.t = whh_t;
  }
  float* whr_t = proj ? sc.floats(H * Hout) : nullptr;
  if (!as_is) wfpass_fast::transpose(G, I, fp(wi), wi.stride(0), wih_t, G);
  if (proj) wfpass_fast::transpose(Hout, H, fp(wr), wr.stride(0), whr_t, Hout);
  // The input projection over all N rows: on the ukernel from W_ih^T, or
  // on the direct kernel from W_ih as it is (cols columns from row g0 of
  // W_ih, into `into` with leading dim ld).
  const auto input_gemm = [&](int64_t g0, int64_t cols, const float* b, float* into, int64_t ld) {
    if (as_is)
      wfpass_direct::direct_linear(N, cols, I, fp(x), x.stride(0), fp(wi) + g0 * wi.stride(0), wi.stride(0), b,
                                   into, ld);
    else
      wfpass_fast::gemm_rows(N, cols, I, fp(x), x.stride(0), wih_t + g0, G, b, into, ld, false);
  };
  // The bias the input GEMM adds: b_ih + b_hh where both are given (the
  // same float adds as at::add), else the one given, else none.
  const float* bias = sum ? nullptr : bi.defined() ? fp(bi) : fp(bh);
  if (sum) {
    float* b = sc.floats(G);
    const float *p = fp(bi), *q = fp(bh);
    for (int64_t j = 0; j < G; ++j) b[j] = p[j] + q[j];
    bias = b;
  }
  const float* h_init = hs.defined() ? fp(hs) : sc.zeros(B * Hout);
  const float* c_init = !lstm ? nullptr : cs.defined() ? fp(cs) : sc.zeros(B * H);
  float* hbuf = reverse ? sc.floats(B * Hout) : nullptr;
  float* cbuf = reverse && lstm ? sc.floats(B * H) : nullptr;
  float* hpre = proj ? sc.floats(B * H) : nullptr;
  const Tensor out = into.defined() ? into : at::empty({N, Hout}, opts);
  float* o = fp(out);
  const int64_t ldo = out.stride(0);
  Tensor c_n;
  if (lstm) {
    input_gemm(0, G, bias, ws, K);
    wfpass_fast::lstm_forward(steps, H, Hout, ws, o, ldo, h_init, Hout, c_init, H, rec, whr_t, hbuf, cbuf, hpre);
    c_n = final_rows(ws + 4 * H, K, H, s, reverse, opts);
  } else if (gru) {
    // r | z from the summed biases, n from b_ih's, and hn starts as b_hn
    // (zero without b_hh), so the step's GEMM leaves W_hn h + b_hn there.
    input_gemm(0, 2 * H, bias, ws, K);
    input_gemm(2 * H, H, bi.defined() ? fp(bi) + 2 * H : nullptr, ws + 3 * H, K);
    for (int64_t r = 0; r < N; ++r) {
      float* hn = ws + r * K + 2 * H;
      if (bh.defined())
        std::memcpy(hn, fp(bh) + 2 * H, H * sizeof(float));
      else
        std::memset(hn, 0, H * sizeof(float));
    }
    wfpass_fast::gru_forward(steps, H, ws, o, ldo, h_init, H, rec, hbuf);
    c_n = at::empty({0}, opts);
  } else {
    input_gemm(0, H, bias, o, ldo);
    wfpass_fast::rnn_forward(steps, H, o, ldo, h_init, H, rec, hbuf, mode == Mode::RNN_RELU);
    c_n = at::empty({0}, opts);
  }
  Tensor h_n = final_rows(o, ldo, Hout, s, reverse, opts);
  return {out, h_n, c_n, train ? ws_out : at::empty({0}, opts)};
}


// One layer and direction. `into`, where given (the raw-pointer path only),
// is the output: a column block of a bidirectional layer's [N, 2 Hout].
Fw layer_forward(const Tensor& data, const Tensor& batch_sizes, const Tensor& w_ih, const Tensor& w_hh,
                 const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                 c10::string_view mode_name, bool reverse, bool train, const Tensor& into) {
  const Mode mode = parse_mode(mode_name);
  check_args(mode, w_hr, c0);
  check_weights(mode, data, w_ih, w_hh, b_ih, b_hh, w_hr);
  const Steps s = read_steps(batch_sizes, data.size(0));
  const int64_t N = s.N, B = s.B, H = w_ih.size(0) / gate_count(mode);
  const int64_t Hout = w_hr.has_value() ? w_hr->size(0) : H;
  check_state(h0, data, 1, B, Hout, "wfpass::packed_layer", "h0");
  check_state(c0, data, 1, B, H, "wfpass::packed_layer", "c0");
  const auto opts = data.options();
  // Called below autograd; the guard also keeps any nested call from
  // recording a graph when the op runs through an autograd fallback.
  at::NoGradGuard no_grad;
  if (fast(data)) return lean_forward(mode, s, reverse, train, data, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, into, H, Hout);
  const Tensor h_init = initial_state(h0, data, B, Hout, "h0");
  const Tensor hbuf = reverse ? at::empty({B, Hout}, opts) : Tensor();
  const Tensor w_hh_t = w_hh.t();
  const std::vector<Step> steps = schedule(s, reverse);
  const Tensor ws = at::empty({N, workspace_width(mode, H)}, opts);
  Tensor out, c_n;
  if (mode == Mode::LSTM) {
    const Tensor c_init = initial_state(c0, data, B, H, "c0");
    // Column blocks of the workspace, made once: i | f | g | o | c | tanh(c).
    const Tensor gates = ws.narrow(1, 0, 4 * H), c_all = ws.narrow(1, 4 * H, H), tc_all = ws.narrow(1, 5 * H, H);
    const Tensor i_all = ws.narrow(1, 0, H), f_all = ws.narrow(1, H, H), if_all = ws.narrow(1, 0, 2 * H);
    const Tensor g_all = ws.narrow(1, 2 * H, H), o_all = ws.narrow(1, 3 * H, H);
    project(gates, bias_sum(b_ih, b_hh, 0, 4 * H), data, w_ih);
    out = into.defined() ? into : at::empty({N, Hout}, opts);
    const Tensor cbuf = reverse ? at::empty({B, H}, opts) : Tensor();
    const Tensor w_hr_t = w_hr.has_value() ? w_hr->t() : Tensor();
    const Tensor hpre = w_hr.has_value() ? at::empty({B, H}, opts) : Tensor();
    for (const Step& st : steps) {
      const Tensor hp = prev_state(out, h_init, hbuf, st), cp = prev_state(c_all, c_init, cbuf, st);
      const Tensor o = o_all.narrow(0, st.r0, st.n), g = g_all.narrow(0, st.r0, st.n);
      gates.narrow(0, st.r0, st.n).addmm_(hp, w_hh_t);
      if_all.narrow(0, st.r0, st.n).sigmoid_();
      g.tanh_();
      o.sigmoid_();
      Tensor c = c_all.narrow(0, st.r0, st.n);
      at::mul_out(c, f_all.narrow(0, st.r0, st.n), cp);
      c.addcmul_(i_all.narrow(0, st.r0, st.n), g);  // c = f * c_prev + i * g
      Tensor t_c = tc_all.narrow(0, st.r0, st.n);
      at::tanh_out(t_c, c);
      Tensor h = out.narrow(0, st.r0, st.n);
      if (w_hr_t.defined()) {
        Tensor hq = hpre.narrow(0, 0, st.n);
        at::mm_out(h, at::mul_out(hq, o, t_c), w_hr_t);
      } else {
        at::mul_out(h, o, t_c);
      }
    }
    c_n = final_state(c_all, s, reverse);
  } else if (mode == Mode::GRU) {
    // r | z | hn | n: one recurrent GEMM a step accumulates into r | z | hn.
    const Tensor rz_all = ws.narrow(1, 0, 2 * H), rzh_all = ws.narrow(1, 0, 3 * H);
    const Tensor r_all = ws.narrow(1, 0, H), z_all = ws.narrow(1, H, H);
    const Tensor hn_all = ws.narrow(1, 2 * H, H), n_all = ws.narrow(1, 3 * H, H);
    project(rz_all, bias_sum(b_ih, b_hh, 0, 2 * H), data, w_ih.narrow(0, 0, 2 * H));
    project(n_all, b_ih.has_value() ? b_ih->narrow(0, 2 * H, H) : Tensor(), data, w_ih.narrow(0, 2 * H, H));
    // hn starts as b_hn, so the step's GEMM leaves W_hn h + b_hn there.
    if (b_hh.has_value())
      hn_all.copy_(b_hh->narrow(0, 2 * H, H));
    else
      hn_all.zero_();
    out = into.defined() ? into : at::empty({N, H}, opts);
    for (const Step& st : steps) {
      const Tensor hp = prev_state(out, h_init, hbuf, st);
      rzh_all.narrow(0, st.r0, st.n).addmm_(hp, w_hh_t);
      rz_all.narrow(0, st.r0, st.n).sigmoid_();
      Tensor nt = n_all.narrow(0, st.r0, st.n);
      nt.addcmul_(r_all.narrow(0, st.r0, st.n), hn_all.narrow(0, st.r0, st.n)).tanh_();
      Tensor h = out.narrow(0, st.r0, st.n);
      at::lerp_out(h, nt, hp, z_all.narrow(0, st.r0, st.n));  // (1 - z) * n + z * h
    }
    c_n = at::empty({0}, opts);
  } else {
    out = into.defined() ? into : at::empty({N, H}, opts);
    project(out, bias_sum(b_ih, b_hh, 0, H), data, w_ih);
    const bool relu = mode == Mode::RNN_RELU;
    for (const Step& st : steps) {
      const Tensor hp = prev_state(out, h_init, hbuf, st);
      Tensor h = out.narrow(0, st.r0, st.n).addmm_(hp, w_hh_t);
      if (relu)
        h.relu_();
      else
        h.tanh_();
    }
    c_n = at::empty({0}, opts);
  }
  Tensor h_n = final_state(out, s, reverse);
  return {out, h_n, c_n, train ? ws : at::empty({0}, opts)};
}

// A full batch: data [T, B, I] with an empty batch_sizes, every one of the
// T steps B rows (a plain, unpacked RNN input). The same kernels run over
// its T * B rows; the graph that calls them then needs no batch_sizes tensor
// of its own (a constant Inductor would have to build per call). Returns the
// rows [T * B, I] and the batch sizes, or data and batch_sizes as given.
std::pair<Tensor, Tensor> as_rows(const Tensor& data, const Tensor& batch_sizes, const char* op) {
  if (data.dim() != 3) return {data, batch_sizes};
  TORCH_CHECK(batch_sizes.numel() == 0, op, ": data of 3 dimensions is a full batch [T, B, I] and takes an empty "
              "batch_sizes, got ", batch_sizes.numel(), " batch sizes");
  const int64_t T = data.size(0), B = data.size(1);
  TORCH_CHECK(T > 0 && B > 0, op, ": a full batch [T, B, I] needs T >= 1 and B >= 1, got ", data.sizes());
  return {data.reshape({T * B, data.size(2)}), at::full({T}, B, at::TensorOptions().dtype(at::kLong))};
}

Fw packed_layer(const Tensor& data, const Tensor& batch_sizes, const Tensor& w_ih, const Tensor& w_hh,
                const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                c10::string_view mode_name, bool reverse, bool train) {
  const auto rows = as_rows(data, batch_sizes, "wfpass::packed_layer");
  return layer_forward(rows.first, rows.second, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode_name, reverse, train,
                       Tensor());
}

using Bw = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// dh = grad_out[rows] + carry[:n] (or the carry alone), written into dst.
void incoming(Tensor& dst, const Opt& grad_out, const Tensor& carry, int64_t r0, int64_t n) {
  if (grad_out.has_value())
    at::add_out(dst, grad_out->narrow(0, r0, n), carry.narrow(0, 0, n));
  else
    dst.copy_(carry.narrow(0, 0, n));
}

// out = 1 - x, exactly (negation is exact), without a temporary.
Tensor& one_minus(Tensor& out, const Tensor& x) {
  return at::neg_out(out, x).add_(1);
}

// A carry: the gradient of each sequence's final state, contiguous, to be
// overwritten row by row (zeros where it has none).
Tensor carry_from(const Opt& grad, const Tensor& data, int64_t B, int64_t W) {
  if (!grad.has_value()) return at::zeros({B, W}, data.options());
  return grad->select(0, 0).clone(at::MemoryFormat::Contiguous);
}

// The biases' gradients: the column sums of dg, the same for both biases
// (two tensors where both are given: outputs may not alias).
std::pair<Tensor, Tensor> bias_grads(const Tensor& dg, const Opt& b_ih, const Opt& b_hh) {
  Tensor d_b_ih = at::empty({0}, dg.options()), d_b_hh = at::empty({0}, dg.options());
  if (b_ih.has_value() || b_hh.has_value()) {
    const Tensor d_b = dg.sum(0);
    if (b_ih.has_value()) d_b_ih = d_b;
    if (b_hh.has_value()) d_b_hh = b_ih.has_value() ? d_b.clone() : d_b;
  }
  return {d_b_ih, d_b_hh};
}

// Each step's rows (r0, n) in the backward's order, the forward's reversed.
wfpass_fast::Rows backward_rows(const Steps& s, bool reverse) {
  wfpass_fast::Rows rows;
  for (int64_t k = 0; k < s.T; ++k) {
    const int64_t t = reverse ? k : s.T - 1 - k;
    rows.emplace_back(s.off[t], s.bs[t]);
  }
  return rows;
}

// The rows each packed row's step read its state from (prev_index's
// answer, on raw pointers): dst [N, W] (contiguous) gets, for every row,
// its row of states [N, W] (leading dim ld) or of init [B, W] (contiguous).
void gather_rows(float* dst, const float* states, int64_t ld, const float* init, int64_t W, const Steps& s,
                 bool reverse) {
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t nxt = t + 1 < s.T ? s.bs[t + 1] : 0;
    for (int64_t j = 0; j < s.bs[t]; ++j) {
      const bool first = reverse ? j >= nxt : t == 0;
      const float* src = first ? init + j * W : states + ((reverse ? s.off[t + 1] : s.off[t - 1]) + j) * ld;
      std::memcpy(dst + (s.off[t] + j) * W, src, W * sizeof(float));
    }
  }
}

// A carry on raw pointers: the gradient of each sequence's final state
// ([1, B, W] where given, else zeros) copied into dst [B, W].
void carry_into(float* dst, const Opt& grad, int64_t B, int64_t W) {
  if (!grad.has_value()) {
    std::memset(dst, 0, B * W * sizeof(float));
    return;
  }
  const Tensor g = grad->select(0, 0).contiguous();
  std::memcpy(dst, g.data_ptr<float>(), B * W * sizeof(float));
}

// The LSTM backward on the raw-pointer loop (fast_rnn.cpp, lstm_backward):
// the gates' gradients computed in the loop from the workspace, so none of
// the ATen path's factor passes over [N, 4H] or its gathered c_prev. As in
// lean_forward, the ATen calls are cut to the outputs' allocations (and the
// bias gradients' column sums, kept on ATen's sum for its bits): the
// temporaries (gates' gradients, gathered states, zero initial states, the
// carries, the weight GEMMs' transposes) are raw pointers into the thread's
// scratch buffer, and a carry that is returned (d_h0, d_c0) is written in
// place.
Bw lean_lstm_backward(const Steps& s, bool reverse, const Tensor& data, const Tensor& w_ih, const Tensor& w_hh,
                      const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                      const Tensor& out, const Tensor& workspace, const Opt& grad_out, const Opt& grad_hn,
                      const Opt& grad_cn) {
  const int64_t N = s.N, B = s.B, H = w_hh.size(0) / 4, I = data.size(1), G = 4 * H;
  const bool proj = w_hr.has_value();
  const int64_t Hout = proj ? w_hr->size(0) : H;
  const auto opts = data.options();
  const Tensor x = unit_cols(data), o = unit_cols(out);
  const Tensor ws = workspace.contiguous(), gout = grad_out.has_value() ? grad_out->contiguous() : Tensor();
  const Tensor wh = w_hh.contiguous(), wi = w_ih.contiguous(), wr = proj ? w_hr->contiguous() : Tensor();
  const Tensor hs = h0.has_value() ? h0->select(0, 0).contiguous() : Tensor();
  const Tensor cs = c0.has_value() ? c0->select(0, 0).contiguous() : Tensor();
  // The carries end as the initial states' gradients: returned where asked.
  const Tensor d_h0 = at::empty(h0.has_value() ? at::IntArrayRef{1, B, Hout} : at::IntArrayRef{0}, opts);
  const Tensor d_c0 = at::empty(c0.has_value() ? at::IntArrayRef{1, B, H} : at::IntArrayRef{0}, opts);
  Scratch sc(N * G + N * Hout + (proj ? N * Hout + B * H + N * H : B * Hout) + B * H +
                 t_rows_scratch(N, I, G) + t_rows_scratch(N, Hout, G) + (hs.defined() ? 0 : B * Hout) +
                 (cs.defined() ? 0 : B * H) + (h0.has_value() ? 0 : B * Hout) + (c0.has_value() ? 0 : B * H),
             opts);
  const float* h_init = hs.defined() ? fp(hs) : sc.zeros(B * Hout);
  const float* c_init = cs.defined() ? fp(cs) : sc.zeros(B * H);
  float* hcar = h0.has_value() ? fp(d_h0) : sc.floats(B * Hout);
  float* ccar = c0.has_value() ? fp(d_c0) : sc.floats(B * H);
  carry_into(hcar, grad_hn, B, Hout);
  carry_into(ccar, grad_cn, B, H);
  float* dg = sc.floats(N * G);
  float* h_prev = sc.floats(N * Hout);
  gather_rows(h_prev, fp(o), o.stride(0), h_init, Hout, s, reverse);
  float* dh = sc.floats((proj ? N : B) * Hout);
  float* dhp = proj ? sc.floats(B * H) : nullptr;
  float* cbuf = sc.floats(B * H);
  wfpass_fast::lstm_backward(schedule(s, reverse), H, Hout, fp(gout), hcar, ccar, fp(ws), c_init, H, cbuf, dg, fp(wh),
                             fp(wr), dh, dhp);
  Tensor d_w_hr = at::empty({0}, opts);
  if (proj) {  // dh.T @ (o * tanh(c)), on ATen's mm as before (its bits)
    float* oc = sc.floats(N * H);
    const float* w = fp(ws);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < H; ++k) oc[r * H + k] = w[r * 6 * H + 3 * H + k] * w[r * 6 * H + 5 * H + k];
    d_w_hr = at::mm(at::from_blob(dh, {N, Hout}, opts).t(), at::from_blob(oc, {N, H}, opts));
  }
  // d_data = dg @ w_ih, d_w_ih = dg.T @ data, d_w_hh = dg.T @ h_prev (weight_grads' fast path).
  Tensor d_data = at::empty({N, I}, opts), d_w_ih = at::empty({G, I}, opts), d_w_hh = at::empty({G, Hout}, opts);
  wfpass_fast::gemm_rows(N, I, G, dg, G, fp(wi), I, nullptr, fp(d_data), I, false);
  t_rows_raw(N, I, G, dg, G, fp(x), x.stride(0), fp(d_w_ih), sc.floats(t_rows_scratch(N, I, G)));
  t_rows_raw(N, Hout, G, dg, G, h_prev, Hout, fp(d_w_hh), sc.floats(t_rows_scratch(N, Hout, G)));
  Tensor d_b_ih, d_b_hh;
  std::tie(d_b_ih, d_b_hh) = bias_grads(at::from_blob(dg, {N, G}, opts), b_ih, b_hh);
  return {d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_h0, d_c0};
}

// The GRU backward on the raw-pointer loop, as lean_lstm_backward: the
// factor passes over [N, H] are the ATen path's below, as the same float
// multiplies and adds per element in the same order (so the same bits),
// then fast_rnn.cpp's gru_backward and the GEMMs, with the ATen calls cut to
// the outputs' allocations and the bias gradients' column sums (ATen's sum,
// for its bits); the temporaries from the thread's scratch buffer.
Bw lean_gru_backward(const Steps& s, bool reverse, const Tensor& data, const Tensor& w_ih, const Tensor& w_hh,
                     const Opt& b_ih, const Opt& b_hh, const Opt& h0, const Tensor& out, const Tensor& workspace,
                     const Opt& grad_out, const Opt& grad_hn) {
  const int64_t N = s.N, B = s.B, H = w_hh.size(0) / 3, I = data.size(1), G = 3 * H;
  const auto opts = data.options();
  const Tensor x = unit_cols(data), o = unit_cols(out);
  const Tensor ws = workspace.contiguous(), gout = grad_out.has_value() ? grad_out->contiguous() : Tensor();
  const Tensor wh = w_hh.contiguous(), wi = w_ih.contiguous();
  const Tensor hs = h0.has_value() ? h0->select(0, 0).contiguous() : Tensor();
  const Tensor d_h0 = at::empty(h0.has_value() ? at::IntArrayRef{1, B, H} : at::IntArrayRef{0}, opts);
  Scratch sc(N * G + 3 * N * H + (hs.defined() ? 0 : B * H) + (h0.has_value() ? 0 : B * H) +
                 t_rows_scratch(N, I, 2 * H) + t_rows_scratch(N, I, H) + t_rows_scratch(N, H, G),
             opts);
  const float* h_init = hs.defined() ? fp(hs) : sc.zeros(B * H);
  float* hcar = h0.has_value() ? fp(d_h0) : sc.floats(B * H);
  carry_into(hcar, grad_hn, B, H);
  float* h_prev = sc.floats(N * H);
  gather_rows(h_prev, fp(o), o.stride(0), h_init, H, s, reverse);
  // dL/d(recurrent gates) = dh * (k_r, k_z, a_n r), the factors written
  // into dg here and scaled in the loop (native_layer._gates_backward).
  float* dg = sc.floats(N * G);
  float* a_n = sc.floats(N * H);
  const float* w = fp(ws);
  for (int64_t r = 0; r < N; ++r) {
    const float* wr = w + r * 4 * H;
    const float* hp = h_prev + r * H;
    float* g = dg + r * G;
    float* an = a_n + r * H;
    for (int64_t k = 0; k < H; ++k) {
      const float rg = wr[k], zg = wr[H + k], hn = wr[2 * H + k], nv = wr[3 * H + k];
      const float one_z = -zg + 1.0f;
      const float a = (-(nv * nv) + 1.0f) * one_z;  // (1 - n^2)(1 - z): through n
      g[H + k] = (one_z * zg) * (hp[k] - nv);      // (1 - z) z (h_prev - n)
      g[k] = (((-rg + 1.0f) * rg) * hn) * a;       // (1 - r) r hn a_n
      g[2 * H + k] = a * rg;                       // the recurrent side of n is scaled by r
      an[k] = a;
    }
  }
  float* dh_all = sc.floats(N * H);
  wfpass_fast::gru_backward(backward_rows(s, reverse), H, fp(gout), hcar, w, dg, fp(wh), dh_all);
  // The input side differs from dg only in n's third (not scaled by r):
  // its gradients as GEMMs over dg's r | z columns and a_n * dh.
  for (int64_t i = 0; i < N * H; ++i) a_n[i] = a_n[i] * dh_all[i];
  const float* wip = fp(wi);
  Tensor d_data = at::empty({N, I}, opts), d_w_ih = at::empty({G, I}, opts), d_w_hh = at::empty({G, H}, opts);
  wfpass_fast::gemm_rows(N, I, 2 * H, dg, G, wip, I, nullptr, fp(d_data), I, false);
  wfpass_fast::gemm_rows(N, I, H, a_n, H, wip + 2 * H * I, I, nullptr, fp(d_data), I, true);
  t_rows_raw(N, I, 2 * H, dg, G, fp(x), x.stride(0), fp(d_w_ih), sc.floats(t_rows_scratch(N, I, 2 * H)));
  t_rows_raw(N, I, H, a_n, H, fp(x), x.stride(0), fp(d_w_ih) + 2 * H * I, sc.floats(t_rows_scratch(N, I, H)));
  t_rows_raw(N, H, G, dg, G, h_prev, H, fp(d_w_hh), sc.floats(t_rows_scratch(N, H, G)));
  const Tensor dg2 = at::from_blob(dg, {N, G}, opts);
  Tensor d_b_ih = at::empty({0}, opts), d_b_hh = at::empty({0}, opts);
  if (b_ih.has_value()) {
    d_b_ih = at::empty({G}, opts);
    Tensor d_b_rz = d_b_ih.narrow(0, 0, 2 * H), d_b_n = d_b_ih.narrow(0, 2 * H, H);
    at::sum_out(d_b_rz, dg2.narrow(1, 0, 2 * H), 0);
    at::sum_out(d_b_n, at::from_blob(a_n, {N, H}, opts), 0);
  }
  if (b_hh.has_value()) d_b_hh = dg2.sum(0);
  return {d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, at::empty({0}, opts), d_h0, at::empty({0}, opts)};
}

// The ATen path of layer_backward, one function per mode: each fills the
// gradients layer_backward allocated (d_h0 aside, which layer_backward makes
// last from the carried dL/dh, ``hcar``, updated here in place), running the
// steps in ``order`` (the backward's: the forward's reversed). ``h_prev``:
// the state each row read, [N, H_out]. The same ATen calls in the same
// order as the Python kernel (varlen_layer_py_backward.py), so the same bits.
void aten_lstm_backward(const Steps& s, const std::vector<int64_t>& order, const std::pair<Tensor, Tensor>& where,
                        const Tensor& data, const Tensor& w_ih, const Tensor& w_hh, const Opt& b_ih,
                        const Opt& b_hh, const Opt& w_hr, const Opt& c0, const Tensor& workspace,
                        const Opt& grad_out, const Opt& grad_cn, const Tensor& h_prev, const Tensor& hcar,
                        int64_t B, int64_t H, int64_t Hout, Tensor& d_data, Tensor& d_w_ih, Tensor& d_w_hh,
                        Tensor& d_b_ih, Tensor& d_b_hh, Tensor& d_w_hr, Tensor& d_c0) {
  const int64_t N = s.N;
  const auto opts = data.options();
  const Tensor c_init = initial_state(c0, data, B, H, "c0");
  const Tensor i = workspace.narrow(1, 0, H), f = workspace.narrow(1, H, H), g = workspace.narrow(1, 2 * H, H);
  const Tensor o = workspace.narrow(1, 3 * H, H), c = workspace.narrow(1, 4 * H, H);
  const Tensor tc = workspace.narrow(1, 5 * H, H);
  // dL/d(pre-activation) = dc * k_i, k_f, k_g and dh * k_o, where the
  // step's dc = carried dc + dh * k_c: the factors for all rows at once,
  // written into dg, which the loop then scales in place.
  const Tensor dg = at::empty({N, 4, H}, opts);
  Tensor dg_if = dg.narrow(1, 0, 2), dg_i = dg.select(1, 0), dg_f = dg.select(1, 1), dg_g = dg.select(1, 2);
  Tensor dg_o = dg.select(1, 3);
  const Tensor ws_if = workspace.narrow(1, 0, 2 * H).view({N, 2, H});
  one_minus(dg_if, ws_if).mul_(ws_if);  // i (1 - i), f (1 - f)
  dg_i.mul_(g);
  Tensor k_c = gather(c, c_init, where);  // c_prev, until k_f has it
  dg_f.mul_(k_c);
  at::mul_out(dg_g, g, g).neg_().add_(1).mul_(i);  // (1 - g^2) i
  one_minus(dg_o, o).mul_(o).mul_(tc);  // (1 - o) o tanh(c)
  at::mul_out(k_c, tc, tc).neg_().add_(1).mul_(o);  // (1 - tanh(c)^2) o
  Tensor ccar = carry_from(grad_cn, data, B, H);
  const Tensor dg_ifg = dg.narrow(1, 0, 3), dg2 = dg.view({N, 4 * H});
  const bool proj = w_hr.has_value();
  // With a projection, d_w_hr needs every row's dL/dh.
  const Tensor dh_all = at::empty({proj ? N : B, Hout}, opts);
  const Tensor dhp = proj ? at::empty({B, H}, opts) : Tensor();
  for (const int64_t t : order) {
    const int64_t r0 = s.off[t], n = s.bs[t];
    Tensor dh = dh_all.narrow(0, proj ? r0 : 0, n);
    incoming(dh, grad_out, hcar, r0, n);
    if (proj) {  // through the projection: dL/d(o * tanh(c))
      Tensor d = dhp.narrow(0, 0, n);
      at::mm_out(d, dh, *w_hr);
      dh = d;
    }
    Tensor dc = ccar.narrow(0, 0, n);
    dc.addcmul_(dh, k_c.narrow(0, r0, n));
    dg_ifg.narrow(0, r0, n).mul_(dc.unsqueeze(1));
    dg_o.narrow(0, r0, n).mul_(dh);
    dc.mul_(f.narrow(0, r0, n));  // dL/dc_prev
    Tensor hc = hcar.narrow(0, 0, n);
    at::mm_out(hc, dg2.narrow(0, r0, n), w_hh);  // dL/dh_prev
  }
  if (proj) d_w_hr = at::mm(dh_all.t(), at::mul_out(k_c, o, tc));  // k_c's buffer is free now
  if (c0.has_value()) d_c0 = ccar.unsqueeze(0);
  std::tie(d_data, d_w_ih, d_w_hh) = weight_grads(dg2, data, h_prev, w_ih);
  std::tie(d_b_ih, d_b_hh) = bias_grads(dg2, b_ih, b_hh);
}

void aten_gru_backward(const Steps& s, const std::vector<int64_t>& order, const Tensor& data, const Tensor& w_ih,
                       const Tensor& w_hh, const Opt& b_ih, const Opt& b_hh, const Tensor& workspace,
                       const Opt& grad_out, const Tensor& h_prev, const Tensor& hcar, int64_t H, Tensor& d_data,
                       Tensor& d_w_ih, Tensor& d_w_hh, Tensor& d_b_ih, Tensor& d_b_hh) {
  const int64_t N = s.N;
  const auto opts = data.options();
  const Tensor r = workspace.narrow(1, 0, H), z = workspace.narrow(1, H, H);
  const Tensor hn = workspace.narrow(1, 2 * H, H), nn = workspace.narrow(1, 3 * H, H);
  // As native_layer._gates_backward: dL/d(recurrent gates) =
  // dh * (k_r, k_z, a_n r), written into dg, scaled in the loop.
  const Tensor dg = at::empty({N, 3, H}, opts);
  Tensor dg_r = dg.select(1, 0), dg_z = dg.select(1, 1), dg_n = dg.select(1, 2);
  Tensor a_n = at::mul(nn, nn).neg_().add_(1);
  a_n.mul_(one_minus(dg_z, z));  // (1 - n^2)(1 - z): through n
  dg_z.mul_(z).mul_(at::sub_out(dg_r, h_prev, nn));  // (1 - z) z (h_prev - n)
  one_minus(dg_r, r).mul_(r).mul_(hn).mul_(a_n);  // (1 - r) r hn a_n
  at::mul_out(dg_n, a_n, r);  // the recurrent side of n is scaled by r
  const Tensor dg2 = dg.view({N, 3 * H});
  const Tensor dh_all = at::empty({N, H}, opts);
  for (const int64_t t : order) {
    const int64_t r0 = s.off[t], n = s.bs[t];
    Tensor dh = dh_all.narrow(0, r0, n);
    incoming(dh, grad_out, hcar, r0, n);
    dg.narrow(0, r0, n).mul_(dh.unsqueeze(1));
    Tensor hc = hcar.narrow(0, 0, n);
    at::mul_out(hc, dh, z.narrow(0, r0, n));
    hc.addmm_(dg2.narrow(0, r0, n), w_hh);  // dL/dh_prev = dh * z + dgh @ W_hh
  }
  // The input side differs from dg only in n's third (not scaled by r):
  // its gradients as GEMMs over dg's r | z columns and this one.
  const Tensor dgi_n = a_n.mul_(dh_all), dg_rz = dg2.narrow(1, 0, 2 * H);
  if (use_onednn(data)) {  // as packed_layer_py_backward._gru_weight_grads
    d_data = onednn_rows(dg_rz, w_ih.narrow(0, 0, 2 * H).t(), Tensor())
                 .add_(onednn_rows(dgi_n, w_ih.narrow(0, 2 * H, H).t(), Tensor()));
    d_w_ih = at::cat({onednn_t_rows(dg_rz, {data})[0], onednn_t_rows(dgi_n, {data})[0]});
    d_w_hh = onednn_t_rows(dg2, {h_prev})[0];
  } else {
    d_data = at::mm(dg_rz, w_ih.narrow(0, 0, 2 * H)).addmm_(dgi_n, w_ih.narrow(0, 2 * H, H));
    d_w_ih = at::empty(w_ih.sizes(), opts);
    Tensor d_w_rz = d_w_ih.narrow(0, 0, 2 * H), d_w_n = d_w_ih.narrow(0, 2 * H, H);
    at::mm_out(d_w_rz, dg_rz.t(), data);
    at::mm_out(d_w_n, dgi_n.t(), data);
    d_w_hh = at::mm(dg2.t(), h_prev);
  }
  if (b_ih.has_value()) {
    d_b_ih = at::empty({3 * H}, opts);
    Tensor d_b_rz = d_b_ih.narrow(0, 0, 2 * H), d_b_n = d_b_ih.narrow(0, 2 * H, H);
    at::sum_out(d_b_rz, dg_rz, 0);
    at::sum_out(d_b_n, dgi_n, 0);
  }
  if (b_hh.has_value()) d_b_hh = dg2.sum(0);
}

// A plain RNN's: ``quick`` (the raw-pointer loop, fp32 where fast(data)) with
// ``gout``, grad_out made contiguous, else the ATen loop over ``order``.
void aten_rnn_backward(Mode mode, const Steps& s, bool reverse, const std::vector<int64_t>& order, bool quick,
                       const Tensor& gout, const Tensor& data, const Tensor& w_ih, const Tensor& w_hh,
                       const Opt& b_ih, const Opt& b_hh, const Tensor& out, const Opt& grad_out,
                       const Tensor& h_prev, const Tensor& hcar, int64_t B, int64_t H, Tensor& d_data,
                       Tensor& d_w_ih, Tensor& d_w_hh, Tensor& d_b_ih, Tensor& d_b_hh) {
  const auto opts = data.options();
  // d act(pre) / d pre, scaled in place by dL/dh in the loop.
  const Tensor dpre =
      mode == Mode::RNN_RELU ? at::gt(out, 0).to(out.scalar_type()) : at::mul(out, out).neg_().add_(1);
  const Tensor dh_buf = at::empty({B, H}, opts);
  if (quick) {
    wfpass_fast::rnn_backward(backward_rows(s, reverse), H, fp(gout), fp(hcar), fp(dpre), fp(w_hh.contiguous()), fp(dh_buf));
  } else {
    for (const int64_t t : order) {
      const int64_t r0 = s.off[t], n = s.bs[t];
      Tensor dh = dh_buf.narrow(0, 0, n);
      incoming(dh, grad_out, hcar, r0, n);
      Tensor hc = hcar.narrow(0, 0, n);
      at::mm_out(hc, dpre.narrow(0, r0, n).mul_(dh), w_hh);
    }
  }
  std::tie(d_data, d_w_ih, d_w_hh) = weight_grads(dpre, data, h_prev, w_ih);
  std::tie(d_b_ih, d_b_hh) = bias_grads(dpre, b_ih, b_hh);
}

Bw layer_backward(const Tensor& data, const Tensor& batch_sizes, const Tensor& w_ih, const Tensor& w_hh,
                         const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                         const Tensor& out, const Tensor& h_n, const Tensor& c_n, const Tensor& workspace,
                         const Opt& grad_out, const Opt& grad_hn, const Opt& grad_cn, c10::string_view mode_name,
                         bool reverse) {
  const Mode mode = parse_mode(mode_name);
  check_args(mode, w_hr, c0);
  check_weights(mode, data, w_ih, w_hh, b_ih, b_hh, w_hr);
  const Steps s = read_steps(batch_sizes, data.size(0));
  const int64_t N = s.N, B = s.B, H = w_ih.size(0) / gate_count(mode);
  const int64_t Hout = w_hr.has_value() ? w_hr->size(0) : H;
  const int64_t K = workspace_width(mode, H);
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(0) == N && workspace.size(1) == K,
              "wfpass::packed_layer_backward: the workspace has shape ", workspace.sizes(), ", not (", N, ", ", K,
              "): was the forward run with train=False?");
  check_like(workspace, data, "wfpass::packed_layer_backward", "workspace");
  check_grads(mode, data, s, H, Hout, out, grad_out, grad_hn, grad_cn);
  check_state(h0, data, 1, B, Hout, "wfpass::packed_layer_backward", "h0");
  check_state(c0, data, 1, B, H, "wfpass::packed_layer_backward", "c0");
  const auto opts = data.options();
  at::NoGradGuard no_grad;
  if (mode == Mode::LSTM && fast(data))
    return lean_lstm_backward(s, reverse, data, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, workspace, grad_out,
                              grad_hn, grad_cn);
  if (mode == Mode::GRU && fast(data))
    return lean_gru_backward(s, reverse, data, w_ih, w_hh, b_ih, b_hh, h0, out, workspace, grad_out, grad_hn);
  const Tensor h_init = initial_state(h0, data, B, Hout, "h0");
  // Few fresh N-row buffers, no throwaway ones: each costs page faults (the
  // CPU allocator hands large blocks back to the system), so the factors
  // are computed in place into the buffers the loop then scales
  // (packed_layer.py, _packed_layer_backward).
  const auto where = prev_index(s, reverse);
  const Tensor h_prev = gather(out, h_init, where);  // [N, H_out]: the state each row read
  Tensor hcar = carry_from(grad_hn, data, B, Hout);
  // The backward runs the steps in the opposite order of the forward.
  std::vector<int64_t> order(s.T);
  for (int64_t k = 0; k < s.T; ++k) order[k] = reverse ? k : s.T - 1 - k;
  const bool quick = fast(data);  // a plain RNN's; LSTMs and GRUs took lean_*_backward above
  const Tensor gout = quick && grad_out.has_value() ? grad_out->contiguous() : Tensor();
  Tensor d_data, d_w_ih, d_w_hh, d_b_ih = at::empty({0}, opts), d_b_hh = at::empty({0}, opts);
  Tensor d_w_hr = at::empty({0}, opts), d_c0 = at::empty({0}, opts);
  if (mode == Mode::LSTM)
    aten_lstm_backward(s, order, where, data, w_ih, w_hh, b_ih, b_hh, w_hr, c0, workspace, grad_out, grad_cn, h_prev,
                       hcar, B, H, Hout, d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_c0);
  else if (mode == Mode::GRU)
    aten_gru_backward(s, order, data, w_ih, w_hh, b_ih, b_hh, workspace, grad_out, h_prev, hcar, H, d_data, d_w_ih,
                      d_w_hh, d_b_ih, d_b_hh);
  else
    aten_rnn_backward(mode, s, reverse, order, quick, gout, data, w_ih, w_hh, b_ih, b_hh, out, grad_out, h_prev,
                      hcar, B, H, d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh);
  Tensor d_h0 = h0.has_value() ? hcar.unsqueeze(0) : at::empty({0}, opts);
  return {d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_h0, d_c0};
}

// The gradient of data has data's shape: [T, B, I] for a full batch.
Bw packed_layer_backward(const Tensor& data, const Tensor& batch_sizes, const Tensor& w_ih, const Tensor& w_hh,
                         const Opt& b_ih, const Opt& b_hh, const Opt& w_hr, const Opt& h0, const Opt& c0,
                         const Tensor& out, const Tensor& h_n, const Tensor& c_n, const Tensor& workspace,
                         const Opt& grad_out, const Opt& grad_hn, const Opt& grad_cn, c10::string_view mode_name,
                         bool reverse) {
  const auto rows = as_rows(data, batch_sizes, "wfpass::packed_layer_backward");
  Bw r = layer_backward(rows.first, rows.second, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, workspace,
                        grad_out, grad_hn, grad_cn, mode_name, reverse);
  if (data.dim() == 3) std::get<0>(r) = std::get<0>(r).view(data.sizes());
  return r;
}

// wfpass::packed_bilayer (and its twin packed_bilayer_fw, the same without
// an autograd kernel): both directions of a bidirectional layer in one call,
// into one [N, 2 Hout] output (packed_layer.py), and its backward. On the
// raw-pointer path each direction writes its column half in place (no
// concatenation of two fresh outputs) and, where torch has two or more
// threads, the two directions run at once, one per OpenMP thread: each
// step's GEMMs are too small to split, but the directions are independent,
// forward and backward. Elsewhere: the two packed_layer calls one after the
// other and a concatenation, as before.
struct Pair {
  at::TensorList weights;
  int64_t per;
  bool has_biases, has_proj;
  Pair(at::TensorList w, bool biases, bool proj)
      : weights(w), per(2 + (biases ? 2 : 0) + (proj ? 1 : 0)), has_biases(biases), has_proj(proj) {
    TORCH_CHECK(static_cast<int64_t>(w.size()) == 2 * per, "wfpass::packed_bilayer: expected ", 2 * per,
                " weights (both directions), got ", w.size());
  }
  const Tensor& w(int64_t d, int64_t i) const { return weights[d * per + i]; }
  Opt opt(int64_t d, int64_t i, bool has) const { return has ? Opt(w(d, i)) : Opt(); }
  Opt b_ih(int64_t d) const { return opt(d, 2, has_biases); }
  Opt b_hh(int64_t d) const { return opt(d, 3, has_biases); }
  Opt w_hr(int64_t d) const { return opt(d, per - 1, has_proj); }
  int64_t hout() const { return has_proj ? w(0, per - 1).size(0) : w(0, 1).size(1); }
};

Opt half(const Opt& t, int64_t dim, int64_t d, int64_t size) {
  return t.has_value() && t->numel() > 0 ? Opt(t->narrow(dim, d * size, size)) : Opt();
}

// Both directions' weights, batch_sizes and the states (where given: an
// empty tensor stands for none, as in half()) checked before either
// direction starts: each checks its own again, but on its own thread, where
// the other may have begun. Returns the steps, H and H_out.
struct PairSizes {
  Steps s;
  int64_t H, Hout;
};

PairSizes check_pair(const Pair& p, Mode mode, const Tensor& data, const Tensor& batch_sizes, const Opt& h0,
                     const Opt& c0, const char* op) {
  const auto given = [](const Opt& t) { return t.has_value() && t->numel() > 0 ? t : Opt(); };
  check_args(mode, p.w_hr(0), given(c0));
  const auto hw = check_weights(mode, data, p.w(0, 0), p.w(0, 1), p.b_ih(0), p.b_hh(0), p.w_hr(0));
  TORCH_CHECK(check_weights(mode, data, p.w(1, 0), p.w(1, 1), p.b_ih(1), p.b_hh(1), p.w_hr(1)) == hw, op,
              ": the two directions' weights have different hidden sizes");
  PairSizes r{read_steps(batch_sizes, data.size(0)), hw.first, hw.second};
  check_state(given(h0), data, 2, r.s.B, r.Hout, op, "h0");
  check_state(given(c0), data, 2, r.s.B, r.H, op, "c0");
  return r;
}

// run(0) and run(1): at once on two OpenMP threads where `together` and
// torch has them, else one after the other.
template <typename F>
void both(bool together, const F& run) {
#ifdef _OPENMP
  if (together && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t d = begin; d < end; ++d) run(d);
    });
    return;
  }
#endif
  run(0);
  run(1);
}

using Bi = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

Bi packed_bilayer(const Tensor& data_in, const Tensor& batch_sizes_in, at::TensorList weights, const Opt& h0,
                  const Opt& c0, c10::string_view mode_name, bool has_biases, bool has_proj, bool train) {
  const auto rows = as_rows(data_in, batch_sizes_in, "wfpass::packed_bilayer");
  const Tensor &data = rows.first, &batch_sizes = rows.second;
  const Pair p(weights, has_biases, has_proj);
  check_pair(p, parse_mode(mode_name), data, batch_sizes, h0, c0, "wfpass::packed_bilayer");
  const int64_t Hout = p.hout();
  const bool in_place = fast(data);
  const Tensor out = in_place ? at::empty({data.size(0), 2 * Hout}, data.options()) : Tensor();
  Fw r[2];
  both(in_place, [&](int64_t d) {
    r[d] = layer_forward(data, batch_sizes, p.w(d, 0), p.w(d, 1), p.b_ih(d), p.b_hh(d), p.w_hr(d), half(h0, 0, d, 1),
                         half(c0, 0, d, 1), mode_name, d == 1, train, in_place ? out.narrow(1, d * Hout, Hout) : Tensor());
  });
  const bool lstm = parse_mode(mode_name) == Mode::LSTM;
  return {in_place ? out : at::cat({std::get<0>(r[0]), std::get<0>(r[1])}, 1),
          at::cat({std::get<1>(r[0]), std::get<1>(r[1])}, 0),
          lstm ? at::cat({std::get<2>(r[0]), std::get<2>(r[1])}, 0) : at::empty({0}, data.options()),
          std::get<3>(r[0]), std::get<3>(r[1])};
}

// Each direction's packed_layer_backward, the two data gradients summed.
std::tuple<Tensor, std::vector<Tensor>, Tensor, Tensor> packed_bilayer_backward(
    const Tensor& data_in, const Tensor& batch_sizes_in, at::TensorList weights, const Opt& h0, const Opt& c0,
    const Tensor& out, const Tensor& h_n, const Tensor& c_n, const Tensor& ws_f, const Tensor& ws_b,
    const Opt& grad_out, const Opt& grad_hn, const Opt& grad_cn, c10::string_view mode_name, bool has_biases,
    bool has_proj) {
  const auto rows = as_rows(data_in, batch_sizes_in, "wfpass::packed_bilayer_backward");
  const Tensor &data = rows.first, &batch_sizes = rows.second;
  const Pair p(weights, has_biases, has_proj);
  const Mode mode = parse_mode(mode_name);
  const char* op = "wfpass::packed_bilayer_backward";
  const PairSizes z = check_pair(p, mode, data, batch_sizes, h0, c0, op);
  const int64_t Hout = p.hout(), N = z.s.N, K = workspace_width(mode, z.H);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == 2 * Hout, op, ": out must have shape (", N, ", ",
              2 * Hout, "), got ", out.sizes());
  TORCH_CHECK(h_n.dim() == 3 && h_n.size(0) == 2 && (mode != Mode::LSTM || (c_n.dim() == 3 && c_n.size(0) == 2)), op,
              ": h_n and c_n must hold both directions, got ", h_n.sizes(), " and ", c_n.sizes());
  for (const Tensor& ws : {ws_f, ws_b})
    TORCH_CHECK(ws.dim() == 2 && ws.size(0) == N && ws.size(1) == K, op, ": the workspaces must have shape (", N,
                ", ", K, "), got ", ws_f.sizes(), " and ", ws_b.sizes(), ": was the forward run with train=False?");
  if (grad_out.has_value() && grad_out->numel() > 0)
    TORCH_CHECK(grad_out->dim() == 2 && grad_out->size(0) == N && grad_out->size(1) == 2 * Hout, op,
                ": grad_out must have shape (", N, ", ", 2 * Hout, "), got ", grad_out->sizes());
  if (grad_hn.has_value() && grad_hn->numel() > 0) check_state(grad_hn, data, 2, z.s.B, Hout, op, "grad_hn");
  if (mode == Mode::LSTM && grad_cn.has_value() && grad_cn->numel() > 0)
    check_state(grad_cn, data, 2, z.s.B, z.H, op, "grad_cn");
  const bool lstm = mode == Mode::LSTM;
  Bw r[2];
  both(fast(data), [&](int64_t d) {
    r[d] = layer_backward(data, batch_sizes, p.w(d, 0), p.w(d, 1), p.b_ih(d), p.b_hh(d), p.w_hr(d),
                                 half(h0, 0, d, 1), half(c0, 0, d, 1), out.narrow(1, d * Hout, Hout),
                                 h_n.narrow(0, d, 1), lstm ? c_n.narrow(0, d, 1) : c_n, d == 0 ? ws_f : ws_b,
                                 half(grad_out, 1, d, Hout), half(grad_hn, 0, d, 1),
                                 lstm ? half(grad_cn, 0, d, 1) : Opt(), mode_name, d == 1);
  });
  std::vector<Tensor> d_w;
  for (int64_t d = 0; d < 2; ++d) {
    d_w.push_back(std::get<1>(r[d]));
    d_w.push_back(std::get<2>(r[d]));
    if (has_biases) {
      d_w.push_back(std::get<3>(r[d]));
      d_w.push_back(std::get<4>(r[d]));
    }
    if (has_proj) d_w.push_back(std::get<5>(r[d]));
  }
  const auto empty = at::empty({0}, data.options());
  return {at::add(std::get<0>(r[0]), std::get<0>(r[1])).view(data_in.sizes()), d_w,
          h0.has_value() ? at::cat({std::get<6>(r[0]), std::get<6>(r[1])}, 0) : empty,
          lstm && c0.has_value() ? at::cat({std::get<7>(r[0]), std::get<7>(r[1])}, 0) : empty};
}

}  // namespace

namespace wfpass_varlen {

bool short_lstm_on() {
  // WFPASS_RNN_AS_IS=0 turns this off too.
  static const bool on = as_is_setting() != AsIs::off && wfpass_fast::fast_loop() && wfpass_direct::available();
  return on;
}

bool takes_short_lstm(const Tensor& input, const Tensor& w_hh, int64_t hidden_size) {
  return short_lstm_on() && input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 3 &&
         input.size(0) * input.size(1) <= kShortLstmRows && input.size(0) * input.size(1) > 0 &&
         w_hh.size(1) == hidden_size && fast(input);
}

std::tuple<Tensor, Tensor, Tensor> short_lstm(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh,
                                              const Opt& b_ih, const Opt& b_hh, const Opt& hx, const Opt& cx,
                                              bool reverse) {
  const int64_t T = input.size(0), B = input.size(1);
  Fw r = packed_layer(input, at::empty({0}, input.options().dtype(at::kLong)), w_ih, w_hh, b_ih, b_hh,
                      std::nullopt, hx, cx, "LSTM", reverse, false);
  return {std::get<0>(r).view({T, B, std::get<0>(r).size(-1)}), std::get<1>(r), std::get<2>(r)};
}

}  // namespace wfpass_varlen

TORCH_LIBRARY_IMPL(wfpass, CPU, m) {
  m.impl("packed_layer", packed_layer);
  m.impl("packed_layer_fw", packed_layer);
  m.impl("packed_bilayer", packed_bilayer);
  m.impl("packed_bilayer_fw", packed_bilayer);
  m.impl("packed_bilayer_backward", packed_bilayer_backward);
  m.impl("packed_layer_backward", packed_layer_backward);
}

// Whether the raw-pointer loop (fast_rnn.cpp) serves fp32 calls in this
// process: for the report and the tests (wfpass/native, fast_loop).
// And whether packed_bilayer_fw can run its two directions at once (built
// with OpenMP: wfpass/native, parallel_directions). And the rows up to
// which an inference lstm_layer_fw call runs on the loop (short_lstm.h;
// 0: never here), for the report's words (wfpass/native, short_lstm_rows).
TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def(WFPASS_SCHEMA_native_fast_loop, []() { return wfpass_fast::fast_loop(); });
  m.def(WFPASS_SCHEMA_native_short_lstm_rows,
        []() -> int64_t { return wfpass_varlen::short_lstm_on() ? wfpass_varlen::kShortLstmRows : 0; });
  m.def(WFPASS_SCHEMA_native_fast_isa, []() { return std::string(wfpass_fast::fast_isa()); });
  m.def(WFPASS_SCHEMA_native_openmp, []() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}
