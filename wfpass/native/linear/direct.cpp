// The "direct" linear kernel: Y = X . W^T for a float32 weight as the
// Parameter holds it ([N, K], row-major), no copy. Why: at the row counts
// of decoding (1-16 rows) a linear is a few dot products per output, and
// the plain GEMM (ATen's addmm on MKL) reads a row-major weight slowly
// there; the other fast kernels (oneDNN's packed linear, the "brgemm"
// panels) need a copy of the weight in their own layout, as many bytes as
// the weight. Here each output is a dot product of an input row and a
// weight row, 16 of them at a time with AVX-512 (a block of 1 x 16, 2 x 8
// or 4 x 4 input rows x weight rows, 8 with AVX2), their sums reduced
// together in one shuffle tree (direct_kernel.h). On a 2-core AMD EPYC
// with AVX-512, 1 thread, the weight cycling through 16 MiB of copies as a
// model's calls find it (benchmarks/brgemm_kernel.py --pool-mib 16): a
// 2752x256 weight at 2 / 8 rows took 84 / 154 us, against 209 / 363 us
// plain and 185 / 210 us from the brgemm copy (docs/pack.md, "direct").
//
// A bfloat16 or float16 weight is read the same way, as it is (2 bytes an
// element, no float32 copy of it): each load of W elements is widened to
// float32 in registers (bf16: the 16 bits moved up; fp16: vcvtph2ps, F16C
// on AVX2) and multiplied into float32 sums, the input rows widened once
// per call. At decode row counts the kernel is bound by the weight's
// bytes, not by the widening (2 instructions per 16 elements).
//
// direct_kernel.h is compiled twice, under __attribute__((target("avx512f")))
// and target("avx2,fma"), one picked at run time (isa()), so the library
// itself still builds for any x86-64 CPU.
// Built and loaded by wfpass/native/__init__.py; checked on torch
// 2.11.0, 2.13.0 and 2.15.0.
#include "direct.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WFPASS_DIRECT_X86 1
#endif
#include "direct_amx.h"
#include "direct_bf16dot.h"

