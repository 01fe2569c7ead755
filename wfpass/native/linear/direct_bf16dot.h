// The direct kernel's body for a prompt's bf16 rows on a CPU with AVX-512
// BF16 and no AMX (direct.cpp, dot_takes): vdpbf16ps multiplies 32 bf16
// pairs of an input row and a weight row and adds them, pair by pair, into
// 16 float32 sums, reading the input and the weight as they are (no
// widening of either). A tile of R input rows x 4 weight rows (R <= 4),
// over K in steps of 32 (one 64-byte line of each row), the sums reduced
// once per K chunk (prompt_rows) and added in float32. Every product of
// two bf16 values is exact in float32, so the sums are float32 sums of
// the exact products, as the widening body's are, in another order; the
// output is rounded once, as there.
// Why: without it, 16 prompt rows of a bf16 model on an AMD EPYC (AVX-512
// BF16, no AMX) ran faster from oneDNN's packed copies, and the decision
// rule kept a copy of most of the model (946 MiB for 1.06 GB of weights).
// A decode step's one or two rows take another loop over the same
// instruction (stream_rows): the weight rows one after another.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define WFPASS_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace wfpass_direct {
namespace bf16dot {

// Does this CPU run vdpbf16ps (and the OS keep AVX-512 state)?
inline bool probe() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }

// The sums of the lanes of 16 vectors: out[4 (p % 4) + p / 4] = the sum of
// v[p]'s lanes. Two 128-bit-lane shuffle stages, then in-lane unpacks, ~30
// instructions where 16 separate reductions take ~130. AVX-512F alone: the
// widening body's Isa::sums (direct.cpp) is this function too.
__attribute__((target("avx512f"), always_inline)) inline void sums16(const __m512* v, float* out) {
  __m512 s[8], r[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE)));
}

