"""The teaching notebooks and the site: committed without outputs, run once, by building the site.

Notebooks are committed stripped; the test that runs them is the README's book command,
``python -m numba_sc book``, run here as a subprocess exactly as a reader types it. It
executes every notebook top to bottom in a fresh kernel with notebooks/ as the working
directory (the kernels inherit this process's environment, so NUMBA_ENABLE_CUDASIM set by
conftest.py, or by you, and NUMBA_SC_DATA reach the notebooks), then builds the whole site
with Sphinx, warnings as errors. This test is CI's docs build: the notebooks run once per
CI run, here (.ci/run says so). The test then reads the site, not the command's word for
it: a page per notebook with no error output and a figure, the contents and the
previous/next links in the order of numba_sc.tools.book.PARTS with the notation page
first, every link of every page resolving (its file, and its #anchor in that file), an
API page for every public module, a search index, and maths with no network.

The book test is the slowest of the suite; conftest.py starts it first. Set
NUMBA_SC_BOOK_OUT to a folder to keep the site it builds (otherwise a temporary folder).
"""
import html
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import DATA_DIR, ROOT

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read notebooks (pip install '.[dev]')")
pytest.importorskip("nbclient", reason="nbclient is needed to run notebooks (pip install '.[dev]')")
pytest.importorskip("sphinx", reason="Sphinx builds the site (pip install '.[dev]')")
pytest.importorskip("myst_nb", reason="myst-nb renders the notebooks (pip install '.[dev]')")

import numba_sc  # noqa: E402
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


LINK = re.compile(r"""<(?:a|link|img|script)\b[^>]*?\s(?:href|src)=(["'])(.*?)\1""")
ANCHOR = re.compile(r"""\sid=(["'])(.*?)\1""")
ARTICLE = re.compile(r'<article\b.*?</article>', re.S)
IMAGE = re.compile(r"""<img\b[^>]*?\ssrc=(["'])([^"']+)\1""")


def links(page: Path) -> list[str]:
    return [html.unescape(m.group(2)) for m in LINK.finditer(page.read_text(encoding="utf-8"))]


def broken_links(site: Path) -> list[str]:
    """Every link of every page of ``site`` that leads nowhere: a local file that is not
    there, or an #anchor that its page does not have. Web addresses are not followed
    (and none may be a script: see the maths check)."""
    ids: dict[Path, set[str]] = {}
    broken = []
    for page in sorted(site.rglob("*.html")):
        for target in links(page):
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, data:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / unquote(path.partition("?")[0])).resolve() if path else page.resolve()
            if not file.exists():
                broken.append(f"{page.relative_to(site)} -> {target} (no such file)")
            elif anchor and file.suffix == ".html":
                if file not in ids:
                    ids[file] = {html.unescape(m.group(2)) for m in ANCHOR.finditer(file.read_text(encoding="utf-8"))}
                if unquote(anchor) not in ids[file]:
                    broken.append(f"{page.relative_to(site)} -> {target} (no such anchor)")
    return broken


def remote_assets(site: Path) -> list[str]:
    """The scripts and styles that pages of ``site`` load from the network."""
    return sorted({t for page in site.rglob("*.html") for t in links(page)
                   if re.match(r"^(https?:)?//", t) and re.search(r"\.(js|css)(\?|$)", t)})


