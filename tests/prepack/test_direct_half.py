"""The ``direct`` kernel on bfloat16 and float16 weights: the parameter read
as it is (2 bytes an element, no float32 copy), widened in registers and
summed in float32, the output rounded once, as the plain GEMM rounds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wfpass import native
from wfpass.native import ops as _nops
from wfpass.tools.doctor import cpu_words

HALF = [d for d in (torch.bfloat16, torch.float16) if _nops.direct_runs(d)]

pytestmark = pytest.mark.skipif(not HALF, reason="no direct kernel here (wfpass's C++ kernels, or AVX-512F / AVX2 "
                                "with FMA and F16C, missing)")


def _want(x, w, b, dtype):
    """The exact float32 sums of the same half values, rounded once to ``dtype``."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return y.to(dtype)


@pytest.mark.parametrize("dtype", HALF or [torch.bfloat16])
def test_half_weights_give_the_float32_sums_rounded_once(dtype):
    """Any shape (output features not a multiple of the 16-row block, input
    features not a multiple of the vector width: the row's tail; 53 = a
    whole cache line of a half row, one vector, a tail), 1 to 70
    input rows, batched and strided inputs, a weight whose rows are apart
    or transposed, with and without a bias, at 1 and 2 threads: within one
    rounding of the exact result (the plain GEMM is held to the same)."""
    torch.manual_seed(0)
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n, k in ((384, 256), (100, 37), (1, 5), (17, 16), (48, 1), (35, 1030), (64, 2048), (33, 53)):
                w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
                wide = torch.randn(n, k + 3).to(dtype)[:, 1:k + 1]
                for x in (*(torch.randn(m, k).to(dtype) for m in (1, 2, 3, 5, 7, 70)),
                          torch.randn(2, 3, k).to(dtype), torch.randn(k, 9).to(dtype).t()):
                    for bias in (b, None):
                        for weight in (w, wide, w.t().contiguous().t()):
                            got, want = _nops.direct_linear(x, weight, bias), _want(x, weight, bias, dtype)
                            assert got.dtype == dtype and got.shape == want.shape
                            scale = want.abs().max().item() + 1e-3
                            err = (got.double() - want.double()).abs().max().item() / scale
                            plain = (F.linear(x, weight, bias).double() - want.double()).abs().max().item() / scale
                            assert err <= max(2 * ulp, 1.5 * plain), (dtype, n, k, tuple(x.shape), err, plain)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", HALF or [torch.bfloat16])
def test_a_half_call_whose_tensors_do_not_fit_raises(dtype):
    w, x = torch.randn(100, 37).to(dtype), torch.randn(4, 37).to(dtype)
    bad = [(x.float(), w, None), (x, w.float(), None), (x, w, torch.randn(100)), (torch.randn(4, 36).to(dtype), w, None),
           (x, w, torch.randn(99).to(dtype)),
           (x, w.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16), None)]
    for args in bad:
        with pytest.raises(RuntimeError, match="_direct_linear"):
            _nops.direct_linear(*args)


@pytest.mark.skipif(torch.float16 not in HALF, reason="no fp16 direct kernel here")
def test_fp16_linears_where_onednn_has_no_fp16_kernel_take_the_direct_kernel(monkeypatch):
    """On a CPU whose oneDNN cannot multiply fp16 (an AVX2 CPU, an AMD EPYC
    without avx512_fp16: faked here), a fp16 model's linears are still
    served, by the copy-free kernel: before, they were left with "oneDNN
    cannot multiply torch.float16 on this CPU"."""
    import copy

    import torch.nn as nn

    import wfpass
    from wfpass._torch import kernels as _k
    from wfpass.prepack import guards

    monkeypatch.setattr(_k, "onednn_packs", lambda dtype: False)
    monkeypatch.setattr(_k, "mkl_packs", lambda dtype: False)
    monkeypatch.setattr(guards, "_always", lambda dtype: "direct" if _nops.direct_runs(dtype) else "plain")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64)).to(torch.float16).eval()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(prepack={"mode": "always", "max_bytes": None}))
    x = torch.randn(3, 64).to(torch.float16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fn(x), ref(x), rtol=2e-3, atol=2e-3)
    rows = wfpass.report(model).find("prepack")
    assert len(rows) == 2 and all(r.action == "rewritten" and r.stats["direct_calls"] >= 1 for r in rows), \
        [(r.action, r.reason) for r in rows]


