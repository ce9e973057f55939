"""Sphinx's settings for the numba-sc site: the book (every notebook, executed, in the
paper's order), the pages of docs/, and an API reference made from the docstrings.

``numba-sc book`` builds it (numba_sc/tools/book.py: it executes the notebooks, several
at once, then runs Sphinx with these settings). By hand, from the repository's root::

    sphinx-build -W -c docs . build/book                          # executes every notebook
    sphinx-build -c docs -D nb_execution_mode=off . build/book     # quick: pages without outputs

The source folder is the repository's root, not docs/, so that every link resolves as
it is written for GitHub: a notebook links the notation as ``../docs/notation.md#bounds``
and a result file as ``../benchmarks/results/net_scans.json``, and with the root as the
source folder a link to a page becomes a link to that page of the site, a link to any
other file a download of it (MyST). ``include_patterns`` keeps the site to docs/ and
notebooks/; ``root_doc`` is docs/index.md, and the site's index.html sends a reader there.

The book's order is one list, :data:`numba_sc.tools.book.PARTS`: docs/index.md holds a
marker that the contents made from it replace (:func:`numba_sc.tools.book.contents_markdown`),
and a notebook that no part lists stops the build.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from pathlib import Path

from docutils import nodes
from docutils.transforms import Transform

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # this checkout's numba_sc, whether installed or not

from numba_sc import __version__  # noqa: E402
from numba_sc.tools import book  # noqa: E402

# The book's chapters, checked against notebooks/ before anything is read: a notebook
# that no part of PARTS lists (or a listed one that is missing) stops the build here.
CHAPTERS = book.chapters_in_order(report=lambda line: None)  # (`numba-sc book` reports a planned one)

project = "numba-sc"
author = "the numba-sc authors"
copyright = "numba-sc authors, MIT license"
release = version = __version__

extensions = [
    "myst_nb",  # notebooks, executed and rendered; Markdown pages read as MyST (myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",  # a page per module of numba_sc (docs/api/index.md)
    "sphinx.ext.napoleon",  # the docstrings' NumPy-style sections
    "sphinx.ext.mathjax",  # the maths, with MathJax's own files copied into the site (below)
    "sphinx.ext.viewcode",  # each documented object links its source
]

# ------------------------------------------------------------------ what the site holds
root_doc = "docs/index"
include_patterns = ["docs/**", "notebooks/*.ipynb"]
# Pruned while Sphinx walks the root (include_patterns alone would still walk .venv).
exclude_patterns = [".*", "build", "**/.ipynb_checkpoints", "docs/_templates", "docs/_static"]
templates_path = [str(DOCS / "_templates")]  # absolute: autosummary reads it from the source folder, HTML from docs/

# ------------------------------------------------------------------ notebooks and Markdown
# Executed with notebooks/ as the working folder, as a reader runs them, in this process's
# environment (NUMBA_ENABLE_CUDASIM chooses the simulator or the GPU). "force" runs every
# notebook Sphinx reads; `numba-sc book` runs them itself, several at once, and passes
# "cache" with the cache it filled; "off" renders them as committed (a quick look).
nb_execution_mode = "force"
# `numba-sc book --only ...` names the notebooks it neither ran nor found in the cache.
nb_execution_excludepatterns = [p for p in os.environ.get(book.NOT_RUN, "").split(",") if p]
nb_execution_in_temp = False
nb_execution_timeout = book.CELL_TIMEOUT_S
nb_execution_allow_errors = False  # a cell that raises stops its notebook, with a warning (-W: an error)
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]  # $...$ and $$...$$, as Jupyter renders them

# ------------------------------------------------------------------ the API reference
autosummary_generate = True  # the pages go to docs/api/generated/ (ignored by git)
autodoc_member_order = "bysource"  # a module's own order: the lesson's, the idea before the rungs
autodoc_typehints = "description"
autodoc_mock_imports = ["torch", "cupy"]  # optional dependencies (nn.torch_adapter, the GPU's arrays)
napoleon_google_docstring = False
napoleon_numpy_docstring = True


# The docstrings are written to be read with help() first. Two habits of theirs mean
# something else to reStructuredText: |Q|, the size of a set, would be a substitution
# (so each such name is defined as itself), and a kernel compiled by @cuda.jit is an
# object autodoc does not document (see _walk).
rst_epilog = "\n".join(f".. |{name}| replace:: \\|{name}\\|" for name in ("P", "Q", "rung - reference"))


def _walk(package: str = "numba_sc") -> tuple[dict[str, list[str]], dict[str, str]]:
    """Two looks at every module of ``package``, for the API pages.

    Re-exports: for a module whose ``__all__`` names classes or functions defined
    elsewhere (``numba_sc.sparse_conv3d`` is ``numba_sc.conv.layer``'s), those names'
    homes. Each object is documented once, in its home; the module that re-exports it
    lists it (docs/_templates/autosummary/module.rst).

    Kernels: autodoc documents functions and classes, and a ``@cuda.jit`` kernel is
    neither (a Numba dispatcher, or the simulator's stand-in), so the kernels, which are
    what the lessons teach, would be left out. In this process (the docs build) each
    module's kernel is replaced by the Python function it compiles, which has the
    kernel's docstring, signature and source line; the returned names get a line saying
    that they are kernels or device functions (:func:`_kernel_note`).
    """
    reexports, kernels = {}, {}
    top = importlib.import_module(package)
    for name in [package] + [m.name for m in pkgutil.walk_packages(top.__path__, package + ".")]:
        if name.rpartition(".")[2].startswith("_"):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (torch): autodoc mocks it
            continue
        for attr, obj in list(vars(module).items()):
            py_func = getattr(obj, "py_func", None)
            if type(obj).__module__.startswith("numba.cuda") and inspect.isfunction(py_func) \
                    and py_func.__module__ == name and not attr.startswith("_"):
                device = getattr(obj, "_device", None)  # the simulator's; a GPU's dispatcher: targetoptions
                if device is None:
                    device = getattr(obj, "targetoptions", {}).get("device", False)
                kernels[f"{name}.{attr}"] = "device function" if device else "kernel"
                setattr(module, attr, py_func)
        homes = []
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr, None)
            home = getattr(obj, "__module__", name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and home != name:
                homes.append(f"{home}.{obj.__qualname__}")
        if homes:
            reexports[name] = homes
    return reexports, kernels


REEXPORTS, KERNELS = _walk()
autosummary_context = {"reexports": REEXPORTS}


SECTION_RULE = re.compile(r"^-{3,}\s*$")
PARAMETER = re.compile(r"^\*{0,2}\w+(\s*,\s*\*{0,2}\w+)*(\s+:(\s.*)?)?$")  # "x", "a, b", "x : int"


def _end_sections(app, what, name, obj, options, lines):
    """End a NumPy-style section where the docstring goes on in prose.

    The docstrings follow a Parameters section with a paragraph after one blank line
    ("Returns a :class:`Voxelization` with ..."), which reads right in help(); napoleon
    reads on until two blank lines or the next section, and makes each line of that
    paragraph a parameter. A line at the left margin after a blank line, with the next
    line at the margin too, is a paragraph and not a parameter (a parameter's
    description is indented), unless it reads as a parameter's line ("x : int"): a
    second blank line is put before it. Runs before napoleon (priority 400 < its 500)."""
    in_section, i = False, 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and SECTION_RULE.match(lines[i + 1]) and line.strip():
            in_section, i = True, i + 2
            continue
        if in_section and not line.strip() and i + 2 < len(lines):
            first, second = lines[i + 1], lines[i + 2]
            if first.strip() and not first[0].isspace() and second.strip() and not second[0].isspace() \
                    and not SECTION_RULE.match(second) and not PARAMETER.match(first):
                lines.insert(i + 1, "")
                in_section = False
                i += 1
        i += 1


def _kernel_note(app, what, name, obj, options, lines):
    """The first line of a kernel's documentation says it is one, and how it runs."""
    kind = KERNELS.get(name)
    if kind == "kernel":
        short = name.rpartition(".")[2]
        lines[:0] = [f"*A CUDA kernel* (``@cuda.jit``), launched as ``{short}[blocks, threads](...)``.", ""]
    elif kind == "device function":
        lines[:0] = ["*A CUDA device function* (``@cuda.jit(device=True)``), called from kernels.", ""]


# ------------------------------------------------------------------ the pages
html_theme = "furo"
html_title = f"numba-sc {release}"
html_static_path = []
html_additional_pages = {"index": "redirect.html"}  # the site's index.html: on to docs/index.html
html_last_updated_fmt = "%Y-%m-%d"

# MathJax from the files of a pip package (sphinx-mathjax-offline), not from a CDN: the
# maths renders with no network. Its folder static/mathjax/ is copied into _static/.
_mathjax = importlib.util.find_spec("sphinx-mathjax-offline")
if _mathjax is None:
    raise RuntimeError("docs/conf.py: the package sphinx-mathjax-offline is missing (MathJax's files for the "
                       "maths, offline): pip install -e '.[dev]'")
html_static_path.append(str(Path(next(iter(_mathjax.submodule_search_locations))) / "static"))
mathjax_path = "mathjax/tex-chtml.js"


# ------------------------------------------------------------------ hooks
# The line of docs/index.md that the book's contents replace (a MyST comment).
CONTENTS_MARKER = re.compile(r"^% book-contents\b.*$", re.M)


def _contents(app, docname, source):
    """Put the book's contents, made from ``PARTS``, in place of the marker in docs/index.md."""
    if docname != root_doc:
        return
    guides = sorted(p.stem for p in DOCS.glob("*.md") if p.stem not in ("index", book.FIRST_DOC))
    made = book.contents_markdown(book.PARTS, CHAPTERS, guides)
    source[0], found = CONTENTS_MARKER.subn(lambda m: made, source[0], count=1)
    if not found:
        raise RuntimeError("docs/index.md has lost its line '% book-contents': the book's contents go there")


class HtmlAnchors(Transform):
    """``<a id="bounds"></a>`` before an entry of a Markdown page (docs/notation.md marks
    its entries so, which GitHub shows too) becomes a target Sphinx knows: a link to
    ``notation.md#bounds`` then resolves, and one to an anchor that is not there warns.
    (MyST passes the two tags on as two pieces of raw HTML, the opening and the closing.)"""

    default_priority = 200  # before docutils moves targets onto the element after them (260)
    OPEN = re.compile(r'<a\s+(?:id|name)="([^"]+)"\s*>')

    def apply(self):
        for raw in list(self.document.findall(nodes.raw)):
            m = self.OPEN.fullmatch(raw.astext().strip())
            if not m or "html" not in raw.get("format", "").split():
                continue
            after = raw.next_node(descend=False, siblings=True)
            if isinstance(after, nodes.raw) and after.astext().strip() == "</a>":
                name = m.group(1)
                after.parent.remove(after)
                holder = self.document.ids.get(name)
                if holder is None:
                    target = nodes.target("", "", names=[name])
                    self.document.note_explicit_target(target)
                    raw.replace_self(target)
                else:  # the heading after it has this id already ("Tensor stride"): name that
                    holder["names"].append(name)
                    self.document.nameids[name] = name
                    self.document.nametypes[name] = True
                    raw.parent.remove(raw)


def setup(app):
    app.connect("source-read", _contents)
    app.add_transform(HtmlAnchors)
    app.connect("autodoc-process-docstring", _end_sections, priority=400)
    app.connect("autodoc-process-docstring", _kernel_note)
