// The body of the "direct" kernel (direct.cpp), included once per
// instruction set: each inclusion sits in a namespace of its own that
// defines `Isa` (the vector type and its few operations) and the macros
// WFPASS_TARGET / WFPASS_TARGET_INLINE (the matching target attribute), so
// the same code is compiled for AVX-512F and for AVX2 with FMA and picked at
// run time. No include guard on purpose.
//
// Isa: V (a vector of W floats), Mask, ACC (accumulators a block holds: 16
// of 32 registers with AVX-512, 8 of 16 with AVX2), zero(), loadu(p),
// load(mask, p), fma(a, b, c), tail(n) (a mask of the first n lanes),
// slot(p) (where output p's accumulator sits) and sums(acc, out) (out[p] =
// the sum of the lanes of acc[slot(p)], for p < ACC), and for the weight's
// element type WT (float, Bf16 or F16): loadw(p) (W elements widened to
// float32) (load_tail below reads a row's last elements).
// Input rows, bias and sums are float32 whatever WT is: a half-precision
// weight is widened as it streams in, so its bytes are read once, as they
// are, and every product is summed in float32.

// The last K % W elements of a weight row (the rest zero): float32 through
// the ISA's masked load; a half row through a zeroed copy, as a masked
// 16-bit load needs AVX-512BW (once per weight row).
WFPASS_TARGET_INLINE typename Isa::V load_tail(const float* p, typename Isa::Mask m, int64_t) {
  return Isa::load(m, p);
}
template <class T>
WFPASS_TARGET_INLINE typename Isa::V load_tail(const T* p, typename Isa::Mask, int64_t n) {
  alignas(64) T buf[Isa::W] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
  return Isa::loadw(buf);
}

// One step of W columns k .. k + W - 1 (the last partial one masked) for
// R input rows and C weight rows: output p = i C + j (input row i, weight
// row j) accumulates at slot(p). With PF, the same columns of the C rows at
// pf are fetched into cache.
template <int R, int C, bool PF, bool TAIL, class WT>
WFPASS_TARGET_INLINE void step(typename Isa::V* acc, const float* x, int64_t ldx, const WT* w, int64_t ldw,
                               int64_t k, typename Isa::Mask m, int64_t n, const WT* pf) {
  typename Isa::V wv[C];
#pragma GCC unroll 16
  for (int j = 0; j < C; ++j) wv[j] = TAIL ? load_tail(w + j * ldw + k, m, n) : Isa::loadw(w + j * ldw + k);
  if (PF) {
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + k), _MM_HINT_T1);
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const typename Isa::V xv = TAIL ? Isa::load(m, x + i * ldx + k) : Isa::loadu(x + i * ldx + k);
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) acc[Isa::slot(i * C + j)] = Isa::fma(xv, wv[j], acc[Isa::slot(i * C + j)]);
  }
}

// Two steps' columns k .. k + 2 W - 1 of a half-precision weight (2 W
// elements: one 64-byte cache line of each row), each weight row's line
// read whole before the next row's. Two step() calls in a row would read
// the first half of all C rows, then the second: with rows 4 KB apart
// (2048 bf16 input features) every row's line sits in the same L1 set, and
// C = 16 of them evicted one another before their second half was read
// (an AMD EPYC, 1 thread, bf16 2048x2048 at one row: 0.60 of the read
// bandwidth). Each accumulator gets the same multiply-adds in the same
// order as from two step() calls: the same bits.
template <int R, int C, bool PF, class WT>
WFPASS_TARGET_INLINE void step2(typename Isa::V* acc, const float* x, int64_t ldx, const WT* w, int64_t ldw,
                                int64_t k, const WT* pf) {
  typename Isa::V xa[R], xb[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    xa[i] = Isa::loadu(x + i * ldx + k);
    xb[i] = Isa::loadu(x + i * ldx + k + Isa::W);
  }
#pragma GCC unroll 16
  for (int j = 0; j < C; ++j) {
    const typename Isa::V wa = Isa::loadw(w + j * ldw + k), wb = Isa::loadw(w + j * ldw + k + Isa::W);
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + k), _MM_HINT_T1);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      acc[Isa::slot(i * C + j)] = Isa::fma(xa[i], wa, acc[Isa::slot(i * C + j)]);
      acc[Isa::slot(i * C + j)] = Isa::fma(xb[i], wb, acc[Isa::slot(i * C + j)]);
    }
  }
}

