"""The only place wfpass touches private PyTorch API. Checked on torch 2.13.0.

Each helper says which private name it needs and what the fallback is, so a
torch upgrade breaks here, loudly, and nowhere else.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

import torch

__all__ = ["storage_use_count", "dynamo_source_name", "qualified_name_from_source"]


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


_ROOT = re.compile(r"^([LG])\[['\"]([^'\"]+)['\"]\]")


def source_root(source: str):
    """The object a Dynamo source starts from: ``L['self']`` -> the frame's
    local ``self`` (the module being compiled), ``G['model']`` -> a global.
    Read from ``InstructionTranslator.current_tx()``'s ``f_locals`` /
    ``f_globals`` (private; torch 2.13.0), set while the backend runs; None
    anywhere else or when the source has another form."""
    m = _ROOT.match(source or "")
    if m is None:
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return None
    if tx is None:
        return None
    scope = getattr(tx, "f_locals", None) if m.group(1) == "L" else getattr(tx, "f_globals", None)
    return (scope or {}).get(m.group(2))


def source_root_key(source: str) -> Optional[str]:
    """``L['self']`` of ``L['self']._modules['q']._parameters['weight']``."""
    m = _ROOT.match(source or "")
    return m.group(0) if m else None


def traced_frame_modules() -> list:
    """The ``nn.Module`` objects the frame Dynamo is compiling can reach: its
    locals (``self`` of a ``forward``), the globals its code names and the
    module whose call runs it. For
    modules Dynamo did not put into the graph (a graph break runs them
    eagerly). ``InstructionTranslator.current_tx()`` and its ``f_locals`` /
    ``f_globals`` / ``f_code`` (private; torch 2.13.0) are set while the
    backend runs; anywhere else this returns ``[]``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return []
    if tx is None:
        return []
    found, seen = [], set()
    values = list(getattr(tx, "f_locals", {}).values())
    # A resume function (the rest of a frame after a graph break) holds only
    # stack values; the module whose forward it continues is the ``self`` of
    # the nearest ``nn.Module._call_impl`` on the Python stack
    # (torch/nn/modules/module.py, torch 2.13.0), which also holds for a
    # first compile: Dynamo compiles ``forward`` as ``_call_impl`` calls it.
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            values.append(frame.f_locals["self"])
            break
        frame = frame.f_back
    del frame
    f_globals = getattr(tx, "f_globals", {}) or {}
    values += [f_globals[n] for n in getattr(getattr(tx, "f_code", None), "co_names", ()) if n in f_globals]
    for v in values:
        if isinstance(v, torch.nn.Module) and id(v) not in seen:
            seen.add(id(v))
            found.append(v)
    return found


def compile_origin() -> tuple:
    """((compile context, attempt), does this compile continue a call already under way?) of
    the Dynamo compile in progress, so ``last_report`` can hold every graph of
    one model call. DDPOptimizer compiles several subgraphs under one compile
    id. A graph break runs part of a frame eagerly: Dynamo then compiles
    nested frames it calls and a resume function for the rest, each while the
    user's frame is executing. A first compile of a call has only
    ``nn.Module`` call plumbing between Dynamo's ``compile_wrapper``
    (torch/_dynamo/eval_frame.py) and its frame callback
    (torch/_dynamo/convert_frame.py); a continuation has the user's code
    there. (Those file and function names, and ``CompileContext.
    current_compile_id``, are private; torch 2.13.0.) Third: the call's
    tensor arguments, to check that a continuation belongs to the same call
    as the graphs before it. ``(None, False, ())`` outside Dynamo."""
    import sys

    try:
        from torch._guards import CompileContext

        # The context object, not its id string: ids restart at "0/0" after
        # torch._dynamo.reset(). The caller keeps it, so it cannot be reused.
        cid = CompileContext.try_get()
    except Exception:
        return None, False, ()
    frame, seen_callback, continues, call = sys._getframe(1), False, False, ()
    while frame is not None:
        fname = frame.f_code.co_filename.replace("\\", "/")
        if fname.endswith("torch/_dynamo/convert_frame.py"):
            seen_callback, continues = True, False
        elif seen_callback:
            if fname.endswith("torch/_dynamo/eval_frame.py") and frame.f_code.co_name == "compile_wrapper":
                # The call's tensor arguments tell two calls apart (frame
                # objects are not weak-referenceable and their ids are reused).
                args = frame.f_locals.get("args") or ()
                call = tuple(a for a in args if isinstance(a, torch.Tensor))
                break
            if not fname.endswith("torch/nn/modules/module.py"):
                continues = True
        frame = frame.f_back
    else:
        continues = False  # no compile_wrapper: not a torch.compile call we can place
    del frame
    # A restarted analysis (attempt + 1) compiles the same graph again: a new
    # report, not a second graph of the call.
    return ((cid, getattr(cid, "attempt", None)) if cid is not None else None), continues, call


