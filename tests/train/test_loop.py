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
    assert main(["train", "--steps", "3", "--crop", "150", "--log-every", "1", "--out", str(out)]) == 0
    import json

    rec = json.loads(out.read_text())
    assert [h["step"] for h in rec["history"]] == [0, 1, 2] and rec["points"] == 150
    with pytest.raises(SystemExit) as refused:  # the parser refuses it, naming --steps
        main(["train", "--steps", "0"])
    assert refused.value.code == 2 and "argument --steps" in capsys.readouterr().err
