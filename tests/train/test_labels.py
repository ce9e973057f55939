"""SemanticKITTI labels: the learning map, the real label file, voxel labels and the scores.

The official map is written out again below, independently of the module, from
SemanticKITTI's ``semantic-kitti.yaml``; the real file of the scan the other
tests use (``semantickitti_000000.label``) must be fully known to it and give a
street scene's class histogram. Voxel labels are checked against a loop over
the voxels, the scores against hand-counted examples.
"""
import numpy as np
import pytest
from conftest import DATA_DIR

import numba_sc as ns
from numba_sc.train import labels as lb

# semantic-kitti.yaml's learning_map (raw id -> 0 unlabeled, 1..19), transcribed for the test
OFFICIAL = {
    0: 0, 1: 0, 10: 1, 11: 2, 13: 5, 15: 3, 16: 5, 18: 4, 20: 5, 30: 6, 31: 7, 32: 8, 40: 9, 44: 10,
    48: 11, 49: 12, 50: 13, 51: 14, 52: 0, 60: 9, 70: 15, 71: 16, 72: 17, 80: 18, 81: 19, 99: 0,
    252: 1, 253: 7, 254: 6, 255: 8, 256: 5, 257: 5, 258: 4, 259: 5,
}
LABEL_FILE = DATA_DIR / "semantickitti_000000.label"


def real_labels():
    if not LABEL_FILE.exists():
        pytest.skip(f"real labels {LABEL_FILE} not present")
    return lb.load_semantickitti_labels(LABEL_FILE)


# ------------------------------------------------------------------ the map
def test_learning_map_is_the_official_one():
    assert lb.LEARNING_MAP == OFFICIAL
    raw = np.array(sorted(OFFICIAL))
    want = np.array([255 if OFFICIAL[r] == 0 else OFFICIAL[r] - 1 for r in raw])
    np.testing.assert_array_equal(lb.learning_map(raw), want)
    assert lb.learning_map(raw).dtype == np.int64


def test_class_names_follow_the_training_ids():
    assert len(lb.CLASS_NAMES) == lb.NUM_CLASSES == 19 and lb.IGNORE_INDEX == 255
    # each training id is named after one of the raw classes mapped to it (10 car -> 0 "car",
    # 20 other-vehicle (and bus, on-rails, ...) -> 4 "other-vehicle", 81 -> 18 "traffic-sign")
    for k, name in enumerate(lb.CLASS_NAMES):
        assert name in [lb.RAW_CLASSES[r][0] for r, t in OFFICIAL.items() if t == k + 1]
    assert lb.CLASS_NAMES[8] == "road" and lb.CLASS_NAMES[14] == "vegetation"


def test_instance_bits_are_dropped_and_split():
    words = np.array([(3 << 16) | 252, (7 << 16) | 10, 40, (1 << 16) | 0, 0xFFFF0000 | 81], np.uint32)
    np.testing.assert_array_equal(lb.learning_map(words), [0, 0, 8, 255, 18])
    np.testing.assert_array_equal(lb.semantic_ids(words), [252, 10, 40, 0, 81])
    np.testing.assert_array_equal(lb.instance_ids(words), [3, 7, 0, 1, 0xFFFF])
    np.testing.assert_array_equal(lb.learning_map(words.reshape(5, 1)).ravel(), [0, 0, 8, 255, 18])


def test_unknown_raw_ids_are_listed():
    raw = np.array([10, 2, 2, 300, 40, (5 << 16) | 2, 65535], np.uint32)
    with pytest.raises(ValueError, match=r"2 \(3 points\), 300 \(1 points\), 65535 \(1 points\)"):
        lb.learning_map(raw)


def test_load_round_trip_and_errors(tmp_path):
    words = np.array([(2 << 16) | 10, 48, 0], np.uint32)
    path = tmp_path / "000000.label"
    words.tofile(path)
    got = lb.load_semantickitti_labels(path)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, words)
    (tmp_path / "odd.label").write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        lb.load_semantickitti_labels(tmp_path / "odd.label")
    with pytest.raises(FileNotFoundError, match="no label file"):
        lb.load_semantickitti_labels(tmp_path / "missing.label")