def test_the_link_checks_find_what_is_wrong(tmp_path):
    """The site's checks, on a small site made here: a link to a missing page, to an
    anchor a page lacks and a script from a CDN are found; good links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notation.html").write_text('<h2 id="bounds">Bounds</h2>')
    (tmp_path / "index.html").write_text(
        '<a href="docs/notation.html#bounds">ok</a> <a href="docs/notation.html#nowhere">anchor</a> '
        '<a href="docs/gone.html">file</a> <a href="#top">self</a> <a href="https://arxiv.org/x">web</a> '
        '<span id="top"></span><script src="https://cdn.example.org/mathjax/tex-chtml.js"></script>')
    assert broken_links(tmp_path) == ["index.html -> docs/notation.html#nowhere (no such anchor)",
                                      "index.html -> docs/gone.html (no such file)"]
    assert remote_assets(tmp_path) == ["https://cdn.example.org/mathjax/tex-chtml.js"]


def public_modules() -> list[str]:
    """numba_sc and every module of it whose name has no leading underscore."""
    names = ["numba_sc"] + [m.name for m in pkgutil.walk_packages(numba_sc.__path__, "numba_sc.")]
    return [n for n in names if not any(part.startswith("_") for part in n.split("."))]


def test_the_book_builds_and_every_notebook_runs_clean(tmp_path):
    if not DATA_DIR.is_dir():
        pytest.skip(f"the notebooks read real scans from {DATA_DIR}, which is missing "
                    "(set NUMBA_SC_DATA to the folder holding semantickitti_000000.bin)")
    site = Path(os.environ.get("NUMBA_SC_BOOK_OUT") or tmp_path / "book")
    command = [sys.executable, "-m", "numba_sc", "book", "--out", str(site), "--jobs", "2"]
    t0 = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BOOK_TIMEOUT_S)
    log = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "WARNING |" not in line)
    print(f"{' '.join(command[1:])}: {time.perf_counter() - t0:.0f} s\n{log}")  # per notebook: seconds, ok
    assert run.returncode == 0, f"the site failed to build (exit {run.returncode}):\n{log[-6000:]}"

    # Every notebook ran clean and has its page, with a figure and a link to the notation.
    report = {r["name"]: r for r in json.loads((site / "book.json").read_text())["notebooks"]}
    assert sorted(report) == sorted(p.stem for p in NOTEBOOKS)
    assert all(r["ok"] for r in report.values()), [r for r in report.values() if not r["ok"]]
    for path in NOTEBOOKS:
        page = site / "notebooks" / f"{path.stem}.html"
        assert page.is_file(), f"no page for {path.name}"
        text = page.read_text(encoding="utf-8")
        assert 'class="output traceback' not in text, f"{page.name} shows an error output"
        images = [m.group(2) for m in IMAGE.finditer(ARTICLE.search(text).group(0))]
        assert any((page.parent / src).is_file() for src in images), f"{page.name} holds no figure"
        targets = links(page)
        assert any(t.startswith("../docs/notation.html") for t in targets), f"{page.name} does not link the notation"
        # Links to other pages were resolved by Sphinx: none still points at a source.
        stale = [t for t in targets if re.search(r"\.(ipynb|md)(#|$)", t) and "://" not in t]
        assert not stale, f"{page.name} links the sources, not their pages: {stale}"

    # The contents: the notation page first, then every notebook, in the parts' order;
    # the previous/next links of the notebook pages follow the same order.
    order = [c.name for c in book.chapters_in_order()]
    assert sorted(order) == sorted(p.stem for p in NOTEBOOKS)
    contents = ARTICLE.search((site / "docs" / "index.html").read_text(encoding="utf-8")).group(0)
    targets = [m.group(2) for m in LINK.finditer(contents)]
    listed = [t.removeprefix("../notebooks/").removesuffix(".html") for t in targets if t.startswith("../notebooks/")]
    assert listed == order, "the contents do not list the notebooks in the order of PARTS"
    assert "notation.html" in targets and targets.index("notation.html") < targets.index(f"../notebooks/{order[0]}.html")
    assert (site / "docs" / "notation.html").is_file()
    for here, after in zip(order, order[1:]):
        page = (site / "notebooks" / f"{here}.html").read_text(encoding="utf-8")
        assert f'class="next-page" href="{after}.html"' in page, f"{here}'s next page is not {after}"
    assert "docs/index.html" in (site / "index.html").read_text(encoding="utf-8")  # the site's door

    # Every link of every page leads somewhere.
    broken = broken_links(site)
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken[:30])

    # An API page for every public module; the search index knows the pages.
    missing = [m for m in public_modules() if not (site / "docs" / "api" / "generated" / f"{m}.html").is_file()]
    assert not missing, f"modules without an API page: {missing}"
    index = (site / "searchindex.js").read_text(encoding="utf-8")
    for doc in ("docs/notation", f"notebooks/{order[0]}", "docs/api/generated/numba_sc.gmas.gather"):
        assert f'"{doc}"' in index, f"the search index does not hold {doc}"
    assert (site / "search.html").is_file()

    # The maths renders without a network: MathJax comes from the site's own files.
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    remote = remote_assets(site)
    assert not remote, f"pages load scripts or styles from the network: {remote}"
    first = (site / "notebooks" / f"{order[0]}.html").read_text(encoding="utf-8")
    assert "mathjax/tex-chtml.js" in first and 'class="math' in first
