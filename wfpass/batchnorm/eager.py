"""The fp32_batchnorm format for BatchNorms Dynamo runs eagerly, outside
every graph (``momentum=None`` in training), and the note that tells the
user which BatchNorm stopped a compile. See "BatchNorms Dynamo runs eagerly"
in ``wfpass/batchnorm/fp32_format.py``: its format yields ``eager_batchnorms``'
matches (``EagerBatchNorm``) after the graph's own and hands them to
``eager_guard`` and ``eager_apply``."""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Dict, Iterator, Optional

import torch

from .._torch import distributed as _distributed, dynamo as _dynamo
from ..core.graph import PassContext
from ..pipeline import Match
from ..core.records import Record as _Record
from ..core.history import note_uncompiled
from ..core.runtime import Group, note, unnote
from ..core.storage import first_sharing_problem
from .fp32 import ddp_problem, dtype_name
from .kernels import HALF, ROLES, bn_eager_pre_hook, to_fp32
from .match import is_module_bn

__all__ = ["EagerBatchNorm", "EagerForwardGraph", "eager_batchnorms", "eager_guard", "eager_apply", "forward_graph_apply",
           "drop_eager_hook", "note_item_break"]


# -- BatchNorms that Dynamo runs eagerly ----------------------------------------

# module -> hook handle; weak keys (modules hash by identity).
_EAGER_HOOKS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
# module -> its ``rewritten`` record (weak keys): the row of a graph of the
# module's own forward (``EagerForwardGraph``).
_EAGER_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, _Record]" = weakref.WeakKeyDictionary()


def _graph_breaking(mod: torch.nn.Module) -> bool:
    """Does Dynamo (torch 2.13.0) graph-break inside this module's forward?
    Only ``momentum=None`` in training with running statistics: it reads
    ``float(self.num_batches_tracked)``."""
    return mod.training and mod.momentum is None and mod.track_running_stats


class EagerBatchNorm(Match):
    """A BatchNorm module Dynamo runs eagerly (``_graph_breaking``), with half
    tensors that no graph of this compile reads: a match of the
    fp32_batchnorm format of its own kind."""

    def __init__(self, mod: torch.nn.Module, label: str, tensors: Dict[str, torch.Tensor], state: list, ddp_held: set):
        super().__init__([f"{label}.{r}" for r in tensors], flavour="eager", mode="training", folded=False)
        self.module, self.label, self.tensors = mod, label, tensors
        self.half = [r for r in tensors if tensors[r].dtype in HALF]
        self.state = state  # every named tensor of the frame's module (sharing checks)
        self.ddp_held = ddp_held
        self.why = (f"'{label}': momentum=None in training, so Dynamo graph-breaks on float(num_batches_tracked) "
                    f"and runs this BatchNorm eagerly")
        self.src: Optional[str] = None  # set by eager_guard
        self.before = 0


#: Why a graph of a hooked BatchNorm's own forward is compiled. Dynamo (torch
#: 2.13.0, ``trace_rules.check_verbose``) skips the frames of torch.nn's
#: forwards, except a module's that has hooks: the pre-hook is one. Measured:
#: one graph more than the same model without wfpass, on the first call after
#: the hook is added, shared by the BatchNorms that pass its guards; again
#: where those fail (another input shape), as for any graph.
FORWARD_GRAPH = ("Dynamo compiles the forward of a torch.nn module that has hooks, so it also compiles this one's "
                 "up to that break (num_batches_tracked += 1, nothing to rewrite) as a graph of its own: one graph "
                 "more than without wfpass, per set of guards (another input shape compiles it again)")


class EagerForwardGraph(Match):
    """The graph of the forward of a BatchNorm ``eager_apply`` hooked, up to
    its break: the pre-hook is why Dynamo compiles it (``FORWARD_GRAPH``)."""

    def __init__(self, mod: torch.nn.Module, record: _Record):
        super().__init__(record.params, flavour="eager", mode="training", folded=False)
        self.module, self.record = mod, record
        self.plan = FORWARD_GRAPH


