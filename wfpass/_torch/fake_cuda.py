"""Inductor's CUDA code written on a machine without a GPU (checked on
torch 2.11.0+cu130 and 2.15.0+cu130, triton 3.6 / 3.9).

For tests and ``benchmarks/bench_gpu.py --check``: a graph captured on fake
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

and ``GraphLowering.compile_to_module`` writes the wrapper code and stops
(``CodegenOnly``) before the Triton kernels would be compiled and loaded.
Nothing here is used by wfpass itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Iterator, List

__all__ = ["CodegenOnly", "inductor_wrapper_code", "stopped_after_codegen"]

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


@contextlib.contextmanager
def inductor_wrapper_code() -> Iterator[List[str]]:
    """Within: every Inductor compile writes its Python wrapper code into
    the yielded list and raises ``CodegenOnly`` (Dynamo reports it as a
    backend failure; the caller expects that)."""
    import torch
    import torch.utils._triton as triton_utils
    from torch._inductor import scheduler
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime import hints

    codes: List[str] = []
    props = hints.DeviceProperties  # a NamedTuple (2.11-2.15); a dataclass would do too
    fields = ([f.name for f in dataclasses.fields(props)] if dataclasses.is_dataclass(props)
              else list(props._fields))

    def create(cls, device):
        return cls(**{k: (device.index if k == "index" else _H100.get(k)) for k in fields})

    def compile_to_module(self, *args, **kwargs):
        code = self.codegen()
        code = code[0] if isinstance(code, tuple) else code
        codes.append(getattr(code, "value", code))  # 2.15 wraps it in ValueWithLineMap
        raise CodegenOnly(_STOP)

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
    try:
        yield codes
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
