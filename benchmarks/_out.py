"""How a benchmark script ends: print its table and, with ``--out``, write
it there (the command that made it is the table's first line)."""
from __future__ import annotations

from typing import Optional, Sequence, Union


def emit(table: Union[str, Sequence[str]], out: Optional[str]) -> int:
    """Print ``table`` (text, or its lines), write it to ``out`` if given;
    the script's exit status."""
    text = table if isinstance(table, str) else "\n".join(table) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0
