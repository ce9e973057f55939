"""Which dataflow for a layer: measured when asked, else a rule of thumb.

TorchSparse++ and PCEngine both found that no one dataflow wins every layer:
gather-GEMM-scatter (``"gmas"``, Minuet's) pays for moving every pair's
features through global-memory buffers and wins when the GEMMs are large;
fetch-on-demand (``"fetch"``) and implicit GEMM (``"implicit"``) move no
buffers but compute on CUDA cores here (Numba has no tensor-core intrinsics;
the one exception is the implicit GEMM in fp16 on a GPU, whose rung v4 calls a
tensor-core ``mma`` in linked CUDA C++, :func:`numba_sc.dataflows.implicit_driver.library_rung`),
so they can only win where the buffers, not the multiplications, cost the most:
few channels, small clouds, where a layer is a handful of short launches. So
``sparse_conv3d(..., dataflow="auto")`` asks this module per layer, the way the
tile sizes are asked of :mod:`numba_sc.autotune`:

1. a choice measured by :func:`numba_sc.choose_dataflow` for this layer (its
   ``layer`` name, or its shape: channels, kernel volume, dtype, direction, and
   the cloud's size class, a power of two), cached for the process;
2. otherwise the rule of thumb :func:`rule_dataflow`, written from the H100
   measurements in ``benchmarks/results/`` (see its docstring).

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

from ..core.measure import Choice, size_class
from ..core.state import STATE
from ..dataflows.implicit_driver import library_rung
from .arguments import where

DATAFLOWS = ("gmas", "fetch", "implicit")

_DATAFLOW: dict = STATE.choices["dataflow"]  # the one record of measured choices (core.state)


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
    "conv/choice.py"; the fp16 rows with v4 in ``alternatives_fp16_v4.json``.
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


def pick_dataflow(dataflow, layer, f, w, km, transposed, training, map_given, centre, backend=None):
    """The ``dataflow`` argument -> "gmas" | "fetch" | "implicit" (see the module docstring).
    ``centre``: the map's submanifold centre (-1 for a strided map, read backwards or not).
    ``backend``: the layer's; None asks for the rule's answer whatever runs it."""
    check_dataflow(dataflow)
    if training:  # the backward pass reads the gmas buffers
        if dataflow not in ("gmas", "auto"):
            raise ValueError(f"{where(layer)}dataflow={dataflow!r} has no backward pass here: training "
                             "runs dataflow='gmas' (or 'auto', which picks it when training)")
        return "gmas"
    if dataflow != "auto":
        return dataflow
    if backend == "reference":
        # The reference answers the same whatever ran before: no rule that turns on
        # whether the map was given (a network's second call on a tensor reuses the maps
        # of its first) may pick another summation order there. Timing means nothing in
        # NumPy, so "auto" is the paper's dataflow; a named one runs as named (above).
        return "gmas"
    c_in, c_out = w.shape[1], w.shape[2]
    if not measured_dataflows() and (c_in > MID_CHANNELS or c_out > MID_CHANNELS):
        return "gmas"  # the rule's answer for wide layers, without counting anything (every layer asks)
    n_out = km.in_coords.shape[0] if transposed else km.out_coords.shape[0]
    counts = km.host_counts().tolist()
    pairs = sum(counts) - (counts[centre] if centre >= 0 else 0)
    per_output = pairs / max(n_out, 1)
    key = dataflow_key(layer, c_in, c_out, w.shape[0], f.dtype, transposed, n_out)
    return dataflow_for(key, c_in, c_out, f.dtype, n_out, map_given, per_output)
