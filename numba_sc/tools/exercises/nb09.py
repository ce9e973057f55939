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

The inputs are random logits (and logits of a confident network, around 1000, which
overflow ``exp`` unless each row's maximum is subtracted first), random labellings, and
a crop of the SemanticKITTI scan moved to the origin (coordinates of both signs,
:func:`numba_sc.tools.exercises.inputs.scan_crop`); the references are the library's.
More slips: ``exp`` of the raw logits, ignored rows left with their softmax (9.1); the
odd squares taken for the even ones (9.2); 0 where a class has no IoU (9.3).
"""
from __future__ import annotations

import numpy as np

from . import Slip, exercise, expect_equal
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


def _grad_without_max(logits, target):
    """Wrong: ``exp`` of the raw logits, which overflows for a confident network's."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x)
    p /= p.sum(axis=1, keepdims=True)
    labelled = np.asarray(target) != IGNORE
    rows = np.flatnonzero(labelled)
    p[rows, np.asarray(target)[rows]] -= 1
    p[~labelled] = 0
    return p / labelled.sum()


def _grad_ignored_not_zeroed(logits, target):
    """Wrong: an ignored row keeps its softmax, as if it pulled towards no class."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    labelled = np.asarray(target) != IGNORE
    rows = np.flatnonzero(labelled)
    p[rows, np.asarray(target)[rows]] -= 1
    return p / labelled.sum()


GRAD_RULE = ("row i of the gradient is (softmax(logits[i]) - onehot(target[i])) / n_labelled for a labelled "
             "row and 0 for an ignored one (target 255): the mean is over the labelled rows only. The softmax "
             "subtracts each row's maximum before exp, or a confident network's logits overflow")


@exercise("9.1", "the gradient of the cross-entropy", answer="cross_entropy_grad",
          wrong=[Slip(_grad_over_all_rows, says="labelled rows only"), Slip(_grad_without_max, says="maximum"),
                 Slip(_grad_ignored_not_zeroed, says="0 for an ignored one")])
def check_cross_entropy_grad(cross_entropy_grad):
    """``cross_entropy_grad(logits, target)`` on random logits of 19 classes with a third
    of the rows unlabelled (255), then on a confident network's logits (around 1000),
    against :func:`numba_sc.train.loss.cross_entropy_reference`."""
    from ...train.loss import cross_entropy_reference

    rng = np.random.default_rng(91)
    for n, centre in ((7, 0.0), (60, 0.0), (20, 1000.0)):
        logits = (rng.normal(size=(n, 19)) * 3 + centre).astype(np.float32)
        target = rng.integers(0, 19, n)
        target[rng.random(n) < 1 / 3] = IGNORE
        target[0] = 4  # at least one labelled row
        target[1] = IGNORE  # and at least one ignored
        _, expected = cross_entropy_reference(logits.astype(np.float64), target)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer's to show, as NaN
            got = np.asarray(cross_entropy_grad(logits.copy(), target.copy()), np.float64)
        case = f"{n} rows, logits around {centre:g}"
        expect_equal(got, expected, f"{case}: grad[i, c]", rule=GRAD_RULE, atol=1e-6,
                     where=lambda ic: f"row {ic[0]}, " + ("ignored" if target[ic[0]] == IGNORE else
                                                          f"target {target[ic[0]]}, max logit "
                                                          f"{float(logits[ic[0]].max()):.1f}"))


# -- 9.2 ------------------------------------------------------------------------------

def _checkerboard_truncating(points, size):
    """Wrong: ``int(x / size)`` rounds towards zero, so -0.5 and 0.5 share square 0."""
    cells = (np.asarray(points)[:, :2] / size).astype(np.int64)
    return cells.sum(axis=1) % 2 == 0


def _checkerboard_odd(points, size):
    """Wrong: the odd squares, where the split takes the even ones."""
    cells = np.floor(np.asarray(points)[:, :2] / size).astype(np.int64)
    return cells.sum(axis=1) % 2 == 1


CHECKERBOARD_RULE = ("point i is True when floor(x / size) + floor(y / size) is even: the floor, not truncation "
                     "(int() rounds towards zero and merges the squares either side of an axis into one "
                     "double-width square of one colour)")


@exercise("9.2", "the checkerboard split", answer="checkerboard_mask",
          wrong=[Slip(_checkerboard_truncating, says="floor"), Slip(_checkerboard_odd, says="even")])
def check_checkerboard_mask(checkerboard_mask):
    """``checkerboard_mask(points, size)`` on a crop of the scan centred on the origin, with
    squares of 0.5 m and 2 m, against :func:`numba_sc.train.checkerboard`."""
    from ...train.loop import checkerboard

    points = scan_crop(2000, seed=9)
    for size in (0.5, 2.0):
        got = np.asarray(checkerboard_mask(points.copy(), size))
        expect_equal(got.astype(bool), checkerboard(points, size), f"squares of {size} m: mask[i]",
                     rule=CHECKERBOARD_RULE,
                     where=lambda i: f"the point at x = {points[i[0], 0]:.3f} m, y = {points[i[0], 1]:.3f} m")


# -- 9.3 ------------------------------------------------------------------------------

def _iou_double_counted(confusion):
    """Wrong: row sum + column sum counts every true positive twice."""
    cm = np.asarray(confusion, np.float64)
    union = cm.sum(axis=0) + cm.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.diag(cm) / union


def _iou_zero_for_absent(confusion):
    """Wrong: 0 for a class in neither the targets nor the predictions, where it has no IoU."""
    cm = np.asarray(confusion, np.float64)
    tp = np.diag(cm)
    union = cm.sum(axis=0) + cm.sum(axis=1) - tp
    return np.divide(tp, union, out=np.zeros_like(tp), where=union > 0)


IOU_RULE = ("IoU[c] = TP / (TP + FP + FN): TP the diagonal entry cm[c, c], FP the rest of column c, FN the "
            "rest of row c (row sum plus column sum counts TP twice: subtract it once); NaN for a class in "
            "neither the targets nor the predictions (0 / 0: no IoU, which labels.miou leaves out)")


@exercise("9.3", "IoU from a confusion matrix", answer="iou_per_class",
          wrong=[Slip(_iou_double_counted, says="TP + FP + FN"), Slip(_iou_zero_for_absent, says="NaN")])
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
        def where(c, cm=cm):
            c = c[0]
            return f"TP {cm[c, c]}, FP {cm[:, c].sum() - cm[c, c]}, FN {cm[c].sum() - cm[c, c]}"

        expect_equal(got, expected, f"{classes} classes: IoU[c]", rule=IOU_RULE, atol=1e-12, where=where)
