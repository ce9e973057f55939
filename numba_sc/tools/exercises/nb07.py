"""Exercises of notebook 07, a small network end to end: the two layers that change levels.

* 7.1 the map of a strided layer (kernel 2, stride 2) by hand: the coarse coordinates
  ``floor(P / 2) * 2`` and, for each of the 8 offsets, the fine voxel each coarse voxel
  reads. The wrong answer truncates where it should floor, the slip that moves every
  voxel with a negative odd coordinate into the wrong coarse cell;
* 7.2 the transposed layer, which builds no map: it reads a strided layer's map
  backwards, ``fine[table[k, i]] += coarse[i] @ W[k]``. The wrong answer assigns where
  it should add: right for a 2x2x2 kernel of stride 2 (every fine voxel has exactly one
  pair, the toy of the notebook), wrong for a 3x3x3 one (up to 8 pairs a fine voxel).

Both are checked on the voxels of a crop of the SemanticKITTI scan moved to the
origin (:func:`numba_sc.tools.exercises.inputs.scan_crop`: coordinates of both signs)
against the library's NumPy references. More slips: the offsets enumerated z slowest,
the coarse coordinates left at the coarse scale (7.1), and a -1 entry read as a row
(7.2).
"""
from __future__ import annotations

import numpy as np

from . import ExerciseFailed, Slip, exercise, expect_equal
from .inputs import crop_voxels


# -- 7.1 ------------------------------------------------------------------------------

OUT_RULE = ("out_coords are the unique floor(P / 2) * 2, sorted: the floor, not truncation (-1 belongs to "
            "the cell at -2), and times 2, because coordinates stay at the finest scale")
TABLE_RULE = ("table[k, i] is the row of coords at out_coords[i] + offsets[k], or -1, with the 8 offsets "
              "{0, 1}^3 in ns.kernel_offsets(2)'s order: x slowest, z fastest")
X_SLOWEST = [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]


def _strided_map(coords, out, offsets):
    row_of = {tuple(p): j for j, p in enumerate(np.asarray(coords).tolist())}
    return np.array([[row_of.get((q[0] + a, q[1] + b, q[2] + c), -1) for q in out.tolist()]
                     for a, b, c in offsets], np.int32).reshape(len(offsets), len(out))


def _strided_map_truncating(coords):
    """Wrong: ``int(p / 2) * 2`` rounds towards zero, so -1 lands in cell 0, not -2."""
    out = np.unique((np.asarray(coords) / 2).astype(np.int32) * 2, axis=0)
    return out, _strided_map(coords, out, X_SLOWEST)


def _strided_map_z_slowest(coords):
    """Wrong: the offsets enumerated with z slowest (c, b, a), not ``kernel_offsets``' x slowest."""
    out = np.unique(np.floor_divide(coords, 2) * 2, axis=0)
    return out, _strided_map(coords, out, [(a, b, c) for c in (0, 1) for b in (0, 1) for a in (0, 1)])


def _strided_map_coarse(coords):
    """Wrong: the coarse cells ``floor(P / 2)``, not moved back to the finest scale."""
    out = np.unique(np.floor_divide(coords, 2), axis=0)
    return out, _strided_map(coords, out * 2, X_SLOWEST)


@exercise("7.1", "the map of a strided layer", answer="strided_map",
          wrong=[Slip(_strided_map_truncating, says="floor"), Slip(_strided_map_z_slowest, says="x slowest"),
                 Slip(_strided_map_coarse, says="finest scale")])
def check_strided_map(strided_map):
    """``strided_map(coords) -> (out_coords, table)`` for a 2x2x2 kernel of stride 2 on
    the voxels of two crops, against :func:`numba_sc.build_kernel_map`'s reference."""
    import numba_sc as ns

    offsets = ns.kernel_offsets(2)
    for seed in (3, 4):
        coords = crop_voxels(300, seed=seed)
        km = ns.build_kernel_map(coords, 2, stride=2, backend="reference")
        got = strided_map(coords.copy())
        if not isinstance(got, tuple) or len(got) != 2:
            raise ExerciseFailed(f"strided_map returned {type(got).__name__}",
                                 "strided_map returns a pair (out_coords, table)")
        out, table = (np.asarray(a) for a in got)
        expect_equal(out, km.out_coords, f"crop {seed}: out_coords[i, axis]", rule=OUT_RULE)
        expect_equal(table, km.table, f"crop {seed}: table[k, i]", rule=TABLE_RULE,
                     where=lambda ki: f"offset {tuple(offsets[ki[0]].tolist())}, output at "
                                      f"{tuple(np.asarray(km.out_coords)[ki[1]].tolist())}")


# -- 7.2 ------------------------------------------------------------------------------

TRANSPOSED_RULE = ("for every pair (table[k, i] >= 0), fine[table[k, i]] += coarse[i] @ weight[k]: the pairs of "
                   "a fine voxel add up (a 3x3x3 kernel of stride 2 reaches one from up to 8 coarse voxels), and "
                   "an entry -1 is no pair (fine[-1] is the last row, not nothing)")


def _transposed_assigning(coarse, weight, table, n_fine):
    """Wrong: each pair overwrites the fine row instead of adding to it."""
    out = np.zeros((n_fine, weight.shape[2]), np.float64)
    for k in range(table.shape[0]):
        i = np.flatnonzero(table[k] >= 0)
        out[table[k, i]] = coarse[i].astype(np.float64) @ weight[k]
    return out


def _transposed_unmasked(coarse, weight, table, n_fine):
    """Wrong: every entry used, so each -1 adds a product to the last fine row."""
    out = np.zeros((n_fine, weight.shape[2]), np.float64)
    for k in range(table.shape[0]):
        np.add.at(out, table[k], coarse.astype(np.float64) @ weight[k])
    return out


def _pairs(n):
    return f"a fine voxel with {n} pair{'s' if n != 1 else ''}"


@exercise("7.2", "the transposed layer reads the strided map backwards", answer="transposed_layer",
          wrong=[Slip(_transposed_assigning, says="add up"), Slip(_transposed_unmasked, says="-1 is no pair")])
def check_transposed_layer(transposed_layer):
    """``transposed_layer(coarse, weight, table, n_fine)`` for the maps of a 2x2x2 and a
    3x3x3 layer of stride 2 on a crop, against :func:`numba_sc.sparse_conv3d` with
    ``transposed=True`` and that map (reference backend)."""
    import numba_sc as ns

    coords = crop_voxels(300, seed=5)
    rng = np.random.default_rng(72)
    fine = ns.SparseTensor(coords, rng.normal(size=(len(coords), 3)).astype(np.float32))
    for kernel in (2, 3):
        k3 = kernel ** 3
        down = ns.sparse_conv3d(fine, rng.normal(size=(k3, 3, 4)).astype(np.float32), kernel, stride=2,
                                backend="reference")
        weight = rng.normal(size=(k3, 4, 2)).astype(np.float32)
        up = ns.sparse_conv3d(down, weight, transposed=True, kernel_map=down.kernel_map, backend="reference")
        table = np.asarray(down.kernel_map.table)
        got = transposed_layer(down.features.copy(), weight.copy(), table.copy(), len(coords))
        expect_equal(np.asarray(got, np.float64), np.asarray(up.features, np.float64),
                     f"after the transposed {kernel}x{kernel}x{kernel} layer: fine[j, c]", rule=TRANSPOSED_RULE,
                     atol=1e-4, where=lambda jc: _pairs(int((table == jc[0]).sum())))
