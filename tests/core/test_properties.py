"""Property-based: random small models and random life sequences always
match eager (outputs, grads, saved values).

A drawn model is sibling linears reading one input (optionally two of them
sharing one Parameter), an optional BatchNorm1d, and an optional LSTM/GRU/RNN
(1-2 layers, bidirectional or not, batch_first or not) on top; fp32, fp64 or
bf16; run through ``torch.compile(backend=wfpass.backend(...))`` or
``wfpass.apply(torch.fx.symbolic_trace(model))``; each example draws two
sequence lengths in 1..6, one at most the default ``seq_threshold`` and one
above it, and each call takes one of them, so both RNN paths run (and are
counted). BatchNorm follows the linears (Linear -> BatchNorm -> tanh). After
each step of a random life (train step, cast round trip, save and
load, ``assign=True`` load, ``param.data = ...``, restore) the outputs, grads
and ``state_dict`` must equal a deep-copied eager model's that lived the same
life, and the report must show the pass really rewrote what it should (so a
pass that silently did nothing fails here).
"""
from __future__ import annotations

import collections
import copy
import io

import pytest
import torch
import torch.nn as nn

hyp = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st  # noqa: E402

import wfpass  # noqa: E402

OPS = ("step", "cast_roundtrip", "save_load", "assign_load", "replace_data", "restore")
RNNS = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}
N = wfpass.config.default_seq_threshold("cpu")  # the default here: T <= N unfused, T > N fused
B = 6  # batch; BatchNorm normalises over B * T >= 6 rows (3 rows make 1/std noisy in bf16)
HIDDEN = 5


class Random(nn.Module):
    def __init__(self, d, widths, biases, tie, bn, rnn=None):
        super().__init__()
        self.members = nn.ModuleList(nn.Linear(d, w, bias=b) for w, b in zip(widths, biases))
        self.tied = bool(tie and len(widths) > 1 and widths[0] == widths[1])
        if self.tied:
            self.members[1].weight = self.members[0].weight  # a tie inside the group
        self.bn = nn.BatchNorm1d(sum(widths)) if bn else None
        self.rnn = None
        self.batch_first = False
        if rnn is not None:
            kind, layers, bi, bf = rnn
            self.rnn = RNNS[kind](sum(widths), HIDDEN, num_layers=layers, bidirectional=bi, batch_first=bf)
            self.batch_first = bf

    def forward(self, x):
        # Linear -> BatchNorm -> tanh: BatchNorm sees the linears' outputs,
        # whose per-channel variance stays healthy (after tanh, a saturated
        # channel is near-constant and its 1/std turns bf16 rounding into
        # noise of any size, in eager as in wfpass).
        y = torch.cat([m(x) for m in self.members], -1)
        if self.bn is not None:
            y = self.bn(y.flatten(0, 1)).view_as(y)
        y = torch.tanh(y)
        if self.rnn is not None:
            y = self.rnn(y)[0]
        return y


models = st.builds(
    lambda d, ws, bs, tie, bn: (d, ws, (bs * len(ws))[: len(ws)], tie, bn),
    st.sampled_from([4, 8]),
    st.lists(st.sampled_from([2, 4, 6]), min_size=2, max_size=3),
    st.lists(st.booleans(), min_size=1, max_size=3),
    st.booleans(),
    st.booleans(),
)
# One length at most N and one above it per example, each call picking one:
# both RNN paths run, and a compiled model sees at most two lengths (Dynamo
# compiles one graph per length here; more lengths cost compile time, not
# coverage).
lengths = st.builds(lambda short, long, picks: [long if p else short for p in picks],
                    st.integers(1, N), st.integers(N + 1, 6), st.lists(st.booleans(), min_size=6, max_size=6))
# (kind, num_layers, bidirectional, batch_first); drawn twice as often as None.
rnns = st.one_of(st.none(), *[st.tuples(st.sampled_from(sorted(RNNS)), st.integers(1, 2), st.booleans(), st.booleans())] * 2)


_FLOOR = {torch.bfloat16: 1e-2, torch.float32: 1e-3}


def _scale(ref, dtype, scale=None):
    """What an error is measured against: the tensor's largest magnitude, or
    for a gradient the model's largest gradient if that is larger."""
    own = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return max(own, scale or 0.0, _FLOOR.get(dtype, 0.0))


