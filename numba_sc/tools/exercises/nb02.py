"""Exercises of notebook 02, voxelization and output coordinates.

2.1 voxelizes in NumPy (floor, de-duplicate, sort, inverse, mean), 2.2 writes the
reduction of ``voxelization_v1`` for another operation (the voxel's maximum, by
atomics), 2.3 writes Eq. 1 as a kernel. Each runs on a crop of a real scan moved to the
origin, so coordinates of both signs occur, and is compared with the stage's NumPy
reference. The kernels are launched the way Numba teaches, as the ladder's plain rungs
are, ``kernel[blocks, threads](...)`` with one thread per element, under the recorder
of :mod:`.races`, so that a kernel whose threads race fails on every run, not on the
rare run where the race shows.

The slips: truncating where the floor is meant (2.1, 2.3), dividing in float32 (2.1),
the sum where the mean or the maximum is asked (2.1, 2.2), a maximum without the
atomic (2.2), snapped coordinates left at the coarse scale, and ``cuda.threadIdx.x``
where the thread's index in the whole launch is meant (2.3).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...coords.output_coords import output_coordinates_reference
from ...coords.voxelization import atomic_reduce_v1, voxelize_reference
from ...core.launch import THREADS, blocks_for
from ...core.state import cached
from . import ExerciseFailed, Slip, exercise, expect_equal, expect_no_race, recorded_launch
from .inputs import VOXEL, crop_voxels, scan_crop, scan_points


# -- 2.1 ------------------------------------------------------------------------------

COORDS_RULE = ("a point's voxel is floor(p / voxel_size) on each axis (floor, not truncation: -0.3 "
               "voxels is voxel -1), divided in float64 as the library does (float32 puts a point "
               "just below a cell border into the next cell); coords are the unique voxels, sorted on "
               "x, then y, then z")
INVERSE_RULE = "inverse[i] is the row of coords that holds point i's voxel"
MEAN_RULE = "features[m] is the mean of voxel m's points' features: their sum over their count"


def _voxelize_truncating(points, features, voxel_size):
    """Wrong: ``astype(int)`` truncates towards zero, so cell 0 is twice as wide."""
    return _voxelize(points, features, (points / voxel_size).astype(np.int32))


def _voxelize_float32(points, features, voxel_size):
    """Wrong: floors the float32 quotient (NumPy keeps float32 / a Python float in float32)."""
    return _voxelize(points, features, np.floor(points / voxel_size).astype(np.int32))


def _voxelize_summing(points, features, voxel_size):
    """Wrong: the voxel's sum where its mean is asked."""
    coords, means, inverse = _voxelize(points, features, np.floor(points.astype(np.float64) / voxel_size))
    return coords, means * np.bincount(inverse)[:, None], inverse


def _voxelize(points, features, cells):
    coords, inverse = np.unique(cells.astype(np.int32), axis=0, return_inverse=True)
    inverse = inverse.ravel()
    sums = np.zeros((len(coords), features.shape[1]))
    np.add.at(sums, inverse, features)
    return coords, sums / np.bincount(inverse)[:, None], inverse


def _points(n):
    return f"a voxel of {n} point{'s' if n != 1 else ''}"


@cached
def float32_border_points(n: int = 150) -> np.ndarray:
    """float32 (n, 4): the ``n`` points of the scan nearest (Chebyshev) to its first point
    whose voxel differs between float32 and float64 division (in the scan's own
    coordinates: moving them would move the border)."""
    points = scan_points()
    xyz = points[:, :3]
    differs = np.flatnonzero(np.any(np.floor(xyz / np.float32(VOXEL)) != np.floor(xyz.astype(np.float64) / VOXEL),
                                    axis=1))
    centre = xyz[differs[0]] if len(differs) else xyz[0]
    return points[np.argsort(np.abs(xyz - centre).max(axis=1), kind="stable")[:n]]


@exercise("2.1", "voxelize in NumPy", answer="voxelize_mean",
          wrong=[Slip(_voxelize_truncating, says="floor"), Slip(_voxelize_float32, says="float64"),
                 Slip(_voxelize_summing, says="mean")])
def check_voxelize_mean(voxelize_mean):
    """``voxelize_mean(points, features, voxel_size)`` -> ``(coords, features, inverse)`` on a
    crop of 300 points around the origin (both signs), then on points around one whose
    voxel differs between float32 and float64 division, against
    :func:`numba_sc.coords.voxelization.voxelize_reference`."""
    cases = (("a crop around the origin", scan_crop(300, seed=3)),
             ("points at a cell border that float32 division crosses", float32_border_points()))
    for case, crop in cases:
        points, features = np.ascontiguousarray(crop[:, :3]), np.ascontiguousarray(crop[:, 3:])
        ref = voxelize_reference(points, VOXEL, features=features)
        got = voxelize_mean(points.copy(), features.copy(), VOXEL)
        if not isinstance(got, tuple) or len(got) != 3:
            raise ExerciseFailed(f"voxelize_mean returned {type(got).__name__}",
                                 "return three things: (coords, features, inverse)")
        coords, feats, inverse = (np.asarray(a) for a in got)
        expect_equal(coords, ref.coords, f"{case}: coords[m, axis]", rule=COORDS_RULE,
                     where=lambda i: f"voxel {i[0]}, axis {'xyz'[i[1]]}")
        expect_equal(inverse.ravel(), ref.inverse, f"{case}: inverse[i]", rule=INVERSE_RULE)
        expect_equal(np.asarray(feats, np.float64), np.asarray(ref.features, np.float64),
                     f"{case}: features[m, c]", rule=MEAN_RULE, atol=1e-5,
                     where=lambda i: _points(int(np.sum(ref.inverse == i[0]))))


# -- 2.2 ------------------------------------------------------------------------------

