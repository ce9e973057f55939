"""Stage 1, voxelization: float points -> unique integer voxel coordinates.

A LiDAR scan is a list of float points. Sparse convolution works on a grid, so
each point is snapped to the voxel that contains it::

    voxel(p) = floor(p / voxel_size)        (per axis, computed in float64)

Several points fall in the same voxel; the voxels are de-duplicated, sorted
lexicographically (the order every later stage expects), and each voxel gets the
mean (or sum, or max) of its points' features. ``inverse[i]`` tells which voxel
point ``i`` went to, so per-voxel results can be carried back to the points.

Worked example, ``voxel_size = 1``::

    points   (0.5, 0.2, 0.1)  (2.7, 0.0, 0.0)  (0.9, 0.9, 0.9)  (-0.1, 0.0, 0.0)
    voxels   (0, 0, 0)        (2, 0, 0)        (0, 0, 0)        (-1, 0, 0)
    coords   [(-1,0,0), (0,0,0), (2,0,0)]       inverse [1, 2, 1, 0]

The GPU pipeline (one thread per point or per voxel, paper Section 2.2 / Eq. 1):

1. ``quantize_kernel``: floor and pack each point into a 64-bit key
   (:mod:`numba_sc.core.conventions`), flagging NaN / inf / out-of-range points;
2. library sort + run marking + compaction (:mod:`numba_sc.core.unique`);
3. ``unpack_kernel`` (:mod:`numba_sc.core.unique`): unique keys back to int32 coordinates;
4. ``voxelization_v2``: each voxel reduces the features of its run of points.

The reduction is a two-rung ladder (``python -m numba_sc ladder voxelization``):
``voxelization_v1`` adds every point into its voxel with atomics, as the
formula reads; ``voxelization_v2`` (the library's) sums each voxel's
sorted run in a register instead.

Bytes moved for N points, M voxels, C channels (float32): quantize reads 12N,
writes 8N; sort/unique ~60N; unpack 8M -> 12M; reduce reads 4NC + 8N, writes 4MC.
Points with a leading batch column ``(N, 4)`` give ``(M, 4)`` coordinates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..core import conventions as cv
from ..core.device import device_xp, is_cupy
from ..core.backend import like, resolve_backend, to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.tensor import as_array
from ..core.unique import sort_unique_cuda, sort_unique_reference, unpack_kernel

REDUCTIONS = ("mean", "sum", "max")


@dataclass
class Voxelization:
    """What :func:`voxelize` returns."""

    coords: object  # int32 (M, 3) or (M, 4), sorted lexicographically
    features: object  # (M, C) reduced features, or None
    inverse: object  # int64 (N,): voxel index of every point
    counts: object  # int64 (M,): points per voxel

    def __len__(self):
        return int(self.coords.shape[0])


# ------------------------------------------------------------------ reference
def voxelize_reference(points, voxel_size, features=None, reduce="mean") -> Voxelization:
    """NumPy reference of :func:`voxelize` (host arrays in, host arrays out)."""
    points = np.asarray(points)
    vs, features = _check_args(points, voxel_size, features, reduce)
    _explain_bad_points(points, vs)  # raises on NaN / inf / out of range
    s = points.shape[1] - 3
    q = np.floor(points[:, s:].astype(np.float64) / vs).astype(np.int64)
    if s:
        q = np.concatenate([points[:, :1].astype(np.int64), q], axis=1)
    keys = cv.pack_keys(q.astype(np.int32))
    su = sort_unique_reference(keys)
    coords = cv.unpack_keys(su.keys, with_batch=bool(s))
    counts = np.diff(su.starts)
    feats = None
    if features is not None:
        f = np.asarray(features)[su.order].astype(np.float64)
        if reduce == "max":
            red = np.maximum.reduceat(f, su.starts[:-1], axis=0)
        else:
            red = np.add.reduceat(f, su.starts[:-1], axis=0)
            if reduce == "mean":
                red /= counts[:, None]
        feats = red.astype(features.dtype)
    return Voxelization(coords, feats, su.inverse, counts)


# ------------------------------------------------------------- v1: atomics
# The reduction, first as the formula reads: every point adds its features into its
# voxel's sum. One thread per (point, channel), an atomic add, then a division.
@cuda.jit
def atomic_reduce_v1(features, inverse, sums):
    """v1: one thread per (point, channel) adds its value into ``sums[voxel, c]``
    (float64, zeroed). Many points of a voxel add to the same address: the atomics
    on it are serialized, and they land in whatever order the threads run."""
    t = cuda.grid(1)
    channels = features.shape[1]
    if t < features.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        cuda.atomic.add(sums, (inverse[i], c), np.float64(features[i, c]))


@cuda.jit
def divide_v1(sums, counts, out):
    """v1's second pass: one thread per (voxel, channel), the mean."""
    t = cuda.grid(1)
    channels = out.shape[1]
    if t < out.shape[0] * channels:
        m = t // channels
        out[m, t - m * channels] = sums[m, t - m * channels] / counts[m]