def fsdp2_modules() -> list:
    """Live modules ``fully_shard`` (FSDP2) manages: the ``FSDPModule``
    instances in torch.distributed's registry of composable-API module states
    (``torch.distributed._composable_state._module_state_mapping``, a private
    WeakKeyDictionary; torch 2.13.0). Read only if torch.distributed's FSDP is
    already imported (no FSDP2 module can exist otherwise); ``[]`` where the
    registry is missing or changed shape."""
    import sys

    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    mapping = getattr(sys.modules.get("torch.distributed._composable_state"), "_module_state_mapping", None)
    if fsdp_module is None or not mapping:
        return []
    try:
        return [m for m in list(mapping.keys()) if isinstance(m, fsdp_module)]
    except Exception:  # pragma: no cover - the registry changed shape
        return []


def ddp_tensors() -> set:
    """``id``s of the Parameters and buffers of the DistributedDataParallel
    whose forward is running now (Dynamo compiles a DDP model's graphs inside
    it): ``DistributedDataParallel._get_active_ddp_module()``, private, the
    same call Dynamo's DDPOptimizer makes (torch/_dynamo/convert_frame.py;
    torch 2.13.0). Empty outside a DDP forward.

    Why a format must not change their dtype: DDP's reducer hooked each
    Parameter's gradient accumulator when it was built, and autograd replaces
    a Parameter's accumulator when ``param.data`` changes type, so the hook
    would never fire again (DDP then raises "Expected to have finished
    reduction", or with ``find_unused_parameters=True`` silently stops
    all-reducing that gradient); its buffers are broadcast from lists DDP
    also built up front."""
    ddp = active_ddp()
    if ddp is None:
        return set()
    mod = ddp.module
    return {id(t) for t in (*mod.parameters(), *mod.buffers())}


def active_ddp():
    """The DistributedDataParallel whose forward is running now, or None
    (``DistributedDataParallel._get_active_ddp_module()``, private; torch 2.13.0)."""
    import sys

    ddp_cls = getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None)
    get = getattr(ddp_cls, "_get_active_ddp_module", None)
    return get() if get is not None else None


