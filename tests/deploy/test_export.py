"""``wfpass.export``: RNN models export with a dynamic sequence length, in a
graph whose size does not depend on the example's T, equal to eager; the
program saves, loads and compiles with AOTInductor, and runs in a fresh
process where only ``import wfpass`` ran; the model is left as it was."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import wfpass
from wftest import fake_mode, needs_cuda_build


class Net(nn.Module):
    """An RNN between two layers, its input reused by a residual."""

    def __init__(self, rnn: nn.RNNBase, width: int, with_state: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, rnn.input_size)
        self.rnn, self.head, self.with_state = rnn, nn.Linear(width, 8), with_state

    def forward(self, x, h=None):
        z = self.inp(x)
        y, state = self.rnn(z, h) if self.with_state else self.rnn(z)
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(y) + x, h_n


CASES = {
    "lstm_2_layers": (lambda: nn.LSTM(16, 32, 2), 32, False),
    "gru_bidirectional_batch_first": (lambda: nn.GRU(16, 24, 2, bidirectional=True, batch_first=True), 48, True),
    "lstm_proj_bidirectional": (lambda: nn.LSTM(16, 32, 2, proj_size=8, bidirectional=True), 16, False),
    "rnn_relu_no_bias": (lambda: nn.RNN(16, 20, 3, nonlinearity="relu", bias=False), 20, False),
    "rnn_tanh": (lambda: nn.RNN(16, 20), 20, False),
}


def _x(batch_first: bool, t: int, b: int = 3):
    return torch.randn(b, t, 8) if batch_first else torch.randn(t, b, 8)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_dynamic_length_program_equals_eager_at_every_length(case):
    make, width, bf = CASES[case]
    torch.manual_seed(0)
    model = Net(make(), width).eval()
    ref = copy.deepcopy(model)
    ep = wfpass.export(model, (_x(bf, 5),), dynamic_shapes={"x": {1 if bf else 0: Dim("T", min=1, max=400)}})
    for t in (1, 2, 17, 300):
        x = _x(bf, t)
        with torch.no_grad():
            want = ref(x)
        got = ep.module()(x)
        assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5, (case, t)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(o.startswith("wfpass.") for o in ops), ops
    assert not any(o.startswith(("aten.lstm", "aten.gru", "aten.rnn_")) for o in ops), ops
    row, = wfpass.report(model).find("rnn", "rewritten")
    assert "T=symbolic" in row.reason and "whatever T" in row.reason


def test_the_graph_does_not_grow_with_the_example_length():
    sizes = []
    for t in (2, 64):
        model = Net(nn.LSTM(16, 32, 2), 32).eval()
        ep = wfpass.export(model, (_x(False, t),), dynamic_shapes={"x": {0: Dim("T")}})
        sizes.append(len(ep.graph.nodes))
    assert sizes[0] == sizes[1] < 60, sizes
    # A static export (no dynamic_shapes) is the same size too: one op per layer, not per step.
    static = wfpass.export(Net(nn.LSTM(16, 32, 2), 32).eval(), (_x(False, 64),))
    assert len(static.graph.nodes) <= sizes[0]


def test_given_states_dynamic_batch_and_the_model_left_as_it_was():
    torch.manual_seed(1)
    model = Net(nn.LSTM(16, 32, 2), 32, with_state=True).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {k: id(p) for k, p in model.named_parameters()}
    x, h, c = _x(False, 5), torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    T, B = Dim("T"), Dim("B")
    ep = wfpass.export(model, (x, (h, c)), dynamic_shapes={"x": {0: T, 1: B}, "h": ({1: B}, {1: B})})
    assert "forward" not in model.rnn.__dict__
    assert {k: id(p) for k, p in model.named_parameters()} == ids
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(ep.state_dict) == {k for k, _ in model.named_parameters()}  # the model's own keys, nothing added
    x2, h2, c2 = _x(False, 9, 6), torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    with torch.no_grad():
        want = model(x2, (h2, c2))
    got = ep.module()(x2, (h2, c2))
    assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5


def test_a_forward_the_module_already_had_is_put_back():
    """A module compiled with wformat before holds wfpass's forward in its
    __dict__: after an export it holds the same one again."""
    model = Net(nn.LSTM(16, 32), 32).eval()
    torch.compile(model, backend="wformat")(_x(False, 5))
    had = model.rnn.__dict__.get("forward")
    wfpass.export(model, (_x(False, 5),))
    assert model.rnn.__dict__.get("forward") is had


def test_a_model_compiled_before_packages_each_weight_once(tmp_path):
    """After torch.compile(backend="wformat") the RNN's Parameters are views
    of one flat block; AOTInductor packages a constant's whole storage, so a
    program holding those views packaged the block once per Parameter (31 MB
    for this 3.7 MB model). The program holds aliases of each weight's own
    bytes: the same memory as the model's (a later change shows through),
    a package and a saved program of about the weights' size."""
    torch.manual_seed(0)
    model = Net(nn.LSTM(64, 128, 2), 128).eval()
    torch.compile(model, backend="wformat")(_x(False, 5))
    assert len({p.untyped_storage().data_ptr() for p in model.rnn.parameters()}) == 1  # one flat block
    ep = wfpass.export(model, (_x(False, 16),), dynamic_shapes={"x": {0: Dim("T", max=300)}})
    params = dict(model.named_parameters())
    for name, t in ep.state_dict.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
        assert t.data_ptr() == params[name].data_ptr(), name  # an alias, not a copy
    (row,) = wfpass.last_report().find("export")
    assert len(row.params) == len(list(model.rnn.parameters())), row
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.export.save(ep, tmp_path / "program.pt2")
    assert (tmp_path / "program.pt2").stat().st_size < weights * 1.1 + 200_000
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    assert (tmp_path / "m.pt2").stat().st_size < weights * 1.2 + 3_000_000
    with torch.no_grad():
        model.rnn.weight_hh_l1.mul_(0.5)  # the program reads the model's bytes: never a stale copy
        x = _x(False, 23)
        want = model(x)[0]
        assert _rel(ep.module()(x)[0], want) <= 1e-5
        assert _rel(torch._inductor.aoti_load_package(package)(x)[0], model(x)[0]) > 1e-3  # the package froze the weights it was given


