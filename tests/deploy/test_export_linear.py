"""Sibling linears in exported programs (wfpass/deploy/linear.py): Q/K/V and
gate/up as one ``wfpass::linear_group`` over each weight where the program
holds it, equal to eager, in the program, after ``torch.export.save`` /
``load`` and in an AOTInductor package loaded by a fresh process."""
import copy
import operator
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import wfpass
from wfpass import native
from wfpass.deploy import linear as deploy_linear
from wfpass.linear import group as wfpass_group


class Block(nn.Module):
    """LLaMA-like: Q/K/V (no bias), O, gate/up (one with a bias), down."""

    def __init__(self, d=64, heads=4, ff=96):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=True), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _dyn():
    return {"x": {0: Dim("B", min=1, max=64), 1: Dim("T", min=1, max=512)}}


def _x(b, t, dtype=torch.float32):
    return torch.randn(b, t, 64, generator=torch.Generator().manual_seed(100 * t + b)).to(dtype)


def _ops(ep):
    """The program's ``wfpass::linear_group`` nodes and its top-level
    ``aten.linear`` nodes. Where the program's row count is symbolic the op
    sits in a ``torch.cond`` on it, whose other branch holds one
    ``aten.linear`` per member (checked here) for the rows above the op's."""
    gm = ep.graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    groups = [n for n in nodes if n.target is torch.ops.wfpass.linear_group.default]
    for n in nodes:
        if n.target is torch.ops.higher_order.cond:
            small, large = (getattr(gm, a.target).graph.nodes for a in n.args[1:3])
            (group,) = [m for m in small if m.target is torch.ops.wfpass.linear_group.default]
            linears = [m for m in large if m.target is torch.ops.aten.linear.default]
            assert len(linears) == len(group.args[2]) and len(n.args[3]) == 1 + len(group.args[1]), gm.graph
            groups.append(group)
    plain = [n for n in nodes if n.target is torch.ops.aten.linear.default]
    return groups, plain


@pytest.fixture
def direct_rows(monkeypatch):
    """Set the row count the direct kernel serves, instead of the export's
    timing (which decides by this machine's speed): both paths of the op
    run in every test, whatever the machine measures."""
    def use(rows):
        monkeypatch.setattr(deploy_linear, "direct_rows", lambda dtype, k, n, config: (rows, f"test: {rows} rows"))
    return use


