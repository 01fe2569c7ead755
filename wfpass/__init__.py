"""wfpass: weight formats inside the PyTorch compiler.

    model = torch.compile(model, backend="wformat")
    print(wfpass.report(model))
"""
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "apply", "backend", "explain", "export", "last_report", "report", "restore",
    "register_format", "unregister_format", "registered_formats",
    "Config", "LinearOptions", "RnnOptions", "PrepackOptions", "Format", "ParamFormat", "Record", "Report",
]


def _load_api() -> None:
    """Import the public API (and with it torch) into this namespace."""
    from ._torch import versions

    versions.check()  # a clear error on a torch wfpass does not run on, before any private API is touched
    from .api import apply, explain, report, restore
    from .compiler import backend, last_report
    from .config import Config, LinearOptions, PrepackOptions, RnnOptions
    from .deploy.program import export
    from .formats import Format, ParamFormat, register_format, registered_formats, unregister_format
    from .core.records import Record, Report

    from . import native

    native.load_if_built()  # an exported program loaded in a fresh process calls the C++ kernels, when built

    # No public name is also a submodule's (tests/test_architecture.py checks),
    # so importing a submodule never rebinds one of these.
    globals().update({k: v for k, v in locals().items() if k in __all__})


def _started_by_cli() -> bool:
    # ``python -m wfpass --help`` must answer in well under a second, and
    # importing torch takes seconds. Python imports this package before it
    # runs wfpass/__main__.py and sets sys.argv[0] to "-m" while it does so:
    # only then is the API left to load on first use (the CLI's commands load
    # it). Every other import of wfpass loads it at once, as always.
    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] != ["-m"] or "-m" not in argv:
        return False
    return argv[argv.index("-m") + 1:argv.index("-m") + 2] == [__name__]


if TYPE_CHECKING:
    from .api import apply, explain, report, restore
    from .compiler import backend, last_report
    from .deploy.program import export
    from .config import Config, LinearOptions, PrepackOptions, RnnOptions
    from .formats import Format, ParamFormat, register_format, registered_formats, unregister_format
    from .core.records import Record, Report

def __getattr__(name: str):
    if name == "PackOptions":  # the earlier name of PrepackOptions: config says so, with a DeprecationWarning
        from . import config

        return config.PackOptions
    if name in __all__:  # only when started by the CLI, which loads the API on first use
        _load_api()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_by_cli():
    _load_api()
