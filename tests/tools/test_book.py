"""The book's pieces, on tiny notebooks made here: the parts table checked against the
notebooks, links rewritten, the contents and the navigation in the parts' order, and a
notebook that raises failing the build. (tests/test_notebooks.py builds the real book.)"""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the book needs the notebook packages (pip install '.[dev]')")
pytest.importorskip("nbconvert", reason="the book needs nbconvert (pip install '.[dev]')")

from numba_sc.tools import book  # noqa: E402
from numba_sc.tools.book import Chapter, Part  # noqa: E402


def write_notebook(folder: Path, name: str, title: str, code: str = "x = 1", link: str = "") -> Path:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"# {title}\n\nSee [the notation](../docs/notation.md#bounds).{link}"),
        nbformat.v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture
def project(tmp_path):
    """notebooks/ with three notebooks, docs/ with the notation page and one more, and a
    parts table that puts the third notebook before the second."""
    nbs, docs = tmp_path / "notebooks", tmp_path / "docs"
    nbs.mkdir()
    docs.mkdir()
    write_notebook(nbs, "01_idea", "1. The idea", link=" Next: [two](02_map.ipynb#top).")
    write_notebook(nbs, "02_map", "02 · The map")
    write_notebook(nbs, "03_gmas", "03 · Gather_and_scatter")
    (docs / "notation.md").write_text('# Notation\n\n<a id="bounds"></a>\n### Bounds\n\nsee [02](../notebooks/02_map.ipynb)\n')
    (docs / "debugging.md").write_text("# Debugging a kernel\n\nsee [the README](../README.md)\n")
    (tmp_path / "README.md").write_text("# readme\n")
    parts = (Part("The idea", "§2", (Chapter("01_idea", "one line about the idea"),)),
             Part("The GMaS step", "§5.2", (Chapter("03_gmas", "gathers <and> scatters"),)),
             Part("The Map step", "§5.1", (Chapter("02_map", "searches"),
                                           Chapter("04_planned", "not written yet", planned=True))))
    return tmp_path, parts


def test_every_notebook_of_the_repository_is_in_the_parts_table():
    chapters = book.chapters_in_order(report=lambda line: None)
    assert {c.name for c in chapters} == {p.stem for p in book.NOTEBOOK_DIR.glob("*.ipynb")}
    assert [c.name for c in chapters] == [c.name for p in book.PARTS for c in p.chapters if c in chapters]


def test_a_notebook_in_no_part_is_an_error_that_names_it(project):
    root, parts = project
    write_notebook(root / "notebooks", "13_new", "13 · New")
    with pytest.raises(ValueError, match=r"notebooks/13_new\.ipynb.*add each to PARTS"):
        book.chapters_in_order(parts, root / "notebooks")


def test_a_listed_notebook_that_is_absent_is_an_error_unless_planned(project):
    root, parts = project
    said = []
    got = book.chapters_in_order(parts, root / "notebooks", report=said.append)
    assert [c.name for c in got] == ["01_idea", "03_gmas", "02_map"]  # the parts' order, not the files'
    assert said == ["book: 04_planned.ipynb is planned but not written yet: skipped"]
    unplanned = parts[:2] + (Part("The Map step", "§5.1", (Chapter("02_map", "x"), Chapter("04_gone", "y"))),)
    with pytest.raises(ValueError, match=r"notebooks/04_gone\.ipynb.*planned=True"):
        book.chapters_in_order(unplanned, root / "notebooks")
    twice = parts + (Part("Again", "", (Chapter("01_idea", "z"),)),)
    with pytest.raises(ValueError, match="more than once"):
        book.chapters_in_order(twice, root / "notebooks")


def test_only_selects_by_name_or_number():
    chapters = [Chapter("01_idea", ""), Chapter("03_gmas", ""), Chapter("02_map", "")]
    assert [c.name for c in book.select(chapters, ["2", "01_idea.ipynb"])] == ["01_idea", "02_map"]
    assert [c.name for c in book.select(chapters, ["03_gmas", "03"])] == ["03_gmas"]
    with pytest.raises(ValueError, match=r"'7' names no notebook.*01_idea, 03_gmas, 02_map"):
        book.select(chapters, ["7"])


def test_links_point_at_the_pages_of_the_book(tmp_path):
    nbs, out = tmp_path / "notebooks", tmp_path / "build" / "book"
    pages = {(tmp_path / "docs" / "notation.md").resolve(): "notation.html",
             (nbs / "05_gather.ipynb").resolve(): "05_gather.html"}

    def link(target):
        return book.rewrite_link(target, nbs, pages, out)

    assert link("../docs/notation.md#bounds") == "notation.html#bounds"
    assert link("05_gather.ipynb") == "05_gather.html"
    assert link("./05_gather.ipynb#3.-Tiles") == "05_gather.html#3.-Tiles"
    # other files of the repository: reached from the book's folder
    assert link("../numba_sc/gmas/gather.py") == "../../numba_sc/gmas/gather.py"
    assert link("../benchmarks/results/conv.json#x") == "../../benchmarks/results/conv.json#x"
    for unchanged in ("https://arxiv.org/abs/2401.x.ipynb", "#bounds", "mailto:a@b.c", "data:image/png;base64,AA",
                      "/abs/notation.md", ""):
        assert link(unchanged) == unchanged
    page = ('<p><a href="../docs/notation.md#bounds">N</a> <a href=\'05_gather.ipynb\'>5</a> '
            '<img src="fig.png"> <a href="https://x.org/a.md">w</a></p>')
    assert book.rewrite_links(page, nbs, pages, out) == (
        '<p><a href="notation.html#bounds">N</a> <a href=\'05_gather.html\'>5</a> '
        '<img src="../../notebooks/fig.png"> <a href="https://x.org/a.md">w</a></p>')


