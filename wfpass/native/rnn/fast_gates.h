// The gate math and the step loops of fast_rnn.cpp, written once over a
// few vector primitives and compiled once per instruction set: fast_rnn.cpp
// includes this file inside namespace wfpass_fast::avx512 and again inside
// wfpass_fast::avx2, each time after defining
//
//   WF_T / WF_F           always-inline helper / kernel attributes carrying
//                         the target ISA (GCC/Clang `target(...)`)
//   V, Mask, kW           the float vector, a lane mask, the lane count
//   lanes(j, W)           lanes j .. j + kW of a row of width W (the tail's)
//   ld(m, p), st(m, p, v) masked load (zeros outside) and store
//   splat, add, sub, mul, div, vmin, vmax, fmadd (a b + c), fnmadd (c - a b)
//   absv(x), with_sign(mag, x), lt_select(a, b, t, f) (a < b ? t : f)
//   kExpMax, round_v(x), times_pow2(p, n), keep_nan(r, x)   exp_v's parts
//
// so both ISAs run the same formulas; they differ from ATen's (SLEEF) in the
// last bits, and from each other only above exp_v's clamp (kExpMax).
// Not a header to include anywhere else: it has no include guard by design.

// Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7
// polynomial, times 2^n. NaN stays NaN.
WF_T V exp_v(V x) {
  const V y = vmin(vmax(x, splat(-87.5f)), splat(kExpMax));
  const V n = round_v(mul(y, splat(1.44269504088896341f)));
  V r = fnmadd(n, splat(0.693359375f), y);
  r = fnmadd(n, splat(-2.12194440e-4f), r);
  V p = splat(1.9875691500E-4f);
  p = fmadd(p, r, splat(1.3981999507E-3f));
  p = fmadd(p, r, splat(8.3334519073E-3f));
  p = fmadd(p, r, splat(4.1665795894E-2f));
  p = fmadd(p, r, splat(1.6666665459E-1f));
  p = fmadd(p, r, splat(5.0000001201E-1f));
  p = fmadd(p, mul(r, r), add(r, splat(1.f)));
  return keep_nan(times_pow2(p, n), x);
}

WF_T V sigmoid_v(V x) {
  const V one = splat(1.f);
  return div(one, add(one, exp_v(sub(splat(0.f), x))));
}

// Cephes tanhf: x + x^3 P(x^2) below |x| = 0.625, else 1 - 2 / (exp(2|x|) + 1)
// with x's sign (written through exp(-2|x|) <= 1, so it cannot overflow).
WF_T V tanh_v(V x) {
  const V ax = absv(x), one = splat(1.f);
  const V e = exp_v(mul(ax, splat(-2.f)));
  const V big = with_sign(div(sub(one, e), add(one, e)), x);
  const V z = mul(x, x);
  V p = splat(-5.70498872745E-3f);
  p = fmadd(p, z, splat(2.06390887954E-2f));
  p = fmadd(p, z, splat(-5.37397155531E-2f));
  p = fmadd(p, z, splat(1.33314422036E-1f));
  p = fmadd(p, z, splat(-3.33332819422E-1f));
  const V small = fmadd(mul(p, z), x, x);
  return lt_select(ax, splat(0.625f), small, big);
}

WF_F void lstm_step(int64_t n, int64_t H, float* ws, const float* c_prev, int64_t ldcp, float* h, int64_t ldh) {
  for (int64_t r = 0; r < n; ++r) {
    float* w = ws + r * 6 * H;
    const float* cp = c_prev + r * ldcp;
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      const V i = sigmoid_v(ld(m, w + j)), f = sigmoid_v(ld(m, w + H + j));
      const V g = tanh_v(ld(m, w + 2 * H + j)), o = sigmoid_v(ld(m, w + 3 * H + j));
      const V c = fmadd(i, g, mul(f, ld(m, cp + j)));
      const V tc = tanh_v(c);
      st(m, w + j, i);
      st(m, w + H + j, f);
      st(m, w + 2 * H + j, g);
      st(m, w + 3 * H + j, o);
      st(m, w + 4 * H + j, c);
      st(m, w + 5 * H + j, tc);
      st(m, hr + j, mul(o, tc));
    }
  }
}

WF_F void gru_step(int64_t n, int64_t H, float* ws, const float* h_prev, int64_t ldp, float* h, int64_t ldh) {
  for (int64_t r = 0; r < n; ++r) {
    float* w = ws + r * 4 * H;
    const float* hp = h_prev + r * ldp;
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      const V rg = sigmoid_v(ld(m, w + j)), z = sigmoid_v(ld(m, w + H + j));
      const V nn = tanh_v(fmadd(rg, ld(m, w + 2 * H + j), ld(m, w + 3 * H + j)));
      st(m, w + j, rg);
      st(m, w + H + j, z);
      st(m, w + 3 * H + j, nn);
      st(m, hr + j, fmadd(z, sub(ld(m, hp + j), nn), nn));
    }
  }
}

WF_F void rnn_step(int64_t n, int64_t H, float* h, int64_t ldh, bool relu) {
  for (int64_t r = 0; r < n; ++r) {
    float* hr = h + r * ldh;
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      const V x = ld(m, hr + j);
      st(m, hr + j, relu ? vmax(x, splat(0.f)) : tanh_v(x));
    }
  }
}

