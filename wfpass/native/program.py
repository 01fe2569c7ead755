"""The libraries a C++ program loads to run a wfpass program without Python.

An AOTInductor package that ``wfpass.export`` made calls wfpass's ops as
extern kernels, by name, through torch's dispatcher. In Python,
``import wfpass`` defines them (their schemas in ``schemas.py``, their
fakes and gradient formulas beside them) and loads their C++ kernels. A C++
program (``torch::inductor::AOTIModelPackageLoader``) has no Python, so it
loads two shared libraries instead:

- the kernels (``wfpass_native-*.so``, what ``import wfpass`` loads: the
  ops' CPU kernels, registered with ``TORCH_LIBRARY_IMPL``), and
- the definitions (``wfpass_program_ops-*.so``, built here): one
  ``m.def`` per op Python defines, its text written from ``schemas.py``
  (the one table every definition reads), so the dispatcher knows each
  op's schema as it does in Python.

Python never loads the second one (its ops are defined there already);
the two load in either order (the dispatcher takes a kernel before its
op's definition). The ops' gradient formulas and fakes stay in Python: a
C++ program runs a package, it does not trace or differentiate one.
``examples/export_cpp/run_package.cpp`` is such a program,
``docs/guide/export.md`` says how to build it.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import List

from . import _LIBS, _cache_dir, _compiler, _compiler_or_raise, _first_error, _flags, _say, build, library_path
from .schemas import CXX_DEFINED, all_schemas

__all__ = ["definitions_source", "definitions_path", "cxx_libraries", "compile_command"]


def definitions_source() -> str:
    """The C++ source of the definitions library: every op Python defines
    (twins included), in the text ``schemas.py`` holds."""
    ops = {n: text for n, text in all_schemas().items() if n not in CXX_DEFINED}
    lines = ["// Written by wfpass/native/program.py from wfpass/native/schemas.py: edit the table there.",
             "#include <torch/library.h>", "", "TORCH_LIBRARY_FRAGMENT(wfpass, m) {"]
    for name, args in ops.items():
        text = (name + args).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'  m.def("{text}");')
    lines.append("}")
    return "\n".join(lines) + "\n"


def definitions_path() -> Path:
    """Where the definitions library for this torch and compiler lives."""
    h = hashlib.sha256(definitions_source().encode())
    h.update(" ".join([_compiler() or ""] + _flags() + _LIBS).encode())
    h.update(library_path().name.encode())
    return _cache_dir() / f"wfpass_program_ops-{h.hexdigest()[:16]}.so"


def _build_definitions(target: Path) -> None:
    cxx = _compiler_or_raise()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as work:
        src, tmp = Path(work) / "program_ops.cpp", Path(work) / target.name
        src.write_text(definitions_source())
        flags = [f for f in _flags() if f != "-fopenmp"]
        r = subprocess.run([cxx] + flags + [str(src)] + _LIBS + ["-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{Path(cxx).name} failed on the ops' definitions: {_first_error(r.stderr)}")
        os.replace(tmp, target)


def cxx_libraries() -> List[Path]:
    """The two libraries a C++ program loads (``dlopen``, or links) before
    ``AOTIModelPackageLoader`` runs a package ``wfpass.export`` made: the
    kernels, then the ops' definitions; each built once per machine and
    torch version into wfpass's cache folder. Raises ``RuntimeError`` where
    they cannot be built (no compiler, a failed build: the reason)."""
    why = build()
    if why is not None:
        raise RuntimeError(f"wfpass's C++ kernels are not built: {why}")
    target = definitions_path()
    if not target.exists():
        _say(f"building the ops' definitions for C++ programs into {target.parent}")
        _build_definitions(target)
    return [library_path(), target]


def compile_command(source: str, output: str) -> List[str]:
    """The compiler's command line that builds the C++ program ``source``
    into the executable ``output`` against this torch (its headers, its C++
    standard and ABI, its libraries, found at run time through an rpath),
    as the kernels' library is built."""
    cxx = _compiler_or_raise()
    flags = [f for f in _flags() if f not in ("-shared", "-fPIC", "-fopenmp", "-O2")]
    # --no-as-needed: the program itself calls nothing in libtorch.so, so a
    # linker that drops unused libraries (Ubuntu's default) leaves it out,
    # and the package's own library, which needs it (torch 2.15), then
    # finds no libtorch.so to load: the executable's rpath does not reach
    # a dlopen'ed library's dependencies. Loaded with the program, the
    # package's dependency is the library already there.
    return [cxx, "-O1"] + flags + [source, "-Wl,--no-as-needed"] + _LIBS + ["-ldl", "-o", output]
