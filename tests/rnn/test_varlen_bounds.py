"""Every kernel of the packed path checks its inputs' sizes against
batch_sizes, the lengths and the weights before it reads or writes a row,
and raises eager's exception type (RuntimeError).

Each check three ways where it applies: through a function compiled with
``backend="wformat"`` (against eager's own exception on the same inputs),
the op on the CPU (the C++ kernels of ``native/rnn/varlen_sequence.cpp`` and
``packed_rnn.cpp``, where they built) and the Python kernel called directly
(what runs with ``WFPASS_NATIVE=0`` or off the CPU). The sizes are ones that
read or wrote out of bounds before: data shorter or longer than
sum(batch_sizes), batch_sizes increasing, negative or larger than B, lengths
longer than the input, orders that are not permutations, a feature size
other than the RNN's input_size, h0 of the wrong batch or hidden size.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import wfpass  # noqa: F401  (registers backend="wformat")
from wfpass import native
from wfpass._torch.kernels import mkldnn_rnn_dtype
from wfpass.rnn.varlen import pad_ops as P
from wfpass.rnn.cpu import varlen_layer as pl
from wfpass.rnn.cpu import varlen_lstm_runs as runs

# The C++ kernels, where they build, before the first test (the "cpp" cases
# skip where they did not).
native.load()
ops = torch.ops.wfpass

_PY = {"pack_padded": P._pack_padded, "pad_packed": P._pad_packed, "pack_padded_backward": P._pack_padded_backward,
       "pad_packed_backward": P._pad_packed_backward, "packed_layer": pl._packed_layer,
       "packed_layer_backward": pl._packed_layer_backward, "packed_bilayer": pl._bilayer,
       "packed_bilayer_backward": pl._bilayer_backward}


def kernel_of(kernel: str, name: str):
    """The op (its C++ kernel on the CPU) or its Python kernel."""
    if kernel == "python":
        return _PY[name]
    if not native.loaded():
        pytest.skip(native.status())
    return getattr(ops, name)


KERNELS = ["cpp", "python"]


def named(*rows):
    """parametrize rows whose first entry names the case: it is the test's id."""
    return [pytest.param(*r, id=re.sub(r"[^\w.-]+", "-", r[0]).strip("-")) for r in rows]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny cases; spinning OpenMP workers on a busy 2-core machine cost more
    yield
    torch.set_num_threads(n)


def _eager_error(fn, *args) -> Exception:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever eager raises is the reference
        return e
    raise AssertionError("eager did not raise")


# -- pack / pad through backend="wformat" ------------------------------------------------------------

def _wformat(inductor: bool):
    """``backend="wformat"`` (Inductor) for the one case of each test
    function that goes end to end; the others through ``inner="aot_eager"``:
    the check that raises is in wfpass's ops (run by either compiler) or in
    Dynamo's trace, ahead of the inner compiler, so they test the same code
    without an Inductor compile each."""
    return "wformat" if inductor else wfpass.backend(inner="aot_eager")


def _pad(seq):
    return pad_packed_sequence(seq)


def _pack_pad(x, lengths, enforce_sorted):
    return pad_packed_sequence(pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted))[0]


def _hand_built(T, B, F, data=lambda d: d, sizes=lambda s: s, unsorted=lambda u: u):
    lengths = torch.arange(T, T - B, -1).clamp(min=1)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    p = pack_padded_sequence(torch.randn(T, B, F), lengths[perm], enforce_sorted=False)
    return PackedSequence(data(p.data), sizes(p.batch_sizes), p.sorted_indices, unsorted(p.unsorted_indices))


@pytest.mark.parametrize("T,B,F", [(12, 5, 3), (400, 64, 256)])
def test_compiled_pad_of_data_shorter_than_batch_sizes(T, B, F):
    """The issue's case: a hand-built PackedSequence whose data is one row
    long. The C++ pad read past its end (non-finite values at (400, 64,
    256), a segfault at (1500, 64, 512)); eager raises RuntimeError."""
    bad = _hand_built(T, B, F, data=lambda d: d[:1].clone())
    assert isinstance(_eager_error(_pad, bad), RuntimeError)
    with pytest.raises(RuntimeError, match=r"data has 1 rows, but batch_sizes sums to \d+"):
        torch.compile(_pad, backend=_wformat(T == 12))(bad)


