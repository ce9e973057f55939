"""One source for every number: the recorded results, and the prose that quotes them.

Every performance figure this project states comes from a result file in
``benchmarks/results/`` (the latest run of each benchmark under a stable name, older
runs still cited in ``archive/``; ``paper.json`` holds the figures the Minuet paper
reports, with their section). Notebooks compute what they show from those files with
:func:`load`; prose (README, ``docs/``, ``benchmarks/README.md``, the notebooks'
markdown) quotes a figure as a *figure link*, whose title says how the number is
derived from the file it links to::

    MinkUNet42 runs at [0.89x](benchmarks/results/net_scans.json "ratio(run(r, net='minkunet42', cloud='kitti', dtype='float16'))")
    of spconv's time.

The link opens the file; the title is a Python expression evaluated with ``r`` bound
to that file's content and the small vocabulary below (:data:`VOCABULARY`). A figure
link's text may hold several numbers (``0.78-0.81x``): the expression then gives as
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
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..core.files import write_text

__all__ = ["RESULTS_DIR", "VOCABULARY", "Finding", "check_prose", "evaluate", "load", "prose_files",
           "provenance", "update_prose"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(os.environ.get("NUMBA_SC_RESULTS", ROOT / "benchmarks" / "results"))


def load(name: str, results_dir=None) -> dict:
    """The result file ``name`` (``"net_scans"``, ``"archive/map_h100_2026-11-22"``; the
    ``.json`` may be left out), parsed."""
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    path = folder / (name if name.endswith(".json") else name + ".json")
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.json"))
        raise FileNotFoundError(f"no result file {path}; the recorded results are {known}")
    with open(path) as f:
        return json.load(f)


def provenance(record: dict) -> str:
    """One line saying where a result file's numbers come from: device, date, command,
    code (the ``recorded`` block every benchmark writes; older files spell it differently)."""
    rec = record.get("recorded", record.get("meta", {}))
    if rec and "device" not in rec and all(isinstance(v, dict) for v in rec.values()):
        # A file merged from several runs (bench_alternatives.py): each part's record.
        return "; ".join(f"{part}: {provenance({'recorded': r})}" for part, r in rec.items())
    device = rec.get("device") or record.get("device") or record.get("gpu") or "?"
    date = rec.get("date") or str(rec.get("time", "?"))[:10]
    parts = [str(device), str(date)]
    if rec.get("command"):
        parts.append(str(rec["command"]))
    code = rec.get("commit") or rec.get("code")
    if code:
        parts.append(f"code {code}")
    return ", ".join(parts)


# -- the vocabulary of figure expressions ------------------------------------------------

def rows(seq, **where):
    """The items of ``seq`` (a list of dicts) whose fields equal ``where``'s values."""
    out = [x for x in seq if all(x.get(k) == v for k, v in where.items())]
    if not out:
        raise LookupError(f"no row with {where}")
    return out


def row(seq, **where):
    """The one item of ``seq`` whose fields equal ``where``'s values."""
    out = rows(seq, **where)
    if len(out) > 1:
        raise LookupError(f"{len(out)} rows with {where}; name more fields")
    return out[0]


def run(record, **where):
    """The one run of a ``bench_net``/``bench_train`` record (its ``runs`` list) matching ``where``."""
    return row(record["runs"], **where)


SPCONV = ("spconv Native", "spconv MaskImplicitGemm")


def ratio(network_run, ours="numba-sc", peers=SPCONV):
    """Our time over the best peer's in one ``bench_net`` run (its ``network`` block), or
    in any block of ``{contender: {"ms": ...}}`` (a ``bench_train`` run's ``step``):
    below 1 we are faster."""
    times = network_run["network"] if "network" in network_run else network_run
    return times[ours]["ms"] / min(times[p]["ms"] for p in peers)


def times(block, key="host_ms"):
    """{contender: time} of a block recorded as ``{"times": {"<row> / <contender>": {"host_ms":
    ..., "gpu_ms": ...}}}`` (``bench_alternatives``, ``ab_compare``); ``key`` picks wall
    clock (``host_ms``, between device-wide synchronizes) or CUDA-event time (``gpu_ms``)."""
    block = block.get("times", block)
    return {name.rpartition(" / ")[2]: t[key] for name, t in block.items()}


def versus(block, ours, key="host_ms"):
    """``ours``' time over the fastest spconv contender's in one such block."""
    t = times(block, key)
    return t[ours] / min(v for name, v in t.items() if name.startswith("spconv"))


def span(values):
    """(smallest, largest) of ``values``: the two numbers of a range such as ``0.78-0.81x``."""
    values = list(values)
    return (min(values), max(values))


VOCABULARY = {"rows": rows, "row": row, "run": run, "ratio": ratio, "span": span, "times": times, "versus": versus, "min": min, "max": max,
              "median": statistics.median, "mean": statistics.fmean, "len": len, "sum": sum, "abs": abs,
              "round": round, "sorted": sorted, "range": range, "SPCONV": SPCONV}


def evaluate(expression: str, record: dict):
    """The numbers ``expression`` gives on ``record`` (bound to ``r``), as a tuple."""
    # One namespace as the globals, so that comprehensions in the expression see ``r``.
    value = eval(expression, dict(VOCABULARY, r=record, __builtins__={}))  # noqa: S307 (our own docs)
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{expression!r} gave {value!r}: a figure must be finite numbers")
    return values


# -- prose --------------------------------------------------------------------------------

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
    from .tables import TABLES

    return eval(call, dict(VOCABULARY, **TABLES, r=load(name, results_dir), __builtins__={}))  # noqa: S307



def prose_files(root=ROOT):
    """The prose this project publishes: README.md, docs/*.md, benchmarks/README.md and
    the notebooks' markdown cells."""
    root = Path(root)
    files = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()] + sorted((root / "notebooks").glob("*.ipynb"))


def _where(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
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
                                            "as a figure link to its result file (numba_sc.tools.results), or "
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
