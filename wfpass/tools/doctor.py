"""``python -m wfpass doctor``: what wfpass can use on this machine.

The torch release and whether wfpass was tested on it, which kernels each
dtype gets on this CPU (each found by a tiny probe call, the same probes
the formats use before they choose a kernel), whether wfpass's C++ kernels
are built and in use (and, where the build failed, the compiler's first
error), and what CUDA and cuDNN this torch has.
"""
from __future__ import annotations

import platform
import sys
from typing import List

__all__ = ["doctor", "lines", "cpu_words"]


def cpu_words() -> str:
    """The CPU as a results page names it: model, vendor and the instruction
    sets wfpass's kernels pick from ("AMD EPYC (AuthenticAMD; avx2, fma,
    f16c)"). Figures differ by vendor and instruction set."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
    isa = ", ".join(f for f in wanted if f in flags) or platform.machine()
    from ..prepack.choose import _cpu_name  # the model name the kernel decisions are keyed by

    return f"{_cpu_name()} ({vendor or 'vendor unknown'}; {isa})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _dot_words() -> str:
    """Which bf16 rows the direct kernel's AVX-512 BF16 dot body takes
    (direct.cpp, dot_takes): with AMX on, the prompt rows the tiles leave;
    without, also a decode step's one and two rows."""
    from ..native import ops as _nops

    rows = "8+ rows" if _nops.direct_amx() else "1-2 rows (up to 4096 input features) and 8+ rows"
    return f"; bfloat16 at {rows} by AVX-512 BF16 dot products (WFPASS_DIRECT_BF16DOT=0: off)"


def _native_lines() -> List[str]:
    """What the C++ kernels give on this machine (built here if needed)."""
    import torch

    from .. import native
    from ..native import ops as _nops

    out: List[str] = []
    why = native.load()
    if why is None:
        how = f"built in {native.build_seconds():.1f} s" if native.build_seconds() else "from the cache"
        out.append(f"C++ kernels: in use ({how}: {native.library_path()}; -std={native.cxx_standard()})")
        fast = (f"yes (oneDNN's small-GEMM kernel, {native.fast_isa_words()} gate math)" if native.fast_loop()
                else "no (a CPU with neither AVX-512 nor AVX2 with FMA, oneDNN's small-GEMM kernel not answering, "
                     "or WFPASS_FAST_LOOP=0)")
        out.append(f"packed RNN loop on raw pointers (float32): {fast}")
        isa = _nops.direct_isa()
        out.append(f"direct linear (float32, bfloat16, float16: dot products over the weight as it is, no copy): "
                   + (f"yes ({'AVX-512F' if isa == 'avx512f' else 'AVX2 with FMA'}"
                      f"{'; bfloat16 at 4+ rows on AMX tiles (WFPASS_DIRECT_AMX=0: off)' if _nops.direct_amx() else ''}"
                      f"{_dot_words() if _nops.direct_bf16dot() else ''}"
                      f"{'; half rows 4 KB apart read skewed at 1-2 rows (WFPASS_DIRECT_SKEW=0: off)' if _nops.direct_skew() else ''})"
                      if isa else
                      "no (a CPU with neither AVX-512F nor AVX2 with FMA and F16C, or WFPASS_DIRECT=0)"))
        out.append(f"brgemm packed linear (float32, oneDNN's small-GEMM kernel over 64-column panels): "
                   f"{_yes(_nops.panel_packs(torch.float32))}")
        both = (f"yes, with {torch.get_num_threads()} torch threads" if native.parallel_directions()
                else "no (the C++ kernels were built without OpenMP, or the raw-pointer loop does not run)")
        out.append(f"bidirectional packed layers, both directions at once: {both}")
    else:
        out.append(f"C++ kernels: not in use, the Python kernels run instead ({why})")
    return out


def lines() -> List[str]:
    """The report, one line per fact (builds the C++ kernels if needed)."""
    import torch

    from .. import __version__, native
    from .._torch import kernels, versions

    out = [f"wfpass {__version__}, Python {sys.version.split()[0]}"]
    v = versions.torch_version()
    tested = torch.__version__.split("+")[0] in versions.TESTED
    in_range = versions.OLDEST <= v[:2] <= versions.NEWEST_TESTED
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    out.append(f"torch {torch.__version__} ({build}): "
               + ("tested with wfpass" if tested else "in wfpass's range, this release not tested" if in_range
                  else "newer than any release wfpass was tested on")
               + f"; wfpass runs on {versions.OLDEST[0]}.{versions.OLDEST[1]}-"
               f"{versions.NEWEST_TESTED[0]}.{versions.NEWEST_TESTED[1]} (tested: {', '.join(versions.TESTED)})")
    out.append(f"CPU: {cpu_words()}, {torch.get_num_threads()} torch threads")
    if not torch.backends.mkldnn.is_available():
        out.append("oneDNN: not in this torch build: RNNs take ATen's kernels, linears are not packed")
    else:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            name = str(dtype).replace("torch.", "")
            if not kernels.onednn_cpu_flag(dtype):
                out.append(f"oneDNN {name}: this CPU lacks the instructions: LSTMs take ATen's kernels, "
                           f"linears stay unpacked")
                continue
            out.append(f"oneDNN {name}: LSTM kernel {_yes(kernels.mkldnn_rnn_dtype(dtype))}, "
                       f"packed linear {_yes(kernels.onednn_packs(dtype))} (each probed with a tiny call)")
    out.append(f"MKL packed SGEMM (float32): {_yes(kernels.mkl_packs(torch.float32))}")
    out += _native_lines()
    from ..core import memory

    out.append(f"packed copies, default bound (prepack.max_bytes='weights'): at most the weights' bytes and "
               f"{memory.describe()}")
    if torch.version.cuda:
        if torch.cuda.is_available():
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            out.append(f"CUDA: {names}; cuDNN {torch.backends.cudnn.version()}")
        else:
            out.append("CUDA: no GPU visible to this process")
        body = ("C++ (wfpass/native/rnn/cudnn.cpp; dropout in training and weights out of cuDNN's layout "
                "in Python)" if native.cudnn_cxx() else "Python (the C++ kernels are not in use)")
        out.append(f"cuDNN RNN ops (rnn={{'cuda': 'cudnn'}}), per-call work: {body}")
    return out


def doctor() -> int:
    for line in lines():
        print(line)
    return 0
