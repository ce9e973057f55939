"""Exercises of notebook 01, sparse convolution from scratch.

1.1 builds the kernel map the way the definition reads it (a dictionary from coordinate
to row), 1.2 multiplies along it. Both are checked on the voxels of a small crop of a
real scan against the library's NumPy reference. The slips are the ones the definition
invites: looking up ``q - d`` instead of ``q + d`` (a convolution's flip, where Eq. 2 is a
correlation), 0 for an empty cell where the map says -1, the table laid out one row
per output; reading ``features[-1]`` for a missing pair, and assigning where the
pairs of an output add up.
"""
from __future__ import annotations

import numpy as np

from . import ExerciseFailed, Slip, exercise, expect_equal
from .inputs import crop_voxels

MAP_RULE = ("table[k, i] is the row j with coords[j] == coords[i] + offsets[k] (plus: Eq. 2 is a "
            "correlation, not a convolution's flip), or -1 when that cell is empty; one row per offset, "
            "one column per output")
CONV_RULE = ("out[i] is the sum, over the offsets k with table[k, i] >= 0, of features[table[k, i]] @ "
             "weight[k] (Eq. 3): every pair of output i adds its product, and an entry -1 means no input "
             "(features[-1] is the last row, not zero)")


def _as_table(got, shape):
    got = np.asarray(got)
    if got.shape != shape:
        raise ExerciseFailed(f"the table has shape {got.shape}; expected {shape}", MAP_RULE)
    return got.astype(np.int64)


def _map_by(coords, offsets, sign=1, empty=-1):
    row_of = {tuple(c): j for j, c in enumerate(np.asarray(coords).tolist())}
    return np.array([[row_of.get(tuple((np.asarray(q) + sign * np.asarray(d)).tolist()), empty)
                      for q in np.asarray(coords)] for d in np.asarray(offsets)])


# -- 1.1 ------------------------------------------------------------------------------

def _kernel_map_flipped(coords, offsets):
    """Wrong: looks up q - d, the flipped kernel of a textbook convolution."""
    return _map_by(coords, offsets, sign=-1)


def _kernel_map_zero_for_empty(coords, offsets):
    """Wrong: an empty cell gets 0 (``dict.get``'s habit), which is row 0, a real input."""
    return _map_by(coords, offsets, empty=0)


def _kernel_map_per_output(coords, offsets):
    """Wrong: one row per output, one column per offset (the transposed layout)."""
    return _map_by(coords, offsets).T


@exercise("1.1", "the kernel map, by dictionary", answer="kernel_map",
          wrong=[Slip(_kernel_map_flipped, says="correlation"), Slip(_kernel_map_zero_for_empty, says="-1"),
                 Slip(_kernel_map_per_output, says="one row per offset")])
def check_kernel_map(kernel_map):
    """``kernel_map(coords, offsets)`` on the voxels of a crop with the 27 offsets of a
    3x3x3 kernel, against :func:`numba_sc.build_kernel_map`'s reference."""
    import numba_sc as ns

    coords = crop_voxels(250, seed=1)
    offsets = ns.kernel_offsets(3)
    expected = np.asarray(ns.build_kernel_map(coords, 3, backend="reference").table, np.int64)
    got = _as_table(kernel_map(coords.copy(), offsets.copy()), expected.shape)

    def where(index):
        k, i = index
        return f"offset {tuple(offsets[k].tolist())}, output at {tuple(coords[i].tolist())}"

    expect_equal(got, expected, "table[k, i]", rule=MAP_RULE, where=where)


# -- 1.2 ------------------------------------------------------------------------------

def _conv_unmasked(features, weight, table):
    """Wrong: forgets that -1 means "no input"; features[-1] is the last row."""
    out = np.zeros((table.shape[1], weight.shape[2]))
    for k in range(len(weight)):
        out += features[table[k]].astype(np.float64) @ weight[k]
    return out


def _conv_assigning(features, weight, table):
    """Wrong: ``=`` where the pairs add up, so each output keeps only its last pair."""
    out = np.zeros((table.shape[1], weight.shape[2]))
    for k in range(len(weight)):
        i = np.flatnonzero(table[k] >= 0)
        out[i] = features[table[k, i]].astype(np.float64) @ weight[k]
    return out


@exercise("1.2", "multiply along the kernel map", answer="conv_from_map",
          wrong=[Slip(_conv_unmasked, says="-1 means no input"), Slip(_conv_assigning, says="sum")])
def check_conv_from_map(conv_from_map):
    """``conv_from_map(features, weight, table)`` on a crop's submanifold 3x3x3 layer,
    against :func:`numba_sc.sparse_conv3d`'s reference."""
    import numba_sc as ns

    coords = crop_voxels(250, seed=2)
    rng = np.random.default_rng(12)
    features = rng.normal(size=(len(coords), 3)).astype(np.float32)
    weight = rng.normal(size=(27, 3, 2)).astype(np.float32)
    table = np.asarray(ns.build_kernel_map(coords, 3, backend="reference").table)
    expected = np.asarray(ns.sparse_conv3d(ns.SparseTensor(coords, features), weight, kernel_size=3,
                                           backend="reference").features, np.float64)
    got = np.asarray(conv_from_map(features.copy(), weight.copy(), table.copy()), np.float64)

    def where(index):
        pairs = int((table[:, index[0]] >= 0).sum())
        return f"output {index[0]}, channel {index[1]}: {pairs} pair{'s' if pairs != 1 else ''}"

    expect_equal(got, expected, "out[i, c]", rule=CONV_RULE, atol=1e-4, where=where)
