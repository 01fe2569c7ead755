"""wfpass's C++ kernels, by format: ``rnn/`` (the RNN loops, variable-length
batches, the cuDNN ops' bodies), ``linear/`` (the copy-free ``direct``
kernel, the fused linear), ``prepack/`` (the prepacked linear's per-call
check and kernel call), ``common/`` (what two of them share). Built on
first use with the machine's C++ compiler (``build``, the one entry point;
a first build says so on stderr, with its progress), cached, loaded into
torch's dispatcher; Python kernels where they cannot be.

Only per-call work lives here (``prepack/prepack.cpp``: the prepacked
linear's copy check and kernel call, 15-29 us a call in Python, measured by
``benchmarks/prepack/profile_pack.py``; ``rnn/cudnn.cpp``: the cuDNN RNN ops' bodies,
registered for CUDA, built the same against a CPU-only torch). Every decision stays in Python, which hands
the C++ kernel what it decided; the ops' schemas, fake implementations and
gradient formulas are registered in Python as before, so the compiler sees
the same ops either way. Every op's schema is in ``schemas.py``; the build
writes the C++-defined ones into ``wfpass_schemas.h`` for the sources.

The library is built once per source text and torch version into
``$WFPASS_CACHE`` (default ``~/.cache/wfpass``): ``g++`` with torch's headers,
about 17 s on 2 cores, then loaded in milliseconds. Set
``WFPASS_NATIVE=0`` to use the Python kernels. Where there is no compiler
or the build fails, wfpass runs the Python kernels and :func:`status` says
why; nothing else changes.

Compiler flags and paths are read from the installed torch itself (see
``_flags``): its headers' folders, the C++ standard they ask for (C++17 up
to torch 2.13, C++20 from 2.14 on; checked on 2.11.0, 2.13.0, 2.14.1 and
2.15.0) and its C++ ABI (``wfpass._torch.kernels.cxx11_abi``).
``torch.utils.cpp_extension`` is not imported: on a CUDA build of torch
without a CUDA toolkit it logs "No CUDA runtime is found" at import, a
warning about CUDA that a CPU user must not see.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

__all__ = ["build", "load", "load_if_built", "status", "loaded", "is_loaded", "fast_loop", "fast_isa", "fast_isa_words", "parallel_directions", "short_lstm_rows", "serves", "build_seconds", "cxx_standard", "library_path", "cudnn_cxx"]

_HERE = Path(__file__).resolve().parent
_SOURCES = ("prepack/prepack.cpp", "linear/direct.cpp", "rnn/rnn.cpp", "rnn/varlen_rnn.cpp", "rnn/fast_rnn.cpp",
            "rnn/varlen_sequence.cpp", "linear/linear.cpp", "rnn/cudnn.cpp")
#: Included by the sources: part of the cache key, not compiled alone.
_HEADERS = ("linear/direct.h", "linear/direct_kernel.h", "linear/direct_amx.h", "linear/direct_bf16dot.h", "rnn/fast_rnn.h", "rnn/fast_gates.h", "rnn/short_lstm.h", "common/weight_sample.h")

# None: not tried yet; "": loaded; else why not.
_STATE: list = [None]
# native.fast_loop()'s answer, asked once (it cannot change in a process).
_FAST: list = [None]
#: Seconds this process spent building the library (0.0 when it was cached).
BUILD_S: list = [0.0]


def loaded() -> bool:
    """Are the C++ kernels in use in this process? (Builds and loads them
    the first time it is asked.)"""
    return load() is None


def is_loaded() -> bool:
    """Are they loaded already? Never builds."""
    return _STATE[0] == ""


def status() -> str:
    """One line for the report: which kernels the ops run on, and why."""
    why = load()
    if why is None:
        return "C++ kernels (wfpass/native, built with this machine's compiler)"
    return f"Python kernels ({why})"


def fast_loop() -> bool:
    """Do the packed RNN kernels run their fp32 steps on the raw-pointer
    loop (``fast_rnn.cpp``: oneDNN's small-GEMM ukernel and vectorized gate
    math, AVX-512F or AVX2 with FMA)? False without the C++ kernels, on a
    CPU with neither, or with ``WFPASS_FAST_LOOP=0``."""
    if _FAST[0] is None:
        _FAST[0] = loaded() and bool(torch.ops.wfpass.native_fast_loop())
    return _FAST[0]


def fast_isa() -> str:
    """The instruction set of the loop's gate math: ``"avx512f"``,
    ``"avx2"`` (AVX2 with FMA; also on an AVX-512 CPU with
    ``WFPASS_FAST_ISA=avx2``), or ``""`` where :func:`fast_loop` is false."""
    return str(torch.ops.wfpass.native_fast_isa()) if fast_loop() else ""


def fast_isa_words() -> str:
    """:func:`fast_isa` as the report and ``doctor`` say it: ``"AVX-512"``,
    ``"AVX2"``, or ``""``."""
    return {"avx512f": "AVX-512", "avx2": "AVX2"}.get(fast_isa(), "")


def parallel_directions() -> bool:
    """Can a bidirectional packed layer run its two directions at once,
    forward and backward (``wfpass::packed_bilayer`` on the raw-pointer
    loop, one direction per OpenMP thread when torch has two or more)? True
    where the C++ kernels were built with OpenMP and the loop runs."""
    return fast_loop() and bool(torch.ops.wfpass.native_openmp())


def short_lstm_rows() -> int:
    """Up to how many rows (T x batch) an inference call of
    ``wfpass::lstm_layer_fw`` (the oneDNN path's op) runs on the
    raw-pointer loop instead of oneDNN's layer (``rnn/short_lstm.h``): 16
    where the loop and the direct linear kernel are in use, 0 otherwise or
    with ``WFPASS_RNN_AS_IS=0``."""
    return int(torch.ops.wfpass.native_short_lstm_rows()) if fast_loop() else 0


def serves(x: torch.Tensor) -> bool:
    """Does the packed RNN kernel run ``x``'s steps on the raw-pointer
    loop? The C++ kernel's rule (``packed_rnn.cpp``, ``fast``): a float32
    CPU tensor, oneDNN switched on (``torch.backends.mkldnn.enabled``), and
    :func:`fast_loop`."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.enabled
            and fast_loop())


