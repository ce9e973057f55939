"""Between the convolutions: BatchNorm, ReLU, the residual add and concatenation.

A network is more than its convolutions. Between two of them the features pass
through a normalization and a nonlinearity; a residual block adds its input
back; a U-Net's decoder concatenates the features coming up with the ones its
encoder left at the same level. None of these looks at the coordinates: each
works on the feature rows alone, so a layer made of them hands its input's
coordinates (and maps) on unchanged, and every one of them is one pass over
the features.

BatchNorm at inference is, per channel ``c``::

    y = (x - running_mean[c]) * weight[c] / sqrt(running_var[c] + eps) + bias[c]

and a residual block ends in ``relu(y + shortcut)``. So one kernel,
:func:`batch_norm_v1`, does all three, each optional: normalize, add a
residual, clamp at zero. A network's ``BatchNorm`` followed by ``ReLU`` is one
launch, not two (:class:`numba_sc.nn.Sequential` fuses them), and so is the end
of a residual block.

Worked example, two points, two channels, ``running_mean = [1, 0]``,
``running_var = [4, 1]``, ``weight = [1, 2]``, ``bias = [0, 1]``, eps = 0::

    x = [[3, -1],        (3 - 1) / 2 * 1 + 0 = 1      (-1 - 0) / 1 * 2 + 1 = -1
         [-1, 2]]        (-1 - 1) / 2 * 1 + 0 = -1     (2 - 0) / 1 * 2 + 1 = 5
    y = [[1, -1], [-1, 5]]          relu(y) = [[1, 0], [0, 5]]

Every kernel gives one thread to one feature value ``(i, c)`` of the output:
thread ``t`` takes row ``t // C`` and channel ``t % C``, so the threads of a
warp read and write neighbouring values. BatchNorm, the one that runs after
every convolution, has a second version that the library runs
(:func:`batch_norm_v2`: the channel count compiled in, fast math);
:func:`batch_norm_v1` is the plain one, and both are checked against the
reference. The arithmetic is float32 also for
float16 features (each value is widened when read and rounded once when
written), as cuDNN's BatchNorm does for half precision. float64 features (the
oracle's, :mod:`numba_sc.tools.oracle`) run on the reference only, in float64
throughout (:func:`numba_sc.core.conventions.compute_dtype`).

Napkin math: these kernels only move bytes. BatchNorm with a residual on a
SemanticKITTI level (94k voxels, 64 channels, fp32) reads 2 x 24 MB and writes
24 MB: ~25 us at the H100's ~3 TB/s (typed: napkin math), about what two
launches cost the host (measured: ``docs/performance.md``, "The launch path"),
which is why fusing BatchNorm, the add and the ReLU into one launch is worth
doing and fusing further is not (the convolution around them moves an order of
magnitude more bytes).

Training-mode BatchNorm (statistics of the batch itself, and the running
averages updated with ``momentum``) normalizes with the same kernel; its
per-channel mean and variance come from two passes of a column-sum kernel shaped
as the backward's (:func:`batch_statistics_update`: six small launches where the array
library's steps made about fifteen a layer, a MinkUNet42 training step's most
frequent device operations; ``benchmarks/results/timeline_unet42.json``).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint64

from ..core.device import device_xp
from ..core.backend import resolve_backend, to_device, to_host
from ..core import conventions as cv
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.state import cached, remember

def _check_pair(a, b, name_a, name_b, same_channels=True, backend=None):
    cv.check_features(a, name_a, backend)
    cv.check_features(b, name_b, backend)
    if a.shape[0] != b.shape[0] or (same_channels and a.shape[1] != b.shape[1]):
        raise ValueError(
            f"{name_a} has shape {tuple(a.shape)} and {name_b} {tuple(b.shape)}: "
            + ("they must have the same shape (the same points, in the same order, and the same "
               "channels)" if same_channels else "they must have the same number of rows (points)"))
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} is {a.dtype} but {name_b} is {b.dtype}: convert one, e.g. "
                        f"{name_b}.astype(np.{np.dtype(a.dtype).name})")


def _check_channel_params(c, **params):
    for name, p in params.items():
        if not hasattr(p, "shape") or tuple(p.shape) != (c,):
            shape = tuple(p.shape) if hasattr(p, "shape") else type(p).__name__
            raise ValueError(f"{name} must have shape ({c},), one value per channel, got {shape}")


# ------------------------------------------------------------------ reference
def batch_norm_reference(x, weight, bias, mean, var, eps=1e-5, residual=None, relu=False):
    """NumPy: ``(x - mean) * weight / sqrt(var + eps) + bias`` per channel, then
    ``+ residual`` and ``max(., 0)`` when asked; float32 arithmetic (float64 for
    float64 features), rounded once."""
    x = np.asarray(x)
    f32 = cv.compute_dtype(x.dtype).type
    v = (x.astype(f32) - np.asarray(mean, f32)) * (
        np.asarray(weight, f32) / np.sqrt(np.asarray(var, f32) + f32(eps))) + np.asarray(bias, f32)
    if residual is not None:
        v = v + np.asarray(residual).astype(f32)
    if relu:
        v = np.maximum(v, f32(0))
    return v.astype(x.dtype)


def relu_reference(x):
    """NumPy: ``max(x, 0)``."""
    x = np.asarray(x)
    return np.maximum(x, x.dtype.type(0))


def add_reference(a, b, relu=False):
    """NumPy: ``a + b`` (then ``max(., 0)``), float32 arithmetic (float64 for float64),
    rounded once."""
    a = np.asarray(a)
    ct = cv.compute_dtype(a.dtype)
    v = a.astype(ct) + np.asarray(b).astype(ct)
    if relu:
        v = np.maximum(v, ct.type(0))
    return v.astype(a.dtype)


def bias_add_reference(x, bias):
    """NumPy: ``x + bias`` per channel, float32 arithmetic (float64 for float64), rounded once."""
    x = np.asarray(x)
    ct = cv.compute_dtype(x.dtype)
    return (x.astype(ct) + np.asarray(bias, ct)).astype(x.dtype)


def concat_reference(a, b):
    """NumPy: ``[a | b]`` along the channels."""
    return np.concatenate([np.asarray(a), np.asarray(b)], axis=1)


# -------------------------------------------------------------------- kernels
@cuda.jit
def batch_norm_v1(x, weight, bias, mean, var, eps, residual, has_residual, relu, out):
    """One thread per value (i, c): normalize with channel c's statistics, add the
    residual's value, clamp at zero (the last two when asked)."""
    t = cuda.grid(1)
    channels = x.shape[1]
    if t < x.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        v = (float32(x[i, c]) - mean[c]) * (weight[c] / math.sqrt(var[c] + float32(eps))) + bias[c]
        if has_residual:
            v += float32(residual[i, c])
        if relu and v < float32(0.0):
            v = float32(0.0)
        out[i, c] = v  # (the store rounds to float16 for half-precision features)


