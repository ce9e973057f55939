"""Exercises of notebook 01, sparse convolution from scratch.

1.1 builds the kernel map the way the definition reads it (a dictionary from coordinate
to row), 1.2 multiplies along it. Both are checked on the voxels of a small crop of a
real scan against the library's NumPy reference; the wrong answers are the two slips
the definition invites: looking up ``q - d`` instead of ``q + d`` (a convolution's
flip, where Eq. 2 is a correlation), and reading ``features[-1]`` for a missing pair.

:func:`scan_crop` is the crop every exercise of notebooks 01-03 starts from.
"""
from __future__ import annotations


import numpy as np

from . import ExerciseFailed, exercise, expect_equal
from .inputs import crop_voxels

def _as_table(got, shape):
    got = np.asarray(got)
    if got.shape != shape:
        raise ExerciseFailed(f"the table has shape {got.shape}; expected {shape}: one row per offset, "
                             "one column per output coordinate")
    return got.astype(np.int64)


# -- 1.1 ------------------------------------------------------------------------------

def _kernel_map_flipped(coords, offsets):
    """Wrong: looks up q - d, the flipped kernel of a textbook convolution."""
    row_of = {tuple(c): j for j, c in enumerate(np.asarray(coords).tolist())}
    return np.array([[row_of.get(tuple(np.subtract(q, d).tolist()), -1) for q in np.asarray(coords)]
                     for d in np.asarray(offsets)])


@exercise("1.1", "the kernel map, by dictionary", answer="kernel_map", wrong=_kernel_map_flipped)
def check_kernel_map(kernel_map):
    """``kernel_map(coords, offsets)`` on the voxels of a crop with the 27 offsets of a
    3x3x3 kernel, against :func:`numba_sc.build_kernel_map`'s reference."""
    import numba_sc as ns

    coords = crop_voxels(250, seed=1)
    offsets = ns.kernel_offsets(3)
    expected = np.asarray(ns.build_kernel_map(coords, 3, backend="reference").table, np.int64)
    got = _as_table(kernel_map(coords.copy(), offsets.copy()), expected.shape)
    expect_equal(got, expected, "table[k, i] (the row of the input at coords[i] + offsets[k], or -1)")


# -- 1.2 ------------------------------------------------------------------------------

def _conv_unmasked(features, weight, table):
    """Wrong: forgets that -1 means "no input"; features[-1] is the last row."""
    out = np.zeros((table.shape[1], weight.shape[2]))
    for k in range(len(weight)):
        out += features[table[k]].astype(np.float64) @ weight[k]
    return out


@exercise("1.2", "multiply along the kernel map", answer="conv_from_map", wrong=_conv_unmasked)
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
    expect_equal(got, expected, "out[i, c] (output i, channel c)", atol=1e-4)