@pytest.mark.parametrize("case,bad,match", named(
    ("batch_sizes increasing", dict(sizes=lambda s: s.flip(0)), "non-negative and non-increasing"),
    ("unsorted_indices out of range", dict(unsorted=lambda u: torch.where(u == 0, 7, u)), "not a permutation"),
))
def test_compiled_pad_of_a_bad_packed_sequence(case, bad, match):
    seq = _hand_built(6, 4, 3, **bad)
    assert isinstance(_eager_error(_pad, seq), RuntimeError)
    with pytest.raises(RuntimeError, match=match):
        torch.compile(_pad, backend=_wformat(case == "batch_sizes increasing"))(seq)


@pytest.mark.parametrize("case,lengths,enforce_sorted,match", named(
    ("longer than T", [5, 3, 1], True, "longer than the input's 4 steps"),  # eager packs fewer rows; pad raises
    ("longer than T unsorted", [5, 1, 3], False, "longer than the input's 4 steps"),
    ("not sorted", [1, 3, 2], True, "sorted in decreasing order"),
    ("zero", [3, 0, 1], False, "greater than 0"),
    ("negative", [3, -1, 1], False, "greater than 0"),
    ("more than the batch", [3, 3, 1, 1], True, r"len\(lengths\)"),
))
def test_compiled_pack_of_bad_lengths(case, lengths, enforce_sorted, match):
    x, L = torch.randn(4, 3, 2), torch.tensor(lengths)
    assert isinstance(_eager_error(_pack_pad, x, L, enforce_sorted), RuntimeError)
    with pytest.raises(RuntimeError, match=match):
        torch.compile(_pack_pad, backend=_wformat(case == "longer than T unsorted"))(x, L, enforce_sorted)


# -- RNNs over a packed batch through backend="wformat" ----------------------------------------------

class Encoder(nn.Module):
    def __init__(self, kind="LSTM", I=6, H=8, **kw):
        super().__init__()
        self.enc = getattr(nn, kind)(I, H, **kw)

    def forward(self, x, lengths, hx=None, enforce_sorted=False):
        out, state = self.enc(pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted), hx)
        y, lens = pad_packed_sequence(out)
        return (y, lens) + (tuple(state) if isinstance(state, tuple) else (state,))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("features", [4, 7, 40])
def test_compiled_rnn_of_the_wrong_feature_size_raises_eagers_error(kind, features):
    """A packed batch whose feature size is not input_size (6) ran and
    returned values; a larger mismatch failed later in the backward with an
    AssertionError. Now eager's error, the module named where eager's check
    names it (GRU, RNN; the LSTM's comes from ATen's GEMM)."""
    model = Encoder(kind)
    x, L = torch.randn(5, 3, features, requires_grad=True), torch.tensor([5, 3, 2])
    want = _eager_error(copy.deepcopy(model), x, L)
    assert isinstance(want, RuntimeError)
    with pytest.raises(RuntimeError, match=re.escape(str(want))) as got:
        torch.compile(model, backend="wformat")(x, L)
    if kind != "LSTM":
        assert str(got.value).startswith(f"'enc' (nn.{kind}): "), got.value


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("shape,where", [
    ((1, 2, 8), "batch"),  # batch_sizes[0] is 3, a value: the layer kernel checks it when it runs
    ((1, 3, 5), "hidden"),  # checked while Dynamo traces, which then runs the call eagerly: eager's own error
    ((2, 3, 8), "layers"),  # a one-layer RNN: ran on h0[0] before
])
def test_compiled_rnn_with_h0_of_the_wrong_size_raises_runtime_error(kind, shape, where):
    """Eager raises RuntimeError for each (GRU: its check_forward_args; LSTM:
    ATen); wformat raised ValueError for the first two and ran the third."""
    model = Encoder(kind)
    x, L = torch.randn(5, 3, 6), torch.tensor([5, 3, 2])
    h0 = torch.randn(*shape)
    hx = (h0, torch.randn(*shape[:2], 8)) if kind == "LSTM" else h0
    want = _eager_error(copy.deepcopy(model), x, L, hx, True)
    assert isinstance(want, RuntimeError)
    match = (r"h0 must have shape \(1, 3, 8\) \(batch_sizes\[0\] = 3 sequences\)" if where == "batch"
             else re.escape(str(want)))
    with pytest.raises(RuntimeError, match=match):
        torch.compile(model, backend=_wformat(kind == "LSTM" and where == "batch"))(x, L, hx, True)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("case,bad", named(
    ("data too short", dict(data=lambda d: d[:3].clone())),
    ("data too long", dict(data=lambda d: torch.cat([d, d[:2]]))),
    ("batch_sizes increasing", dict(sizes=lambda s: s.flip(0))),
))
def test_compiled_rnn_of_a_hand_built_packed_sequence_with_rows_not_matching_batch_sizes(kind, case, bad):
    """A PackedSequence made outside the compiled function whose data rows
    do not match its batch_sizes: eager raises RuntimeError where rows are
    missing (it drops extra rows: the op's output has data's rows, so
    wformat refuses them too); wformat raised ValueError."""
    model = getattr(nn, kind)(3, 8)
    seq = _hand_built(6, 4, 3, **bad)
    if case != "data too long":
        assert isinstance(_eager_error(copy.deepcopy(model), seq), RuntimeError)
    with pytest.raises(RuntimeError, match=r"batch_sizes must be positive, non-increasing and sum to data.shape\[0\]"):
        torch.compile(model, backend=_wformat(kind == "LSTM" and case == "data too short"))(seq)


