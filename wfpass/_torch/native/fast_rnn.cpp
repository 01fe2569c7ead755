// Raw-pointer pieces of the packed RNN loop; see fast_rnn.h for what each
// computes. Why they exist (benchmarks/profile_packed.py, one thread, the
// bench's 2-layer bidirectional LSTM, training step): the ATen loop spent
// 15 ms a step in ~800 per-step GEMMs through ATen's mm (MKL, 17-23 us at
// 16 x 128 x 512 on this AMD EPYC) and 8 ms making the narrow() views the
// per-step calls need. oneDNN's fp32 small-GEMM ukernel
// (at::native::cpublas::brgemm, exported by libtorch_cpu, checked on torch
// 2.11.0, 2.13.0 and 2.15.0) runs that GEMM in 8 us, on raw pointers; the gate math becomes one
// pass over the step's rows instead of eight ATen calls.
//
// The functions carry __attribute__((target("avx512f"))) and run only where
// fast_loop() found AVX-512F at run time, so the library itself is built
// for any x86-64 CPU. exp, sigmoid and tanh are Cephes' single-precision
// formulas (max error ~2 ulp for exp); they differ from ATen's (SLEEF) in
// the last bits, so the C++ and Python kernels agree to rounding, not
// bit for bit, on this path.
#include "fast_rnn.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cctype>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WFPASS_X86 1
#endif

namespace wfpass_fast {

namespace {

// C[m, n] = A[m, k] . B[k, n] (+ C when add); row-major, leading dims given.
void gemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, A, B, C, false);
}

bool probe() {
  // Off as WFPASS_NATIVE is (wfpass/_torch/native/__init__.py): 0, false, no, off.
  if (const char* env = std::getenv("WFPASS_FAST_LOOP")) {
    std::string v(env);
    for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    v.erase(0, v.find_first_not_of(" \t"));
    v.erase(v.find_last_not_of(" \t") + 1);
    if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  }
#ifdef WFPASS_X86
  if (!__builtin_cpu_supports("avx512f")) return false;
  // The ukernel refuses (throws) where oneDNN's ukernel API is not built in
  // or the CPU is not one it has kernels for; check it answers, and right.
  try {
    const float a[2] = {1.f, 2.f}, b[2] = {3.f, 4.f};
    float c[1] = {0.5f};
    gemm(1, 1, 2, a, 2, b, 1, c, 1, true);
    return c[0] == 11.5f;
  } catch (const std::exception&) {
    return false;
  }
#else
  return false;
#endif
}

}  // namespace

void gemm_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
               const float* bias, float* C, int64_t ldc, bool add) {
  // 64 rows a call: the ukernel's speed was flat from 16 rows to all of
  // them (250-260 GFLOPS at 957 x 128 x 512, one thread); a block keeps the
  // bias rows just written in cache for the GEMM that adds to them.
  // The blocks are independent: on torch's threads where it has several
  // (serial inside a parallel region, e.g. a bidirectional layer's two
  // directions already running at once).
  constexpr int64_t kRows = 64;
  at::parallel_for(0, (M + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * kRows; i < std::min(M, b1 * kRows); i += kRows) {
      const int64_t m = std::min(kRows, M - i);
      float* c = C + i * ldc;
      if (bias != nullptr && !add)
        for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldc, bias, N * sizeof(float));
      gemm(m, N, K, A + i * lda, lda, B, ldb, c, ldc, add || bias != nullptr);
    }
  });
}

// Blocks of 64 rows: what a reduction over R rows hands the ukernel. Why
// blocks: ATen keeps one JIT kernel per shape (M, N, K, lda, ldb, ldc, ...)
// in a thread_local map it never empties, and oneDNN's linear, which ran
// these GEMMs before, one primitive per shape in ideep's and oneDNN's
// caches (1,024 each, ~0.5 MB a shape at these sizes): with the batch size
// and lengths changing every step, a training run grew by hundreds of MB
// (docs/rnn.md, "Memory"). Here K is 64, or the last block's 1..63, and lda
// 64: at most 64 kernels for each (M, N), whatever R is.
constexpr int64_t kTnRows = 64;

