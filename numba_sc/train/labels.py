"""SemanticKITTI labels: reading them, mapping them to training classes, per voxel, and scoring.

A SemanticKITTI scan ``velodyne/000000.bin`` comes with ``labels/000000.label``:
one uint32 per point, in the points' order. Its low 16 bits are the *raw
semantic id* of the point (``40`` road, ``50`` building, ``252`` a moving car,
...), its high 16 bits an instance id (which car, which person; 0 for stuff
such as road)::

    word = 0x0003_00FC    ->    semantic = word & 0xFFFF = 252 (moving-car)
                                instance = word >> 16    = 3

The raw ids are sparse (0 .. 259, 34 of them used) and finer than what is
trained: the dataset's configuration (``semantic-kitti.yaml``) maps them with
its ``learning_map`` onto 20 ids, 0 "unlabeled" and 1 .. 19 the 19 classes of
the benchmark. Moving and static things fall together (252 moving-car and 10
car are both car), and a few raw classes that are too rare or too vague to
learn (outlier, other-structure, other-object) go to 0 with the unlabeled points.

**Our training ids are 0 .. 18 and 255.** We shift the official ids down by one
and send "unlabeled" to the *ignore index* 255, as SPVNAS and most point-cloud
training code do: the network then has exactly 19 outputs, one per scored
class, and the loss skips ignored points (``numba_sc.train.loss.cross_entropy``'s
``ignore_index``). So ``car`` is 0 here and 1 in the yaml; ``traffic-sign`` is
18 here and 19 there. :data:`CLASS_NAMES` lists the 19 in order.

Per voxel: a network that works on voxels predicts one class per voxel, so
training needs one label per voxel. :func:`voxel_labels` gives each voxel the
label most of its points carry (ignored points do not vote). Worked example,
three voxels and six points, ``inverse`` as :func:`numba_sc.voxelize` returns
it (the voxel of each point)::

    labels  = [8, 8, 13, 255, 255, 13]
    inverse = [0, 0, 0,  1,   2,   2]
    voxel 0: votes 8, 8, 13 -> 8      voxel 1: only ignored -> 255
    voxel 2: votes 13       -> 13     (the ignored point does not vote)

Scoring: :func:`confusion_matrix` counts (true, predicted) pairs over the
labelled points; :func:`accuracy` and :func:`miou` read it. Sum the matrices of
many scans first and score the sum: that is how the benchmark's mIoU is defined
(over the whole split, not averaged per scan).

Everything here is NumPy (counting and table look-ups, nothing for a kernel to
teach); CuPy arrays are accepted and read to the host first.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.backend import to_host
from ..core.conventions import is_int

IGNORE_INDEX = 255


class DataError(ValueError):
    """A data file that is not what it should be: damaged, cut short, or of another
    dataset. The message names the file. A ValueError, so code that catches those
    still does; the command line reports it on one line, even when it turns up in a
    scan deep inside a run (``numba-sc train``)."""

# raw semantic id -> (name, official training id 0..19) from SemanticKITTI's semantic-kitti.yaml
RAW_CLASSES = {
    0: ("unlabeled", 0),
    1: ("outlier", 0),
    10: ("car", 1),
    11: ("bicycle", 2),
    13: ("bus", 5),
    15: ("motorcycle", 3),
    16: ("on-rails", 5),
    18: ("truck", 4),
    20: ("other-vehicle", 5),
    30: ("person", 6),
    31: ("bicyclist", 7),
    32: ("motorcyclist", 8),
    40: ("road", 9),
    44: ("parking", 10),
    48: ("sidewalk", 11),
    49: ("other-ground", 12),
    50: ("building", 13),
    51: ("fence", 14),
    52: ("other-structure", 0),
    60: ("lane-marking", 9),
    70: ("vegetation", 15),
    71: ("trunk", 16),
    72: ("terrain", 17),
    80: ("pole", 18),
    81: ("traffic-sign", 19),
    99: ("other-object", 0),
    252: ("moving-car", 1),
    253: ("moving-bicyclist", 7),
    254: ("moving-person", 6),
    255: ("moving-motorcyclist", 8),
    256: ("moving-on-rails", 5),
    257: ("moving-bus", 5),
    258: ("moving-truck", 4),
    259: ("moving-other-vehicle", 5),
}

# The official learning_map: raw id -> 0 (unlabeled) .. 19.
LEARNING_MAP = {raw: train for raw, (_, train) in RAW_CLASSES.items()}

# Our 19 classes, training id 0 .. 18 (the official id minus one).
CLASS_NAMES = (
    "car", "bicycle", "motorcycle", "truck", "other-vehicle", "person", "bicyclist", "motorcyclist",
    "road", "parking", "sidewalk", "other-ground", "building", "fence", "vegetation", "trunk",
    "terrain", "pole", "traffic-sign",
)
NUM_CLASSES = len(CLASS_NAMES)

# The look-up table learning_map() indexes: raw id -> our id (0..18, 255), -1 for an unknown id.
_TABLE = np.full(max(RAW_CLASSES) + 1, -1, np.int64)
for _raw, _official in LEARNING_MAP.items():
    _TABLE[_raw] = IGNORE_INDEX if _official == 0 else _official - 1


def load_semantickitti_labels(path) -> np.ndarray:
    """The ``.label`` file at ``path`` as uint32 words, one per point: semantic id
    in the low 16 bits, instance id in the high 16 (see :func:`semantic_ids`).

    A file whose size is not whole words, or that holds a semantic id SemanticKITTI
    does not define, raises :class:`DataError` naming the file (and the ids): read
    now, not found later in a batch of a training run."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no label file at {path}")
    size = path.stat().st_size
    if size % 4:
        raise DataError(f"{path} has {size} bytes, not a multiple of 4: a .label file is one uint32 per "
                        "point (is it a .bin scan?)")
    words = np.fromfile(path, dtype="<u4").astype(np.uint32, copy=False)
    try:
        learning_map(words)
    except ValueError as e:
        raise DataError(f"{path}: {e}; is it a SemanticKITTI .label file?") from None
    return words


