"""The package's layering, checked on its source (docs/design/architecture.md).

The import graph counts every ``import`` / ``from ... import`` anywhere in a
module (inside functions too) and ``importlib.import_module("...")`` string
literals; ``from . import x`` where ``x`` is a submodule is an edge to that
submodule. The rules: no import cycle among wfpass modules; the private
PyTorch layer (``wfpass/_torch/``) imports nothing from wfpass; private torch
attributes are touched only in that layer; each module imports only its own
layer or below. And the rooms: no folder under ``wfpass/`` holds more than
12 modules (a module is a ``.py`` file directly in the folder,
``__init__.py`` not counted; ``wfpass/`` itself is not a folder under it);
the RNN format's CPU and CUDA kernels (``wfpass.rnn.cpu``,
``wfpass.rnn.cuda``) sit in folders of their own and never import the
format's matcher, guards, rewrite, paths, capture or cell loops.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "wfpass"
PRIVATE_LAYER = "wfpass._torch"


def _modules():
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _resolve(name: str):
    """The wfpass module ``name`` names (a module, or a package's __init__), or None."""
    return name if name in MODULES else None


def _edges(mod: str):
    path, is_pkg = MODULES[mod]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = mod if is_pkg else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("wfpass"):
                    # ``import a.b.c`` imports a, a.b and a.b.c.
                    parts = alias.name.split(".")
                    for i in range(1, len(parts) + 1):
                        target = _resolve(".".join(parts[:i]))
                        if target:
                            out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("wfpass"):
                continue
            parents = base.split(".")
            for i in range(1, len(parents) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                target = _resolve(".".join(parents[:i]))
                if target and target != base:
                    out.add(target)
            for alias in node.names:
                sub = _resolve(f"{base}.{alias.name}")
                if sub:
                    out.add(sub)  # ``from . import x``: the submodule x
                elif _resolve(base):
                    out.add(base)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                name = node.args[0].value
                if isinstance(name, str) and name.startswith("wfpass"):
                    target = _resolve(name)
                    if target:
                        out.add(target)
    out.discard(mod)
    # A package's __init__ importing its own submodules, and a submodule
    # importing its parent package, are both edges; the parent packages a
    # submodule's import runs first are not counted against a cycle here:
    # Python runs them before the submodule, and they may import it.
    return {t for t in out if not mod.startswith(t + ".")}


GRAPH = {m: _edges(m) for m in MODULES}


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_graph_finds_imports_inside_functions():
    # The checker itself: ``api.report`` imports wfpass.core.runtime inside a
    # function (and api imports it nowhere else); ``from ._torch import aot
    # as _aot`` is an edge to the submodule.
    assert "wfpass.core.runtime" in GRAPH["wfpass.api"]
    assert "wfpass._torch.aot" in GRAPH["wfpass.compiler"] and "wfpass" not in GRAPH["wfpass.compiler"]
    assert PRIVATE_LAYER in MODULES


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_private_layer_imports_nothing_from_wfpass():
    for mod, deps in GRAPH.items():
        if mod == PRIVATE_LAYER or mod.startswith(PRIVATE_LAYER + "."):
            outside = {d for d in deps if not (d == PRIVATE_LAYER or d.startswith(PRIVATE_LAYER + "."))}
            assert not outside, f"{mod} imports {sorted(outside)}"


# ``torch._x`` attribute access, ``_C.``, ``import torch._x``, ``from torch.a._b
# import ...``, ``from torch.a import _b`` and ``torch.nn.modules.x._Y``.
_PRIVATE = re.compile(
    r"\btorch\._[a-zA-Z]|\b_C\.|\b_VF\b|import torch(\.\w+)*\._|from torch(\.\w+)*\._"
    r"|from torch(\.\w+)* import .*\b_[a-zA-Z]|\bmodules\.\w+\._[a-zA-Z]"
    # nn.RNNBase's private weight bookkeeping
    r"|\._flat_weight|\._weights_have_changed|\._init_flat_weights")


def _code_lines(path):
    """Source lines without comments and docstrings (which name private API on purpose)."""
    src = path.read_text()
    tree = ast.parse(src)
    doc_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    for i, line in enumerate(src.splitlines(), 1):
        if i in doc_lines:
            continue
        yield i, line.split("#", 1)[0]


def test_private_torch_api_only_in_private_layer():
    found = []
    for mod, (path, _) in MODULES.items():
        if mod == PRIVATE_LAYER or mod.startswith(PRIVATE_LAYER + "."):
            continue
        for i, line in _code_lines(path):
            if _PRIVATE.search(line):
                found.append(f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", [
    "import torch._dynamo", "torch._C._nn.linear(x, w)", "from torch._inductor import config",
    "from torch.nn.modules.batchnorm import _BatchNorm", "x = torch._VF.lstm", "m._flat_weights_names",
])
def test_private_pattern_matches(line):
    assert _PRIVATE.search(line)


# The layers of docs/design/architecture.md, bottom first. A module may import
# modules of its own layer or below; pipeline.py, the bottom of "base",
# imports nothing else from wfpass.
LAYERS = [
    ("private torch", ("wfpass._torch",)),
    ("kernels", ("wfpass.native",)),
    ("base", ("wfpass.pipeline", "wfpass.config", "wfpass.core", "wfpass.core.stats", "wfpass.core.records", "wfpass.core.history", "wfpass.core.storage")),
    ("graph", ("wfpass.core.graph", "wfpass.core.bodies")),
    ("runtime", ("wfpass.core.notes", "wfpass.core.runtime", "wfpass.core.groups")),
    ("capture policy", ("wfpass.capture",)),
    ("formats", ("wfpass.formats", "wfpass.builtin", "wfpass.rnn", "wfpass.linear", "wfpass.prepack", "wfpass.batchnorm")),
    ("entry points", ("wfpass.compiler", "wfpass.api", "wfpass.deploy", "wfpass")),
    ("tools", ("wfpass.tools", "wfpass.__main__")),
]


def _layer(mod: str) -> int:
    # Longest prefix first; "wfpass" (the package's __init__) is only itself,
    # so a new module must be placed in a layer here before it passes.
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if mod == p or (p != "wfpass" and mod.startswith(p + "."))), default=None)
    assert best is not None, f"{mod} is in no layer of docs/design/architecture.md"
    return best[1]


