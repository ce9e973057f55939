"""Every notebook's exercises: at least two each, every shown solution passes its checker,
every declared wrong answer fails it, and an unanswered exercise is reported as such.

Solutions are read from the notebooks themselves (the ``<details>`` block under each
``### Exercise N.M`` heading), so the solution a student unfolds is the one tested.
"""
import json
import re
from pathlib import Path

import pytest

from numba_sc.tools import exercises
from numba_sc.tools.exercises import EXERCISES, ExerciseFailed

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
HEADING = re.compile(r"^#{2,4}\s*Exercise\s+(\d+\.\d+)\b", re.M)
SOLUTION = re.compile(r"<details>.*?```python\n(.*?)```.*?</details>", re.S)
CHECK = re.compile(r"""exercises\.check\(\s*["'](\d+\.\d+)["']\s*,\s*(\w+)\s*\)""")


def _cells(path):
    return [("".join(c["source"]) if isinstance(c["source"], list) else c["source"], c["cell_type"])
            for c in json.loads(path.read_text())["cells"]]


def notebook_exercises(path):
    """{number: (solution code, the name the check cell passes)} of one notebook."""
    found, cells = {}, _cells(path)
    for i, (text, kind) in enumerate(cells):
        if kind != "markdown":
            continue
        for number in HEADING.findall(text):
            sol = SOLUTION.search(text)
            checks = [m for t, k in cells[i + 1:i + 4] if k == "code" for m in CHECK.findall(t)]
            name = next((n for num, n in checks if num == number), None)
            found[number] = (sol.group(1) if sol else None, name)
    return found


ALL = {num: (path, *v) for path in NOTEBOOKS for num, v in notebook_exercises(path).items()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_every_notebook_has_two_exercises(path):
    found = notebook_exercises(path)
    assert len(found) >= 2, f"{path.name} has {len(found)} exercises (### Exercise N.M headings); at least two"
    prefix = str(int(path.name[:2]))
    for number, (solution, name) in found.items():
        assert number.split(".")[0] == prefix, f"{path.name}: exercise {number} should be numbered {prefix}.M"
        assert solution, f"{path.name}: exercise {number} has no <details> solution with a ```python block"
        assert name, f"{path.name}: exercise {number}'s heading is not followed by a cell calling exercises.check"
        assert number in EXERCISES, f"{path.name}: exercise {number} has no checker in numba_sc.tools.exercises"
        assert EXERCISES[number].answer == name, (
            f"{path.name}: exercise {number} checks {name!r}, its checker expects {EXERCISES[number].answer!r}")


def test_every_checker_is_in_a_notebook():
    missing = sorted(set(EXERCISES) - set(ALL))
    assert not missing, f"exercises declared in numba_sc.tools.exercises but in no notebook: {missing}"


def _solve(number):
    path, solution, name = ALL[number]
    namespace = {}
    exec(compile(solution, f"{path.name}:exercise {number}", "exec"), namespace)
    assert name in namespace, f"exercise {number}'s solution does not define {name}"
    return namespace[name]


@pytest.mark.parametrize("number", sorted(ALL))
def test_solution_passes(number, capsys):
    assert exercises.check(number, _solve(number)) is True
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_wrong_answer_fails(number):
    with pytest.raises(ExerciseFailed):
        EXERCISES[number].checker(EXERCISES[number].wrong)


def test_unanswered_is_not_checked(capsys):
    number = sorted(EXERCISES)[0] if EXERCISES else pytest.skip("no exercises yet")

    def stub(*args, **kwargs):
        raise NotImplementedError

    assert exercises.check(number, stub) is False
    assert exercises.check(number, None) is False
    assert "not answered yet" in capsys.readouterr().out


def test_unknown_exercise_is_named():
    with pytest.raises(KeyError, match="no exercise '99.9'"):
        exercises.check("99.9", lambda: None)


def test_checkers_launch_kernels_as_numba_teaches():
    """A checker launches a student's kernel as ``kernel[blocks, threads](...)``, never
    through the library's launcher (``numba_sc.core.launch.launch``: its fast path is the
    library's, not the lesson's)."""
    import ast

    folder = Path(exercises.__file__).parent
    for source in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("core.launch"):
                names = {a.name for a in node.names}
                assert "launch" not in names, f"{source.name} imports core.launch.launch"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called = node.func.id
                assert called not in ("launch", "launch_on_gpu"), f"{source.name}:{node.lineno} calls {called}"
