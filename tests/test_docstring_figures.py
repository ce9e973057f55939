"""No performance figure typed by hand in the package's docstrings and comments.

The project's rule for prose (README, docs, notebooks) holds for the package's own
prose too: a measured time, ratio or rate goes stale the day a kernel changes, so a
docstring or comment says *where* the reader finds the measurement (the recorded
ladder, ``docs/performance.md``, ``benchmarks/README.md``, which
:mod:`numba_sc.tools.prose` checks against the result files) instead of typing it.
What the test looks for is :data:`numba_sc.tools.prose.TYPED`, the same pattern
the prose check uses (``12 us``, ``2.6x``, ``3 TB/s``).

Code is not prose: a constant the code reads (``LAUNCH_US = 12.0``) or an f-string
that prints a measured value may match the pattern. A comment or docstring line that
must type a number that is no measurement (napkin arithmetic: bytes moved, the FLOPs
of a tile) carries a ``typed: REASON`` marker on that line, e.g. ``# typed: napkin
math`` or, inside a docstring, ``(typed: napkin math)``.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import numba_sc
from numba_sc.tools.prose import TYPED

PKG = Path(numba_sc.__file__).parent

# They define TYPED and show examples of what it matches.
NOT_SCANNED = {"tools/results.py", "tools/tables.py", "tools/prose.py"}

# Files allowed to type a figure without a marker: none. (The set stays, empty, for a
# file that cannot be fixed at once; test_the_allowed_files_still_need_it keeps it
# exact: a file that no longer types a figure must leave it.)
ALLOWED = set()

MARKER = re.compile(r"typed:\s*\S")


def prose_lines(source: str):
    """(line number, text) of every piece of prose in a module's source: each comment
    (found by :mod:`tokenize`, so a ``#`` inside a string is not one) and each line
    of each docstring (found by :mod:`ast`: the module's, classes' and functions')."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    lines = source.split("\n")  # as ast counts lines (splitlines also breaks at form feeds)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        doc = first.value
        for n in range(doc.lineno, doc.end_lineno + 1):
            text = lines[n - 1]
            # Only the string's own columns: a one-line ``def f(): """..."""`` shares its line with code.
            if n == doc.end_lineno:
                text = text[:doc.end_col_offset]
            if n == doc.lineno:
                text = text[doc.col_offset:]
            out.append((n, text))
    return sorted(out)


def typed_figures(path: Path):
    """The figures typed by hand in ``path``'s docstrings and comments, as (line
    number, figure, the line); a line with a ``typed:`` marker is let be."""
    source = path.read_text(encoding="utf-8")
    if not TYPED.search(source):  # most modules: nothing to tokenize (which is slow)
        return []
    found = []
    for n, text in prose_lines(source):
        if not MARKER.search(text):
            found += [(n, m.group(), text.strip()) for m in TYPED.finditer(text)]
    return found


def _shown(path, found):
    return [f"{path}:{n}: {figure!r}: {line}" for n, figure, line in found]


def _package_files():
    """{path relative to numba_sc/: file} of every module the test scans."""
    files = {f.relative_to(PKG).as_posix(): f for f in sorted(PKG.rglob("*.py"))}
    return {rel: f for rel, f in files.items() if rel not in NOT_SCANNED}


FILES = _package_files()


def test_no_figure_typed_in_docstrings_or_comments():
    found = [x for rel, f in FILES.items() if rel not in ALLOWED for x in _shown(f, typed_figures(f))]
    assert not found, (
        f"{len(found)} performance figures typed in numba_sc's docstrings or comments: say where the "
        "reader finds them measured (the recorded ladder: benchmarks/results/ladder_all_kitti.json, "
        "`python -m numba_sc ladder STAGE`; docs/performance.md; benchmarks/README.md), or mark napkin "
        "arithmetic with `typed: napkin math` on its line:\n" + "\n".join(found[:60]))


@pytest.mark.parametrize("rel", sorted(ALLOWED))
def test_the_allowed_files_still_need_it(rel):
    assert rel in FILES, f"ALLOWED names numba_sc/{rel}, which is not a scanned module: remove it"
    assert typed_figures(FILES[rel]), f"numba_sc/{rel} types no figure any more: remove it from ALLOWED"


def test_the_scan_covers_the_package():
    # Guards the tests above against passing vacuously on an empty or wrong file list.
    assert len(FILES) >= 40, f"only {len(FILES)} modules found under {PKG}"
    for rel in ("gmas/gather.py", "map/backward_search.py", "gmas/gemm_grouping.py", "__init__.py"):
        assert rel in FILES, rel


PLANTED = '''"""A module. The planted kernel went 170 -> 159 us."""
import numpy as np

LAUNCH_US = 12.0  # a constant the code reads, measured in docs/performance.md

# A comment that types a figure: about 3 TB/s on the GPU.
s = "not a docstring: 2.5x, a string the code uses"
# The tile moves 64 KB at 2 TB/s: 32 ns.  # typed: napkin math


class Kernel:
    """The class. It runs 2.6x faster."""

    def run(self):
        """A method whose docstring is clean, on the first line,
        and types a figure on its second: 48 ms (typed: napkin math)."""
        return f"{LAUNCH_US} us, 2.5x"  # a string the code prints is code, not prose


def f(): """One-line docstring sharing its line with code: 7 us."""
'''


def test_the_scanner_finds_planted_figures(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(PLANTED)
    found = [(n, figure) for n, figure, _ in typed_figures(path)]
    # The module docstring (line 1), the comment (6), the class docstring (12) and the
    # one-line docstring (20); not the constant (4), the string (7), the marked comment (8),
    # the marked docstring line (16) or the string the code returns (17).
    assert found == [(1, "159 us"), (6, "3 TB/s"), (12, "2.6x"), (20, "7 us")], found
