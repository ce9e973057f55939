"""The training loop: a few steps on a labelled crop lower the loss, and the
``python -m numba_sc train`` command."""
import numpy as np
import pytest

from numba_sc import models
from numba_sc.train import optim
from numba_sc import train
from numba_sc.train.labels import load_semantickitti_labels

from conftest import DATA_DIR, load_scan


def test_a_few_training_steps_lower_the_loss():
    """The CI half of the training demonstration: MinkUNet42, narrow, on a crop of the
    labelled scan under the reference backend."""
    points = load_scan("semantickitti")
    raw = load_semantickitti_labels(DATA_DIR / "semantickitti_000000.label")
    keep = np.argsort(np.abs(points[:, :3] - points[100, :3]).max(axis=1), kind="stable")[:500]
    x, target, inverse, point_target = train.scan_tensor(points[keep], raw[keep], 0.05, backend="reference")
    net = models.MinkUNet42(4, 19, width=0.25, seed=0)
    opt = optim.AdamW(net.trainable_parameters(), lr=3e-3, weight_decay=0.0)
    losses = [train.train_step(net, x, target, opt, backend="reference") for _ in range(8)]
    assert losses[-1] < 0.6 * losses[0], losses
    acc, miou = train.scores(net, x, inverse, point_target, backend="reference")
    assert 0.0 <= miou <= acc <= 1.0


def test_train_command(tmp_path, capsys):
    """``python -m numba_sc train`` on a crop with the references: short runs included
    (the warm-up of the schedule fits in them), the curve written, bad --steps refused."""
    from numba_sc.__main__ import main

    load_scan("semantickitti")  # skips without the data
    out = tmp_path / "curve.json"
    assert main(["train", "overfit", "--steps", "3", "--crop", "150", "--log-every", "1", "--out", str(out)]) == 0
    import json

    rec = json.loads(out.read_text())
    assert [h["step"] for h in rec["history"]] == [0, 1, 2] and rec["points"] == 150
    with pytest.raises(SystemExit) as refused:  # the parser refuses it, naming --steps
        main(["train", "overfit", "--steps", "0"])
    assert refused.value.code == 2 and "argument --steps" in capsys.readouterr().err


def test_evaluate_against_a_confusion_matrix_made_by_hand():
    """Targets 0 0 1 1 2 (and one ignored point), predictions 0 1 1 1 0: by hand, class 0
    has TP 1, FN 1, FP 1 (IoU 1/3); class 1 TP 2, FP 1 (2/3); class 2 TP 0 (0); class 3
    is predicted only on the ignored point, so it does not count."""
    target = np.array([0, 0, 1, 1, 2, 255])
    pred = np.array([0, 1, 1, 1, 0, 3])
    r = train.evaluate(pred, target)
    want = np.zeros((19, 19), np.int64)
    for t_, p_ in [(0, 0), (0, 1), (1, 1), (1, 1), (2, 0)]:
        want[t_, p_] += 1
    np.testing.assert_array_equal(r["confusion"], want)
    assert r["accuracy"] == pytest.approx(3 / 5)
    names = list(r["iou"])
    assert [r["iou"][names[c]] for c in range(3)] == pytest.approx([1 / 3, 2 / 3, 0.0])
    assert r["iou"][names[3]] is None
    assert r["miou"] == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    assert train.evaluate(pred, target, classes=[0, 1])["miou"] == pytest.approx(0.5)
    table = train.iou_table({"run": r}, classes=[0, 1, 2])
    assert "0.333" in table and "0.667" in table and "mIoU" in table


def test_checkerboard_squares():
    pts = np.array([[1, 1], [11, 1], [-1, 1], [11, 11], [-0.5, -0.5], [25, 3]], np.float32)
    np.testing.assert_array_equal(train.checkerboard(pts), [True, False, False, True, True, True])
    np.testing.assert_array_equal(train.checkerboard(pts, size=20), [True, True, False, True, True, False])
    with pytest.raises(ValueError, match="size must be a positive number"):
        train.checkerboard(pts, size=0)