@cached
def batch_norm_v2(channels: int):
    """:func:`batch_norm_v1` compiled for one channel count, with fast math.

    Two things change, nothing else:

    * ``t // channels`` divides by a compile-time constant: a multiply and a
      shift, where a 64-bit division by a run-time value is a software routine
      of dozens of instructions (unsigned, as in :mod:`numba_sc.gmas.gather`);
    * ``fastmath``: the square root and the division are the GPU's
      approximate instructions (within 2 ulp), not the IEEE routines.

    Why it pays: a half-precision value is 2 bytes read and 2 written, so at
    the H100's memory bandwidth the per-value arithmetic, not the memory, sets
    v1's time on large clouds.

    v2 of BatchNorm's ladder (``python -m numba_sc ladder pointwise``; v1:
    :func:`batch_norm_v1`). What it bought on one call on SemanticKITTI at 64
    channels, with the residual and ReLU, is recorded in
    ``benchmarks/results/ladder_all_kitti.json``
    (``numba_sc.tools.lesson.bought("pointwise")``; more in
    ``docs/performance.md``, "nn/pointwise.py").
    """
    C = np.uint64(channels)

    @cuda.jit(fastmath=True)
    def batch_norm_v2_kernel(x, weight, bias, mean, var, eps, residual, has_residual, relu, out):
        t = uint64(cuda.grid(1))
        if t < uint64(x.shape[0]) * C:
            i = t // C
            c = t - i * C
            v = (float32(x[i, c]) - mean[c]) * (weight[c] / math.sqrt(var[c] + float32(eps))) + bias[c]
            if has_residual:
                v += float32(residual[i, c])
            if relu and v < float32(0.0):
                v = float32(0.0)
            out[i, c] = v

    return batch_norm_v2_kernel


@cuda.jit
def relu_kernel(x, out):
    """One thread per value: ``max(x, 0)``."""
    t = cuda.grid(1)
    channels = x.shape[1]
    if t < x.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        v = float32(x[i, c])
        out[i, c] = v if v > float32(0.0) else float32(0.0)


@cuda.jit
def add_kernel(a, b, relu, out):
    """One thread per value: ``a + b``, clamped at zero when ``relu``."""
    t = cuda.grid(1)
    channels = a.shape[1]
    if t < a.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        v = float32(a[i, c]) + float32(b[i, c])
        if relu and v < float32(0.0):
            v = float32(0.0)
        out[i, c] = v


@cuda.jit
def bias_add_kernel(x, bias, out):
    """One thread per value: ``x + bias[c]`` (a layer's bias, one value per channel)."""
    t = cuda.grid(1)
    channels = x.shape[1]
    if t < x.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        out[i, c] = float32(x[i, c]) + bias[c]


@cuda.jit
def concat_kernel(a, b, out):
    """One thread per output value: the first ``C_a`` channels of a row come from
    ``a``, the rest from ``b``."""
    t = cuda.grid(1)
    channels = out.shape[1]
    if t < out.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        ca = a.shape[1]
        if c < ca:
            out[i, c] = a[i, c]
        else:
            out[i, c] = b[i, c - ca]


# ------------------------------------------------------------------ launchers
def _f32(p):
    """A per-channel parameter as a float32 device array (a no-op for one already there)."""
    p = to_device(p)
    return p if p.dtype == np.float32 else p.astype(np.float32)


