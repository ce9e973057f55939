"""Data augmentation: small random changes to a scan that do not change what it shows.

A network trained on a few scans memorizes them: where the road is, which way
the car points, how far the wall stands. Augmentation shows it the same scene
moved in ways that keep every label true, so that what it learns is the shape
of a car and not its position in one scan::

    rotate_z   turn the scene about the vertical axis through the sensor
    flip       mirror it left-right and/or front-back
    scale      make it a little larger or smaller (all three axes alike)
    jitter     move every point by a few centimetres of noise
    crop       keep a random box of the scene (fewer points: a cheaper step, and a
               scene the network has never seen whole)

Each function takes an (N, 3 + C) float array whose first three columns are
x, y, z in metres (z up, the sensor at the origin, as in SemanticKITTI) and
whose other columns (remission, colour, ...) are carried along untouched, and
an explicit ``rng``: a :class:`numpy.random.Generator`
(:func:`numpy.random.default_rng`), or an int seed, or None for fresh entropy, as
NumPy's own functions take it (:func:`as_rng`). The same generator
state gives the same result, so a training run is reproducible from its seed
(:class:`numba_sc.train.data.Loader` gives every scan of every epoch its own
generator). They return new arrays of the input's float dtype and never modify
their input.

Each function documents exactly what it draws from ``rng`` and in which order,
so that a test (or a reader) can redo the draw and check the result by another
formula.

Example: a pipeline for training, then applied to a scan::

    import numpy as np
    from functools import partial
    from numba_sc.train import augment as A

    augment = A.compose(A.rotate_z, A.flip, partial(A.scale, low=0.9, high=1.1), A.jitter)
    rng = np.random.default_rng(0)
    points, labels = A.crop(points, labels, rng, size=40.0)   # changes N: first, with the labels
    points = augment(points, rng)                            # N unchanged: labels still line up

All of it is NumPy on the host: a scan's augmentation costs a few milliseconds
and runs in the loader's background threads, while the GPU trains on the
previous batch; there is nothing here that a kernel would teach.
"""
from __future__ import annotations

import math

import numpy as np

from ..core import conventions as cv


def check_points(points, name="points") -> np.ndarray:
    """``points`` as a float NumPy array (N, 3 + C) of finite numbers; raises with the reason otherwise
    (a NaN point would rotate to NaN, and a crop centred on one would keep nothing)."""
    if not hasattr(points, "shape") or not hasattr(points, "dtype"):
        raise TypeError(f"{name} must be a NumPy array (N, 3 + C), got {type(points).__name__}")
    a = np.asarray(points)
    if a.ndim != 2 or a.shape[1] < 3:
        raise ValueError(f"{name} must have shape (N, 3 + C): x, y, z first, got {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a float array (float32), got {a.dtype}")
    cv.check_finite_points(a, name)
    return a


