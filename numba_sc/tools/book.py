"""``numba-sc book``: the project's site, built with Sphinx: the book (every notebook,
executed, in the order of the paper), the pages of ``docs/`` and the API reference.

The notebooks are committed without their outputs, so on GitHub or in a fresh checkout a
reader sees no figure and no number. The book is what they look like once run:

1. the chapters are checked against ``notebooks/`` (:func:`chapters_in_order`);
2. every notebook is executed top to bottom in a fresh Jupyter kernel (nbclient), with
   ``notebooks/`` as its working directory and this process's environment, so without a
   GPU the kernels run under Numba's CUDA simulator exactly as they do for a student who
   opens the notebook; up to ``jobs`` notebooks run at once, each in its own kernel;
   each executed notebook goes into a notebook cache (jupyter-cache) in the site's folder;
3. Sphinx builds the site with ``docs/conf.py``, warnings as errors: myst-nb renders each
   notebook with the outputs it finds in that cache (nothing runs twice), MyST reads
   ``docs/*.md``, autodoc and autosummary write a page per module of ``numba_sc`` from
   its docstrings, and every page gets the search box.

The build prints, per notebook, the seconds it took, whether it ran clean and the first
error, and fails (the command exits 1) when a notebook raised or left an ``error``
output, or when Sphinx warned (a broken link, a docstring Sphinx cannot read). A failed
notebook's page is still written, with its outputs up to the error and the error.

The order of the book is :data:`PARTS`, the one place that says which notebook belongs
to which part; ``docs/conf.py`` makes the contents page and the sidebar from it
(:func:`contents_markdown`). A notebook in ``notebooks/`` that no part lists is an error
(a new notebook cannot be left out of the book by accident); an entry whose notebook
does not exist is an error too, unless the entry says ``planned=True``: a notebook
announced and being written, skipped (and the skip printed) until it appears.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from ..core.files import write_text
from ..core.progress import bar

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
DOCS_DIR = ROOT / "docs"
FIRST_DOC = "notation"  # the docs page the contents lists first, before the notebooks
CELL_TIMEOUT_S = 600  # seconds a cell may run: far above the slowest simulator cell, so a hung kernel
CACHE = ".jupyter_cache"  # the notebook cache, in the site's folder: the executed notebooks Sphinx renders


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

# ----------------------------------------------------------------- the contents
def _escape_md(text: str) -> str:
    """``text`` with Markdown's punctuation escaped, to be shown as it is."""
    return re.sub(r"([\\`*_\[\]<>#|$])", r"\\\1", text)


def contents_markdown(parts: Sequence[Part], chapters: Sequence[Chapter], guides: Sequence[str]) -> str:
    """The book's contents, in MyST Markdown, for docs/index.md (docs/conf.py puts it
    there): the notation page, then each part of ``parts`` with its paper sections and
    its chapters (each notebook's title, a link, and its one line), then the reference:
    the ``guides`` (other pages of docs/, by name) and the API.

    ``chapters`` are the chapters that exist (:func:`chapters_in_order`); a part with
    none is left out. Each list goes with a hidden toctree of the same pages, captioned
    with the part's title: the order the sidebar, the previous and next links and the
    search follow. A link with no text shows the page's title (its first heading)."""
    present = {c.name for c in chapters}
    lines = [f"**[](./{FIRST_DOC}.md)**: the symbols and terms every notebook uses.", "",
             "```{toctree}", ":hidden:", "", FIRST_DOC, "```", ""]
    for part in parts:
        names = [c for c in part.chapters if c.name in present]
        if not names:
            continue
        lines += [f"## {_escape_md(part.title)}", "", f"*{_escape_md(part.paper)}*", ""]
        lines += [f"- **[](../notebooks/{c.name}.ipynb)**: {_escape_md(c.line)}" for c in names]
        lines += ["", "```{toctree}", ":hidden:", f":caption: {part.title}", ""]
        lines += [f"/notebooks/{c.name}" for c in names] + ["```", ""]
    reference = [*guides, "api/index"]
    lines += ["## Reference", ""] + [f"- [](./{name}.md)" for name in reference]
    lines += ["", "```{toctree}", ":hidden:", ":caption: Reference", "", *reference, "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------- running the notebooks
@dataclasses.dataclass
class NotebookRun:
    """How one notebook's execution went: seconds, and the first error (None: clean)."""

    name: str
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
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
            t0 = time.perf_counter()
            # A kernel that fails to start (two kernels started at once can pick the same
            # free port: "Address already in use", then "Kernel didn't respond") is not the
            # notebook's fault: it gets a fresh kernel, up to twice. A notebook that ran any
            # cell keeps its error.
            for attempt in range(3):
                nb = nbformat.read(path, as_version=4)
                # The kernel's own log at ERROR: each would otherwise print ipykernel's warning
                # that it talks to this process over TCP on localhost (Jupyter's default too).
                # The notebook's warnings and errors are outputs, not log lines: they stay.
                # record_timing=False: no timestamps in the cells' metadata, which the cache's
                # match of a notebook against its source would see as a change.
                client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                                 extra_arguments=["--IPKernelApp.log_level=ERROR"],
                                                 resources={"metadata": {"path": str(path.parent)}})
                raised = None
                try:
                    await client.async_execute()
                except Exception as err:  # a cell's error, a timeout, a kernel that died: all reported
                    raised = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                started = any(c.get("execution_count") for c in nb.cells if c.get("cell_type") == "code")
                if raised is None or started or first_error(nb):
                    break
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