def fsdp2_sharded_of(t: torch.Tensor):
    """The sharded Parameter (a DTensor) that FSDP2 (``fully_shard``)
    all-gathered into ``t``, or None. Dynamo traces the forward between
    FSDP's hooks, where the module holds plain unsharded Parameters; after
    the forward FSDP puts the sharded ones back, and those are what
    ``model.named_parameters()`` shows. Reads each module's
    ``_get_fsdp_state()._fsdp_param_groups[*].fsdp_params[*]`` and their
    ``_unsharded_param`` / ``sharded_param`` (private; torch 2.13.0)."""
    for m in fsdp2_modules():
        try:
            groups = m._get_fsdp_state()._fsdp_param_groups
            for g in groups:
                for fp in g.fsdp_params:
                    if getattr(fp, "_unsharded_param", None) is t:
                        return fp.sharded_param
        except Exception:  # pragma: no cover - FSDP2's internals changed shape
            return None
    return None


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
    # Higher-order ops' bodies (activation checkpointing, wrap) are
    # submodules the new GraphModule shares with Dynamo's: copy them too, so
    # a rewrite inside a body changes neither Dynamo's graph nor the fallback.
    copied = set()
    for node in new_gm.graph.nodes:
        if node.op == "get_attr" and "." not in node.target and node.target not in copied:
            sub = getattr(new_gm, node.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                copied.add(node.target)
                setattr(new_gm, node.target, clone_dynamo_graph(sub))
    return new_gm


def weak_id_key_dict():
    """A dict with weak, identity-compared tensor keys (``torch.utils.weak.
    WeakIdKeyDictionary``, undocumented; torch 2.13.0). ``weakref.
    WeakKeyDictionary`` cannot hold tensors: its lookups compare keys with
    ``==``, which is elementwise for tensors and raises "Boolean value of
    Tensor with more than one value is ambiguous"."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


# -- RNN capture and kernels (fuse_rnn, ops/rnn.py) ---------------------------


class _AllowRnnUnderWformat(int):
    """Stands in for ``torch._dynamo.config.allow_rnn = False``: falsy except
    while Dynamo traces a frame for a wformat backend that runs ``fuse_rnn``.

    Dynamo refuses ``nn.RNN/GRU/LSTM`` with ``if ... and not config.allow_rnn``
    (``VariableBuilder.wrap_module``, torch/_dynamo/variables/builder.py,
    torch 2.13.0), evaluated while tracing. There is no per-backend switch:
    ``torch.compile`` wraps every non-Inductor backend in
    ``_TorchCompileWrapper``, which drops a ``backend_ctx_ctor`` attribute, so
    the truthiness of this value is the narrowest hook. It finds the backend
    of the trace in progress through ``InstructionTranslator.current_tx()
    .output.compiler_fn`` (private). ``repr`` / ``to_jsonable`` keep Dynamo's
    config hashing, logging and repro scripts working: they see ``False``.
    It is an ``int`` (0) so that torch versions that ``json.dumps`` the config
    for their compile metrics (2.11 does) can serialise it too."""

    def __bool__(self) -> bool:
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx()
        except Exception:
            return False
        try:
            wanted = rnn_capture_wanted(getattr(getattr(tx, "output", None), "compiler_fn", None))
        except Exception:  # never break a trace over this
            return False
        if wanted:
            module, path = _name_rnn_being_wrapped()
            if module is not None and not _on_cpu(module):
                # Off the CPU the RNN graph-breaks and runs eagerly, as without
                # wfpass: PyTorch's cuDNN path keeps its own flat weight buffer,
                # and wfpass's ATen lowering of RNNs is checked on the CPU only.
                return False
            if module is not None:
                config = wformat_config(getattr(getattr(tx, "output", None), "compiler_fn", None))
                if config is not None and not config.dry_run:  # explain() files nothing
                    _note_rnn_seen(module, path)
        return wanted

    def __repr__(self) -> str:
        return "False"

    def to_jsonable(self) -> bool:
        return False

    def __reduce__(self):
        return (_AllowRnnUnderWformat, ())

    def __deepcopy__(self, memo):
        return self


def _on_cpu(module: torch.nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters())


def _name_rnn_being_wrapped() -> Tuple[Optional[torch.nn.Module], str]:
    """Give the RNN that Dynamo is wrapping right now errors that name it
    (``fuse_rnn.name_errors``) and fresh flat-weight references
    (``_refresh_flat_weight_refs``). The module and where it came from are the
    locals ``value`` and ``self.source`` of ``VariableBuilder.wrap_module``
    (torch/_dynamo/variables/builder.py, torch 2.13.0), the frame that asks
    ``not config.allow_rnn``. Anything unexpected: leave the module alone."""
    import sys

    try:
        frame = sys._getframe(1)
        for _ in range(4):
            if frame is None or frame.f_code.co_name == "wrap_module":
                break
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != "wrap_module":
            return None, ""
        module = frame.f_locals.get("value")
        source = getattr(frame.f_locals.get("self"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if not isinstance(module, torch.nn.RNNBase):
            return None, ""
        from .passes.fuse_rnn import name_errors

        path = module_name_from_source(name) if isinstance(name, str) else ""
        name_errors(module, path)
        _refresh_flat_weight_refs(module)
        return module, path
    except Exception:  # never break a trace over this
        return None, ""


def _note_rnn_seen(module: torch.nn.RNNBase, path: str) -> None:
    """File a provisional record for an RNN Dynamo is about to inline for a
    wformat backend. If the call reaches a graph, the pass's own record
    replaces it; if it never does (a ``PackedSequence`` input: Dynamo breaks
    on ``pack_padded_sequence`` and again inside ``forward``, and no backend
    is called for that code), ``wfpass.report(model)`` still says so."""
    from .runtime import note_provisional

    names = [f"{path}.{n}" if path else n for n in module._flat_weights_names]
    label = f"'{path}' (nn.{type(module).__name__})" if path else f"nn.{type(module).__name__}"
    note_provisional(
        "rnn", f"{label}: Dynamo did not put this call into a compiled graph (a PackedSequence input, or a graph "
        "break inside the RNN): it runs eagerly, unchanged", names, [getattr(module, n) for n in module._flat_weights_names])


def _refresh_flat_weight_refs(module: torch.nn.RNNBase) -> None:
    """Run, before Dynamo inlines ``forward``, the first thing ``forward``
    does: ``if self._weights_have_changed(): self._init_flat_weights()``
    (torch/nn/modules/rnn.py, torch 2.13.0).

    Why: after ``load_state_dict(assign=True)`` (or any new Parameter object)
    ``_flat_weight_refs`` still holds weak references to the old Parameters.
    Dynamo traces ``ref()`` and guards on its result; when the old Parameter
    is freed between the trace and the building of the guards, Dynamo fails
    with ``InternalTorchDynamoError: TypeError: _dispatch_keys(): incompatible
    function arguments ... Invoked with: None`` (reproduced with plain
    ``allow_rnn=True`` and the eager backend, without wfpass: a torch bug,
    intermittent because it depends on when the old object dies; Dynamo
    traces weakref calls since pytorch/pytorch#125720). Refreshed
    here, the references point at the module's live Parameters."""
    if module._weights_have_changed():
        module._init_flat_weights()


def module_name_from_source(source: str) -> str:
    """``L['self']._modules['enc']._modules['0']`` -> ``enc.0``; ``""`` for
    the root object itself (``L['rnn']``)."""
    head = source.find("]")
    parts = [a or b or c for a, b, c in _PART.findall(source[head + 1 :])]
    return ".".join(p for p in parts if p not in ("_modules", "_parameters", "_buffers"))


def rnn_capture_wanted(compiler_fn) -> bool:
    """Is ``compiler_fn`` (as Dynamo holds it: ``WrapBackendDebug`` around
    ``_TorchCompileWrapper`` around ours, torch 2.13.0) a wformat backend whose
    config runs ``fuse_rnn``? Backends built by ``wfpass.backend(...)`` carry
    their ``Config`` as ``.config`` (kept by ``functools.wraps`` wrappers)."""
    import importlib

    from .config import Config

    _backend = importlib.import_module("wfpass.backend")  # the module; ``wfpass.backend`` the attribute is a function
    fn = compiler_fn
    for _ in range(8):
        if fn is None:
            return False
        cfg = getattr(fn, "config", None)
        if isinstance(cfg, Config):
            return cfg.runs("fuse_rnn")
        if fn is _backend.wformat:
            return _backend._DEFAULT.runs("fuse_rnn")
        fn = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "__wrapped__", None)
            # DistributedDataParallel: Dynamo compiles through the bound method
            # DDPOptimizer.compile_fn, whose object holds our backend as
            # ``backend_compile_fn`` (torch/_dynamo/backends/distributed.py, 2.13.0).
            or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
            # A plain function wrapping a wformat backend (``wfpass.explain``'s
            # collector): the backend it closes over.
            or _closed_over_backend(fn)
        )
    return False