int64_t tn_scratch(int64_t R, int64_t M) {
  return (R + kTnRows - 1) / kTnRows * kTnRows * M;
}

void gemm_tn_rows(int64_t R, int64_t M, int64_t N, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc, float* tbuf) {
  if (R == 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(float));
    return;
  }
  const int64_t blocks = (R + kTnRows - 1) / kTnRows;
  // tbuf[b] = (A's rows of block b)^T, [M, 64], 16 of its rows at a time.
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * kTnRows, k = std::min(kTnRows, R - r0);
    float* t = tbuf + b * M * kTnRows;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t me = std::min<int64_t>(16, M - m0);
      for (int64_t r = 0; r < k; ++r) {
        const float* src = A + (r0 + r) * lda + m0;
        for (int64_t m = 0; m < me; ++m) t[(m0 + m) * kTnRows + r] = src[m];
      }
    }
  }
  // C's column blocks over torch's threads (one block on one thread, or
  // inside a parallel region), each summing over all row blocks.
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t cols = threads > 1 ? (std::max<int64_t>(64, (N + threads - 1) / threads) + 15) / 16 * 16 : N;
  at::parallel_for(0, (N + cols - 1) / cols, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t j = c0 * cols; j < std::min(N, c1 * cols); j += cols) {
      const int64_t n = std::min(cols, N - j);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * kTnRows, k = std::min(kTnRows, R - r0);
        gemm(M, n, k, tbuf + b * M * kTnRows, kTnRows, B + r0 * ldb + j, ldb, C + j, ldc, b > 0);
      }
    }
  });
}

bool fast_loop() {
  static const bool ok = probe();
  return ok;
}

#ifdef WFPASS_X86
namespace {

#define WF_T __attribute__((target("avx512f"), always_inline)) inline
#define WF_F __attribute__((target("avx512f")))

WF_T __m512 splat(float v) { return _mm512_set1_ps(v); }

// Lanes j .. j + 16 of a row of width W: all, or the tail's.
WF_T __mmask16 lanes(int64_t j, int64_t W) {
  const int64_t w = W - j;
  return w >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << w) - 1u);
}