def test_a_constant_that_views_a_larger_tensor_is_narrowed_too():
    """A non-persistent buffer (a program constant, packaged like a weight)
    that is a slice of a larger tensor: held as its own bytes too."""
    model = Net(nn.GRU(16, 32), 32).eval()
    big = torch.randn(1000)
    model.register_buffer("scale", big[10:18], persistent=False)
    ep = wfpass.export(model, (_x(False, 5),))
    t = ep.constants["scale"]
    assert t.untyped_storage().nbytes() == 8 * 4 and t.data_ptr() == big[10:18].data_ptr()
    (row,) = wfpass.last_report().find("export")
    assert row.params == ["scale"], row


def test_unbatched_input():
    model = Net(nn.GRU(16, 24), 24).eval()
    ep = wfpass.export(model, (torch.randn(5, 8),), dynamic_shapes={"x": {0: Dim("T")}})
    x = torch.randn(13, 8)
    with torch.no_grad():
        want = model(x)
    assert _rel(ep.module()(x)[0], want[0]) <= 1e-5


def test_a_training_mode_program_gives_eagers_gradients():
    """A module in training mode is traced with the ops that carry gradient
    formulas: the program's backward gives eager's gradients (loss: a fixed
    random projection; errors scaled by the largest gradient)."""
    torch.manual_seed(2)
    model = Net(nn.LSTM(16, 32, 2), 32).train()
    ref = copy.deepcopy(model)
    ep = wfpass.export(model, (_x(False, 5),), dynamic_shapes={"x": {0: Dim("T")}})
    prog = ep.module()
    x = _x(False, 11)
    R = torch.randn(11, 3, 8)
    (ref(x)[0] * R).sum().backward()
    (prog(x)[0] * R).sum().backward()
    got = dict(prog.named_parameters())
    for name, p in ref.named_parameters():
        g = got[name].grad
        assert g is not None, name
        assert ((g - p.grad).abs().max() / p.grad.abs().max()).item() <= 1e-5, name