def _prompt_rows_agree_with_single_rows(shapes, row_counts):
    """For each (n, k, leading dim) bf16 weight with a bias and each row
    count m: the call over m rows equals the m one-row calls (the widening
    body) and the exact sums within one rounding."""
    torch.manual_seed(0)
    for n, k, ld in shapes:
        w = torch.randn(n, ld).to(torch.bfloat16)[:, :k]
        b = torch.randn(n).to(torch.bfloat16)
        for m in row_counts:
            x = torch.randn(m, k).to(torch.bfloat16)
            got = _nops.direct_linear(x, w, b)
            rows = torch.cat([_nops.direct_linear(x[i:i + 1], w, b) for i in range(m)])
            scale = rows.abs().max().item()
            assert (got.double() - rows.double()).abs().max().item() <= 2 ** -7 * scale, (n, k, m)
            assert (got.double() - _want(x, w, b, torch.bfloat16).double()).abs().max().item() <= 2 ** -7 * scale


@pytest.mark.skipif("amx_bf16" not in cpu_words(), reason="no AMX-BF16 on this CPU")
def test_amx_tiles_take_bf16_prompt_rows_and_agree_with_the_widening_body():
    """At 4 or more rows a bf16 weight whose shape fits the tiles (K a
    multiple of 32, N of 16) goes through AMX tiles (direct_amx.h); each
    row's result is the widening body's for that row alone (1 row) within
    one rounding, whatever the row count (4 to 70: one and two tile halves,
    a 32-row pass and its rest), the weight's row stride and the bias."""
    native.load()
    if not _nops.direct_amx():
        pytest.skip("the AMX body is off here (WFPASS_DIRECT_AMX=0, the kernel refused the tiles, or no AVX-512 build)")
    _prompt_rows_agree_with_single_rows(((64, 2048, 2048), (48, 96, 96), (32, 64, 80)), (4, 16, 17, 32, 33, 70))


@pytest.mark.skipif("amx_bf16" not in cpu_words() or _nops.direct_isa() != "avx512f", reason="no AMX-BF16 on this CPU")
def test_the_amx_body_is_on_by_default_and_wfpass_direct_amx_0_turns_it_off():
    """In fresh processes (the switch is read once): without the variable
    the tiles run; with WFPASS_DIRECT_AMX=0 they do not, and the rounding
    checks hold on the widening body alone."""
    from wftest import pytest_in_a_process

    pytest_in_a_process({"WFPASS_DIRECT_AMX": ""}, "from wfpass import native; from wfpass.native import ops as _nops; "
                        "native.load(); assert _nops.direct_amx()",
                        ["tests/prepack/test_direct_half.py", "-k", "agree_with"])
    pytest_in_a_process({"WFPASS_DIRECT_AMX": "0"}, "from wfpass import native; from wfpass.native import ops as _nops; "
                        "native.load(); assert not _nops.direct_amx()",
                        ["tests/prepack/test_direct_half.py", "-k", "rounded_once"])


@pytest.mark.skipif("avx512_bf16" not in cpu_words() or "amx_bf16" in cpu_words(),
                    reason="needs AVX-512 BF16 without AMX (with AMX the tiles take these rows)")
def test_bf16_dot_products_take_prompt_rows_and_agree_with_the_widening_body():
    """At 8 or more rows (K a multiple of 32) a bf16 weight goes through
    vdpbf16ps (direct_bf16dot.h): each row's result is the row's alone (1
    row: the one-row dot body up to 4096 input features, else the widening
    body) within one rounding, at 8 to 70 rows (tiles
    of 4 input rows and their rest), weight rows apart, N not a multiple of
    4, with a bias; and its bits are not the widening body's (the path is
    taken: a sum whose float32 rounding depends on which products meet
    first)."""
    native.load()
    if not _nops.direct_bf16dot():
        pytest.skip("the bf16 dot body is off here (WFPASS_DIRECT_BF16DOT=0 or no AVX-512 build)")
    _prompt_rows_agree_with_single_rows(((64, 2048, 2048), (45, 96, 96), (33, 64, 80)), (8, 9, 16, 17, 70))
    # 2^24 + 1 - 2^24 in the first 32 inputs: the widening body sums inputs 0
    # and 16 in one lane (2^24 - 2^24) and input 1 in another: 1. The dot
    # body adds input 1 to input 0's lane first, 2^24 + 1, which float32
    # rounds to 2^24: 0. K 4128: one row wider than 4096 takes the widening
    # body (dot_takes), so the single row is the widening body's.
    x = torch.zeros(8, 4128, dtype=torch.bfloat16)
    x[:, 0], x[:, 1], x[:, 16] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    w = torch.ones(16, 4128, dtype=torch.bfloat16)
    assert _nops.direct_linear(x[:1], w, None).eq(1).all()
    assert _nops.direct_linear(x, w, None).eq(0).all()