WF_T __m512 ld(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
WF_T void st(__mmask16 m, float* p, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

// Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7
// polynomial, times 2^n (scalef). NaN stays NaN.
WF_T __m512 exp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512 y = _mm512_min_ps(_mm512_max_ps(x, splat(-87.5f)), splat(88.5f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, splat(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(0.693359375f), y);
  r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  __m512 p = splat(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, splat(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, splat(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, splat(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, splat(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, splat(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, splat(1.f)));
  return _mm512_mask_blend_ps(nan, _mm512_scalef_ps(p, n), x);
}

WF_T __m512 sigmoid16(__m512 x) {
  const __m512 one = splat(1.f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// Cephes tanhf: x + x^3 P(x^2) below |x| = 0.625, else 1 - 2 / (exp(2|x|) + 1)
// with x's sign (written through exp(-2|x|) <= 1, so it cannot overflow).
WF_T __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x), one = splat(1.f);
  const __m512 e = exp16(_mm512_mul_ps(ax, splat(-2.f)));
  __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  // Copy x's sign bit onto big (integer ops: the float ones need AVX-512DQ).
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), sign));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = splat(-5.70498872745E-3f);
  p = _mm512_fmadd_ps(p, z, splat(2.06390887954E-2f));
  p = _mm512_fmadd_ps(p, z, splat(-5.37397155531E-2f));
  p = _mm512_fmadd_ps(p, z, splat(1.33314422036E-1f));
  p = _mm512_fmadd_ps(p, z, splat(-3.33332819422E-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, splat(0.625f), _CMP_LT_OQ), big, small);
}

WF_F static void lstm_step(int64_t n, int64_t H, float* ws, const float* c_prev, int64_t ldcp, float* h, int64_t ldh) {
  for (int64_t r = 0; r < n; ++r) {
    float* w = ws + r * 6 * H;
    const float* cp = c_prev + r * ldcp;
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      const __m512 i = sigmoid16(ld(m, w + j)), f = sigmoid16(ld(m, w + H + j));
      const __m512 g = tanh16(ld(m, w + 2 * H + j)), o = sigmoid16(ld(m, w + 3 * H + j));
      const __m512 c = _mm512_fmadd_ps(i, g, _mm512_mul_ps(f, ld(m, cp + j)));
      const __m512 tc = tanh16(c);
      st(m, w + j, i);
      st(m, w + H + j, f);
      st(m, w + 2 * H + j, g);
      st(m, w + 3 * H + j, o);
      st(m, w + 4 * H + j, c);
      st(m, w + 5 * H + j, tc);
      st(m, hr + j, _mm512_mul_ps(o, tc));
    }
  }
}

WF_F static void gru_step(int64_t n, int64_t H, float* ws, const float* h_prev, int64_t ldp, float* h, int64_t ldh) {
  for (int64_t r = 0; r < n; ++r) {
    float* w = ws + r * 4 * H;
    const float* hp = h_prev + r * ldp;
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      const __m512 rg = sigmoid16(ld(m, w + j)), z = sigmoid16(ld(m, w + H + j));
      const __m512 nn = tanh16(_mm512_fmadd_ps(rg, ld(m, w + 2 * H + j), ld(m, w + 3 * H + j)));
      st(m, w + j, rg);
      st(m, w + H + j, z);
      st(m, w + 3 * H + j, nn);
      st(m, hr + j, _mm512_fmadd_ps(z, _mm512_sub_ps(ld(m, hp + j), nn), nn));
    }
  }
}

WF_F static void rnn_step(int64_t n, int64_t H, float* h, int64_t ldh, bool relu) {
  for (int64_t r = 0; r < n; ++r) {
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      const __m512 x = ld(m, hr + j);
      st(m, hr + j, relu ? _mm512_max_ps(x, _mm512_setzero_ps()) : tanh16(x));
    }
  }
}

WF_F static void incoming(int64_t n, int64_t W, const float* g, int64_t ldg, const float* carry, int64_t ldc, float* dh,
                   int64_t lddh) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < W; j += 16) {
      const __mmask16 m = lanes(j, W);
      const __m512 c = ld(m, carry + r * ldc + j);
      st(m, dh + r * lddh + j, g ? _mm512_add_ps(ld(m, g + r * ldg + j), c) : c);
    }
}

// dc = ccar + dh o (1 - tanh(c)^2); the pre-activations' gradients
// dc g i (1 - i), dc c_prev f (1 - f), dc i (1 - g^2), dh tanh(c) o (1 - o)
// into dg; ccar = dc f (dL/dc_prev).
WF_F static void lstm_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, const float* ws,
                                    const float* cp, int64_t ldcp, float* dg, float* ccar) {
  const __m512 one = splat(1.f);
  for (int64_t r = 0; r < n; ++r) {
    const float* w = ws + r * 6 * H;
    float* d = dg + r * 4 * H;
    float* cc = ccar + r * H;
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      const __m512 h = ld(m, dh + r * lddh + j), i = ld(m, w + j), f = ld(m, w + H + j);
      const __m512 g = ld(m, w + 2 * H + j), o = ld(m, w + 3 * H + j), tc = ld(m, w + 5 * H + j);
      const __m512 dc = _mm512_fmadd_ps(_mm512_mul_ps(h, o), _mm512_fnmadd_ps(tc, tc, one), ld(m, cc + j));
      st(m, d + j, _mm512_mul_ps(_mm512_mul_ps(dc, g), _mm512_fnmadd_ps(i, i, i)));
      st(m, d + H + j, _mm512_mul_ps(_mm512_mul_ps(dc, ld(m, cp + r * ldcp + j)), _mm512_fnmadd_ps(f, f, f)));
      st(m, d + 2 * H + j, _mm512_mul_ps(_mm512_mul_ps(dc, i), _mm512_fnmadd_ps(g, g, one)));
      st(m, d + 3 * H + j, _mm512_mul_ps(_mm512_mul_ps(h, tc), _mm512_fnmadd_ps(o, o, o)));
      st(m, cc + j, _mm512_mul_ps(dc, f));
    }
  }
}

