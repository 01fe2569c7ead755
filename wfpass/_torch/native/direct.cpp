// The "direct" linear kernel: Y = X . W^T for a float32 weight as the
// Parameter holds it ([N, K], row-major), no copy. Why: at the row counts
// of decoding (1-16 rows) a linear is a few dot products per output, and
// the plain GEMM (ATen's addmm on MKL) reads a row-major weight slowly
// there; the other fast kernels (oneDNN's packed linear, the "brgemm"
// panels) need a copy of the weight in their own layout, as many bytes as
// the weight. Here each output is a dot product of an input row and a
// weight row, 16 of them at a time (a block of 1 x 16, 2 x 8 or 4 x 4
// input rows x weight rows), their 16 sums reduced together in one
// shuffle tree. On a 2-core AMD EPYC with AVX-512, 1 thread
// (benchmarks/brgemm_kernel.py): a 2752x256 weight at 1 / 5 / 16 rows took
// 36 / 73 / 219 us, against 75 / 194 / 307 us plain and 43 / 74 / 210 us
// from the brgemm copy.
//
// Compiled under __attribute__((target("avx512f"))), chosen at run time
// (available()), so the library itself still builds for any x86-64 CPU.
// Built and loaded by wfpass/_torch/native/__init__.py; checked on torch
// 2.11.0, 2.13.0 and 2.15.0.
#include "direct.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WFPASS_DIRECT_X86 1
#endif

namespace wfpass_direct {

namespace {

bool probe() {
  const char* env = std::getenv("WFPASS_DIRECT");
  std::string v(env != nullptr ? env : "");
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
#ifdef WFPASS_DIRECT_X86
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

#ifdef WFPASS_DIRECT_X86
// The library is built with -O2 (native/__init__.py), where GCC leaves the
// loops over the register block rolled and the 16 accumulators in memory
// (4x slower at 8 rows); each such loop is unrolled by a pragma.
#define WFPASS_AVX512 __attribute__((target("avx512f")))
#define WFPASS_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline

// The sums of 16 vectors' lanes at once: element 4 l + j of the result is
// the sum of v[4 j + l]'s 16 lanes (two 128-bit-lane shuffle stages, then
// in-lane unpacks: ~30 instructions for 16 sums, where 16 separate
// reductions take ~130).
WFPASS_AVX512_INLINE __m512 reduce16(const __m512* v) {
  __m512 s[8], r[4];
  #pragma GCC unroll 16
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  #pragma GCC unroll 16
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}

// One step of 16 columns k .. k + 15 (masked by m) for R input rows and
// C = 16 / R weight rows. Output p = i C + j (input row i, weight row j)
// accumulates at 4 (p % 4) + p / 4, so that reduce16 leaves it at element p.
// With PF, the same columns of the rows at pf are fetched into cache too.
template <int R, bool PF>
WFPASS_AVX512_INLINE void step(__m512* acc, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k,
                               __mmask16 m, const float* pf) {
  constexpr int C = 16 / R;
  __m512 wv[C];
  #pragma GCC unroll 16
  for (int j = 0; j < C; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * ldw + k);
  if (PF)
    #pragma GCC unroll 16
    for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + k), _MM_HINT_T1);
  #pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
    #pragma GCC unroll 16
    for (int j = 0; j < C; ++j) {
      const int p = i * C + j, a = 4 * (p % 4) + p / 4;
      acc[a] = _mm512_fmadd_ps(xv, wv[j], acc[a]);
    }
  }
}

// y[i * ldy + j] = x_i . w_j (+ bias[j]) for R input rows, 16 / R weight
// rows; with PF, the rows at pf (as many, as long) are fetched into cache meanwhile.
template <int R, bool PF>
WFPASS_AVX512_INLINE void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y,
                                int64_t ldy, const float* bias, const float* pf) {
  constexpr int C = 16 / R;
  __m512 acc[16];
  #pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step<R, PF>(acc, x, ldx, w, ldw, k, static_cast<__mmask16>(0xFFFF), pf);
  if (k < K) step<R, PF>(acc, x, ldx, w, ldw, k, static_cast<__mmask16>((1u << (K - k)) - 1), pf);
  const __m512 e = reduce16(acc);
  alignas(64) float t[16];
  _mm512_store_ps(t, bias != nullptr ? _mm512_add_ps(e, R == 1   ? _mm512_loadu_ps(bias)
                                                        : R == 2 ? _mm512_castpd_ps(_mm512_broadcast_f64x4(
                                                                       _mm256_castps_pd(_mm256_loadu_ps(bias))))
                                                                 : _mm512_broadcast_f32x4(_mm_loadu_ps(bias)))
                                     : e);
  #pragma GCC unroll 16
  for (int i = 0; i < R; ++i) std::copy(t + i * C, t + (i + 1) * C, y + i * ldy);
}

