"""Which kernel a linear of one shape runs: measured once per shape on this
machine, and the decision kept, in the process and in a file, so the same
model on the same machine gets the same kernels from one process to the next.

Candidates: ``"plain"`` (``F.linear`` on the parameter, what eager and
Inductor run: oneDNN or MKL reorders the weight inside every call),
``"direct"`` (float32, bfloat16 or float16 on a CPU with AVX-512F, or AVX2
with FMA and F16C: wfpass's C++ kernel of dot products over the parameter as
it is, no copy), ``"brgemm"``
(float32: oneDNN's small-GEMM ukernel over a copy of the weight
in 64-column panels, wfpass's C++ kernel), ``"onednn"`` (oneDNN's packed
layout, one copy for every row count) and, for float32 with at most
``EXACT_ROWS`` rows, ``"mkl"`` (MKL's packed SGEMM, whose copy is made for
one row count and is several MB larger than the weight).

**Lightest first.** The kernels are taken in that order: direct where it
gains the margin over the plain GEMM, then brgemm where it gains the margin
over the plain GEMM and over the kernel taken so far, then oneDNN only where
it gains the margin over the kernel taken so far too, in three rounds of
four at least level, then MKL the same way by ``MKL_MARGIN``. direct needs
no memory at all; the copies of brgemm and oneDNN are the weight's bytes, but each row count a kernel runs makes the
library compile one for it, and keep it: about 16 KiB for brgemm's
ukernel, 0.56 MiB for oneDNN's linear (torch 2.13, docs/guide/prepack.md). A
near-tie between two kernels keeps the lighter, so it cannot flip
between processes.

**A gain clear of the noise.** Each candidate is timed in ``ROUNDS``
interleaved rounds of about ``SAMPLE_S`` each beside the plain GEMM; each
round gives the ratio (candidate + the op's own call) / plain. A packed
kernel is taken only where the median of its rounds is at most ``MARGIN``
of the plain GEMM; MKL (a copy per row count, larger) must beat the plain
GEMM and oneDNN that way by ``MKL_MARGIN``, round by round. Rounds decide
to pack only where the upper-quartile round is no slower than the plain
GEMM, and to run the plain GEMM only where the lower-quartile round does not
gain the margin either (``_settled``); otherwise (a near-tie, or rounds
spread by another process) they are measured again, up to ``ATTEMPTS``
times. The median of 11 rounds of 2 ms moves less between processes than
the second-worst of 7 rounds of 1 ms (the rule before this one, which a single
slow round also swayed). The margin is wide on purpose: across fresh
processes the median of the same shape moved by up to 0.08 (0.88-0.96 for a
384x256 weight at 5 rows), so a threshold near 1 flipped such near-ties from
one process to the next (``benchmarks/prepack/choice_spread.py``,
docs/choice_spread.md), and a gain that small is not worth a copy's memory.

**Timed among the model's weights.** Where the graph reads more than
``POOL_MIN_MIB`` of weights per call, each call of the timing takes the
next of as many copies of the weight (and of its packed copy) as fill those
bytes (``pool_mib``, a power of two), so the weight comes from where the
model's calls find it, after the others went through the caches, not from
the core's L2. On the bench decoder (18.6 MB of weights) a 2752x256 weight
at one row took 45 us plain and 43 us with oneDNN timed alone, 147 us and
70 us cycling through its weights' bytes; deciding the latter way took its
1-token step from level with Inductor to 1.4-1.6x (docs/choice_spread.md).

**Kept.** The decision, with the times it rested on, goes into
``choices.json`` in ``WFPASS_CACHE_DIR`` (default ``~/.cache/wfpass``; an
empty value or ``off`` keeps decisions in the process only), keyed by this
CPU's model name, the torch version and the thread count: later processes on
this machine take it from there instead of timing again, so a compile while
the machine is busy no longer bakes in whichever kernel won that moment. The
report says which decisions came from the file. Rounds that cannot decide
(``_settled``: a near-tie, or another process on the cores or the memory)
are measured again; if all ``ATTEMPTS`` cannot, the decision is the plain
GEMM, and it is kept like any other, marked too noisy: later processes on
this machine run the plain GEMM there too instead of measuring again, each on its own luck (with
2 threads and a core busy, fresh processes measuring afresh agreed in
2 of 10, docs/choice_spread.md). Delete the file to measure again (after a
torch upgrade the key changes by itself).

Row counts above ``EXACT_ROWS`` are measured at the next power of two
(one measurement serves every M up to it).

This module decides, keeps and reads the decisions; the candidates are
timed in ``timing.py`` and the rule's code (margins, lightest first,
settled or not) is ``rule.py``, both re-exported here.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from .._torch import kernels as _k
from ..native import ops as _nops
from .. import native as _native
from . import timing as _timing
# The decision rule (rule.py) and the pool's bounds (timing.py), re-exported:
# callers read them here (``choose.MARGIN``, ``choose._best``), and
# ``decide`` calls ``_best`` and ``_settled`` through this module's names.
from .rule import COPY_FREE, MARGIN, MKL_MARGIN, best as _best, copy_free, settled as _settled
from .timing import POOL_MAX_COPIES, POOL_MAX_MIB

__all__ = ["COPY_FREE", "copy_free", "MARGIN", "MKL_MARGIN", "ROUNDS", "SAMPLE_S", "CLEAR_ROUND", "ATTEMPTS", "RULE",
           "OP_COST_NATIVE_S", "OP_COST_PYTHON_S", "op_cost_s", "EXACT_ROWS", "bucket", "measure", "measured",
           "kernels_for_dtype", "Decision", "decide", "choices_file", "pool_mib", "POOL_MIN_MIB", "POOL_MAX_COPIES",
           "POOL_MAX_MIB"]

#: What a call of the packed op costs beyond its kernel, added to every
#: packed candidate's time before the comparison: the plain GEMM runs inside
#: the compiled graph, the packed kernel behind an op that checks its copy.
#: Measured with ``benchmarks/prepack/profile_pack.py`` (one row, 1 thread, torch
#: 2.13.0): 0.5-2.5 us with the C++ kernel (``wfpass/native``), 15-29 us (19 us on an AMD EPYC)
#: with the Python one; the high end of the first, the low end of the
#: second, so a kernel that wins by more is still taken.
OP_COST_NATIVE_S = 3e-6
OP_COST_PYTHON_S = 15e-6


def op_cost_s() -> float:
    """The op's own cost per call in this process (C++ or Python kernel)."""
    return OP_COST_NATIVE_S if _native.loaded() else OP_COST_PYTHON_S