// y[i * ldy + j] = x_i . w_j (+ bias[j]) for R input rows and C weight rows
// (R C <= ACC); with PF, the C rows at pf are fetched into cache meanwhile.
template <int R, int C, bool PF, class WT>
WFPASS_TARGET_INLINE void block(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* y,
                                int64_t ldy, const float* bias, const WT* pf) {
  static_assert(R * C <= Isa::ACC, "more outputs than accumulators");
  typename Isa::V acc[Isa::ACC];
#pragma GCC unroll 16
  for (int i = 0; i < Isa::ACC; ++i) acc[i] = Isa::zero();
  int64_t k = 0;
  if constexpr (sizeof(WT) == 2)
    for (; k + 2 * Isa::W <= K; k += 2 * Isa::W) step2<R, C, PF, WT>(acc, x, ldx, w, ldw, k, pf);
  for (; k + Isa::W <= K; k += Isa::W) step<R, C, PF, false>(acc, x, ldx, w, ldw, k, Isa::tail(Isa::W), Isa::W, pf);
  if (k < K) step<R, C, PF, true>(acc, x, ldx, w, ldw, k, Isa::tail(K - k), K - k, pf);
  alignas(64) float t[Isa::ACC];
  Isa::sums(acc, t);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) y[i * ldy + j] = t[i * C + j] + (bias != nullptr ? bias[j] : 0.f);
}

// block() with each weight row read from a column of its own: row n
// starts at line ((n mod 16) S) / 16 of its S whole 64-byte lines, goes to
// the end, then from the start, then its last K mod (64 / sizeof(WT))
// columns. Taken by one and two input rows over a half-precision weight
// whose rows lie a multiple of 4 KB apart (2048 bf16 input features): read
// by block() at one column, a block's C rows' lines, and the next lines
// the hardware's prefetcher fetches for each, all sit in one L1 set (8
// ways on the AMD EPYC measured) and evict one another before they are
// read. Measured there, 1 thread, each weight cycling through 384 MiB: a
// 2048x2048 bf16 weight at one row 0.74 of the read bandwidth at one
// column, 0.88 skewed (0.87 with the rows padded to 4160 bytes instead);
// 8000x2048 0.83 -> 0.91; at two rows 0.84 -> 1.12 and 0.89 -> 1.19 (the
// bandwidth reference, torch.mv, is not a ceiling). Rows not 4 KB apart
// (5632 bf16 features: 0.99 at one column, 0.91 skewed) and float32 rows
// (1024 and 2048 features: 0.98 and 1.12 at one column, 0.94 and 1.01
// skewed) read better at one column and keep block(). An output's sum
// depends on its row's number and K alone, not on the block, the thread
// or M (1 or 2): the same bits in any such call. The input is read at each
// weight row's own columns, from L1.
template <int R, int C, bool PF, class WT>
WFPASS_TARGET_INLINE void block_skew(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, float* y,
                                     int64_t ldy, const float* bias, const WT* pf, int64_t n0) {
  static_assert(R * C <= Isa::ACC, "more outputs than accumulators");
  constexpr int L = 64 / static_cast<int>(sizeof(WT));  // elements in one line
  constexpr int NV = L / Isa::W;                        // vectors in one line
  typename Isa::V acc[Isa::ACC];
#pragma GCC unroll 16
  for (int i = 0; i < Isa::ACC; ++i) acc[i] = Isa::zero();
  const int64_t S = K / L, end = S * L;
  int64_t kj[C];
#pragma GCC unroll 16
  for (int j = 0; j < C; ++j) kj[j] = ((((n0 + j) & 15) * S) >> 4) * L;
  for (int64_t s = 0; s < S; ++s) {
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) {
      const int64_t k = kj[j];
      typename Isa::V wv[NV];
      Isa::line(w + j * ldw + k, wv);
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + k), _MM_HINT_T1);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[Isa::slot(i * C + j)] = Isa::fma(Isa::loadu(x + i * ldx + k + v * Isa::W), wv[v], acc[Isa::slot(i * C + j)]);
      kj[j] = k + L == end ? 0 : k + L;
    }
  }
  int64_t k = end;
  for (; k + Isa::W <= K; k += Isa::W) step<R, C, false, false>(acc, x, ldx, w, ldw, k, Isa::tail(Isa::W), Isa::W, pf);
  if (k < K) step<R, C, false, true>(acc, x, ldx, w, ldw, k, Isa::tail(K - k), K - k, pf);
  alignas(64) float t[Isa::ACC];
  Isa::sums(acc, t);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) y[i * ldy + j] = t[i * C + j] + (bias != nullptr ? bias[j] : 0.f);
}

// Every input row against the C weight rows at w: blocks of 4, 2 and 1
// input rows, as many as the accumulators allow; the first block fetches
// the C rows at pf.
template <int C, class WT>
WFPASS_TARGET_INLINE void rows_c(int64_t M, const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                                 float* y, int64_t ldy, const float* bias, const WT* pf) {
  int64_t i = 0;
  bool first = true;
  if constexpr (4 * C <= Isa::ACC) {
    for (; i + 4 <= M; i += 4, first = false)
      first ? block<4, C, true, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf)
            : block<4, C, false, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf);
  }
  if constexpr (2 * C <= Isa::ACC) {
    for (; i + 2 <= M; i += 2, first = false)
      first ? block<2, C, true, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf)
            : block<2, C, false, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf);
  }
  for (; i < M; ++i, first = false)
    first ? block<1, C, true, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf)
          : block<1, C, false, WT>(x + i * ldx, ldx, w, ldw, K, y + i * ldy, ldy, bias, pf);
}

