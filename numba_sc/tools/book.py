"""``python -m numba_sc book``: every notebook, executed, as an HTML book a reader opens in a browser.

The notebooks are committed without their outputs, so on GitHub or in a fresh checkout
a reader sees no figure and no number. The book is what they look like once run:

1. every notebook in ``notebooks/`` is executed top to bottom in a fresh Jupyter kernel
   (nbclient), with ``notebooks/`` as its working directory and this process's
   environment, so without a GPU the kernels run under Numba's CUDA simulator exactly as
   they do for a student who opens the notebook; up to ``jobs`` notebooks run at once,
   each in its own kernel process;
2. each executed notebook becomes a standalone HTML page (nbconvert's ``HTMLExporter``,
   the JupyterLab look) with its outputs and its figures embedded in the page;
3. links are rewritten for the book: ``05_gather_gemm_scatter.ipynb`` becomes
   ``05_gather_gemm_scatter.html``, ``../docs/notation.md#bounds`` becomes
   ``notation.html#bounds``, and a link to any other file of the repository points back
   at that file from the book's folder;
4. the pages of ``docs/*.md`` (the notation page first) are rendered the same way;
5. ``index.html``, the contents, lists the notebooks in the order of the paper's
   pipeline (:data:`PARTS`), each with its title (its first heading) and one line.

Every page carries a small navigation bar: contents, previous page, next page, in the
contents' order. The build prints, per notebook, the seconds it took, whether it ran
clean and the first error, and it fails (``build_book`` reports it, the command exits
1) when any notebook raised or left an ``error`` output; the page of such a notebook is
still written, its outputs up to the error and the error itself shown in a red frame.

The order of the book is :data:`PARTS`, the one place that says which notebook belongs
to which part. A notebook in ``notebooks/`` that no part lists is an error (a new
notebook cannot be left out of the book by accident); an entry whose notebook does not
exist is an error too, unless the entry says ``planned=True``: a notebook announced
and being written, skipped (and the skip printed) until it appears.
"""
from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import unquote

from ..core.files import write_text

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
DOCS_DIR = ROOT / "docs"
FIRST_DOC = "notation"  # the docs page the contents lists first, before the notebooks
CELL_TIMEOUT_S = 600  # seconds a cell may run: far above the slowest simulator cell, so a hung kernel


@dataclasses.dataclass(frozen=True)
class Chapter:
    """One notebook of the book: ``name`` is its file name without ``.ipynb``; ``line``
    says in one line what a reader finds there. ``planned``: announced but perhaps not
    written yet, so the build skips it (and says so) while the file is absent."""

    name: str
    line: str
    planned: bool = False


@dataclasses.dataclass(frozen=True)
class Part:
    """A group of chapters that follows one step of Minuet's pipeline; ``paper`` names
    the sections of the paper (EuroSys 2024) the part reads with."""

    title: str
    paper: str
    chapters: tuple[Chapter, ...]


# The book's order: the paper's, from the idea through the Map step (§5.1) and the GMaS
# step (§5.2) to the engine, training, and the evaluation (§6). Add a new notebook here.
PARTS: tuple[Part, ...] = (
    Part("The idea", "§2: sparse convolution and its three steps", (
        Chapter("01_sparse_convolution_from_scratch",
                "a dense convolution against a sparse one, the paper's Eq. 2 by brute force, then the library"),
    )),
    Part("The Map step", "§5.1: building the kernel map with sorted queries", (
        Chapter("02_voxelization_and_output_coordinates",
                "points to voxels on SemanticKITTI, the output coordinates of a strided layer, packed keys"),
        Chapter("03_why_sorted_queries",
                "why searching sorted queries is cache friendly, and segmented against full query sorting"),
        Chapter("04_double_traversed_binary_search",
                "source and query blocks, the backward and forward searches, comparisons as B and C vary"),
    )),
    Part("The GMaS step", "§5.2: gather, GEMM, scatter", (
        Chapter("05_gather_gemm_scatter",
                "the metadata tables, the tiled gather and scatter, indexing cost against parallelism"),
        Chapter("06_gemm_grouping",
                "padding against launches when GEMMs are grouped, and why sorting them by size pays"),
    )),
    Part("The engine", "§4 and §3: the whole layer, whole networks, and the other engines' choices", (
        Chapter("07_end_to_end", "a tiny encoder-decoder on SemanticKITTI, each stage's share of a layer's time"),
        Chapter("08_networks",
                "the maps MinkUNet42 builds and reuses, spconv weights, the reference check, time by layer kind"),
        Chapter("10_which_map_which_dataflow",
                "hash table, dense grid or sorted search; gather-GEMM-scatter or the fused dataflows; "
                "how dataflow='auto' decides"),
        Chapter("12_tensor_cores",
                "the implicit GEMM's tensor-core rung: fragments, ldmatrix, mma.sync in C++ linked into "
                "a Numba kernel, modelled in NumPy and checked; what it bought by channel count"),
    )),
    Part("Training", "beyond the paper, which measures inference only", (
        Chapter("09_training",
                "the gradients of the features and the weights, checked numerically; a few steps on a crop; "
                "the recorded fit of a whole scan; training over a dataset, the checkerboard split, "
                "held-out scores"),
    )),
    Part("Reproducing the paper's evaluation", "§6: the paper's figures beside our recorded GPU runs", (
        Chapter("11_reproducing_the_paper",
                "Minuet's headline results beside our own GPU measurements of the same experiments"),
    )),
)