#: Interleaved timing rounds per shape, about ``SAMPLE_S`` seconds of calls
#: each; the report also gives each candidate's ``CLEAR_ROUND``-th worst
#: round.
ROUNDS = 11
SAMPLE_S = 2e-3
CLEAR_ROUND = 2

#: Measurements of one shape before a noisy one decides the plain GEMM.
ATTEMPTS = 3

#: The decision rule's version, part of the decision file's key: decisions
#: made by an earlier rule are measured again, not read.
RULE = 10

#: Row counts measured exactly; above it, at the next power of two.
EXACT_ROWS = 8

#: The weights a graph reads per call, above which a decision is timed with
#: the weight cycling through copies that fill them (``pool_mib``): in the
#: model each weight comes back after all the others went through the
#: caches, so timing one weight over and over (it stays in the core's L2)
#: measures another machine. Measured on the bench decoder's shapes (18.6 MB
#: of weights; ``docs/choice_spread.md``): at one row a 2752x256 weight took
#: 45 us plain / 43 us oneDNN timed alone, 147 / 70 us cycling through 18.6
#: MB, and the decoder's 1-token step ran at the latter's bandwidth.
POOL_MIN_MIB = 1


def pool_mib(pool_bytes: int) -> int:
    """The weights a graph reads per call, in MiB rounded to a power of two
    (the nearest in log scale), for the decision's key; 0 below
    ``POOL_MIN_MIB`` (the weight alone)."""
    mib = pool_bytes / 2**20
    if mib < POOL_MIN_MIB:
        return 0
    return int(min(POOL_MAX_MIB, 2 ** round(math.log2(mib))))


def bucket(m: int) -> int:
    return m if m <= EXACT_ROWS else 1 << (m - 1).bit_length()


def kernels_for_dtype(dtype: torch.dtype, m: int) -> List[str]:
    """The kernels beside the plain GEMM this CPU and build have for ``dtype``
    at ``m`` rows, lightest first."""
    out = []
    if _nops.direct_runs(dtype):
        out.append("direct")
    if _nops.panel_packs(dtype):
        out.append("brgemm")
    if _k.onednn_packs(dtype):
        out.append("onednn")
    if _k.mkl_packs(dtype) and m <= EXACT_ROWS:
        out.append("mkl")
    return out