// Every input row at once (R = M, up to 7) against the weight rows
// r0 .. r1 - 1, C = ACC / R of them per block, so the weight is read once:
// a block of 5 input rows x 3 weight rows takes 8 loads for 15
// multiply-adds, where blocks of 4 and then 1 input row read each weight
// row twice and the second pass takes 5 loads for 4. The last rows of the
// range (fewer than C) one at a time.
template <int R, class WT>
WFPASS_TARGET_INLINE void all_rows(int64_t N, int64_t K, const float* x, int64_t ldx, const WT* w, int64_t ldw,
                                   const float* bias, float* y, int64_t ldy, int64_t r0, int64_t r1) {
  constexpr int C = Isa::ACC / R;
  constexpr int64_t kAhead = 16;
  int64_t n = r0;
  if constexpr (R <= 2 && sizeof(WT) == 2) {
    if (ldw % (4096 / sizeof(WT)) == 0 && skew_on()) {
      for (; n + C <= r1; n += C) {
        const WT* wn = w + n * ldw;
        const WT* pf = n + kAhead + C <= N ? wn + kAhead * ldw : wn;
        block_skew<R, C, true, WT>(x, ldx, wn, ldw, K, y + n, ldy, bias != nullptr ? bias + n : nullptr, pf, n);
      }
      for (; n < r1; ++n)
        block_skew<R, 1, false, WT>(x, ldx, w + n * ldw, ldw, K, y + n, ldy, bias != nullptr ? bias + n : nullptr,
                                    nullptr, n);
      return;
    }
  }
  for (; n + C <= r1; n += C) {
    const WT* wn = w + n * ldw;
    const WT* pf = n + kAhead + C <= N ? wn + kAhead * ldw : wn;  // else these rows again: in cache
    block<R, C, true, WT>(x, ldx, wn, ldw, K, y + n, ldy, bias != nullptr ? bias + n : nullptr, pf);
  }
  for (; n < r1; ++n)
    block<R, 1, false, WT>(x, ldx, w + n * ldw, ldw, K, y + n, ldy, bias != nullptr ? bias + n : nullptr, nullptr);
}

// Weight rows r0 .. r1 - 1 for every input row. One or two input rows, and
// up to 7 (4 with AVX2's 8 accumulators) where the rows are long (K >=
// 1024): all at once (all_rows). Else C weight rows at a time (ACC / 2 for
// 3 input rows, ACC / 4 for more), every block of 4 input rows (then 2, 1)
// going through them while they stay in L1 (C rows of 1376 floats: 22 KB
// with AVX-512). Which is faster was measured, as the direct kernel's time
// over brgemm's with the weight cycling through 16 MiB of copies, 1 thread,
// AVX-512, three runs each: at 5-7 rows a 256x1376 weight took 0.77-0.93
// all at once against 0.85-1.08 in blocks; the 384x256 and 2752x256 weights
// 0.84-1.11 all at once against 0.69-0.91 in blocks (their rows are short:
// a block's 16 steps then cost less than its sums and stores). Each group's
// first block of input rows fetches the weight rows kAhead further on: a weight row is a short stream (1 KB at 256 input features) that the
// hardware's prefetchers barely start on, so without it the rows came from
// memory one miss at a time (a 2752x256 weight at 8 rows, cycling through
// 16 MiB of weights as in a model: 611 us, against 474 us plain; with it,
// 142 us).
template <class WT>
WFPASS_TARGET void rows_of(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const WT* w,
                           int64_t ldw, const float* bias, float* y, int64_t ldy, int64_t r0, int64_t r1) {
  constexpr int A = Isa::ACC;
  constexpr int64_t kAhead = 16;
  if (M == 1) return all_rows<1, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
  if (M == 2) return all_rows<2, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
  if (K >= 1024) {
    switch (M) {
      case 3: return all_rows<3, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
      case 4: return all_rows<4, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
      default: break;
    }
    if constexpr (A >= 16) {
      switch (M) {
        case 5: return all_rows<5, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
        case 6: return all_rows<6, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
        case 7: return all_rows<7, WT>(N, K, x, ldx, w, ldw, bias, y, ldy, r0, r1);
        default: break;
      }
    }
  }
  const int64_t C = M < 4 ? A / 2 : A / 4;
  int64_t n = r0;
  for (; n + C <= r1; n += C) {
    const WT* wn = w + n * ldw;
    const WT* pf = n + kAhead + C <= N ? wn + kAhead * ldw : wn;  // else these rows again: in cache
    const float* bn = bias != nullptr ? bias + n : nullptr;
    if (C == A / 2)
      rows_c<A / 2, WT>(M, x, ldx, wn, ldw, K, y + n, ldy, bn, pf);
    else
      rows_c<A / 4, WT>(M, x, ldx, wn, ldw, K, y + n, ldy, bn, pf);
  }
  for (; n < r1; ++n)  // the last rows of the range, one at a time
    rows_c<1, WT>(M, x, ldx, w + n * ldw, ldw, K, y + n, ldy, bias != nullptr ? bias + n : nullptr, w + n * ldw);
}