WF_F void incoming(int64_t n, int64_t W, const float* g, int64_t ldg, const float* carry, int64_t ldc, float* dh,
                   int64_t lddh) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < W; j += kW) {
      const Mask m = lanes(j, W);
      const V c = ld(m, carry + r * ldc + j);
      st(m, dh + r * lddh + j, g ? add(ld(m, g + r * ldg + j), c) : c);
    }
}

// dc = ccar + dh o (1 - tanh(c)^2); the pre-activations' gradients
// dc g i (1 - i), dc c_prev f (1 - f), dc i (1 - g^2), dh tanh(c) o (1 - o)
// into dg; ccar = dc f (dL/dc_prev).
WF_F void lstm_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, const float* ws, const float* cp,
                             int64_t ldcp, float* dg, float* ccar) {
  const V one = splat(1.f);
  for (int64_t r = 0; r < n; ++r) {
    const float* w = ws + r * 6 * H;
    float* d = dg + r * 4 * H;
    float* cc = ccar + r * H;
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      const V h = ld(m, dh + r * lddh + j), i = ld(m, w + j), f = ld(m, w + H + j);
      const V g = ld(m, w + 2 * H + j), o = ld(m, w + 3 * H + j), tc = ld(m, w + 5 * H + j);
      const V dc = fmadd(mul(h, o), fnmadd(tc, tc, one), ld(m, cc + j));
      st(m, d + j, mul(mul(dc, g), fnmadd(i, i, i)));
      st(m, d + H + j, mul(mul(dc, ld(m, cp + r * ldcp + j)), fnmadd(f, f, f)));
      st(m, d + 2 * H + j, mul(mul(dc, i), fnmadd(g, g, one)));
      st(m, d + 3 * H + j, mul(mul(h, tc), fnmadd(o, o, o)));
      st(m, cc + j, mul(dc, f));
    }
  }
}

WF_F void gru_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, const float* z, int64_t ldz,
                            float* dg, float* hcar) {
  for (int64_t r = 0; r < n; ++r) {
    float* d = dg + r * 3 * H;
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      const V h = ld(m, dh + r * lddh + j);
      st(m, d + j, mul(ld(m, d + j), h));
      st(m, d + H + j, mul(ld(m, d + H + j), h));
      st(m, d + 2 * H + j, mul(ld(m, d + 2 * H + j), h));
      st(m, hcar + r * H + j, mul(h, ld(m, z + r * ldz + j)));
    }
  }
}

WF_F void rnn_step_backward(int64_t n, int64_t H, const float* dh, int64_t lddh, float* dpre, int64_t ldp) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < H; j += kW) {
      const Mask m = lanes(j, H);
      float* p = dpre + r * ldp + j;
      st(m, p, mul(ld(m, p), ld(m, dh + r * lddh + j)));
    }
}

// The step loops: the same for every ISA but for the gate math they call.

void lstm_forward(const std::vector<Step>& steps, int64_t H, int64_t Hout, float* ws, float* out, int64_t ldo,
                  const float* h0, int64_t ldh, const float* c0, int64_t ldc, const Recurrent& whh, const float* whr_t,
                  float* hbuf, float* cbuf, float* hpre) {
  const int64_t G = 4 * H, L = 6 * H;
  for (const Step& st : steps) {
    int64_t lh = 0, lc = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, Hout, st, lh);
    const float* cp = prev_rows(ws + 4 * H, L, c0, ldc, cbuf, H, st, lc);
    float* w = ws + st.r0 * L;
    float* h = out + st.r0 * ldo;
    step_gemm(st.n, G, Hout, hp, lh, whh, w, L);
    if (whr_t != nullptr) {
      lstm_step(st.n, H, w, cp, lc, hpre, H);
      gemm(st.n, Hout, H, hpre, H, whr_t, Hout, h, ldo, false);
    } else {
      lstm_step(st.n, H, w, cp, lc, h, ldo);
    }
  }
}

void gru_forward(const std::vector<Step>& steps, int64_t H, float* ws, float* out, int64_t ldo, const float* h0,
                 int64_t ldh, const Recurrent& whh, float* hbuf) {
  for (const Step& st : steps) {
    int64_t lh = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, H, st, lh);
    float* w = ws + st.r0 * 4 * H;
    step_gemm(st.n, 3 * H, H, hp, lh, whh, w, 4 * H);  // into r | z | hn
    gru_step(st.n, H, w, hp, lh, out + st.r0 * ldo, ldo);
  }
}

void rnn_forward(const std::vector<Step>& steps, int64_t H, float* out, int64_t ldo, const float* h0, int64_t ldh,
                 const Recurrent& whh, float* hbuf, bool relu) {
  for (const Step& st : steps) {
    int64_t lh = 0;
    const float* hp = prev_rows(out, ldo, h0, ldh, hbuf, H, st, lh);
    float* h = out + st.r0 * ldo;
    step_gemm(st.n, H, H, hp, lh, whh, h, ldo);
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
