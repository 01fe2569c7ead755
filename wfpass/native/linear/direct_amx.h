// The direct kernel's AMX body for bfloat16 weights at 4-32 input rows (a
// prompt's rows), reading the weight as the Parameter holds it. Why: there
// the widening body (direct_kernel.h) is bound by its multiply-adds, 2.1-2.6x
// slower than the plain GEMM, so those rows took oneDNN's packed copy of the
// weight (as many bytes as the weight). AMX's tile product needs its second
// operand in pairs along K ("VNNI"); Y^T = W . X^T puts the weight first: an
// A tile is 16 weight rows x 32 elements loaded with the row stride, as they
// are, and only the input rows (a few KB) are re-laid into pairs per call.
// Measured at 16 rows, bf16, 1 thread, each weight cycling through 512 MiB
// (Intel Xeon with AMX): 5632x2048 1.87 ms (oneDNN's packed copy 2.60,
// plain 2.33, widening body 4.30; the read-bandwidth floor 1.58). On by
// default; WFPASS_DIRECT_AMX=0 turns it off (direct.cpp, amx_on).
//
// One block of 16 weight rows at a time over the whole of K (16 streams the
// hardware prefetcher follows): up to 16 rows, four accumulator tiles on the
// k-block mod 4, so the tile products do not wait on each other; 17-32 rows,
// two per row half, the weight tile used by both. Needs K % 32 == 0 and
// N % 16 == 0 (linear_op checks); Linux asks the kernel for the tile state
// once per process (arch_prctl ARCH_REQ_XCOMP_PERM).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define WFPASS_DIRECT_AMX 1
#endif

namespace wfpass_direct {
namespace amx {

#ifdef WFPASS_DIRECT_AMX
// The tile configuration AMX's ldtilecfg reads (palette 1).
struct Config {
  uint8_t palette = 1, start = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
  return tile && bf16 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

// The input rows [m0, m0 + mi) in pairs along K: xv[kb][r][m][j] = x[m][32 kb + 2 r + j].
inline void vnni(const uint16_t* x, int64_t ldx, int64_t m0, int64_t mi, int64_t K, uint16_t* xv) {
  for (int64_t kb = 0; kb < K / 32; ++kb)
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t m = 0; m < mi; ++m) {
        const uint16_t* p = x + (m0 + m) * ldx + kb * 32 + 2 * r;
        uint16_t* q = xv + ((kb * 16 + r) * mi + m) * 2;
        q[0] = p[0], q[1] = p[1];
      }
}

#define WFPASS_AMX __attribute__((target("amx-tile,amx-bf16")))

// Rows [r0, r1) of Y^T for input rows held as xv0 (the first mi0 <= 16) and
// xv1 (the next mi1 <= 16, or none): y[m][n] = sum_k w[n][k] x[m][k] + bias[n].
WFPASS_AMX inline void rows(int64_t K, const uint16_t* w, int64_t ldw, const uint16_t* xv0, int64_t mi0,
                            const uint16_t* xv1, int64_t mi1, const float* bias, float* y, int64_t ldy, int64_t r0,
                            int64_t r1) {
  Config cfg;
  const int64_t c1 = mi1 > 0 ? mi1 : mi0;  // tiles 1 and 3: the second half's sums, or more of the first's
  const int64_t cols[8] = {mi0, c1, mi0, c1, 16, 16, mi0, c1};
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(cols[t] * 4);
  _tile_loadconfig(&cfg);
  const int64_t kbs = K / 32, s0 = mi0 * 4, s1 = c1 * 4, step0 = 16 * mi0 * 2, step1 = 16 * mi1 * 2;
  alignas(64) float ct[4][16 * 16];
  for (int64_t n = r0; n < r1; n += 16) {
    const uint16_t* a = w + n * ldw;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    int64_t kb = 0;
    if (mi1 == 0) {
      for (; kb + 4 <= kbs; kb += 4) {
        _tile_loadd(4, a + kb * 32, ldw * 2); _tile_loadd(6, xv0 + kb * step0, s0); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a + kb * 32 + 32, ldw * 2); _tile_loadd(7, xv0 + (kb + 1) * step0, s0); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(4, a + kb * 32 + 64, ldw * 2); _tile_loadd(6, xv0 + (kb + 2) * step0, s0); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, a + kb * 32 + 96, ldw * 2); _tile_loadd(7, xv0 + (kb + 3) * step0, s0); _tile_dpbf16ps(3, 5, 7);
      }
      for (; kb < kbs; ++kb) {
        _tile_loadd(4, a + kb * 32, ldw * 2);
        _tile_loadd(6, xv0 + kb * step0, s0);
        _tile_dpbf16ps(0, 4, 6);
      }
    } else {
      for (; kb + 2 <= kbs; kb += 2) {
        _tile_loadd(4, a + kb * 32, ldw * 2); _tile_loadd(6, xv0 + kb * step0, s0); _tile_loadd(7, xv1 + kb * step1, s1);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + kb * 32 + 32, ldw * 2); _tile_loadd(6, xv0 + (kb + 1) * step0, s0);
        _tile_loadd(7, xv1 + (kb + 1) * step1, s1); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      if (kb < kbs) {
        _tile_loadd(4, a + kb * 32, ldw * 2); _tile_loadd(6, xv0 + kb * step0, s0); _tile_loadd(7, xv1 + kb * step1, s1);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, ct[0], s0); _tile_stored(1, ct[1], s1); _tile_stored(2, ct[2], s0); _tile_stored(3, ct[3], s1);
    for (int64_t i = 0; i < 16; ++i) {
      const float b = bias != nullptr ? bias[n + i] : 0.0f;
      if (mi1 == 0) {
        for (int64_t m = 0; m < mi0; ++m)
          y[m * ldy + n + i] = ((ct[0][i * mi0 + m] + ct[1][i * mi0 + m]) + (ct[2][i * mi0 + m] + ct[3][i * mi0 + m])) + b;
      } else {
        for (int64_t m = 0; m < mi0; ++m) y[m * ldy + n + i] = ct[0][i * mi0 + m] + ct[2][i * mi0 + m] + b;
        for (int64_t m = 0; m < mi1; ++m) y[(16 + m) * ldy + n + i] = ct[1][i * mi1 + m] + ct[3][i * mi1 + m] + b;
      }
    }
  }
  _tile_release();
}
#undef WFPASS_AMX
#endif

}  // namespace amx
}  // namespace wfpass_direct
