"""The prose quotes the recorded results, never types them: the check of every figure link.

Prose (README, ``docs/``, ``benchmarks/README.md``, the notebooks' markdown) quotes a
figure as a *figure link*, whose title says how the number is derived from the result
file it links to (:mod:`numba_sc.tools.results`)::

    MinkUNet42 runs at [0.89x](benchmarks/results/net_scans.json "ratio(run(r, net='minkunet42', cloud='kitti', dtype='float16'))")
    of spconv's time.

The link opens the file; the title is a Python expression evaluated with ``r`` bound
to that file's content and the small vocabulary of :data:`numba_sc.tools.results.VOCABULARY`.
A figure link's text may hold several numbers (``0.78-0.81x``): the expression then gives as
many (``span(...)`` gives the smallest and the largest of a list). :func:`check_prose`
compares every figure link's numbers with what its expression gives, rounded as the
text rounds them, and reports performance figures typed outside figure links (a
ratio such as ``2.6x``, a time such as ``12 ms``, a rate such as ``3 TB/s``); a
paragraph that must type one (a napkin estimate, a probe's or a profiler's reading
that no result file holds) says why with ``<!-- typed: REASON -->``. ``numba-sc figures`` runs the
check; ``numba-sc figures --update`` rewrites stale figure links from the files
(after a benchmark was run again), keeping each text's rounding.

A whole table is made, not typed: ``<!-- table: NAME.json CALL -->``, the table,
``<!-- /table -->``, where ``CALL`` is one of :mod:`numba_sc.tools.tables` applied to
the file (``network_table(r)``); the check makes it again and compares.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.files import write_text
from . import results
from .results import VOCABULARY, evaluate, load
from .tables import TABLES

__all__ = ["Finding", "check_prose", "prose_files", "render_table", "update_prose"]

# A figure link: [text](path/to/benchmarks/results/NAME.json "expression") (the path relative to
# the prose's own folder, as a link must be).
FIGURE_LINK = re.compile(r'\[([^\]\n]+)\]\(([^)\s]*results/([^)\s]+\.json))\s+"([^"\n]+)"\)')
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# What a performance figure typed by hand looks like: a ratio (2.6x, 0.78 x), a time
# (12 ms, 48 us), a rate (3 TB/s, 120 scans/s), a fraction of the peak.
TYPED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x(?![\w])|\s?(?:ns|us|µs|ms)\b|\s?(?:[KMGT]B|TFLOP|GFLOP|scans|steps|voxels|points)/s\b)")
TYPED_OK = re.compile(r"<!--\s*typed:\s*\S[^>]*-->")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# A generated table: <!-- table: NAME.json CALL -->, the table, <!-- /table -->.
TABLE = re.compile(r"<!-- table: (\S+\.json) (.+?) -->\n(.*?)\n?<!-- /table -->", re.S)


def render_table(name: str, call: str, results_dir=None) -> str:
    """The markdown table ``call`` (e.g. ``network_table(r)``, :mod:`numba_sc.tools.tables`)
    makes from the result file ``name``."""
    return eval(call, dict(VOCABULARY, **TABLES, r=load(name, results_dir), __builtins__={}))  # noqa: S307



def prose_files(root=None):
    """The prose this project publishes: README.md, ``docs/*.md``, benchmarks/README.md and
    the notebooks' markdown cells (of the checkout, or of ``root``)."""
    root = Path(root) if root is not None else results.ROOT
    files = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()] + sorted((root / "notebooks").glob("*.ipynb"))


def _where(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(results.ROOT))
    except ValueError:
        return str(path)


def _texts(path: Path):
    """(where, markdown text) for each piece of prose in ``path``: the file, or a notebook's cells."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "markdown":
                src = cell["source"]
                yield f"{_where(path)} cell {i}", "".join(src) if isinstance(src, list) else src
    else:
        yield _where(path), path.read_text()


def _decimals(text: str) -> int:
    mantissa = text.partition("e")[0]
    return len(mantissa.rpartition(".")[2]) if "." in mantissa else 0


def _matches(shown: str, value: float) -> bool:
    """Does the number as typed (``"0.89"``, ``"1,250"``, ``"6.0e-05"``) equal ``value``
    rounded as it is?"""
    d = _decimals(shown)
    unit = 10.0 ** (int(shown.partition("e")[2]) - d) if "e" in shown else 10.0 ** -d
    return abs(float(shown.replace(",", "")) - value) <= 0.5 * unit + 1e-9 * abs(value)


def _format_like(shown: str, value: float) -> str:
    d = _decimals(shown)
    if "e" in shown:
        return f"{value:.{d}e}"
    return f"{value:,.{d}f}" if "," in shown else f"{value:.{d}f}"


@dataclass(frozen=True)
class Finding:
    """One problem in the prose: where, what was written, what the results say."""

    where: str
    text: str
    problem: str

    def __str__(self):
        return f"{self.where}: {self.text!r}: {self.problem}"


def _figures(text):
    """The figure links of ``text`` outside code: (match, its numbers as typed)."""
    masked = CODE.sub(lambda m: " " * len(m.group()), text)
    for m in FIGURE_LINK.finditer(masked):
        yield m, NUMBER.findall(m.group(1))


def _check_link(m, shown, results_dir):
    name, expression = m.group(3), m.group(4)
    try:
        values = evaluate(expression, load(name, results_dir))
    except Exception as err:  # a stale expression is a finding, not a crash
        return f"{name}: {expression!r} fails: {type(err).__name__}: {err}"
    if len(values) != len(shown):
        return f"the text shows {len(shown)} numbers, {expression!r} gives {len(values)}"
    wrong = [f"{s} (the file gives {v:.4g})" for s, v in zip(shown, values) if not _matches(s, v)]
    return f"stale: {', '.join(wrong)}" if wrong else None


def check_prose(files=None, results_dir=None) -> list:
    """Every problem with the figures of ``files`` (default :func:`prose_files`): figure
    links whose numbers differ from their result file's, or whose expression fails; and
    performance figures typed outside figure links. Returns :class:`Finding` s (none: all
    good)."""
    findings = []
    for path in (prose_files() if files is None else [Path(f) for f in files]):
        for where, text in _texts(Path(path)):
            for m, shown in _figures(text):
                problem = _check_link(m, shown, results_dir)
                if problem:
                    findings.append(Finding(where, m.group(1), problem))
            for m in TABLE.finditer(text):
                try:
                    made = render_table(m.group(1), m.group(2), results_dir)
                except Exception as err:
                    findings.append(Finding(where, m.group(2), f"the table fails: {type(err).__name__}: {err}"))
                    continue
                if made.strip() != m.group(3).strip():
                    findings.append(Finding(where, m.group(2), f"stale table: {m.group(1)} now makes another "
                                            "(numba-sc figures --update writes it again)"))
            # Typed figures: everything outside code, figure links and marked lines.
            bare = TABLE.sub(lambda m: " " * len(m.group()), text)
            bare = CODE.sub(lambda m: " " * len(m.group()), bare)
            bare = FIGURE_LINK.sub(lambda m: " " * len(m.group()), bare)
            for paragraph in re.split(r"\n\s*\n", bare):
                if TYPED_OK.search(paragraph):
                    continue
                for t in TYPED.finditer(paragraph):
                    findings.append(Finding(where, t.group(), "a performance figure typed by hand: quote it "
                                            "as a figure link to its result file (numba_sc.tools.prose), or "
                                            "say why its paragraph types it with <!-- typed: REASON -->"))
    return findings


def _update_tables(text, results_dir, where, changed):
    def again(m):
        try:
            made = render_table(m.group(1), m.group(2), results_dir)
        except Exception:
            return m.group()
        if made.strip() == m.group(3).strip():
            return m.group()
        changed.append(Finding(where, m.group(2), "table written again"))
        return f"<!-- table: {m.group(1)} {m.group(2)} -->\n{made}\n<!-- /table -->"
    return TABLE.sub(again, text)


def _update_text(text, results_dir, where, changed):
    text = _update_tables(text, results_dir, where, changed)
    out, last = [], 0
    for m, shown in _figures(text):
        try:
            values = evaluate(m.group(4), load(m.group(3), results_dir))
        except Exception:
            continue
        if len(values) != len(shown) or all(_matches(s, v) for s, v in zip(shown, values)):
            continue
        it = iter(values)
        new = NUMBER.sub(lambda n: _format_like(n.group(), next(it)), m.group(1))
        out.append(text[last:m.start(1)] + new)
        last = m.end(1)
        changed.append(Finding(where, m.group(1), f"-> {new}"))
    return "".join(out) + text[last:] if out else text


def update_prose(files=None, results_dir=None) -> list:
    """Rewrite each stale figure link's numbers from its result file, keeping the text's
    rounding; returns the :class:`Finding` s it changed (links whose expression fails are
    left for a person to mend)."""
    changed = []
    for path in (prose_files() if files is None else [Path(f) for f in files]):
        path = Path(path)
        if path.suffix == ".ipynb":
            nb = json.loads(path.read_text())
            before = len(changed)
            for i, cell in enumerate(nb["cells"]):
                if cell["cell_type"] == "markdown":
                    src = cell["source"]
                    text = "".join(src) if isinstance(src, list) else src
                    new = _update_text(text, results_dir, f"{_where(path)} cell {i}", changed)
                    if new != text:
                        cell["source"] = new.splitlines(keepends=True)
            if len(changed) > before:  # written the way Jupyter writes notebooks
                write_text(path, json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        else:
            text = path.read_text()
            new = _update_text(text, results_dir, _where(path), changed)
            if new != text:
                write_text(path, new)
    return changed