def execute_notebooks(paths: Sequence[Path], cache_dir: Path, jobs: int, timeout: float = CELL_TIMEOUT_S,
                      report=print) -> list[NotebookRun]:
    """Execute the notebooks at ``paths``, ``jobs`` at a time, and put each executed
    notebook in the jupyter-cache at ``cache_dir``, where myst-nb finds it (matched by
    the notebook's code). Returns one :class:`NotebookRun` per notebook, in the order of
    ``paths``; ``report`` receives a line as each finishes, and a progress bar over the
    notebooks done (with an ETA) is drawn on stderr where bars are on
    (:mod:`numba_sc.core.progress`: a terminal, or ``--progress``). A notebook that failed is
    cached too, so that its page shows where it stopped (:func:`forget_failed` removes it
    after the build: a later build must not show it as if it were new)."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(cache_dir)
    runs: dict[Path, NotebookRun] = {}

    def done(path, nb, seconds, error):
        cache.cache_notebook_bundle(CacheBundleIn(nb, str(path), data={"execution_seconds": seconds}),
                                    check_validity=False, overwrite=True)
        runs[path] = NotebookRun(path.stem, seconds, error)
        progress.clear()  # (the line on stdout, the bar on stderr: on one terminal, lift the bar first)
        report(runs[path].line())
        progress.update(1)

    with bar(total=len(paths), desc="notebooks run", unit="notebook") as progress:
        _run(_execute(paths, jobs, timeout, done))
    return [runs[p] for p in paths]


def forget_failed(paths: Sequence[Path], runs: Sequence[NotebookRun], cache_dir: Path) -> None:
    """Remove the cached notebooks of the failed ``runs`` (of the notebooks at ``paths``)."""
    from jupyter_cache import get_cache

    cache = get_cache(cache_dir)
    for path, run in zip(paths, runs):
        if not run.ok:
            with contextlib.suppress(KeyError):
                cache.remove_cache(_cached(path, cache).pk)


def _cached(path: Path, cache):
    """The cache's record of the notebook at ``path`` (matched by its code), or KeyError."""
    import nbformat

    return cache.match_cache_notebook(nbformat.read(path, as_version=4))


def cached_names(chapters: Sequence[Chapter], cache_dir: Path, notebook_dir: Path = NOTEBOOK_DIR) -> set[str]:
    """The names of the ``chapters`` whose notebook, as it is now, the cache holds."""
    from jupyter_cache import get_cache

    if not Path(cache_dir).is_dir():
        return set()
    cache, found = get_cache(cache_dir), set()
    for c in chapters:
        with contextlib.suppress(KeyError):
            _cached(Path(notebook_dir) / f"{c.name}.ipynb", cache)
            found.add(c.name)
    return found


# ----------------------------------------------------------------- the site
NOT_RUN = "NUMBA_SC_BOOK_NOT_RUN"  # notebooks (paths, comma-separated) docs/conf.py renders without running


