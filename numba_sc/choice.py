"""Which dataflow, and which Map method, for a layer: measured when asked, else a rule of thumb.

TorchSparse++ and PCEngine both found that no one dataflow wins every layer:
gather-GEMM-scatter (``"gmas"``, Minuet's) pays for moving every pair's
features through global-memory buffers and wins when the GEMMs are large;
fetch-on-demand (``"fetch"``) and implicit GEMM (``"implicit"``) move no
buffers but compute on CUDA cores here (Numba has no tensor-core intrinsics),
so they can only win where the buffers, not the multiplications, cost the most:
few channels, small clouds, where a layer is a handful of short launches. So
``sparse_conv3d(..., dataflow="auto")`` asks this module per layer, the way the
tile sizes are asked of :mod:`numba_sc.autotune`:

1. a choice measured by :func:`numba_sc.choose_dataflow` for this layer (its
   ``layer`` name, or its shape: channels, kernel volume, dtype, direction, and
   the cloud's size class, a power of two), cached for the process;
2. otherwise the rule of thumb :func:`rule_dataflow`, written from the H100
   measurements in ``benchmarks/results/`` (see its docstring).

The same holds for the Map step's ``method="auto"``: :func:`numba_sc.choose_map_method`
measures the three methods on a cloud, else :func:`rule_map_method` decides.

Layers that share a map share its decision only through their shapes: the
plans each dataflow builds from a map are kept on the map
(:class:`numba_sc.KernelMap`), so the second layer of a group pays no metadata
whichever dataflow it runs; TorchSparse++'s grouping of layers by map is that
cache here.

Worked example: a 4 -> 16 fp32 layer on 30k voxels, never measured, gets the
rule's answer (gmas when it builds its map, implicit when it is given one);
after ``choose_dataflow(x, w)`` timed gmas 0.31 ms, fetch 0.22 ms, implicit
0.25 ms, every layer of that shape and size class runs fetch.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

DATAFLOWS = ("gmas", "fetch", "implicit")
MAP_METHODS = ("sorted", "hash", "grid")


@dataclass
class Choice:
    """A decision and where it came from."""

    value: str
    source: str  # "measured" | "rule"
    timings: dict = field(default_factory=dict)  # candidate -> median seconds (measured only)


_DATAFLOW: dict = {}
_METHOD: dict = {}


def clear_choices():
    """Forget every measured dataflow and Map method."""
    _DATAFLOW.clear()
    _METHOD.clear()


def size_class(n: int) -> int:
    """Clouds whose sizes round to the same power of two share a choice."""
    return int(round(math.log2(max(int(n), 1))))


def dataflow_key(layer, c_in, c_out, kernel_volume, dtype, transposed, n_out):
    """The cache key of a layer: its ``layer`` name, else its shape and size class."""
    if layer is not None:
        return ("layer", layer)
    return ("shape", int(c_in), int(c_out), int(kernel_volume), np.dtype(dtype).str, bool(transposed),
            size_class(n_out))


def check_dataflow(dataflow):
    if dataflow not in DATAFLOWS + ("auto",):
        raise ValueError(f"dataflow must be one of {DATAFLOWS + ('auto',)}, got {dataflow!r}")
    return dataflow


SMALL_CHANNELS = 16  # at most this many channels in and out: the implicit GEMM's territory


def rule_dataflow(c_in, c_out, dtype, n_out, map_given=False) -> str:
    """The dataflow to run when none was measured (see the module docstring).

    Written from the single-layer table measured on the H100 (SemanticKITTI,
    ScanNet and SUN RGB-D, fp32 and fp16, 4->16 to 256->256;
    ``benchmarks/results/alternatives_h100_2026-11-24.json``):

    * a layer that reuses a map (``kernel_map=`` given, as the layers after the
      first of a group do) with at most :data:`SMALL_CHANNELS` channels in and
      out runs ``"implicit"``: 4->16 took 0.66-0.78x gmas's time on all three
      scans in both dtypes, its plan kept on the map. At 32 channels the two
      were within 15 % of each other either way; from 64 on gmas won every row.
    * everything else runs ``"gmas"``. A layer that builds its own map would
      also build the implicit plan (a sort of the outputs by mask and two
      kernels), which cost more than the dataflow saved on every row measured;
      and cuBLAS's GEMMs (tensor cores in fp16) beat the CUDA-core kernels as
      soon as the products, not the buffers, are the cost.
    """
    if map_given and c_in <= SMALL_CHANNELS and c_out <= SMALL_CHANNELS:
        return "implicit"
    return "gmas"


def dataflow_for(key, c_in, c_out, dtype, n_out, map_given=False) -> str:
    """The cached measured choice for ``key``, else :func:`rule_dataflow`."""
    hit = _DATAFLOW.get(key)
    return hit.value if hit is not None else rule_dataflow(c_in, c_out, dtype, n_out, map_given)


def measured_dataflows() -> bool:
    """Whether any layer's dataflow was measured in this process."""
    return bool(_DATAFLOW)


def cached_dataflow(key):
    """The :class:`Choice` measured for ``key``, or None."""
    return _DATAFLOW.get(key)


def remember_dataflow(key, choice: Choice):
    _DATAFLOW[key] = choice


def method_key(n_points, kernel_volume):
    return (size_class(n_points), int(kernel_volume))


def rule_map_method(n_points, kernel_volume) -> str:
    """The Map method to run when none was measured: Minuet's sorted search, which
    was at least as fast as the hash table on every cloud measured on the H100
    and 3x faster than the grid (whose box must be cleared and read back)."""
    return "sorted"


def map_method_for(n_points, kernel_volume) -> str:
    """The measured method for clouds of this size class, else the rule. ``kernel_volume``
    may be a callable that returns it: it is asked only when something was measured
    (every Map step asks this, and its ~0.1-0.2 ms has no microseconds to spare)."""
    if not _METHOD:
        return rule_map_method(n_points, None)
    K = kernel_volume() if callable(kernel_volume) else kernel_volume
    hit = _METHOD.get(method_key(n_points, K))
    return hit.value if hit is not None else rule_map_method(n_points, K)


def remember_map_method(n_points, kernel_volume, choice: Choice):
    _METHOD[method_key(n_points, kernel_volume)] = choice


def wall_timer(fn) -> float:
    """Seconds of one call of ``fn`` as a user meets it: wall clock between two
    device-wide synchronizes (so the host's launches and every stream count)."""
    import cupy

    dev = cupy.cuda.Device()
    dev.synchronize()
    t = time.perf_counter()
    fn()
    dev.synchronize()
    return time.perf_counter() - t


def measure(candidates: dict, timer, rounds: int = 5, block: int = 3) -> dict:
    """Median seconds of each candidate ``name -> fn``: ``rounds`` interleaved rounds,
    each a block of calls whose first is not kept (cold host caches), so that a
    slow moment of a shared GPU costs every candidate alike."""
    times = {name: [] for name in candidates}
    for fn in candidates.values():  # compile and warm every candidate first
        fn()
    for r in range(rounds):
        names = list(candidates) if r % 2 == 0 else list(candidates)[::-1]
        for name in names:
            candidates[name]()
            times[name].extend(timer(candidates[name]) for _ in range(block))
    return {name: statistics.median(t) for name, t in times.items()}
