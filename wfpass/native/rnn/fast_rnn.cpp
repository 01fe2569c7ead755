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
// The gate math (fast_gates.h) is compiled twice, for AVX-512F and for
// AVX2 with FMA, each under __attribute__((target(...))); fast_loop() picks
// one at run time (AVX-512F where the CPU has it), so the library itself is
// built for any x86-64 CPU. exp, sigmoid and tanh are Cephes' single-precision
// formulas (max error ~2 ulp for exp); they differ from ATen's (SLEEF) in
// the last bits, so the C++ and Python kernels agree to rounding, not
// bit for bit, on this path.
#include "fast_rnn.h"

#include "../linear/direct.h"

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

// An environment variable's value, lower case and trimmed ("" where unset).
std::string env_word(const char* name) {
  const char* env = std::getenv(name);
  std::string v(env != nullptr ? env : "");
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  return v;
}

enum class Isa { none, avx2, avx512 };

Isa probe() {
  // Off as WFPASS_NATIVE is (wfpass/native/__init__.py): 0, false, no, off.
  const std::string off = env_word("WFPASS_FAST_LOOP");
  if (off == "0" || off == "false" || off == "no" || off == "off") return Isa::none;
#ifdef WFPASS_X86
  Isa isa = Isa::none;
  if (__builtin_cpu_supports("avx512f"))
    isa = Isa::avx512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    isa = Isa::avx2;
  // WFPASS_FAST_ISA=avx2 runs the AVX2 loop on an AVX-512 CPU too: how the
  // tests check both on one machine.
  if (isa == Isa::avx512 && env_word("WFPASS_FAST_ISA") == "avx2") isa = Isa::avx2;
  if (isa == Isa::none) return isa;
  // The ukernel refuses (throws) where oneDNN's ukernel API is not built in
  // or the CPU is not one it has kernels for; check it answers, and right.
  try {
    const float a[2] = {1.f, 2.f}, b[2] = {3.f, 4.f};
    float c[1] = {0.5f};
    gemm(1, 1, 2, a, 2, b, 1, c, 1, true);
    return c[0] == 11.5f ? isa : Isa::none;
  } catch (const std::exception&) {
    return Isa::none;
  }
#else
  return Isa::none;
#endif
}

Isa isa() {
  static const Isa v = probe();
  return v;
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

void panel_pack(int64_t N, int64_t K, const float* w, int64_t ldw, float* out) {
  const int64_t P = panels_of(N);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* d = out + p * K * kPanel;
      const int64_t n = std::min(kPanel, N - p * kPanel);
      if (n < kPanel) std::memset(d, 0, K * kPanel * sizeof(float));
      transpose(n, K, w + p * kPanel * ldw, ldw, d, kPanel);
    }
  });
}

void panel_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* panels,
                  const float* bias, float* y, int64_t ldy) {
  constexpr int64_t kRows = 64;
  const int64_t P = panels_of(N);
  // Panels per thread: at least ~256K multiply-adds each, so a small call
  // (a 384x256 weight at one row: 6 panels of 16K) runs on one thread
  // rather than pay the threads' start for a few microseconds of work.
  constexpr int64_t kMinWork = 1 << 18;
  const int64_t per_panel = std::min(M, kRows) * K * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, per_panel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, n = std::min(kPanel, N - n0);
      const float* B = panels + p * K * kPanel;
      // The panel (K x 64 floats: 64 KB at K 256) stays in cache while
      // every block of rows goes through it.
      for (int64_t i = 0; i < M; i += kRows) {
        const int64_t m = std::min(kRows, M - i);
        float* c = y + i * ldy + n0;
        if (bias != nullptr)
          for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldy, bias + n0, n * sizeof(float));
        gemm(m, n, K, x + i * ldx, ldx, B, kPanel, c, ldy, bias != nullptr);
      }
    }
  });
}