def _own_forward(ctx: PassContext) -> Optional[EagerForwardGraph]:
    """The graph being compiled is the forward of a BatchNorm that
    ``eager_apply`` hooked (its frame's ``self``), still breaking: its match."""
    mod = _dynamo.source_root("L['self']")
    if not isinstance(mod, torch.nn.Module) or mod not in _EAGER_HOOKS or not _graph_breaking(mod):
        return None
    record = _EAGER_RECORDS.get(mod)
    return EagerForwardGraph(mod, record) if record is not None else None


def forward_graph_apply(m: EagerForwardGraph, ctx: PassContext) -> None:
    """The graph's row is the module's own record, which now also says why
    this graph exists: ``last_report()`` shows what the graph is, and
    ``wfpass.report(model)`` keeps one row per BatchNorm."""
    record = m.record
    if "forward_graphs" not in record.detail:
        record.reason += f"; {FORWARD_GRAPH}"
    record.detail["forward_graphs"] = record.detail.get("forward_graphs", 0) + 1
    ctx.report.records.append(record)


def eager_batchnorms(ctx: PassContext) -> Iterator[Match]:
    """The BatchNorms Dynamo runs eagerly among the modules the frame being
    compiled can reach, each once (see "BatchNorms Dynamo runs eagerly" in
    ``wfpass/batchnorm/fp32_format.py``). Leaves out, without a row, the ones
    with nothing to do: fp32 already, already hooked, or read by this graph
    after all (those are the graph's own BatchNorm matches). First, where
    the graph is a hooked BatchNorm's own forward, its ``EagerForwardGraph``."""
    own = _own_forward(ctx)
    if own is not None:
        yield own
    in_graph = {id(r.tensor) for r in ctx.state_tensors()}
    done = set()
    ddp_held = _distributed.ddp_tensors()
    for root in _dynamo.traced_frame_modules():
        state = None
        for name, mod in root.named_modules():
            if id(mod) in done or not is_module_bn(mod) or mod in _EAGER_HOOKS or not _graph_breaking(mod):
                continue
            done.add(id(mod))
            tensors = {r: getattr(mod, r) for r in ROLES if getattr(mod, r, None) is not None}
            if not any(t.dtype in HALF for t in tensors.values()) or any(id(t) in in_graph for t in tensors.values()):
                continue  # fp32 model, or compiled in this graph after all (the graph's matches)
            if state is None:
                state = list(root.named_parameters(remove_duplicate=False)) + list(root.named_buffers(remove_duplicate=False))
            yield EagerBatchNorm(mod, name or type(mod).__name__, tensors, state, ddp_held)


def eager_guard(m: EagerBatchNorm) -> Optional[str]:
    """Why the module's half tensors must keep their dtype, or None (then
    ``m.plan`` and the row's details say what the move does)."""
    tensors, half = m.tensors, m.half
    problem = first_sharing_problem([(f"{m.label}.{r}", tensors[r]) for r in half], m.state)
    problem = problem or ddp_problem([tensors[r] for r in half], m.ddp_held)
    if problem:
        return f"{m.why}; {problem}"
    m.src = dtype_name(tensors[half[0]].dtype)
    m.before = int(m.module.num_batches_tracked) if m.module.num_batches_tracked is not None else 0
    m.detail.update(from_dtype=m.src, cast=[f"{m.label}.{r}" for r in half],
                    extra_bytes=sum(tensors[r].numel() * 2 for r in half), half_calls_before=m.before)
    m.plan = f"{m.why}; would hold {', '.join(half)} in float32"
    return None