WF_F static void gru_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, const float* z, int64_t ldz,
                            float* dg, float* hcar) {
  for (int64_t r = 0; r < n; ++r) {
    float* d = dg + r * 3 * H;
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      const __m512 h = ld(m, dh + r * lddh + j);
      st(m, d + j, _mm512_mul_ps(ld(m, d + j), h));
      st(m, d + H + j, _mm512_mul_ps(ld(m, d + H + j), h));
      st(m, d + 2 * H + j, _mm512_mul_ps(ld(m, d + 2 * H + j), h));
      st(m, hcar + r * H + j, _mm512_mul_ps(h, ld(m, z + r * ldz + j)));
    }
  }
}

WF_F static void rnn_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, float* dpre, int64_t ldp) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = lanes(j, H);
      float* p = dpre + r * ldp + j;
      st(m, p, _mm512_mul_ps(ld(m, p), ld(m, dh + r * lddh + j)));
    }
}


// The rows a step reads its state from, as a pointer and leading dim; where
// sequences join (a reversed step) the two pieces are copied into buf.
const float* prev_rows(const float* states, int64_t lds, const float* init, int64_t ldi, float* buf, int64_t W,
                       const Step& st, int64_t& ld) {
  if (st.m == st.n) {
    ld = lds;
    return states + st.p0 * lds;
  }
  if (st.m == 0) {
    ld = ldi;
    return init;
  }
  for (int64_t r = 0; r < st.m; ++r) std::memcpy(buf + r * W, states + (st.p0 + r) * lds, W * sizeof(float));
  for (int64_t r = st.m; r < st.n; ++r) std::memcpy(buf + r * W, init + r * ldi, W * sizeof(float));
  ld = W;
  return buf;
}

}  // namespace

void lstm_forward(const std::vector<Step>& steps, int64_t H, int64_t Hout, float* ws, float* out, int64_t ldo,
                  const float* h0, int64_t ldh, const float* c0, int64_t ldc, const float* whh_t, const float* whr_t,
                  float* hbuf, float* cbuf, float* hpre) {
  const int64_t G = 4 * H, L = 6 * H;
  for (const Step& st : steps) {
    int64_t lh = 0, lc = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, Hout, st, lh);
    const float* cp = prev_rows(ws + 4 * H, L, c0, ldc, cbuf, H, st, lc);
    float* w = ws + st.r0 * L;
    float* h = out + st.r0 * ldo;
    gemm(st.n, G, Hout, hp, lh, whh_t, G, w, L, true);
    if (whr_t != nullptr) {
      lstm_step(st.n, H, w, cp, lc, hpre, H);
      gemm(st.n, Hout, H, hpre, H, whr_t, Hout, h, ldo, false);
    } else {
      lstm_step(st.n, H, w, cp, lc, h, ldo);
    }
  }
}

void gru_forward(const std::vector<Step>& steps, int64_t H, float* ws, float* out, int64_t ldo, const float* h0,
                 int64_t ldh, const float* whh_t, float* hbuf) {
  for (const Step& st : steps) {
    int64_t lh = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, H, st, lh);
    float* w = ws + st.r0 * 4 * H;
    gemm(st.n, 3 * H, H, hp, lh, whh_t, 3 * H, w, 4 * H, true);  // into r | z | hn
    gru_step(st.n, H, w, hp, lh, out + st.r0 * ldo, ldo);
  }
}