def _closed_over_backend(fn):
    from .config import Config

    for cell in getattr(fn, "__closure__", None) or ():
        try:
            c = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(c) and isinstance(getattr(c, "config", None), Config):
            return c
    return None


def install_rnn_capture() -> None:
    """Let Dynamo put ``nn.RNN/GRU/LSTM`` into the graph for wformat backends
    only (see ``_AllowRnnUnderWformat``). A user's own ``allow_rnn = True``
    is left alone; every other backend still graph-breaks on RNNs."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.allow_rnn is False:
        dynamo_config.allow_rnn = _AllowRnnUnderWformat()


class mkldnn_disabled:
    """Run a CPU RNN call on ATen's native kernel instead of oneDNN's
    (``torch._C._get_mkldnn_enabled`` / ``_set_mkldnn_enabled``, private;
    torch 2.13.0; ``torch.backends.mkldnn.flags`` also resets TF32 settings
    and warns). The flag is process-global: another thread's CPU RNN call
    during the window also takes the native kernel, which only costs speed."""

    def __enter__(self):
        self._prev = torch._C._get_mkldnn_enabled()
        if self._prev:
            torch._C._set_mkldnn_enabled(False)
        return self

    def __exit__(self, *exc):
        if self._prev:
            torch._C._set_mkldnn_enabled(True)
        return False


_RNN_KERNELS: dict = {}


def rnn_kernel(mode: str):
    """The fused multi-layer RNN entry point for ``mode`` (``torch._VF.lstm``
    etc., private module; torch 2.13.0). On CPU it dispatches to oneDNN
    (LSTM) or ATen's native loop; on CUDA to cuDNN."""
    fn = _RNN_KERNELS.get(mode)
    if fn is None:
        from torch import _VF

        fn = _RNN_KERNELS[mode] = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}[mode]
    return fn


