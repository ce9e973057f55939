"""Cross-entropy over points or voxels: the loss and its gradient, in one kernel.

A segmentation network ends with ``C`` *logits* per point (or voxel), one per
class: unnormalized scores. Softmax turns a row into probabilities,
``p_c = exp(x_c) / sum_k exp(x_k)``, and the loss of a row whose true class is
``t`` is the negative log-probability of that class::

    nll = -log p_t = log(sum_k exp(x_k)) - x_t          ("log-sum-exp minus the target's logit")

The loss of a scan is the mean over its labelled rows; rows whose target is
``ignore_index`` (255: unlabeled points, see :mod:`numba_sc.train.labels`) count for
nothing. The gradient of the mean with respect to the logits is, row by row,
the simplest in deep learning::

    d loss / d x_c = (p_c - [c == t]) / n_valid        for a labelled row, 0 for an ignored one

(the probabilities, minus one at the true class). A row sums to zero: pushing
the true class up pushes the others down by as much.

Worked example, ``C = 3``, three rows, the last one ignored::

    logits          target   softmax                   nll
    [2, 1, 0]       0        [0.665, 0.245, 0.090]     log(1 + e^-1 + e^-2) = 0.408
    [0, 0, 3]       1        [0.045, 0.045, 0.909]     3 + log(1.100) - 0   = 3.095
    [5, 5, 5]       255      (ignored)
    loss = (0.408 + 3.095) / 2 = 1.751
    grad = [[-0.167, 0.122, 0.045], [0.023, -0.477, 0.455], [0, 0, 0]]     (softmax - onehot) / 2

**Numerically stable.** ``exp(x)`` overflows float32 above x ~ 88, and logits
of a confident network get there. Softmax does not change when a constant is
subtracted from the whole row, so every row subtracts its maximum ``m`` first:
``log sum exp(x_k) = m + log sum exp(x_k - m)``, where every exponent is <= 0
and the sum is between 1 and C. The arithmetic is float32 also for float16
logits (each value widened when read, the gradient rounded when written).

**Class weights** (``weight``, one per class, as PyTorch's ``weight``
argument): a row of class ``t`` counts ``w_t`` times, and the mean becomes a
weighted mean, ``loss = sum_i w_ti * nll_i / sum_i w_ti`` over labelled rows,
with gradient rows ``w_t * (p - onehot) / sum_i w_ti``. Rare classes
(bicyclists) get larger weights so that the road does not drown them out.

The kernel (:func:`cross_entropy_kernel`) gives one thread to one row; the
per-row losses it writes are summed by the array library. ``cross_entropy``
returns the loss as a Python float and the gradient as an array of the logits'
kind (NumPy or CuPy) and dtype. The input checks (target values, finite logits,
something labelled) and the loss itself are each one small read to the host.

Napkin math: SemanticKITTI at 5 cm is 94k voxels x 19 classes: 7 MB of float32
logits read, 7 MB of gradient written, ~5 us at the H100's ~3 TB/s (typed: napkin math),
less than the launches and reads around it cost the host.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ..core.device import device_xp
from ..core import conventions as cv
from .labels import IGNORE_INDEX  # (one place: SemanticKITTI's unscored label)
from ..core.backend import like, resolve_backend, to_device, to_host
from ..core.launch import launch



# ------------------------------------------------------------------ checks
def _check_shapes(logits, target, weight):
    if not hasattr(logits, "shape") or not hasattr(logits, "dtype"):
        raise TypeError(f"logits must be a NumPy or CuPy array, got {type(logits).__name__}")
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape (N, C), one row of class scores per point, "
                         f"got {tuple(logits.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("logits has no rows: a loss over no points is undefined (an empty batch or "
                         "an empty crop? skip it before the forward pass)")
    if np.dtype(logits.dtype) not in cv.REFERENCE_DTYPES:
        raise TypeError(f"logits must be float32 or float16 (or float64 on backend='reference'), got "
                        f"{logits.dtype}")
    if not hasattr(target, "shape") or tuple(target.shape) != (logits.shape[0],):
        shape = tuple(target.shape) if hasattr(target, "shape") else type(target).__name__
        raise ValueError(f"target must have shape ({logits.shape[0]},), one class per row of logits, got {shape}")
    if not np.issubdtype(np.dtype(target.dtype), np.integer):
        raise TypeError(f"target must be an integer array of class ids, got {target.dtype}")
    if weight is not None:
        c = logits.shape[1]
        if not hasattr(weight, "shape") or tuple(weight.shape) != (c,):
            shape = tuple(weight.shape) if hasattr(weight, "shape") else type(weight).__name__
            raise ValueError(f"weight must have shape ({c},), one value per class, got {shape}")
        w = np.asarray(to_host(weight), np.float64)
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise ValueError(f"weight must be finite and >= 0, got {w.tolist()}")


def _check_values(xp, logits, target, weight, ignore_index):
    """Target values, finite logits, something labelled: checked on the arrays' own side
    with one read to the host. Returns the total weight of the labelled rows (their
    count when there are no class weights)."""
    c = logits.shape[1]
    labelled = target != ignore_index
    bad = labelled & ((target < 0) | (target >= c))
    good = labelled & ~bad
    nonfinite = ~xp.isfinite(logits).all(axis=1)
    w = xp.where(good, weight[xp.where(good, target, 0)].astype(np.float64), 0.0)
    n_bad, n_nonfinite, n_labelled, total = to_host(xp.stack(
        [bad.sum(), nonfinite.sum(), good.sum(), w.sum()]).astype(np.float64)).tolist()
    if n_bad:
        values = to_host(xp.unique(target[bad]))[:10].tolist()
        raise ValueError(f"target has values {values} ({int(n_bad)} rows) that are neither a class in "
                         f"[0, {c}) nor ignore_index={ignore_index}: map raw labels first "
                         "(numba_sc.train.labels.learning_map)")
    if n_nonfinite:
        first = int(to_host(xp.argmax(nonfinite)))
        raise FloatingPointError(f"logits have NaN or inf in {int(n_nonfinite)} rows (the first: row {first}): "
                                 "the network has diverged (a smaller learning rate?)")
    if not n_labelled:
        raise ValueError(f"every row of target is ignore_index={ignore_index}: no labelled point to learn "
                         "from (skip this batch)")
    if total <= 0:
        raise ValueError("the class weights of the labelled rows sum to 0: the loss would be 0 / 0")
    return total


# ------------------------------------------------------------------ reference
def cross_entropy_reference(logits, target, ignore_index=IGNORE_INDEX, weight=None):
    """NumPy: ``(loss, grad_logits)``, the (weighted) mean negative log-softmax of
    the target over the rows not ``ignore_index``, and its gradient.

    The arithmetic is float32 for float16 or float32 logits, float64 for float64
    ones (the tests differentiate it numerically); the gradient is rounded to
    the logits' dtype. ``target`` values must be classes or ``ignore_index``.
    """
    x = np.asarray(to_host(logits))
    dtype = np.promote_types(x.dtype, np.float32)
    x = x.astype(dtype)
    n, c = x.shape
    t = np.asarray(to_host(target)).astype(np.int64)
    w = np.ones(c, dtype) if weight is None else np.asarray(to_host(weight)).astype(dtype)
    labelled = t != ignore_index
    rows, cls = np.arange(n), np.where(labelled, t, 0)
    wt = np.where(labelled, w[cls], dtype.type(0))      # each row's weight, 0 when ignored
    m = x.max(axis=1, keepdims=True)                     # subtract the row's maximum: exp(.) <= 1
    e = np.exp(x - m)
    s = e.sum(axis=1, keepdims=True)
    nll = (m[:, 0] + np.log(s[:, 0])) - x[rows, cls]     # log-sum-exp minus the target's logit
    total = wt.sum(dtype=np.float64)
    loss = float(np.sum(wt * nll, dtype=np.float64) / total)
    grad = e / s                                         # softmax
    grad[rows, cls] -= 1                                 # minus the one-hot target
    grad *= (wt / dtype.type(total))[:, None]            # weighted, averaged; 0 for ignored rows
    return loss, grad.astype(np.asarray(to_host(logits)).dtype)


# -------------------------------------------------------------------- kernel
@cuda.jit
def cross_entropy_kernel(logits, target, weight, ignore_index, inv_total, losses, grad):
    """One thread per row ``i``: the row's maximum, its sum of exponentials, its
    loss term ``w_t * (m + log s - x_t)`` into ``losses[i]``, and its gradient row
    ``w_t * (softmax - onehot) * inv_total`` (all zero for an ignored row).

    Why one thread per row and not a warp or a block: C is small (19 for
    SemanticKITTI), so a row is a few dozen bytes and three short loops; a warp
    per row would leave 13 of its 32 lanes idle and need shuffles for the max
    and the sum. With ~100k rows one thread each still gives the GPU enough
    threads to hide memory latency. The three passes over a row read the same
    few cache lines; only the first comes from memory.
    """
    i = cuda.grid(1)
    if i < logits.shape[0]:
        num_classes = logits.shape[1]
        t = target[i]
        if t == ignore_index:
            losses[i] = float32(0.0)
            for c in range(num_classes):
                grad[i, c] = float32(0.0)
        else:
            m = float32(logits[i, 0])
            for c in range(1, num_classes):
                m = max(m, float32(logits[i, c]))
            s = float32(0.0)
            for c in range(num_classes):
                s += math.exp(float32(logits[i, c]) - m)
            w = weight[t]
            losses[i] = w * (m + math.log(s) - float32(logits[i, t]))
            scale = w * inv_total
            for c in range(num_classes):
                p = math.exp(float32(logits[i, c]) - m) / s
                if c == t:
                    p -= float32(1.0)
                grad[i, c] = p * scale  # (the store rounds to float16 for half-precision logits)


# ------------------------------------------------------------------ launcher
def cross_entropy(logits, target, ignore_index=IGNORE_INDEX, weight=None, backend=None):
    """Cross-entropy of ``logits`` (N, C) against ``target`` (N,) and its gradient.

    Returns ``(loss, grad_logits)``: ``loss`` a Python float, the mean over the
    rows whose target is not ``ignore_index`` of ``-log softmax(logits)[target]``
    (weighted by ``weight[target]`` when class weights are given, as PyTorch's
    ``cross_entropy``); ``grad_logits`` the gradient of that loss, the shape,
    dtype and kind (NumPy or CuPy) of ``logits``, zero on ignored rows.

    ``logits`` are float32 or float16 (or float64, the oracle's, on
    ``backend="reference"``, computed in float64); ``target`` any integer dtype, every value
    a class in ``[0, C)`` or ``ignore_index``; ``weight`` (C,) >= 0. NaN or inf
    logits, and a target with no labelled row, are refused.

    A note for float16: the gradient is ``(p - onehot) / n``, and with ~100k
    labelled rows most of its values are below float16's smallest normal number
    (6e-5), where only a few bits of precision remain. Pass float32 logits
    (``logits.astype(np.float32)``) to get a float32 gradient when that matters.
    """
    _check_shapes(logits, target, weight)
    if not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    c = logits.shape[1]
    bk = resolve_backend(backend)
    cv.check_backend_dtype(logits.dtype, bk, "logits")
    if bk == "reference":
        x, t = to_host(logits), to_host(target).astype(np.int64)
        ct = cv.compute_dtype(x.dtype)  # float32, or float64 for the oracle's float64 logits
        w = np.ones(c, ct) if weight is None else np.asarray(to_host(weight), ct)
        _check_values(np, x, t, w, ignore_index)
        loss, grad = cross_entropy_reference(x, t, ignore_index, w)
        return loss, like(grad, logits)
    xp = device_xp()
    x = to_device(logits)
    t = to_device(target)
    if t.dtype not in (np.int32, np.int64):
        t = t.astype(np.int64)
    w = xp.ones(c, np.float32) if weight is None else to_device(weight).astype(np.float32)
    total = _check_values(xp, x, t, w, ignore_index)
    n = x.shape[0]
    losses = xp.empty(n, np.float32)
    grad = xp.empty(x.shape, x.dtype)
    launch(cross_entropy_kernel, n, x, t, w, ignore_index, np.float32(1.0 / total), losses, grad)
    loss = float(to_host(losses.sum(dtype=np.float64))) / total
    return loss, like(grad, logits)