@pytest.mark.parametrize("rows", [0, 4])
def test_decoder_block_program_has_four_gemms_and_equals_eager_at_every_shape(direct_rows, rows):
    direct_rows(rows)
    torch.manual_seed(0)
    model = Block().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ep = wfpass.export(model, (_x(2, 16),), dynamic_shapes=_dyn())
    groups, plain = _ops(ep)
    rep = wfpass.last_report()
    sibling = [["gate.bias", "gate.weight", "up.weight"], ["k.weight", "q.weight", "v.weight"]]
    if rows:
        # 4 GEMM nodes for 7 linears: Q/K/V one, gate/up one, O and down alone.
        assert not plain and sorted(len(g.args[2]) for g in groups) == [1, 1, 2, 3], ep.graph
        assert {g.args[3] for g in groups} == {rows}
        assert sorted(sorted(r.params) for r in rep.find("linear", "rewritten")) == sorted(
            sibling + [["down.weight"], ["o.weight"]]), str(rep)
    else:
        # Where the direct kernel wins at no row count the op would only add
        # its call to the same GEMMs: the linears stay as stock traced them.
        assert not groups and len(plain) == 7, ep.graph
        assert sorted(sorted(r.params) for r in rep.find("linear", "skipped")) == sibling, str(rep)
    # The program holds the model's keys, each weight once, unchanged; the model is as it was.
    assert set(ep.state_dict) == set(model.state_dict())
    ptrs = [t.untyped_storage().data_ptr() for t in ep.state_dict.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    run = ep.module()
    # Rows 1 (decode), 3 (under 4), 8 and 300 x 2 (over): both paths of the op.
    for b, t in ((1, 1), (3, 1), (1, 4), (2, 4), (1, 300), (2, 150)):
        x = _x(b, t)
        with torch.no_grad():
            got, want = run(x), model(x)
        assert got.shape == want.shape
        assert _rel(got, want) <= 1e-5, (b, t, _rel(got, want))


def test_the_op_sits_behind_a_cond_on_the_row_count_only_where_the_rows_vary(direct_rows):
    """A dynamic program branches on batch x T: the op up to its rows, the
    linears as traced above; a static one takes one side at export."""
    direct_rows(4)
    torch.manual_seed(0)
    model = Block().eval()
    dyn = wfpass.export(model, (_x(2, 16),), dynamic_shapes=_dyn())
    conds = [n for n in dyn.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == 4 and len(_ops(dyn)[0]) == 4, dyn.graph
    # The predicate: the input's rows (sym_size of each leading dim, multiplied) <= 4.
    for n in conds:
        pred = n.args[0]
        assert pred.target is operator.le and pred.args[1] == 4, pred.format_node()
        assert [a.target for a in pred.args[0].args] == [torch.ops.aten.sym_size.int] * 2, pred.args[0].format_node()
    rows = wfpass.last_report().find("linear", "rewritten")
    assert all("torch.cond on the row count" in r.reason for r in rows), [r.reason for r in rows]
    small = wfpass.export(model, (_x(1, 3),))  # 3 rows: the op, no branch
    groups, plain = _ops(small)
    assert len(groups) == 4 and not plain
    assert not [n for n in small.graph.nodes if n.target is torch.ops.higher_order.cond]
    large = wfpass.export(model, (_x(2, 16),))  # 32 rows: the linears as traced
    groups, plain = _ops(large)
    assert not groups and len(plain) == 7
    skipped = wfpass.last_report().find("linear", "skipped")
    assert skipped and all("row count is 32, above the 4" in r.reason for r in skipped), [r.reason for r in skipped]
    with torch.no_grad():
        for ep, x in ((small, _x(1, 3)), (large, _x(2, 16))):
            assert _rel(ep.module()(x), model(x)) <= 1e-5


def test_a_training_mode_program_gives_eagers_gradients(direct_rows):
    direct_rows(4)
    torch.manual_seed(0)
    model = Block().train()
    ref = copy.deepcopy(model)
    ep = wfpass.export(model, (_x(2, 16),), dynamic_shapes=_dyn())
    assert sorted(len(g.args[2]) for g in _ops(ep)[0]) == [1, 1, 2, 3]
    run = ep.module()
    for b, t in ((1, 2), (2, 9)):
        x = _x(b, t).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, want = run(x), ref(x_ref)
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        (out * r).sum().backward()
        (want * r).sum().backward()
        assert _rel(out, want) <= 1e-5
        assert _rel(x.grad, x_ref.grad) <= 1e-5
        grads = dict(run.named_parameters())
        top = max(p.grad.abs().max().item() for p in ref.parameters())
        for name, p in ref.named_parameters():
            got = grads[name].grad
            assert got is not None, name
            assert (got - p.grad).abs().max().item() / top <= 1e-5, name
            grads[name].grad = None
            p.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", ["none", "some", "all"])
def test_the_op_equals_separate_linears_on_both_paths(dtype, bias):
    g = torch.Generator().manual_seed(0)
    k = 80
    sizes = (48, 16, 33)  # 33: a partial block of 16 rows at the end of a member
    ws = [torch.randn(n, k, generator=g).to(dtype) for n in sizes]
    ws[1] = torch.randn(16, k + 8, generator=g).to(dtype)[:, :k]  # a weight whose rows are apart
    bs = [torch.randn(n, generator=g).to(dtype) if (bias == "all" or (bias == "some" and i != 1)) else None
          for i, n in enumerate(sizes)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for rows in (1, 2, 3, 5, 9):
        x = torch.randn(rows, 1, k, generator=g).to(dtype)
        want = torch.cat([F.linear(x.float(), w.float(), None if b is None else b.float())
                          for w, b in zip(ws, bs)], -1)
        for direct in (0, 16):
            outs = wfpass_group.linear_group(x, ws, bs, direct)
            # One output per member, contiguous, as each linear gives it.
            assert [o.shape for o in outs] == [(rows, 1, n) for n in sizes]
            assert all(o.dtype == dtype and o.is_contiguous() for o in outs)
            got = torch.cat(outs, -1).float()
            assert _rel(got, want) <= tol, (rows, direct, _rel(got, want))


def test_bf16_prompt_rows_of_the_op_take_the_amx_body_as_the_one_weight_kernel_does():
    """The export decides a group's direct rows from the one-weight direct
    kernel's timings, which take AMX tiles for bf16 at 4+ rows: the group
    runs the same body (before, it ran the widening body there, up to 2.8x
    slower at 16 rows), and gives the one-weight kernel's values."""
    from wfpass.native import ops as _nops

    if not _nops.direct_amx():
        pytest.skip("the AMX body is off here (no AMX-BF16, WFPASS_DIRECT_AMX=0, or no AVX-512 build)")
    g = torch.Generator().manual_seed(3)
    k = 96  # a multiple of 32; members of 16-row multiples, one with its rows apart
    ws = [torch.randn(48, k, generator=g).bfloat16(), torch.randn(32, k + 16, generator=g).bfloat16()[:, :k],
          torch.randn(16, k, generator=g).bfloat16()]
    bs = [torch.randn(48, generator=g).bfloat16(), None, torch.randn(16, generator=g).bfloat16()]
    for rows in (4, 16, 33, 40):  # one tile of rows, two halves, a partial second pass
        x = torch.randn(rows, k, generator=g).bfloat16()
        outs = wfpass_group.linear_group(x, ws, bs, 64)
        for o, w, b in zip(outs, ws, bs):
            one = torch.ops.wfpass._direct_linear(x, w, b)
            assert torch.equal(o, one), rows
            want = F.linear(x.float(), w.float(), None if b is None else b.float())
            assert _rel(o.float(), want) <= 1e-2, rows


def test_the_op_gives_every_member_its_gradient():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 24, generator=g, requires_grad=True) for n in (16, 8, 5)]
    bs = [torch.randn(16, generator=g, requires_grad=True), None, torch.randn(5, generator=g, requires_grad=True)]
    x = torch.randn(3, 4, 24, generator=g, requires_grad=True)
    r = torch.randn(3, 4, 29, generator=g)
    for used in (3, 2):  # every output in the loss; then the last one in none (its gradient is None)
        loss = lambda outs: (torch.cat(outs[:used], -1) * r[..., :sum((16, 8, 5)[:used])]).sum()  # noqa: E731
        loss(wfpass_group.linear_group(x, ws, bs, 4)).backward()
        got = [t.grad for t in (x, *ws, bs[0], bs[2])]
        for t in (x, *ws, bs[0], bs[2]):
            t.grad = None
        loss([F.linear(x, w, b) for w, b in zip(ws, bs)]).backward()
        want = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, *ws, bs[0], bs[2])]
        for t in (x, *ws, bs[0], bs[2]):
            t.grad = None
        top = max(w.abs().max().item() for w in want)
        for a, b in zip(got, want):
            assert a is not None and (a - b).abs().max().item() / top <= 1e-6