def _label_words(labels, name="labels") -> np.ndarray:
    """``labels`` as uint32 words; refused when they are not whole numbers in 0 .. 2**32 - 1
    (a float id such as 40.7 would otherwise be read as 40)."""
    a = np.asarray(to_host(labels))
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.number):
        raise TypeError(f"{name} must be an integer array of label words, got {a.dtype}")
    if not np.issubdtype(a.dtype, np.integer):
        if not (np.isfinite(a).all() and np.array_equal(a, np.round(a))):
            raise ValueError(f"{name} must hold whole label ids, got {a[~np.isfinite(a) | (a != np.round(a))][:5]}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.uint32).max):
        raise ValueError(f"{name} must lie in 0 .. 2**32 - 1 (uint32 label words), got {a.min()} .. {a.max()}")
    return a.astype(np.uint32)


def semantic_ids(labels) -> np.ndarray:
    """The raw semantic id of each point: the low 16 bits of the label words."""
    return (_label_words(labels) & 0xFFFF).astype(np.int64)


def instance_ids(labels) -> np.ndarray:
    """The instance id of each point: the high 16 bits of the label words."""
    return (_label_words(labels) >> 16).astype(np.int64)


def learning_map(raw) -> np.ndarray:
    """Raw SemanticKITTI ids -> our training ids: 0 .. 18 for the 19 classes and
    :data:`IGNORE_INDEX` (255) for unlabeled, outlier and the other unscored
    classes. int64, the shape of ``raw``.

    ``raw`` may be the label words as read from the file (the instance bits are
    dropped here) or the semantic ids alone. An id that SemanticKITTI does not
    define is an error listing it: a file of another dataset, or not a label
    file at all.
    """
    sem = semantic_ids(raw)
    known = sem < len(_TABLE)
    out = np.where(known, _TABLE[np.where(known, sem, 0)], -1)
    if (out < 0).any():
        ids, counts = np.unique(sem[out < 0], return_counts=True)
        listed = ", ".join(f"{i} ({c} points)" for i, c in zip(ids[:20].tolist(), counts[:20].tolist()))
        raise ValueError(f"raw semantic ids not in SemanticKITTI's learning_map: {listed}"
                         f"{' ...' if len(ids) > 20 else ''}; known ids are {sorted(RAW_CLASSES)}")
    return out


def _check_labels(labels, num_classes, ignore_index, name):
    """``labels`` as an int64 host array whose values are in [0, num_classes) or ``ignore_index``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int (SemanticKITTI: NUM_CLASSES = {NUM_CLASSES}), "
                         f"got {num_classes!r}")
    a = np.asarray(to_host(labels))
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be a 1-D integer array, got {a.dtype} of shape {a.shape}")
    a = a.astype(np.int64)
    bad = (a != ignore_index) & ((a < 0) | (a >= num_classes))
    if bad.any():
        raise ValueError(f"{name} has values {np.unique(a[bad])[:10].tolist()} outside [0, {num_classes}) "
                         f"that are not the ignore index {ignore_index}")
    return a


def voxel_labels(labels, inverse, num_classes, ignore_index=IGNORE_INDEX, num_voxels=None) -> np.ndarray:
    """The majority label of each voxel's points: int64 (M,).

    ``labels`` (N,) is one training id per point, ``inverse`` (N,) the voxel of
    each point (:func:`numba_sc.voxelize`'s ``.inverse``); ``M`` is
    ``num_voxels``, or ``inverse.max() + 1``. Points labelled ``ignore_index``
    do not vote; a voxel with only such points gets ``ignore_index``. A tie goes
    to the smaller class id.

    How: one count per (voxel, class) pair, ``bincount(inverse * C + label)``,
    seen as an (M, C) table, then the arg-max of each row.
    """
    labels = _check_labels(labels, num_classes, ignore_index, "labels")
    inverse = np.asarray(to_host(inverse))
    if inverse.shape != labels.shape or not np.issubdtype(inverse.dtype, np.integer):
        raise ValueError(f"inverse must be an integer array of the labels' shape {labels.shape} (the voxel of "
                         f"each point), got {inverse.dtype} of shape {inverse.shape}")
    inverse = inverse.astype(np.int64)
    if num_voxels is None:
        m = int(inverse.max()) + 1 if len(inverse) else 0
    else:
        m = int(num_voxels)
    if len(inverse) and (inverse.min() < 0 or inverse.max() >= m):
        raise ValueError(f"inverse has voxel indices outside [0, {m}) (num_voxels={num_voxels})")
    valid = labels != ignore_index
    counts = np.bincount(inverse[valid] * num_classes + labels[valid],
                         minlength=m * num_classes).reshape(m, num_classes)
    out = counts.argmax(axis=1)  # (the first maximum: the smaller id wins a tie)
    out[counts.sum(axis=1) == 0] = ignore_index
    return out


def confusion_matrix(pred, target, num_classes, ignore_index=IGNORE_INDEX) -> np.ndarray:
    """Counts of (true class, predicted class) over the points whose target is
    not ``ignore_index``: int64 (C, C), row = target, column = prediction
    (so the diagonal holds the correct ones)."""
    target = _check_labels(target, num_classes, ignore_index, "target")
    pred = np.asarray(to_host(pred))
    if pred.shape != target.shape or not np.issubdtype(pred.dtype, np.integer):
        raise ValueError(f"pred must be an integer array of target's shape {target.shape} (one class per "
                         f"point; take logits.argmax(axis=1)), got {pred.dtype} of shape {pred.shape}")
    valid = target != ignore_index
    p = pred[valid].astype(np.int64)
    if len(p) and (p.min() < 0 or p.max() >= num_classes):
        raise ValueError(f"pred has classes outside [0, {num_classes}) on labelled points: "
                         f"{np.unique(p[(p < 0) | (p >= num_classes)])[:10].tolist()}")
    return np.bincount(target[valid] * num_classes + p,
                       minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def _check_confusion(confusion):
    cm = np.asarray(to_host(confusion))
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(f"confusion must be a (C, C) matrix from confusion_matrix(), got shape {cm.shape}")
    if cm.sum() == 0:
        raise ValueError("the confusion matrix is empty: no labelled points were scored")
    return cm.astype(np.float64)


def accuracy(confusion) -> float:
    """The fraction of labelled points predicted right: trace / sum of the confusion matrix."""
    cm = _check_confusion(confusion)
    return float(np.trace(cm) / cm.sum())


def iou(confusion) -> np.ndarray:
    """Intersection over union of each class, float64 (C,)::

        IoU_c = TP_c / (TP_c + FP_c + FN_c)

    with TP the diagonal, FP the rest of column c (predicted c, was not), FN the
    rest of row c (was c, predicted not). NaN for a class absent from both the
    targets and the predictions (0 / 0).
    """
    cm = _check_confusion(confusion)
    tp = np.diag(cm)
    union = cm.sum(axis=0) + cm.sum(axis=1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, tp / np.where(union > 0, union, 1), np.nan)


def check_classes(classes, num_classes, name="classes") -> list[int]:
    """A list of class ids to score: whole ints (not bools, not floats) in
    ``[0, num_classes)``, each once, at least one. Returned sorted.

    A negative id would index from the end (``-1`` the last class) and a repeated
    one would weigh its class twice in a mean, so both are refused here rather
    than scored."""
    if isinstance(classes, (str, bytes)) or not hasattr(classes, "__iter__"):
        raise TypeError(f"{name} must be a sequence of class ids, e.g. [0, 3, 8], got {classes!r}")
    ids = list(classes)
    if not ids:
        raise ValueError(f"{name} is empty: name at least one class id to score")
    bad = [c for c in ids if not is_int(c)]
    if bad:
        raise TypeError(f"{name} must hold int class ids, got {bad[:5]!r}; a class id is whole "
                        f"(write 3, not 3.0 or True)")
    ids = [int(c) for c in ids]
    out = sorted(c for c in ids if not 0 <= c < num_classes)
    if out:
        raise ValueError(f"{name} has ids {out[:10]} outside [0, {num_classes}): class ids count from 0, "
                         f"and a negative id does not count from the end")
    twice = sorted({c for c in ids if ids.count(c) > 1})
    if twice:
        raise ValueError(f"{name} names the classes {twice} more than once: list each class once")
    return sorted(ids)


def miou(confusion, classes=None) -> float:
    """The mean IoU over the classes present in the targets or the predictions.

    A class absent from both has IoU 0 / 0 and is left out of the mean: counting
    it as 0 would punish a scan for not containing, say, a motorcyclist, and
    counting it as 1 would reward it. A class that is predicted but absent from
    the targets (a false alarm) counts, with IoU 0. Over a whole split every
    class is present and this is the benchmark's mIoU.

    ``classes`` (ids, optional): average over these classes only (checked by
    :func:`check_classes`); the same rule leaves out those of them absent from
    both. This is the one place the rule lives: :func:`numba_sc.train.evaluate`
    calls it.
    """
    values = iou(confusion)
    if classes is not None:
        classes = check_classes(classes, len(values))
        values = values[classes]
    if np.isnan(values).all():
        raise ValueError(f"none of the classes {classes} occurs in the targets or the predictions: their mIoU "
                         "is 0 / 0; choose classes present in the scored points")
    return float(np.nanmean(values))