namespace wfpass_direct {

namespace {

// A weight's element types beside float: their bits, so that the kernel's
// loads pick the widening by type (at::BFloat16 and at::Half have the same
// layout).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

enum class Kind { none, avx2, avx512 };

// An environment switch as its words, lowercased ("" where unset), and
// whether those words turn it off: the two switches below read the same.
std::string switch_words(const char* name) {
  const char* env = std::getenv(name);
  std::string v(env != nullptr ? env : "");
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return v;
}

bool says_off(const std::string& v) { return v == "0" || v == "false" || v == "no" || v == "off"; }

Kind probe() {
  const std::string v = switch_words("WFPASS_DIRECT");
  if (says_off(v)) return Kind::none;
#ifdef WFPASS_DIRECT_X86
  // WFPASS_DIRECT=avx2 runs the AVX2 kernel on an AVX-512 CPU too: how the
  // tests check both on one machine.
  if (__builtin_cpu_supports("avx512f") && v != "avx2") return Kind::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Kind::avx2;
#endif
  return Kind::none;
}

Kind kind() {
  static const Kind k = probe();
  return k;
}

// Whether one and two input rows read each row of a half-precision weight
// whose rows are 4 KB apart from a column of its own (block_skew in
// direct_kernel.h), unless WFPASS_DIRECT_SKEW is 0 / false / no / off.
bool skew_on() {
  static const bool on = !says_off(switch_words("WFPASS_DIRECT_SKEW"));
  return on;
}

#ifdef WFPASS_DIRECT_X86
// The library is built with -O2 (native/__init__.py), where GCC leaves the
// loops over a register block rolled and the accumulators in memory (4x
// slower at 8 rows): the kernel's loops carry `#pragma GCC unroll`.
namespace avx512 {
#define WFPASS_TARGET __attribute__((target("avx512f")))
#define WFPASS_TARGET_INLINE __attribute__((target("avx512f"), always_inline)) inline

struct Isa {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int W = 16, ACC = 16;
  WFPASS_TARGET_INLINE static V zero() { return _mm512_setzero_ps(); }
  WFPASS_TARGET_INLINE static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  WFPASS_TARGET_INLINE static V load(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
  WFPASS_TARGET_INLINE static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  WFPASS_TARGET_INLINE static Mask tail(int64_t n) { return static_cast<Mask>((1u << n) - 1); }
  WFPASS_TARGET_INLINE static V loadw(const float* p) { return loadu(p); }
  WFPASS_TARGET_INLINE static V loadw(const Bf16* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  WFPASS_TARGET_INLINE static V loadw(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // One 64-byte line of a weight row widened (block_skew): W elements a
  // vector, as loadw. An fp16 line is one 512-bit load, both halves
  // converted from the register: vcvtph2ps from memory, twice a line, read
  // the skewed rows slower. Measured on an AMD EPYC, 1 thread, interleaved,
  // each weight cycling through 256 MiB, one row: fp16 2048x2048 and
  // 11264x2048 at 18.9-19.9 GB/s from memory, 23.3-24.7 GB/s this way
  // (bf16 from memory in the same runs: 22.5-23.6). The same widening, the
  // same sums: the same bits. bf16 keeps its two loads: the same one-load
  // form (vpmovzxwd from the register) read it at 15.1-18.7 GB/s there.
  template <class WT>
  WFPASS_TARGET_INLINE static void line(const WT* p, V* out) {
#pragma GCC unroll 4
    for (int v = 0; v < static_cast<int>(64 / sizeof(WT)) / W; ++v) out[v] = loadw(p + v * W);
  }
  WFPASS_TARGET_INLINE static void line(const F16* p, V* out) {
    const __m512i v = _mm512_loadu_si512(p);
    out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
    out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
  }
  // sums below leaves the sum of v[4 j + l] at element 4 l + j.
  static constexpr int slot(int p) { return 4 * (p % 4) + p / 4; }
  // The sums of 16 vectors' lanes at once (bf16dot::sums16).
  WFPASS_TARGET_INLINE static void sums(const V* v, float* out) { bf16dot::sums16(v, out); }
};

#include "direct_kernel.h"

#undef WFPASS_TARGET
#undef WFPASS_TARGET_INLINE
}  // namespace avx512

namespace avx2 {
#define WFPASS_TARGET __attribute__((target("avx2,fma,f16c")))
#define WFPASS_TARGET_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

struct Isa {
  using V = __m256;
  using Mask = __m256i;
  static constexpr int W = 8, ACC = 8;
  WFPASS_TARGET_INLINE static V zero() { return _mm256_setzero_ps(); }
  WFPASS_TARGET_INLINE static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  WFPASS_TARGET_INLINE static V load(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
  WFPASS_TARGET_INLINE static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  WFPASS_TARGET_INLINE static Mask tail(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  WFPASS_TARGET_INLINE static V loadw(const float* p) { return loadu(p); }
  WFPASS_TARGET_INLINE static V loadw(const Bf16* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  WFPASS_TARGET_INLINE static V loadw(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // One 64-byte line of a weight row widened (block_skew), W elements a vector.
  template <class WT>
  WFPASS_TARGET_INLINE static void line(const WT* p, V* out) {
#pragma GCC unroll 8
    for (int v = 0; v < static_cast<int>(64 / sizeof(WT)) / W; ++v) out[v] = loadw(p + v * W);
  }
  static constexpr int slot(int p) { return p; }
  // The sums of 8 vectors' lanes at once (horizontal adds, then the two
  // 128-bit halves): element p is the sum of v[p].
  WFPASS_TARGET_INLINE static void sums(const V* v, float* out) {
    const V g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const V g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31)));
  }
};

#include "direct_kernel.h"
#include "wfpass_schemas.h"  // the ops' schemas, written by the build from wfpass/native/schemas.py

#undef WFPASS_TARGET
#undef WFPASS_TARGET_INLINE
}  // namespace avx2
#endif

}  // namespace

bool available() { return kind() != Kind::none; }

const char* isa() { return kind() == Kind::avx512 ? "avx512f" : kind() == Kind::avx2 ? "avx2" : ""; }

// The AMX body (direct_amx.h), on a CPU with AMX-BF16 whose kernel grants
// the tile state, with the AVX-512 build, unless WFPASS_DIRECT_AMX is 0 /
// false / no / off. Measured on the 1.06 GB bf16 LLaMA, each variant in its
// own process, interleaved over two passes: the same decode speed with it
// as without (86.8 ms/token both) and no prepacked copy (RSS +0.17 GB
// against +0.82: its prompt rows need none)
// (docs/results/decode_sizes_amx_1thread.md).
bool amx_on() {
#ifdef WFPASS_DIRECT_AMX
  static const bool on =
      kind() == Kind::avx512 && !says_off(switch_words("WFPASS_DIRECT_AMX")) && amx::probe();
  return on;
#else
  return false;
#endif
}

// The AVX-512 BF16 bodies (direct_bf16dot.h) for a prompt's and a decode
// step's bf16 rows where AMX is not in use, with the AVX-512 build, unless
// WFPASS_DIRECT_BF16DOT is 0 / false / no / off.
bool dot_on() {
#ifdef WFPASS_DIRECT_X86
  static const bool on =
      kind() == Kind::avx512 && !says_off(switch_words("WFPASS_DIRECT_BF16DOT")) && bf16dot::probe();
  return on;
#else
  return false;
#endif
}

namespace {

template <class WT>
void run(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const WT* w, int64_t ldw, const float* bias,
         float* y, int64_t ldy) {
#ifdef WFPASS_DIRECT_X86
  TORCH_CHECK(available(), "wfpass::_direct_linear: not available on this CPU");
  const bool wide = kind() == Kind::avx512;
  const int64_t blocks = (N + 15) / 16;
  // Blocks of 16 weight rows per thread: at least ~256K multiply-adds each
  // (a 384x256 weight at one row, 98K, runs on one thread rather than pay
  // the threads' start). Each thread streams its own rows of the weight
  // (a fused Q/K/V or gate/up block is one [N, K] weight: one stream).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * M * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t r0 = b0 * 16, r1 = std::min(N, b1 * 16);
    if (wide)
      avx512::rows_of<WT>(M, N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
    else
      avx2::rows_of<WT>(M, N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
  });
#else
  (void)M, (void)N, (void)K, (void)x, (void)ldx, (void)w, (void)ldw, (void)bias, (void)y, (void)ldy;
  TORCH_CHECK(false, "wfpass::_direct_linear: not built for this CPU");
#endif
}

// Whether a call's bf16 rows take AMX tiles (run_amx): a prompt's rows, 4 or
// more (at 1-3 the widening body streams the weight faster), over K in
// steps of 32 and N in blocks of 16. One rule for the one-weight op and the
// group: the export decides a group's direct rows from the one-weight op's
// timings, so both must run the body those timings measured.
bool amx_takes(at::ScalarType dt, int64_t M, int64_t N, int64_t K) {
  return dt == at::kBFloat16 && M >= 4 && K % 32 == 0 && N % 16 == 0 && amx_on();
}

// Whether a call's bf16 rows take vdpbf16ps (run_dot): 8 rows or more
// where AMX does not take them, K in steps of 32. Measured on an AMD EPYC
// (AVX-512 BF16, no AMX), 1 thread, the 1.06 GB model's five weight shapes
// cycling through 256 MiB: at 16 rows 1081-5716 us against the widening
// body's 1465-7967 (0.69-0.74x), at 8 rows 0.87-0.96x, at 4 rows level to
// 1.33x slower (2048x5632), so 4-7 rows keep the widening body. And a
// decode step's one or two rows where K is at most 4096 (stream_rows in
// direct_bf16dot.h: one rule for both counts, so a row's result is the same
// bits alone and beside a second; wider rows keep the widening body at
// both). Measured on a CPU without AMX only: with AMX on, one and two rows
// keep the widening body. One rule for the one-weight op and the group, as
// amx_takes.
bool dot_takes(at::ScalarType dt, int64_t M, int64_t N, int64_t K) {
  if (dt != at::kBFloat16 || K % 32 != 0 || !dot_on()) return false;
  if (M <= 2) return K <= 4096 && !amx_on();
  return M >= 8 && !amx_takes(dt, M, N, K);
}

// bf16 rows by vdpbf16ps, the input and the weight as they are; blocks of
// 16 weight rows split over threads as run() splits them.
void run_dot(int64_t M, int64_t N, int64_t K, const uint16_t* x, const uint16_t* w, int64_t ldw, const float* bias,
             float* y) {
#ifdef WFPASS_DIRECT_X86
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * M * K));
  at::parallel_for(0, (N + 15) / 16, grain, [&](int64_t b0, int64_t b1) {
    bf16dot::rows(M, N, K, x, w, ldw, bias, y, b0 * 16, std::min(N, b1 * 16));
  });
#else
  (void)M, (void)N, (void)K, (void)x, (void)w, (void)ldw, (void)bias, (void)y;
  TORCH_CHECK(false, "wfpass::_direct_linear: the bf16 dot body is not built");
#endif
}

// bf16 rows by AMX tiles, 32 input rows at a time (two halves of 16),
// blocks of 16 weight rows split over threads as run() splits them.
void run_amx(int64_t M, int64_t N, int64_t K, const uint16_t* x, const uint16_t* w, int64_t ldw, const float* bias,
             float* y) {
#ifdef WFPASS_DIRECT_AMX
  std::vector<uint16_t> xv0(16 * K), xv1(16 * K);
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t mi0 = std::min<int64_t>(16, M - m0), mi1 = std::max<int64_t>(0, std::min<int64_t>(16, M - m0 - 16));
    amx::vnni(x, K, m0, mi0, K, xv0.data());
    if (mi1 > 0) amx::vnni(x, K, m0 + 16, mi1, K, xv1.data());
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * (mi0 + mi1) * K));
    at::parallel_for(0, N / 16, grain, [&](int64_t b0, int64_t b1) {
      amx::rows(K, w, ldw, xv0.data(), mi0, xv1.data(), mi1, bias, y + m0 * N, N, b0 * 16, b1 * 16);
    });
  }
#else
  (void)M, (void)N, (void)K, (void)x, (void)w, (void)ldw, (void)bias, (void)y;
  TORCH_CHECK(false, "wfpass::_direct_linear: AMX body not built");
#endif
}

// One pass over several weights that read the same input (a Q/K/V or
// gate/up group as the model holds it, each weight where it is), member i's
// outputs into its own rows y_i (leading dim n_i). The members' blocks of
// 16 weight rows are split over threads as one weight's would be, so the
// group streams as one [sum n_i, K] weight does: one call, one parallel
// region, the input rows widened once.
template <class WT>
void run_group(int64_t M, int64_t K, const float* x, int64_t ldx, const std::vector<GroupMember>& ms) {
#ifdef WFPASS_DIRECT_X86
  TORCH_CHECK(available(), "wfpass::linear_group: the direct kernel is not available on this CPU");
  const bool wide = kind() == Kind::avx512;
  std::vector<int64_t> first(ms.size() + 1, 0);  // each member's first block in the group's numbering
  for (size_t i = 0; i < ms.size(); ++i) first[i + 1] = first[i] + (ms[i].n + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * M * K));
  at::parallel_for(0, first.back(), grain, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ms.size(); ++i) {
      const int64_t lo = std::max(b0, first[i]), hi = std::min(b1, first[i + 1]);
      if (lo >= hi) continue;
      const GroupMember& m = ms[i];
      const int64_t r0 = (lo - first[i]) * 16, r1 = std::min(m.n, (hi - first[i]) * 16);
      const WT* w = static_cast<const WT*>(m.w);
      if (wide)
        avx512::rows_of<WT>(M, m.n, K, x, ldx, w, m.ldw, m.bias, m.y, m.n, r0, r1);
      else
        avx2::rows_of<WT>(M, m.n, K, x, ldx, w, m.ldw, m.bias, m.y, m.n, r0, r1);
    }
  });
