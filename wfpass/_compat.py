"""The only place wfpass touches private PyTorch API. Checked on torch 2.13.0.

Each helper says which private name it needs and what the fallback is, so a
torch upgrade breaks here, loudly, and nowhere else.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

__all__ = ["storage_use_count", "dynamo_source_name", "qualified_name_from_source", "current_fake_mode"]


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


def dynamo_source_name(node: torch.fx.Node) -> Optional[str]:
    """Dynamo records where a placeholder came from in ``node.meta['grapharg']``
    (``GraphArg.source``, private; torch 2.13.0), e.g.
    ``L['self']._modules['q']._parameters['weight']``."""
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return None
    try:
        return src.name() if callable(getattr(src, "name", None)) else str(src.name)
    except Exception:  # pragma: no cover
        return None


_PART = re.compile(r"\.(?:_modules|_parameters|_buffers)\[['\"]([^'\"]+)['\"]\]|\.(\w+)|\[(\d+)\]")


def qualified_name_from_source(source: str) -> Optional[str]:
    """``L['self']._modules['enc']._modules['0']._parameters['weight']`` -> ``enc.0.weight``.

    Returns None for sources that are not attributes of a module (plain inputs).
    """
    if "_parameters[" not in source and "_buffers[" not in source:
        return None
    head = source.find("]")  # drop the L['self'] / L['model'] root
    parts = [a or b or c for a, b, c in _PART.findall(source[head + 1 :])]
    parts = [p for p in parts if p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts) if parts else None


def current_fake_mode():
    """The fake mode of the Dynamo trace being compiled, if any (torch._guards, torch 2.13.0)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    return None if ctx is None else ctx.fake_mode


def mark_lifted_input(placeholder: torch.fx.Node, like: Optional[torch.fx.Node] = None) -> None:
    """AOTAutograd asserts every placeholder of a Dynamo graph has a
    ``_dynamo_source`` attribute (torch/_functorch/_aot_autograd/frontend_utils.py,
    torch 2.13.0). ``None`` is the value DDPOptimizer uses for inputs that did
    not come from user code, which is what a hoisted prologue value is."""
    placeholder._dynamo_source = None  # type: ignore[attr-defined]


def clone_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's GraphModule that the passes may rewrite.

    Dynamo reads its own graph again after the backend returns (it iterates
    the placeholders' ``meta['grapharg']``), so rewriting it in place breaks
    Dynamo. The copy must keep what AOTAutograd reads from Dynamo graphs
    (torch 2.13.0): ``gm.meta`` (``dynamo_compile_id``), the
    ``_param_name_to_source`` attribute and each placeholder's
    ``_dynamo_source``."""
    graph = torch.fx.Graph()
    env = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = torch.fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm


def weak_id_key_dict():
    """A dict with weak, identity-compared tensor keys (``torch.utils.weak.
    WeakIdKeyDictionary``, undocumented; torch 2.13.0). ``weakref.
    WeakKeyDictionary`` cannot hold tensors: its lookups compare keys with
    ``==``, which is elementwise for tensors and raises "Boolean value of
    Tensor with more than one value is ambiguous"."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()