def test_a_subclass_with_its_own_forward_is_left_to_torch_export_and_said():
    class MyLSTM(nn.LSTM):
        def forward(self, x):  # its own signature: traced as it is
            return super().forward(x)

    model = Net(MyLSTM(16, 32), 32).eval()
    ep = wfpass.export(model, (_x(False, 5),))
    (row,) = wfpass.last_report().find("rnn", "skipped")
    assert "defines its own forward" in row.reason
    x = _x(False, 5)
    with torch.no_grad():
        assert _rel(ep.module()(x)[0], model(x)[0]) <= 1e-5
    assert "forward" not in model.rnn.__dict__


@needs_cuda_build
@pytest.mark.parametrize("train", [False, True])
def test_a_cuda_rnn_is_one_cudnn_op_where_asked_and_left_to_torch_export_by_default(train):
    """On CUDA, as under torch.compile, cuDNN is opt-in: by default the RNN
    is left to torch.export (whose LSTM specializes T: its error, naming why
    wfpass left it); with rnn={"cuda": "cudnn"} the program holds one
    wfpass cuDNN op for all layers, T symbolic, a packed batch's too.
    Checked on fake CUDA tensors (no GPU runs here)."""
    dyn = {"x": {0: Dim("T", min=2, max=400)}}
    with fake_mode():
        model = Net(nn.LSTM(16, 32, 2, device="cuda"), 32).train(train)
        model.inp, model.head = nn.Linear(8, 16, device="cuda"), nn.Linear(32, 8, device="cuda")
        x = torch.randn(5, 3, 8, device="cuda")
        with pytest.raises(Exception, match="specialized") as err:
            wfpass.export(model, (x,), dynamic_shapes=dyn)
        assert "left these RNNs to torch.export" in "".join(getattr(err.value, "__notes__", []))
        (row,) = wfpass.last_report().find("rnn", "skipped")
        assert "on cuda" in row.reason and "'cudnn'" in row.reason
        static = wfpass.export(model, (x,))  # stock's trace, as without wfpass
        assert not any(str(n.target).startswith("wfpass.") for n in static.graph.nodes)

        ep = wfpass.export(model, (x,), dynamic_shapes=dyn, rnn={"cuda": "cudnn"})
        ops = [str(n.target) for n in ep.graph.nodes if str(n.target).startswith(("wfpass.", "aten.lstm", "aten._cudnn"))]
        assert ops == ["wfpass.cudnn_rnn.default" if train else "wfpass.cudnn_rnn_fw.default"], ops
        (row,) = wfpass.last_report().find("rnn", "rewritten")
        assert "cuDNN, one op for the 2 layer(s), whatever T" in row.reason and "flattens a copy" in row.reason
        y, h_n = ep.module()(torch.randn(17, 3, 8, device="cuda"))  # another length: the fakes' shapes
        assert tuple(y.shape) == (17, 3, 8) and tuple(h_n.shape) == (2, 3, 32)
        assert "forward" not in model.rnn.__dict__

        enc = Encoder(nn.GRU(16, 24, 2, batch_first=True, bidirectional=True, device="cuda"), 48, True, False)
        enc.head = nn.Linear(48, 8, device="cuda")
        enc.train(train)
        xs, lengths = torch.randn(3, 9, 16, device="cuda"), torch.tensor([9, 4, 6])
        B, T = Dim("B", min=2, max=64), Dim("T", min=2, max=400)
        ep = wfpass.export(enc, (xs, lengths), dynamic_shapes={"x": {0: B, 1: T}, "lengths": {0: B}},
                           rnn={"cuda": "cudnn"})
        ops = [str(n.target) for n in ep.graph.nodes if str(n.target).startswith(("wfpass.", "aten.gru"))]
        rnn_op = "wfpass.cudnn_packed_rnn.default" if train else "wfpass.cudnn_packed_rnn_fw.default"
        assert ops == ["wfpass.pack_padded.default", rnn_op, "wfpass.pad_packed.default"], ops