@pytest.mark.parametrize("kind,kw", [("LSTM", dict(num_layers=2, bidirectional=True)), ("GRU", dict()),
                                     ("LSTM", dict(proj_size=5))])
def test_compiled_normal_batch_still_equals_eager(kind, kw):
    """The checks change nothing for a well-formed batch: values and the
    input's and weights' gradients equal eager's."""
    torch.manual_seed(0)
    model = Encoder(kind, **kw)
    ref = copy.deepcopy(model)
    x, L = torch.randn(6, 4, 6), torch.tensor([3, 6, 1, 4])
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(model, backend=_wformat("num_layers" in kw))(xs, L)
    want = ref(xr, L)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(1)
    R = [torch.randn(t.shape, generator=g) if t.is_floating_point() else None for t in want]
    for out in (got, want):
        sum((t * r).sum() for t, r in zip(out, R) if r is not None).backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


# -- pack / pad called directly --------------------------------------------------------------------

X = torch.randn(4, 3, 2)  # T = 4, B = 3


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case,lengths,order,match", named(
    ("longer than T", [5, 3, 1], None, "a length \\(5\\) is longer than the input's 4 steps"),
    ("not sorted", [2, 3, 1], None, "sorted in decreasing order"),
    ("zero", [3, 2, 0], None, "greater than 0"),
    ("negative", [3, 2, -4], None, "greater than 0"),
    ("more than the batch", [3, 2, 1, 1], None, r"len\(lengths\)"),
    ("order repeats", [3, 2, 1], [0, 0, 1], "not a permutation"),
    ("order out of range", [3, 2, 1], [0, 1, 3], "not a permutation"),
    ("order short", [3, 2, 1], [2, 1], "batch order has 2 entries for a batch of 3"),
))
def test_pack_padded_checks(kernel, case, lengths, order, match):
    op = kernel_of(kernel, "pack_padded")
    with pytest.raises(RuntimeError, match=match):
        op(X, torch.tensor(lengths), False, None if order is None else torch.tensor(order))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case,rows,sizes,order,match", named(
    ("data too short", 1, [3, 2, 1], None, "data has 1 rows, but batch_sizes sums to 6"),
    ("data too long", 8, [3, 2, 1], None, "data has 8 rows, but batch_sizes sums to 6"),
    ("batch_sizes increasing", 6, [1, 2, 3], None, "non-negative and non-increasing, got 2 at step 1 after 1"),
    ("batch_sizes negative", 6, [3, 3, 2, -2], None, "non-negative and non-increasing, got -2 at step 3"),
    ("batch_sizes 2-D", 6, [[3, 2, 1]], None, "batch_sizes must be 1-D"),
    ("order repeats", 6, [3, 2, 1], [0, 2, 2], "not a permutation"),
    ("order long", 6, [3, 2, 1], [0, 1, 2, 3], "batch order has 4 entries for a batch of 3"),
))
def test_pad_packed_checks(kernel, case, rows, sizes, order, match):
    """Every size against batch_sizes, and the order (a negative batch size
    crashed eager's own pad: ``free(): invalid pointer``)."""
    op = kernel_of(kernel, "pad_packed")
    with pytest.raises(RuntimeError, match=match):
        op(torch.randn(rows, 2), torch.tensor(sizes), False, 0.0, -1, None if order is None else torch.tensor(order))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case,grad_shape,sizes,input_size,match", named(
    ("grad too short", (5, 2), [3, 2, 1], [4, 3, 2], "grad has 5 rows, but batch_sizes sums to 6"),
    ("grad too long", (9, 2), [3, 2, 1], [4, 3, 2], "grad has 9 rows, but batch_sizes sums to 6"),
    ("batch_sizes increasing", (6, 2), [1, 2, 3], [4, 3, 2], "non-increasing"),
    ("more steps than T", (8, 2), [3, 2, 1, 1, 1], [4, 3, 2],
     "5 steps, first 3\\) does not describe an input of 4 steps and 3 sequences"),
    ("batch_sizes above B", (6, 2), [4, 2], [4, 3, 2],
     "first 4\\) does not describe an input of 4 steps and 3 sequences"),
    ("features", (6, 5), [3, 2, 1], [4, 3, 2], "the input's features are \\[2\\]"),
    ("grad 3-D", (6, 2, 1), [3, 2, 1], [4, 3, 2], "packed data of an input of 3 dimensions, got 3-D"),
))
def test_pack_padded_backward_checks(kernel, case, grad_shape, sizes, input_size, match):
    op = kernel_of(kernel, "pack_padded_backward")
    with pytest.raises(RuntimeError, match=match):
        op(torch.randn(grad_shape), torch.tensor(sizes), input_size, False, None)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case,grad_shape,rows,sizes,match", named(
    ("rows short", (3, 3, 2), 4, [3, 2, 1], "the packed data has 4 rows, but batch_sizes sums to 6"),  # wrote past it
    ("rows long", (3, 3, 2), 9, [3, 2, 1], "the packed data has 9 rows, but batch_sizes sums to 6"),
    ("grad of fewer steps", (2, 3, 2), 6, [3, 2, 1],
     "grad has 2 steps and 3 sequences, batch_sizes 3 steps and 3 sequences"),
    ("grad of fewer sequences", (3, 2, 2), 6, [3, 2, 1],
     "grad has 3 steps and 2 sequences, batch_sizes 3 steps and 3 sequences"),
    ("batch_sizes increasing", (3, 3, 2), 6, [2, 3, 1], "non-increasing"),
    ("grad 1-D", (6,), 6, [3, 2, 1], "grad must have a time and a batch dimension"),
))
def test_pad_packed_backward_checks(kernel, case, grad_shape, rows, sizes, match):
    op = kernel_of(kernel, "pad_packed_backward")
    with pytest.raises(RuntimeError, match=match):
        op(torch.randn(grad_shape), torch.tensor(sizes), rows, False, None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_pack_and_pad_of_a_good_batch_still_run(kernel):
    """The checks pass a well-formed batch, unsorted, batch-first, with a
    longer total_length: eager's values and gradients' shapes."""
    x, lengths = torch.randn(3, 5, 2), torch.tensor([2, 5, 4])
    want = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    order = want.sorted_indices
    data, sizes = kernel_of(kernel, "pack_padded")(x, lengths.sort(descending=True).values, True, order)
    assert torch.equal(data, want.data) and torch.equal(sizes, want.batch_sizes)
    out, lens = kernel_of(kernel, "pad_packed")(data, sizes, True, 0.0, 7, want.unsorted_indices)
    ref, ref_lens = pad_packed_sequence(want, batch_first=True, total_length=7)
    assert torch.equal(out, ref) and torch.equal(lens[want.unsorted_indices], ref_lens)
    assert kernel_of(kernel, "pad_packed_backward")(out, sizes, data.shape[0], True, want.unsorted_indices).shape \
        == data.shape
    assert kernel_of(kernel, "pack_padded_backward")(data, sizes, list(x.shape), True, order).shape == x.shape


def test_fakes_check_what_the_shapes_say():
    """Where a check needs only shapes, the fake makes it too (the compiler
    stops at trace time); where it needs values, only the kernels do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def fake(args):
        return [mode.from_tensor(t) if isinstance(t, torch.Tensor) else fake(t) if isinstance(t, list) else t
                for t in args]

    a = _layer_args("GRU")
    cases = [
        (ops.pack_padded, (X, torch.tensor([3, 2, 1, 1]), False), r"len\(lengths\)"),
        (ops.pack_padded_backward, (torch.randn(6, 5), torch.tensor([3, 2, 1]), [4, 3, 2], False),
         "the input's features are"),
        (ops.packed_layer, _with(a, data=torch.randn(11, 7)).values(),
         r"input.size\(-1\) must be equal to input_size. Expected 5"),
        (ops.packed_layer_fw, _with(a, w_hh=torch.randn(18, 5)).values(), "w_hh must have shape"),
        (ops.packed_layer_fw, _with(a, h0=torch.randn(1, 4, 3)).values(),
         r"h0 must have shape \(1, batch_sizes\[0\], 6\)"),
        (ops.packed_bilayer_fw, _with(_bilayer_args(), h0=torch.randn(1, 4, 6)).values(),
         r"h0 must have shape \(2, batch_sizes\[0\], 6\)"),
    ]
    with mode:
        for op, args, match in cases:
            with pytest.raises(RuntimeError, match=match):
                op(*fake(list(args)))
        # batch_sizes' values: no fake can see them; the kernels check them.
        out = ops.packed_layer_fw(*fake(list(_with(a, batch_sizes=torch.tensor([9, 1])).values())))
        assert out[0].shape == (11, H)


# -- the layer ops called directly -----------------------------------------------------------------

LENGTHS = [4, 3, 3, 1]  # B = 4, N = 11
I, H = 5, 6


def _layer_args(mode="LSTM", proj=0, reverse=False, train=True):
    """One layer's arguments in the op's order, as a dict (names for _with)."""
    g = torch.Generator().manual_seed(0)
    G = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1}[mode]
    Hout = proj or H
    p = pack_padded_sequence(torch.randn(max(LENGTHS), len(LENGTHS), I, generator=g), torch.tensor(LENGTHS))
    B = len(LENGTHS)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    return dict(data=p.data, batch_sizes=p.batch_sizes, w_ih=r(G * H, I), w_hh=r(G * H, Hout), b_ih=r(G * H),
                b_hh=r(G * H), w_hr=r(Hout, H) if proj else None, h0=r(1, B, Hout),
                c0=r(1, B, H) if mode == "LSTM" else None, mode=mode, reverse=reverse, train=train)


def _with(args, **changes):
    return {**args, **changes}


LAYER_CASES = [
    # (name, mode, changes(args) -> dict of replaced arguments, match)
    ("data too short", "LSTM", lambda a: dict(data=a["data"][:5]), r"sum to data.shape\[0\] = 5"),
    ("data too long", "GRU", lambda a: dict(data=torch.cat([a["data"], a["data"]])), r"sum to data.shape\[0\] = 22"),
    ("batch_sizes increasing", "LSTM", lambda a: dict(batch_sizes=a["batch_sizes"].flip(0)), "non-increasing"),
    ("batch_sizes zero", "RNN_TANH", lambda a: dict(batch_sizes=torch.tensor([4, 3, 3, 1, 0])), "positive"),
    ("batch_sizes[0] above h0's batch", "LSTM", lambda a: dict(batch_sizes=torch.tensor([5, 3, 2, 1])),
     r"h0 must have shape \(1, 5, 6\) \(batch_sizes\[0\] = 5 sequences\), got \[?\(?1, 4, 6"),
    ("h0 of the wrong batch", "GRU", lambda a: dict(h0=a["h0"][:, :3]), r"h0 must have shape \(1, 4, 6\)"),
    ("h0 of the wrong hidden size", "RNN_TANH", lambda a: dict(h0=a["h0"][..., :4]), r"h0 must have shape \(1, 4, 6\)"),
    ("c0 of the wrong batch", "LSTM", lambda a: dict(c0=a["c0"][:, :2]), r"c0 must have shape \(1, 4, 6\)"),
    ("fewer features", "LSTM", lambda a: dict(data=a["data"][:, :3]),
     r"input.size\(-1\) must be equal to input_size. Expected 5 \(w_ih's columns\), got 3"),
    ("more features", "GRU", lambda a: dict(data=torch.randn(11, 40)), "Expected 5 \\(w_ih's columns\\), got 40"),
    # 3-D data is a full batch [T, B, I], which takes no batch sizes (test_cxx_rnn.py)
    ("data 3-D", "GRU", lambda a: dict(data=a["data"][:, None]), "full batch .* empty batch_sizes"),
    ("data 4-D", "GRU", lambda a: dict(data=a["data"][:, None, None]), "data must be 2-D"),
    ("w_ih rows not gates", "LSTM", lambda a: dict(w_ih=a["w_ih"][:-1]), "w_ih must be 2-D with 4 rows a hidden unit"),
    ("w_hh of another hidden size", "LSTM", lambda a: dict(w_hh=a["w_hh"][:, :4]), r"w_hh must have shape \(24, 6\)"),
    ("b_ih short", "GRU", lambda a: dict(b_ih=a["b_ih"][:5]), r"b_ih must have shape \(18\)"),
    ("b_hh 2-D", "RNN_TANH", lambda a: dict(b_hh=a["b_hh"][None]), r"b_hh must have shape \(6\)"),
    ("w_hh bf16", "GRU", lambda a: dict(w_hh=a["w_hh"].bfloat16()), "w_hh is"),
    ("h0 bf16", "LSTM", lambda a: dict(h0=a["h0"].bfloat16()), "h0 is"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("name,mode,change,match", named(*LAYER_CASES))
def test_packed_layer_checks(kernel, reverse, name, mode, change, match):
    a = _layer_args(mode, reverse=reverse)
    with pytest.raises(RuntimeError, match=match):
        kernel_of(kernel, "packed_layer")(*_with(a, **change(a)).values())


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_layer_projection_checks(kernel):
    a = _layer_args("LSTM", proj=3)
    op = kernel_of(kernel, "packed_layer")
    with pytest.raises(RuntimeError, match=r"w_hr must have shape \(proj_size, 6\)"):
        op(*_with(a, w_hr=a["w_hr"][:, :5]).values())
    with pytest.raises(RuntimeError, match=r"w_hh must have shape \(24, 4\), got \[?\(?24, 3"):  # H_out: w_hr's rows
        op(*_with(a, w_hr=torch.randn(4, H)).values())
    with pytest.raises(RuntimeError, match=r"h0 must have shape \(1, 4, 3\)"):
        op(*_with(a, h0=torch.randn(1, 4, H)).values())


def _backward_args(mode="LSTM", reverse=False):
    """A good forward's outputs and the backward's arguments (a dict in the backward op's order)."""
    a = _layer_args(mode, reverse=reverse)
    out, h_n, c_n, ws = ops.packed_layer_fw(*a.values()) if native.loaded() else pl._packed_layer(*a.values())
    g = torch.Generator().manual_seed(3)
    return {**{k: a[k] for k in ("data", "batch_sizes", "w_ih", "w_hh", "b_ih", "b_hh", "w_hr", "h0", "c0")},
            "out": out, "h_n": h_n, "c_n": c_n, "workspace": ws,
            "grad_out": torch.randn(out.shape, generator=g), "grad_hn": torch.randn(h_n.shape, generator=g),
            "grad_cn": torch.randn(c_n.shape, generator=g) if mode == "LSTM" else None, "mode": mode,
            "reverse": reverse}


BACKWARD_CASES = [
    ("grad_out short", "LSTM", lambda b: dict(grad_out=b["grad_out"][:4]), r"grad_out must have shape \(11, 6\)"),
    ("grad_out wide", "GRU", lambda b: dict(grad_out=torch.randn(11, 9)), r"grad_out must have shape \(11, 6\)"),
    ("grad_hn of the wrong batch", "RNN_TANH", lambda b: dict(grad_hn=b["grad_hn"][:, :2]),
     r"grad_hn must have shape \(1, 4, 6\)"),
    ("grad_cn of the wrong hidden size", "LSTM", lambda b: dict(grad_cn=b["grad_cn"][..., :2]),
     r"grad_cn must have shape \(1, 4, 6\)"),
    ("out short", "GRU", lambda b: dict(out=b["out"][:3]), r"out must have shape \(11, 6\)"),
    ("data too short", "LSTM", lambda b: dict(data=b["data"][:9]), r"sum to data.shape\[0\] = 9"),
    ("batch_sizes[0] above the states'", "GRU", lambda b: dict(batch_sizes=torch.tensor([5, 3, 2, 1])),
     r"must have shape \(1, 5, 6\)"),
    ("more features", "LSTM", lambda b: dict(data=torch.randn(11, 7)), "Expected 5 \\(w_ih's columns\\), got 7"),
    ("workspace of another call", "LSTM", lambda b: dict(workspace=b["workspace"][:5]), "train=False"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name,mode,change,match", named(*BACKWARD_CASES))
def test_packed_layer_backward_checks(kernel, name, mode, change, match):
    b = _backward_args(mode, reverse=name.startswith("grad_hn"))
    with pytest.raises(RuntimeError, match=match):
        kernel_of(kernel, "packed_layer_backward")(*_with(b, **change(b)).values())


def _bilayer_args(mode="LSTM", train=True):
    f, r = _layer_args(mode, train=train), _layer_args(mode, reverse=True)
    names = ("w_ih", "w_hh", "b_ih", "b_hh")
    return dict(data=f["data"], batch_sizes=f["batch_sizes"], weights=[d[n] for d in (f, r) for n in names],
                h0=torch.cat([f["h0"], r["h0"]]), c0=torch.cat([f["c0"], r["c0"]]) if mode == "LSTM" else None,
                mode=mode, has_biases=True, has_proj=False, train=train)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case,change,match", named(
    ("h0 of one direction", lambda a: dict(h0=a["h0"][:1]), "h0 must have shape"),
    ("c0 of the wrong batch", lambda a: dict(c0=a["c0"][:, :3]), "c0 must have shape"),
    ("reverse w_ih of more features",
     lambda a: dict(weights=a["weights"][:4] + [torch.randn(24, 9)] + a["weights"][5:]),
     "Expected 9 \\(w_ih's columns\\), got 5"),
    ("forward w_hh of another hidden size",
     lambda a: dict(weights=[a["weights"][0], torch.randn(24, 3)] + a["weights"][2:]),
     r"w_hh must have shape \(24, 6\)"),
    ("data too short", lambda a: dict(data=a["data"][:10]), r"sum to data.shape\[0\] = 10"),
    ("a weight missing", lambda a: dict(weights=a["weights"][:-1]), "expected 8 weights"),
))
def test_packed_bilayer_checks(kernel, threads, case, change, match):
    """Both directions checked before either starts (they run at once on
    two threads where torch has them)."""
    torch.set_num_threads(threads)  # the fixture puts 1 back
    a = _bilayer_args()
    with pytest.raises(RuntimeError, match=match):
        kernel_of(kernel, "packed_bilayer")(*_with(a, **change(a)).values())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case,change,match", named(
    # Both directions' columns (C++: (11, 12)), or one direction's half (the Python kernel: (11, 6)).
    ("grad_out of one direction", lambda b: dict(grad_out=b["grad_out"][:, :6]), r"grad_out must have shape \(11, "),
    ("out of one direction", lambda b: dict(out=b["out"][:, :6]), r"out must have shape \(11, "),
    ("grad_hn of the wrong batch", lambda b: dict(grad_hn=b["grad_hn"][:, :3]), "grad_hn must have shape"),
    ("workspace short", lambda b: dict(ws_b=b["ws_b"][:4]), "train=False"),
))
def test_packed_bilayer_backward_checks(kernel, case, change, match):
    a = _bilayer_args()
    out, h_n, c_n, ws_f, ws_b = (ops.packed_bilayer_fw if native.loaded() else pl._bilayer)(*a.values())
    b = dict(data=a["data"], batch_sizes=a["batch_sizes"], weights=a["weights"], h0=a["h0"], c0=a["c0"], out=out,
             h_n=h_n, c_n=c_n, ws_f=ws_f, ws_b=ws_b, grad_out=torch.randn(out.shape), grad_hn=torch.randn(h_n.shape),
             grad_cn=torch.randn(c_n.shape), mode="LSTM", has_biases=True, has_proj=False)
    with pytest.raises(RuntimeError, match=match):
        kernel_of(kernel, "packed_bilayer_backward")(*_with(b, **change(b)).values())