class Decision:
    """The kernel for one shape and what it rested on: each candidate's
    median seconds per call, its rounds' ratios to the plain GEMM (the op's
    call included), the bytes of its copy, where it came from (``"measured"``
    in this process, ``"file"``: an earlier process's, from ``choices.json``;
    ``"noisy"``: measured in this process, too noisy to decide, so plain),
    when it was measured, and whether it was too noisy to decide
    (``noisy``: then plain, in this process and in those that read it)."""

    __slots__ = ("kernel", "times", "ratios", "nbytes", "source", "when", "noisy")

    def __init__(self, kernel: str, times: Dict[str, float], ratios: Dict[str, List[float]],
                 nbytes: Dict[str, int], source: str, when: str, noisy: bool = False):
        self.kernel, self.times, self.ratios, self.nbytes = kernel, times, ratios, nbytes
        self.source, self.when, self.noisy = source, when, noisy

    def clear_ratio(self, kernel: str) -> float:
        """The ``CLEAR_ROUND``-th worst round's ratio of ``kernel`` to the plain GEMM."""
        rs = sorted(self.ratios.get(kernel) or [float("inf")], reverse=True)
        return rs[min(CLEAR_ROUND, len(rs)) - 1]

    def spread(self) -> float:
        """The widest interquartile range of a candidate's rounds' ratios,
        relative to their median."""
        out = 0.0
        for rs in self.ratios.values():
            s = sorted(rs)
            if s:
                q1, q3 = s[(len(s) - 1) // 4], s[3 * (len(s) - 1) // 4]
                out = max(out, (q3 - q1) / max(statistics.median(s), 1e-12))
        return out

    def median_ratio(self, kernel: str) -> float:
        """The median of ``kernel``'s rounds' ratios to the plain GEMM."""
        return statistics.median(self.ratios.get(kernel) or [float("inf")])

    def to_json(self) -> dict:
        out = {"kernel": self.kernel, "times": self.times, "ratios": self.ratios, "nbytes": self.nbytes,
               "when": self.when}
        if self.noisy:
            out["noisy"] = True
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Decision":
        return cls(str(d["kernel"]), {k: float(v) for k, v in d["times"].items()},
                   {k: [float(x) for x in v] for k, v in d.get("ratios", {}).items()},
                   {k: int(v) for k, v in d.get("nbytes", {}).items()}, "file", str(d.get("when", "")),
                   bool(d.get("noisy", False)))


# (dtype, in, out, bucket, threads) -> its Decision, for this process.
_DECIDED: Dict[tuple, Decision] = {}
_FILE_LOCK = threading.Lock()
_FILE_STATE: Dict[str, object] = {"path": None, "data": None}


def choices_file() -> Optional[str]:
    """Where decisions are kept between processes, or None (``WFPASS_CACHE_DIR``
    empty or ``off``)."""
    d = os.environ.get("WFPASS_CACHE_DIR")
    if d is None:
        d = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "wfpass")
    if d.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    return os.path.join(d, "choices.json")


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    """This CPU's model name (read once: it does not change in a process)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> str:
    """What a decision holds for: this CPU's model, the torch build, the
    threads, the copy-free kernel's bodies (AMX tiles, AVX-512 BF16 dots at
    1-2 rows and in K chunks: "bf16dot3", skewed 1-2-row reads, fp16 lines in
    one load: "skew2"); decisions timed on other bodies are timed again."""
    direct = _nops.direct_isa() + "+amx" * _nops.direct_amx() + "+bf16dot3" * _nops.direct_bf16dot() + "+skew2" * _nops.direct_skew()
    return (f"{_cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | rule {RULE} | "
            f"direct {direct or 'none'}")


def _key_text(key: tuple) -> str:
    dtype, k, n, mb, _threads, pool = key
    return f"{str(dtype).replace('torch.', '')} {n}x{k} M={mb}" + (f" pool={pool}MiB" if pool else "")


def _load(path: str) -> dict:
    if _FILE_STATE["path"] != path:
        data: dict = {}
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        _FILE_STATE["path"], _FILE_STATE["data"] = path, data
    return _FILE_STATE["data"]  # type: ignore[return-value]


def _from_file(key: tuple) -> Optional[Decision]:
    path = choices_file()
    if path is None:
        return None
    with _FILE_LOCK:
        entry = _load(path).get(_machine(), {}).get(_key_text(key))
    if not isinstance(entry, dict):
        return None
    try:
        return Decision.from_json(entry)
    except (KeyError, TypeError, ValueError):  # an entry from another version of this file: measure again
        return None


def _to_file(key: tuple, d: Decision) -> None:
    """Add ``d`` to the file: read it again, add, write a temporary file and
    rename it over the old one (another process writing at the same time
    loses nothing but its own newest entries, which it measured anyway)."""
    path = choices_file()
    if path is None:
        return
    with _FILE_LOCK:
        _FILE_STATE["path"] = None  # read what other processes wrote since
        data = _load(path)
        data.setdefault(_machine(), {})[_key_text(key)] = d.to_json()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".choices-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:  # a read-only home: decisions stay in the process
            pass


def _time_candidates(dtype: torch.dtype, k: int, n: int, mb: int, pool: int = 0):
    """Each candidate's seconds per call in ``ROUNDS`` interleaved rounds of
    about ``SAMPLE_S``, and its copy's bytes (``timing.time_candidates``).
    ``pool`` (MiB, ``pool_mib``): each call takes the next of as many copies
    of the weight (and of its packed copy) as fill it, as the model's calls
    find their weight after the others. ROUNDS and SAMPLE_S are read here, at
    each call, so a benchmark that changes them times with its own."""
    return _timing.time_candidates(dtype, k, n, mb, pool, kernels_for_dtype, ROUNDS, SAMPLE_S)


def decide(dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> Decision:
    """The decision at this shape (``m`` rounded by ``bucket``) for a graph
    reading ``pool_bytes`` of weights per call (``pool_mib``): this
    process's, else the file's, else measured now (and kept in both)."""
    mb = bucket(m)
    pool = pool_mib(pool_bytes)
    key = (dtype, k, n, mb, torch.get_num_threads(), pool)
    got = _DECIDED.get(key)
    if got is not None:
        return got
    got = _from_file(key)
    if got is None:
        for _ in range(ATTEMPTS):
            got = _measure(dtype, k, n, mb, pool)
            if _settled(got):
                got.kernel = _best(got)
                _to_file(key, got)
                break
            # The rounds disagree too much to tell (another process took the
            # cores): measure again; after ATTEMPTS, the plain GEMM, kept, so
            # that later processes run the same instead of each deciding on
            # its own luck.
            got.source, got.noisy, got.kernel = "noisy", True, "plain"
        if got.noisy:
            _to_file(key, got)
    got = _runnable(got, dtype, mb)
    _DECIDED[key] = got
    return got


def _runnable(d: Decision, dtype: torch.dtype, mb: int) -> Decision:
    """``d``, or where its kernel cannot run in this process (a decision
    file written where wfpass's C++ kernels ran, read by a process without
    them: ``WFPASS_NATIVE=0``, ``WFPASS_FAST_LOOP=0``), the same rounds
    decided again among the kernels this process has."""
    have = set(kernels_for_dtype(dtype, mb))
    if d.kernel == "plain" or d.kernel in have:
        return d
    keep = have | {"plain"}
    out = Decision("plain", {k: v for k, v in d.times.items() if k in keep},
                   {k: v for k, v in d.ratios.items() if k in have}, {k: v for k, v in d.nbytes.items() if k in have},
                   d.source, d.when, d.noisy)
    out.kernel = "plain" if d.noisy else _best(out)
    return out


def _measure(dtype: torch.dtype, k: int, n: int, mb: int, pool: int = 0) -> Decision:
    times, nbytes = _time_candidates(dtype, k, n, mb, pool)
    op = op_cost_s()
    ratios = {name: [(t + op) / p for t, p in zip(ts, times["plain"])] for name, ts in times.items()
              if name != "plain"}
    return Decision("plain", {name: statistics.median(ts) for name, ts in times.items()}, ratios, nbytes,
                    "measured", time.strftime("%Y-%m-%d"))


def measure(dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> Dict[str, float]:
    """Median seconds per call of each candidate at this shape (``m``
    rounded by ``bucket``)."""
    return decide(dtype, k, n, m, pool_bytes).times


def measured(dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> Tuple[str, Dict[str, float]]:
    """The kernel to run at this shape, and the times that chose it."""
    d = decide(dtype, k, n, m, pool_bytes)
    return d.kernel, d.times
