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
:func:`numba_sc.dataflows.implicit_gemm.plan_work` of the NumPy plan). More slips: a
grid filled with 0, which is a row, where it should say "no input" (10.1); the centre
counted, and the last tile's missing rows not counted though the GEMM multiplies them
(10.2).
"""
from __future__ import annotations

import numpy as np

from . import Slip, exercise, expect_equal
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


def _grid_table_zero_filled(in_coords, out_coords, offsets):
    """Wrong: the grid made with ``np.zeros``, so an empty cell says row 0."""
    lo, hi = in_coords.min(axis=0), in_coords.max(axis=0)
    grid = np.zeros(tuple(hi - lo + 1), np.int64)
    grid[tuple((in_coords - lo).T)] = np.arange(len(in_coords))
    table = np.full((len(offsets), len(out_coords)), -1, np.int64)
    for k, d in enumerate(offsets):
        cell = out_coords + d - lo
        inside = np.all((cell >= 0) & (cell <= hi - lo), axis=1)
        table[k, inside] = grid[tuple(cell[inside].T)]
    return table


GRID_RULE = ("table[k, i] is the row of in_coords at out_coords[i] + offsets[k], or -1. The grid holds -1 in "
             "every empty cell (0 would be row 0, a real input); a query inside the inputs' box is one read at "
             "q + d - lo, and a query outside the box is a miss with no read (moved onto the box's face, it "
             "would find a voxel that is not its neighbour)")


@exercise("10.1", "the kernel map through a dense grid", answer="grid_table",
          wrong=[Slip(_grid_table_clamped, says="outside the box"),
                 Slip(_grid_table_zero_filled, says="-1 in every empty cell")])
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
        lo, hi = coords.min(axis=0), coords.max(axis=0)
        offsets = np.asarray(km.offsets)

        def where(ki):
            q = out[ki[1]] + offsets[ki[0]]
            inside = "inside" if np.all((q >= lo) & (q <= hi)) else "outside"
            return f"the query {tuple(q.tolist())}, {inside} the inputs' box {tuple(lo.tolist())}..{tuple(hi.tolist())}"

        expect_equal(got.astype(np.int64), np.asarray(km.table, np.int64),
                     f"kernel {kernel}, stride {stride}: table[k, i]", rule=GRID_RULE, where=where)


# -- 10.2 -----------------------------------------------------------------------------

def _waste_in_map_order(table, skip, tile_m):
    """Wrong: the tiles take the outputs in the map's order, unsorted."""
    return _waste(table, skip, tile_m, sort=False)


def _waste(table, skip, tile_m, sort=True, padded=True):
    table = np.asarray(table)
    rows = [k for k in range(len(table)) if k != skip]
    has = table[rows] >= 0
    masks = (has.astype(np.int64) << np.arange(len(rows))[:, None]).sum(axis=0)
    ordered = np.sort(masks) if sort else masks
    starts = np.arange(0, len(ordered), tile_m)
    tile_or = np.bitwise_or.reduceat(ordered, starts)
    heights = np.full(len(starts), tile_m) if padded else np.diff(np.append(starts, len(ordered)))
    return sum(bin(int(m)).count("1") * int(h) for m, h in zip(tile_or, heights)) / has.sum()


def _waste_with_centre(table, skip, tile_m):
    """Wrong: the centre counted like any offset, in the row products and in the pairs."""
    return _waste(table, None, tile_m)


def _waste_last_tile_short(table, skip, tile_m):
    """Wrong: the last tile counted with its real rows only, though the GEMM multiplies tile_m."""
    return _waste(table, skip, tile_m, padded=False)


WASTE_RULE = ("r = row products / pairs. Give each output the bitmask of the offsets it has a pair through "
              "(offset skip, the centre, left out), sort the outputs by mask, cut them into tiles of tile_m "
              "outputs (the last one padded to tile_m), count tile_m row products for every offset in the OR "
              "of a tile's masks, and divide by the pairs outside skip")


@exercise("10.2", "the implicit GEMM's waste, sorted by mask", answer="implicit_waste",
          wrong=[Slip(_waste_in_map_order, says="sort the outputs by mask"), Slip(_waste_with_centre, says="skip"),
                 Slip(_waste_last_tile_short, says="padded to tile_m")])
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
        expect_equal(float(got), expected, f"r with tiles of {tile_m} outputs ({table.shape[1]} outputs, centre "
                                           f"{centre})", rule=WASTE_RULE, atol=1e-9)
