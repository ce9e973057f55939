"""Exercises for the notebooks, each with a checker a student runs and a solution to unfold.

Each notebook ends its sections with exercises. One looks like this in the notebook:

* a markdown cell ``### Exercise 4.1: <title>`` with the task, and below it a
  ``<details><summary>Solution</summary>`` block holding the solution as one
  ```` ```python ```` block (closed by default: the student unfolds it);
* a code cell where the student writes the answer (a function, or a ``@cuda.jit``
  kernel), then checks it::

      def lower_bound(keys, query):
          raise NotImplementedError  # your answer here

      exercises.check("4.1", lower_bound)

:func:`check` runs the exercise's checker on the answer: on inputs of its own (for a
kernel, a crop of a real scan, run the way the stage's ladder runs its rungs, under
the simulator without a GPU), it compares the answer with the stage's NumPy
reference and raises :class:`ExerciseFailed` naming the first input where they
differ. An answer that is still ``None`` (a kernel's placeholder) or raises
``NotImplementedError`` is not checked ("not answered yet"), so the notebooks run top
to bottom as committed.

The checkers live in one module per notebook (``nb04.py`` for notebook 04), each
declared with :func:`exercise`, together with a *wrong* answer (a plausible slip: an
off-by-one, a missing atomic) that its checker must reject: ``tests/tools/
test_exercises.py`` runs every solution the notebooks show through its checker
(it must pass) and every wrong answer (it must fail).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

__all__ = ["EXERCISES", "Exercise", "ExerciseFailed", "check", "exercise", "expect_equal"]


class ExerciseFailed(AssertionError):
    """An answer disagrees with the reference; the message says where."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: its number (``"4.1"``: notebook 04, first exercise), its title, the
    checker (``checker(answer)`` raises :class:`ExerciseFailed` on a wrong answer), the
    name the notebook gives the answer, and a deliberately wrong answer for the tests."""

    number: str
    title: str
    checker: Callable
    answer: str
    wrong: Callable


EXERCISES: dict = {}


def exercise(number: str, title: str, answer: str, wrong: Callable):
    """Declare the decorated function as exercise ``number``'s checker (``answer``: the name
    of the function or kernel the student writes; ``wrong``: a wrong answer it rejects)."""
    def register(checker):
        if number in EXERCISES:
            raise ValueError(f"exercise {number} is declared twice")
        EXERCISES[number] = Exercise(number, title, checker, answer, wrong)
        return checker
    return register


def _load_all():
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def expect_equal(got, expected, what: str, atol: float = 0.0):
    """Raise :class:`ExerciseFailed` unless ``got`` equals ``expected`` (to ``atol``), naming
    the first differing element of ``what``."""
    import numpy as np

    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        raise ExerciseFailed(f"{what}: shape {got.shape}, expected {expected.shape}")
    bad = ~np.isclose(got, expected, rtol=0, atol=atol) if atol else got != expected
    if np.any(bad):
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise ExerciseFailed(f"{what}: {int(bad.sum())} of {got.size} values differ; first at {i}: "
                             f"got {got[i]!r}, expected {expected[i]!r}")


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
