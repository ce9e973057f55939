"""Stage 11, tile-size autotuning (paper Algorithm 2), with a heuristic fallback.

The gather and the scatter each take a tile size T, a divisor of their channel
count (:mod:`numba_sc.gmas.gather` explains the trade-off: bigger tiles read the
metadata table less often, smaller tiles give more threads). Which T is fastest
depends on the GPU, the channels and the cloud, so Minuet measures: for each
layer, on a few sample clouds, it times the gather with every divisor of C_in and
the scatter with every divisor of C_out, R rounds each, keeps the fastest, and
caches the choice so that inference pays nothing. Here the R rounds are
interleaved (each round times every candidate once) and each candidate keeps
its median, so that a passing slowdown of a shared GPU cannot crown a bad tile
(:func:`search_tiles`).

Worked example, a layer with C_in = 4 and C_out = 6 on one sample cloud, each
candidate's median time in microseconds (times made up for the example, not
measured)::

    gather  T = 1, 2, 4         -> 31, 22, 25       -> T_gather  = 2
    scatter T = 1, 2, 3, 6      -> 40, 28, 27, 35   -> T_scatter = 3

Cost: ``d(C_in) + d(C_out)`` timed launches per round (``d`` = number of
divisors; 9 + 9 for 256 channels), once per layer before inference.

Timing only means something on a real GPU. Under the simulator (or with the
reference backend) :func:`numba_sc.autotune` (in :mod:`numba_sc.conv.tuning`, which
prepares the layer as the convolution does and hands its samples to
:func:`search_tiles`) uses :func:`heuristic_tile` instead, unless
a ``timer`` is injected (how the tests exercise the search). The heuristic:
start from the largest divisor whose tile is at most 32 bytes (8 fp32 or 16 fp16
channels: a couple of vector loads per thread, the metadata read amortized over
them) and shrink it while the launch would have fewer than ``2**17`` threads
(about the number an H100 keeps resident: 132 SMs x 2048 threads / 2), so that
small clouds still fill the GPU.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from ..core import state
from ..core.device import device_xp
from .gather import divisors, gather_cuda
from .gemm_grouping import product_dtype
from .scatter import scatter_cuda

TARGET_THREADS = 1 << 17
MAX_TILE_BYTES = 32


@dataclass
class TileChoice:
    """Tile sizes of one layer and where they came from."""

    gather: int
    scatter: int
    source: str  # "autotuned" | "heuristic"
    timings: dict = field(default_factory=dict)  # {"gather": {T: s}, "scatter": {T: s}}


def layer_key(layer, c_in, c_out, kernel_volume, dtype, transposed):
    """The cache key: the caller's ``layer`` name when given, else the layer's shape."""
    if layer is not None:
        return ("layer", layer)
    return ("shape", int(c_in), int(c_out), int(kernel_volume), np.dtype(dtype).str, bool(transposed))


# The tuned layers live with the library's other measured choices:
# ``STATE.choices["tile"]``, emptied by ``numba_sc.clear_caches()`` too.
def tuned_tiles(key):
    """The tuned :class:`TileChoice` for ``key``, or None."""
    return state.STATE.choices["tile"].get(key)


def keep_tiles(key, choice):
    """Keep ``choice`` (a :class:`TileChoice`) under ``key`` (:func:`layer_key`)."""
    state.STATE.choices["tile"][key] = choice


def forget_tiles():
    """Forget every tuned layer."""
    state.STATE.choices["tile"].clear()


@state.cached(maxsize=4096)
def heuristic_tile(channels: int, n_points: int, itemsize: int = 4) -> int:
    """Count-based tile size (module docstring): no timing, same answer everywhere.
    (Remembered: every call of every layer asks, and the divisors cost a loop.)"""
    cands = [d for d in divisors(channels) if d * itemsize <= MAX_TILE_BYTES] or [1]
    for t in sorted(cands, reverse=True):  # largest first: fewest table reads
        if n_points * (channels // t) >= TARGET_THREADS:
            return t
    return 1  # a small cloud: take all the parallelism there is


def gpu_timer(fn, rounds: int = 5) -> float:
    """Median GPU time of ``fn`` in seconds over ``rounds`` runs (CUDA events), after
    one warm-up run that also compiles the kernel for this tile size."""
    fn()
    return statistics.median(gpu_time_once(fn) for _ in range(rounds))


def gpu_time_once(fn) -> float:
    """GPU time of one call of ``fn`` in seconds, between two CUDA events."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e-3


def search_tiles(samples, c_out, timer, rounds=5, warmup=True):
    """Algorithm 2 for one layer: time every divisor, keep the fastest.

    ``samples`` is a list of ``(features, plan)`` pairs on the device (features of
    each sample cloud and its :class:`~numba_sc.gmas.layout.GmasPlan`); ``timer(fn)``
    returns the time of one call of ``fn`` in seconds. The time of a tile size in
    one round is its sum over the samples; its score is the median of its rounds.

    The rounds are *interleaved*: every round times every candidate once (in
    alternating directions), rather than each candidate timing all its rounds
    before the next starts. A shared GPU slows down in bursts, and a burst of a
    few milliseconds then costs each candidate one round, which the median
    drops, instead of all the rounds of the unlucky candidates (a case seen with
    rounds run in a row: ``docs/performance.md``, "gmas/autotune.py").
    ``warmup``: one untimed call of every candidate first, which also compiles
    its kernel.
    """
    xp = device_xp()
    c_in = samples[0][0].shape[1]
    dtype = samples[0][0].dtype
    obufs = [xp.zeros((plan.rows, c_out), dtype=product_dtype(dtype)) for _, plan in samples]  # as gmas() has it

    def calls(stage, t):
        if stage == "gather":
            return [lambda f=f, p=p: gather_cuda(f, p.in_lists, p.rows, t) for f, p in samples]
        return [lambda o=o, p=p: scatter_cuda(o, p.out_lists, None, p.n_out, c_out, dtype, t)
                for (_, p), o in zip(samples, obufs)]

    candidates = [("gather", t, calls("gather", t)) for t in divisors(c_in)]
    candidates += [("scatter", t, calls("scatter", t)) for t in divisors(c_out)]
    if warmup:
        for _, _, fns in candidates:
            for fn in fns:
                fn()
    measured = {(stage, t): [] for stage, t, _ in candidates}
    for r in range(rounds):
        for stage, t, fns in (candidates if r % 2 == 0 else candidates[::-1]):
            measured[(stage, t)].append(sum(timer(fn) for fn in fns))
    timings = {"gather": {}, "scatter": {}}
    for (stage, t), times in measured.items():
        timings[stage][t] = statistics.median(times)
    best = {s: min(d, key=d.get) for s, d in timings.items()}  # ties: the smaller tile
    return best["gather"], best["scatter"], timings
