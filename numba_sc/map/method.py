"""Which Map method for a cloud: measured when asked, else a rule of thumb.

(A stand-in, moved verbatim out of the dataflow choice so that the Map step
imports nothing above it; the Map step's owner writes this module's final form.)

``build_kernel_map(..., method="auto")`` asks :func:`map_method_for`: the method
:func:`numba_sc.choose_map_method` measured fastest for clouds of this size class
and kernel volume, else :func:`rule_map_method`.
"""
from __future__ import annotations

from ..core.measure import Choice, measure, size_class, wall_timer  # noqa: F401 (kernel_map reads them here)
from ..core.state import STATE

MAP_METHODS = ("sorted", "hash", "grid")

_METHOD: dict = STATE.choices["map_method"]


def method_key(n_points, kernel_volume):
    return (size_class(n_points), int(kernel_volume))


def rule_map_method(n_points, kernel_volume) -> str:
    """The Map method to run when none was measured: Minuet's sorted search, which
    was at least as fast as the hash table on every cloud measured, and faster
    than the grid (whose box must be cleared and read back; figures in
    ``docs/performance.md``, "conv/choice.py")."""
    return "sorted"


def map_method_for(n_points, kernel_volume) -> str:
    """The measured method for clouds of this size class, else the rule. ``kernel_volume``
    may be a callable that returns it: it is asked only when something was measured
    (every Map step asks this, and on a scan a Map step is short enough that each
    microsecond of host time shows)."""
    if not _METHOD:
        return rule_map_method(n_points, None)
    K = kernel_volume() if callable(kernel_volume) else kernel_volume
    hit = _METHOD.get(method_key(n_points, K))
    return hit.value if hit is not None else rule_map_method(n_points, K)


def remember_map_method(n_points, kernel_volume, choice: Choice):
    _METHOD[method_key(n_points, kernel_volume)] = choice