def batch_norm(x, weight, bias, mean, var, eps=1e-5, residual=None, relu=False, backend=None):
    """Inference BatchNorm of features ``x`` (N, C) with per-channel ``weight``, ``bias``,
    ``mean`` and ``var`` (C,), then ``+ residual`` (N, C) and ReLU when asked.

    Returns an array of the kind and dtype of ``x`` (NumPy or CuPy)."""
    bk = resolve_backend(backend)
    cv.check_features(x, "x", bk)
    c = x.shape[1]
    _check_channel_params(c, weight=weight, bias=bias, running_mean=mean, running_var=var)
    if residual is not None:
        _check_pair(x, residual, "x", "residual", backend=bk)
    if bk == "reference":
        return batch_norm_reference(to_host(x), to_host(weight), to_host(bias), to_host(mean),
                                    to_host(var), eps, None if residual is None else to_host(residual), relu)
    return batch_norm_rung("v2", x, weight, bias, mean, var, eps, residual, relu)


def batch_norm_rung(rung: str, x, weight, bias, mean, var, eps=1e-5, residual=None, relu=False):
    """Run one rung of BatchNorm's ladder on device arrays: ``"v1"`` the plain
    kernel, launched the way Numba teaches (``kernel[blocks, threads](...)``), ``"v2"``
    the library's (:func:`batch_norm_v2`), through the library's launcher."""
    if rung not in LADDER.names:
        raise ValueError(f"rung must be one of {LADDER.names}, got {rung!r}")
    xd = to_device(x)
    out = device_xp().empty(xd.shape, xd.dtype)
    res = xd if residual is None else to_device(residual)  # (not read without a residual)
    args = (xd, _f32(weight), _f32(bias), _f32(mean), _f32(var), float(eps), res, residual is not None, bool(relu), out)
    if rung == "v1":
        batch_norm_v1[blocks_for(xd.size, THREADS), THREADS](*args)
    else:
        launch(batch_norm_v2(xd.shape[1]), xd.size, *args)
    return out


def column_sums(a):
    """float32 (C,) (float64 for float64 ``a``, the oracle's): the sum of each column of
    ``a`` (N, C), as one matrix-vector product
    (``ones(N) @ a``, cuBLAS on the device). The array library's ``a.sum(axis=0)``
    gives each of the few columns one thread block that walks all N rows, with
    C apart between its reads: on the H100, at 94,444 x 64 float32, it took about
    ten times as long as the product (measured when this function came in)."""
    ct = cv.compute_dtype(a.dtype)
    af = a if a.dtype == ct else a.astype(ct)
    xp = device_xp() if not isinstance(af, np.ndarray) else np
    return xp.matmul(xp.ones(af.shape[0], ct), af)


def batch_statistics(x):
    """Per-channel mean and (biased) variance of ``x`` (N, C) in float32 (float64 for
    float64 ``x``), by the array library: what a BatchNorm in training mode normalizes
    with (two passes: the mean, then the squares of the deviations from it)."""
    ct = cv.compute_dtype(x.dtype)
    xf = x.astype(ct, copy=False)
    n = max(xf.shape[0], 1)
    mean = column_sums(xf) / ct.type(n)
    var = column_sums((xf - mean) ** 2) / ct.type(n)
    return mean, var


def relu(x, backend=None):
    """``max(x, 0)`` of features ``x`` (N, C)."""
    bk = resolve_backend(backend)
    cv.check_features(x, "x", bk)
    if bk == "reference":
        return relu_reference(to_host(x))
    xd = to_device(x)
    out = device_xp().empty(xd.shape, xd.dtype)
    launch(relu_kernel, xd.size, xd, out)
    return out


def add(a, b, relu=False, backend=None):
    """``a + b`` of two feature arrays of one shape (then ReLU when asked)."""
    bk = resolve_backend(backend)
    _check_pair(a, b, "a", "b", backend=bk)
    if bk == "reference":
        return add_reference(to_host(a), to_host(b), relu)
    ad = to_device(a)
    out = device_xp().empty(ad.shape, ad.dtype)
    launch(add_kernel, ad.size, ad, to_device(b), bool(relu), out)
    return out


def bias_add(x, bias, backend=None):
    """``x + bias``: features ``x`` (N, C) plus one value per channel, ``bias`` (C,)."""
    bk = resolve_backend(backend)
    cv.check_features(x, "x", bk)
    _check_channel_params(x.shape[1], bias=bias)
    if bk == "reference":
        return bias_add_reference(to_host(x), to_host(bias))
    xd = to_device(x)
    out = device_xp().empty(xd.shape, xd.dtype)
    launch(bias_add_kernel, xd.size, xd, _f32(bias), out)
    return out


def concat(a, b, backend=None):
    """``[a | b]``: the channels of ``b`` after those of ``a``, row by row."""
    bk = resolve_backend(backend)
    _check_pair(a, b, "a", "b", same_channels=False, backend=bk)
    if bk == "reference":
        return concat_reference(to_host(a), to_host(b))
    ad, bd = to_device(a), to_device(b)
    out = device_xp().empty((ad.shape[0], ad.shape[1] + bd.shape[1]), ad.dtype)
    launch(concat_kernel, out.size, ad, bd, out)
    return out


