"""Fetch-on-demand as the library runs it: the pair list built on the device, and the
launcher of the library's rung (v2).

The lesson, :mod:`numba_sc.dataflows.fetch_on_demand`, teaches the dataflow and its
rungs with NumPy references (its :func:`~numba_sc.dataflows.fetch_on_demand.fetch_plan_reference`
among them); this module adds :func:`fetch_plan` (the same plan from one library scan
and one kernel, no device-to-host read) and :func:`fetch_on_demand_cuda`;
:func:`fetch_on_demand_rung` runs any rung.

Worked example (features in the map's order, ``features[km.in_order]`` for the caller's)::

    km = build_kernel_map(coords, 3)
    centre = submanifold_centre(km)                               # -1 when none
    plan = fetch_plan(km.table, km.host_counts(), skip=centre)   # once per map
    init = features @ weight[centre] if centre >= 0 else None     # a dense GEMM
    out = fetch_on_demand_cuda(features, weight, plan, km.table.shape[1], init)
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..core import conventions as cv
from ..core.backend import filled, to_device
from ..core.device import device_xp
from ..core.launch import launch
from .fetch_on_demand import LADDER, RUNS
from .fetch_shapes import FetchPlan, FetchTiles, block_table, check_table


# ------------------------------------------------------------------ the plan
@cuda.jit
def plan_kernel(table, rank, starts, in_rows, out_rows):
    """One thread per output i, walking the K offsets: the pair (k, i) goes to
    position ``starts[k] + rank[k, i] - 1`` of the list, where ``rank[k, i]``
    counts the pairs of offset k among outputs 0..i (a library scan along the
    table's rows). Neighbouring threads read neighbouring entries of each table
    row and write neighbouring entries of the list.

    Nothing is written for the skipped offset (its range ``starts[k]:starts[k+1]``
    is empty) nor past the end of an offset's range (counts smaller than the
    table's: such pairs are lost, never written out of bounds)."""
    i = cuda.grid(1)
    if i < table.shape[1]:
        for k in range(table.shape[0]):
            row = table[k, i]
            if row >= 0:
                pos = starts[k] + rank[k, i] - 1
                if pos < starts[k + 1]:
                    in_rows[pos] = row
                    out_rows[pos] = i



def fetch_plan(table, counts_host, skip=-1, tile_p=None) -> FetchPlan:
    """Device version of :func:`fetch_plan_reference`: the pair list from one
    library scan of ``table >= 0`` along each row and one launch of
    :func:`plan_kernel`; the block table on the host from ``counts_host``
    (:func:`block_table`).

    No device-to-host read (``counts_host`` says how long the list is, where
    ``xp.nonzero`` would read its length back). The counts are trusted, not
    checked against the table: pass the map's own (``KernelMap.host_counts()``).
    List entries the table does not fill (counts larger than the table's) stay
    -1, and the kernels skip them.
    """
    counts, skip, tile_p = check_table(table, counts_host, skip, tile_p)
    xp = device_xp()
    t = to_device(table)
    starts, b_off, b_start, b_stop = block_table(counts, skip, tile_p)
    n = int(starts[-1])
    in_rows, out_rows = filled((n,), np.int32, -1), filled((n,), np.int32, -1)
    if n:
        rank = xp.cumsum(t >= 0, axis=1, dtype=np.int32)
        launch(plan_kernel, t.shape[1], t, rank, to_device(starts), in_rows, out_rows)
    return FetchPlan(in_rows, out_rows, to_device(b_off), to_device(b_start), to_device(b_stop), starts,
                     t.shape[1], tile_p, skip)


# ------------------------------------------------------------------ the launchers
def fetch_on_demand_rung(rung: str, features, weight, plan: FetchPlan, n_out: int, init=None,
                         tiles: FetchTiles = None):
    """Run one rung of the ladder (``"v1"``, ``"v2"``) on a plan; returns the
    (n_out, C_out) output as a device array of the features' dtype.

    ``tiles``: v2's tile sizes (default
    :func:`~numba_sc.dataflows.fetch_shapes.v2_tiles` for these channels);
    e.g. ``v2_tiles(c_in, c_out, simulated=False)`` runs the GPU's tiles under the
    simulator. The plan may come from :func:`fetch_plan` or
    :func:`~numba_sc.dataflows.fetch_on_demand.fetch_plan_reference`;
    its ``tile_p`` should be a multiple of ``tiles.p`` (the default 64 is, on the
    GPU), else the last kernel tile of every plan block leaves threads idle.
    """
    if rung not in LADDER.names:
        raise ValueError(f"rung must be one of {LADDER.names}, got {rung!r}")
    if not isinstance(plan, FetchPlan):
        raise TypeError(f"plan must be a FetchPlan (from fetch_plan), got {type(plan).__name__}")
    cv.check_features(features, backend="cuda")
    cv.check_weight(weight, plan.K, features.shape[1], features.dtype, ": one (C_in, C_out) matrix per offset of the map")
    if int(n_out) != plan.n_out:
        raise ValueError(f"n_out = {n_out} but the plan's table has {plan.n_out} outputs (columns)")
    cv.check_init(init, plan.n_out, weight.shape[2])
    f, wt = to_device(features), to_device(weight)
    return RUNS[rung](f, wt, plan, init, tiles)


def fetch_on_demand_cuda(features, weight, plan: FetchPlan, n_out: int, init=None):
    """The library's fetch-on-demand convolution: one launch of v2 for all offsets
    (plus the float16 cast). ``features`` (n_in, C_in) and ``weight`` (K, C_in,
    C_out), float32 or float16 alike; ``init`` (n_out, C_out) or None, not
    modified. Returns a device array (n_out, C_out) of the features' dtype: CuPy
    on a GPU, NumPy under the simulator. Sums run in fp32 through atomics, so
    the last bits may differ from run to run (module docstring)."""
    return fetch_on_demand_rung("v2", features, weight, plan, n_out, init)
