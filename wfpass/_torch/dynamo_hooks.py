"""Two Dynamo config values that call back into wfpass while Dynamo traces
(torch 2.13.0; checked on 2.11.0-2.15.0 by the suites).

This layer imports nothing from wfpass. Where Dynamo must ask wfpass a
question while it traces (may this RNN be put into the graph? which
BatchNorm is about to graph-break?), wfpass installs a function here
(``install_rnn_capture`` / ``install_item_break_probe``, called by
``wfpass.capture``) and the value Dynamo reads calls it.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple

import torch

from .dynamo import compiler_fn_of, current_tx

# -- RNN capture ----------------------------------------------------------------

#: The function wfpass installed to decide RNN capture (``install_rnn_capture``):
#: called as ``policy(compiler_fn, module, source_name)`` -> bool.
_RNN_POLICY: list = [None]


class _StandIn(int):
    """A Dynamo config value that stands in for a bool (an ``int``, so torch
    versions that ``json.dumps`` the config can serialise it) and asks a
    question when Dynamo tests its truth. ``repr`` / ``to_jsonable`` keep
    Dynamo's config hashing, logging and repro scripts seeing the bool."""

    VALUE = False

    def __new__(cls):
        return super().__new__(cls, int(cls.VALUE))

    def __repr__(self) -> str:
        return repr(self.VALUE)

    def to_jsonable(self) -> bool:
        return self.VALUE

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return self


class _FalseStandIn(_StandIn):
    VALUE = False


class _TrueStandIn(_StandIn):
    VALUE = True


class _AllowRnnUnderWformat(_FalseStandIn):
    """Stands in for ``torch._dynamo.config.allow_rnn = False``: falsy except
    where the installed policy says yes (wfpass: while Dynamo traces a frame
    for a wformat backend that runs ``fuse_rnn``).

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
        policy = _RNN_POLICY[0]
        tx = current_tx()
        if policy is None or tx is None:
            return False
        try:
            module, name = _rnn_being_wrapped()
            return bool(policy(compiler_fn_of(tx), module, name))
        except Exception:  # never break a trace over this
            return False



class _AllowRnnTrue(_TrueStandIn):
    """Stands in for a user's own ``torch._dynamo.config.allow_rnn = True``:
    true for every backend, as the user asked, and while Dynamo wraps an RNN
    it asks the installed policy too, for what wfpass does to the RNNs of a
    wformat trace (names its errors, lets its PackedSequence calls into the
    graph, files its report row). A plain ``True`` would skip that: a packed
    RNN would graph-break inside ``forward`` and run eagerly, unreported."""

    def __bool__(self) -> bool:
        policy = _RNN_POLICY[0]
        if policy is not None and current_tx() is not None:
            try:
                module, name = _rnn_being_wrapped()
                if module is not None:
                    policy(compiler_fn_of(current_tx()), module, name)
            except Exception:  # never break a trace over this
                pass
        return True


def _rnn_being_wrapped() -> Tuple[Optional[torch.nn.Module], str]:
    """The RNN that Dynamo is wrapping right now and the name of its source.
    They are the locals ``value`` and ``self.source`` of
    ``VariableBuilder.wrap_module`` (torch/_dynamo/variables/builder.py,
    torch 2.13.0), the frame that asks ``not config.allow_rnn``. Anything
    unexpected: ``(None, "")``."""
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
        return module, name if isinstance(name, str) else ""
    except Exception:  # never break a trace over this
        return None, ""


def refresh_flat_weight_refs(module: torch.nn.RNNBase) -> None:
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



def install_rnn_capture(policy: Callable) -> None:
    """Let Dynamo put ``nn.RNN/GRU/LSTM`` into the graph where
    ``policy(compiler_fn, module, source_name)`` says so (see
    ``_AllowRnnUnderWformat``). A user's own ``allow_rnn = True`` is left
    alone; every other backend still graph-breaks on RNNs."""
    _RNN_POLICY[0] = policy
    ensure_rnn_capture()


def ensure_rnn_capture() -> bool:
    """Put the stand-in back where ``allow_rnn`` holds a plain ``bool``
    (the user set it after importing wfpass), keeping its truth: ``False``
    becomes ``_AllowRnnUnderWformat``, ``True`` ``_AllowRnnTrue``. Called
    when the policy is installed and whenever a wformat backend compiles, so
    a value set later holds from the next trace on. True where it replaced
    a plain ``True``: the trace that just ran wrapped RNNs unasked."""
    import torch._dynamo.config as dynamo_config

    if _RNN_POLICY[0] is None:
        return False
    value = dynamo_config.allow_rnn
    if value is False:
        dynamo_config.allow_rnn = _AllowRnnUnderWformat()
    elif value is True:
        dynamo_config.allow_rnn = _AllowRnnTrue()
        return True
    return False


# -- BatchNorm(momentum=None): tell the user which module stopped the compile --

#: Called as ``hook(module, source_name, compiler_fn)`` (``install_item_break_probe``).
_ITEM_BREAK_HOOK: list = [None]


class _ItemBreakProbe(_FalseStandIn):
    """Stands in for ``torch._dynamo.config.capture_scalar_outputs = False``
    and stays falsy: Dynamo behaves exactly as before. What it adds: when
    Dynamo is about to graph-break on ``Tensor.item()`` (``float(t)``) inside
    a BatchNorm's ``forward`` (``momentum=None`` in training reads
    ``float(self.num_batches_tracked)``), it calls the installed hook with
    the module (wfpass then tells the user which module it is). In an
    ``nn.Sequential`` that break makes Dynamo run the whole model eagerly and
    call no backend at all, so without this the user sees "nothing compiled
    yet".

    Dynamo reads the flag in ``TensorVariable.method_item(self, tx, ...)``
    (torch/_dynamo/variables/tensor.py, torch 2.13.0): the caller's ``tx`` is
    the translator of the frame being traced, whose ``symbolic_locals['self']``
    holds the module and its source (private). Setting the flag to ``True``
    instead does not help: the break moves to ``F.batch_norm``, which does not
    take a traced float momentum."""

    def __bool__(self) -> bool:
        try:
            hook = _ITEM_BREAK_HOOK[0]
            frame = sys._getframe(1)
            if hook is not None and frame.f_code.co_name == "method_item":
                tx = frame.f_locals.get("tx")
                var = getattr(tx, "symbolic_locals", {}).get("self")
                module = getattr(var, "value", None)
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                    src = getattr(var, "source", None)
                    name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")
                    hook(module, name if isinstance(name, str) else "", compiler_fn_of(current_tx()))
        except Exception:  # never break a trace over this
            pass
        return False



def install_item_break_probe(hook: Callable) -> None:
    """See ``_ItemBreakProbe``; a user's own ``capture_scalar_outputs = True`` is left alone."""
    import torch._dynamo.config as dynamo_config

    _ITEM_BREAK_HOOK[0] = hook
    if dynamo_config.capture_scalar_outputs is False:
        dynamo_config.capture_scalar_outputs = _ItemBreakProbe()


