"""Exercises of notebook 02, voxelization and output coordinates.

2.1 voxelizes in NumPy (floor, de-duplicate, sort, inverse, mean), 2.2 writes the
reduction of ``voxelization_v1`` for another operation (the voxel's maximum, by
atomics), 2.3 writes Eq. 1 as a kernel. Each runs on a crop of a real scan moved to
the origin, so coordinates of both signs occur, and is compared with the stage's NumPy
reference. The kernels are launched the way Numba teaches, as the ladder's plain rungs
are: ``kernel[blocks, threads](...)``, one thread per element
(:func:`numba_sc.core.launch.blocks_for`).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...coords.output_coords import output_coordinates_reference
from ...coords.voxelization import atomic_reduce_v1, voxelize_reference
from ...core.launch import THREADS, blocks_for, simulator_pace
from . import ExerciseFailed, exercise, expect_equal
from .inputs import VOXEL, crop_voxels, scan_crop


# -- 2.1 ------------------------------------------------------------------------------

def _voxelize_truncating(points, features, voxel_size):
    """Wrong: ``astype(int)`` truncates towards zero, so cell 0 is twice as wide."""
    cells = (points / voxel_size).astype(np.int32)
    coords, inverse = np.unique(cells, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    sums = np.zeros((len(coords), features.shape[1]))
    np.add.at(sums, inverse, features)
    return coords, sums / np.bincount(inverse)[:, None], inverse


@exercise("2.1", "voxelize in NumPy", answer="voxelize_mean", wrong=_voxelize_truncating)
def check_voxelize_mean(voxelize_mean):
    """``voxelize_mean(points, features, voxel_size)`` -> ``(coords, features, inverse)``
    on a crop of 300 points, against :func:`numba_sc.coords.voxelization.voxelize_reference`."""
    crop = scan_crop(300, seed=3)
    points, features = np.ascontiguousarray(crop[:, :3]), np.ascontiguousarray(crop[:, 3:])
    ref = voxelize_reference(points, VOXEL, features=features)
    got = voxelize_mean(points.copy(), features.copy(), VOXEL)
    if not isinstance(got, tuple) or len(got) != 3:
        raise ExerciseFailed("return three things: (coords, features, inverse)")
    coords, feats, inverse = (np.asarray(a) for a in got)
    expect_equal(coords, ref.coords, "coords[m] (the m-th voxel, sorted on x, then y, then z)")
    expect_equal(inverse.ravel(), ref.inverse, "inverse[i] (the row of point i's voxel)")
    expect_equal(np.asarray(feats, np.float64), np.asarray(ref.features, np.float64),
                 "features[m] (the mean of voxel m's points)", atol=1e-5)


# -- 2.2 ------------------------------------------------------------------------------

# Wrong: v1's own kernel, copied unchanged: it adds where a maximum is asked.
@exercise("2.2", "a voxel's maximum, by atomics", answer="voxel_max_kernel", wrong=atomic_reduce_v1)
def check_voxel_max_kernel(voxel_max_kernel):
    """``voxel_max_kernel[grid, block](features, inverse, out)``, one thread per (point,
    channel) as ``atomic_reduce_v1`` is launched, ``out`` (float64) filled with -inf: each
    voxel's maximum against :func:`voxelize_reference` with ``reduce="max"``."""
    crop = scan_crop(200, seed=4)
    points, features = np.ascontiguousarray(crop[:, :3]), np.ascontiguousarray(crop)  # x, y, z, remission
    ref = voxelize_reference(points, VOXEL, features=features, reduce="max")
    out = np.full(ref.features.shape, -np.inf)  # the neutral element of max
    with simulator_pace():
        voxel_max_kernel[blocks_for(features.size), THREADS](features, np.asarray(ref.inverse), out)
    expect_equal(out.astype(np.float32), ref.features, "out[m, c] (voxel m's largest value of channel c)")


# -- 2.3 ------------------------------------------------------------------------------

@cuda.jit
def _snap_truncating(coords, stride, out):
    """Wrong: ``int(c / s)`` truncates towards zero, so -1 snaps to 0 instead of -2."""
    i = cuda.grid(1)
    if i < coords.shape[0]:
        for a in range(3):
            out[i, a] = int(coords[i, a] / stride) * stride


@exercise("2.3", "Eq. 1 as a kernel", answer="snap_kernel", wrong=_snap_truncating)
def check_snap_kernel(snap_kernel):
    """``snap_kernel[grid, block](coords, stride, out)``, one thread per coordinate: the
    snapped coordinates, de-duplicated and sorted here, against
    :func:`numba_sc.coords.output_coords.output_coordinates_reference` at strides 2 and 4."""
    coords = crop_voxels(200, seed=5)
    for stride in (2, 4):
        out = np.full_like(coords, 12345)
        with simulator_pace():
            snap_kernel[blocks_for(len(coords)), THREADS](coords, stride, out)
        got = np.unique(out, axis=0)  # unique rows, sorted lexicographically: the library's order
        expect_equal(got, output_coordinates_reference(coords, stride),
                     f"Q at stride {stride} (unique snapped coordinates, sorted)")