def test_titles_are_first_headings(project):
    root, _ = project
    assert book.notebook_title(root / "notebooks" / "02_map.ipynb") == "02 · The map"
    assert book.first_heading("text\n\n## A *title* ##\n# later") == "A *title*"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no heading here")])
    nbformat.write(nb, root / "untitled.ipynb")
    with pytest.raises(ValueError, match=r"untitled\.ipynb has no heading"):
        book.notebook_title(root / "untitled.ipynb")


def test_contents_and_navigation_follow_the_parts(project):
    root, parts = project
    out = root / "book"
    said = []
    runs = book.build_book(out, execute=False, parts=parts, notebook_dir=root / "notebooks",
                           docs_dir=root / "docs", report=said.append)
    assert [r.name for r in runs] == ["01_idea", "03_gmas", "02_map"] and all(r.ok for r in runs)
    assert {p.name for p in out.iterdir()} == {"index.html", "book.json", "notation.html", "debugging.html",
                                               "01_idea.html", "03_gmas.html", "02_map.html"}
    index = (out / "index.html").read_text()
    body = index[index.index("<main>"):]
    at = [body.index(s) for s in ('href="notation.html"', "The idea", 'href="01_idea.html"', "The GMaS step",
                                  'href="03_gmas.html"', "The Map step", 'href="02_map.html"',
                                  'href="debugging.html"')]
    assert at == sorted(at), "the contents are not in the parts' order"
    assert "03 · Gather_and_scatter" in body and "gathers &lt;and&gt; scatters" in body  # shown as written
    assert "04_planned" not in body
    # Reading order: notation, the notebooks in the parts' order, the other docs.
    nav = {p: (out / f"{p}.html").read_text() for p in ("notation", "01_idea", "03_gmas", "02_map", "debugging")}
    assert '&larr; Notation</a>' in nav["01_idea"] and '03 · Gather_and_scatter &rarr;</a>' in nav["01_idea"]
    assert 'href="02_map.html">02 · The map &rarr;' in nav["03_gmas"]
    assert 'href="debugging.html">Debugging a kernel &rarr;' in nav["02_map"]
    assert all('href="index.html">Contents</a>' in page for page in nav.values())
    # The links of every page, rewritten.
    assert 'href="notation.html#bounds"' in nav["01_idea"] and 'href="02_map.html#top"' in nav["01_idea"]
    assert 'href="02_map.html"' in nav["notation"] and 'href="../README.md"' in nav["debugging"]
    assert ".ipynb" not in nav["01_idea"].split("<main>")[1]
    # --only rebuilds one page; the contents still list all of them.
    (out / "03_gmas.html").unlink()
    book.build_book(out, ["2"], execute=False, parts=parts, notebook_dir=root / "notebooks",
                    docs_dir=root / "docs", report=said.append)
    index = (out / "index.html").read_text()
    assert 'href="02_map.html"' in index and "03 · Gather_and_scatter (not built yet)" in index


def test_a_notebook_that_raises_fails_the_build_and_its_page_shows_where(project):
    root, parts = project
    write_notebook(root / "notebooks", "03_gmas", "03 · Broken", code="import math\nmath.sqrt(-1)")
    said = []
    runs = book.build_book(root / "book", ["3"], jobs=1, parts=parts, notebook_dir=root / "notebooks",
                           docs_dir=root / "docs", report=said.append)
    (run,) = runs
    assert not run.ok and run.error == "cell 2: ValueError: math domain error"
    assert any("FAILED" in line and "math domain error" in line for line in said)
    page = (root / "book" / "03_gmas.html").read_text()
    assert page.count('class="book-error"') == 1 and 'class="book-failed"' in page


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="jobs must be a whole number >= 1"):
        book.build_book(tmp_path, jobs=0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        book.build_book(tmp_path, timeout=0)
    with pytest.raises(ValueError, match="is not a folder"):
        book.build_book(tmp_path, notebook_dir=tmp_path / "nowhere")


def test_the_command_refuses_an_unknown_notebook_and_renders_one_without_running(tmp_path, capsys):
    from numba_sc.__main__ import main

    assert main(["book", "--out", str(tmp_path), "--only", "99"]) == 2
    assert "--only '99' names no notebook of the book" in capsys.readouterr().err
    assert main(["book", "--out", str(tmp_path), "--only", "01", "--no-execute"]) == 0
    out = capsys.readouterr().out
    assert "rendered, not executed" in out and f"open {(tmp_path / 'index.html').as_uri()}" in out
    assert {p.name for p in tmp_path.glob("01_*.html")} == {"01_sparse_convolution_from_scratch.html"}