MAX_RACE_RULE = ("several points of a voxel update out[m, c]: the read, the comparison and the write must "
                 "be one indivisible step, cuda.atomic.max(out, (m, c), value). A plain "
                 "`if value > out[m, c]: out[m, c] = value` races: two threads read the same old value and "
                 "the larger of their two writes may be the one lost")
MAX_RULE = ("out[m, c] is the largest value of channel c among voxel m's points: a maximum, starting "
            "from -inf, not a sum")


@cuda.jit
def _max_without_atomic(features, inverse, out):
    """Wrong: the read-compare-write of a maximum done with plain loads and stores."""
    t = cuda.grid(1)
    channels = features.shape[1]
    if t < features.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        value = np.float64(features[i, c])
        if value > out[inverse[i], c]:
            out[inverse[i], c] = value


@exercise("2.2", "a voxel's maximum, by atomics", answer="voxel_max_kernel",
          wrong=[Slip(_max_without_atomic, says="cuda.atomic.max"),
                 # v1's own kernel, copied unchanged: it adds where a maximum is asked
                 Slip(atomic_reduce_v1, says="largest value")])
def check_voxel_max_kernel(voxel_max_kernel):
    """``voxel_max_kernel[grid, block](features, inverse, out)``, one thread per (point,
    channel) as ``atomic_reduce_v1`` is launched, ``out`` (float64) filled with -inf: no
    two threads may race on ``out`` (:mod:`.races`), and each voxel's maximum must equal
    :func:`voxelize_reference` with ``reduce="max"``."""
    crop = scan_crop(200, seed=4)
    points, features = np.ascontiguousarray(crop[:, :3]), np.ascontiguousarray(crop)  # x, y, z, remission
    ref = voxelize_reference(points, VOXEL, features=features, reduce="max")
    inverse = np.asarray(ref.inverse)
    out = np.full(ref.features.shape, -np.inf)  # the neutral element of max
    rec = recorded_launch(voxel_max_kernel, "voxel_max_kernel", blocks_for(features.size), THREADS,
                          {"features": features, "inverse": inverse, "out": out}, watch=("out",))
    expect_no_race(rec, MAX_RACE_RULE)
    expect_equal(out.astype(np.float32), ref.features, "out[m, c]", rule=MAX_RULE,
                 where=lambda i: f"voxel {i[0]}, {_points(int(np.sum(inverse == i[0])))}, channel "
                                 f"{'x y z remission'.split()[i[1]]}")


# -- 2.3 ------------------------------------------------------------------------------

SNAP_THREADS = 64  # threads per block: a crop of ~130 voxels spans several blocks
SNAP_RULE = ("Eq. 1: row i of out is floor(coords[i] / stride) * stride on each axis (floor, not "
             "truncation: -1 snaps to -2 at stride 2; integer // floors), kept at the finest scale "
             "(multiples of the stride)")
OWN_ROW_RULE = ("one thread per coordinate: thread i = cuda.grid(1) (blockIdx.x * blockDim.x + "
                "threadIdx.x, its index in the whole launch, not in its block) writes row i of out, and no "
                "other thread does")


@cuda.jit
def _snap_truncating(coords, stride, out):
    """Wrong: ``int(c / s)`` truncates towards zero, so -1 snaps to 0 instead of -2."""
    i = cuda.grid(1)
    if i < coords.shape[0]:
        for a in range(3):
            out[i, a] = int(coords[i, a] / stride) * stride


@cuda.jit
def _snap_coarse(coords, stride, out):
    """Wrong: the cell's index, ``c // s``, where Eq. 1 keeps the finest scale."""
    i = cuda.grid(1)
    if i < coords.shape[0]:
        for a in range(3):
            out[i, a] = coords[i, a] // stride


@cuda.jit
def _snap_thread_in_block(coords, stride, out):
    """Wrong: ``cuda.threadIdx.x`` is the thread's index in its block; every block then
    snaps the first rows again, and the later rows are never written."""
    i = cuda.threadIdx.x
    if i < coords.shape[0]:
        for a in range(3):
            out[i, a] = (coords[i, a] // stride) * stride


@exercise("2.3", "Eq. 1 as a kernel", answer="snap_kernel",
          wrong=[Slip(_snap_truncating, says="floor"), Slip(_snap_coarse, says="multiples of the stride"),
                 Slip(_snap_thread_in_block, says="cuda.grid(1)")])
def check_snap_kernel(snap_kernel):
    """``snap_kernel[grid, block](coords, stride, out)``, one thread per coordinate in
    blocks of 64: each row written by its own thread, and the snapped coordinates,
    de-duplicated and sorted here, against
    :func:`numba_sc.coords.output_coords.output_coordinates_reference` at strides 2 and 4."""
    coords = crop_voxels(200, seed=5)
    for stride in (2, 4):
        out = np.full_like(coords, 12345)  # 12345: a row no thread wrote
        rec = recorded_launch(snap_kernel, "snap_kernel", blocks_for(len(coords), SNAP_THREADS), SNAP_THREADS,
                              {"coords": coords, "stride": stride, "out": out}, watch=("out",))
        expect_no_race(rec, OWN_ROW_RULE)
        writers = rec.writers("out")
        for i in range(len(coords)):
            who = sorted(set(writers.get((i, 0), [])))
            if who != [i]:
                raise ExerciseFailed(f"stride {stride}: out[{i}, 0] was written by threads {who}, expected by "
                                     f"thread {i} alone", OWN_ROW_RULE)
        got = np.unique(out, axis=0)  # unique rows, sorted lexicographically: the library's order
        expect_equal(got, output_coordinates_reference(coords, stride),
                     f"stride {stride}: Q[row, axis] (the unique snapped coordinates, sorted)", rule=SNAP_RULE)