def as_rng(rng, draws=(), name="rng"):
    """``rng`` as a :class:`numpy.random.Generator`: a Generator is used as it is (its
    draws advance), an int is a seed (``default_rng(seed)``: the same seed, the same
    draws), None a fresh generator (unrepeatable). An object with the methods in
    ``draws`` (the ones the caller draws with, e.g. ``("uniform",)``) is used as it is:
    a test may hand in one that returns a chosen angle. Anything else is refused,
    naming ``name``.

    >>> as_rng(3).random() == np.random.default_rng(3).random()
    True
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng()
    if cv.is_int(rng):
        if rng < 0:
            raise ValueError(f"{name}: a seed must be an integer >= 0, got {rng}")
        return np.random.default_rng(int(rng))
    if draws and not isinstance(rng, (bool, np.bool_, float, str, bytes)) and all(
            callable(getattr(rng, d, None)) for d in draws):
        return rng
    raise TypeError(f"{name} must be a numpy.random.Generator (np.random.default_rng(seed)), an int seed or None, "
                    f"got {type(rng).__name__} {rng!r:.40}")


def rotate_z(points, rng, max_angle=math.pi):
    """Rotate the scene about the vertical (z) axis by a random angle.

    Draws one angle ``t = rng.uniform(-max_angle, max_angle)`` and turns every
    point counter-clockwise (seen from above) about the z axis through the
    origin, the sensor::

        x' = x cos t - y sin t
        y' = x sin t + y cos t          z and the other columns unchanged

    ``max_angle = pi`` (the default) gives any heading, right for a spinning
    LiDAR that sees all around; a front camera's cone wants a small angle.

    >>> p = np.array([[1, 0, 0, 0.5]], np.float32)
    >>> rotate_z(p, np.random.default_rng(0), max_angle=0.0).tolist()
    [[1.0, 0.0, 0.0, 0.5]]
    """
    a = check_points(points)
    if not max_angle >= 0:
        raise ValueError(f"max_angle must be >= 0 (radians), got {max_angle}")
    t = as_rng(rng, ("uniform",)).uniform(-max_angle, max_angle)
    c, s = math.cos(t), math.sin(t)
    out = a.copy()
    x, y = a[:, 0].astype(np.float64), a[:, 1].astype(np.float64)
    out[:, 0] = c * x - s * y
    out[:, 1] = s * x + c * y
    return out


def flip(points, rng, axes=(0, 1)):
    """Mirror the scene along each of ``axes``, each with probability 1/2.

    Draws ``rng.random(len(axes))``, one number per axis in the order given;
    axis ``axes[i]`` is flipped (its coordinate negated) when number ``i`` is
    below 0.5. The default mirrors x (front-back) and y (left-right), which a
    road scene allows; z (up-down) does not: the ground would be above.

    >>> p = np.array([[1, 2, 3]], np.float32)
    >>> flip(p, np.random.default_rng(8)).tolist()   # this generator flips x only
    [[-1.0, 2.0, 3.0]]
    """
    a = check_points(points)
    axes = tuple(int(ax) for ax in axes)
    if any(ax not in (0, 1, 2) for ax in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axes must be distinct spatial axes among 0, 1, 2 (x, y, z), got {axes}")
    draws = as_rng(rng, ("random",)).random(len(axes))
    out = a.copy()
    for ax, u in zip(axes, draws):
        if u < 0.5:
            out[:, ax] = -a[:, ax]
    return out


def scale(points, rng, low=0.95, high=1.05):
    """Scale the scene about the origin by one random factor on all three axes.

    Draws one factor ``s = rng.uniform(low, high)``; x, y and z are multiplied by
    ``s``, the other columns are not. One factor for all axes keeps shapes (a
    car stays a car's proportions); a few percent is what real objects vary by.

    >>> p = np.array([[1, 2, 3, 0.5]], np.float32)
    >>> scale(p, np.random.default_rng(0), low=2, high=2).tolist()
    [[2.0, 4.0, 6.0, 0.5]]
    """
    a = check_points(points)
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    s = as_rng(rng, ("uniform",)).uniform(low, high)
    out = a.copy()
    out[:, :3] = a[:, :3] * s
    return out


def jitter(points, rng, sigma=0.01, clip=0.05):
    """Move every point by its own small random offset (metres).

    Draws ``rng.normal(0, sigma, (N, 3))``, one offset per point and axis,
    clipped to ``[-clip, clip]`` so that no point leaves its neighbourhood (an
    unclipped normal now and then throws a point a voxel away), and adds it to
    x, y, z. Sensor noise is of this order: a centimetre.

    >>> p = np.zeros((2, 3), np.float32)
    >>> bool(np.abs(jitter(p, np.random.default_rng(0), sigma=1.0, clip=0.05)).max() <= 0.05)
    True
    """
    a = check_points(points)
    if not sigma >= 0 or not clip > 0:
        raise ValueError(f"need sigma >= 0 and clip > 0, got sigma={sigma}, clip={clip}")
    noise = np.clip(as_rng(rng, ("normal",)).normal(0.0, sigma, (a.shape[0], 3)), -clip, clip)
    out = a.copy()
    out[:, :3] = a[:, :3] + noise
    return out


def crop(points, labels, rng, size, return_indices=False):
    """Keep the points inside a random box of ``size`` metres centred on a random point.

    Draws one index ``i = rng.integers(N)``; the box is centred on point ``i``
    (so it is never empty: point ``i`` is always kept). ``size`` is

    * a number ``s``: a horizontal square ``s`` x ``s``, every height kept. A road
      scene is flat; cutting it in z would slice the ground or the tree tops
      arbitrarily;
    * ``(sx, sy)`` a horizontal rectangle, or ``(sx, sy, sz)`` a box.

    A point is kept when ``|p[a] - centre[a]| <= size[a] / 2`` on every boxed axis.
    Kept points stay in their order. Returns ``(points, labels)`` (``labels`` may
    be None and then stays None), or with ``return_indices=True`` the kept
    indices, int64 ascending, to apply to any other per-point array.

    >>> p = np.array([[0, 0, 0], [1, 0, 0], [5, 0, 0]], np.float32)
    >>> crop(p, None, np.random.default_rng(1), size=3.0, return_indices=True).tolist()  # box on point 1
    [0, 1]
    """
    a = check_points(points)
    n = a.shape[0]
    if n == 0:
        raise ValueError("points is empty: there is nothing to crop")
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels has {len(labels)} entries but points has {n} rows: one label per point")
    half = np.atleast_1d(np.asarray(size, np.float64)) / 2
    if half.ndim != 1 or len(half) not in (1, 2, 3) or not (half > 0).all():
        raise ValueError(f"size must be a positive number or 2 or 3 positive numbers (metres), got {size!r}")
    if len(half) == 1:
        half = np.repeat(half, 2)
    centre = a[as_rng(rng, ("integers",)).integers(n), :len(half)].astype(np.float64)
    d = np.abs(a[:, :len(half)].astype(np.float64) - centre)
    keep = np.flatnonzero((d <= half).all(axis=1))
    if return_indices:
        return keep
    return a[keep], (None if labels is None else np.asarray(labels)[keep])


def compose(*fns):
    """One augmentation made of several, applied in the order given, on one ``rng``.

    Each of ``fns`` takes ``(points, rng)`` and returns new points with the same
    rows (use :func:`functools.partial` to set their parameters). :func:`crop`
    is not one of them: it changes the number of points and needs the labels;
    call it first.

    >>> from functools import partial
    >>> aug = compose(partial(scale, low=2, high=2), partial(rotate_z, max_angle=0.0))
    >>> aug(np.array([[1, 0, 0]], np.float32), np.random.default_rng(0)).tolist()
    [[2.0, 0.0, 0.0]]
    """
    for f in fns:
        if not callable(f):
            raise TypeError(f"compose takes functions (points, rng) -> points, got {f!r}")

    def composed(points, rng):
        if rng is None or isinstance(rng, (int, np.integer)):  # a seed: one generator for all steps,
            rng = as_rng(rng)  # where a seed given to each would repeat its draws
        for f in fns:
            points = f(points, rng)
        return points

    composed.__doc__ = "Applies, in order: " + ", ".join(getattr(f, "__name__", repr(f)) for f in fns)
    return composed