#else
  (void)M, (void)K, (void)x, (void)ldx, (void)ms;
  TORCH_CHECK(false, "wfpass::linear_group: the direct kernel is not built for this CPU");
#endif
}

}  // namespace

std::vector<at::Tensor> group_op(const at::Tensor& x2, at::TensorList weights, const std::vector<at::Tensor>& biases) {
  const at::ScalarType dt = x2.scalar_type();
  const int64_t M = x2.size(0), K = x2.size(1);
  std::vector<at::Tensor> ys, sums;  // each member's output, and its float32 sums for a half-precision group
  for (const at::Tensor& w : weights) {
    ys.push_back(at::empty({M, w.size(0)}, x2.options()));
    sums.push_back(dt == at::kFloat ? ys.back() : at::empty({M, w.size(0)}, x2.options().dtype(at::kFloat)));
  }
  if (M == 0) return ys;
  if (K == 0) {
    for (size_t i = 0; i < weights.size(); ++i)
      if (biases[i].defined()) ys[i].copy_(biases[i].expand_as(ys[i])); else ys[i].zero_();
    return ys;
  }
  // AMX tiles where they take every member's rows, as the one-weight op's.
  bool tiles = true, dots = true;
  for (const at::Tensor& w : weights) tiles = tiles && amx_takes(dt, M, w.size(0), K);
  for (const at::Tensor& w : weights) dots = dots && dot_takes(dt, M, w.size(0), K);  // never with tiles
  // Otherwise the input rows in float32 (M x K values: a few KB at decode row counts).
  const at::Tensor xf = (tiles || dots) ? x2.contiguous() : x2.to(at::kFloat).contiguous();
  std::vector<at::Tensor> keep;  // the float32 biases and any weight made row-contiguous, alive for the call
  std::vector<GroupMember> ms;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const at::Tensor wc = (w.stride(1) == 1 && w.stride(0) >= K) ? w : w.contiguous();
    keep.push_back(wc);
    const float* bp = nullptr;
    if (biases[i].defined()) {
      keep.push_back(biases[i].to(at::kFloat).contiguous());  // summed in float32
      bp = keep.back().const_data_ptr<float>();
    }
    ms.push_back({wc.const_data_ptr(), wc.stride(0), w.size(0), bp, sums[i].data_ptr<float>()});
  }
  if (tiles || dots)
    for (const GroupMember& m : ms)
      (tiles ? run_amx : run_dot)(M, m.n, K, reinterpret_cast<const uint16_t*>(xf.const_data_ptr<at::BFloat16>()),
                                  static_cast<const uint16_t*>(m.w), m.ldw, m.bias, m.y);
  else if (dt == at::kFloat)
    run_group<float>(M, K, xf.const_data_ptr<float>(), K, ms);
  else if (dt == at::kBFloat16)
    run_group<Bf16>(M, K, xf.const_data_ptr<float>(), K, ms);
  else
    run_group<F16>(M, K, xf.const_data_ptr<float>(), K, ms);
  if (dt != at::kFloat)
    for (size_t i = 0; i < ys.size(); ++i) ys[i].copy_(sums[i]);  // rounded once, as the plain GEMM rounds
  return ys;
}

