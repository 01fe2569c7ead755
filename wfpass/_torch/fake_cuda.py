"""Inductor's CUDA code written on a machine without a GPU (checked on
torch 2.11.0+cu130 and 2.15.0+cu130, triton 3.6 / 3.9).

For tests and ``benchmarks/gpu/bench_gpu.py --check``: a graph captured on fake
CUDA tensors (a CUDA build of torch, ``FakeTensorMode``) goes through
AOTAutograd and Inductor's lowering and scheduling as on a GPU; what stops
Inductor without one is only where it asks the driver. Inside
``inductor_wrapper_code()`` those questions get an H100's answers:

* ``torch._inductor.runtime.hints.DeviceProperties.create`` -> an H100's
  (sm 9.0, 132 SMs, warp 32), instead of ``torch.cuda.get_device_properties``;
* ``torch.cuda.get_device_capability`` / ``get_device_properties`` -> an
  H100's (Triton's codegen asks them, e.g. whether TMA may be used);
* ``torch._inductor.scheduler.has_triton`` -> True (it asks whether a CUDA
  device is present, not whether triton imports);
* ``torch.utils._triton.triton_hash_with_backend`` -> a fixed string (a cache
  key only; the real one asks the driver for the current target);

and ``GraphLowering.compile_to_module`` writes the wrapper code and returns
a module whose call stops (``CodegenOnly``): Inductor finishes its
decisions (CUDA graphs among them), nothing is compiled for or run on a
GPU. Inductor's and AOTAutograd's caches are off within (a cached graph
skips the codegen).
Nothing here is used by wfpass itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Iterator, List, Optional

__all__ = ["CodegenOnly", "WrapperCode", "inductor_wrapper_code", "stopped_after_codegen", "cudagraph_blocker"]

#: An H100 SXM as Inductor's ``DeviceProperties`` describes it.
_H100 = dict(type="cuda", multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
             max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)


class CodegenOnly(RuntimeError):
    """Raised by Inductor's compile once its wrapper code is written: the
    compile stops there, as it must without a GPU."""


def stopped_after_codegen(exc: BaseException) -> bool:
    """Whether ``exc`` is ``CodegenOnly``, as raised or as Inductor or Dynamo
    wrap it (``InductorError``, ``BackendCompilerFailed`` keep its text)."""
    return isinstance(exc, CodegenOnly) or _STOP in str(exc)


_STOP = "wfpass: Inductor's wrapper code written; no GPU to compile kernels for"


class WrapperCode(list):
    """The wrapper code of each compile, in order; ``cudagraphs[i]``:
    whether Inductor's CUDA graphs were on for compile ``i``
    (``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets)."""

    def __init__(self):
        super().__init__()
        self.cudagraphs: List[bool] = []


def cudagraph_blocker(gm) -> Optional[str]:
    """What in an AOTAutograd graph would make Inductor leave it out of
    CUDA graphs (``torch._inductor.utils.get_first_incompatible_cudagraph_node``:
    an op tagged unsafe for them, or a value whose size is known only at run
    time), or None."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    node = get_first_incompatible_cudagraph_node(gm)
    return None if node is None else f"{node.target} ({node.meta.get('val')})"


def _stop(*args, **kwargs):
    raise CodegenOnly(_STOP)


@contextlib.contextmanager
def inductor_wrapper_code() -> Iterator[WrapperCode]:
    """Within: every Inductor compile writes its Python wrapper code into
    the yielded list and raises ``CodegenOnly`` (Dynamo reports it as a
    backend failure; the caller expects that)."""
    import torch
    import torch.utils._triton as triton_utils
    from torch._inductor import scheduler
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime import hints

    from torch._inductor import config as inductor_config

    codes = WrapperCode()
    props = hints.DeviceProperties  # a NamedTuple (2.11-2.15); a dataclass would do too
    fields = ([f.name for f in dataclasses.fields(props)] if dataclasses.is_dataclass(props)
              else list(props._fields))

    def create(cls, device):
        return cls(**{k: (device.index if k == "index" else _H100.get(k)) for k in fields})

    def compile_to_module(self, *args, **kwargs):
        code = self.codegen()
        code = code[0] if isinstance(code, tuple) else code
        codes.append(getattr(code, "value", code))  # 2.15 wraps it in ValueWithLineMap
        codes.cudagraphs.append(bool(inductor_config.triton.cudagraphs))
        # A module whose ``call`` stops: Inductor goes on to its decisions
        # about the compiled graph (CUDA graphs among them) before any call.
        runner = types.SimpleNamespace(recursively_apply_fns=lambda fns: None, call=_stop)
        return types.SimpleNamespace(call=_stop, __file__="<wfpass fake cuda>", runner=runner)

    cuda_props = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3 (wfpass fake)", major=9, minor=0, multi_processor_count=132,
        total_memory=80 * 2**30, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
        max_threads_per_block=1024, warp_size=32, L2_cache_size=50 * 2**20,
        shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, gcnArchName="",
        is_integrated=False)

    saved = [(torch.cuda, "get_device_properties", torch.cuda.get_device_properties),
             (torch.cuda, "get_device_capability", torch.cuda.get_device_capability),
             (hints.DeviceProperties, "create", hints.DeviceProperties.__dict__["create"]),
             (scheduler, "has_triton", scheduler.has_triton),
             (triton_utils, "triton_hash_with_backend", triton_utils.triton_hash_with_backend),
             (GraphLowering, "compile_to_module", GraphLowering.compile_to_module)]
    torch.cuda.get_device_properties = lambda device=None: cuda_props
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    hints.DeviceProperties.create = classmethod(create)
    scheduler.has_triton = lambda *a, **k: True
    triton_utils.triton_hash_with_backend = lambda: "WFPASS-FAKE-CUDA"
    GraphLowering.compile_to_module = compile_to_module
    import torch._functorch.config as functorch_config

    # Cached graphs would skip the codegen this reads.
    no_caches = [inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False)]
    try:
        with no_caches[0], no_caches[1]:
            yield codes
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