def test_errors_name_what_is_wrong():
    model = Net(nn.LSTM(16, 32), 32).eval()
    with pytest.raises(TypeError, match="nn.Module"):
        wfpass.export(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="args must be a tuple"):
        wfpass.export(model, torch.randn(5, 3, 8))
    with pytest.raises(ValueError, match="unknown wfpass option"):
        wfpass.export(model, (_x(False, 5),), colour=1)
    ep = wfpass.export(model, (_x(False, 5),))
    with pytest.raises(TypeError, match="wfpass.export"):
        wfpass.apply(ep)
    # A failed trace leaves the module as it was.
    with pytest.raises(Exception):
        wfpass.export(model, (torch.randn(5, 3, 9),))
    assert "forward" not in model.rnn.__dict__


def test_the_export_example_runs_its_package_in_a_fresh_process(tmp_path):
    """``examples/export_lstm.py`` (docs/guide/export.md): ``torch.export.save``
    / ``load`` and an AOTInductor package, loaded in a process where only
    ``import wfpass`` ran, give eager's values at lengths the example did not
    have."""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "examples" / "export_lstm.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("equals eager") == 6, r.stdout
    assert (tmp_path / "lm_aoti.pt2").exists() and (tmp_path / "lm_program.pt2").exists()


def test_the_two_libraries_run_the_ops_in_a_process_without_wfpass():
    """The kernels' library and the definitions library that
    ``python -m wfpass libraries`` prints, loaded into a process where only
    torch was imported (as a C++ program loads them), define and serve the
    ops an exported LSTM calls, with eager's values; the definitions are
    the table's, and none of the kernels' own."""
    from wfpass.native import program, schemas

    if wfpass.native.load() is not None:
        pytest.skip(f"wfpass's C++ kernels are not built here: {wfpass.native.load()}")
    src = program.definitions_source()
    for name, args in schemas.all_schemas().items():
        assert (f'm.def("{name}{args}");' in src) == (name not in schemas.CXX_DEFINED), name
    kernels, defs = program.cxx_libraries()
    child = f"""
import torch
torch.ops.load_library({str(defs)!r})
torch.ops.load_library({str(kernels)!r})
torch.manual_seed(0)
lstm = torch.nn.LSTM(8, 16).eval()
x = torch.randn(40, 3, 8)
with torch.no_grad():
    want = lstm(x)[0]
    got = torch.ops.wfpass.lstm_layer_fw(x, *lstm.parameters(), None, None, False, 16, True, False)[0]
print(((got - want).abs().max() / want.abs().max()).item(), "wfpass" in __import__("sys").modules)
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    err, imported = r.stdout.split()
    assert float(err) <= 1e-5 and imported == "False", r.stdout


def test_the_cpp_example_runs_the_package_with_no_python(tmp_path):
    """``examples/export_cpp.py`` (docs/guide/export.md): the package runs
    from ``examples/export_cpp/run_package.cpp``, a C++ program
    (``AOTIModelPackageLoader``) with wfpass's two libraries loaded, and
    gives eager's values at lengths and batches the example did not have."""
    if wfpass.native.load() is not None:
        pytest.skip(f"wfpass's C++ kernels are not built here: {wfpass.native.load()}")
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "examples" / "export_cpp.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("equals eager") == 3, r.stdout


class Encoder(nn.Module):
    """A packed batch: pack_padded_sequence -> RNN -> pad_packed_sequence
    (imported by name, as most models do)."""

    def __init__(self, rnn: nn.RNNBase, width: int, total_length: bool, sorted_: bool):
        super().__init__()
        self.rnn, self.head, self.total_length, self.sorted = rnn, nn.Linear(width, 8), total_length, sorted_

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.sorted)
        y, state = self.rnn(packed)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=x.shape[1] if self.total_length else None)
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(y), h_n