void direct_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* w, int64_t ldw,
                   const float* bias, float* y, int64_t ldy) {
  run<float>(M, N, K, x, ldx, w, ldw, bias, y, ldy);
}

// Every shape, dtype and stride is checked before a pointer is read.
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(wfpass_direct::available(),
              "wfpass::_direct_linear: needs an x86-64 CPU with AVX-512F, or AVX2 with FMA and F16C (and WFPASS_DIRECT "
              "not off)");
  const at::ScalarType dt = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && w.dim() == 2,
              "wfpass::_direct_linear: expected a 2-D float32, bfloat16 or float16 CPU weight, got ", dt,
              " of shape ", w.sizes(), " on ", w.device());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dt && x.dim() >= 1 && x.size(-1) == K,
              "wfpass::_direct_linear: input of shape ", x.sizes(), " and dtype ", x.scalar_type(), " for a ", dt,
              " weight with ", K, " input features");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dt && bias->dim() == 1 && bias->numel() == N,
                "wfpass::_direct_linear: bias of shape ", bias->sizes(), " and dtype ", bias->scalar_type(), " for ",
                N, " output features of dtype ", dt);
    b = bias->to(at::kFloat).contiguous();  // summed in float32 (a copy of N values for a half bias)
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = N > 0 ? y.numel() / N : 0;
  if (M == 0 || N == 0) return y;
  if (K == 0) return b.defined() ? y.copy_(b.expand_as(y)) : y.zero_();
  // The weight's rows may be apart (a leading dim past K); its elements in a row must be adjacent.
  const at::Tensor wc = (w.stride(1) == 1 && w.stride(0) >= K) ? w : w.contiguous();
  // A prompt's bf16 rows take AMX tiles over the weight as it is
  // (direct_amx.h), reading the input as it is (amx_takes).
  const bool tiles = wfpass_direct::amx_takes(dt, M, N, K);
  // Or vdpbf16ps where the CPU has AVX-512 BF16 and no AMX (dot_takes).
  const bool dots = wfpass_direct::dot_takes(dt, M, N, K);
  // Otherwise the input rows in float32 (M x K values: a few KB at decode row counts).
  const at::Tensor x2 = (tiles || dots) ? at::Tensor() : x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  if (dt == at::kFloat) {
    wfpass_direct::run<float>(M, N, K, x2.const_data_ptr<float>(), K, wc.const_data_ptr<float>(), wc.stride(0), bp,
                              y.data_ptr<float>(), N);
    return y;
  }
  at::Tensor y32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (tiles || dots) {  // the input's bf16 rows as they are
    const at::Tensor xb = x.reshape({M, K}).contiguous();
    (tiles ? wfpass_direct::run_amx : wfpass_direct::run_dot)(
        M, N, K, reinterpret_cast<const uint16_t*>(xb.const_data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(wc.const_data_ptr<at::BFloat16>()), wc.stride(0), bp, y32.data_ptr<float>());
  } else if (dt == at::kBFloat16)
    wfpass_direct::run<Bf16>(M, N, K, x2.const_data_ptr<float>(), K,
                             reinterpret_cast<const Bf16*>(wc.const_data_ptr<at::BFloat16>()), wc.stride(0), bp,
                             y32.data_ptr<float>(), N);
  else
    wfpass_direct::run<F16>(M, N, K, x2.const_data_ptr<float>(), K,
                            reinterpret_cast<const F16*>(wc.const_data_ptr<at::Half>()), wc.stride(0), bp,
                            y32.data_ptr<float>(), N);
  y.view({M, N}).copy_(y32);  // rounded once, as the plain GEMM rounds its float32 sums
  return y;
}

}  // namespace wfpass_direct

TORCH_LIBRARY_FRAGMENT(wfpass, m) {
  m.def(WFPASS_SCHEMA_direct_linear);
  m.def(WFPASS_SCHEMA_native_direct, []() { return wfpass_direct::available(); });
  m.def(WFPASS_SCHEMA_native_direct_isa, []() { return std::string(wfpass_direct::isa()); });
  m.def(WFPASS_SCHEMA_native_direct_amx, []() { return wfpass_direct::amx_on(); });
  m.def(WFPASS_SCHEMA_native_direct_bf16dot, []() { return wfpass_direct::dot_on(); });
  m.def(WFPASS_SCHEMA_native_direct_skew, []() { return wfpass_direct::available() && wfpass_direct::skew_on(); });
}

TORCH_LIBRARY_IMPL(wfpass, CPU, m) { m.impl("_direct_linear", wfpass_direct::linear_op); }