@pytest.mark.parametrize("kernel", KERNELS)
def test_layer_ops_still_run_a_good_batch(kernel):
    """The checks pass every well-formed call: forward and backward of each
    mode, a projection, both directions at once."""
    for mode, proj in (("LSTM", 0), ("LSTM", 3), ("GRU", 0), ("RNN_TANH", 0)):
        a = _layer_args(mode, proj=proj, reverse=True)
        out, h_n, c_n, ws = kernel_of(kernel, "packed_layer")(*a.values())
        assert out.shape == (11, proj or H) and h_n.shape == (1, 4, proj or H)
        grads = kernel_of(kernel, "packed_layer_backward")(*list(a.values())[:9], out, h_n, c_n, ws,
                                                           torch.ones_like(out), None, None, mode, True)
        assert grads[0].shape == a["data"].shape
    b = _bilayer_args("GRU")
    assert kernel_of(kernel, "packed_bilayer")(*b.values())[0].shape == (11, 2 * H)


# -- packed_lstm_runs (Python kernels) and the whole packed_rnn op --------------------------------

@pytest.mark.skipif(not mkldnn_rnn_dtype(torch.float32), reason="oneDNN's LSTM is not available here")
@pytest.mark.parametrize("case,change,match", named(
    ("fewer features", lambda a: dict(data=a["data"][:, :4]), "Expected 5 \\(w_ih's columns\\), got 4"),
    ("more features", lambda a: dict(data=torch.randn(11, 30)), "Expected 5 \\(w_ih's columns\\), got 30"),
    ("data too short", lambda a: dict(data=a["data"][:6]), r"sum to data.shape\[0\] = 6"),
    ("batch_sizes[0] above h0's batch", lambda a: dict(batch_sizes=torch.tensor([5, 3, 2, 1])),
     r"h0 must have shape \(1, 5, 6\)"),
    ("w_hh of another hidden size", lambda a: dict(w_hh=a["w_hh"][:, :5]), r"w_hh must have shape \(24, 6\)"),
))
def test_packed_lstm_runs_checks(case, change, match):
    """oneDNN's LSTM layer trusts the shapes it is handed: the kernel checks
    them first, forward and backward."""
    a = _layer_args("LSTM")
    args = {k: a[k] for k in ("data", "batch_sizes", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "c0", "reverse", "train")}
    bad = _with(args, **change(args))
    with pytest.raises(RuntimeError, match=match):
        ops.packed_lstm_runs_fw(*bad.values())
    out, h_n, c_n, ws = runs._forward(*args.values())
    grads = (torch.randn(out.shape), torch.randn(h_n.shape), torch.randn(c_n.shape))
    with pytest.raises(RuntimeError, match=match):
        runs._backward(*list(bad.values())[:8], ws, *grads, False)