def cudnn_cxx() -> bool:
    """Do the cuDNN RNN ops (``wfpass::cudnn_rnn``, ``cudnn_packed_rnn``,
    their ``_fw`` twins and backwards) run their C++ bodies on CUDA
    (``cudnn.cpp``)? True where the C++ kernels are loaded and registered
    for the CUDA key, which a CPU-only torch accepts too (nothing reaches
    them there). ``torch._C._dispatch_has_kernel_for_dispatch_key`` is
    private (checked on torch 2.11.0-2.15.0)."""
    from .._torch.kernels import has_kernel_for_key

    return loaded() and all(has_kernel_for_key(f"wfpass::{op}", "CUDA")
                            for op in ("cudnn_rnn_fw", "cudnn_rnn_backward", "cudnn_packed_rnn_fw",
                                       "cudnn_packed_rnn_backward"))


def build_seconds() -> float:
    """Seconds this process spent building the C++ kernels (0.0 when they
    came from the cache, or were not built)."""
    return BUILD_S[0]


def _cache_dir() -> Path:
    """``$WFPASS_CACHE``, else ``~/.cache/wfpass``, else (no writable home,
    as in some containers) a folder of this user's under the temp dir."""
    root = os.environ.get("WFPASS_CACHE")
    if root:
        return Path(root)
    home = Path(os.path.expanduser("~")) / ".cache" / "wfpass"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"wfpass-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


_TORCH_DIR = Path(torch.__file__).resolve().parent


def cxx_standard() -> str:
    """The C++ standard this torch's headers require: ``ATen/ATen.h``
    stops with ``#error C++20 or later compatible compiler is required``
    from torch 2.14 on, and asks for C++17 before (2.11.0, 2.13.0)."""
    try:
        text = (_TORCH_DIR / "include" / "ATen" / "ATen.h").read_text(errors="replace")
    except OSError:
        return "c++20"
    return "c++20" if "C++20 or later" in text else "c++17"


def _flags() -> list:
    """Everything on the compiler's command line but the sources, the
    compiler and the output: the cache key includes it. The folders are the
    ones ``torch.utils.cpp_extension.include_paths()`` / ``library_paths()``
    return for a CPU extension (checked on torch 2.11.0-2.15.0)."""
    from .._torch.kernels import cxx11_abi

    abi = int(cxx11_abi())
    inc = _TORCH_DIR / "include"
    libdir = _TORCH_DIR / "lib"
    return ["-O2", f"-std={cxx_standard()}", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{_HERE}", f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{libdir}", f"-Wl,-rpath,{libdir}"] + _openmp()


def _openmp() -> list:
    """``-fopenmp`` where torch runs on OpenMP: ``at::parallel_for`` in our
    kernels then uses torch's own OpenMP threads (the library is linked
    against ``libgomp.so.1``, the name of the copy torch loads from its own
    ``lib`` folder, so there is one OpenMP runtime in the process). Without
    it ``at::parallel_for`` runs serially here. A compiler without OpenMP
    gets a build without it (``_build``)."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


#: Linked after the sources (the linker resolves left to right).
_LIBS = ["-lc10", "-ltorch_cpu", "-ltorch"]


def _digest() -> str:
    from .schemas import cxx_header

    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update((_HERE / name).read_bytes())
    h.update(cxx_header().encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(" ".join([_compiler() or ""] + _flags() + _LIBS).encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the built library for this torch, Python and compiler lives."""
    return _cache_dir() / f"wfpass_native-{_digest()}.so"


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _compiler_or_raise() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    return cxx