def test_every_module_imports_only_its_layer_or_below():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
              for m, deps in GRAPH.items() for d in deps if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)
    assert not {d for d in GRAPH["wfpass.pipeline"]}, "pipeline.py imports nothing else from wfpass"


def test_no_public_name_is_a_submodule_name():
    # ``import wfpass.x`` binds ``wfpass.x`` to the submodule: a public
    # function of the same name would then depend on import order.
    import pkgutil

    import wfpass

    subs = {m.name for m in pkgutil.iter_modules(wfpass.__path__)}
    assert not subs & set(wfpass.__all__), subs & set(wfpass.__all__)
    assert all(callable(getattr(wfpass, n)) for n in wfpass.__all__)


def test_layer_list_matches_the_picture_in_architecture_md():
    # The picture in docs/design/architecture.md is the newcomer's map: each layer's
    # line there names the same modules as LAYERS here, in the same order.
    text = (ROOT.parent / "docs" / "design" / "architecture.md").read_text()
    picture = text.split("## Layers", 1)[1].split("```", 2)[1]
    lines = {}
    for line in picture.strip().splitlines():
        label, files = line[:15].strip(), line[15:].split()
        lines[label] = files
    doc_order = list(lines)[::-1]  # drawn top (tools) to bottom
    assert doc_order == [name for name, _ in LAYERS], doc_order

    def drawn(mod: str) -> str:
        if mod == "wfpass":
            return "__init__.py"
        last = mod.rsplit(".", 1)[1]
        return f"{last}/" if (ROOT / last).is_dir() else f"{last}.py"

    for name, prefixes in LAYERS:
        want = {drawn(p) for p in prefixes if p != "wfpass.__main__"}
        got = {f for f in lines[name] if f.endswith((".py", "/"))}
        assert want == got, (name, sorted(want ^ got))


# -- the rooms of wfpass/rnn/ (docs/design/architecture.md, "The RNN format's rooms") --

#: The most modules a folder under wfpass/ may hold. A module is a ``.py``
#: file directly in the folder, ``__init__.py`` not counted (nor files in
#: its sub-folders, which are counted as folders of their own). ``wfpass/``
#: itself, the package's layers (the picture above), is not a folder under
#: it and is not checked.
MAX_MODULES = 12