def test_the_op_says_what_does_not_fit():
    w = torch.randn(8, 16)
    group = torch.ops.wfpass.linear_group
    with pytest.raises(RuntimeError, match="weight 1 of shape"):
        group(torch.randn(2, 16), [w, torch.randn(8, 12)], [False, False], 4)
    with pytest.raises(RuntimeError, match="3 tensors for 2 members"):
        group(torch.randn(2, 16), [w, w, torch.randn(8)], [False, False], 4)
    with pytest.raises(RuntimeError, match="bias 0 of shape"):
        group(torch.randn(2, 16), [w, torch.randn(5)], [True], 4)


class Tied(nn.Module):
    """A head tied to the embedding, and two linears reading one input of
    which one weight is read again by another op."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        h = self.emb(tok)
        return self.head(self.a(h) + self.b(h).sum(-1, keepdim=True) * self.c(h).mean()) + self.b.weight.sum()


def test_tied_and_reused_weights_are_left_with_their_reason(direct_rows):
    direct_rows(4)
    model = Tied().eval()
    tok = torch.randint(0, 50, (2, 7))
    ep = wfpass.export(model, (tok,), dynamic_shapes={"tok": {1: Dim("T", min=1, max=64)}})
    groups, plain = _ops(ep)
    # a and c as one; b (its weight read again) and the tied head as they were.
    assert [len(g.args[2]) for g in groups] == [2] and len(plain) == 2, ep.graph
    skipped = {p: r.reason for r in wfpass.last_report().find("linear", "skipped") for p in r.params}
    assert "b.weight" in skipped and "also read by" in skipped["b.weight"], skipped
    with torch.no_grad():
        for t in (1, 30):
            x = torch.randint(0, 50, (2, t))
            assert _rel(ep.module()(x), model(x)) <= 1e-5


class Heads(nn.Module):
    """Linears whose outputs are the program's outputs: two siblings and a
    lone one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 16), nn.Linear(32, 8, bias=False), nn.Linear(16, 4)

    def forward(self, x):
        a = self.a(x)
        return a, self.b(x), self.c(a)


