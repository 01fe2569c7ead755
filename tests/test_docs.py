"""The docs cite tests by name (`file.py::test_name`, and `::test_name` after
a file): every cited test must exist, so a renamed or deleted test cannot
leave a guarantee pointing at nothing."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def _id(p):
    return p.relative_to(ROOT).as_posix()


def _citations(text: str):
    out = []
    # `file.py::test_a` optionally followed by `, `::test_b`` continuations
    # (possibly with parameter ids) in the same cell or sentence.
    for m in re.finditer(r"`(test_\w+\.py)::(test_\w+)[^`]*`((?:[^`|]*?`::test_\w+[^`]*`)*)", text):
        out.append((m.group(1), m.group(2)))
        out += [(m.group(1), n) for n in re.findall(r"`::(test_\w+)", m.group(3))]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_every_cited_test_exists(doc):
    cites = _citations(doc.read_text())
    missing = []
    for f, name in cites:
        # Test files sit in folders that mirror the package; a citation names the file.
        found = sorted((ROOT / "tests").rglob(f))
        path = found[0] if len(found) == 1 else ROOT / "tests" / f
        if not path.exists() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{f}::{name}")
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


def test_the_guarantees_page_cites_tests():
    # The parser above must find the page's citations (else the check is empty).
    assert len(_citations((ROOT / "docs" / "design" / "invariants.md").read_text())) > 100


# -- the docs speak to users ---------------------------------------------------------

PAGES = sorted((ROOT / "docs").rglob("*.md"))
# Pages written by hand: every page of guide/ and design/ (results/ holds
# tables a benchmark wrote).
PROSE = ["index.md"] + sorted(
    p.relative_to(ROOT / "docs").as_posix() for d in ("guide", "design") for p in (ROOT / "docs" / d).glob("*.md")
)
TERMS = ["Dynamo", "FX graph", "ATen", "AOTAutograd", "Inductor", "GEMM", "prepacked weights", "variable-length batch", "oneDNN", "cuDNN"]


def test_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file()):
        rel = page.relative_to(ROOT / "docs").as_posix()
        if rel != "index.md":
            assert f"]({rel})" in index, f"docs/index.md does not list {rel}"
    # Results pages and their data live under results/ only; nothing is left flat.
    assert not [p.name for p in (ROOT / "docs").glob("*") if p.name not in ("index.md", "guide", "design", "results")]
    assert len(PROSE) > 10 and {"guide/install.md", "design/invariants.md", "design/kernel_choices.md"} <= set(PROSE)


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_no_words_about_how_the_project_is_organised(doc):
    # Readers want the software, not the story of its making.
    text = doc.read_text()
    banned = r"\b(issues?|sessions?|lent|helpers?|the lead|second run of the team|could not be carried|first written|first version of this page)\b"
    found = [m.group(0) for m in re.finditer(banned, text, re.I)]
    assert not found, f"{doc.name}: {found}"


def test_terms_are_defined_once_in_the_index_and_linked_from_every_prose_page():
    index = (ROOT / "docs" / "index.md").read_text()
    terms = index.split("## Terms", 1)[1]
    for term in TERMS:
        assert f"- **{term}**" in terms, term
    assert len(PROSE[1:]) > 10
    for name in PROSE[1:]:
        text = (ROOT / "docs" / name).read_text()
        assert "index.md#terms" in text, f"{name} uses the terms without pointing to their definitions"
        # Defined in one place: no page repeats a definition in brackets.
        for phrase in ("(PyTorch's tensor operators)", "(Intel's CPU kernel library", "front end, which records"):
            assert phrase not in text, (name, phrase)


def test_defaults_stated_in_the_docs_are_the_code_s():
    from wfpass.config import DEFAULT_SEQ_THRESHOLD, Config

    cpu, rows = DEFAULT_SEQ_THRESHOLD["cpu"], Config().linear.fused_max_rows
    assert Config().rnn.seq_threshold is None
    rnn = (ROOT / "docs" / "guide" / "rnn.md").read_text()
    assert f"default `None`: **{cpu}** on the CPU" in rnn and f"default {cpu} on the CPU" in rnn
    assert f"default N = {DEFAULT_SEQ_THRESHOLD['cuda']}" in rnn.replace("CUDA default N", "default N")
    readme = (ROOT / "docs" / "guide" / "options.md").read_text()
    assert f"`seq_threshold`, RNN calls with at most this many time steps run the per-step loop, longer ones the fused kernel (default `None`: {cpu} on the CPU" in readme
    assert f"`fused_max_rows`, the largest row count for which `\"auto\"` takes the one GEMM (default {rows})" in readme
    assert f"`fused_max_rows` (default {rows})" in (ROOT / "docs" / "guide" / "linear.md").read_text()


def test_every_option_of_config_is_in_the_options_table():
    import dataclasses

    from wfpass.config import Config

    from wfpass.config import _FLAT

    readme = (ROOT / "docs" / "guide" / "options.md").read_text()
    for f in dataclasses.fields(Config):
        if f.name in _FLAT:  # deprecated flat names: one row that names them all
            assert f"`{f.name}`" in readme.split("| `dry_run` |", 1)[1].split("\n\n", 1)[0], f.name
        else:
            assert f"| `{f.name}` |" in readme, f.name


def test_write_your_own_format_quotes_the_example_verbatim():
    page = (ROOT / "docs" / "guide" / "write_your_own_format.md").read_text()
    example = (ROOT / "examples" / "channels_last_conv.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 4
    for block in blocks:
        assert block in example, f"not in examples/channels_last_conv.py:\n{block}"
    # The members the page's table explains are the ones ParamFormat has.
    import wfpass

    for member in ("name", "targets", "roles", "to_format", "from_format", "check", "kernel"):
        assert f"| `{member}" in page and hasattr(wfpass.ParamFormat, member), member


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\((?!https?://|#)([^)#]+)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{_id(doc)} links to a missing {target}"


def test_the_link_check_sees_links():
    # The check above must find links to check (else it passes on nothing).
    assert len(re.findall(r"\]\((?!https?://|#)([^)#]+)", (ROOT / "docs" / "index.md").read_text())) > 80


def test_no_page_is_too_long():
    # Pages a reader can finish: no docs page over 400 lines, the README at most 150.
    long = {_id(p): n for p in PAGES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


NARRATION = r"\b(last session|we then|we now|was changed|were changed|used to be|no longer|previously|earlier versions?|an earlier run|before this|since then|predates?)\b"


@pytest.mark.parametrize("doc", [ROOT / "docs" / p for p in PROSE], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_guide_and_design_pages_state_what_is_true_now(doc):
    # The story of how wfpass got here belongs in the git log, not in the pages a user reads.
    found = [m.group(0) for m in re.finditer(NARRATION, doc.read_text(), re.I)]
    assert not found, f"{_id(doc)}: {found}"


def test_results_pages_say_their_machine_and_command():
    for page in sorted((ROOT / "docs" / "results").glob("*.md")):
        text = page.read_text()
        assert re.search(r"(Machine:|AMD EPYC|Intel Xeon|GenuineIntel|AuthenticAMD|NVIDIA H[12]00|not recorded)", text), _id(page)
        assert re.search(r"python (-m wfpass|benchmarks/)", text), _id(page)


# -- every figure a reader meets names its source ------------------------------------

#: A measured figure: a number (or a range) with a unit of time, size or speed-up.
FIGURE = re.compile(r"(?<![\w.±-])[±~]?\d+(?:\.\d+)?(?:\s?(?:-|–|to)\s?\d+(?:\.\d+)?)?\s?"
                    r"(?:(?:x|ms|µs|us|s|GB|MB|KB|GiB|MiB|KiB)\b|%)")
RESULTS_LINK = re.compile(r"\]\((?:\.\./|docs/)results/[^)]+\)")
FIGURE_PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs" / "guide").glob("*.md"))


def _sections(text: str):
    """The page's sections (split at headings, code blocks left out), each a
    list of its blocks: paragraphs, bullets and table rows."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for section in re.split(r"^#+ .*$", text, flags=re.M):
        blocks, block = [], []
        for line in section.splitlines():
            s = line.strip()
            if (not s or s.startswith("|") or re.match(r"([-*]|\d+\.) ", s)) and block:
                blocks.append("\n".join(block))
                block = []
            if s.startswith("|"):
                blocks.append(s)
            elif s:
                block.append(s)
        if block:
            blocks.append("\n".join(block))
        yield blocks