# -------------------------------------------------------------------- kernels
@cuda.jit
def quantize_kernel(points, s, vx, vy, vz, keys, flag):
    """One thread per point: key of floor(p / voxel_size); flag[0] = 1 on a bad point.

    ``s`` is 1 when column 0 holds the batch index, else 0.
    """
    i = cuda.grid(1)
    if i < points.shape[0]:
        # float64 division: the exact same rounding as the NumPy reference.
        fx = np.float64(points[i, s]) / vx
        fy = np.float64(points[i, s + 1]) / vy
        fz = np.float64(points[i, s + 2]) / vz
        b = np.float64(points[i, 0]) if s == 1 else 0.0
        # floor(f) lies in [MIN, MAX] exactly when MIN <= f < MAX + 1. Range first,
        # floor after: comparisons with NaN are false and inf fails the range, so
        # floor never sees a value it cannot turn into an integer.
        ok = (cv.COORD_MIN <= fx < cv.COORD_MAX + 1 and cv.COORD_MIN <= fy < cv.COORD_MAX + 1
              and cv.COORD_MIN <= fz < cv.COORD_MAX + 1
              and 0.0 <= b <= cv.BATCH_MAX and b == math.floor(b))
        if ok:
            keys[i] = cv.pack_key_device(int(b), math.floor(fx), math.floor(fy), math.floor(fz))
        else:
            keys[i] = 0
            flag[0] = 1  # every bad thread writes the same value: a benign race


def voxelization_v1(points, voxel_size, features):
    """v1 on device arrays: :func:`voxelize_cuda`'s steps with the atomic reduction
    (:func:`atomic_reduce_v1`, then :func:`divide_v1`); returns a :class:`Voxelization`
    (mean)."""
    xp = device_xp()
    vs, features = _check_args(points, voxel_size, features, "mean")
    p, f = to_device(points), to_device(features)
    n, s = p.shape[0], p.shape[1] - 3
    keys = xp.empty(n, dtype=np.int64)
    flag = xp.zeros(1, dtype=np.int32)
    quantize_kernel[blocks_for(n), THREADS](p, s, float(vs[0]), float(vs[1]), float(vs[2]), keys, flag)
    su = sort_unique_cuda(keys)  # (the flag is the library's business; the ladder's points are good)
    m, c = su.keys.shape[0], f.shape[1]
    coords = xp.empty((m, 3 + s), dtype=np.int32)
    unpack_kernel[blocks_for(m), THREADS](su.keys, s, coords)
    counts = xp.diff(su.starts)
    sums = xp.zeros((m, c), dtype=np.float64)
    atomic_reduce_v1[blocks_for(n * c), THREADS](f, su.inverse, sums)
    feats = xp.empty((m, c), dtype=f.dtype)
    divide_v1[blocks_for(m * c), THREADS](sums, counts, feats)
    return Voxelization(coords, feats, su.inverse, counts)


