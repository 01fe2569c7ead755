"""Tensor internals (torch 2.13.0): storage use counts, identity-keyed weak
dicts, version counters, symbolic sizes. Imports nothing from wfpass."""
from __future__ import annotations

import functools
from typing import Optional

import torch


def storage_use_count(t: torch.Tensor) -> Optional[int]:
    """How many TensorImpls hold ``t``'s storage (``torch._C._storage_Use_Count``,
    private; torch 2.13.0). ``None`` where it is unavailable: callers treat that
    as "unknown" and rely on the data_ptr overlap check alone."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    try:
        # The Python UntypedStorage object we create here holds one reference.
        return int(fn(t.untyped_storage()._cdata)) - 1
    except Exception:  # pragma: no cover - defensive: meta/fake tensors
        return None



def weak_id_key_dict():
    """A dict with weak, identity-compared tensor keys (``torch.utils.weak.
    WeakIdKeyDictionary``, undocumented; torch 2.13.0). ``weakref.
    WeakKeyDictionary`` cannot hold tensors: its lookups compare keys with
    ``==``, which is elementwise for tensors and raises "Boolean value of
    Tensor with more than one value is ambiguous"."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def version(t: torch.Tensor) -> int:
    """The in-place write counter of ``t`` (``Tensor._version``, private;
    torch 2.13.0)."""
    return t._version


@functools.lru_cache(maxsize=None)
def fake_tensor_type() -> type:
    """The class of tensors made under ``FakeTensorMode``
    (``torch._subclasses.fake_tensor.FakeTensor``, private; torch
    2.11.0-2.15.0). A model built inside that mode (``device="cuda"`` on a
    machine without a GPU) holds them as its parameters: stand-ins for plain
    tensors, with shapes, strides and storages of their own, which is all a
    format's move needs."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def storage_ptr(t: torch.Tensor) -> int:
    """What tells ``t``'s storage from another's: its data pointer, or for a
    fake tensor (whose data pointer is 0 for every storage) the address of
    its storage object (``untyped_storage()._cdata``, private; torch
    2.11.0-2.15.0)."""
    st = t.untyped_storage()
    if type(t) is fake_tensor_type():
        return st._cdata
    return st.data_ptr()


def size_hint(s) -> Optional[int]:
    """The value a symbolic size had in the example inputs the graph was
    compiled with (its hint), without a guard; None for a size with no hint
    (one known only at run time: an unbacked size). ``optimization_hint`` from torch 2.13,
    ``size_hint`` before (``torch.fx.experimental.symbolic_shapes``;
    checked on 2.11.0, 2.13.0, 2.15.0)."""
    if isinstance(s, int):
        return s
    from torch.fx.experimental import symbolic_shapes as ss

    fn = getattr(ss, "optimization_hint", None) or getattr(ss, "size_hint", None)
    try:
        # optimization_hint gives an unbacked size (a packed batch's rows)
        # a made-up fallback (8192 on 2.13.0): no size anything was seen at.
        if isinstance(s, torch.SymInt) and ss.free_unbacked_symbols(s):
            return None
        return int(fn(s)) if fn is not None else None
    except Exception:  # noqa: BLE001 - an unbacked size has no hint
        return None


def run_time_size(min: int = 0):
    """A size known only when the op runs (an unbacked symbol), inside a
    fake implementation: ``torch.library.get_ctx().new_dynamic_size()``
    without its gate. That gate (``ShapeEnv.allow_dynamic_output_shape_ops``,
    off unless ``capture_dynamic_output_shape_ops``; torch 2.13.0) keeps
    ATen's data-dependent ops (``nonzero``...) out of graphs; wfpass's
    packed-sequence ops are made for such sizes, so they make theirs
    whatever the gate says. ``torch._library.fake_impl.allocate_size`` and
    the context's ``_shape_env`` are private (checked on 2.11.0-2.15.0)."""
    from torch._library.fake_impl import allocate_size

    ctx = torch.library.get_ctx()
    env = getattr(ctx, "_shape_env", None)
    if env is None:
        return ctx.new_dynamic_size(min=min)  # raises as torch.library does: no shape environment
    return allocate_size(env, min)


def size_product_reader(dims, inputs):
    """The product of ``dims`` (ints and symbolic sizes of a graph) as a
    function of that graph's call arguments, ``inputs`` being Dynamo's
    examples of them: e.g. ``def read(a): s0 = a[0]; return s0`` where the
    first input is the symbol ``s0`` (Dynamo passes the symbols of its
    inputs' sizes as ints), else a tensor input's size with that symbol.
    None where a symbol is bound by no input (an unbacked size) or there is
    none. A symbolic size's expression (``SymInt.node.expr``) and
    ``torch.utils._sympy.printers.PythonPrinter`` (Inductor's printer for
    its wrapper's Python) are private (torch 2.13.0)."""
    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    expr = sympy.Integer(1)
    for d in dims:
        expr = expr * (d.node.expr if isinstance(d, torch.SymInt) else int(d))
    where = {}
    for i, a in enumerate(inputs):  # a symbol the graph takes as an int first
        if isinstance(a, torch.SymInt) and isinstance(a.node.expr, sympy.Symbol):
            where.setdefault(a.node.expr, f"a[{i}]")
    for i, a in enumerate(inputs):
        if isinstance(a, torch.Tensor):
            for j, d in enumerate(a.shape):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    where.setdefault(d.node.expr, f"a[{i}].shape[{j}]")
    symbols = sorted(expr.free_symbols, key=str)
    if not symbols or any(s not in where for s in symbols):
        return None
    src = ("def read(a):\n" + "".join(f"    {s} = {where[s]}\n" for s in symbols)
           + f"    return {PythonPrinter().doprint(expr)}\n")
    ns: dict = {}
    exec(compile(src, "<wfpass: a product of symbolic sizes>", "exec"), ns)
    return ns["read"]


def tell_compiler(condition) -> None:
    """``torch._check``: a fact about symbolic sizes the compiler may use (and
    checks when the graph runs). Documented, but named as private (torch
    2.11-2.15)."""
    torch._check(condition)
