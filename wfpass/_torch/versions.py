"""Which torch releases wfpass runs on, checked when wfpass is imported.

wfpass leans on private PyTorch API (everything else in ``wfpass/_torch``),
which changes between releases. The range below is the one its whole test
suite passes on: 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (the CUDA builds run on
the CPU too). Older releases lack API wfpass calls, so importing wfpass
there fails at once with this module's message, never with an
``AttributeError`` from deep inside a private module. Newer releases are
let through with a warning: most of wfpass may still work, and a user
should hear that it was not tested.

Imports nothing from wfpass.
"""
from __future__ import annotations

import re
import warnings
from typing import Tuple

import torch

__all__ = ["OLDEST", "NEWEST_TESTED", "TESTED", "torch_version", "check", "UnsupportedTorchWarning"]

#: The oldest release wfpass runs on, and the newest its suite passed on.
OLDEST: Tuple[int, int] = (2, 11)
NEWEST_TESTED: Tuple[int, int] = (2, 15)
#: The exact releases the suite ran on.
TESTED = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchWarning(UserWarning):
    """torch is newer than any release wfpass was tested on."""


def torch_version(text: str = "") -> Tuple[int, int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15, 0)``; pre-releases and local tags
    count as their release (``2.16.0.dev20261101`` -> ``(2, 16, 0)``)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or torch.__version__)
    if m is None:
        raise ImportError(f"wfpass cannot read this torch's version {text or torch.__version__!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]} (tested: {', '.join(TESTED)})"


def check(text: str = "") -> None:
    """Raise ImportError on a torch older than ``OLDEST``; warn
    (``UnsupportedTorchWarning``) on one newer than ``NEWEST_TESTED``."""
    version = text or torch.__version__
    v = torch_version(version)
    if v[:2] < OLDEST:
        raise ImportError(f"wfpass needs torch {OLDEST[0]}.{OLDEST[1]} or newer; this is torch {version}. "
                          f"wfpass runs on torch {_range()}.")
    if v[:2] > NEWEST_TESTED:
        warnings.warn(f"wfpass was tested on torch {_range()}; this is torch {version}. It may work: "
                      f"where a compile fails inside wfpass, compile without backend='wformat' and report it.",
                      UnsupportedTorchWarning, stacklevel=3)
