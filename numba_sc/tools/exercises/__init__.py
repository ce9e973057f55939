"""Exercises for the notebooks, each with a checker a student runs and a solution to unfold.

Each notebook ends its sections with exercises. One looks like this in the notebook:

* a markdown cell ``### Exercise 4.1: <title>`` with the task, and below it a
  ``<details><summary>Solution</summary>`` block holding the solution as one
  fenced ``python`` code block (closed by default: the student unfolds it);
* a code cell where the student writes the answer (a function, or a ``@cuda.jit``
  kernel), then checks it::

      def lower_bound(keys, query):
          raise NotImplementedError  # your answer here

      exercises.check("4.1", lower_bound)

:func:`check` runs the exercise's checker on the answer: on inputs of its own (for a
kernel, a crop of a real scan, launched as the stage's ladder launches its rungs, under
the simulator), it checks the point the exercise makes, not only the numbers: a
kernel whose threads race fails although the simulator happened to give the right
values (:mod:`.races`), a search that should be branch-free is watched reading its
block, every flag the exercise names is tried both ways. A wrong answer raises
:class:`ExerciseFailed`, whose message says which element is wrong, what it held,
what was expected, and the rule it breaks (:func:`expect_equal`). An answer that is
still ``None`` (a kernel's placeholder) or raises ``NotImplementedError`` is not
checked ("not answered yet"), so the notebooks run top to bottom as committed.

The checkers live in one module per notebook (``nb04.py`` for notebook 04), each
declared with :func:`exercise`, together with the classic slips of its topic
(:class:`Slip`: an off-by-one, a missing atomic, a flag ignored), each with a phrase
its failure must contain. ``tests/tools/test_exercises.py`` runs every solution the
notebooks show through its checker (it must pass) and every slip (it must fail, and
say so in those words).
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["EXERCISES", "Exercise", "ExerciseFailed", "Slip", "check", "exercise", "expect_equal",
           "expect_no_race", "python_lines", "recorded_launch"]


class ExerciseFailed(AssertionError):
    """A wrong answer. ``found``: what is wrong and where (the element, what it held, what
    was expected); ``rule``: what a right answer obeys, and why. The message is both."""

    def __init__(self, found: str, rule: str):
        if not rule:
            raise ValueError("a failure must say the rule it breaks")
        super().__init__(f"{found}\nThe rule: {rule}")
        self.found, self.rule = found, rule


@dataclass(frozen=True)
class Slip:
    """A deliberately wrong answer, the classic slip of an exercise's topic, and a phrase
    (``says``) that its checker's failure must contain: the test checks that the failure
    explains this slip, not only that it happens."""

    answer: Callable
    says: str


@dataclass(frozen=True)
class Exercise:
    """One exercise: its number (``"4.1"``: notebook 04, first exercise), its title, the
    checker (``checker(answer)`` raises :class:`ExerciseFailed` on a wrong answer), the
    name the notebook gives the answer, and the slips its checker must reject."""

    number: str
    title: str
    checker: Callable
    answer: str
    wrong: tuple


EXERCISES: dict = {}


def exercise(number: str, title: str, answer: str, wrong):
    """Declare the decorated function as exercise ``number``'s checker (``answer``: the name
    of the function or kernel the student writes; ``wrong``: the :class:`Slip` s it rejects)."""
    wrong = tuple(wrong)
    if not wrong or not all(isinstance(s, Slip) for s in wrong):
        raise TypeError(f"exercise {number}: wrong= takes one or more Slip(answer, says=...)")

    def register(checker):
        if number in EXERCISES:
            raise ValueError(f"exercise {number} is declared twice")
        EXERCISES[number] = Exercise(number, title, checker, answer, wrong)
        return checker
    return register


def _load_all():
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def expect_equal(got, expected, what: str, *, rule: str, atol: float = 0.0, where=None):
    """Raise :class:`ExerciseFailed` unless ``got`` equals ``expected`` (to ``atol``; NaN
    equals NaN). The failure names the first differing element by its index, says what it
    held and what was expected, and gives the ``rule``.

    ``what`` is the array as the exercise writes it, with its index letters,
    ``"table[k, i]"`` (the first wrong element then reads ``table[k=3, i=11]``); words
    before it say which case (``"stride 2: table[k, i]"``). ``where(index)``, if given,
    describes the element in the exercise's terms (the offset, the output's coordinates)."""
    import numpy as np

    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        raise ExerciseFailed(f"{what}: the answer has shape {got.shape}, expected {expected.shape}", rule)
    if atol or (got.dtype.kind in "fc" and expected.dtype.kind in "fc"):
        bad = ~np.isclose(got, expected, rtol=0, atol=atol, equal_nan=True)
    else:
        bad = got != expected
    if np.any(bad):
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        about = f" ({where(i)})" if where is not None else ""
        count = f" ({int(bad.sum())} of {got.size} values differ)" if got.size > 1 else ""
        raise ExerciseFailed(f"{_at(what, i)}{about}: got {_show(got[i])}, expected {_show(expected[i])}{count}",
                             rule)


def _at(what: str, index: tuple) -> str:
    """``what`` with its last ``name[letters]`` filled in at ``index``: ``table[k=3, i=11]``."""
    last = None
    for last in re.finditer(r"(\w+)\[([^\[\]]*)\]", what):
        pass
    if not index:
        return what
    letters = [s.strip() for s in last.group(2).split(",")] if last else []
    if len(letters) != len(index):
        return f"{what}, element {index}"
    filled = ", ".join(f"{a}={v}" for a, v in zip(letters, index))
    return f"{what[:last.start()]}{last.group(1)}[{filled}]{what[last.end():]}"


def _show(v) -> str:
    """A value as a student reads it: float32 noise trimmed (7 significant digits)."""
    v = v.item() if hasattr(v, "item") else v
    return f"{v:.7g}" if isinstance(v, float) else repr(v)


def python_lines(fn, *args):
    """``(fn(*args), lines)``: the answer's result and how many lines of Python it ran in its
    own source (the cell or file that defines ``fn``; library calls are not counted). A
    loop over every pair runs at least a line a pair; array operations, a few in all."""
    source = getattr(getattr(fn, "__code__", None), "co_filename", None)
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return count

    def calls(frame, event, arg):  # trace only the frames of the answer's own source
        return count if frame.f_code.co_filename == source else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        result = fn(*args)
    finally:
        sys.settrace(previous)
    return result, lines


def recorded_launch(kernel, name: str, grid, block, args: dict, watch=()):
    """Launch a student's kernel under the recorder (:func:`.races.record`): every access
    to the arguments named in ``watch`` and to shared arrays is noted. An answer that is
    not a kernel is a failure that says how to make one."""
    from ...core.device import gpu_present
    from .races import record

    if getattr(kernel, "py_func", None) is None:
        raise ExerciseFailed(f"{name} is a {type(kernel).__name__}, not a kernel",
                             "a kernel is a function decorated with @cuda.jit, launched as "
                             f"{name}[blocks, threads](...)")
    if gpu_present():  # compiled and run on the device too: what Numba cannot compile fails here, in its words
        kernel[grid, block](*(a.copy() if hasattr(a, "copy") else a for a in args.values()))
    return record(kernel, grid, block, args, watch)


def expect_no_race(rec, rule: str):
    """Raise :class:`ExerciseFailed` naming the first data race of a recorded launch
    (:meth:`.races.Record.races`): the element, the two threads and what each did."""
    found = rec.races()
    if found:
        more = f" ({len(found)} elements race in all.)" if len(found) > 1 else ""
        raise ExerciseFailed(rec.explain(found[0]) + more, rule)


def check(number: str, answer) -> bool:
    """Check ``answer`` for exercise ``number``; prints the verdict. Returns True when right,
    False when not answered yet; raises :class:`ExerciseFailed` when wrong."""
    if not EXERCISES:
        _load_all()
    if number not in EXERCISES:
        raise KeyError(f"no exercise {number!r}; the exercises are {sorted(EXERCISES)}")
    ex = EXERCISES[number]
    try:
        if answer is None:  # a kernel cell's placeholder: `my_kernel = None`
            raise NotImplementedError
        ex.checker(answer)
    except NotImplementedError:
        print(f"Exercise {number} ({ex.title}): not answered yet. Write your answer above and run this cell again.")
        return False
    print(f"Exercise {number} ({ex.title}): correct.")
    return True


_load_all()
