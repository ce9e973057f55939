"""Which Map method finds the pairs: Minuet's sorted search, a hash table or a dense grid.

Every method gives the same map (:mod:`numba_sc.map.kernel_map`); they differ in
speed, and which is fastest depends on the cloud. So ``method="auto"`` (the
default of :func:`numba_sc.build_kernel_map`) asks this module:

1. a method measured by :func:`choose_map_method` for clouds of this size class
   (a power of two, :func:`numba_sc.core.measure.size_class`) and kernel
   volume, kept in ``numba_sc.core.state.STATE.choices["map_method"]``;
2. otherwise the rule of thumb :func:`rule_map_method`.

Worked example: a 94k-voxel scan, never measured, runs ``"sorted"`` (the rule);
after ``choose_map_method(coords)`` has timed the three methods and found, say,
the hash table fastest, every cloud of 2^17 +- half an octave points with the
same kernel runs ``"hash"``, until ``numba_sc.clear_caches()``.
"""
from __future__ import annotations

from ..core.backend import resolve_backend, to_device
from ..core.device import simulating
from ..core.measure import Choice, measure, size_class, wall_timer
from ..core.state import STATE
from .driver import build_kernel_map_cuda
from .kernel_map import MAP_METHODS, build_kernel_map_reference, layer_arguments

_METHOD: dict = STATE.choices["map_method"]  # (size class, K) -> Choice: the one record (core.state)


def method_key(n_points, kernel_volume):
    """Where a choice for ``n_points`` points and ``kernel_volume`` offsets is kept."""
    return (size_class(n_points), int(kernel_volume))


def rule_map_method(n_points, kernel_volume) -> str:
    """The Map method to run when none was measured: Minuet's sorted search, which
    was at least as fast as the hash table on every cloud measured, and faster
    than the grid (whose box must be cleared and read back; figures in
    ``docs/performance.md``, "map/method.py")."""
    return "sorted"


def auto_map_method(n, kernel_size=3, stride=1, dilation=1, tensor_stride=1) -> str:
    """What ``method="auto"`` runs for ``n`` inputs and this layer: the method
    :func:`choose_map_method` measured for clouds of this size class, else the rule
    of thumb. The layer's kernel volume is worked out only when something was
    measured (every Map step asks this, and on a scan a Map step is short enough
    that each microsecond of host time shows)."""
    if not _METHOD:
        return rule_map_method(n, None)
    K = len(layer_arguments(kernel_size, stride, dilation, tensor_stride).offsets)
    hit = _METHOD.get(method_key(n, K))
    return hit.value if hit is not None else rule_map_method(n, K)


def remember_map_method(n_points, kernel_volume, choice: Choice):
    """Keep ``choice`` for ``method="auto"`` on clouds of this size class and kernel."""
    _METHOD[method_key(n_points, kernel_volume)] = choice


def choose_map_method(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1, rounds=5,
                      timer=None) -> Choice:
    """Measure the Map methods on ``in_coords`` (sorted and unique, as a layer gets them)
    and cache the fastest for ``method="auto"`` on clouds of this size class.

    Each method is timed as the Map step runs it with ``assume_sorted=True`` (how
    a layer calls it: the library's driver, or the reference where there is no
    GPU), wall clock between device-wide synchronizes, ``rounds`` interleaved
    rounds. The grid is left out when the cloud's box does not fit. Without a
    GPU the rule of thumb answers and nothing is cached, unless
    ``timer(fn) -> seconds`` is given.
    """
    K = len(layer_arguments(kernel_size, stride, dilation, tensor_stride).offsets)
    n = in_coords.shape[0]
    backend = resolve_backend(None)
    if timer is None and not simulating() and backend == "cuda":
        timer = wall_timer
    if timer is None:
        return Choice(rule_map_method(n, K), "rule")
    coords = to_device(in_coords)
    # What build_kernel_map runs for a given method (it is not called itself: its
    # "auto" asks this module, which would make an import circle).
    build = build_kernel_map_cuda if backend == "cuda" else build_kernel_map_reference

    def run(m):
        return lambda: build(coords, kernel_size, stride, dilation, tensor_stride, assume_sorted=True, method=m)

    candidates = {}
    for m in MAP_METHODS:
        try:
            run(m)()
        except ValueError:  # the grid of a cloud whose box does not fit
            continue
        candidates[m] = run(m)
    times = measure(candidates, timer, rounds)
    choice = Choice(min(times, key=times.get), "measured", times)
    remember_map_method(n, K, choice)
    return choice
