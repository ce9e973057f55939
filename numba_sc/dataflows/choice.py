"""Which dataflow, and which Map method, for a layer: measured when asked, else a rule of thumb.

TorchSparse++ and PCEngine both found that no one dataflow wins every layer:
gather-GEMM-scatter (``"gmas"``, Minuet's) pays for moving every pair's
features through global-memory buffers and wins when the GEMMs are large;
fetch-on-demand (``"fetch"``) and implicit GEMM (``"implicit"``) move no
buffers but compute on CUDA cores here (Numba has no tensor-core intrinsics;
the one exception is the implicit GEMM in fp16 on a GPU, whose rung v4 calls a
tensor-core ``mma`` in linked CUDA C++, :func:`numba_sc.dataflows.implicit_gemm.library_rung`),
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
once ``choose_dataflow(x, w)`` has timed the three and found fetch the fastest,
every layer of that shape and size class runs fetch.
"""
from __future__ import annotations

import numpy as np

from ..core.measure import Choice, measure, size_class, wall_timer  # noqa: F401 (this module's names)
from ..core.state import STATE
from .implicit_gemm import library_rung

DATAFLOWS = ("gmas", "fetch", "implicit")
MAP_METHODS = ("sorted", "hash", "grid")


_DATAFLOW: dict = STATE.choices["dataflow"]  # the one record of measured choices (core.state)
_METHOD: dict = STATE.choices["map_method"]


def clear_choices():
    """Forget every measured dataflow and Map method."""
    _DATAFLOW.clear()
    _METHOD.clear()


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
MID_CHANNELS = 64  # ... and, in fp32 on a dense cloud, up to this many
DENSE_PAIRS = 8.0  # pairs per output (outside the centre) from which a cloud counts as dense
SMALL_CLOUD = 1 << 17  # outputs up to which a layer is host-bound (one launch beats several)
LARGE_CLOUD = 1 << 18  # outputs from which the GPU's work decides, not the host's


def rule_dataflow(c_in, c_out, dtype, n_out, map_given=False, pairs_per_output=0.0) -> str:
    """The dataflow to run when none was measured (see the module docstring).

    Written from the single-layer table measured on the H100 (SemanticKITTI,
    ScanNet, SUN RGB-D, 1M random voxels and those voxels at stride 4, fp32 and
    fp16, 4->16 to 256->256; ``benchmarks/results/alternatives.json``).
    ``pairs_per_output``: the map's pairs outside the submanifold centre per output
    (0.4 on the random cloud, 0.8-7.6 on the scans, 16 on the dense cloud).

    * ``"implicit"`` for at most :data:`SMALL_CHANNELS` channels in and out, when
      the layer is given its map (its plan is then kept on the map) on a small
      cloud (at most :data:`SMALL_CLOUD` outputs: one launch instead of several),
      or on a large dense cloud;
    * ``"implicit"`` up to :data:`MID_CHANNELS` channels on a large dense cloud,
      where gmas moves ~16 pairs a voxel through its buffers: in fp32 (v3), and in
      fp16 where the implicit GEMM runs its tensor-core rung (v4; without it gmas's
      GEMMs, on tensor cores, win from 32 channels on). Above that cuBLAS's GEMMs
      win in both (``benchmarks/results/alternatives_fp16_v4.json`` on the H200 for
      fp16 with v4);
    * ``"gmas"`` everywhere else. A small layer that builds its own map would
      also build the implicit plan (a sort of the outputs by mask), which cost
      more than the dataflow saved on every scan row; on the sparse 1M cloud
      (few pairs, large buffers of nothing) gmas won every row; and cuBLAS beats
      the CUDA-core kernels wherever the products, not the buffers, cost most.
      Fetch-on-demand won no row: its atomics cost more than the buffers they save.

    The measured ratios behind each branch: ``docs/performance.md``,
    "dataflows/choice.py"; the fp16 rows with v4 in ``alternatives_fp16_v4.json``.
    """
    small = c_in <= SMALL_CHANNELS and c_out <= SMALL_CHANNELS
    dense_and_large = pairs_per_output >= DENSE_PAIRS and (n_out or 0) >= LARGE_CLOUD
    if small and ((map_given and (n_out or 0) <= SMALL_CLOUD) or dense_and_large):
        return "implicit"
    if dense_and_large and c_in <= MID_CHANNELS and c_out <= MID_CHANNELS and (
            np.dtype(dtype) == np.float32 or library_rung(dtype, c_in, c_out) == "v4"):
        return "implicit"
    return "gmas"


def dataflow_for(key, c_in, c_out, dtype, n_out, map_given=False, pairs_per_output=0.0) -> str:
    """The cached measured choice for ``key``, else :func:`rule_dataflow`."""
    hit = _DATAFLOW.get(key)
    return hit.value if hit is not None else rule_dataflow(c_in, c_out, dtype, n_out, map_given,
                                                           pairs_per_output)


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
    was at least as fast as the hash table on every cloud measured, and faster
    than the grid (whose box must be cleared and read back; figures in
    ``docs/performance.md``, "dataflows/choice.py")."""
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