def _first_error(stderr: str) -> str:
    """The compiler's first error line (what a user needs to fix), else its
    last line: with -w the first ``error`` is the cause and the rest follows
    from it."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def _compile_and_link(cxx: str, flags: list, out: Path, work: Path) -> subprocess.CompletedProcess:
    """Each source to an object file, as many at once as there are cores
    (the build is most of a fresh checkout's first import: about 100 s on a
    2-core machine in one g++ call), then one link. Returns the first
    failed step's result, else the link's."""
    from concurrent.futures import ThreadPoolExecutor

    from .schemas import cxx_header

    # The ops' schemas, from the one table every definition reads.
    (work / "wfpass_schemas.h").write_text(cxx_header())
    flags = flags + [f"-I{work}"]
    objs = [str(work / (Path(src).stem + ".o")) for src in _SOURCES]
    done = [0]

    def one(src: str, obj: str) -> subprocess.CompletedProcess:
        r = subprocess.run([cxx] + flags + ["-c", str(_HERE / src), "-o", obj], capture_output=True, text=True)
        done[0] += 1
        _say(f"  {done[0]}/{len(_SOURCES)} {src}")
        return r

    with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
        results = list(pool.map(one, _SOURCES, objs))
    for r in results:
        if r.returncode != 0:
            return r
    return subprocess.run([cxx] + flags + objs + _LIBS + ["-o", str(out)], capture_output=True, text=True)


def _build(target: Path) -> None:
    cxx = _compiler_or_raise()
    flags = _flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two processes building at once
    # (benchmark workers, test workers) each finish with a whole file.
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    tmp = work / target.name
    try:
        r = _compile_and_link(cxx, flags, tmp, work)
        if r.returncode != 0 and "-fopenmp" in flags:  # a compiler without OpenMP: build serial kernels
            r = _compile_and_link(cxx, [c for c in flags if c != "-fopenmp"], tmp, work)
        if r.returncode != 0:
            raise RuntimeError(f"{Path(cxx).name} -std={cxx_standard()} failed: {_first_error(r.stderr)}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(target: Path):
    """One build per cache folder at a time: processes started together
    (test workers, benchmark workers) wait for the first one's library
    instead of each spending the build's minutes. Where ``fcntl`` is
    missing each process builds its own, which the rename keeps safe."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(target.parent / (target.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: About how long a first build takes on 2 cores (measured: 17-100 s by compiler and machine).
_ABOUT_S = 60


def _say(line: str) -> None:
    """What a first build tells the user on stderr (``WFPASS_QUIET=1``: nothing)."""
    if os.environ.get("WFPASS_QUIET", "").strip().lower() not in ("1", "true", "yes", "on"):
        print(f"wfpass: {line}", file=sys.stderr, flush=True)


def build() -> Optional[str]:
    """Build (once per source text, machine and torch version) and load the
    C++ kernels; the entry point every caller goes through (the first
    ``torch.compile(..., backend="wformat")`` or ``wfpass.apply`` call, or
    ``python -m wfpass doctor``). A build that is not cached says so on
    stderr, one line per compiled source. Returns None when they are
    loaded, else why the Python kernels run."""
    return load()


def load() -> Optional[str]:
    """Build (once) and load the C++ kernels. Returns None when they are
    loaded, else the reason the Python kernels are used."""
    if _STATE[0] is not None:
        return _STATE[0] or None
    why = ""
    if os.environ.get("WFPASS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        why = "WFPASS_NATIVE=0"
    elif not torch.backends.mkldnn.is_available():
        why = "this torch has no oneDNN"
    else:
        target = library_path()
        try:
            if not target.exists():
                with _build_lock(target):
                    if not target.exists():  # another process may have built it while we waited
                        _say(f"building its C++ kernels, once per machine and torch version (about {_ABOUT_S} s), "
                             f"into {target.parent}")
                        t = time.perf_counter()
                        _build(target)
                        BUILD_S[0] = time.perf_counter() - t
                        _say(f"C++ kernels built in {BUILD_S[0]:.0f} s")
            torch.ops.load_library(str(target))
        except Exception as e:  # noqa: BLE001 - any failure: the Python kernels, and say why
            why = f"the C++ build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    _STATE[0] = why
    return why or None


def load_if_built() -> bool:
    """Load the C++ kernels where they are built already, never building:
    what ``import wfpass`` does, so a program exported or compiled by
    AOTInductor in another process calls them when loaded in this one. True
    when they are loaded."""
    if _STATE[0] is None:
        try:
            built = (os.environ.get("WFPASS_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")
                     and torch.backends.mkldnn.is_available() and library_path().exists())
        except Exception:  # noqa: BLE001 - a broken toolchain here is load()'s to report, later
            built = False
        if built:
            load()
    return is_loaded()
