"""Every notebook's exercises: at least two each, every shown solution passes its checker,
every declared slip fails it with a message that explains it (the element, and the rule in
the slip's own words), and an unanswered exercise is reported as such.

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


SLIPS = [(number, i) for number in sorted(EXERCISES) for i in range(len(EXERCISES[number].wrong))]


@pytest.mark.parametrize("number, i", SLIPS, ids=[f"{n}-slip{i}" for n, i in SLIPS])
def test_slip_fails_and_says_why(number, i):
    """Each planted slip fails its checker, and the failure explains it: it says what is
    wrong and where, then the rule, and the slip's own words appear in it (a failure that
    only locates, or names another cause, does not pass)."""
    slip = EXERCISES[number].wrong[i]
    with pytest.raises(ExerciseFailed) as failure:
        EXERCISES[number].checker(slip.answer)
    message = str(failure.value)
    assert failure.value.found and failure.value.rule, message
    assert message == f"{failure.value.found}\nThe rule: {failure.value.rule}"
    assert slip.says.lower() in message.lower(), (
        f"exercise {number}, slip {getattr(slip.answer, '__name__', slip.answer)}: the failure does not say "
        f"{slip.says!r}:\n{message}")


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_every_checker_plants_several_slips(number):
    assert len(EXERCISES[number].wrong) >= 2, f"exercise {number} plants {len(EXERCISES[number].wrong)} slip(s)"


def test_a_race_fails_on_every_run():
    """2.2's maximum without an atomic fails every time, on the same element: the verdict
    comes from the record of who touched what, not from the threads' timing."""
    check = EXERCISES["2.2"].checker
    racy = next(s.answer for s in EXERCISES["2.2"].wrong if s.says == "cuda.atomic.max")
    verdicts = set()
    for _ in range(3):
        with pytest.raises(ExerciseFailed) as failure:
            check(racy)
        assert failure.value.found.startswith("a data race on out[")
        verdicts.add(failure.value.found.split(":")[0])
    assert len(verdicts) == 1, verdicts


def test_a_failure_names_the_element_the_values_and_the_rule():
    with pytest.raises(ExerciseFailed) as failure:
        exercises.expect_equal([[1, 2], [3, 4]], [[1, 2], [3, 5]], "stride 2: table[k, i]", rule="the rule says so",
                               where=lambda ki: f"offset {ki[0]}")
    assert failure.value.found == "stride 2: table[k=1, i=1] (offset 1): got 4, expected 5 (1 of 4 values differ)"
    assert failure.value.rule == "the rule says so"
    with pytest.raises(ExerciseFailed, match=r"shape \(3,\), expected \(2,\)"):
        exercises.expect_equal([1, 2, 3], [1, 2], "x[i]", rule="r")
    exercises.expect_equal([1.0, float("nan")], [1.0 + 1e-9, float("nan")], "x[i]", rule="r", atol=1e-6)
    with pytest.raises(ValueError, match="rule"):
        ExerciseFailed("something is wrong", rule="")


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
