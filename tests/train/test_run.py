"""Training over a dataset (numba_sc.train.run and ``numba-sc train --epochs``): batches of
scans from a folder, checkpoints that resume with the very losses of an uninterrupted run."""
import json

import numpy as np
import pytest

from numba_sc import nn
from numba_sc.train import data, optim
from numba_sc.train import run as tr

from helpers import stop_after_first_checkpoint, write_labelled_crops


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A flat folder of four labelled crops of the shared scan (about 120 points each)."""
    return write_labelled_crops(tmp_path_factory.mktemp("scans"), 4, 20000, 120)


def _small_model():
    rng = np.random.default_rng(0)  # the same initial weights every time
    return nn.Sequential(nn.SubMConv3d(2, 8, 3, rng=rng), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 19, rng=rng))


def _run(folder, stop, start=0, history=None, model=None, opt=None, save_to=None, epochs=3):
    """Epochs ``start .. stop - 1`` of a run of ``epochs`` epochs (its schedule spans them all)."""
    scans = data.ScanFolder(folder)
    loader = data.Loader(scans, 2, lambda p, r, rng: tr.prepare_scan(p, r, rng), seed=3, workers=2)
    model = model or _small_model()
    opt = opt or optim.AdamW(model.trainable_parameters(), lr=1e-2)
    total = epochs * len(loader)
    hist = tr.fit_dataset(model, opt, loader, stop, schedule=lambda s: optim.cosine_lr(s, total, 1e-2, warmup=2),
                          start_epoch=start, history=history, save_to=save_to, backend="reference",
                          print_=lambda s: None)
    return hist, model, opt


def test_a_resumed_run_has_the_losses_of_an_uninterrupted_one(folder, tmp_path):
    straight, _, _ = _run(folder, 3)
    assert len(straight) == 3 and all(len(h["losses"]) == 2 for h in straight)
    first, _, _ = _run(folder, 1, save_to=tmp_path / "run.npz")  # the same run, stopped after epoch 0
    model, opt = _small_model(), None
    opt = optim.AdamW(model.trainable_parameters(), lr=0.5)  # settings come back from the checkpoint
    done, history, _ = tr.resume(tmp_path / "run.npz", model, opt)
    assert done == 1 and history[0]["losses"] == first[0]["losses"]
    resumed, _, _ = _run(folder, 3, start=done, history=history, model=model, opt=opt)
    assert [h["losses"] for h in resumed] == [h["losses"] for h in straight]  # exactly
    # and a run that starts from a fresh model instead is not the same run
    other, _, _ = _run(folder, 3, start=1, history=history)
    assert [h["losses"] for h in other][1:] != [h["losses"] for h in straight][1:]


def test_prepare_scan_leaves_position_out_and_augments_reproducibly(folder):
    points, raw = data.ScanFolder(folder)[0]
    a = tr.prepare_scan(points, raw, np.random.default_rng(0))
    b = tr.prepare_scan(points, raw, np.random.default_rng(0))
    c = tr.prepare_scan(points, raw, None, augmentation=False)
    np.testing.assert_array_equal(a[0].coords, b[0].coords)
    assert a[0].features.shape[1] == 2 and not np.array_equal(a[0].coords, c[0].coords)
    # without augmentation each voxel's features are its points' mean remission and height
    v = c[0]
    inv = c[2]
    order = np.argsort(v.order) if v.order is not None else np.arange(len(v))
    row = order[inv[0]]
    same = inv == inv[0]
    np.testing.assert_allclose(v.features[row], [points[same, 3].mean(), points[same, 2].mean()], rtol=1e-5)


def test_the_command_trains_saves_resumes_and_logs(folder, tmp_path, capsys, monkeypatch):
    from numba_sc.__main__ import main

    ckpt, log = tmp_path / "run.npz", tmp_path / "run.json"
    argv = ["train", "fit", "--data", str(folder), "--batch-size", "2", "--width", "0.125", "--workers", "1",
            "--save", str(ckpt), "--log", str(log), "--eval", str(folder), "--log-every", "1", "--epochs", "2"]
    stop_after_first_checkpoint(main, argv, monkeypatch)  # the run of two epochs, stopped after its first checkpoint
    out, err = capsys.readouterr()  # (the log on stderr, the IoU table on stdout)
    assert "scans/s" in err and "held-out accuracy" in err and ckpt.exists() and not log.exists()
    assert "held-out scans after epoch 1/2" in out and "mIoU" in out
    assert main(argv + ["--resume", str(ckpt)]) == 0
    assert "resumed from" in capsys.readouterr().err
    history = json.loads(log.read_text())
    assert [h["epoch"] for h in history] == [0, 1] and "eval_miou" in history[1]
    assert log.with_suffix(".png").exists()
    assert main(argv + ["--resume", str(ckpt), "--lr", "0.5"]) == 2
    assert "other settings" in capsys.readouterr().err
