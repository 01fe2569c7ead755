"""AOTAutograd and Inductor private API (torch 2.13.0): how a new tensor is
fakified, real tensors inside a fake implementation, the compile caches,
Inductor's compiler entry point. Imports nothing from wfpass."""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional

import torch


#: Custom ops with an autograd formula -> the same op without one, for
#: the graphs AOTAutograd has already differentiated (filled by the formats
#: that define such ops: ``register_twin``).
_TWINS: Dict[Any, Any] = {}


def register_twin(op, twin) -> None:
    """``twin``: ``op`` with the same schema, kernel and fake, and no
    autograd kernel. torch.library's autograd kernel is Python and runs on
    every call, grad mode on or off: ~30 us per call measured for the RNN
    layer ops (torch 2.13.0), spent for nothing in a forward graph that
    AOTAutograd runs under ``no_grad``."""
    _TWINS[op] = twin


def use_twins(gm: torch.fx.GraphModule) -> int:
    """Point every call of a registered op in ``gm`` (a forward or backward
    graph AOTAutograd made) at its twin; returns how many."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _TWINS:
            node.target = _TWINS[node.target]
            n += 1
    if n:
        gm.recompile()
    return n


def inductor_compile_fx(config_patches: Optional[Dict[str, Any]] = None):
    """Inductor's compiler function (``torch._inductor.compile_fx.compile_fx``,
    private module; torch 2.11.0-2.15.0), with ``use_twins`` run on every graph
    AOTAutograd hands Inductor (``inner_compile``, which compile_fx also
    uses for the backward graph it compiles later, at the first backward),
    and Inductor's settings for this compile (``config_patches``: what
    ``torch.compile``'s mode/options ask for, as its Inductor entry passes
    them)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(gm, example_inputs, **kwargs):
        use_twins(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    if config_patches:
        return functools.partial(compile_fx, inner_compile=inner_compile, config_patches=dict(config_patches))
    return functools.partial(compile_fx, inner_compile=inner_compile)


def cacheable(functions: Dict[str, str]):
    """A context in which AOTAutograd's and Inductor's caches accept graphs
    that call ``functions`` (``"module.name"`` -> a key): without it a
    graph calling a Python function (``wfpass.linear.kernel.fused_linear``)
    is refused by AOTAutograd's cache ("Bypassing autograd cache due to:
    Unsupported call_function target"), so every process traces it again:
    seconds of compile and, measured on the bench decoder, about 12 MB of
    the process's memory that stays. The key (here: a hash of wfpass's
    source) goes into the caches' keys through Inductor's config, so a
    changed wfpass never reads an old entry. The graph's own arguments
    (the fused layout, the row limit) are in the key already.
    ``torch._inductor.config.unsafe_marked_cacheable_functions``: private,
    torch 2.11.0-2.15.0."""
    import torch._inductor.config as inductor_config

    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    marked.update(functions)
    return inductor_config.patch(unsafe_marked_cacheable_functions=marked)


def inductor_modes() -> Dict[str, Dict[str, Any]]:
    """``torch.compile``'s modes and the Inductor settings each sets
    (``torch._inductor.list_mode_options``, named in ``torch.compile``'s
    docstring; torch 2.11.0-2.15.0)."""
    import torch._inductor as inductor

    return {mode: dict(inductor.list_mode_options(mode)) for mode in inductor.list_mode_options()}


def disable_compile_caches() -> None:
    """Turn off Inductor's FX-graph cache and AOTAutograd's cache
    (``torch._inductor.config.fx_graph_cache``,
    ``torch._functorch.config.enable_autograd_cache``; private, torch 2.13.0),
    so a benchmark's first-call times are cold compiles."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def stop_compile_workers() -> None:
    """Stop Inductor's pool of compile worker processes
    (``torch._inductor.async_compile.shutdown_compile_workers``, private;
    torch 2.13.0), which a cold compile starts and which stays alive after
    it: benchmarks call this before timing, so idle or busy workers do not
    share the machine with the timed code."""
    from torch._inductor import async_compile

    fn = getattr(async_compile, "shutdown_compile_workers", None)
    if fn is not None:
        fn()


def outside_fake_mode():
    """A context in which tensors are real even while a fake implementation
    runs (``torch._subclasses.fake_tensor.unset_fake_temporarily``, private;
    torch 2.13.0). ``wfpass.rnn.cpu.lstm_layer.workspace_numel`` measures oneDNN's workspace
    size on real zeros from inside ``wfpass::lstm_layer``'s fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def static_example(alias: torch.Tensor, name: str, like: Optional[torch.Tensor] = None) -> None:
    """Tell AOTAutograd how to fakify ``alias``, a new tensor the backend
    hands the inner compiler in place of a graph input (a parameter moved
    into a block, a BatchNorm tensor cast to fp32).

    Why it matters: a tensor Dynamo never saw, with no context, is fakified
    with fresh duck-sized symbols that no graph input binds. A guard on such
    a symbol cannot be built (``AssertionError: sources must not be empty for
    symbol s..`` in ``produce_guards``), and duck sizing can silently tie it
    to an input's symbol of the same value (the batch size equal to a channel
    count), specialising that input or breaking Inductor's indexing
    (``TypeError: Cannot convert expression to float`` under
    ``dynamic=True``, measured). So:

    * ``like`` given (the tensor ``alias`` stands for), with the same sizes,
      strides and offset, and Dynamo fakified it with a context (a buffer
      whose size Dynamo made dynamic): reuse that context, so the new fake
      has exactly the input's symbols, bound by the input's own source;
    * otherwise static sizes, strides and storage offset, as Dynamo treats
      parameters (a moved member's offset changed, so the cached symbols of
      the old tensor would be stale).

    The context goes into ``TracingContext.tensor_to_context``, which
    AOTAutograd's ``process_inputs`` reads
    (torch/_functorch/_aot_autograd/frontend_utils.py;
    ``StatefulSymbolicContext``, ``DimDynamic`` and ``ConstantSource`` are
    private; torch 2.13.0)."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    if tc is None or not hasattr(tc, "tensor_to_context"):
        return
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatefulSymbolicContext

    if like is not None and like.shape == alias.shape and like.stride() == alias.stride() and (
            like.storage_offset() == alias.storage_offset()):
        ctx = tc.tensor_to_context.get(like)
        if isinstance(ctx, StatefulSymbolicContext):
            tc.tensor_to_context[alias] = ctx
            return
    d = alias.dim()
    tc.tensor_to_context[alias] = StatefulSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC] * d, dynamic_strides=[DimDynamic.INFER_STRIDE] * d,
        constraint_sizes=[None] * d, constraint_strides=[None] * d,
        tensor_source=ConstantSource(f"wfpass_block_member_{name}"), shape_env_to_source_to_symbol_cache={},
    )