@pytest.mark.skipif(not mkldnn_rnn_dtype(torch.float32), reason="oneDNN's LSTM is not available here")
def test_packed_lstm_runs_backward_checks_its_own_inputs():
    a = _layer_args("LSTM")
    args = [a[k] for k in ("data", "batch_sizes", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "c0")]
    out, h_n, c_n, ws = runs._forward(*args, False, True)
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \(11, 6\)"):
        runs._backward(*args, ws, torch.randn(5, 6), None, None, False)
    with pytest.raises(RuntimeError, match="train=False"):
        runs._backward(*args, ws[:3], torch.randn(out.shape), None, None, False)
    with pytest.raises(RuntimeError, match=r"grad_cn must have shape \(1, 4, 6\)"):
        runs._backward(*args, ws, None, None, torch.randn(1, 2, 6), False)


def test_packed_rnn_checks_its_weights_and_states():
    a = _layer_args("GRU")
    weights = [a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"]]
    with pytest.raises(RuntimeError, match="incorrect number of RNN parameters: 3, expected 4"):
        ops.packed_rnn(a["data"], a["batch_sizes"], [a["h0"]], weights[:3], "GRU", True, 1, 0.0, False, False, 0)
    with pytest.raises(RuntimeError, match=r"h0 must have 1 layers and directions, got shape \(2, 4, 6\)"):
        ops.packed_rnn(a["data"], a["batch_sizes"], [torch.cat([a["h0"]] * 2)], weights, "GRU", True, 1, 0.0, False,
                       False, 0)
    out, h_n, _ = ops.packed_rnn(a["data"], a["batch_sizes"], [a["h0"]], weights, "GRU", True, 1, 0.0, False, False, 0)
    assert out.shape == (11, H) and h_n.shape == (1, 4, H)