def sphinx_build(out_dir: Path, mode: str, cache_dir: Path | None = None, not_run: Sequence[str] = ()) -> int:
    """Run Sphinx on this checkout (source: its root; settings: docs/conf.py) into
    ``out_dir``, warnings as errors, every page read again (``-E``: the notebooks'
    outputs may have changed while their files did not), in a process of its own (the
    API pages import every module, with torch mocked). ``mode`` is myst-nb's
    ``nb_execution_mode``: "cache" (read from ``cache_dir``), "force" or "off";
    ``not_run``: notebooks (by name) rendered as committed whatever the mode. Returns
    Sphinx's exit status; its warnings go to this process's stderr."""
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E", "-q",
               "-c", str(DOCS_DIR), "-D", f"nb_execution_mode={mode}"]
    if cache_dir is not None:
        command += ["-D", f"nb_execution_cache_path={cache_dir}"]
    env = dict(os.environ, **{NOT_RUN: ",".join(f"notebooks/{name}.ipynb" for name in not_run)})
    return subprocess.run([*command, str(ROOT), str(out_dir)], env=env).returncode


def build_book(out_dir, notebooks: Iterable[str] | None = None, jobs: int | None = None, execute: bool = True,
               timeout: float = CELL_TIMEOUT_S, *, report=print) -> tuple[list[NotebookRun], int]:
    """Build the site in ``out_dir``; return the notebooks' runs and Sphinx's exit status.

    ``notebooks``: the names of the notebooks to execute (:func:`select`), all when
    None; each of the others is rendered with the outputs an earlier build left in
    ``out_dir``'s cache, or without outputs when there are none (it is said which).
    ``jobs``: notebooks executed at once, default :func:`default_jobs`.
    ``execute=False`` renders every notebook as committed, without outputs (a quick
    look). ``timeout``: seconds allowed to one cell. ``report`` receives the progress
    lines.

    The build succeeded when every run is ``ok`` and Sphinx's status is 0.
    """
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds per cell, got {timeout!r}")
    jobs = jobs or default_jobs()
    chapters = chapters_in_order(report=report)
    todo = select(chapters, notebooks)
    out = Path(out_dir).resolve()
    cache_dir = out / CACHE
    simulating = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # what the kernels inherit
    out.mkdir(parents=True, exist_ok=True)

    runs: list[NotebookRun] = []
    paths = [NOTEBOOK_DIR / f"{c.name}.ipynb" for c in todo]
    if execute:
        if notebooks is None and cache_dir.exists():
            shutil.rmtree(cache_dir)  # all of them run again: no output of an older library is kept
        report(f"book: executing {len(paths)} notebook(s), {min(jobs, len(paths))} at a time"
               + (" (kernels under the CUDA simulator)" if simulating else ""))
        runs = execute_notebooks(paths, cache_dir, jobs, timeout, report)
        others = [c for c in chapters if c not in todo]
        kept = cached_names(others, cache_dir)
        not_run = [c.name for c in others if c.name not in kept]
        for c in others:
            report(f"  {c.name:<42} " + ("kept: the outputs of an earlier build" if c.name in kept
                                          else "not run: shown without outputs (no earlier build of it here)"))
        report("book: building the site with Sphinx")
        try:
            status = sphinx_build(out, "cache", cache_dir, not_run)
        finally:
            forget_failed(paths, runs, cache_dir)
    else:
        report("book: building the site with Sphinx, the notebooks as committed (no outputs)")
        status = sphinx_build(out, "off")

    write_text(out / "book.json", json.dumps({
        "built": time.strftime("%Y-%m-%d %H:%M"), "executed": execute, "simulator": simulating, "jobs": jobs,
        "sphinx_status": status, "notebooks": [dataclasses.asdict(r) | {"ok": r.ok} for r in runs]}, indent=1))
    failed = [r for r in runs if not r.ok]
    report("book: " + ("; ".join(f"{r.name} failed ({r.error})" for r in failed) if failed else
                       f"{len(runs)} notebook(s) ran clean" if execute else "notebooks rendered without running"))
    if status:
        report(f"book: Sphinx failed (exit {status}): each warning above is an error")
    report(f"book: open {(out / 'index.html').as_uri()}")
    return runs, status


def main(out_dir: str, jobs: int | None, only: Sequence[str] | None, execute: bool = True) -> int:
    """The ``book`` command: 0 when every notebook ran clean and Sphinx built the site
    without a warning, 1 when not, 2 when the book cannot be built as asked (a notebook
    outside the parts, an unknown name)."""
    try:
        runs, status = build_book(out_dir, only, jobs, execute)
    except ValueError as e:
        print(f"book: {e}", file=sys.stderr)
        return 2
    return 0 if status == 0 and all(r.ok for r in runs) else 1