# ==================================================================== backward
# What each operation above sends back, given ``g = dL/dy`` of its output. The
# ReLU (alone or at the end of BatchNorm or an add) passes ``g`` where its output
# was positive and 0 elsewhere: ``g * (y > 0)``, from the output it kept. The add
# hands that to both operands; the concatenation splits it by channels (a view,
# no kernel). BatchNorm, with ``xhat = (x - mean) / sqrt(var + eps)`` and
# ``y = weight * xhat + bias``, sends per channel over the N rows::
#
#     dL/dbias   = sum_i g_i               dL/dweight = sum_i g_i * xhat_i
#     dL/dx_i    = weight / sqrt(var + eps) * (g_i - a - xhat_i * b)
#
# where, in training mode (the statistics are the batch's own, so they depend
# on every x_i), ``a = dL/dbias / N`` and ``b = dL/dweight / N``; at inference
# (fixed running statistics) ``a = b = 0``. Two rungs: v1 leaves the two sums
# (reductions over the rows) to the array library and one kernel writes dL/dx; v2,
# the library's, reads g, x and y once for both sums in one kernel and once more
# for dL/dx in a second (:func:`batch_norm_backward_v2`; what it bought is in
# ``benchmarks/results/batchnorm_backward.json``).
def relu_backward_reference(g, y):
    """NumPy: ``g * (y > 0)``."""
    g = np.asarray(g)
    return np.where(np.asarray(y) > 0, g, g.dtype.type(0))


def batch_norm_backward_reference(g, x, y, weight, mean, var, eps=1e-5, relu=False, training=True):
    """NumPy, float64: ``(dx, dweight, dbias, dresidual)`` of :func:`batch_norm` with
    statistics ``mean`` and ``var`` (the batch's in training mode, else the running
    ones). ``y`` is the forward's output (the ReLU's mask); ``dresidual`` is the
    gradient reaching the residual operand (the masked ``g``)."""
    g = np.asarray(g, np.float64)
    if relu:
        g = np.where(np.asarray(y) > 0, g, 0.0)
    x = np.asarray(x, np.float64)
    inv = 1.0 / np.sqrt(np.asarray(var, np.float64) + eps)
    xhat = (x - np.asarray(mean, np.float64)) * inv
    dbias = g.sum(axis=0)
    dweight = (g * xhat).sum(axis=0)
    n = x.shape[0]
    a, b = (dbias / n, dweight / n) if training else (0.0, 0.0)
    dx = np.asarray(weight, np.float64) * inv * (g - a - xhat * b)
    dt = np.asarray(y).dtype  # the features' dtype (x is float64 by now)
    pt = cv.compute_dtype(dt)  # the parameters' gradients: float32, float64 in a float64 model
    return dx.astype(dt), dweight.astype(pt), dbias.astype(pt), g.astype(dt)


@cuda.jit
def relu_backward_kernel(g, y, out):
    """One thread per value: ``g`` where the output ``y`` was positive, else 0."""
    t = cuda.grid(1)
    channels = g.shape[1]
    if t < g.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        out[i, c] = float32(g[i, c]) if y[i, c] > 0 else float32(0.0)


@cuda.jit
def batch_norm_backward_kernel(g, x, y, relu, scale, mean, inv_std, a, b, out):
    """One thread per value: ``dL/dx = scale * (g' - a - xhat * b)`` per channel, with
    ``g' = g * (y > 0)`` when ``relu``, ``xhat = (x - mean) * inv_std`` and
    ``scale = weight * inv_std`` (float32 arithmetic)."""
    t = cuda.grid(1)
    channels = g.shape[1]
    if t < g.shape[0] * channels:
        i = t // channels
        c = t - i * channels
        gv = float32(g[i, c])
        if relu and not y[i, c] > 0:
            gv = float32(0.0)
        xhat = (float32(x[i, c]) - mean[c]) * inv_std[c]
        out[i, c] = scale[c] * (gv - a[c] - xhat * b[c])


def relu_backward(g, y, backend=None):
    """``g * (y > 0)``: the gradient through a ReLU whose output was ``y``."""
    bk = resolve_backend(backend)
    _check_pair(g, y, "g", "y", backend=bk)
    if bk == "reference":
        return relu_backward_reference(to_host(g), to_host(y))
    gd = to_device(g)
    out = device_xp().empty(gd.shape, gd.dtype)
    launch(relu_backward_kernel, gd.size, gd, to_device(y), out)
    return out


def batch_norm_backward(g, x, y, weight, mean, var, eps=1e-5, relu=False, training=True, backend=None):
    """Gradients of :func:`batch_norm` (module section above): ``(dx, dweight, dbias,
    dresidual)``; ``dresidual`` is ``g`` after the ReLU's mask (what a residual
    operand receives), the others as named. ``mean``/``var``: the statistics the
    forward normalized with. The library's path is :func:`batch_norm_backward_v2`."""
    bk = resolve_backend(backend)
    _check_pair(g, x, "g", "x", backend=bk)
    _check_pair(g, y, "g", "y", backend=bk)
    c = g.shape[1]
    _check_channel_params(c, weight=weight, mean=mean, var=var)
    if bk == "reference":
        return batch_norm_backward_reference(to_host(g), to_host(x), to_host(y), to_host(weight),
                                             to_host(mean), to_host(var), eps, relu, training)
    return batch_norm_backward_v2(g, x, y, weight, mean, var, eps, relu, training)