# ----------------------------------------------------------------- the table, checked
def chapters_in_order(parts: Sequence[Part] = PARTS, notebook_dir: Path = NOTEBOOK_DIR,
                      report=print) -> list[Chapter]:
    """The chapters of ``parts`` whose notebook exists, in the book's order.

    Raises ValueError, naming the notebook and the fix, when a notebook of
    ``notebook_dir`` is in no part, when a chapter is listed twice, or when a chapter
    that is not ``planned`` has no notebook. A planned chapter without its notebook is
    skipped, and ``report`` says so.
    """
    notebook_dir = Path(notebook_dir)
    if not notebook_dir.is_dir():
        raise ValueError(f"notebook_dir {notebook_dir} is not a folder: the book is built from a checkout "
                         "of numba-sc, whose notebooks/ folder it reads")
    listed = [c for p in parts for c in p.chapters]
    names = [c.name for c in listed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"PARTS lists {twice} more than once: keep each notebook in one part")
    present = {p.stem for p in notebook_dir.glob("*.ipynb")}
    unlisted = sorted(present - set(names))
    if unlisted:
        raise ValueError(
            "notebook(s) in no part of the book: " + ", ".join(f"{notebook_dir.name}/{n}.ipynb" for n in unlisted)
            + f"; add each to PARTS in {Path(__file__).name} (in the part it belongs to, with one line)")
    missing = [c for c in listed if c.name not in present and not c.planned]
    if missing:
        raise ValueError(
            "PARTS lists notebook(s) that do not exist: "
            + ", ".join(f"{notebook_dir.name}/{c.name}.ipynb" for c in missing)
            + "; correct the name, remove the entry, or mark it planned=True while it is being written")
    for c in listed:
        if c.name not in present:
            report(f"book: {c.name}.ipynb is planned but not written yet: skipped")
    return [c for c in listed if c.name in present]


def select(chapters: Sequence[Chapter], only: Iterable[str] | None) -> list[Chapter]:
    """The chapters ``only`` names (all when None), in the book's order. A name is a
    notebook's file name, with or without ``.ipynb``, or its number (``5`` or ``05``)."""
    if only is None:
        return list(chapters)
    chosen = set()
    for name in only:
        key = name.removesuffix(".ipynb")
        hits = [c for c in chapters if c.name == key
                or (key.isdigit() and c.name.split("_", 1)[0].lstrip("0") == key.lstrip("0"))]
        if not hits:
            raise ValueError(f"--only {name!r} names no notebook of the book; choose from "
                             + ", ".join(c.name for c in chapters))
        chosen.update(c.name for c in hits)
    return [c for c in chapters if c.name in chosen]


# ----------------------------------------------------------------- titles and links
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def first_heading(markdown: str) -> str | None:
    """The text of the first Markdown heading (``# Title``) in ``markdown``, or None."""
    m = HEADING.search(markdown)
    return m.group(1) if m else None