# -- Variable-length batches: pack_padded_sequence / pad_packed_sequence ------------------------

#: ``policy(compiler_fn) -> bool``: may this trace put packed RNNs into the graph?
_PACKED_POLICY: list = [None]


def packed_capture_wanted() -> bool:
    """True while Dynamo traces a frame for a backend whose policy (installed
    by ``install_packed_capture``) lets packed sequences into the graph;
    False in eager code. Dynamo does not trace this function: it is
    registered with ``substitute_in_graph(can_constant_fold_through=True)``
    and takes no argument, so Dynamo calls it while tracing and puts its
    answer into the trace as a constant (the frame's guards include the
    backend, torch 2.13.0)."""
    policy = _PACKED_POLICY[0]
    tx = current_tx()
    if policy is None or tx is None:
        return False
    try:
        return bool(policy(compiler_fn_of(tx)))
    except Exception:  # never break a trace over this
        return False


def _packed_capture_wanted_traced() -> bool:  # pragma: no cover - Dynamo constant-folds the original instead
    return False


def install_packed_capture(policy: Callable) -> None:
    """Decide, per trace, whether packed sequences go into the graph."""
    _PACKED_POLICY[0] = policy


_PACKED_INSTALLED: list = [False]


def install_packed_functions(pack_padded_sequence: Callable, pad_packed_sequence: Callable) -> None:
    """Have Dynamo trace ``pack_padded_sequence`` / ``pad_packed_sequence``
    as the given functions (same signatures) instead of graph-breaking on
    them. Dynamo lists both as skipped functions
    (``trace_rules.manual_torch_name_rule_map``: pytorch#93501, #162374,
    torch 2.11.0-2.15.0), so their rules are dropped first; the
    replacements graph-break themselves for backends that did not ask
    (``packed_capture_wanted``), which is the behaviour the skip gave."""
    if _PACKED_INSTALLED[0]:
        return
    import torch._dynamo.trace_rules as trace_rules
    import torch.nn.utils.rnn as rnn_utils

    originals = (rnn_utils.pack_padded_sequence, rnn_utils.pad_packed_sequence)
    for name in ("torch.nn.utils.rnn.pack_padded_sequence", "torch.nn.utils.rnn.pad_packed_sequence"):
        trace_rules.manual_torch_name_rule_map.pop(name, None)
    rules = trace_rules.get_torch_obj_rule_map()
    for fn in originals:
        rules.pop(fn, None)
    substitute = torch._dynamo.substitute_in_graph
    substitute(packed_capture_wanted, can_constant_fold_through=True)(_packed_capture_wanted_traced)
    substitute(originals[0])(pack_padded_sequence)
    substitute(originals[1])(pad_packed_sequence)
    _PACKED_INSTALLED[0] = True


def graph_break(msg: str) -> None:
    """A graph break with ``msg`` as its reason where Dynamo traces this
    (``torch._dynamo.graph_break``; no ``torch.compiler`` name for it up to
    2.15.0); nothing in eager code."""
    torch._dynamo.graph_break(msg=msg)