def eager_apply(m: EagerBatchNorm, ctx: PassContext) -> None:
    """Move the module's half tensors to fp32 (deferred) and add the forward
    pre-hook that keeps the format."""
    mod, tensors, half, before = m.module, m.tensors, m.half, m.before
    late = (f"; it had already run {before} training call(s) with {m.src} statistics before a graph of its "
            f"frame was compiled") if before else ""
    record = ctx.report.add(
        "batchnorm", "rewritten",
        f"{m.why}; {', '.join(half)} held in float32 so that call runs the mixed-precision kernel with fp32 statistics; "
        f"a forward pre-hook keeps the format{late}", m.params, **m.detail)
    record.stats.setdefault("fp32_calls", 0)
    moved = [tensors[r] for r in half]
    ctx.defer(lambda moved=moved: [to_fp32(t) for t in moved])
    # The hook owns its group: it goes with the module.
    _EAGER_HOOKS[mod] = mod.register_forward_pre_hook(functools.partial(bn_eager_pre_hook, Group(record)))
    _EAGER_RECORDS[mod] = record
    # Filed under the module's own tensors: no graph reads them, so the
    # compile's filing (by the graph's inputs) would leave the row out of
    # ``wfpass.report(model)``.
    note(record, m.params, list(tensors.values()))
    broke = _BREAK_NOTED.get(mod)
    if broke is not None:
        # The graph break left graphs around it after all: this record replaces the warning's.
        unnote(broke, list(tensors.values()))


def drop_eager_hook(mod: torch.nn.Module) -> bool:
    """``wfpass.restore``: remove the pre-hook ``eager_apply`` added."""
    handle = _EAGER_HOOKS.pop(mod, None)
    _EAGER_RECORDS.pop(mod, None)
    if handle is None:
        return False
    handle.remove()
    return True


# -- a graph break that leaves nothing compiled -----------------------------------

# BatchNorms already reported (weak keys: the record goes with the module).
_BREAK_NOTED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def note_item_break(mod: torch.nn.Module, name: str, config) -> None:
    """Dynamo is about to graph-break inside ``mod``'s forward on
    ``float(num_batches_tracked)`` (``momentum=None`` in training) while
    compiling for a wformat backend (``wfpass.capture.install_item_break_probe``). Where the
    break leaves graphs on both sides, those graphs' compiles convert the
    module (``EagerBatchNorm`` matches); inside a loop (``nn.Sequential``) Dynamo
    runs the whole frame eagerly and no backend is called. Either way, the
    user learns here which module broke the graph: a warning on the
    ``wfpass`` logger, and a record that ``last_report()`` shows when no
    graph was compiled after it and that ``wfpass.report(model)`` shows
    under the module's tensors."""
    if mod in _BREAK_NOTED or mod in _EAGER_HOOKS or config.dry_run:
        # Hooked: already converted, and its row says so. Dynamo traces it
        # again where a graph of its own forward is compiled (``FORWARD_GRAPH``)
        # for another input shape or another BatchNorm of the class; a
        # warning that no format is applied would be false there.
        return
    label = name or type(mod).__name__
    tensors = {r: getattr(mod, r) for r in ROLES if getattr(mod, r, None) is not None}
    half = any(t.dtype in HALF for t in tensors.values())
    why = (f"'{label}' ({type(mod).__name__}, momentum=None, training): Dynamo graph-breaks on "
           f"float(num_batches_tracked) in its forward. Where that leaves no graph around it (a loop such as "
           f"nn.Sequential's), Dynamo runs the whole model eagerly and compiles nothing, so no format is applied"
           + (" and this BatchNorm keeps its half-precision statistics" if half else "")
           + ". Give it a float momentum (e.g. momentum=0.1), or use wfpass.apply on a torch.fx.symbolic_trace graph")
    record = _Record("batchnorm", "skipped", why, [f"{label}.{r}" for r in tensors], detail=dict(flavour="graph break"))
    note(record, [f"{label}.{r}" for r in tensors], list(tensors.values()))
    _BREAK_NOTED[mod] = record
    logging.getLogger("wfpass").warning("wfpass: %s", why)
    note_uncompiled(record)