def _figures(block: str):
    return FIGURE.findall(re.sub(r"`[^`]*`", "", block))  # not the numbers of code and options


@pytest.mark.parametrize("doc", FIGURE_PAGES, ids=_id)
def test_every_figure_links_the_results_page_it_comes_from(doc):
    # A measured figure in the README or a guide page sits in a paragraph,
    # bullet or table row that links its results page, or in a section that does.
    unsourced = []
    for blocks in _sections(doc.read_text()):
        if any(RESULTS_LINK.search(b) for b in blocks):
            continue
        unsourced += [f"{_figures(b)}: {b[:120]}" for b in blocks if _figures(b)]
    assert not unsourced, f"{_id(doc)}: figures without a link to docs/results/: {unsourced}"


def test_the_figure_check_sees_figures():
    # The check above must find figures, in the README's table and the guide's prose alike.
    readme = [b for s in _sections((ROOT / "README.md").read_text()) for b in s if _figures(b)]
    assert len(readme) >= 6 and all(RESULTS_LINK.search(b) for b in readme if b.startswith("| "))
    guide = [b for p in FIGURE_PAGES[1:] for s in _sections(p.read_text()) for b in s if _figures(b)]
    assert len(guide) > 20
    assert _figures("2.0x faster, 15-29 µs, 4.7 MB, 31 s and ±5%") == ["2.0x", "15-29 µs", "4.7 MB", "31 s", "±5%"]
    assert not _figures("float32, x86_64, T 16, 8x3x32x32, `--pool-mib 18`, 3 steps")
