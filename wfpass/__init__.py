"""wfpass: weight formats inside the PyTorch compiler.

    model = torch.compile(model, backend="wformat")
    print(wfpass.report(model))
"""
from .api import apply, explain, report, restore
from .backend import backend, last_report
from .config import Config
from .formats import Format, ParamFormat, register_format, registered_formats, unregister_format
from .report import Record, Report

__all__ = [
    "apply", "backend", "explain", "last_report", "report", "restore",
    "register_format", "unregister_format", "registered_formats",
    "Config", "Format", "ParamFormat", "Record", "Report",
]
__version__ = "0.1.0"
