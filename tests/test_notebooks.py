"""The teaching notebooks: committed without outputs, and run once, by building the book.

Notebooks are committed stripped; the test that runs them is the README's book command,
``python -m numba_sc book``, run here as a subprocess exactly as a reader types it. It
executes every notebook top to bottom in a fresh kernel with notebooks/ as the working
directory; the kernels inherit this process's environment, so NUMBA_ENABLE_CUDASIM set by
conftest.py (or by you) and NUMBA_SC_DATA reach the notebooks. The test then reads the
book, not the command's word for it: a page per notebook, no error output on any page, a
figure on every page, the contents in the order of numba_sc.tools.book.PARTS with the
notation page, and links that point at pages of the book.

The book test is the slowest of the suite; conftest.py starts it first. Set
NUMBA_SC_BOOK_OUT to a folder to keep the book it builds (otherwise a temporary folder).
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA_DIR, ROOT

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read notebooks (pip install '.[dev]')")
pytest.importorskip("nbclient", reason="nbclient is needed to run notebooks (pip install '.[dev]')")
pytest.importorskip("nbconvert", reason="nbconvert is needed to render the book (pip install '.[dev]')")

from numba_sc.tools import book  # noqa: E402  (after the skips: it needs the notebook packages)

NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
BOOK_TIMEOUT_S = 40 * 60  # far above a build on two slow cores: a hung kernel, not a slow one


def test_there_are_notebooks():
    # Guards the parametrized test below: an empty glob would otherwise pass vacuously.
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stripped(path):
    """Committed notebooks carry no outputs: the repository stays small, the book runs them."""
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


HREF = re.compile(r"""<a\b[^>]*?\shref=(["'])(.*?)\1""")
EMBEDDED_IMAGE = re.compile(r"""<img\b[^>]*?\ssrc=(["'])data:image/""")


def test_the_book_builds_and_every_notebook_runs_clean(tmp_path):
    if not DATA_DIR.is_dir():
        pytest.skip(f"the notebooks read real scans from {DATA_DIR}, which is missing "
                    "(set NUMBA_SC_DATA to the folder holding semantickitti_000000.bin)")
    out = Path(os.environ.get("NUMBA_SC_BOOK_OUT") or tmp_path / "book")
    command = [sys.executable, "-m", "numba_sc", "book", "--out", str(out), "--jobs", "2"]
    t0 = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BOOK_TIMEOUT_S)
    log = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "WARNING |" not in line)
    print(f"{' '.join(command[1:])}: {time.perf_counter() - t0:.0f} s\n{log}")  # per notebook: seconds, ok
    assert run.returncode == 0, f"the book failed to build (exit {run.returncode}):\n{log[-6000:]}"

    # Every notebook has its page: run clean, with a figure.
    report = {r["name"]: r for r in json.loads((out / "book.json").read_text())["notebooks"]}
    assert sorted(report) == sorted(p.stem for p in NOTEBOOKS)
    for path in NOTEBOOKS:
        page = out / f"{path.stem}.html"
        assert page.is_file(), f"no page for {path.name}"
        text = page.read_text(encoding="utf-8")
        assert 'class="book-error"' not in text and 'class="book-failed"' not in text, \
            f"{page.name} shows an error output: {report[path.stem]['error']}"
        assert EMBEDDED_IMAGE.search(text), f"{page.name} holds no figure (no embedded image)"
        links = [m.group(2) for m in HREF.finditer(text)]
        # Rewritten: no link of a page points at a notebook or a Markdown source any more.
        stale = [h for h in links if re.search(r"\.(ipynb|md)(#|$)", h) and "://" not in h]
        assert not stale, f"{page.name} links the sources, not their pages: {stale}"
        assert any(h.startswith("notation.html") for h in links), f"{page.name} does not link the notation page"
        pages = [h.partition("#")[0] for h in links if "://" not in h and h.partition("#")[0].endswith(".html")]
        assert all((out / h).is_file() for h in pages), f"{page.name} links a page the book does not have"

    # The contents: the notation page first, then every notebook, in the parts' order.
    index = (out / "index.html").read_text(encoding="utf-8")
    targets = [m.group(2) for m in HREF.finditer(index)]
    listed = [h.removesuffix(".html") for h in targets if h.removesuffix(".html") in report]
    order = [c.name for c in book.chapters_in_order()]
    assert listed == order, "the contents do not list the notebooks in the order of PARTS"
    assert sorted(order) == sorted(p.stem for p in NOTEBOOKS)
    assert "notation.html" in targets and targets.index("notation.html") < targets.index(f"{order[0]}.html")
    assert (out / "notation.html").is_file()
