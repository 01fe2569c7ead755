"""One summary of the pages ``bench_gpu.py`` wrote, per model and mode:
how many (T, batch) points, and wformat's speed against eager and against
``torch.compile``'s default (Inductor) over them: the lowest, the median and
the highest ratio, with and without CUDA graphs. A point measured in two
pages counts once per page (each is one interleaved measurement).

    python benchmarks/gpu/gpu_summary.py docs/results/gpu_grid_h100_run1.md docs/results/gpu_grid_h100_run2.md
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from wfpass.tools.tables import markdown_table  # noqa: E402

Key = Tuple[str, str]  # (model, "training step" | "inference")


def read_pages(paths: List[str]) -> Dict[Key, List[dict]]:
    """Every table row of every page: ``{(model, mode): [{column: text}]}``."""
    rows: Dict[Key, List[dict]] = {}
    for path in paths:
        key = None
        head: List[str] = []
        for line in open(path):
            m = re.match(r"### (.+), (training step|inference)\s*$", line)
            if m:
                key, head = (m.group(1), m.group(2)), []
                continue
            if key is None or not line.startswith("|"):
                if line.startswith("#"):
                    key = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not head:
                head = cells
            elif not set(cells[0]) <= set("-: "):
                rows.setdefault(key, []).append(dict(zip(head, cells)))
    return rows


def _ratios(rows: List[dict], base: str, ours: str) -> List[float]:
    out = []
    for r in rows:
        try:
            out.append(float(r[base]) / float(r[ours]))
        except (KeyError, ValueError, ZeroDivisionError):
            pass
    return out


def _span(v: List[float]) -> str:
    if not v:
        return "-"
    return f"{min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}"


def summary(rows: Dict[Key, List[dict]]) -> str:
    lines = []
    for (model, mode), rs in rows.items():
        points = len({(r.get("T"), r.get("batch")) for r in rs})
        lines.append([model, mode, f"{len(rs)} ({points})", _span(_ratios(rs, "eager", "wformat")),
                      _span(_ratios(rs, "Inductor", "wformat")),
                      _span(_ratios(rs, "eager", "wformat + CUDA graphs"))])
    return markdown_table(["model", "step", "measurements (points)", "vs eager (low / median / high)", "vs Inductor",
                           "with CUDA graphs, vs eager"], lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="+")
    print(summary(read_pages(ap.parse_args().pages)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