def notebook_title(path: Path) -> str:
    """A notebook's title: the first heading of its markdown cells (ValueError without one)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            title = first_heading(cell.source)
            if title:
                return title
    raise ValueError(f"{path.name} has no heading: start its first markdown cell with '# <title>', "
                     "the title the book's contents show")


def rewrite_link(target: str, source_dir: Path, pages: dict[Path, str], out_dir: Path) -> str:
    """Where a link of a page whose source lies in ``source_dir`` points in the book.

    ``pages`` maps the resolved path of every source the book renders (notebooks and
    docs) to its page's file name. A link to one of them goes to its page, keeping the
    ``#anchor``; a link to any other file of the repository goes to that file, seen from
    ``out_dir``; web addresses, ``#anchors`` of the page itself, absolute paths and
    ``data:`` images are left alone.
    """
    if not target or target.startswith(("#", "/", "data:", "mailto:", "javascript:")) or "://" in target:
        return target
    path, hash_, anchor = target.partition("#")
    path, query, rest = path.partition("?")
    resolved = (Path(source_dir) / unquote(path)).resolve()
    page = pages.get(resolved)
    if page is None:
        page = Path(os.path.relpath(resolved, Path(out_dir).resolve())).as_posix() + query + rest
    return page + hash_ + anchor


LINK = re.compile(r"""\b(href|src)=(["'])(.*?)\2""")


def rewrite_links(page_html: str, source_dir: Path, pages: dict[Path, str], out_dir: Path) -> str:
    """``page_html`` with every ``href`` and ``src`` passed through :func:`rewrite_link`."""
    def sub(m):
        new = rewrite_link(html.unescape(m.group(3)), source_dir, pages, out_dir)
        return f"{m.group(1)}={m.group(2)}{html.escape(new, quote=True)}{m.group(2)}"
    return LINK.sub(sub, page_html)


# ----------------------------------------------------------------- pages
# The JupyterLab page of nbconvert, with the book's navigation bar at the top and the
# bottom, and every error output in a frame of class "book-error" (so that a failed cell
# shows, and a test can find it without guessing at the traceback's markup).
TEMPLATE = """{%- extends 'index.html.j2' -%}
{% block extra_css %}<style>
.book-nav { display: flex; gap: 1.5em; justify-content: space-between; font: 14px sans-serif;
            padding: 0.6em 1em; margin: 0 0 1em 0; background: #f3f4f6; border-radius: 4px; }
.book-nav a { text-decoration: none; }
.book-error { border-left: 4px solid #c62828; background: #fdecea; }
.book-failed { font: 15px sans-serif; padding: 0.8em 1em; margin-bottom: 1em; background: #fdecea;
               border-left: 4px solid #c62828; }
main { max-width: 1100px; margin: 0 auto; }
</style>{% endblock extra_css %}
{%- block body_header -%}{{ super() }}{{ resources.book_top }}{%- endblock body_header -%}
{% block body_footer %}{{ resources.book_bottom }}{{ super() }}{% endblock body_footer %}
{% block error -%}<div class="book-error">{{ super() }}</div>{%- endblock error %}
"""


def _exporter():
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"book.html.j2": TEMPLATE})],
                        template_file="book.html.j2", embed_images=True)


@dataclasses.dataclass
class Page:
    """One page of the book: its source (a notebook or a Markdown file), its file name
    in the book and its title."""

    source: Path
    file: str
    title: str


def _nav(order: Sequence[Page], i: int | None) -> str:
    """The navigation bar of page ``i`` of ``order`` (None: the contents page)."""
    def link(page, text):
        return f'<a href="{html.escape(page.file)}">{text}</a>'

    if i is None:
        prev_ = "<span></span>"
        next_ = link(order[0], f"{html.escape(order[0].title)} &rarr;") if order else "<span></span>"
    else:
        prev_ = link(order[i - 1], f"&larr; {html.escape(order[i - 1].title)}") if i > 0 else \
            '<a href="index.html">&larr; Contents</a>'
        next_ = link(order[i + 1], f"{html.escape(order[i + 1].title)} &rarr;") if i + 1 < len(order) else \
            "<span></span>"
    return f'<nav class="book-nav">{prev_}<a href="index.html">Contents</a>{next_}</nav>'


def _write_page(exporter, nb, title: str, out: Path, source_dir: Path, pages: dict[Path, str],
                nav: str, banner: str = "") -> None:
    """Render ``nb`` to ``out``: its links rewritten, then the navigation bar put in (its
    links are the book's already, so it goes in after the rewriting, through two marks)."""
    top, bottom = "<!--book-top-->", "<!--book-bottom-->"
    body, _ = exporter.from_notebook_node(nb, resources={
        "metadata": {"name": title, "path": str(source_dir)}, "book_top": top, "book_bottom": bottom})
    body = rewrite_links(body, source_dir, pages, out.parent)
    write_text(out, body.replace(top, nav + banner, 1).replace(bottom, nav, 1))


def _markdown_notebook(text: str):
    """A notebook of one markdown cell: how a Markdown file goes through the exporter."""
    import nbformat

    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])