#: Read / set ATen's oneDNN switch without a context-manager object, for the
#: per-call hot path (same private functions as ``mkldnn_disabled``).
get_mkldnn_enabled = torch._C._get_mkldnn_enabled
set_mkldnn_enabled = torch._C._set_mkldnn_enabled


_CUDNN_MODES = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}


def cudnn_flat_layout(weights, weights_per_layer: int, input_size: int, mode: str, hidden_size: int,
                      proj_size: int, num_layers: int, batch_first: bool, bidirectional: bool):
    """Element offsets of each weight inside cuDNN's flat weight buffer and
    the buffer's size, or None where cuDNN cannot take these weights.

    ``torch._cudnn_rnn_flatten_weight`` (private; torch 2.13.0) builds the
    buffer in the layout of the installed cuDNN and ``set_``s its inputs to
    views of it; it runs on clones so the model is not touched, and
    ``storage.fuse`` then moves the real parameters to the same offsets."""
    if not weights or not weights[0].is_cuda or not torch.backends.cudnn.is_acceptable(weights[0]):
        return None
    if not torch._use_cudnn_rnn_flatten_weight():
        return None
    with torch.no_grad():
        clones = [w.detach().clone() for w in weights]
        buf = torch._cudnn_rnn_flatten_weight(
            clones, weights_per_layer, input_size, _CUDNN_MODES[mode], hidden_size, proj_size,
            num_layers, batch_first, bidirectional,
        )
    ptr = buf.untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != ptr for c in clones):
        return None
    base = buf.storage_offset()
    return [c.storage_offset() - base for c in clones], buf.numel()


