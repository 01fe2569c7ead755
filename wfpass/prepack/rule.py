"""The decision rule: from the rounds' ratios of each candidate kernel to the
plain GEMM (the op's own call included), the kernel one linear shape runs,
and whether the rounds can decide at all.

Separate from ``choose.py``, which times the candidates, keeps the decisions
in the process and in ``choices.json`` and reads them back: the rule reads
nothing but a decision's ``ratios`` (and ``noisy``), so it can be read, and
tested, on ratios alone. ``choose``'s docstring says why the rule is what it
is (lightest first; a gain clear of the noise); ``choose`` re-exports these
names (``choose.MARGIN``, ``choose._best``, ``choose._settled``, ...), and
a change to the rule changes ``choose.RULE`` too.
"""
from __future__ import annotations

import statistics
from typing import Callable, List, Optional, Tuple

__all__ = ["MARGIN", "MKL_MARGIN", "COPY_FREE", "copy_free", "best", "settled"]

#: A packed kernel's median round must take at most this fraction of the
#: plain GEMM's time.
MARGIN = 0.85

#: The same for MKL's packed SGEMM, whose copy is made for one row count
#: and is several times larger than the weight (against the plain GEMM and
#: against oneDNN). Its gains at one row on a 2752x256 weight sat between
#: 0.86x and 1.04x in the median here; at 0.85 a process in five took it.
MKL_MARGIN = 0.75

#: The kernels in the order they are taken (lightest first: see
#: ``choose``'s docstring), each with the margin it must gain.
_CHALLENGERS = (("direct", MARGIN), ("brgemm", MARGIN), ("onednn", MARGIN), ("mkl", MKL_MARGIN))


#: The kernels that read the parameter itself and need no copy.
COPY_FREE = ("plain", "direct")


def copy_free(d) -> str:
    """The best of the kernels that need no copy, by the same rule:
    ``"direct"`` where it gains the margin over the plain GEMM, else
    ``"plain"``. What runs where a copy is not allowed (``prepack.max_bytes=0``)
    or would go over the budget."""
    return "plain" if d.noisy else best(d, only=COPY_FREE)


def best(d, pick: Callable[[List[float]], float] = statistics.median,
         vs_plain: Optional[float] = None, only: Optional[Tuple[str, ...]] = None) -> str:
    """The plain GEMM, unless a packed kernel's gain is clear (see ``choose``'s
    docstring); a copy's kernel, only where it is clearly faster than the
    direct kernel too wherever that one is at least level with the plain
    GEMM. Against the plain GEMM, ``pick`` reads the rounds (the
    median; a quartile for ``settled``) and ``vs_plain`` replaces the
    margins; a later packed kernel must beat the one taken so far, round by
    round, in the median by its margin and in the upper quartile at least
    level, else the one taken so far stays. ``only``: the kernels allowed."""
    out = "plain"
    for name, margin in _CHALLENGERS:
        if only is not None and name not in only:
            continue
        rs = d.ratios.get(name)
        if not rs:
            continue
        if out == "plain":
            if _clear(rs, margin if vs_plain is None else vs_plain, pick):
                out = name
            continue
        rel = [x / y for x, y in zip(rs, d.ratios[out])]
        if _clear(rel, margin) and _clear(rel, 1.0, _quartile(3)):
            out = name
    if vs_plain is None and out not in COPY_FREE and (only is None or "direct" in only):
        # A copy is made only where its kernel is clearly faster than what
        # runs without one: where the direct kernel is at least level with
        # the plain GEMM in three rounds of four (its gain under the margin,
        # so it was not taken above), the copy's kernel must also gain the
        # margin over the direct kernel, else the direct kernel runs. On the
        # 1 GB bf16 LLaMA's Q/K/V block at 16 rows oneDNN's copy took 1126
        # us, the direct kernel 1154, the plain GEMM 1357: 132 MiB of copies
        # for 2.4% (docs/results/decode_sizes_amx_1thread.md).
        rd = d.ratios.get("direct")
        if rd and _clear(rd, 1.0, _quartile(3)):
            rel = [x / y for x, y in zip(d.ratios[out], rd)]
            if not _clear(rel, dict(_CHALLENGERS)[out]):
                out = "direct"
    return out


def _clear(ratios: List[float], margin: float, pick: Callable[[List[float]], float] = statistics.median) -> bool:
    """A median round (or ``pick``'s) at most ``margin``."""
    return bool(ratios) and pick(ratios) <= margin


def _quartile(q: int) -> Callable[[List[float]], float]:
    def pick(rs: List[float]) -> float:
        s = sorted(rs)
        return s[q * (len(s) - 1) // 4]
    return pick


def settled(d) -> bool:
    """Can these rounds decide? A packed kernel whose median round gains the
    margin decides where its upper-quartile round is no slower than the
    plain GEMM (three rounds in four at least level); the plain GEMM decides
    where the lower-quartile round does not gain the margin either. Anything
    else (a median gain with slower rounds past the upper quartile, a lower
    quartile inside the margin) is measured again, then left to the plain
    GEMM.

    Rule 6 asked the upper quartile for the margin (0.85) too. With the
    candidates in one fixed order (``timing._interleaved_rounds``) that
    changes no clear gain: in 10 fresh processes timing the bench decoder's
    shapes, every clear gain's upper quartile was within the margin anyway;
    it settles near-ties instead (8 of 120 decisions there had a median
    within the margin and an upper quartile in 0.86-0.91,
    docs/choice_spread.md), which rule 6 measured again and then left to
    the plain GEMM."""
    if best(d) != "plain":
        return best(d, _quartile(3), vs_plain=1.0) != "plain"
    return best(d, _quartile(1)) == "plain"