#: The RNN format's kernels, each device in a folder of its own.
RNN_KERNELS = ("wfpass.rnn.cpu", "wfpass.rnn.cuda")
#: What the kernels never import: the format's matcher, guards and rewrite,
#: the cell loops', the paths that choose between kernels, and the code that
#: runs while Dynamo captures an RNN or a packed batch. Of the format, a
#: kernel sees ``rnn.ops`` (how an RNN op is defined) and ``rnn.varlen.meta``.
RNN_FORMAT_SIDE = ("wfpass.rnn.match", "wfpass.rnn.guards", "wfpass.rnn.rewrite", "wfpass.rnn.capture",
                   "wfpass.rnn.eager_calls", "wfpass.rnn.paths", "wfpass.rnn.auto", "wfpass.rnn.eager",
                   "wfpass.rnn.cells", "wfpass.rnn.varlen.sequence")


def _crowded_folders(root: pathlib.Path, most: int = MAX_MODULES):
    """``{folder: modules}`` for every folder under ``root`` that holds more than ``most`` modules."""
    out = {}
    for folder in sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        mods = sorted(f.name for f in folder.glob("*.py") if f.name != "__init__.py")
        if len(mods) > most:
            out[folder.relative_to(root.parent).as_posix()] = mods
    return out


def _within(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _kernel_imports_of_format_side(graph):
    return sorted(f"{m} imports {d}" for m, deps in graph.items() if _within(m, RNN_KERNELS)
                  for d in deps if _within(d, RNN_FORMAT_SIDE))


def test_no_folder_under_wfpass_holds_more_than_twelve_modules():
    assert _crowded_folders(ROOT) == {}


def test_crowded_folder_check_finds_a_crowded_folder(tmp_path):
    # The checker itself: 13 modules and an __init__.py are one too many;
    # 12 and an __init__.py are not, nor files of a sub-folder.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for i in range(12):
        (pkg / f"m{i}.py").write_text("")
        (pkg / "sub" / f"s{i}.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    assert _crowded_folders(pkg) == {}
    (pkg / "sub" / "s12.py").write_text("")
    assert list(_crowded_folders(pkg)) == ["pkg/sub"]


def test_rnn_kernels_sit_in_folders_of_their_own():
    for pkg in RNN_KERNELS:
        path, is_pkg = MODULES[pkg]
        assert is_pkg and any(m.startswith(pkg + ".") for m in MODULES), pkg
    # A renamed module must not leave the rule below checking nothing.
    missing = [m for m in RNN_FORMAT_SIDE if m not in MODULES]
    assert not missing, missing


def test_rnn_kernels_never_import_the_format_s_matcher_or_rewrite():
    assert _kernel_imports_of_format_side(GRAPH) == []


def test_kernel_import_check_finds_a_kernel_importing_the_matcher():
    graph = {"wfpass.rnn.cpu.lstm_layer": {"wfpass.rnn.ops", "wfpass.rnn.varlen.meta"},
             "wfpass.rnn.cuda.cudnn": {"wfpass.rnn.cells.match"},
             "wfpass.rnn.paths": {"wfpass.rnn.match"}}
    assert _kernel_imports_of_format_side(graph) == ["wfpass.rnn.cuda.cudnn imports wfpass.rnn.cells.match"]


def test_every_cxx_source_and_header_ships_in_the_package():
    """A wheel or a non-editable install carries only the package-data globs
    of pyproject.toml: a C++ source or header the build names but the globs
    miss builds on a developer's checkout and fails on a user's machine."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    data = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["wfpass.native"]
    tree = ast.parse((ROOT / "native" / "__init__.py").read_text())
    named = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("_SOURCES", "_HEADERS") for t in node.targets):
            named += [e.value for e in node.value.elts]
    assert any(n.endswith(".h") for n in named) and any(n.endswith(".cpp") for n in named), named
    missed = [n for n in named if not any(fnmatch.fnmatch(n, g) for g in globs)]
    assert not missed, f"pyproject.toml's package-data for wfpass.native misses {missed}"
    on_disk = {p.relative_to(ROOT / "native").as_posix() for p in (ROOT / "native").rglob("*")
               if p.suffix in (".cpp", ".h")}
    assert on_disk == set(named), (on_disk, named)


# -- the layout's limits ------------------------------------------------------------------

MAX_ROOT_MODULES, MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CXX_FUNCTION_LINES = 12, 400, 60, 120


def test_package_root_holds_at_most_twelve_modules():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def _long_functions(src: str, most: int):
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(src))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > most]


def test_no_function_over_60_lines():
    long = {f"{p.relative_to(ROOT.parent)}:{name}": n for p in ROOT.rglob("*.py")
            for name, n in _long_functions(p.read_text(), MAX_FUNCTION_LINES)}
    assert not long, long


def _cxx_functions(text: str):
    """``(name, lines)`` of every function body in C++ source ``text``: a
    ``{`` opened outside any function whose statement has a ``)`` and is no
    namespace, class, struct, enum or union (comments, strings and
    preprocessor lines dropped first)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    out, stack, stmt, line = [], [], "", 1
    for ch in text:
        line += ch == "\n"
        if ch == "{":
            s = stmt.strip()
            head = s.split("(")[0]
            fn = (not any(k == "fn" for k, _, _ in stack) and ")" in s and not s.endswith("=")
                  and not re.search(r"\b(namespace|struct|class|enum|union)\b", head))
            names = re.findall(r"([\w:~]+)\s*\(", s)
            stack.append(("fn" if fn else "block", line, names[0] if names else s[:40]))
            stmt = ""
        elif ch == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "fn":
                    out.append((name, line - start + 1))
            stmt = ""
        elif ch == ";":
            stmt = ""
        else:
            stmt += ch
    return out


def test_cxx_function_check_measures_functions_not_namespaces():
    src = "namespace a {\nstruct S { int x; };\nint f(int y) {\n  if (y) {\n    return 1;\n  }\n  return 2;\n}\n}\n"
    assert _cxx_functions(src) == [("f", 6)]


def test_no_cxx_function_over_120_lines():
    long = {f"{p.relative_to(ROOT.parent)}:{name}": n for p in (ROOT / "native").rglob("*")
            if p.suffix in (".cpp", ".h") for name, n in _cxx_functions(p.read_text()) if n > MAX_CXX_FUNCTION_LINES}
    assert not long, long


def test_each_built_in_format_has_one_home():
    """A format's whole code is one folder under wfpass/ (its pipeline step
    included); the built-in order is one list, in wfpass/builtin.py."""
    from wfpass.builtin import BUILTIN_FORMATS

    homes = {"fuse_linears": "linear", "fold_cells": "rnn", "fuse_rnn": "rnn", "fp32_batchnorm": "batchnorm",
             "fold_batchnorm": "batchnorm", "prepack_linears": "prepack"}
    for f in BUILTIN_FORMATS:
        assert type(f).__module__.startswith(f"wfpass.{homes[f.name]}."), (f.name, type(f).__module__)
    assert not (ROOT / "passes").exists()


def test_kernels_import_only_the_private_torch_layer():
    """The C++ kernels' package (``wfpass.native``) never imports a format's
    match, guards or rewrite, nor anything above the private torch layer."""
    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if _within(m, ("wfpass.native",))
                 for d in deps if not _within(d, ("wfpass.native", PRIVATE_LAYER)))
    assert bad == []


def test_each_op_schema_is_written_once_in_the_schema_table():
    """No schema text outside ``wfpass/native/schemas.py``: Python defines
    ops through ``schemas.define`` (or ``define_rnn_op``, which reads the
    table), C++ through the ``WFPASS_SCHEMA_*`` macros the build writes
    from it. A literal ``define("name(...")`` / ``m.def("name(...")`` would
    be a second home for a schema."""
    literal = re.compile(r"""(\.define|m\.def)\(\s*f?["'][A-Za-z_]\w*\(""")
    found = [f"{p.relative_to(ROOT.parent)}:{n + 1}" for p in sorted(ROOT.rglob("*"))
             if p.suffix in (".py", ".cpp", ".h") and p.name != "schemas.py"
             for n, line in enumerate(p.read_text().splitlines()) if literal.search(line)]
    assert found == []


def test_every_registered_op_comes_from_the_table():
    """The ops torch knows under ``wfpass::`` (the C++ library loaded, every
    op module imported) are exactly the table's, with its schemas."""
    import torch

    import wfpass.native as native
    from wfpass.native import schemas
    from wfpass.rnn.cpu import lstm_layer, native_layer, varlen_layer, varlen_lstm_runs  # noqa: F401
    from wfpass.rnn.cuda import cudnn, cudnn_varlen  # noqa: F401
    from wfpass.rnn.varlen import pad_ops, sequence  # noqa: F401
    from wfpass.prepack import kernel  # noqa: F401
    from wfpass.linear import kernel as _linear_kernel  # noqa: F401

    if native.load() is not None:
        pytest.skip(f"C++ kernels not loaded here: {native.load()}")
    registered = {str(s)[len("wfpass::"):] for s in torch._C._jit_get_all_schemas() if s.name.startswith("wfpass::")}
    table = {name + schema for name, schema in [*schemas.SCHEMAS.items(),
                                                *(kv for n, b in schemas._WITH_TWINS.items()
                                                  for kv in schemas.twins(n, b).items())]}
    assert registered == table
