"""Training a sparse network by hand: forward, loss, backward, update, and nothing hidden.

One step is four calls, each a module of this library::

    with nn.Tape() as tape:                      # record each layer's backward (numba_sc.nn.tape)
        y = model(x)                             # forward, BatchNorm on the batch's statistics
    loss, g = cross_entropy(y.features, target)  # the loss and dL/dy (numba_sc.train.loss)
    grads = tape.backward(y, g)                  # every layer's backward kernels, last to first
    optimizer.step(grads)                        # SGD or AdamW, in place (numba_sc.train.optim)

:func:`fit_scan` runs that loop on one labelled scan, the way a student
checks a new backward pass: a network that can drive the loss on one scan
towards zero (point accuracy and mIoU near 1) has gradients that point the
right way. It is an overfitting demonstration, not a training recipe: nothing
here generalizes to other scans, and no number it prints is a benchmark
result on SemanticKITTI.

The voxel features are the mean of the points' (x, y, z, remission) in each
voxel, with x, y, z centred and scaled to unit spread; a voxel's label is the
majority of its points' labels (:func:`numba_sc.train.labels.voxel_labels`), and
the scores are on the points, each taking its voxel's prediction.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from . import labels as lb
from ..nn.tape import Tape
from ..core.device import gpu_present, simulating
from ..core.progress import bar
from ..core.backend import resolve_backend, to_device, to_host
from ..core.conventions import check_finite_points, whole_number
from .loss import cross_entropy
from ..core.tensor import SparseTensor
from ..coords.voxelization import voxelize

log = logging.getLogger(__name__)


def train_step(model, x, target, optimizer, backend=None, weight=None):
    """One step (module docstring) on a :class:`SparseTensor` ``x`` with ``target`` (one
    class id per row of the output, ignore index 255). Returns the loss (float)."""
    model.train()
    with Tape() as tape:
        y = model(x, backend=backend)
    loss, g = cross_entropy(y.features, target, weight=weight, backend=backend)
    optimizer.step(tape.backward(y, g))
    return loss


def predict(model, x, backend=None):
    """The class of each output row at inference (``model.eval()``, running statistics)."""
    model.eval()
    y = model(x, backend=backend)
    return np.asarray(to_host(y.features)).argmax(axis=1)


def scan_tensor(points, raw_labels, voxel_size=0.05, backend=None):
    """A labelled scan as training data: ``(x, voxel_target, inverse, point_target)``.

    ``points`` (N, 4) x, y, z, remission; ``raw_labels`` (N,) SemanticKITTI's raw
    label words. ``x`` holds one row per voxel, its features the voxel's mean of
    (centred, scaled x, y, z, remission)."""
    points = np.asarray(points, np.float32)
    if points.ndim != 2 or points.shape[1] != 4:
        raise ValueError(f"points must be (N, 4): x, y, z, remission, got {points.shape}")
    point_target = lb.learning_map(raw_labels)
    if point_target.shape != (len(points),):
        raise ValueError(f"raw_labels must have one label per point ({len(points)}), got {point_target.shape}")
    xyz = points[:, :3]
    feats = np.concatenate([(xyz - xyz.mean(axis=0)) / xyz.std(axis=0).clip(1e-6), points[:, 3:4]], axis=1)
    v = voxelize(np.ascontiguousarray(xyz), voxel_size, features=feats.astype(np.float32), backend="reference")
    target = lb.voxel_labels(point_target, v.inverse, lb.NUM_CLASSES, num_voxels=len(v))
    coords, f = v.coords, v.features
    if resolve_backend(backend) == "cuda" and gpu_present() and not simulating():
        coords, f, target = to_device(coords), to_device(f), to_device(target)
    return SparseTensor(coords, f), target, v.inverse, point_target


def scores(model, x, inverse, point_target, backend=None):
    """Point accuracy and mIoU of the model's voxel predictions, carried to the points."""
    pred = predict(model, x, backend)[np.asarray(inverse)]
    cm = lb.confusion_matrix(pred, point_target, lb.NUM_CLASSES)
    return lb.accuracy(cm), lb.miou(cm)