// The last N % 16 weight rows: one dot product at a time.
WFPASS_AVX512_INLINE float dot(const float* x, const float* w, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc);
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The input rows i .. i + R - 1 against the 16 weight rows at wn, in
// blocks of 16 / R of them; with PF, the next block's rows (at pf) fetched meanwhile.
template <int R, bool PF>
WFPASS_AVX512_INLINE void rows16(const float* x, int64_t ldx, const float* wn, int64_t ldw, int64_t K, float* y,
                                 int64_t ldy, const float* bn, const float* pf) {
  constexpr int C = 16 / R;
  #pragma GCC unroll 16
  for (int64_t c = 0; c < 16; c += C)
    block<R, PF>(x, ldx, wn + c * ldw, ldw, K, y + c, ldy, bn ? bn + c : nullptr, pf + c * ldw);
}

// Weight rows 16 b0 .. 16 b1 for every input row. The 16 weight rows of a
// block stay in cache while every block of input rows goes through them,
// and the first block of input rows fetches the next 16 weight rows: a
// weight row is a short stream (1 KB at 256 input features) that the
// hardware's prefetchers barely start on, so without it the rows came from
// memory one miss at a time (a 2752x256 weight at 8 rows, cycling through
// 16 MiB of weights as in a model: 611 us, against 474 us plain; with it, see
// the file's head).
WFPASS_AVX512 void rows_of(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* w,
                           int64_t ldw, const float* bias, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * 16;
    const float* wn = w + n * ldw;
    const float* bn = bias != nullptr ? bias + n : nullptr;
    if (n + 16 <= N) {
      // The next block's rows where there are 16 more, else these again (in cache: no cost but the slot).
      const float* pf = n + 32 <= N ? wn + 16 * ldw : wn;
      int64_t i = 0;
      bool first = true;
      for (; i + 4 <= M; i += 4, first = false)
        first ? rows16<4, true>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf)
              : rows16<4, false>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf);
      for (; i + 2 <= M; i += 2, first = false)
        first ? rows16<2, true>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf)
              : rows16<2, false>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf);
      for (; i < M; ++i, first = false)
        first ? rows16<1, true>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf)
              : rows16<1, false>(x + i * ldx, ldx, wn, ldw, K, y + i * ldy + n, ldy, bn, pf);
    } else {
      for (int64_t j = n; j < N; ++j)
        for (int64_t i = 0; i < M; ++i)
          y[i * ldy + j] = dot(x + i * ldx, w + j * ldw, K) + (bias != nullptr ? bias[j] : 0.f);
    }
  }
}
#endif

}  // namespace

bool available() {
  static const bool ok = probe();
  return ok;
}

void direct_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* w, int64_t ldw,
                   const float* bias, float* y, int64_t ldy) {
#ifdef WFPASS_DIRECT_X86
  const int64_t blocks = (N + 15) / 16;
  // Blocks per thread: at least ~256K multiply-adds each (a 384x256 weight
  // at one row, 98K, runs on one thread rather than pay the threads' start).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * M * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    rows_of(M, N, K, x, ldx, w, ldw, bias, y, ldy, b0, b1);
  });
#else
  (void)M, (void)N, (void)K, (void)x, (void)ldx, (void)w, (void)ldw, (void)bias, (void)y, (void)ldy;
  TORCH_CHECK(false, "wfpass::_direct_linear: not built for this CPU");
#endif
}

// Every shape, dtype and stride is checked before a pointer is read.
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(wfpass_direct::available(),
              "wfpass::_direct_linear: needs an x86-64 CPU with AVX-512F (and WFPASS_DIRECT not off)");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "wfpass::_direct_linear: expected a 2-D float32 CPU weight, got ", w.scalar_type(), " of shape ",
              w.sizes(), " on ", w.device());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
              "wfpass::_direct_linear: input of shape ", x.sizes(), " and dtype ", x.scalar_type(),
              " for a float32 weight with ", K, " input features");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->numel() == N,
                "wfpass::_direct_linear: bias of shape ", bias->sizes(), " for ", N, " output features");
    b = bias->contiguous();
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = N > 0 ? y.numel() / N : 0;
  if (M == 0 || N == 0) return y;
  if (K == 0) return b.defined() ? y.copy_(b.expand_as(y)) : y.zero_();
  // The weight's rows may be apart (a leading dim past K); its elements in a row must be adjacent.
  const at::Tensor wc = (w.stride(1) == 1 && w.stride(0) >= K) ? w : w.contiguous();
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  wfpass_direct::direct_linear(M, N, K, x2.const_data_ptr<float>(), K, wc.const_data_ptr<float>(), wc.stride(0),
                               b.defined() ? b.const_data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  return y;
}

}  // namespace wfpass_direct

TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def("_direct_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("native_direct() -> bool", []() { return wfpass_direct::available(); });
}

TORCH_LIBRARY_IMPL(wfpass, CPU, m) { m.impl("_direct_linear", wfpass_direct::linear_op); }