def batch_norm_backward_v1(g, x, y, weight, mean, var, eps=1e-5, relu=False, training=True):
    """v1 of the backward's ladder: the formula above as array-library calls, one
    step each (the ReLU's mask, the two column sums as matrix-vector products, the
    per-channel divisions), then :func:`batch_norm_backward_kernel` for ``dx``.
    Plain to read, but about a dozen launches a layer and two temporaries the size
    of the features (``g`` in float32 and ``g * xhat``)."""
    xp = device_xp()
    gd, xd, yd = to_device(g), to_device(x), to_device(y)
    mean, var, weight = _f32(mean), _f32(var), _f32(weight)
    inv_std = (1.0 / xp.sqrt(var + np.float32(eps))).astype(np.float32)
    blocks = blocks_for(gd.size, THREADS)
    gm = gd  # the gradient past the ReLU
    if relu:
        gm = xp.empty(gd.shape, gd.dtype)
        relu_backward_kernel[blocks, THREADS](gd, yd, gm)
    gf = gm.astype(np.float32, copy=False)
    dbias = column_sums(gf)
    dweight = column_sums(gf * ((xd.astype(np.float32, copy=False) - mean) * inv_std))
    n = xd.shape[0]
    zero = xp.zeros_like(dbias)
    a, b = (dbias / np.float32(n), dweight / np.float32(n)) if training else (zero, zero)
    out = xp.empty(gd.shape, gd.dtype)
    batch_norm_backward_kernel[blocks, THREADS](gd, xd, yd, bool(relu), (weight * inv_std).astype(np.float32),
                                                mean, inv_std, a.astype(np.float32), b.astype(np.float32), out)
    return out, dweight, dbias, gm


# v2: two passes. Kernel A (:func:`batch_norm_backward_sums_v2`) reads g, x and y
# once and leaves, per block and channel, its share of sum(g') and sum(g' * xhat);
# kernel A2 (:func:`batch_norm_backward_total_v2`) adds the shares in a fixed order
# into a small float32 array ``sums`` = [sum g' (C) | sum g' * xhat (C) | N]; kernel B
# (:func:`batch_norm_backward_input_v2`) reads them back and writes dx (and the
# masked g, when a ReLU made one). Three launches in all and no temporary the size
# of the features. The layout of ``sums`` is what a synced BatchNorm all-reduces as
# it is: the row count rides along.
SUMS_THREADS = 256  # threads per block of kernel A (its shared-memory tile is this size)
SUMS_ROWS_PER_THREAD = 16  # rows each thread of kernel A adds up, at least (fewer blocks: shorter columns for A2)
SUMS_MAX_BLOCKS = 1024  # enough blocks to fill an H100/H200 (132 SMs, 8 such blocks each)