# ------------------------------------------------------------------ the real file
def test_real_label_file():
    words = real_labels()
    points = np.fromfile(DATA_DIR / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    assert words.shape == (len(points),) == (123389,)
    raw = words & 0xFFFF
    assert set(np.unique(raw).tolist()) <= set(OFFICIAL)  # every raw id in the file is known
    train = lb.learning_map(words)
    assert set(np.unique(train).tolist()) <= set(range(19)) | {255}
    # the ignored points are exactly the raw classes mapped to 0
    assert (train == 255).sum() == np.isin(raw, [0, 1, 52, 99]).sum() > 0
    # moving and static cars are one class
    assert (train == 0).sum() == np.isin(raw, [10, 252]).sum() > 0
    hist = np.bincount(train[train != 255], minlength=19)
    names = [lb.CLASS_NAMES[k] for k in np.argsort(hist)[::-1]]
    # a street: the ground classes and vegetation are most of it
    assert set(names[:4]) == {"road", "sidewalk", "vegetation", "terrain"}
    assert hist[[8, 10, 14, 16]].sum() > 0.8 * hist.sum()
    assert hist[lb.CLASS_NAMES.index("building")] > 1000 and hist[lb.CLASS_NAMES.index("car")] > 1000
    # instances: things (cars) have them, stuff (road) does not
    inst = lb.instance_ids(words)
    assert (inst[train == 0] > 0).all() and (inst[train == 8] == 0).all()


def test_real_scan_voxel_labels():
    words = real_labels()
    points = np.fromfile(DATA_DIR / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    vox = ns.voxelize(np.ascontiguousarray(points[:, :3]), 0.05, backend="reference")
    train = lb.learning_map(words)
    v = lb.voxel_labels(train, vox.inverse, 19)
    assert v.shape == (len(vox.coords),) == (94444,)
    assert set(np.unique(v).tolist()) <= set(range(19)) | {255}
    labelled = train != 255
    # most labelled points agree with their voxel's majority (5 cm voxels rarely straddle classes)
    assert (v[vox.inverse][labelled] == train[labelled]).mean() > 0.97
    # a voxel is ignored only when none of its points is labelled
    has_label = np.bincount(vox.inverse[labelled], minlength=len(v)) > 0
    np.testing.assert_array_equal(v == 255, ~has_label)


# ------------------------------------------------------------------ voxel labels
def test_voxel_labels_worked_example():
    v = lb.voxel_labels(np.array([8, 8, 13, 255, 255, 13]), np.array([0, 0, 0, 1, 2, 2]), 19)
    np.testing.assert_array_equal(v, [8, 255, 13])
    assert v.dtype == np.int64


def test_voxel_labels_against_a_loop(rng):
    n, m, c = 3000, 400, 5
    labels = rng.integers(0, c, n)
    labels[rng.random(n) < 0.3] = 255
    inverse = rng.integers(0, m, n)
    got = lb.voxel_labels(labels, inverse, c, num_voxels=m + 3)
    assert got.shape == (m + 3,)
    for j in range(m + 3):
        votes = labels[(inverse == j) & (labels != 255)]
        if len(votes) == 0:
            assert got[j] == 255
        else:
            counts = np.bincount(votes, minlength=c)
            assert counts[got[j]] == counts.max()
            assert got[j] == np.flatnonzero(counts == counts.max())[0]  # ties: the smaller id


def test_voxel_labels_other_ignore_index_and_errors():
    np.testing.assert_array_equal(lb.voxel_labels(np.array([1, -1, -1]), np.array([0, 0, 1]), 3, ignore_index=-1),
                                  [1, -1])
    np.testing.assert_array_equal(lb.voxel_labels(np.array([2, 1, 2, 1]), np.array([0, 0, 0, 0]), 3), [1])
    np.testing.assert_array_equal(lb.voxel_labels(np.array([2, 1, 2, 0]), np.array([0, 0, 0, 0]), 3), [2])
    with pytest.raises(ValueError, match=r"labels has values \[7\]"):
        lb.voxel_labels(np.array([0, 7]), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="inverse must be an integer array"):
        lb.voxel_labels(np.array([0, 1]), np.array([0]), 3)
    with pytest.raises(TypeError, match="labels must be a 1-D integer array"):
        lb.voxel_labels(np.array([0.0, 1.0]), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="outside"):
        lb.voxel_labels(np.array([0, 1]), np.array([0, 5]), 3, num_voxels=2)


# ------------------------------------------------------------------ scores
def test_confusion_accuracy_miou_by_hand():
    # 3 classes; class 2 never occurs in target or prediction (excluded from the mean)
    target = np.array([0, 0, 0, 1, 1, 255, 255, 3])
    pred = np.array([0, 0, 1, 1, 3, 2, 7, 3])  # the ignored rows' predictions do not count
    cm = lb.confusion_matrix(pred, target, 4)
    want = np.zeros((4, 4), np.int64)
    want[0, 0], want[0, 1], want[1, 1], want[1, 3], want[3, 3] = 2, 1, 1, 1, 1
    np.testing.assert_array_equal(cm, want)
    assert lb.accuracy(cm) == pytest.approx(4 / 6)
    # IoU: class 0: 2 / (2 + 0 + 1); class 1: 1 / (1 + 1 + 1); class 2: absent; class 3: 1 / (1 + 1 + 0)
    iou = lb.iou(cm)
    np.testing.assert_allclose(iou[[0, 1, 3]], [2 / 3, 1 / 3, 1 / 2])
    assert np.isnan(iou[2])
    assert lb.miou(cm) == pytest.approx((2 / 3 + 1 / 3 + 1 / 2) / 3)


def test_miou_counts_false_alarms_and_sums_over_scans():
    # class 1 only predicted (a false alarm): IoU 0, and it counts
    cm = lb.confusion_matrix(np.array([0, 1]), np.array([0, 0]), 2)
    np.testing.assert_allclose(lb.iou(cm), [0.5, 0.0])
    assert lb.miou(cm) == pytest.approx(0.25)
    # matrices add up over scans
    a = lb.confusion_matrix(np.array([0, 1, 1]), np.array([0, 1, 0]), 2)
    b = lb.confusion_matrix(np.array([1, 0]), np.array([1, 1]), 2)
    np.testing.assert_array_equal(a + b, lb.confusion_matrix(np.array([0, 1, 1, 1, 0]),
                                                             np.array([0, 1, 0, 1, 1]), 2))
    # [[1, 1], [1, 2]]: IoU 1 / (1 + 1 + 1) and 2 / (2 + 1 + 1)
    assert lb.miou(a + b) == pytest.approx((1 / 3 + 2 / 4) / 2)


def test_score_errors():
    with pytest.raises(ValueError, match=r"target has values \[5\]"):
        lb.confusion_matrix(np.array([0]), np.array([5]), 3)
    with pytest.raises(ValueError, match=r"pred has classes outside \[0, 3\).*\[4\]"):
        lb.confusion_matrix(np.array([4, 9]), np.array([1, 255]), 3)
    with pytest.raises(ValueError, match="argmax"):
        lb.confusion_matrix(np.zeros((2, 3), np.float32), np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="empty"):
        lb.miou(lb.confusion_matrix(np.array([0]), np.array([255]), 3))
    with pytest.raises(ValueError, match=r"\(C, C\)"):
        lb.accuracy(np.zeros(3))