@pytest.mark.skipif("avx512_bf16" not in cpu_words() or "amx_bf16" in cpu_words(),
                    reason="needs AVX-512 BF16 without AMX (with AMX the tiles take these rows)")
def test_bf16_prompt_rows_over_a_wide_weight_are_summed_in_k_chunks():
    """A prompt's rows over more than 2048 input features run in equal K
    chunks (prompt_rows in direct_bf16dot.h, so 4 weight rows of a chunk stay
    in L1), each chunk's sums added into the float32 output: rows agree with
    the single rows and the exact sums within one rounding at 8 to 33 rows,
    K 4160 (weight rows apart, N not a multiple of 4) and 5632; the output's
    bits do not depend on how the weight rows split over threads; and the
    chunks are the ones that run (below)."""
    native.load()
    if not _nops.direct_bf16dot():
        pytest.skip("the bf16 dot body is off here (WFPASS_DIRECT_BF16DOT=0 or no AVX-512 build)")
    _prompt_rows_agree_with_single_rows(((37, 4160, 4192), (24, 5632, 5632)), (8, 13, 16, 33))
    torch.manual_seed(1)
    w, x = torch.randn(300, 5632).to(torch.bfloat16), torch.randn(16, 5632).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(_nops.direct_linear(x, w, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # 5632 features: 3 chunks of 59 lines (1888 features). 2^24 in chunk 0,
    # 1 + 1 at the start of chunk 1 (the first in lane 0 with the 2^24, the
    # second in lane 1), -2^24 in chunk 2. Summed lane by lane over the
    # whole K, 2^24 + 1 rounds to 2^24 and the result is 1; by chunks, the
    # chunk's 2 meets 2^24 in the output (2^24 + 2, exact), so 2: the exact sum.
    x = torch.zeros(8, 5632, dtype=torch.bfloat16)
    x[:, 0], x[:, 1888], x[:, 1890], x[:, 3776] = 2.0 ** 24, 1.0, 1.0, -(2.0 ** 24)
    assert _nops.direct_linear(x, torch.ones(16, 5632, dtype=torch.bfloat16), None).eq(2).all()


@pytest.mark.skipif("avx512_bf16" not in cpu_words() or "amx_bf16" in cpu_words() or _nops.direct_isa() != "avx512f",
                    reason="needs AVX-512 BF16 without AMX")
def test_wfpass_direct_bf16dot_0_turns_the_dot_body_off():
    """In fresh processes (the switch is read once): on by default; with
    WFPASS_DIRECT_BF16DOT=0 off, and the rounding checks hold on the
    widening body alone."""
    from wftest import pytest_in_a_process

    pytest_in_a_process({"WFPASS_DIRECT_BF16DOT": "0"}, "from wfpass import native; from wfpass.native import ops as _nops; "
                        "native.load(); assert not _nops.direct_bf16dot()",
                        ["tests/prepack/test_direct_half.py", "-k", "rounded_once"])


@pytest.mark.parametrize("dtype", HALF or [torch.bfloat16])
def test_one_and_two_rows_give_an_output_the_same_bits_in_any_call(dtype):
    """One and two input rows over a half-precision weight whose rows are 4
    KB apart read each weight row from a column of its own (``block_skew``
    in direct_kernel.h, so a block's rows do not all sit in one L1 set): an
    output's sum depends on its weight row and K alone, so a row's result
    is the same bits alone, beside a second row, in a batched call and at 1
    and 2 threads, and within one rounding of the exact sums (K: 4 KB rows,
    a tail past the last whole line, less than one line, and rows 4 KB
    apart whose K is shorter than their stride)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for k, ld in ((2048, 2048), (2048, 2080), (4096, 4096), (8192, 8192), (1030, 1030), (53, 53), (5, 5),
                      (2000, 2048)):
            w, b = torch.randn(100, ld).to(dtype)[:, :k], torch.randn(100).to(dtype)
            x = torch.randn(2, k).to(dtype)
            torch.set_num_threads(1)
            one, two = _nops.direct_linear(x[:1], w, b), _nops.direct_linear(x, w, b)
            torch.set_num_threads(2)
            assert torch.equal(one[0], two[0]), k
            assert torch.equal(_nops.direct_linear(x, w, b), two), k
            assert torch.equal(_nops.direct_linear(x.view(2, 1, k), w, b).view(2, -1), two), k
            want = _want(x, w, b, dtype).double()
            err = (two.double() - want).abs().max().item() / want.abs().max().item()
            assert err <= {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype], (k, err)
    finally:
        torch.set_num_threads(threads)


def _order_probe():
    """A bf16 weight of 8192 input features (rows 16 KB apart, wider than
    the one- and two-row dot body takes: the widening body's skewed reads)
    whose row 1 sums to 1 in the skewed order and to 0 at one column: in
    lane 0, 2^24 at line 0, 1 at line 16 (where row 1 starts when skewed:
    (1 * 256 lines) / 16), -2^24 at line 17. At one column 2^24 + 1 rounds
    to 2^24 and the row sums to 0; from line 16 it is 1 - 2^24 (exact),
    then + 2^24 = 1, the exact sum."""
    w = torch.zeros(16, 8192)
    w[1, 0], w[1, 16 * 32], w[1, 17 * 32] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    return w.to(torch.bfloat16), torch.ones(2, 8192, dtype=torch.bfloat16)


@pytest.mark.skipif(torch.bfloat16 not in HALF, reason="no bf16 direct kernel here")
def test_the_skewed_order_is_the_one_that_runs_and_wfpass_direct_skew_0_turns_it_off():
    """The default reads row 1 of a bf16 weight whose rows are a multiple
    of 4 KB apart from its own line (the exact sum, 1, at one and two
    rows); WFPASS_DIRECT_SKEW=0 reads it from line 0, where 2^24 + 1 loses
    the 1 (0). A 5632-wide weight (rows not 4 KB apart) is read at one
    column either way."""
    import os
    import subprocess
    import sys

    assert _nops.direct_skew()
    w, x = _order_probe()
    for m in (1, 2):
        assert _nops.direct_linear(x[:m], w, None)[:, 1].eq(1).all(), m
    code = ("import sys; sys.path.insert(0, 'tests/prepack'); from wfpass import native; native.load(); "
            "from wfpass.native import ops as o; from test_direct_half import _order_probe; w, x = _order_probe(); "
            "assert not o.direct_skew(); "
            "print([o.direct_linear(x[:m], w, None)[:, 1].tolist() for m in (1, 2)])")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, WFPASS_DIRECT_SKEW="0"), cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[[0.0], [0.0, 0.0]]", r.stdout
    wide = torch.zeros(16, 5632)
    wide[1, 0], wide[1, 4 * 32], wide[1, 5 * 32] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    assert _nops.direct_linear(torch.ones(1, 5632, dtype=torch.bfloat16), wide.to(torch.bfloat16), None)[0, 1] == 0


def _stream_probe(k):
    """A bf16 weight of k input features whose row 0 has 2^24 at line 0, 1
    at line 1 and -2^24 at line 4 (lane 0), and an input of ones: 1 in the
    streaming loop's order, 0 read from line 0 into one accumulator."""
    w = torch.zeros(16, k)
    w[0, 0], w[0, 32], w[0, 4 * 32] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    return w.to(torch.bfloat16), torch.ones(2, k, dtype=torch.bfloat16)


@pytest.mark.skipif("avx512_bf16" not in cpu_words() or "amx_bf16" in cpu_words() or _nops.direct_isa() != "avx512f",
                    reason="needs AVX-512 BF16 without AMX")
def test_one_and_two_bf16_rows_stream_the_weight_through_the_dot_body():
    """Where K is at most 4096 (a multiple of 32), one and two bf16 rows
    take the dot body's row-streaming loop (stream_rows in
    direct_bf16dot.h): line s of a weight row sums into the s % 4-th of its
    row's 4 accumulators. Row 0 has 2^24 at line 0, 1 at line 1, -2^24 at
    line 4: the streaming sums give the exact 1 (lines 0 and 4 cancel in
    one accumulator, the 1 sits in another); the widening body reads row 0
    from line 0 on into one accumulator, where 2^24 + 1 loses the 1 (0), as
    it does with WFPASS_DIRECT_BF16DOT=0. At 4128 input features the
    widening body runs (0)."""
    import os
    import subprocess
    import sys

    native.load()
    assert _nops.direct_bf16dot()
    w, x = _stream_probe(2048)
    for m in (1, 2):
        assert _nops.direct_linear(x[:m], w, None)[:, 0].eq(1).all(), m
    w, x = _stream_probe(4128)
    assert _nops.direct_linear(x[:1], w, None)[0, 0] == 0
    code = ("import sys; sys.path.insert(0, 'tests/prepack'); from wfpass import native; native.load(); "
            "from wfpass.native import ops as o; from test_direct_half import _stream_probe; "
            "w, x = _stream_probe(2048); assert not o.direct_bf16dot(); "
            "print([o.direct_linear(x[:m], w, None)[:, 0].tolist() for m in (1, 2)])")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, WFPASS_DIRECT_BF16DOT="0"), cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[[0.0], [0.0, 0.0]]", r.stdout
