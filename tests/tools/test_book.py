"""The book's pieces without Sphinx: the parts table checked against the notebooks, the
contents made from it, notebooks executed into the cache Sphinx reads (a failing one
reported and forgotten), the command's refusals. (tests/test_notebooks.py builds the
real site and checks it.)"""
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the book needs the notebook packages (pip install '.[dev]')")
pytest.importorskip("jupyter_cache", reason="the book needs myst-nb's notebook cache (pip install '.[dev]')")

from numba_sc.tools import book  # noqa: E402
from numba_sc.tools.book import Chapter, Part  # noqa: E402


def write_notebook(folder: Path, name: str, title: str, code: str = "x = 1") -> Path:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"# {title}\n\nSee [the notation](../docs/notation.md#bounds)."),
        nbformat.v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture
def project(tmp_path):
    """notebooks/ with three notebooks, and a parts table that puts the third notebook
    before the second and announces a fourth."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    write_notebook(nbs, "01_idea", "1. The idea")
    write_notebook(nbs, "02_map", "02 · The map")
    write_notebook(nbs, "03_gmas", "03 · Gather_and_scatter")
    parts = (Part("The idea", "§2", (Chapter("01_idea", "one line about the idea"),)),
             Part("The GMaS step", "§5.2", (Chapter("03_gmas", "gathers <and> scatters *all*"),)),
             Part("The Map step", "§5.1", (Chapter("02_map", "searches"),
                                           Chapter("04_planned", "not written yet", planned=True))),
             Part("Later", "§9", (Chapter("05_later", "nothing yet", planned=True),)))
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
    assert said == ["book: 04_planned.ipynb is planned but not written yet: skipped",
                    "book: 05_later.ipynb is planned but not written yet: skipped"]
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


def test_the_contents_follow_the_parts(project):
    """The contents docs/conf.py puts in docs/index.md: the notation first, the parts in
    their order with their chapters' links and lines, a hidden toctree per part (the
    sidebar and the previous/next links follow it), a part with no notebook yet left
    out, and the reference last."""
    root, parts = project
    chapters = book.chapters_in_order(parts, root / "notebooks", report=lambda line: None)
    text = book.contents_markdown(parts, chapters, ["debugging", "oracle"])
    at = [text.index(s) for s in ("(./notation.md)", "## The idea", "(../notebooks/01_idea.ipynb)",
                                  "## The GMaS step", "(../notebooks/03_gmas.ipynb)", "## The Map step",
                                  "(../notebooks/02_map.ipynb)", "## Reference", "(./debugging.md)",
                                  "(./oracle.md)", "(./api/index.md)")]
    assert at == sorted(at), "the contents are not in the parts' order"
    assert r"gathers \<and\> scatters \*all\*" in text  # shown as written, not read as markup
    assert "04_planned" not in text and "Later" not in text
    toctrees = re.findall(r"```\{toctree\}\n(.*?)```", text, re.S)
    entries = [[line for line in body.splitlines() if line and not line.startswith(":")] for body in toctrees]
    assert entries == [["notation"], ["/notebooks/01_idea"], ["/notebooks/03_gmas"], ["/notebooks/02_map"],
                       ["debugging", "oracle", "api/index"]]
    assert all(":hidden:" in body for body in toctrees)
    assert ":caption: The GMaS step" in toctrees[2]


def test_notebooks_run_into_the_cache_and_a_failing_one_is_reported_then_forgotten(project, capsys, monkeypatch):
    """Each notebook runs in its own kernel with notebooks/ as its folder; the cache then
    holds it, matched by its code as myst-nb matches it. A notebook that raises is
    reported with its cell and error, cached (its page shows where it stopped) and
    forgotten after the build, so that a later build runs it again. A bar over the
    notebooks done is drawn on stderr (asked for: stderr is no terminal here), and
    nowhere in the notebooks' outputs."""
    from jupyter_cache import get_cache

    root, parts = project
    nbs, cache_dir = root / "notebooks", root / "site" / book.CACHE
    (nbs / "here.txt").write_text("notebooks/ is the working folder")
    write_notebook(nbs, "01_idea", "1. The idea", code="print(open('here.txt').read())")
    write_notebook(nbs, "03_gmas", "03 · Broken", code="import math\nmath.sqrt(-1)")
    paths = [nbs / "01_idea.ipynb", nbs / "03_gmas.ipynb"]
    said = []
    monkeypatch.setenv("NUMBA_SC_PROGRESS", "1")
    runs = book.execute_notebooks(paths, cache_dir, jobs=2, timeout=120, report=said.append)
    err = capsys.readouterr().err
    assert "notebooks run" in err and "2/2 [" in err and "notebook/s" in err
    assert [r.name for r in runs] == ["01_idea", "03_gmas"]
    assert runs[0].ok and not runs[1].ok
    assert runs[1].error == "cell 2: ValueError: math domain error"
    assert any("FAILED" in line and "math domain error" in line for line in said)

    chapters = [Chapter("01_idea", ""), Chapter("03_gmas", ""), Chapter("02_map", "")]
    assert book.cached_names(chapters, cache_dir, nbs) == {"01_idea", "03_gmas"}
    cache = get_cache(cache_dir)
    _, merged = cache.merge_match_into_notebook(nbformat.read(paths[0], as_version=4))
    assert merged.cells[1].outputs[0]["text"] == "notebooks/ is the working folder\n"
    assert len(merged.cells[1].outputs) == 1  # (no bar in the notebook)

    book.forget_failed(paths, runs, cache_dir)
    assert book.cached_names(chapters, cache_dir, nbs) == {"01_idea"}
    # A changed notebook is not the cached one: it would run again.
    write_notebook(nbs, "01_idea", "1. The idea", code="x = 2")
    assert book.cached_names(chapters, cache_dir, nbs) == set()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="jobs must be a whole number >= 1"):
        book.build_book(tmp_path, jobs=0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        book.build_book(tmp_path, timeout=0)
    with pytest.raises(ValueError, match="is not a folder"):
        book.chapters_in_order(notebook_dir=tmp_path / "nowhere")


def test_the_command_refuses_an_unknown_notebook(tmp_path, capsys):
    from numba_sc.__main__ import main

    assert main(["book", "--out", str(tmp_path / "site"), "--only", "99"]) == 2
    assert "--only '99' names no notebook of the book" in capsys.readouterr().err
    assert not (tmp_path / "site").exists()  # refused before anything was written



def test_a_kernel_that_fails_to_start_is_started_again(project, monkeypatch):
    """A kernel start that fails before any cell ran (two kernels on one port) is retried
    with a fresh kernel; the notebook then runs as if nothing happened."""
    import nbclient

    root, _ = project
    nbs, cache_dir = root / "notebooks", root / "site" / book.CACHE
    write_notebook(nbs, "01_idea", "1. The idea", code="print(1 + 1)")
    real, failed = nbclient.NotebookClient.async_execute, []

    async def flaky(self, *a, **k):
        if not failed:
            failed.append(1)
            raise RuntimeError("Kernel didn't respond in 60 seconds")
        return await real(self, *a, **k)

    monkeypatch.setattr(nbclient.NotebookClient, "async_execute", flaky)
    runs = book.execute_notebooks([nbs / "01_idea.ipynb"], cache_dir, jobs=1, timeout=120, report=lambda s: None)
    assert failed and runs[0].ok, runs[0].error