// y[i * ldy + j] (+)= x_i[k0:k1] . w_j[k0:k1], R input rows (leading dim
// ldx) x C weight rows (leading dim ldw), k0, k1 multiples of 32: the
// first of a row's K chunks writes its sums (+ bias[j]), the others add
// theirs. NPF lines of the rows at pf, pf + pfs rows, ... are fetched
// into L1 meanwhile, one per line of K.
template <int R, int C, int NPF>
WFPASS_DOT_TARGET inline void tile(const uint16_t* x, int64_t ldx, int64_t k0, int64_t k1, const uint16_t* w,
                                   int64_t ldw, const float* bias, float* y, int64_t ldy, bool first,
                                   const uint16_t* pf, int64_t pfs) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 32) {
    __m512bh xv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
#pragma GCC unroll 4
    for (int p = 0; p < NPF; ++p) _mm_prefetch(reinterpret_cast<const char*>(pf + p * pfs * ldw + k), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  alignas(64) float t[16];
  if constexpr (R == 4 && C == 4) {
    // A whole tile's 16 sums at once (sums16), ~30 instructions where 16
    // separate reductions take ~130: at 16 rows of a 2048-wide weight the
    // separate ones were an eighth of the tile's work.
    sums16(&acc[0][0], t);
  } else {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) t[4 * j + i] = _mm512_reduce_add_ps(acc[i][j]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      float& out = y[i * ldy + j];
      out = first ? t[4 * j + i] + (bias != nullptr ? bias[j] : 0.f) : out + t[4 * j + i];
    }
}

// One tile of R <= 4 input rows, NPF picked at run time (0, 1, 2 or 4).
template <int C>
WFPASS_DOT_TARGET inline void tile_rows(int64_t R, int npf, const uint16_t* x, int64_t ldx, int64_t k0, int64_t k1,
                                        const uint16_t* w, int64_t ldw, const float* bias, float* y, int64_t ldy,
                                        bool first, const uint16_t* pf, int64_t pfs) {
#define WFPASS_DOT_TILE(RR)                                                                    \
  switch (npf) {                                                                               \
    case 0: return tile<RR, C, 0>(x, ldx, k0, k1, w, ldw, bias, y, ldy, first, pf, pfs);       \
    case 1: return tile<RR, C, 1>(x, ldx, k0, k1, w, ldw, bias, y, ldy, first, pf, pfs);       \
    case 2: return tile<RR, C, 2>(x, ldx, k0, k1, w, ldw, bias, y, ldy, first, pf, pfs);       \
    default: return tile<RR, C, 4>(x, ldx, k0, k1, w, ldw, bias, y, ldy, first, pf, pfs);      \
  }
  switch (R) {
    case 4: WFPASS_DOT_TILE(4)
    case 3: WFPASS_DOT_TILE(3)
    case 2: WFPASS_DOT_TILE(2)
    default: WFPASS_DOT_TILE(1)
  }
#undef WFPASS_DOT_TILE
}

// A prompt's rows (M >= 3) against weight rows r0 .. r1 - 1: panels of 4
// weight rows, each against every tile of 4 input rows (the last tile the
// M % 4 rest), over K in chunks of at most kChunk elements.
// - The tiles run forward over one panel and backward over the next, so
//   the tile a panel ends with starts the next from L1 (16 rows of a
//   2048-wide input are 64 KB, more than the 48 KB L1 of the CPU measured:
//   every panel read the whole input from L2 again).
// - The first min(tiles, 4) tiles fetch the next panel's 4 rows into L1
//   (one row each at 16 rows, two at 8, 2-1-1 at 12, four at 4), while
//   the panel's rows come in from memory: a 2048-wide bf16 row is one
//   4 KB page, which the hardware stream prefetchers do not cross.
// - A K wider than kChunk is cut into equal chunks, each over all panels
//   in turn, the sums of each chunk added into the float32 output: a
//   chunk's 4 weight rows (<= 16 KB) then stay in L1 across the tiles
//   (a 5632-wide panel is 44 KB).
// Measured on an AMD EPYC (Zen 5-class, AVX-512 BF16, no AMX), 1 thread,
// in a standalone timing of this body beside the 4x4-tile body it
// replaces (each panel against each tile over the whole K, the panel 16
// rows on fetched into L2 by the first tile), interleaved, each weight
// cycling through 48-384 MiB of copies: 16 rows 1.16x (2048x2048), 1.29x
// (11264x2048), 1.37x (2048x5632), 1.27x (3072x2048); 8 rows 1.12-1.37x;
// 13 rows 1.23x. Against oneDNN's packed copy at 16 rows, oneDNN's time
// is now 0.88-1.02x of this body's (0.71-0.84x before), so the decision
// rule makes no copy for a prompt (docs/results/decode_prompt_amd.md).
// Each output's sum is the same for any split of the weight rows over
// threads (chunks and tiles depend on M and K only).
constexpr int64_t kChunk = 2048;
WFPASS_DOT_TARGET inline void prompt_rows(int64_t M, int64_t N, int64_t K, const uint16_t* x, const uint16_t* w,
                                          int64_t ldw, const float* bias, float* y, int64_t r0, int64_t r1) {
  const int64_t tiles = (M + 3) / 4, fetchers = std::min<int64_t>(tiles, 4);
  const int64_t lines = K / 32, chunks = (lines * 32 + kChunk - 1) / kChunk, per = (lines + chunks - 1) / chunks;
  const int64_t n4 = r0 + (r1 - r0) / 4 * 4;  // the panels' end; rows n4 .. r1 - 1 one at a time
  int64_t pass = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * per * 32, k1 = std::min(K, (c + 1) * per * 32);
    const bool first = c == 0;
    for (int64_t n = r0; n < n4; n += 4, ++pass) {
      // The next panel, or the next chunk's first panel after the last.
      const uint16_t* next = n + 8 <= n4 ? w + (n + 4) * ldw : (c + 1 < chunks ? w + r0 * ldw + (k1 - k0) : nullptr);
      for (int64_t q = 0; q < tiles; ++q) {
        const int64_t t = (pass & 1) ? tiles - 1 - q : q;
        // Tile q fetches rows q, q + fetchers, ... of the 4 (all 4 are fetched whatever the tile count).
        const int npf = (q < fetchers && next != nullptr) ? static_cast<int>((4 - q + fetchers - 1) / fetchers) : 0;
        tile_rows<4>(std::min<int64_t>(4, M - 4 * t), npf, x + 4 * t * K, K, k0, k1, w + n * ldw, ldw,
                     bias != nullptr ? bias + n : nullptr, y + 4 * t * N + n, N, first,
                     next != nullptr ? next + q * ldw : nullptr, fetchers);
      }
    }
    for (int64_t n = n4; n < r1; ++n)
      for (int64_t t = 0; t < tiles; ++t)
        tile_rows<1>(std::min<int64_t>(4, M - 4 * t), 0, x + 4 * t * K, K, k0, k1, w + n * ldw, ldw,
                     bias != nullptr ? bias + n : nullptr, y + 4 * t * N + n, N, first, nullptr, 0);
  }
}

