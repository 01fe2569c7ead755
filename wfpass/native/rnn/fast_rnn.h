// Raw-pointer pieces of the packed RNN loop (fast_rnn.cpp): the per-step
// recurrent GEMM on oneDNN's small-GEMM ukernel, and each cell's gate math
// as one vector pass over the step's rows (AVX-512F, or AVX2 with FMA).
// packed_rnn.cpp calls them where fast_loop() says yes (fp32, such a CPU,
// the ukernel answering), and
// keeps its ATen calls otherwise.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace wfpass_fast {

// Can the step functions below run here? Asked once per process: the CPU
// has AVX-512F or AVX2 with FMA, oneDNN's fp32 ukernel answers a probe, and
// WFPASS_FAST_LOOP is not 0 / false / no / off. fast_isa() names the gate
// math's instruction set: "avx512f", "avx2" (also on an AVX-512 CPU with
// WFPASS_FAST_ISA=avx2), or "" where fast_loop() is false.
bool fast_loop();
const char* fast_isa();

// C[M, N] = A[M, K] . B[K, N] (+ bias[N] on every row, where given), in
// blocks of rows: the big GEMMs over all packed rows, written straight into
// a column block of the workspace (no temporary, no copy).
void gemm_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
               const float* bias, float* C, int64_t ldc, bool add);

// C[M, N] = A^T . B over R rows: A [R, M] (leading dim lda), B [R, N]
// (ldb), C [M, N] (ldc); the weight gradients' GEMMs, whose reduction runs
// over all packed rows. In blocks of 64 rows, each block of A copied
// transposed into tbuf (tn_scratch(R, M) floats), so the ukernel's shapes
// (its cache key) do not depend on R.
int64_t tn_scratch(int64_t R, int64_t M);
void gemm_tn_rows(int64_t R, int64_t M, int64_t N, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc, float* tbuf);

// dst [cols, rows] (leading dim ldd) = src [rows, cols]^T (leading dim lds):
// the weights' per-call transposes the loop's GEMMs read (W^T, as the
// ukernel takes B as [K, N]). In 8 x 8 blocks transposed in AVX registers,
// the edges element by element. Only where fast_loop() is true.
void transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd);

// A linear from a copy of its weight in panels: W [N, K] row-major as
// ceil(N / kPanel) blocks of [K, kPanel] (W^T's columns, kPanel at a time,
// zero past N), the layout the ukernel reads B in. panel_pack makes the copy
// ([panels_of(N), K, kPanel] floats); panel_linear computes Y [M, N] (leading dim
// ldy) = X [M, K] (leading dim ldx) . W^T (+ bias[N] on every row, where
// given), one ukernel call per panel and block of up to 64 rows, the panels
// shared out among torch's threads where there is enough work. Only where
// fast_loop() is true.
constexpr int64_t kPanel = 64;
inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }
void panel_pack(int64_t N, int64_t K, const float* w, int64_t ldw, float* out);
void panel_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* panels,
                  const float* bias, float* y, int64_t ldy);

// The recurrent weight a forward step's GEMM reads: either W_hh^T ([Hout,
// G], leading dim G: the per-call transpose oneDNN's ukernel takes B in),
// or W_hh as it is ([G, Hout], leading dim ldw) through the direct linear
// kernel (linear/direct.h), its [n, G] product written to tmp (B x G floats)
// and added into the step's rows. The second reads no copy of the weight:
// at a few rows a step the transposes cost more than the loop (see
// varlen_rnn.cpp, lean_forward).
struct Recurrent {
  const float* t = nullptr;
  const float* w = nullptr;
  int64_t ldw = 0;
  float* tmp = nullptr;
};

// One step in processing order (packed_rnn.cpp, schedule): its rows
// r0 : r0 + n; the first m rows of the state it reads are rows p0 : p0 + m
// of the step before it, the rest rows m : n of the initial state.
struct Step {
  int64_t r0, n, p0, m;
};

// The recurrent half of wfpass::packed_layer's forward, after the input
// projection (already in ws's gate columns, or in out for a plain RNN).
// Row-major: ws [N, 6H] (LSTM) / [N, 4H] (GRU), contiguous; out [N, Hout]
// with leading dim ldo (2 Hout: one direction's half of a bidirectional
// layer's output); the initial states with leading dims ldh / ldc; whh
// the recurrent weight (Recurrent), whr_t = W_hr^T [H, Hout] or null;
// hbuf, cbuf, hpre: [B, *]
// scratch rows.
void lstm_forward(const std::vector<Step>& steps, int64_t H, int64_t Hout, float* ws, float* out, int64_t ldo,
                  const float* h0, int64_t ldh, const float* c0, int64_t ldc, const Recurrent& whh, const float* whr_t,
                  float* hbuf, float* cbuf, float* hpre);
void gru_forward(const std::vector<Step>& steps, int64_t H, float* ws, float* out, int64_t ldo, const float* h0,
                 int64_t ldh, const Recurrent& whh, float* hbuf);
void rnn_forward(const std::vector<Step>& steps, int64_t H, float* out, int64_t ldo, const float* h0, int64_t ldh,
                 const Recurrent& whh, float* hbuf, bool relu);

// The backward loops. g: grad_out [N, Hout] or null; hcar [B, Hout] / ccar
// [B, H]: the carried gradients (in: of the final states; out: of the
// initial ones); w_hh [G*H, Hout], w_hr [Hout, H] or null as the module
// holds them.
// LSTM: over the forward's steps in reverse, the gates' gradients into dg
// [N, 4H] from the workspace ws [N, 6H] (i|f|g|o|c|tanh c) and each step's
// c_prev (rows of ws's c, or of c0 with leading dim ldc; cbuf [B, H]
// scratch); dh: [N, Hout] with a projection (every row's dL/dh is kept),
// else [B, Hout]; dhp [B, H] scratch.
void lstm_backward(const std::vector<Step>& steps, int64_t H, int64_t Hout, const float* g, float* hcar, float* ccar,
                   const float* ws, const float* c0, int64_t ldc, float* cbuf, float* dg, const float* w_hh,
                   const float* w_hr, float* dh, float* dhp);
using Rows = std::vector<std::pair<int64_t, int64_t>>;
// GRU and plain RNN: over (r0, n) in the backward's order.
// GRU: dg [N, 3H] holding (k_r, k_z, a_n r), ws [N, 4H]; dh [N, H] gets every row's dL/dh.
void gru_backward(const Rows& rows, int64_t H, const float* g, float* hcar, const float* ws, float* dg,
                  const float* w_hh, float* dh);
// Plain RNN: dpre [N, H] holding act'(pre), scaled by dL/dh; dh [B, H] scratch.
void rnn_backward(const Rows& rows, int64_t H, const float* g, float* hcar, float* dpre, const float* w_hh,
                  float* dh);

}  // namespace wfpass_fast
