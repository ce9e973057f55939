"""What every lesson promises its reader, checked on the committed notebooks (no execution):

* it uses the package's public API only: no underscore name of numba-sc (``x._trusted``,
  ``from numba_sc.nn import _Conv``);
* a stage notebook climbs its ladder: for each stage it shows, the first rung a reader
  meets is that stage's ``v1`` (``lesson.show(stage, "v1")``), before any other rung's
  code or diff;
* it links the notation page.
"""
import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# The notebooks that teach a stage's kernels, and the ladders each must climb.
STAGE_NOTEBOOKS = {"02": {"voxelization", "output_coords"}, "04": {"backward_search", "forward_search"},
                   "05": {"gather", "scatter"}}


def _code(path):
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            # IPython's magics and shell escapes are not Python.
            yield i, "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


def private_uses(source: str) -> list:
    """The underscore names of numba-sc that ``source`` reaches for."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numba_sc"):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [p for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Import):
            found += [p for a in node.names if a.name.startswith("numba_sc") for p in a.name.split(".")
                      if p.startswith("_")]
    return found


def test_the_rule_sees_private_names():
    # Guards the test below: it must catch each way of reaching a private name.
    found = private_uses("x = t._trusted(a)\nfrom numba_sc.nn import _Conv\nimport numba_sc._x")
    assert sorted(found) == ["_Conv", "_trusted", "_x"]
    assert private_uses("x.__class__; from numba_sc.tools import lesson") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_public_api_only(path):
    bad = {i: private_uses(src) for i, src in _code(path)}
    bad = {i: names for i, names in bad.items() if names}
    assert not bad, f"{path.name} uses underscore names of the package (cell: names): {bad}"


LESSON_CALL = re.compile(r"""lesson\.(show|diff|code)\(\s*["'](\w+)["']\s*,\s*["'](v\d+)["']""")


def first_rungs(path) -> dict:
    """{stage: (the first lesson call on it, its rung)} in reading order."""
    first = {}
    for _, src in _code(path):
        for call, stage, rung in LESSON_CALL.findall(src):
            first.setdefault(stage, (call, rung))
    return first


@pytest.mark.parametrize("number", sorted(STAGE_NOTEBOOKS))
def test_a_stage_notebook_starts_at_v1(number):
    [path] = [p for p in NOTEBOOKS if p.name.startswith(number)]
    first = first_rungs(path)
    for stage in STAGE_NOTEBOOKS[number]:
        assert stage in first, f"{path.name} never shows the {stage} ladder (lesson.show({stage!r}, 'v1'))"
        assert first[stage] == ("show", "v1"), (
            f"{path.name}: the first {stage} rung a reader meets is lesson.{first[stage][0]}(..., "
            f"{first[stage][1]!r}); it must be lesson.show({stage!r}, 'v1')")
    # No kernel source reaches the reader another way first.
    for _, src in _code(path):
        assert "getsource" not in src, f"{path.name} prints kernel source with inspect.getsource: use lesson.show"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_links_the_notation_page(path):
    text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    assert "docs/notation.md" in text, f"{path.name} does not link ../docs/notation.md"
