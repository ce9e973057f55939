"""What ``numba-sc train`` shows while it works: a progress bar on stderr, the per-class
IoU table on stdout, logging that -q quiets and -v opens up, the two jobs (``overfit``,
``fit``) and the old spelling, which still runs and says the new one."""
import json
import logging

import numpy as np
import pytest

import numba_sc as ns
from numba_sc.__main__ import _new_train_spelling, main
from numba_sc.core import progress
from numba_sc.train import run as tr

from conftest import DATA_DIR, load_scan
from helpers import write_labelled_crops

QUICK = ["--batch-size", "2", "--width", "0.125", "--workers", "0"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two labelled crops of the shared scan (about 100 points each): a dataset of one batch."""
    return write_labelled_crops(tmp_path_factory.mktemp("tiny"), 2, 30000, 100)


def test_fit_for_one_epoch_shows_a_bar_and_prints_the_iou_table(folder, tmp_path, capsys):
    log = tmp_path / "run.json"
    assert main(["--progress", "train", "fit", "--data", str(folder), "--epochs", "1", *QUICK,
                 "--eval", str(folder), "--log", str(log)]) == 0
    out, err = capsys.readouterr()
    # the bar: on stderr, with its count and an ETA ([elapsed<remaining, rate])
    assert "epoch 1/1" in err and "1/1 [" in err and "<" in err and "batch/s" in err
    assert "batch/s" not in out and "\r" not in out  # never on stdout
    # the table: each class with points, its IoU, voxels and points, then accuracy and mIoU
    history = json.loads(log.read_text())
    assert "held-out scans after epoch 1/1" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:4] == ["class", "IoU", "voxels", "points"])
    rows = {line.split()[0]: line.split()[1:] for line in lines[head + 1:] if line.strip()}
    iou = history[0]["eval_iou"]
    shown = {n: v for n, v in iou.items() if v is not None}
    assert shown and set(shown) <= set(rows)
    for name, v in shown.items():
        assert float(rows[name][0]) == pytest.approx(v, abs=5e-4)
        assert int(rows[name][1].replace(",", "")) == history[0]["eval_voxels"][name]
    assert float(rows["mIoU"][0]) == pytest.approx(history[0]["eval_miou"], abs=5e-4)
    assert sum(history[0]["eval_voxels"].values()) > 0


def test_no_bar_where_stderr_is_not_a_terminal_unless_asked(folder, capsys, monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert main(["train", "fit", "--data", str(folder), "--epochs", "1", *QUICK]) == 0
    err = capsys.readouterr().err
    assert "batch/s" not in err and "epoch 1/1 done" in err  # the log, without the bar
    monkeypatch.setenv(progress.ENV, "1")
    assert main(["train", "fit", "--data", str(folder), "--epochs", "1", *QUICK]) == 0
    assert "batch/s" in capsys.readouterr().err


def test_quiet_silences_the_log_and_verbose_adds_debug(folder, capsys):
    argv = ["train", "fit", "--data", str(folder), "--epochs", "1", *QUICK, "--log-every", "1"]
    assert main(argv) == 0
    normal = capsys.readouterr().err
    assert "epoch 1/1 done" in normal and "batch 1/1" not in normal  # INFO, not DEBUG
    assert main(["-q", *argv]) == 0
    quiet = capsys.readouterr().err
    assert quiet.strip() == ""
    assert main(["-v", *argv]) == 0
    verbose = capsys.readouterr().err
    assert "epoch 1/1 done" in verbose and "DEBUG numba_sc.train.run: epoch 1/1  batch 1/1" in verbose
    assert main([*argv, "-q"]) == 0  # after the job too
    assert capsys.readouterr().err.strip() == ""
    # the command leaves logging as it found it: library code does not configure it
    assert not any(h.get_name() == "numba-sc command line" for h in logging.getLogger("numba_sc").handlers)


def test_the_old_spelling_still_runs_and_says_the_new_one(folder, capsys):
    with pytest.warns(FutureWarning, match=r"old spelling of 'numba-sc train fit --data .* --epochs 1"):
        assert main(["train", "--data", str(folder), "--epochs", "1", *QUICK, "--crop", "50"]) == 0
    assert "epoch 1/1 done" in capsys.readouterr().err
    # the rewriting itself: --epochs makes it fit; without, overfit with the scan named
    new, message = _new_train_spelling(["-q", "train", "--steps", "3", "--data", "D", "--workers", "1"])
    assert new == ["-q", "train", "overfit", "--steps", "3", "--data", "D"]
    assert "'numba-sc train overfit --steps 3 --scan D/semantickitti_000000.bin'" in message
    assert "left out, as the old spelling ignored them: --workers 1" in message
    new, message = _new_train_spelling(["train", "--data", "R", "--epochs", "2", "--steps=5"])
    assert new == ["train", "fit", "--data", "R", "--epochs", "2"] and "--steps=5" in message
    assert _new_train_spelling(["train", "fit", "--data", "R", "--epochs", "2"])[1] is None
    assert _new_train_spelling(["demo", "--crop", "5"])[1] is None


def test_the_old_spelling_from_the_shell_is_one_line_on_stderr(folder, monkeypatch, capsys, recwarn):
    """From the shell (argv None) the deprecation is a log line, not a Python warning with
    a file and a line number."""
    import sys

    monkeypatch.setattr(sys, "argv", ["numba-sc", "train", "--data", str(folder), "--epochs", "1", *QUICK])
    assert main() == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "old spelling" in line]
    assert len(said) == 1 and said[0].startswith("numba-sc: 'numba-sc train --data")
    assert "train fit --data" in said[0] and "FutureWarning" not in err
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_fit_without_data_and_overfit_without_labels_are_refused(tmp_path, capsys):
    assert main(["train", "fit", "--epochs", "1"]) == 2
    assert "--data ROOT is needed" in capsys.readouterr().err
    scan = tmp_path / "a.bin"
    np.zeros((4, 4), np.float32).tofile(scan)
    assert main(["train", "overfit", "--scan", str(scan), "--steps", "1"]) == 2
    assert "no labels beside it (a.label)" in capsys.readouterr().err
    assert main(["train", "overfit", "--scan", str(tmp_path / "nope.bin")]) == 2
    assert "nope.bin: no such file" in capsys.readouterr().err


def test_overfit_on_a_scan_file_logs_its_steps(tmp_path, capsys):
    points = load_scan("semantickitti")
    raw = np.fromfile(DATA_DIR / "semantickitti_000000.label", np.uint32)
    points[:3000].tofile(tmp_path / "s.bin")
    raw[:3000].tofile(tmp_path / "s.label")
    argv = ["train", "overfit", "--scan", str(tmp_path / "s.bin"), "--steps", "2", "--crop", "60",
            "--width", "0.125", "--log-every", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"data: {tmp_path / 's.bin'}" in err and "step    1  loss" in err
    assert main(["-q", *argv]) == 0
    assert "step" not in capsys.readouterr().err


def test_the_plot_has_a_legend_and_whole_epochs(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    history = [{"epoch": e, "loss": 2.0 - e / 4, "eval_miou": 0.1 * e} for e in range(3)]
    made = []
    real = plt.close
    try:
        plt.close = lambda fig=None: made.append(fig)  # keep the figure to look at it
        png = tr.write_log(history, tmp_path / "log.json")
    finally:
        plt.close = real
    assert png.exists()
    fig = made[0]
    ax, ax2 = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["training loss (mean over the epoch)",
                                                                   "held-out mIoU"]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert "epochs" in ax.get_xlabel() and "nats" in ax.get_ylabel() and "0 to 1" in ax2.get_ylabel()
    real(fig)


def test_eval_table_against_a_result_made_by_hand():
    cm = np.zeros((3, 3), np.int64)
    cm[0, 0], cm[0, 1], cm[1, 1] = 3, 1, 2  # class 0: 4 points, class 1: 2, class 2: none and never predicted
    result = {"accuracy": 5 / 6, "miou": 0.625, "iou": {"a": 0.75, "b": 0.5, "c": None}, "confusion": cm,
              "voxels": {"a": 2, "b": 1, "c": 0}}
    text = tr.eval_table(result)
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["class", "IoU", "voxels", "points"]
    assert rows[1] == ["a", "0.750", "2", "4"] and rows[2] == ["b", "0.500", "1", "2"]
    assert not any(r[0] == "c" for r in rows)  # undefined IoU: left out
    assert rows[-1] == ["mIoU", "0.625"]


def test_the_switches_of_the_bars(capsys, monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert not progress.progress_enabled()  # a test's stderr is no terminal
    for _ in progress.bar(range(3), desc="quiet"):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(progress.ENV, "1")
    with progress.prints_above_bars():
        for i in progress.bar(range(3), desc="shown"):
            print(f"row {i}")  # a script's result lines: on stdout, whole, not inside the bar
    out, err = capsys.readouterr()
    assert out.splitlines() == ["row 0", "row 1", "row 2"] and "shown" in err and "3/3" in err
    progress.set_progress(False)  # the program's word over the environment's
    try:
        assert not progress.progress_enabled()
        ns.clear_caches()  # ... kept with the library's state: a reset forgets it
        assert progress.progress_enabled()
    finally:
        progress.set_progress(None)
    monkeypatch.setenv(progress.ENV, "yes")
    with pytest.raises(ValueError, match="NUMBA_SC_PROGRESS='yes': give 1"):
        progress.progress_enabled()
    with pytest.raises(ValueError, match="True, False or None"):
        progress.set_progress("on")
