"""The one way wfpass's tools write a markdown table: ``tabulate``'s GitHub
format, every cell kept as the text it was given (no number parsing, so
"1.00" stays "1.00")."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """``headers`` and ``rows`` as a GitHub markdown table, one line per row."""
    from tabulate import tabulate

    return tabulate([[str(c) for c in row] for row in rows], headers=list(headers), tablefmt="github",
                    disable_numparse=True)