def _escape_md(text: str) -> str:
    """``text`` with Markdown's punctuation escaped, to be shown as it is."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)


def _split_docs(docs: Sequence[Page]) -> tuple[list[Page], list[Page]]:
    """The docs pages split into the one the contents put first (``FIRST_DOC``: the
    notation every notebook links) and the others (the reference, after the notebooks)."""
    return ([d for d in docs if d.source.stem == FIRST_DOC], [d for d in docs if d.source.stem != FIRST_DOC])


def contents_markdown(parts: Sequence[Part], chapters: Sequence[Chapter], titles: dict[str, str],
                      docs: Sequence[Page], built: set[str], how: str = "") -> str:
    """The contents page, in Markdown: the first docs page, the parts with their
    chapters (title, linked when its page was built, and its line), the other docs.
    ``how`` says how the pages were made (date, machine)."""
    present = {c.name for c in chapters}
    lines = ["# numba-sc: the book",
             "",
             "Minuet's sparse-convolution engine (EuroSys 2024) taught stage by stage, one notebook a "
             "stage, in the order of the paper's pipeline. Each page is a notebook as it ran when "
             "this book was built " + how + "; numbers measured on a GPU are read from the recorded "
             "results in `benchmarks/results/`. Build it again with `numba-sc book`.",
             ""]
    first, rest = _split_docs(docs)
    for d in first:
        lines += [f"**[{_escape_md(d.title)}]({d.file})**: the symbols and terms every notebook uses.", ""]
    for part in parts:
        chs = [c for c in part.chapters if c.name in present]
        if not chs:
            continue
        lines += [f"## {_escape_md(part.title)}", "", f"*{_escape_md(part.paper)}*", ""]
        for c in chs:
            title = _escape_md(titles[c.name])
            shown = f"[{title}]({c.name}.html)" if c.name in built else f"{title} (not built yet)"
            lines.append(f"- **{shown}**: {_escape_md(c.line)}")
        lines.append("")
    if rest:
        lines += ["## Reference", ""] + [f"- [{_escape_md(d.title)}]({d.file})" for d in rest] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------- running
@dataclasses.dataclass
class NotebookRun:
    """How one notebook's execution went: seconds, and the first error (None: clean)."""

    name: str
    seconds: float
    error: str | None = None
    executed: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        if not self.executed:
            return f"  {self.name:<42} rendered, not executed"
        return f"  {self.name:<42} {'ok' if self.ok else 'FAILED':<6} {self.seconds:7.1f} s" + (
            "" if self.ok else f"   {self.error}")


def first_error(nb) -> str | None:
    """``cell N: Name: message`` for the first ``error`` output of ``nb`` (cells counted
    from 1, markdown included, as Jupyter shows them), or None."""
    for i, cell in enumerate(nb.cells, 1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {i}: {out.get('ename')}: {out.get('evalue')}".strip()
    return None


async def _execute(paths: Sequence[Path], jobs: int, timeout: float, on_done) -> None:
    """Execute the notebooks at ``paths``, ``jobs`` kernels at a time; ``on_done(path,
    nb, seconds, error)`` as each finishes. nbclient's async client lets one event loop
    drive several kernels: the work is in the kernels' processes, not here."""
    import nbclient
    import nbformat

    gate = asyncio.Semaphore(jobs)

    async def one(path):
        async with gate:
            nb = nbformat.read(path, as_version=4)
            # The kernel's own log at ERROR: each would otherwise print ipykernel's warning
            # that it talks to this process over TCP on localhost (Jupyter's default too).
            # The notebook's warnings and errors are outputs, not log lines: they stay.
            client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                             extra_arguments=["--IPKernelApp.log_level=ERROR"],
                                             resources={"metadata": {"path": str(path.parent)}})
            t0 = time.perf_counter()
            raised = None
            try:
                await client.async_execute()
            except Exception as err:  # a cell's error, a timeout, a kernel that died: all reported
                raised = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            error = first_error(nb) or raised
            on_done(path, nb, time.perf_counter() - t0, error)

    await asyncio.gather(*(one(p) for p in paths))


