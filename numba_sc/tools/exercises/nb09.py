"""Exercises of notebook 09, training: the loss's gradient, the split, and the score.

* 9.1 the gradient of the mean cross-entropy, ``(softmax - onehot) / n_labelled`` on
  the labelled rows and 0 on the ignored ones. The wrong answer divides by every row,
  ignored ones included: the gradient then shrinks with the share of unlabelled points;
* 9.2 the checkerboard split of a scan into squares on the ground. The wrong answer
  truncates ``x / size`` where it should floor it: the squares either side of an axis
  then merge into one double-width square of one colour;
* 9.3 per-class IoU from a confusion matrix, ``TP / (TP + FP + FN)``, NaN for a class
  that is neither in the targets nor in the predictions. The wrong answer divides by
  the row sum plus the column sum, which counts the true positives twice.

The inputs are random logits, random labellings, and a crop of the SemanticKITTI scan
moved to the origin (coordinates of both signs,
:func:`numba_sc.tools.exercises.nb01.scan_crop`); the references are the library's.
"""
from __future__ import annotations

import numpy as np

from . import ExerciseFailed, exercise, expect_equal
from .inputs import scan_crop

IGNORE = 255  # SemanticKITTI's unscored label (numba_sc.train.labels.IGNORE_INDEX)


# -- 9.1 ------------------------------------------------------------------------------

def _grad_over_all_rows(logits, target):
    """Wrong: the mean over every row, ignored rows included."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    labelled = np.asarray(target) != IGNORE
    rows = np.flatnonzero(labelled)
    p[rows, np.asarray(target)[rows]] -= 1
    p[~labelled] = 0
    return p / len(x)


@exercise("9.1", "the gradient of the cross-entropy", answer="cross_entropy_grad", wrong=_grad_over_all_rows)
def check_cross_entropy_grad(cross_entropy_grad):
    """``cross_entropy_grad(logits, target)`` on random logits of 19 classes with a third
    of the rows unlabelled (255), against :func:`numba_sc.train.loss.cross_entropy_reference`."""
    from ...train.loss import cross_entropy_reference

    rng = np.random.default_rng(91)
    for n in (7, 60):
        logits = (rng.normal(size=(n, 19)) * 3).astype(np.float32)
        target = rng.integers(0, 19, n)
        target[rng.random(n) < 1 / 3] = IGNORE
        target[0] = 4  # at least one labelled row
        _, expected = cross_entropy_reference(logits.astype(np.float64), target)
        got = np.asarray(cross_entropy_grad(logits.copy(), target.copy()), np.float64)
        expect_equal(got, expected, f"d loss / d logits[i, c] ({n} rows)", atol=1e-6)


# -- 9.2 ------------------------------------------------------------------------------

def _checkerboard_truncating(points, size):
    """Wrong: ``int(x / size)`` rounds towards zero, so -0.5 and 0.5 share square 0."""
    cells = (np.asarray(points)[:, :2] / size).astype(np.int64)
    return cells.sum(axis=1) % 2 == 0


@exercise("9.2", "the checkerboard split", answer="checkerboard_mask", wrong=_checkerboard_truncating)
def check_checkerboard_mask(checkerboard_mask):
    """``checkerboard_mask(points, size)`` on a crop of the scan centred on the origin, with
    squares of 0.5 m and 2 m, against :func:`numba_sc.train.checkerboard`."""
    from ...train.loop import checkerboard

    points = scan_crop(2000, seed=9)
    for size in (0.5, 2.0):
        got = np.asarray(checkerboard_mask(points.copy(), size))
        expect_equal(got.astype(bool), checkerboard(points, size),
                     f"mask[i] (True: point i's square of {size} m is even)")


# -- 9.3 ------------------------------------------------------------------------------

def _iou_double_counted(confusion):
    """Wrong: row sum + column sum counts every true positive twice."""
    cm = np.asarray(confusion, np.float64)
    union = cm.sum(axis=0) + cm.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.diag(cm) / union


@exercise("9.3", "IoU from a confusion matrix", answer="iou_per_class", wrong=_iou_double_counted)
def check_iou_per_class(iou_per_class):
    """``iou_per_class(confusion)`` on confusion matrices of random labellings (some classes
    absent, some only predicted), against :func:`numba_sc.train.labels.iou`."""
    from ...train import labels as lb

    rng = np.random.default_rng(92)
    for n, classes in ((40, 5), (500, 19)):
        target = rng.integers(0, classes - 1, n)  # the last class is never a target ...
        pred = np.where(rng.random(n) < 0.6, target, rng.integers(0, classes, n))  # ... but may be predicted
        pred[pred == 2] = 1  # class 2: a target, never predicted (IoU 0)
        target[target == 3] = 0
        pred[pred == 3] = 0  # class 3: in neither (IoU NaN)
        cm = lb.confusion_matrix(pred, target, classes)
        expected = lb.iou(cm)
        got = np.asarray(iou_per_class(cm.copy()), np.float64)
        if got.shape != expected.shape:
            raise ExerciseFailed(f"iou_per_class gave shape {got.shape} for a {cm.shape} matrix; one IoU per class")
        expect_equal(np.isnan(got), np.isnan(expected), f"which classes are NaN ({classes} classes: a class in "
                     "neither the targets nor the predictions)")
        expect_equal(np.nan_to_num(got, nan=-1.0), np.nan_to_num(expected, nan=-1.0), f"IoU[c] ({classes} classes)",
                     atol=1e-12)