def _tol(ref, dtype, scale=None):
    """Tolerance for comparing with eager's ``ref`` in a model of ``dtype``
    (the model's dtype, not the tensor's: a bf16 model's BatchNorm tensors
    are fp32, with bf16-level error)."""
    # fp64: the fused GEMM only reorders sums: ~exact.
    # fp32: the same reordering (and the RNN op's kernels), ~1e-7 relative;
    # a gradient whose true value is ~0 (a bias just before BatchNorm, which
    # removes any per-channel constant) is rounding noise of the size of the
    # other gradients, so gradients are bounded relative to the model's
    # largest gradient (``scale``), everything else to its own largest value.
    # bf16 (8 mantissa bits: one rounding is 2**-9 = 0.2%): the fused GEMM
    # and the RNN kernels round at other points than eager's, so a result
    # differs by 1-2 bf16 ulps, and the differences pass through BatchNorm,
    # up to 2 recurrent layers x 6 steps and up to five SGD steps.
    # Measured with ERRORS over 400 random examples (200 of every dtype, 200
    # bf16 with BatchNorm): bf16 at most 2.8% of the scale (an LSTM at T=1:
    # the unfused path is ATen's native kernel, eager's bf16 LSTM is
    # oneDNN's, and they round differently; then BatchNorm's backward), fp32
    # at most 7e-7, fp64 0. Bounds: bf16 6% (2x the largest measured), fp32
    # 1e-5 (14x); a stale or wrong buffer is off by far more than 10%. (A
    # lost SGD step, at most 0.02 per element, is caught in fp32/fp64.)
    if not ref.is_floating_point() or dtype == torch.float64:
        return dict(rtol=1e-10, atol=1e-12)
    if dtype == torch.bfloat16:
        return dict(rtol=2e-2, atol=6e-2 * _scale(ref, dtype, scale))
    return dict(rtol=1e-4, atol=1e-5 * _scale(ref, dtype, scale))


def _close(a, ref, dtype, what, scale=None):
    # Compared in the reference's dtype: in a bf16 model wfpass holds
    # BatchNorm's tensors (and so their grads and saved values) in fp32;
    # _check asserts that dtype separately.
    a = a.to(ref.dtype)
    if ERRORS is not None and ref.numel() and ref.is_floating_point():  # measuring, not asserting
        key = (str(dtype), what.split(" ")[0] + " " + what.split(" ")[-1].split(".")[0])
        ERRORS[key] = max(ERRORS.get(key, 0.0), float((a - ref).detach().abs().max()) / max(_scale(ref, dtype, scale), 1e-30))
        return
    torch.testing.assert_close(a, ref, **_tol(ref, dtype, scale), msg=lambda m: f"{what}: {m}")


#: Set to {} to record, instead of asserting, the largest error / scale per
#: (dtype, what) over a run: how _tol's bounds were measured.
ERRORS = None


def _bn_names(model):
    return {f"bn.{n}" for n in ("weight", "bias", "running_mean", "running_var")} if model.bn is not None else set()