@cuda.jit
def voxelization_v2(features, order, starts, mode, out):
    """v2 (the library's): one thread per (voxel, channel) reduces the run of points of
    that voxel.

    What changed from v1: the sort has already put each voxel's points next to
    each other (``starts``), so a thread can sum its voxel's run in a register
    and write once: no atomics, no zeroed buffer, no second pass, and the sum
    runs in the same order every time (v1's order is the threads' race, so its
    float sums may differ in the last bit from run to run). What it bought in
    time: none, on the SemanticKITTI scan (123k points, 4 channels), the whole
    stage (``python -m numba_sc ladder voxelization``, recorded in
    ``benchmarks/results/ladder_all_kitti.json``). At 4 channels the reduction is a
    sliver of the stage (the sort and its device read are most of it), so what
    v2 buys here is the same result run after run, not time; it stays the
    library's for that.

    ``mode`` 0 = mean, 1 = sum, 2 = max. The points of voxel m sit at sorted
    positions ``starts[m]:starts[m+1]``; ``order`` maps them back to input rows.
    Accumulates in float64 so the result does not depend on the summation order.
    """
    t = cuda.grid(1)
    channels = features.shape[1]
    if t < out.shape[0] * channels:
        m = t // channels
        c = t - m * channels  # neighbouring threads read neighbouring channels
        lo = starts[m]
        hi = starts[m + 1]
        acc = np.float64(features[order[lo], c])
        for j in range(lo + 1, hi):
            v = np.float64(features[order[j], c])
            if mode == 2:
                acc = max(acc, v)
            else:
                acc += v
        if mode == 0:
            acc /= hi - lo
        out[m, c] = acc


def voxelize_cuda(points, voxel_size, features=None, reduce="mean") -> Voxelization:
    """Device version: the four kernels of the module docstring."""
    xp = device_xp()
    vs, features = _check_args(points, voxel_size, features, reduce)
    p = to_device(points)
    n, s = p.shape[0], p.shape[1] - 3
    keys = xp.empty(n, dtype=np.int64)
    flag = xp.zeros(1, dtype=np.int32)
    launch(quantize_kernel, n, p, s, float(vs[0]), float(vs[1]), float(vs[2]), keys, flag)
    if int(flag[0]):
        _explain_bad_points(p.get() if is_cupy(p) else np.asarray(p), vs)
        raise AssertionError("quantize_kernel flagged a point the host check accepts")
    su = sort_unique_cuda(keys)
    m = su.keys.shape[0]
    coords = xp.empty((m, 3 + s), dtype=np.int32)
    launch(unpack_kernel, m, su.keys, s, coords)
    counts = xp.diff(su.starts)
    feats = None
    if features is not None:
        f = to_device(features)
        feats = xp.empty((m, f.shape[1]), dtype=f.dtype)
        launch(voxelization_v2, m * f.shape[1], f, su.order, su.starts,
               REDUCTIONS.index(reduce), feats)
    return Voxelization(coords, feats, su.inverse, counts)


# ----------------------------------------------------------------------- API
def voxelize(points: cv.Array, voxel_size: float | tuple[float, float, float], features: cv.Array | None = None,
             reduce: str = "mean", backend: str | None = None) -> Voxelization:
    """Snap float points to unique voxel coordinates, sorted lexicographically.

    Parameters
    ----------
    points : float32/float64 array (N, 3) or (N, 4)
        x, y, z in metres, optionally after a leading batch-index column.
    voxel_size : float or 3 floats
        Edge length of a voxel (per axis).
    features : (N, C) float array, optional
        Per-point features reduced into per-voxel features.
    reduce : "mean" | "sum" | "max"
    backend : None | "cuda" | "reference"

    Returns a :class:`Voxelization` with ``.coords`` (int32 (M, 3|4), exactly
    ``floor(points / voxel_size)`` de-duplicated and sorted), ``.features``,
    ``.inverse`` (int64 (N,)) and ``.counts``; arrays of the kind given (a PyTorch
    tensor, or any array that speaks DLPack, is read as NumPy on the CPU and CuPy on
    a GPU, and the result is of that kind).
    """
    points = as_array(points, "points")
    features = None if features is None else as_array(features, "features")
    if resolve_backend(backend) == "reference":
        out = voxelize_reference(
            points.get() if is_cupy(points) else points, voxel_size,
            features.get() if is_cupy(features) else features, reduce)
    else:
        out = voxelize_cuda(points, voxel_size, features, reduce)
    return Voxelization(*(like(a, points) for a in (out.coords, out.features, out.inverse, out.counts)))


# -------------------------------------------------------------------- the ladder
def _ladder_work(ctx):
    """The scan's points (x, y, z) and, as their features, their own columns cast to
    the context's dtype (4 with a remission column), on the device."""
    points = np.asarray(ctx.points, np.float32)
    return {"points": to_device(np.ascontiguousarray(points[:, :3])), "voxel_size": ctx.voxel_size,
            "features": to_device(np.ascontiguousarray(points[:, :4].astype(ctx.dtype)))}