@cuda.jit(fastmath=True)
def batch_norm_backward_sums_v2(g, x, y, relu, mean, var, eps, tiles, partials):
    """Kernel A: each block's share of every channel's ``sum(g')`` and
    ``sum(g' * xhat)``, ``g' = g * (y > 0)`` when ``relu``, written to its row of
    ``partials`` (``[sums of g' (C) | sums of g' * xhat (C)]``).

    A block of :data:`SUMS_THREADS` threads is a grid of ``lanes`` rows by
    ``width = min(C, SUMS_THREADS)`` channels: thread ``t`` takes lane ``t // width``
    and channel ``t % width`` of its channel tile (block ``b`` takes tile
    ``b % tiles``). The lanes of a block cover ``lanes`` consecutive rows, so its
    threads read one contiguous stretch of memory, and each thread walks down its
    channel, ``lanes * blocks`` rows at a time, keeping its two sums in registers.
    Then the block adds its lanes together in shared memory (a tree: lane ``r``
    takes lane ``r + step``, step 1, 2, 4, ...; :func:`add_lanes_to_row`) and lane 0
    writes the block's two sums of its channel to the block's row of ``partials``;
    :func:`batch_norm_backward_total_v2` adds the rows.

    Why a second kernel and not one atomic add per block into the sums: float
    atomics add in whichever order the blocks finish, so the sums, and every weight
    trained from them, would differ in their last bits from run to run, and a
    training run resumed from a checkpoint could not repeat the uninterrupted run's
    losses. Adding the rows in a fixed order costs one tiny launch, which replaces
    the zeroing that atomics would have needed.
    """
    channels = g.shape[1]
    rows = g.shape[0]
    width = min(channels, SUMS_THREADS)
    lanes = SUMS_THREADS // width
    t = cuda.threadIdx.x
    lane = t // width
    tile = cuda.blockIdx.x % tiles
    c = tile * width + (t - lane * width)
    active = lane < lanes and c < channels  # the last few threads idle when width does not divide the block
    s_g = float32(0.0)
    s_gx = float32(0.0)
    if active:
        m = mean[c]
        inv_std = float32(1.0) / math.sqrt(var[c] + float32(eps))
        i = (cuda.blockIdx.x // tiles) * lanes + lane
        stride = (cuda.gridDim.x // tiles) * lanes
        while i < rows:
            gv = float32(g[i, c])
            if relu and not y[i, c] > 0:
                gv = float32(0.0)
            s_g += gv
            s_gx += gv * (float32(x[i, c]) - m)
            i += stride
        s_gx *= inv_std  # sum(g' * (x - mean)) * inv_std = sum(g' * xhat): one multiply, not one a row
    part = cuda.shared.array((2, SUMS_THREADS), float32)
    add_lanes_to_row(part, s_g, s_gx, t, lane, lanes, width, c, channels, cuda.blockIdx.x // tiles, partials)


@cuda.jit(device=True)
def add_lanes_to_row(part, s0, s1, t, lane, lanes, width, c, channels, row, partials):
    """The end of every column-sum kernel here (kernel A, kernel S): the block's
    threads put their two sums in ``part`` (shared, 2 x SUMS_THREADS), add the lanes
    pairwise in a tree (lane ``r`` takes lane ``r + step``, step 1, 2, 4, ...), and
    lane 0 writes its channel's two totals to row ``row`` of ``partials``."""
    part[0, t] = s0
    part[1, t] = s1
    cuda.syncthreads()
    step = 1
    while step < lanes:  # the same count in every thread: each reaches every syncthreads
        if lane % (2 * step) == 0 and lane + step < lanes:
            part[0, t] += part[0, t + step * width]
            part[1, t] += part[1, t + step * width]
        cuda.syncthreads()
        step *= 2
    if lane == 0 and c < channels:
        partials[row, c] = part[0, t]
        partials[row, channels + c] = part[1, t]


@cuda.jit
def batch_norm_backward_total_v2(partials, rows, sums):
    """Kernel A2: ``sums[j]`` = the column ``j`` of ``partials`` added top to bottom
    (one thread a column, a fixed order: the same bits every run), and the row count
    after the ``2 C`` sums (exact up to 2**24 rows)."""
    j = cuda.grid(1)
    if j < partials.shape[1]:
        s = float32(0.0)
        for r in range(partials.shape[0]):
            s += partials[r, j]
        sums[j] = s
    if j == 0:
        sums[partials.shape[1]] = float32(rows)


@cached
def batch_norm_backward_input_v2(channels: int):
    """Kernel B, compiled for one channel count with fast math (as :func:`batch_norm_v2`):
    one thread per value, ``dx = weight * inv_std * (g' - a - xhat * b)`` with ``a =
    sums[c] / N`` and ``b = sums[C + c] / N`` read from kernel A's ``sums`` in training
    mode (0 at inference), and ``inv_std`` computed here (a root per value is cheaper
    than a launch). When ``write_masked``, also writes ``g'`` into ``masked``."""
    C = np.uint64(channels)

    @cuda.jit(fastmath=True)
    def batch_norm_backward_input_v2_kernel(g, x, y, relu, weight, mean, var, eps, sums, training, out, masked,
                                            write_masked):
        t = uint64(cuda.grid(1))
        if t < uint64(g.shape[0]) * C:
            i = t // C
            c = t - i * C
            gv = float32(g[i, c])
            if relu and not y[i, c] > 0:
                gv = float32(0.0)
            if write_masked:
                masked[i, c] = gv
            inv_std = float32(1.0) / math.sqrt(var[c] + float32(eps))
            xhat = (float32(x[i, c]) - mean[c]) * inv_std
            v = gv
            if training:
                n = sums[uint64(2) * C]
                v = gv - sums[c] / n - xhat * (sums[C + c] / n)
            out[i, c] = weight[c] * inv_std * v

    return batch_norm_backward_input_v2_kernel


def batch_norm_backward_sums(g, x, y, mean, var, eps=1e-5, relu=False):
    """Step A of :func:`batch_norm_backward_v2` on device arrays: a new float32 array
    ``[sum g' (C) | sum g' * xhat (C) | N]`` (``dbias``, ``dweight`` and the row
    count). A synced BatchNorm all-reduces it between steps A and B."""
    gd = to_device(g)
    n, c = gd.shape
    xp = device_xp()
    if n == 0:
        return xp.zeros(2 * c + 1, np.float32)
    return column_sums_and_total(batch_norm_backward_sums_v2, n, c, gd, to_device(x), to_device(y), bool(relu),
                                 _f32(mean), _f32(var), float(eps))


def column_sums_and_total(kernel, n, c, *args):
    """Launch a column-sum kernel shaped as kernel A over ``n`` rows and ``c`` channels
    (its arguments ``args``, then ``tiles`` and ``partials``), then kernel A2: a new
    float32 array ``[C sums | C sums | N]``."""
    xp = device_xp()
    width = min(c, SUMS_THREADS)
    tiles = -(-c // width)
    lanes = SUMS_THREADS // width
    per_block = lanes * SUMS_ROWS_PER_THREAD
    groups = max(1, min(-(-n // per_block), SUMS_MAX_BLOCKS // tiles))  # blocks down the rows
    partials = xp.empty((groups, 2 * c), np.float32)  # every entry written by the kernel
    sums = xp.empty(2 * c + 1, np.float32)
    launch(kernel, 1, *args, tiles, partials, threads=SUMS_THREADS, blocks=tiles * groups)
    launch(batch_norm_backward_total_v2, 2 * c, partials, n, sums)
    return sums


def batch_norm_backward_input(g, x, y, weight, mean, var, eps, relu, sums, training=True):
    """Step B of :func:`batch_norm_backward_v2` on device arrays: ``(dx, dresidual)``
    from ``sums`` (step A's, or their all-reduce over ranks). ``dresidual`` is the
    masked ``g`` when ``relu`` (written by the same kernel), else ``g`` itself."""
    gd = to_device(g)
    out = device_xp().empty(gd.shape, gd.dtype)
    # without a ReLU, g is its own masked gradient: g stands in for ``masked``, never
    # written (not ``out``: the simulator copies each array argument back after the
    # kernel, so an unwritten alias of ``out`` would overwrite it)
    masked = device_xp().empty(gd.shape, gd.dtype) if relu else gd
    launch(batch_norm_backward_input_v2(gd.shape[1]), gd.size, gd, to_device(x), to_device(y), bool(relu),
           _f32(weight), _f32(mean), _f32(var), float(eps), sums, bool(training), out, masked, bool(relu))
    return out, masked


def batch_norm_backward_v2(g, x, y, weight, mean, var, eps=1e-5, relu=False, training=True):
    """v2 of the backward's ladder (the library's): step A, the two per-channel sums in
    one pass (:func:`batch_norm_backward_sums`), then step B, the input gradient
    (:func:`batch_norm_backward_input`). ``dbias`` and ``dweight`` are views into A's
    ``sums``."""
    sums = batch_norm_backward_sums(g, x, y, mean, var, eps, relu)
    c = sums.shape[0] // 2
    dx, dres = batch_norm_backward_input(g, x, y, weight, mean, var, eps, relu, sums, training)
    return dx, sums[c:2 * c], sums[:c], dres


# Training-mode statistics in the same shape: kernel S (:func:`batch_statistics_sums`,
# kernel A's walk with other sums) leaves each block's share of ``sum(x - m)`` and
# ``sum((x - m)^2)`` for a given per-channel ``m``; kernel A2 adds the shares in a
# fixed order. Pass 1 with m = 0 gives the column sums, so the mean; pass 2 with that
# mean gives the squared deviations (and their plain sum, which would be zero but for
# the mean's rounding: the classic correction ``var = E[d^2] - E[d]^2`` uses it). One
# tiny kernel then writes the variance and the running averages.
@cuda.jit(fastmath=True)
def batch_statistics_sums(x, mean, tiles, partials):
    """Kernel S: each block's share of every channel's ``sum(x - mean)`` and
    ``sum((x - mean)^2)`` in its row of ``partials`` (``[C sums | C sums of squares]``),
    the threads laid out as in :func:`batch_norm_backward_sums_v2`."""
    channels = x.shape[1]
    rows = x.shape[0]
    width = min(channels, SUMS_THREADS)
    lanes = SUMS_THREADS // width
    t = cuda.threadIdx.x
    lane = t // width
    tile = cuda.blockIdx.x % tiles
    c = tile * width + (t - lane * width)
    active = lane < lanes and c < channels
    s_d = float32(0.0)
    s_dd = float32(0.0)
    if active:
        m = mean[c]
        i = (cuda.blockIdx.x // tiles) * lanes + lane
        stride = (cuda.gridDim.x // tiles) * lanes
        while i < rows:
            d = float32(x[i, c]) - m
            s_d += d
            s_dd += d * d
            i += stride
    part = cuda.shared.array((2, SUMS_THREADS), float32)
    add_lanes_to_row(part, s_d, s_dd, t, lane, lanes, width, c, channels, cuda.blockIdx.x // tiles, partials)


@cuda.jit
def column_means_kernel(sums, mean):
    """``mean[c] = sums[c] / N``, N the row count kernel A2 writes after the ``2 C`` sums."""
    c = cuda.grid(1)
    if c < mean.shape[0]:
        mean[c] = sums[c] / sums[2 * mean.shape[0]]


@cuda.jit
def batch_statistics_finish_kernel(sums, mean0, momentum, running_mean, running_var, batch_mean, batch_var,
                                   running_mean_out, running_var_out):
    """From pass 2's ``sums`` (deviations from ``mean``, their squares, N): the mean
    (``mean0``, pass 1's) corrected by the deviations' own mean, the biased variance ``E[d^2] - E[d]^2``,
    and the running averages ``(1 - m) r + m s`` with the unbiased variance, as
    PyTorch updates them."""
    c = cuda.grid(1)
    C = mean0.shape[0]
    if c < C:
        n = sums[2 * C]
        e_d = sums[c] / n
        v = max(sums[C + c] / n - e_d * e_d, float32(0.0))
        m = mean0[c] + e_d
        batch_mean[c] = m
        batch_var[c] = v
        unbiased = v * (n / max(n - float32(1.0), float32(1.0)))
        keep = float32(1.0) - momentum
        running_mean_out[c] = keep * running_mean[c] + momentum * m
        running_var_out[c] = keep * running_var[c] + momentum * unbiased


def _statistics_pass(xd, mean):
    """Kernels S and A2: ``[sum(x - mean) (C) | sum((x - mean)^2) (C) | N]``, float32."""
    return column_sums_and_total(batch_statistics_sums, *xd.shape, xd, mean)


_ZEROS = remember({})


def _zeros(c):
    """A float32 zero array of ``c`` on the device, made once per channel count and device."""
    xp = device_xp()
    key = (c, None if xp is np else xp.cuda.runtime.getDevice())
    if key not in _ZEROS:
        _ZEROS[key] = xp.zeros(c, np.float32)
    return _ZEROS[key]


def batch_statistics_update(x, running_mean, running_var, momentum):
    """Training-mode BatchNorm's statistics of ``x`` (N >= 1, C) on the device:
    ``(mean, var, new running mean, new running var)``, all float32 (C,), the variance
    biased (what normalizes), the running one updated with the unbiased variance.
    Six launches, no temporary the size of ``x``, the same bits every run;
    :func:`batch_statistics` is the array library's version (and the reference's)."""
    xd = to_device(x)
    c = xd.shape[1]
    xp = device_xp()
    first = _statistics_pass(xd, _zeros(c))  # [sum x | sum x^2 | N]
    mean0 = xp.empty(c, np.float32)
    launch(column_means_kernel, c, first, mean0)
    second = _statistics_pass(xd, mean0)  # deviations from that mean
    mean, var, new_mean, new_var = (xp.empty(c, np.float32) for _ in range(4))
    launch(batch_statistics_finish_kernel, c, second, mean0, float(momentum), _f32(running_mean),
           _f32(running_var), mean, var, new_mean, new_var)
    return mean, var, new_mean, new_var


# -------------------------------------------------------------------- the ladder
# BatchNorm's (the pointwise kernel that runs after every convolution): inference
# BatchNorm, a residual added and ReLU, in one pass.
def _ladder_work(ctx):
    """Features and a residual (N, C) in the context's dtype, and BatchNorm's
    per-channel weight, bias, running mean and running variance (float32)."""
    n, c = len(ctx.coords), ctx.channels

    def stats():
        rng = ctx.rng("batch_norm")
        return [to_device(v.astype(np.float32)) for v in (rng.uniform(0.5, 1.5, c), rng.normal(0, 0.2, c),
                                                          rng.normal(0, 0.2, c), rng.uniform(0.5, 2, c))]

    return {"features": ctx.normal("features", (n, c)), "residual": ctx.normal("residual", (n, c)),
            "bn": ctx.memo(("batch_norm", c, ctx.seed), stats)}


def _rung(name, adds):
    return Rung(name, lambda w: batch_norm_rung(name, w["features"], *w["bn"], 1e-5, w["residual"], True), adds)


LADDER = Ladder(
    "pointwise",
    (_rung("v1", "BatchNorm, residual add and ReLU in one pass, one thread per value"),
     _rung("v2", "+ the channel count compiled in, fast math (the library's)")),
    operation="batch_norm",  # the rungs climb one operation of this module: batch_norm_v1, _v2
    workload=_ladder_work,
    reference=lambda w: batch_norm_reference(to_host(w["features"]), *[to_host(v) for v in w["bn"]], 1e-5,
                                             to_host(w["residual"]), True),
    # at least: the features, the residual and the 4 per-channel statistics read once, the output written once
    bytes_moved=lambda w: 2 * w["features"].nbytes + w["residual"].nbytes + sum(v.nbytes for v in w["bn"]),
    # the GPU fuses a multiply and an add (and v2 approximates the root and the
    # division): a float32 ulp or two, which may move a fp16 rounding by one ulp
    tolerance={"float32": 4e-6, "float16": 2e-3},
)


# BatchNorm's backward in training mode, with the ReLU's mask (the training step
# runs it after every convolution). Declared beside the module's ``LADDER`` (the
# forward's), and found by the ladder tool as that one is (``numba-sc ladder
# batch_norm_backward``): the rungs are host functions, v1 about a dozen launches, v2 three.
def _backward_work(ctx):
    """The forward's workload plus ``g`` (N, C) and the forward's output ``y`` (its
    ReLU's mask), with the batch's own statistics, as in training."""
    w = _ladder_work(ctx)
    x = w["features"]
    weight, bias = w["bn"][0], w["bn"][1]
    mean, var = batch_statistics(x)
    y = batch_norm_rung("v2", x, weight, bias, mean, var, 1e-5, w["residual"], True)
    return dict(w, g=ctx.normal("grad", x.shape), y=y, stats=(mean.astype(np.float32), var.astype(np.float32)))


def _backward_rung(name, fn, adds):
    return Rung(name, lambda w: fn(w["g"], w["features"], w["y"], w["bn"][0], *w["stats"], 1e-5, True, True), adds)


BACKWARD_LADDER = Ladder(
    "batch_norm_backward",
    (_backward_rung("v1", batch_norm_backward_v1, "array-library steps and one kernel for dx (~12 launches)"),
     _backward_rung("v2", batch_norm_backward_v2, "the sums in one pass, dx in one kernel (3 launches)")),
    workload=_backward_work,
    reference=lambda w: batch_norm_backward_reference(*[to_host(w[k]) for k in ("g", "features", "y")],
                                                      to_host(w["bn"][0]), *[to_host(s) for s in w["stats"]],
                                                      1e-5, True, True)[0],
    collect=lambda res: to_host(res[0]),  # dx: in training mode it reads both sums
    # at least: g, x and y read once (a cache would keep them from the sums' pass to dx's), the weight and
    # the batch's statistics; dx written, with the weight's and the bias's gradients (C float32 each)
    bytes_moved=lambda w: (sum(w[k].nbytes for k in ("g", "features", "y")) + w["bn"][0].nbytes
                           + sum(s.nbytes for s in w["stats"]) + w["features"].nbytes + 2 * w["bn"][0].nbytes),
    # float32 arithmetic against float64, the sums in another order; half: one rounding
    tolerance={"float32": 2e-5, "float16": 2e-3},
)