def _check(model, ref, fn, x, dtype):
    if model.tied:  # never silently untied
        assert model.members[0].weight is model.members[1].weight
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    a, b = fn(x), ref(x)
    assert a.dtype == b.dtype == dtype
    _close(a, b, dtype, "output")
    w = torch.linspace(0.5, 1.5, a.numel(), dtype=a.dtype).view(a.shape)
    (a * w).sum().backward()
    (b * w).sum().backward()
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    for (n, p), (rn, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == rn
        _close(p.grad, q.grad, dtype, f"grad {n}", scale)
    fp32_bn = dtype == torch.bfloat16
    for (k, v), (rk, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == rk
        if k in _bn_names(model):
            # The BatchNorm format: fp32 in a bf16 model, right after every call.
            assert v.dtype == (torch.float32 if fp32_bn else dtype), (k, v.dtype)
        assert v.dtype == r.dtype, (k, v.dtype, r.dtype)
        _close(v, r, dtype, f"state {k}")


# Helpers, so that no alias of a parameter (a state_dict entry) outlives the
# check: a tensor the user still holds makes wfpass take the copying
# fallback instead of re-fusing (right, and counted), which the exact
# call counts at the end of _lives would then see.
def _assert_saved(live, saved):
    assert list(live) == list(saved)
    for k, v in live.items():  # the file holds exactly the live values
        assert v.dtype == saved[k].dtype and torch.equal(v, saved[k]), k


def _assert_restored(model, before, dtype, bn_dtype):
    """Identical values, every tensor in the dtype a plain model that lived
    the same life has: the model's, and BatchNorm's ``bn_dtype`` (fp32 after
    an ``assign=True`` load of a file holding fp32 BatchNorm tensors: assign
    keeps the file's dtype, in eager too)."""
    for k, v in model.state_dict().items():
        want = before[k].dtype if not v.is_floating_point() else bn_dtype if k in _bn_names(model) else dtype
        assert v.dtype == want and torch.equal(v, before[k].to(v.dtype)), (k, v.dtype, want)


def _eager_fp32_batchnorm(ref, dtype):
    """The reference for a bf16 model: eager PyTorch with BatchNorm's tensors
    in fp32 (its own mixed-precision kernel), which is what the BatchNorm
    format is. Against a pure-bf16 eager BatchNorm the two kernels alone
    differ by a bf16 ulp in the forward and, through BatchNorm's backward
    (g - mean(g) - x_hat * mean(g * x_hat): cancelling terms), by up to ~5%
    of the largest gradient (measured over 200 random examples), which would
    drown everything else this test checks. That the format is right against
    pure bf16 and fp32 is tests/batchnorm/test_fp32_batchnorm.py's job."""
    if dtype == torch.bfloat16 and ref.bn is not None:
        ref.bn.float()


def _shared_pairs(m):
    ptrs = [(n, p.untyped_storage().data_ptr()) for n, p in m.named_parameters()]  # a tie counts once
    return {(a, b) for i, (a, pa) in enumerate(ptrs) for b, pb in ptrs[i + 1 :] if pa == pb}


def _rnn_stats(records):
    out = collections.Counter()
    for r in records:
        if r.pattern == "rnn" and r.action == "rewritten":
            out.update({k: v for k, v in r.stats.items() if k in ("fused_calls", "unfused_calls", "fallback_calls")})
    return out


#: Filled by every example of _lives; test_random_models_and_lives_match_eager
#: asserts on the totals (both RNN paths, every RNN kind, every dtype ran).
SEEN: collections.Counter = collections.Counter()


# No shrinking and a fixed seed: CI time stays bounded and a failure prints
# the example that failed, reproducible as is. The explicit examples alone
# cover what test_random_models_and_lives_match_eager asserts was covered
# (every dtype, both ways in, every RNN kind, bf16 BatchNorm, a tie), so a
# different draw (another hypothesis version) cannot make it fail; the drawn
# examples add variety. Runtime: about 25 s on a 2-core machine, most of it
# compiling (one graph per sequence length, cast and restore).
@settings(max_examples=6, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(spec=models, rnn=rnns, dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       how=st.sampled_from(["compile", "apply"]), path=st.sampled_from(["fused", "split"]),
       ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=5), lengths=lengths,
       seed=st.integers(0, 2**16))
@example(spec=(8, [4, 4, 2], [True, False, True], True, True), rnn=("LSTM", 2, True, True), dtype=torch.bfloat16, how="compile",
         path="fused", ops=["step", "cast_roundtrip", "save_load", "restore"], lengths=[2, 5, 2, 5, 5, 2], seed=1)
@example(spec=(4, [6, 2], [False, True], False, True), rnn=("GRU", 1, False, False), dtype=torch.bfloat16, how="apply",
         path="split", ops=["assign_load", "replace_data", "step"], lengths=[6, 1, 6, 1, 1, 6], seed=2)
@example(spec=(8, [2, 2], [True, True], False, False), rnn=("RNN", 2, True, False), dtype=torch.float32, how="compile",
         path="split", ops=["replace_data", "restore", "step"], lengths=[1, 4, 1, 4, 4, 1], seed=3)
@example(spec=(4, [4, 4, 2], [True, True, False], True, True), rnn=("LSTM", 1, False, True), dtype=torch.float64, how="apply",
         path="fused", ops=["cast_roundtrip", "save_load", "step", "assign_load"], lengths=[3, 1, 3, 1, 3, 3], seed=4)
def _lives(spec, rnn, dtype, how, path, ops, lengths, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    d, widths, biases, tie, bn = spec
    model = Random(d, widths, biases, tie, bn, rnn).to(dtype)
    ref = copy.deepcopy(model)
    _eager_fp32_batchnorm(ref, dtype)
    bn_dtype = dtype  # BatchNorm's dtype in a plain model living the same life
    records = []
    if how == "compile":
        be = wfpass.backend(inner="aot_eager", linear_path=path)

        def collect(gm, example_inputs):
            # This graph's records: those that last_report() holds after the
            # compile and did not before (it may merge the graphs of one call).
            before = list(wfpass.last_report().records)
            out = be(gm, example_inputs)
            records.extend(r for r in wfpass.last_report().records if not any(r is b for b in before))
            return out

        fn = torch.compile(model, backend=collect)
    else:
        fn = torch.fx.symbolic_trace(model)
        records.extend(wfpass.apply(fn, linear_path=path).records)
    expect = collections.Counter()

    def make(T):
        expect["unfused_calls" if T <= N else "fused_calls"] += model.rnn is not None
        return torch.randn((B, T, d) if model.batch_first else (T, B, d), dtype=dtype)

    _check(model, ref, fn, make(lengths[0]), dtype)
    for i, op in enumerate(ops):
        if op == "step":
            # Plain SGD whose largest update is 0.02 (one learning rate for
            # both models, from eager's grads): a step large enough to see in
            # fp32/fp64 if it were lost, small enough that bf16's rounding of
            # the grads does not make the two models' lives diverge (with
            # lr=0.1 on these summed losses, updates reach ~3 and a 1-ulp
            # difference in a grad becomes a 5% difference in the output).
            lr = 0.02 / max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
            for m in (model, ref):
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p.sub_(lr * p.grad)
        elif op == "cast_roundtrip":
            other = torch.float64 if dtype == torch.float32 else torch.float32
            for m in (model, ref):
                m.to(other)
                m.to(dtype)
            _eager_fp32_batchnorm(ref, dtype)  # wfpass casts its BatchNorm back on the next call
            bn_dtype = dtype
        elif op in ("save_load", "assign_load"):
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            buf.seek(0)
            sd = torch.load(buf)
            _assert_saved(model.state_dict(), sd)
            plain = Random(d, widths, biases, tie, bn, rnn).to(dtype)
            plain.load_state_dict(sd)  # a plain model reads the fused model's file
            for k, v in plain.state_dict().items():  # (BatchNorm's fp32 values cast to bf16)
                assert torch.equal(v, sd[k].to(v.dtype)), k
            if op == "assign_load" and not model.tied:  # assign=True replaces tied objects separately, in eager too
                model.load_state_dict(copy.deepcopy(sd), assign=True)
                ref.load_state_dict(copy.deepcopy(sd), assign=True)
                bn_dtype = sd["bn.weight"].dtype if model.bn is not None else dtype
            else:
                model.load_state_dict(sd)
                ref.load_state_dict(sd)
        elif op == "replace_data":
            for m in (model, ref):
                m.members[-1].weight.data = m.members[-1].weight.data * 0.5
                if m.rnn is not None:
                    m.rnn.weight_hh_l0.data = m.rnn.weight_hh_l0.data * 0.5
        elif op == "restore":
            before = {k: v.clone() for k, v in model.state_dict().items()}
            wfpass.restore(model)
            # Independent storages, except where eager's model shares too: a
            # file saved from the fused layout holds one storage per block and
            # torch.load rebuilds views of it, so after assign=True both
            # models hold views of one loaded storage that wfpass does not own
            # (restore leaves it; a known gap, docs/guarantees.md).
            assert _shared_pairs(model) <= _shared_pairs(ref), (_shared_pairs(model), _shared_pairs(ref))
            _assert_restored(model, before, dtype, bn_dtype)
            if ref.bn is not None:  # the same rounding as restore's (and the next call's) casts
                ref.bn.to(bn_dtype)
                _eager_fp32_batchnorm(ref, dtype)
        _check(model, ref, fn, make(lengths[1 + i]), dtype)

    # Not vacuous: what the pass rewrote, and which RNN path each call took.
    linear = [r for r in records if r.pattern == "linear" and r.action == "rewritten"]
    assert bool(linear) == (not model.tied), [str(r.__dict__) for r in records]
    if model.tied:  # skipped, and says why
        assert any(r.pattern == "linear" and r.action == "skipped" and "tie stays" in r.reason for r in records)
        SEEN["tie"] += 1
    if model.rnn is not None:
        assert any(r.pattern == "rnn" and r.action == "rewritten" for r in records)
        stats = _rnn_stats(records)
        assert stats["fallback_calls"] == 0 and stats["fused_calls"] == expect["fused_calls"] and stats["unfused_calls"] == expect["unfused_calls"], (stats, expect)
        SEEN.update(stats)
        SEEN[f"rnn:{rnn[0]}"] += 1
    if model.bn is not None and dtype == torch.bfloat16:
        assert any(r.pattern == "batchnorm" and r.action == "rewritten" for r in records)
        SEEN["bf16 batchnorm"] += 1
    SEEN[f"dtype:{dtype}"] += 1
    SEEN[f"how:{how}"] += 1


def test_random_models_and_lives_match_eager():
    SEEN.clear()
    _lives()
    # The explicit examples alone cover all of this; the draw adds variety.
    assert SEEN["fused_calls"] > 0 and SEEN["unfused_calls"] > 0, SEEN
    for key in ("rnn:LSTM", "rnn:GRU", "rnn:RNN", "bf16 batchnorm", "tie", "how:compile", "how:apply",
                "dtype:torch.float32", "dtype:torch.float64", "dtype:torch.bfloat16"):
        assert SEEN[key] > 0, (key, SEEN)