def _coords_and_features(v):
    """A voxelization's coordinates and features, side by side, on the host."""
    return np.concatenate([to_host(v.coords), to_host(v.features)], axis=1)


def _bytes_moved(w):
    """At least: the points and their features read once; each voxel's coordinates and
    features written once, and each point's voxel index (the inverse, int64)."""
    points, features = w["points"], w["features"]
    voxels = len(voxelize_reference(to_host(points), w["voxel_size"]).coords)  # M, as the stage finds it
    per_voxel = 3 * 4 + features.shape[1] * features.dtype.itemsize  # int32 x, y, z; the features
    return points.nbytes + features.nbytes + voxels * per_voxel + points.shape[0] * 8


LADDER = Ladder(
    "voxelization",
    (Rung("v1", lambda w: voxelization_v1(w["points"], w["voxel_size"], w["features"]),
          "the points added into their voxels by atomics (float64), then a division"),
     Rung("v2", lambda w: voxelize_cuda(w["points"], w["voxel_size"], w["features"], "mean"),
          "+ each voxel's sorted run summed in a register: no atomics, one pass (the library's)")),
    workload=_ladder_work,
    reference=lambda w: _coords_and_features(
        voxelize_reference(to_host(w["points"]), w["voxel_size"], to_host(w["features"]))),
    # v1 adds in float64 in the threads' order: exact for these values, but not promised
    tolerance={"float32": 1e-7, "float16": 1e-3},
    collect=_coords_and_features,
    needs=("points",),
    bytes_moved=_bytes_moved,
)


# ------------------------------------------------------- validation (host side)
def _check_args(points, voxel_size, features, reduce):
    if not hasattr(points, "shape") or not hasattr(points, "dtype"):
        raise TypeError(f"points must be a NumPy or CuPy array, got {type(points).__name__}")
    if points.ndim != 2 or points.shape[1] not in (3, 4):
        raise ValueError(
            "points must have shape (N, 3) for x, y, z or (N, 4) with a batch index in "
            f"column 0, got {tuple(points.shape)}; slice off extra columns such as "
            "remission and pass them as features")
    if np.dtype(points.dtype) not in (np.float32, np.float64):
        raise TypeError(f"points must be float32 or float64, got dtype {points.dtype}")
    if points.shape[0] == 0:
        raise ValueError("points is empty: there is nothing to voxelize")
    if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating))
           for v in np.asarray(voxel_size, dtype=object).reshape(-1)):  # one size or three, each a number
        raise TypeError(f"voxel_size must be a positive finite number or 3 of them (metres), got {voxel_size!r}")
    vs = np.asarray(voxel_size, dtype=np.float64).reshape(-1)
    if vs.size == 1:
        vs = np.repeat(vs, 3)
    if vs.size != 3 or not np.all(np.isfinite(vs)) or np.any(vs <= 0):
        raise ValueError(f"voxel_size must be a positive finite number or 3 of them, got {voxel_size!r}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if features is not None:
        if not hasattr(features, "shape"):
            raise TypeError("features must be a NumPy or CuPy array or None")
        if features.ndim == 1:
            features = features.reshape(-1, 1)
        if features.ndim != 2 or features.shape[0] != points.shape[0]:
            raise ValueError(
                f"features must have shape (N, C) with N = {points.shape[0]} (one row per "
                f"point), got {tuple(features.shape)}")
        if np.dtype(features.dtype) not in (np.float16, np.float32, np.float64):
            raise TypeError(f"features must be a float array, got dtype {features.dtype}")
    return vs, features


def _explain_bad_points(points: np.ndarray, vs: np.ndarray):
    """Raise the precise error for points the quantizer refused (host side, slow path)."""
    s = points.shape[1] - 3
    xyz = points[:, s:].astype(np.float64)
    cv.check_finite_points(points)
    if s:
        b = points[:, 0]
        if (b != np.floor(b)).any() or b.min() < 0 or b.max() > cv.BATCH_MAX:
            raise ValueError(
                f"points: column 0 is the batch index and must hold whole numbers in 0..{cv.BATCH_MAX}, "
                f"got values in {b.min()}..{b.max()}")
    q = np.floor(xyz / vs)
    lo, hi = q.min(axis=0), q.max(axis=0)
    cv.check_packable(lo, hi, name=f"points at voxel_size {vs.tolist()}")