def checkerboard(points, size=10.0):
    """The squares of a checkerboard of ``size`` metres on the ground plane: True for the
    points whose square has ``floor(x / size) + floor(y / size)`` even, False for the
    others. Training on one colour and scoring on the other measures whether a network
    generalizes to ground it has not seen; unlike a split at x = 0, both colours hold
    the same mix of classes (road, building, vegetation, cars ...). A point with NaN or
    inf has no square and is refused, not put on either colour."""
    points = np.asarray(to_host(points))
    if points.ndim != 2 or points.shape[1] < 2:
        raise ValueError(f"points must be (N, 2 or more) with x, y first, got {points.shape}")
    if not np.issubdtype(points.dtype, np.number):
        raise TypeError(f"points must be a numeric array, got {points.dtype}")
    check_finite_points(points)
    if not (isinstance(size, (int, float, np.floating, np.integer)) and np.isfinite(size) and size > 0):
        raise ValueError(f"size must be a positive number of metres, got {size!r}")
    cells = np.floor(points[:, :2].astype(np.float64) / size).astype(np.int64)
    return (cells.sum(axis=1) % 2) == 0


def evaluate(pred, point_target, classes=None, num_classes=lb.NUM_CLASSES):
    """Scores of point predictions ``pred`` against ``point_target`` (ignore index 255
    left out): ``{"accuracy", "miou", "iou": {class name: IoU}, "confusion"}``.

    ``classes`` (int ids in ``[0, num_classes)``, each once): the classes the mIoU
    averages over, e.g. those present in both the training and the evaluated points;
    default: every class. Either way a class absent from both the targets and the
    predictions is left out of the mean (:func:`numba_sc.train.labels.miou`)."""
    cm = lb.confusion_matrix(pred, point_target, num_classes)
    per_class = lb.iou(cm)
    m = lb.miou(cm, classes)
    names = lb.CLASS_NAMES if num_classes == lb.NUM_CLASSES else [str(c) for c in range(num_classes)]
    return {"accuracy": lb.accuracy(cm), "miou": m,
            "iou": {names[c]: (None if np.isnan(v) else float(v)) for c, v in enumerate(per_class)},
            "confusion": cm}


def iou_table(results: dict, classes=None) -> str:
    """A plain-text table of per-class IoU, one column per entry of ``results``
    (name -> :func:`evaluate`'s result), then the accuracy and the mIoU."""
    names = list(results)
    if not names:
        raise ValueError("results is empty: give at least one {name: evaluate(...)} entry")
    first = results[names[0]]["iou"]
    keep = set(range(len(first)) if classes is None else lb.check_classes(classes, len(first)))
    rows = [c for i, c in enumerate(first) if i in keep]
    w = max(len(r) for r in rows + ["point accuracy"])
    lines = [f"{'class':{w}s}  " + "  ".join(f"{n:>12s}" for n in names)]
    for r in rows:
        cells = [results[n]["iou"][r] for n in names]
        lines.append(f"{r:{w}s}  " + "  ".join(f"{'-' if v is None else f'{v:.3f}':>12s}" for v in cells))
    lines.append(f"{'point accuracy':{w}s}  " + "  ".join(f"{results[n]['accuracy']:12.3f}" for n in names))
    lines.append(f"{'mIoU':{w}s}  " + "  ".join(f"{results[n]['miou']:12.3f}" for n in names))
    return "\n".join(lines)


def fit_scan(model, optimizer, x, target, inverse, point_target, steps, backend=None, schedule=None,
             log_every=10):
    """Train ``model`` on one scan for ``steps`` steps; returns the history: one dict
    per logged step with the loss, the point accuracy and mIoU (at inference), and
    the seconds since the start. ``schedule(step) -> lr``, optional.

    A progress bar over the steps (ETA, last loss) is drawn on stderr where bars are
    on (:mod:`numba_sc.core.progress`); each logged step's line goes to this module's
    logger at INFO (``numba-sc train overfit`` shows it; ``-q`` hides it)."""
    steps, log_every = whole_number(steps, "steps", 1), whole_number(log_every, "log_every", 1)
    history = []
    t0 = time.perf_counter()
    with bar(range(steps), desc="overfit", unit="step") as progress:
        for step in progress:
            if schedule is not None:
                optimizer.lr = schedule(step)
            loss = train_step(model, x, target, optimizer, backend)
            progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if step % log_every == 0 or step == steps - 1:
                acc, miou = scores(model, x, inverse, point_target, backend)
                rec = {"step": step, "loss": float(loss), "accuracy": acc, "miou": miou,
                       "seconds": time.perf_counter() - t0}
                history.append(rec)
                log.info("step %4d  loss %.4f  point accuracy %.3f  mIoU %.3f  (%.1f s)", step, loss, acc, miou,
                         rec["seconds"])
    return history