def mkldnn_rnn_dtype(dtype: torch.dtype) -> bool:
    """Does ATen send a CPU LSTM of this dtype to oneDNN? float32 always (when
    oneDNN is built in); bf16/fp16 only on CPUs with the instructions
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_fp16_``, private;
    torch 2.13.0)."""
    if not torch.backends.mkldnn.is_available() or not torch._C._get_mkldnn_enabled():
        return False
    if dtype == torch.float32:
        return True
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return False


def disable_compile_caches() -> None:
    """Turn off Inductor's FX-graph cache and AOTAutograd's cache
    (``torch._inductor.config.fx_graph_cache``,
    ``torch._functorch.config.enable_autograd_cache``; private, torch 2.13.0),
    so a benchmark's first-call times are cold compiles."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def outside_fake_mode():
    """A context in which tensors are real even while a fake implementation
    runs (``torch._subclasses.fake_tensor.unset_fake_temporarily``, private;
    torch 2.13.0). ``ops/rnn.workspace_numel`` measures oneDNN's workspace
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


# -- BatchNorm(momentum=None): tell the user which module stopped the compile --


class _ItemBreakProbe(int):
    """Stands in for ``torch._dynamo.config.capture_scalar_outputs = False``
    and stays falsy: Dynamo behaves exactly as before. What it adds: when
    Dynamo is about to graph-break on ``Tensor.item()`` (``float(t)``) for a
    wformat backend, inside a BatchNorm's ``forward`` (``momentum=None`` in
    training reads ``float(self.num_batches_tracked)``), it tells wfpass which
    module it is (``fp32_batchnorm.note_item_break``). In an ``nn.Sequential``
    that break makes Dynamo run the whole model eagerly and call no backend
    at all, so without this the user sees "nothing compiled yet".

    Dynamo reads the flag in ``TensorVariable.method_item(self, tx, ...)``
    (torch/_dynamo/variables/tensor.py, torch 2.13.0): the caller's ``tx`` is
    the translator of the frame being traced, whose ``symbolic_locals['self']``
    holds the module and its source (private). Setting the flag to ``True``
    instead does not help: the break moves to ``F.batch_norm``, which does not
    take a traced float momentum."""

    def __bool__(self) -> bool:
        try:
            import sys

            frame = sys._getframe(1)
            if frame.f_code.co_name == "method_item":
                tx = frame.f_locals.get("tx")
                var = getattr(tx, "symbolic_locals", {}).get("self")
                module = getattr(var, "value", None)
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                    root = InstructionTranslator_current()
                    config = wformat_config(getattr(getattr(root, "output", None), "compiler_fn", None))
                    if config is not None:
                        src = getattr(var, "source", None)
                        name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")
                        from .passes.fp32_batchnorm import note_item_break

                        note_item_break(module, module_name_from_source(name) if isinstance(name, str) else "", config)
        except Exception:  # never break a trace over this
            pass
        return False

    def __repr__(self) -> str:
        return "False"

    def to_jsonable(self) -> bool:
        return False

    def __reduce__(self):
        return (_ItemBreakProbe, ())

    def __deepcopy__(self, memo):
        return self


def InstructionTranslator_current():
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


def wformat_config(compiler_fn):
    """The ``Config`` of the wformat backend ``compiler_fn`` is (through
    Dynamo's wrappers, as ``rnn_capture_wanted`` finds it), or None."""
    import importlib

    from .config import Config

    _backend = importlib.import_module("wfpass.backend")
    fn = compiler_fn
    for _ in range(8):
        if fn is None:
            return None
        cfg = getattr(fn, "config", None)
        if isinstance(cfg, Config):
            return cfg
        if fn is _backend.wformat:
            return _backend._DEFAULT
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "__wrapped__", None)
              or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
              or _closed_over_backend(fn))
    return None


def install_item_break_probe() -> None:
    """See ``_ItemBreakProbe``; a user's own ``capture_scalar_outputs = True`` is left alone."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.capture_scalar_outputs is False:
        dynamo_config.capture_scalar_outputs = _ItemBreakProbe()
