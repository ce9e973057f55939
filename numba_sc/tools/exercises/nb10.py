"""Exercises of notebook 10, which map and which dataflow: one alternative of each step.

* 10.1 the kernel map through a dense grid over the inputs' bounding box (the
  embedded-GPU paper's location table): one int per cell of the box, -1 where there is
  no input, one read per query, and no read at all for a query outside the box. The
  wrong answer clamps such a query to the box's face, where it may find a voxel that
  is not its neighbour;
* 10.2 the implicit GEMM's waste ``r`` (row products over real pairs) when the outputs
  are sorted by their neighbour masks: every tile multiplies all its rows through each
  offset in the OR of their masks. The wrong answer leaves the outputs in the map's
  order, which is the waste that sorting removes (TorchSparse++, Section 2.2.3).

Both run on the voxels of a crop of the SemanticKITTI scan; the references are the
library's (:func:`numba_sc.build_kernel_map` with ``method="grid"``, and
:func:`numba_sc.dataflows.implicit_gemm.plan_work` of the NumPy plan).
"""
from __future__ import annotations

import numpy as np

from . import ExerciseFailed, exercise, expect_equal
from .inputs import crop_voxels


# -- 10.1 -----------------------------------------------------------------------------

def _grid_table_clamped(in_coords, out_coords, offsets):
    """Wrong: a query outside the box is moved onto its face instead of missing."""
    lo, hi = in_coords.min(axis=0), in_coords.max(axis=0)
    grid = np.full(tuple(hi - lo + 1), -1, np.int64)
    grid[tuple((in_coords - lo).T)] = np.arange(len(in_coords))
    table = np.empty((len(offsets), len(out_coords)), np.int64)
    for k, d in enumerate(offsets):
        cell = np.clip(out_coords + d - lo, 0, hi - lo)
        table[k] = grid[tuple(cell.T)]
    return table


@exercise("10.1", "the kernel map through a dense grid", answer="grid_table", wrong=_grid_table_clamped)
def check_grid_table(grid_table):
    """``grid_table(in_coords, out_coords, offsets)`` for a 3x3x3 submanifold layer and a
    2x2x2 layer of stride 2 on a crop, against :func:`numba_sc.build_kernel_map`'s grid."""
    import numba_sc as ns

    coords = crop_voxels(250, seed=10)
    for kernel, stride in ((3, 1), (2, 2)):
        km = ns.build_kernel_map(coords, kernel, stride=stride, backend="reference", method="grid")
        out = np.asarray(km.out_coords)
        got = grid_table(coords.copy(), out.copy(), np.asarray(km.offsets).copy())
        got = np.asarray(got)
        if got.shape != km.table.shape:
            raise ExerciseFailed(f"grid_table gave shape {got.shape}; expected {km.table.shape}: one row per "
                                 "offset, one column per output")
        expect_equal(got.astype(np.int64), np.asarray(km.table, np.int64),
                     f"table[k, i] (kernel {kernel}, stride {stride}: the input at out_coords[i] + offsets[k], or -1)")


# -- 10.2 -----------------------------------------------------------------------------

def _waste_in_map_order(table, skip, tile_m):
    """Wrong: the tiles take the outputs in the map's order, unsorted."""
    table = np.asarray(table)
    rows = np.flatnonzero(np.arange(len(table)) != skip)
    has = table[rows] >= 0  # (offsets, outputs)
    tiles = -(-has.shape[1] // tile_m)
    padded = np.zeros((len(rows), tiles * tile_m), bool)
    padded[:, :has.shape[1]] = has
    products = padded.reshape(len(rows), tiles, tile_m).any(axis=2).sum() * tile_m
    return products / has.sum()


@exercise("10.2", "the implicit GEMM's waste, sorted by mask", answer="implicit_waste", wrong=_waste_in_map_order)
def check_implicit_waste(implicit_waste):
    """``implicit_waste(table, skip, tile_m)`` for a crop's 3x3x3 submanifold map (the
    centre skipped) and tiles of 16, 32 and 64 outputs, against
    :func:`numba_sc.dataflows.implicit_gemm.plan_work` of the library's one-split plan."""
    import numba_sc as ns
    from ...dataflows import implicit_gemm
    from ...gmas.layout import submanifold_centre

    coords = crop_voxels(800, seed=11)
    km = ns.build_kernel_map(coords, 3, backend="reference")
    table, centre = np.asarray(km.table), submanifold_centre(km)
    for tile_m in (16, 32, 64):
        expected = implicit_gemm.plan_work(implicit_gemm.implicit_plan_reference(table, 1, centre, tile_m),
                                           table)["waste"]
        got = implicit_waste(table.copy(), centre, tile_m)
        expect_equal(float(got), expected, f"r = row products / pairs (tiles of {tile_m} outputs)", atol=1e-9)