def test_linears_whose_outputs_are_the_programs_outputs(direct_rows, tmp_path):
    """The graph signature names each output by its node: after the rewrite
    those are the op's outputs (torch.export's verifier and
    ``torch.export.save`` check it)."""
    direct_rows(4)
    model = Heads().eval()
    ep = wfpass.export(model, (torch.randn(2, 5, 32),), dynamic_shapes={"x": {1: Dim("T", min=1, max=64)}})
    groups, plain = _ops(ep)
    assert sorted(len(g.args[2]) for g in groups) == [1, 2] and not plain, ep.graph
    torch.export.save(ep, str(tmp_path / "heads.pt2"))
    for run in (ep.module(), torch.export.load(str(tmp_path / "heads.pt2")).module()):
        for t in (1, 9):
            x = torch.randn(2, t, 32)
            with torch.no_grad():
                for got, want in zip(run(x), model(x)):
                    assert _rel(got, want) <= 1e-5


def test_options_turn_it_off(direct_rows):
    direct_rows(4)
    model = Block().eval()
    for options in ({"passes": ("fuse_rnn",)}, {"linear": {"path": "split"}}):
        ep = wfpass.export(model, (_x(2, 16),), dynamic_shapes=_dyn(), **options)
        groups, plain = _ops(ep)
        assert not groups and len(plain) == 7, options


def test_the_package_runs_the_op_in_a_fresh_process(tmp_path, direct_rows):
    """AOTInductor compiles the program with the op as an extern call; a
    process where only ``import wfpass`` ran loads the package and the
    saved program and gets eager's values at shapes the export never had."""
    why = native.build()
    if why is not None:
        pytest.skip(f"wfpass's C++ kernels did not build here: {why}")
    direct_rows(4)
    torch.manual_seed(0)
    model = Block().eval()
    ep = wfpass.export(model, (_x(2, 16),), dynamic_shapes=_dyn())
    torch.export.save(ep, str(tmp_path / "program.pt2"))
    torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
    cases = ((1, 1), (3, 1), (2, 37), (1, 300))
    with torch.no_grad():
        torch.save({f"{b}x{t}": (_x(b, t), model(_x(b, t))) for b, t in cases}, tmp_path / "want.pt")
    code = textwrap.dedent(f"""
        import torch, wfpass
        package = torch._inductor.aoti_load_package({str(tmp_path / "block.pt2")!r})
        program = torch.export.load({str(tmp_path / "program.pt2")!r}).module()
        for key, (x, want) in torch.load({str(tmp_path / "want.pt")!r}).items():
            for name, run in (("package", package), ("program", program)):
                with torch.no_grad():
                    got = run(x)
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, (name, key, err)
                print(name, key, "ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count(" ok") == 2 * len(cases), r.stdout