// One or two input rows (R) against weight rows r0 .. r1 - 1, one weight
// row after another, so the weight is read as one sequential stream (a
// row's lines fetched 2 KB ahead into L1), one vdpbf16ps per weight line
// and input row. An output sums line s of its row into the s % 4-th of
// its 4 accumulators (lines past the last whole 4 into the first), adds
// them as (a0 + a1) + (a2 + a3), and sums16 reduces 16 outputs' vectors at
// once: the same operations in the same order whatever R, the block or
// the thread, so a row's result is the same bits alone and beside a
// second row. Needs K % 32 == 0. Why: the widening body reads 8 or 16
// weight rows at a time (block_skew), 8-16 streams, and on an AMD EPYC
// (Zen 5-class, AVX-512 BF16, no AMX) this one stream read faster, 1
// thread, interleaved in one process, each weight cycling through 384 MiB
// (shapes of the 1 GB model, K 2048): 1.08-1.36x of the widening body at
// one row and 0.99-1.25x at two, level with or ahead of oneDNN's packed
// copy; at 2 threads 1.14-1.37x. With K 5632 (down) two rows read slower,
// 0.82-0.87x (each weight row reads the two input rows, 22 KB, again), so
// dot_takes keeps K > 4096 on the widening body.
template <int R>
WFPASS_DOT_TARGET inline void stream_rows(int64_t N, int64_t K, const uint16_t* x, const uint16_t* w, int64_t ldw,
                                          const float* bias, float* y, int64_t r0, int64_t r1) {
  constexpr int G = 16 / R;      // weight rows whose sums are reduced together
  constexpr int kAheadB = 2048;  // bytes of the stream fetched ahead
  for (int64_t n0 = r0; n0 < r1; n0 += G) {
    const int g = static_cast<int>(std::min<int64_t>(G, r1 - n0));
    __m512 res[16];
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) res[p] = _mm512_setzero_ps();
    for (int j = 0; j < g; ++j) {
      const uint16_t* wr = w + (n0 + j) * ldw;
      __m512 acc[R][4];
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) acc[i][a] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 128 <= K; k += 128) {
#pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) _mm_prefetch(reinterpret_cast<const char*>(wr + k + 32 * a) + kAheadB, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * a);
#pragma GCC unroll 2
          for (int i = 0; i < R; ++i)
            acc[i][a] = _mm512_dpbf16_ps(acc[i][a], (__m512bh)_mm512_loadu_si512(x + i * K + k + 32 * a), wv);
        }
      }
      for (; k < K; k += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
#pragma GCC unroll 2
        for (int i = 0; i < R; ++i)
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_loadu_si512(x + i * K + k), wv);
      }
      // Output p = i G + j at res[4 (p % 4) + p / 4], which sums16 leaves at t[p].
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i) {
        const int p = i * G + j;
        res[4 * (p % 4) + p / 4] =
            _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3]));
      }
    }
    alignas(64) float t[16];
    sums16(res, t);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < g; ++j) y[i * N + n0 + j] = t[i * G + j] + (bias != nullptr ? bias[n0 + j] : 0.f);
  }
}

WFPASS_DOT_TARGET inline void rows(int64_t M, int64_t N, int64_t K, const uint16_t* x, const uint16_t* w, int64_t ldw,
                                   const float* bias, float* y, int64_t r0, int64_t r1) {
  if (M == 1) return stream_rows<1>(N, K, x, w, ldw, bias, y, r0, r1);  // a decode step (dot_takes)
  if (M == 2) return stream_rows<2>(N, K, x, w, ldw, bias, y, r0, r1);
  prompt_rows(M, N, K, x, w, ldw, bias, y, r0, r1);
}

}  // namespace bf16dot
}  // namespace wfpass_direct
#endif