#ifdef WFPASS_X86
namespace {

// One 8 x 8 block: d[j * ldd + i] = s[i * lds + j], in registers (the
// classic unpack / shuffle / permute sequence), 8 loads and 8 stores.
__attribute__((target("avx2"))) void transpose8(const float* s, int64_t lds, float* d, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(d + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(d + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

}  // namespace
#endif

void transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd) {
  // 64 x 64 tiles of 8 x 8 blocks: a tile's 16 KB of source and of
  // destination stay in L1 while it is done (the weights are 32 KB-1 MB).
  constexpr int64_t kTile = 64;
  const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (int64_t i0 = 0; i0 < r8; i0 += kTile)
    for (int64_t j0 = 0; j0 < c8; j0 += kTile)
      for (int64_t i = i0; i < std::min(r8, i0 + kTile); i += 8)
        for (int64_t j = j0; j < std::min(c8, j0 + kTile); j += 8) {
#ifdef WFPASS_X86
          transpose8(src + i * lds + j, lds, dst + j * ldd + i, ldd);
#else
          for (int64_t a = i; a < i + 8; ++a)
            for (int64_t b = j; b < j + 8; ++b) dst[b * ldd + a] = src[a * lds + b];
#endif
        }
  // The edges: the last rows % 8 rows, and the last cols % 8 columns.
  for (int64_t i = r8; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
  for (int64_t i = 0; i < r8; ++i)
    for (int64_t j = c8; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// C[n, G] += h[n, K] . W_hh^T, the recurrent GEMM of one step: on the
// ukernel from the transposed copy, or on the direct kernel from the
// weight as it is (Recurrent). The direct kernel writes, it does not add,
// so its rows go to tmp and are added here (n x G floats, in L1).
namespace {
void step_gemm(int64_t n, int64_t G, int64_t K, const float* h, int64_t ldh, const Recurrent& r, float* c,
               int64_t ldc) {
  if (r.t != nullptr) {
    gemm(n, G, K, h, ldh, r.t, G, c, ldc, true);
    return;
  }
  wfpass_direct::direct_linear(n, G, K, h, ldh, r.w, r.ldw, nullptr, r.tmp, G);
  for (int64_t i = 0; i < n; ++i) {
    float* ci = c + i * ldc;
    const float* ti = r.tmp + i * G;
    for (int64_t j = 0; j < G; ++j) ci[j] += ti[j];
  }
}
}  // namespace

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

bool fast_loop() { return isa() != Isa::none; }

const char* fast_isa() {
  switch (isa()) {
    case Isa::avx512:
      return "avx512f";
    case Isa::avx2:
      return "avx2";
    default:
      return "";
  }
}

#ifdef WFPASS_X86
namespace {

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

// The step functions, once per ISA (fast_gates.h says what each defines).
namespace avx512 {

#define WF_T __attribute__((target("avx512f"), always_inline)) inline
#define WF_F __attribute__((target("avx512f")))

using V = __m512;
using Mask = __mmask16;
constexpr int64_t kW = 16;

WF_T Mask lanes(int64_t j, int64_t W) {
  const int64_t w = W - j;
  return w >= 16 ? (Mask)0xFFFF : (Mask)((1u << w) - 1u);
}
WF_T V ld(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
WF_T void st(Mask m, float* p, V v) { _mm512_mask_storeu_ps(p, m, v); }
WF_T V splat(float v) { return _mm512_set1_ps(v); }
WF_T V add(V a, V b) { return _mm512_add_ps(a, b); }
WF_T V sub(V a, V b) { return _mm512_sub_ps(a, b); }
WF_T V mul(V a, V b) { return _mm512_mul_ps(a, b); }
WF_T V div(V a, V b) { return _mm512_div_ps(a, b); }
WF_T V vmin(V a, V b) { return _mm512_min_ps(a, b); }
WF_T V vmax(V a, V b) { return _mm512_max_ps(a, b); }
WF_T V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
WF_T V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
WF_T V absv(V x) { return _mm512_abs_ps(x); }
// x's sign bit onto mag (integer ops: the float ones need AVX-512DQ).
WF_T V with_sign(V mag, V x) {
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}
WF_T V lt_select(V a, V b, V t, V f) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), f, t); }

// exp_v's ISA parts (fast_gates.h): scalef makes p 2^n exactly up to
// 2^128, so x is clamped at 88.5.
constexpr float kExpMax = 88.5f;
WF_T V round_v(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
WF_T V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }
WF_T V keep_nan(V r, V x) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x); }

#include "fast_gates.h"

#undef WF_T
#undef WF_F
}  // namespace avx512

// AVX2 with FMA: 8 lanes, a tail through an integer lane mask (maskload
// reads nothing outside it), full vectors through plain loads and stores
// (AMD's masked stores are microcoded).
namespace avx2 {

#define WF_T __attribute__((target("avx2,fma"), always_inline)) inline
#define WF_F __attribute__((target("avx2,fma")))

using V = __m256;
struct Mask {
  bool full;
  __m256i bits;
};
constexpr int64_t kW = 8;

WF_T Mask lanes(int64_t j, int64_t W) {
  const int64_t w = W - j;
  if (w >= 8) return {true, _mm256_set1_epi32(-1)};
  return {false, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(w)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
}
WF_T V ld(Mask m, const float* p) { return m.full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m.bits); }
WF_T void st(Mask m, float* p, V v) {
  if (m.full)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, m.bits, v);
}
WF_T V splat(float v) { return _mm256_set1_ps(v); }
WF_T V add(V a, V b) { return _mm256_add_ps(a, b); }
WF_T V sub(V a, V b) { return _mm256_sub_ps(a, b); }
WF_T V mul(V a, V b) { return _mm256_mul_ps(a, b); }
WF_T V div(V a, V b) { return _mm256_div_ps(a, b); }
WF_T V vmin(V a, V b) { return _mm256_min_ps(a, b); }
WF_T V vmax(V a, V b) { return _mm256_max_ps(a, b); }
WF_T V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
WF_T V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
WF_T V absv(V x) { return _mm256_andnot_ps(splat(-0.f), x); }
WF_T V with_sign(V mag, V x) { return _mm256_or_ps(mag, _mm256_and_ps(x, splat(-0.f))); }
WF_T V lt_select(V a, V b, V t, V f) { return _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }

// exp_v's ISA parts: AVX2 has no scalef, so 2^n is built in the exponent
// bits, and x is clamped at Cephes' MAXLOGF (88.376...), not 88.5, so that
// n <= 127 stays a finite power of two. Only exp itself differs from the
// AVX-512 one there (sigmoid and tanh read it where it is ~1e38 against 1).
constexpr float kExpMax = 88.3762626647949f;
WF_T V round_v(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
WF_T V times_pow2(V p, V n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return mul(p, _mm256_castsi256_ps(e));
}
WF_T V keep_nan(V r, V x) { return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }

#include "fast_gates.h"

#undef WF_T
#undef WF_F
}  // namespace avx2

// Each entry point runs one ISA's loop, chosen once per process (isa()).
#define WF_ISA_CALL(fn, ...) \
  (isa() == Isa::avx512 ? avx512::fn(__VA_ARGS__) : avx2::fn(__VA_ARGS__))

void lstm_forward(const std::vector<Step>& steps, int64_t H, int64_t Hout, float* ws, float* out, int64_t ldo,
                  const float* h0, int64_t ldh, const float* c0, int64_t ldc, const Recurrent& whh, const float* whr_t,
                  float* hbuf, float* cbuf, float* hpre) {
  WF_ISA_CALL(lstm_forward, steps, H, Hout, ws, out, ldo, h0, ldh, c0, ldc, whh, whr_t, hbuf, cbuf, hpre);
}
void gru_forward(const std::vector<Step>& steps, int64_t H, float* ws, float* out, int64_t ldo, const float* h0,
                 int64_t ldh, const Recurrent& whh, float* hbuf) {
  WF_ISA_CALL(gru_forward, steps, H, ws, out, ldo, h0, ldh, whh, hbuf);
}
void rnn_forward(const std::vector<Step>& steps, int64_t H, float* out, int64_t ldo, const float* h0, int64_t ldh,
                 const Recurrent& whh, float* hbuf, bool relu) {
  WF_ISA_CALL(rnn_forward, steps, H, out, ldo, h0, ldh, whh, hbuf, relu);
}
void lstm_backward(const std::vector<Step>& steps, int64_t H, int64_t Hout, const float* g, float* hcar, float* ccar,
                   const float* ws, const float* c0, int64_t ldc, float* cbuf, float* dg, const float* w_hh,
                   const float* w_hr, float* dh, float* dhp) {
  WF_ISA_CALL(lstm_backward, steps, H, Hout, g, hcar, ccar, ws, c0, ldc, cbuf, dg, w_hh, w_hr, dh, dhp);
}
void gru_backward(const Rows& rows, int64_t H, const float* g, float* hcar, const float* ws, float* dg,
                  const float* w_hh, float* dh) {
  WF_ISA_CALL(gru_backward, rows, H, g, hcar, ws, dg, w_hh, dh);
}
void rnn_backward(const Rows& rows, int64_t H, const float* g, float* hcar, float* dpre, const float* w_hh,
                  float* dh) {
  WF_ISA_CALL(rnn_backward, rows, H, g, hcar, dpre, w_hh, dh);
}
#undef WF_ISA_CALL

#else  // not x86-64 with GCC/Clang: fast_loop() is false and these are never called.

void lstm_forward(const std::vector<Step>&, int64_t, int64_t, float*, float*, const float*, int64_t, const float*,
                  int64_t, const Recurrent&, const float*, float*, float*, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void gru_forward(const std::vector<Step>&, int64_t, float*, float*, const float*, int64_t, const Recurrent&, float*) {
  TORCH_CHECK(false, "wfpass: no fast loop on this CPU");
}
void rnn_forward(const std::vector<Step>&, int64_t, float*, const float*, int64_t, const Recurrent&, float*, bool) {
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