@pytest.mark.parametrize("rnn,width,total_length,sorted_", [
    (lambda: nn.GRU(16, 32, 2, bidirectional=True, batch_first=True), 64, True, False),
    (lambda: nn.LSTM(16, 24, 1, batch_first=True), 24, True, True),
    (lambda: nn.LSTM(16, 24, 2, batch_first=True, proj_size=8), 8, False, False),
])
def test_packed_batch_exports_with_dynamic_lengths(rnn, width, total_length, sorted_):
    """Upstream export fails on a packed batch (ATen's packing has no fake
    for lengths that are data); here batch, length and the lengths' values
    are all free, and the program equals eager."""
    torch.manual_seed(4)
    model = Encoder(rnn(), width, total_length, sorted_).eval()
    x, lengths = torch.randn(4, 10, 16), torch.tensor([10, 7, 3, 1])
    B, T = Dim("B", min=2, max=64), Dim("T", min=2, max=400)
    ep = wfpass.export(model, (x, lengths), dynamic_shapes={"x": {0: B, 1: T}, "lengths": {0: B}})
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "wfpass.pack_padded.default" in ops and "wfpass.pad_packed.default" in ops, ops
    gen = torch.Generator().manual_seed(5)
    for b, t in ((4, 10), (6, 300), (3, 2)):
        x = torch.randn(b, t, 16, generator=gen)
        lengths = torch.randint(1, t + 1, (b,), generator=gen)
        lengths[0] = t
        if sorted_:
            lengths = lengths.sort(descending=True).values
        with torch.no_grad():
            want = model(x, lengths)
        got = ep.module()(x, lengths)
        assert got[0].shape == want[0].shape
        assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5, (b, t)
    from wfpass._torch.kernels import packing_functions_replaced

    assert not packing_functions_replaced()  # the trace's packing functions are gone again
    if width == 64:  # one AOTInductor package (about 20 s): every batch, a batch of 1 included, and length
        run = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep))
        for b, t in ((1, 1), (1, 9), (5, 33)):
            x, lengths = torch.randn(b, t, 16, generator=gen), torch.randint(1, t + 1, (b,), generator=gen)
            lengths[0] = t
            with torch.no_grad():
                want = model(x, lengths)
            got = run(x, lengths)
            assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5, (b, t)


def test_the_program_keeps_its_ops_through_run_decompositions():
    """``run_decompositions()`` lowers a program to the core ATen opset (the
    start of ExecuTorch's, ONNX's and other lowerings; stock's LSTM becomes
    one cell per step there: 714 nodes at T 16). wfpass's ops are custom ops
    with no decomposition: they stay one op per layer, T stays dynamic, and
    the lowered program equals eager, a packed batch's too."""
    torch.manual_seed(6)
    model = Net(nn.LSTM(16, 32, 2, proj_size=8, bidirectional=True), 16).eval()
    ep = wfpass.export(model, (_x(False, 5),), dynamic_shapes={"x": {0: Dim("T", min=1, max=400)}})
    low = ep.run_decompositions()

    def ours(program):
        return [str(n.target) for n in program.graph.nodes if str(n.target).startswith("wfpass.")]

    assert ours(low) == ours(ep) and len(ours(ep)) == 2 and len(low.graph.nodes) <= len(ep.graph.nodes), ours(low)
    for t in (1, 33, 300):
        x = _x(False, t)
        with torch.no_grad():
            want = model(x)
        got = low.module()(x)
        assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5, t
    enc = Encoder(nn.GRU(16, 24, 1, batch_first=True), 24, True, False).eval()
    x, lengths = torch.randn(3, 9, 16), torch.tensor([9, 4, 6])
    B, T = Dim("B", min=2, max=64), Dim("T", min=2, max=400)
    low = wfpass.export(enc, (x, lengths), dynamic_shapes={"x": {0: B, 1: T}, "lengths": {0: B}}).run_decompositions()
    ops = {str(n.target) for n in low.graph.nodes if n.op == "call_function"}
    assert "wfpass.pack_padded.default" in ops and not any(o.startswith("aten.gru") for o in ops), ops
    x, lengths = torch.randn(5, 40, 16), torch.tensor([40, 3, 17, 40, 1])
    with torch.no_grad():
        want = enc(x, lengths)
    got = low.module()(x, lengths)
    assert _rel(got[0], want[0]) <= 1e-5 and _rel(got[1], want[1]) <= 1e-5