def _run(coroutine):
    """Run ``coroutine`` to its end, also from inside a running event loop (a notebook's
    kernel has one, and ``asyncio.run`` refuses to nest): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on macOS or Windows)
        return os.cpu_count() or 1


# ----------------------------------------------------------------- the book
def build_book(out_dir, notebooks: Iterable[str] | None = None, jobs: int | None = None, execute: bool = True,
               timeout: float = CELL_TIMEOUT_S, *, parts: Sequence[Part] = PARTS,
               notebook_dir: Path = NOTEBOOK_DIR, docs_dir: Path = DOCS_DIR,
               report=print) -> list[NotebookRun]:
    """Build the book in ``out_dir``; return one :class:`NotebookRun` per notebook run.

    ``notebooks``: the names of the notebooks to (re)build (:func:`select`), all when
    None; the contents and every navigation bar still cover the whole book, so pages
    of an earlier build in ``out_dir`` stay linked. ``jobs``: notebooks executed at
    once, default :func:`default_jobs`. ``execute=False`` renders the notebooks as
    committed, without outputs (a quick look at the layout). ``timeout``: seconds
    allowed to one cell. ``report`` receives the progress lines.

    The build succeeded when every returned run is ``ok``; a failed notebook's page
    is written too, showing where it stopped.
    """
    import nbformat

    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds per cell, got {timeout!r}")
    jobs = jobs or default_jobs()
    simulating = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # what the kernels inherit
    notebook_dir, docs_dir = Path(notebook_dir).resolve(), Path(docs_dir).resolve()
    out = Path(out_dir).resolve()
    chapters = chapters_in_order(parts, notebook_dir, report)
    todo = select(chapters, notebooks)
    out.mkdir(parents=True, exist_ok=True)

    # Every page of the book, in reading order: the notation, the notebooks, the other docs.
    doc_paths = sorted(docs_dir.glob("*.md")) if docs_dir.is_dir() else []
    docs = [Page(p, f"{p.stem}.html", first_heading(p.read_text(encoding="utf-8")) or p.stem) for p in doc_paths]
    nb_pages = [Page(notebook_dir / f"{c.name}.ipynb", f"{c.name}.html",
                     notebook_title(notebook_dir / f"{c.name}.ipynb")) for c in chapters]
    first, rest = _split_docs(docs)
    order = first + nb_pages + rest
    index_of = {p.source: i for i, p in enumerate(order)}
    pages = {p.source: p.file for p in order}
    exporter = _exporter()

    for d in docs:
        _write_page(exporter, _markdown_notebook(d.source.read_text(encoding="utf-8")), d.title, out / d.file,
                    d.source.parent, pages, _nav(order, index_of[d.source]))

    runs: list[NotebookRun] = []

    def done(path, nb, seconds, error):
        page = order[index_of[path]]
        banner = "" if error is None else (
            f'<div class="book-failed">This notebook stopped with an error while the book was built: '
            f'{html.escape(error)}</div>')
        _write_page(exporter, nb, page.title, out / page.file, notebook_dir, pages,
                    _nav(order, index_of[path]), banner)
        runs.append(NotebookRun(path.stem, seconds, error, execute))
        report(runs[-1].line())

    paths = [notebook_dir / f"{c.name}.ipynb" for c in todo]
    if execute:
        report(f"book: executing {len(paths)} notebook(s), {min(jobs, len(paths))} at a time"
               + (" (kernels under the CUDA simulator)" if simulating else ""))
        _run(_execute(paths, jobs, timeout, done))
    else:
        for p in paths:
            done(p, nbformat.read(p, as_version=4), 0.0, None)

    runs.sort(key=lambda r: index_of[notebook_dir / f"{r.name}.ipynb"])
    built = {c.name for c in chapters if (out / f"{c.name}.html").exists()}
    titles = {c.name: order[index_of[notebook_dir / f"{c.name}.ipynb"]].title for c in chapters}
    how = f"on {time.strftime('%Y-%m-%d')}" + (
        " (rendered without running them: the pages have no outputs)" if not execute
        else " (kernels under Numba's CUDA simulator, on crops of the scans)" if simulating
        else " (kernels on the GPU)")
    contents = _markdown_notebook(contents_markdown(parts, chapters, titles, docs, built, how))
    _write_page(exporter, contents, "numba-sc: contents", out / "index.html", out, pages, _nav(order, None))
    write_text(out / "book.json", json.dumps({
        "built": time.strftime("%Y-%m-%d %H:%M"), "executed": execute,
        "simulator": simulating, "jobs": jobs,
        "notebooks": [dataclasses.asdict(r) | {"ok": r.ok} for r in runs]}, indent=1))

    failed = [r for r in runs if not r.ok]
    report("book: " + ("; ".join(f"{r.name} failed ({r.error})" for r in failed) if failed else
                       f"{len(runs)} notebook(s) " + ("ran clean" if execute else "rendered without running")))
    report(f"book: open {(out / 'index.html').as_uri()}")
    return runs


def main(out_dir: str, jobs: int | None, only: Sequence[str] | None, execute: bool = True) -> int:
    """The ``book`` command: 0 when every notebook ran clean, 1 when one did not, 2 when
    the book cannot be built as asked (a notebook outside the parts, an unknown name)."""
    try:
        runs = build_book(out_dir, only, jobs, execute)
    except ValueError as e:
        print(f"book: {e}", file=sys.stderr)
        return 2
    return 0 if all(r.ok for r in runs) else 1