void rnn_forward(const std::vector<Step>& steps, int64_t H, float* out, int64_t ldo, const float* h0, int64_t ldh,
                 const float* whh_t, float* hbuf, bool relu) {
  for (const Step& st : steps) {
    int64_t lh = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, H, st, lh);
    float* h = out + st.r0 * ldo;
    gemm(st.n, H, H, hp, lh, whh_t, H, h, ldo, true);
    rnn_step(st.n, H, h, ldo, relu);
  }
}

void lstm_backward(const std::vector<Step>& steps, int64_t H, int64_t Hout, const float* g, float* hcar, float* ccar,
                   const float* ws, const float* c0, int64_t ldc, float* cbuf, float* dg, const float* w_hh,
                   const float* w_hr, float* dh, float* dhp) {
  const int64_t G = 4 * H;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {  // the forward's steps, last first
    const int64_t r0 = it->r0, n = it->n;
    float* d = dh + (w_hr != nullptr ? r0 * Hout : 0);
    incoming(n, Hout, g != nullptr ? g + r0 * Hout : nullptr, Hout, hcar, Hout, d, Hout);
    const float* x = d;
    int64_t lx = Hout;
    if (w_hr != nullptr) {  // through the projection: dL/d(o * tanh(c))
      gemm(n, H, Hout, d, Hout, w_hr, H, dhp, H, false);
      x = dhp;
      lx = H;
    }
    int64_t lc = 0;
    const float* cp = prev_rows(ws + 4 * H, 6 * H, c0, ldc, cbuf, H, *it, lc);
    lstm_step_backward(n, H, x, lx, ws + r0 * 6 * H, cp, lc, dg + r0 * G, ccar);
    gemm(n, Hout, G, dg + r0 * G, G, w_hh, Hout, hcar, Hout, false);  // dL/dh_prev
  }
}

void gru_backward(const Rows& rows, int64_t H, const float* g, float* hcar, const float* ws, float* dg,
                  const float* w_hh, float* dh) {
  for (const auto& [r0, n] : rows) {
    float* d = dh + r0 * H;
    incoming(n, H, g != nullptr ? g + r0 * H : nullptr, H, hcar, H, d, H);
    gru_step_backward(n, H, d, H, ws + r0 * 4 * H + H, 4 * H, dg + r0 * 3 * H, hcar);
    gemm(n, H, 3 * H, dg + r0 * 3 * H, 3 * H, w_hh, H, hcar, H, true);  // dh * z + dg @ W_hh
  }
}

void rnn_backward(const Rows& rows, int64_t H, const float* g, float* hcar, float* dpre, const float* w_hh,
                  float* dh) {
  for (const auto& [r0, n] : rows) {
    incoming(n, H, g != nullptr ? g + r0 * H : nullptr, H, hcar, H, dh, H);
    rnn_step_backward(n, H, dh, H, dpre + r0 * H, H);
    gemm(n, H, H, dpre + r0 * H, H, w_hh, H, hcar, H, false);
  }
}

#else  // not x86-64 with GCC/Clang: fast_loop() is false and these are never called.

void lstm_forward(const std::vector<Step>&, int64_t, int64_t, float*, float*, const float*, int64_t, const float*,
                  int64_t, const float*, const float*, float*, float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void gru_forward(const std::vector<Step>&, int64_t, float*, float*, const float*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void rnn_forward(const std::vector<Step>&, int64_t, float*, const float*, int64_t, const float*, float*, bool) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void lstm_backward(const std::vector<Step>&, int64_t, int64_t, const float*, float*, float*, const float*,
                   const float*, int64_t, float*, float*, const float*, const float*, float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void gru_backward(const Rows&, int64_t, const float*, float*, const float*, float*, const float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void rnn_backward(const Rows&, int64_t, const float*, float*, float*, const float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}

#endif

}  // namespace wfpass_fast
