"""The command line at the edges (#33): a user's mistake is refused before any work, on
one line of stderr naming the argument or file and the fix, with exit code 2; never a
traceback, a run lost at its end, another folder used in place of the one given, or
bytes dropped.

Two tables in the pattern of tests/test_edges.py. ``CLI_CASES``: (id, argv, words),
the argv run with ``main`` in-process (``{d}`` stands for a folder of small files
made once, see :func:`d`), ``words`` a regex the one line on stderr must match.
``CASES``: (id, call, expected) for the Python functions those commands call with
the user's values.
"""
import json
import re

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT, load_scan
from numba_sc.__main__ import main
from numba_sc.nn import models
from numba_sc.tools.check import select_stages
from numba_sc.tools.demo import load_points
from numba_sc.train import data, labels, loop
from numba_sc.train import run as tr

KITTI_BIN, KITTI_LABEL = "semantickitti_000000.bin", "semantickitti_000000.label"


def _write_scan(folder, stem, points, raw):
    folder.mkdir(parents=True, exist_ok=True)
    points.tofile(folder / f"{stem}.bin")
    if raw is not None:
        raw.tofile(folder / f"{stem}.label")


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A folder of small inputs, good and bad, cut from the shared scan.

    one/     the scan's file names, 300 labelled points      badone/  the same, one label id 77
    ds/      two labelled crops (a dataset, flat layout)      badlab/  the same, 77 in the second
    nolab/   a crop without its .label                        empty/   nothing
    kitti/   SemanticKITTI's layout, sequence 08              odd.bin  two points and 3 bytes
    run.npz  the checkpoint of ``train --data ds --epochs 2 --width 0.125``, stopped after epoch 0
    foreign.npz, cut.npz, empty.npz, text.npz: files that are not checkpoints
    """
    root = tmp_path_factory.mktemp("cli")
    points = load_scan("semantickitti")  # (skips without the real scan, as in an sdist)
    raw = np.fromfile(DATA_DIR / KITTI_LABEL, np.uint32)
    labelled = np.flatnonzero(labels.learning_map(raw) != labels.IGNORE_INDEX)
    crops = []
    for i in range(2):
        centre = points[labelled[i * 30000], :3]
        keep = np.argsort(np.abs(points[:, :3] - centre).max(axis=1), kind="stable")[:120]
        crops.append((points[keep], raw[keep]))
    bad = crops[1][1].copy()
    bad[3] = 77  # a raw id SemanticKITTI does not define
    _write_scan(root / "one", "semantickitti_000000", *crops[0])
    _write_scan(root / "badone", "semantickitti_000000", crops[1][0], bad)
    for i, (p, r) in enumerate(crops):
        _write_scan(root / "ds", f"s{i}", p, r)
        _write_scan(root / "badlab", f"s{i}", p, bad if i else r)
        _write_scan(root / "kitti" / "sequences" / "08" / "velodyne", f"{i:06d}", p, None)
        _write_scan(root / "kitti" / "sequences" / "08" / "labels", f"{i:06d}", r, None)
    _write_scan(root / "nolab", "a", crops[0][0], None)
    (root / "empty").mkdir()
    (root / "odd.bin").write_bytes(points[:2].tobytes() + b"xyz")
    np.savez(root / "foreign.npz", w=np.zeros(3))
    (root / "text.npz").write_text("not a checkpoint\n")
    (root / "empty.npz").write_bytes(b"")
    _stopped_run(root)
    (root / "cut.npz").write_bytes((root / "run.npz").read_bytes()[:4000])
    return root


class _Stopped(Exception):
    """Stands for a run stopped (killed, crashed) right after a checkpoint was written."""


def _stopped_run(root):
    """run.npz: the checkpoint of epoch 0 of a run of two epochs."""
    save = tr.save

    def save_then_stop(state, path):
        save(state, path)
        raise _Stopped

    tr.save = save_then_stop
    try:
        with pytest.raises(_Stopped):
            main(["train", "--data", str(root / "ds"), "--epochs", "2", *RUN, "--save", str(root / "run.npz")])
    finally:
        tr.save = save


RUN = ["--width", "0.125", "--batch-size", "2", "--workers", "0", "--log-every", "1"]  # a quick run of ds/
ONE = ["--steps", "1", "--crop", "20"]  # a quick run on one scan
DS = ["--data", "{d}/ds", "--epochs", "2", *RUN]

# (id, argv, words): argv exits 2 before any work with words (a regex) on one line of stderr
CLI_CASES = [
    # outputs, checked before any work
    ("train --out in a missing folder", ["train", "--data", "{d}/one", *ONE, "--out", "{d}/nodir/c.json"],
     r"--out .*nodir/c\.json: the folder .*nodir does not exist; create it first"),
    ("train --out a folder", ["train", "--data", "{d}/one", *ONE, "--out", "{d}"], r"--out .* is a folder"),
    ("train --save in a missing folder", ["train", *DS, "--save", "{d}/nodir/r.npz"],
     r"--save .*nodir/r\.npz: the folder .*nodir does not exist"),
    ("train --log in a missing folder", ["train", *DS, "--log", "{d}/nodir/r.json"], r"--log .*: the folder .*nodir"),
    ("ladder --out in a missing folder", ["ladder", "gather", "--out", "{d}/nodir/l.json"], r"--out .*nodir"),
    ("train --save without --epochs", ["train", "--data", "{d}/one", *ONE, "--save", "{d}/x.npz"],
     r"--save: only for training on a dataset: add --epochs"),
    # inputs
    ("train --eval without labels", ["train", *DS, "--eval", "{d}/nolab"],
     r"--eval .*nolab: .*a\.bin has no label file .*give a labelled folder"),
    ("train --data missing", ["train", "--data", "{d}/nonexistent", *ONE], r"--data .*nonexistent: no such folder"),
    ("train --data empty", ["train", "--data", "{d}/empty", *ONE], r"--data .*empty has no semantickitti_000000\.bin"),
    ("demo --points missing", ["demo", "--points", "{d}/nope.bin"], r"--points .*nope\.bin: no such file"),
    ("demo --points not whole points", ["demo", "--points", "{d}/odd.bin"],
     r"--points .*odd\.bin has 35 bytes, not a positive multiple of 16 \(--columns 4 float32"),
    ("ladder --points not whole points", ["ladder", "gather", "--points", "{d}/odd.bin", "--columns", "3"],
     r"odd\.bin has 35 bytes, not a positive multiple of 12"),
    ("check --stage nosuch", ["check", "--stage", "nosuch"], r"--stage 'nosuch' matches no stage; stages are: 1 voxelize"),
    ("unknown label ids", ["train", "--data", "{d}/badone", *ONE],
     r"badone/semantickitti_000000\.label: raw semantic ids not in SemanticKITTI's learning_map: 77 \(1 points\)"),
    ("unknown label ids in a dataset", ["train", "--data", "{d}/badlab", "--epochs", "1", *RUN],
     r"badlab/s1\.label: raw semantic ids not in SemanticKITTI's learning_map: 77"),
    ("train --crop 1 of no label", ["train", "--steps", "1", "--crop", "1"],
     r"the 1 point\(s\) of --crop 1 have no scored label .*give a larger --crop"),
    # --resume
    ("--resume missing", ["train", *DS, "--resume", "{d}/nope.npz"], r"no checkpoint at .*nope\.npz"),
    ("--resume cut short", ["train", *DS, "--resume", "{d}/cut.npz"],
     r"cut\.npz: its contents are damaged or incomplete .*cannot be read as a numba-sc checkpoint"),
    ("--resume empty", ["train", *DS, "--resume", "{d}/empty.npz"], r"empty\.npz: the file is empty, so it cannot be read as a numba-sc checkpoint"),
    ("--resume text", ["train", *DS, "--resume", "{d}/text.npz"], r"text\.npz: the file is not a zip archive \(\.npz\), so it cannot be read"),
    ("--resume foreign", ["train", *DS, "--resume", "{d}/foreign.npz"], r"foreign\.npz is an \.npz but not a numba-sc checkpoint"),
    ("--resume another --width", ["train", *DS, "--resume", "{d}/run.npz", "--width", "0.25"],
     r"--resume .*run\.npz was written with other settings \{'width': \(0\.125, 0\.25\)\}"),
    ("--resume another --epochs", ["train", *DS, "--resume", "{d}/run.npz", "--epochs", "3"],
     r"other settings \{'epochs': \(2, 3\)\} .* a cosine over 2 epochs: resume with --epochs 2"),
]


@pytest.mark.parametrize("argv,words", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_edge(argv, words, d, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # where ../shared/data exists: an explicit --data must not fall back on it
    # -q: a run's log lines (stderr, at INFO) left out, so that stderr holds the refusal alone
    assert main(["-q", *(a.replace("{d}", str(d)) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(words, err), err
    assert "loss" not in out and "step" not in out  # refused before any work (a dataset's bad label: at its scan)


def test_resume_compares_the_resolved_data_folder(d, capsys, monkeypatch):
    """``ds/`` and ``./ds`` are the folder the run was started on (given as an absolute
    path): each resumes it (they once were "other settings"), to the end of its epochs."""
    monkeypatch.chdir(d)
    for given in ("ds/", "./ds"):
        ckpt, log = d / f"resumed{len(given)}.npz", d / f"resumed{len(given)}.json"
        ckpt.write_bytes((d / "run.npz").read_bytes())
        assert main(["train", "--data", given, *DS[2:], "--resume", str(ckpt), "--log", str(log)]) == 0
        err = capsys.readouterr().err  # (what a run says goes to stderr, through logging)
        assert "resumed from" in err and f"data: {d / 'ds'}" in err
        assert [h["epoch"] for h in json.loads(log.read_text())] == [0, 1]


def test_train_prints_the_folder_it_used(d, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["train", "--data", str(d / "one"), *ONE]) == 0
    assert f"data: {d / 'one' / KITTI_BIN}" in capsys.readouterr().err


def test_a_real_bug_keeps_its_traceback(d, capsys, monkeypatch):
    """Only the checks' errors become one line: an error of the work itself (here a
    ValueError planted in the training step) reaches the caller with its traceback."""
    def broken(*args, **kwargs):
        raise ValueError("planted bug")

    monkeypatch.setattr(loop, "train_step", broken)
    argv = ["train", "--data", str(d / "one"), *ONE]
    assert main(argv + ["--out", str(d / "nodir" / "c.json")]) == 2  # a user's mistake: one line
    assert "nodir" in capsys.readouterr().err
    with pytest.raises(ValueError, match="planted bug"):  # ours: the traceback
        main(argv)


# (id, call, expected): expected is (exception class, regex) or a function of the result -> bool
CASES = [
    ("load_points columns 4.0", lambda d: load_points(d / "one" / KITTI_BIN, 4.0),
     (ValueError, r"columns must be a positive int, got 4\.0")),
    ("load_points not whole points", lambda d: load_points(d / "odd.bin", 4), (ValueError, r"35 bytes")),
    ("select_stages(3)", lambda d: select_stages(3), (TypeError, r"stage must be text")),
    ("ScanFolder sequences [8.0]", lambda d: data.ScanFolder(d / "kitti", sequences=[8.0]),
     (ValueError, r"sequences must be whole numbers such as 8 or '08', got 8\.0")),
    ("ScanFolder sequences [True]", lambda d: data.ScanFolder(d / "kitti", sequences=[True]),
     (ValueError, r"sequences must be whole numbers .*got True")),
    ("Loader seed 1.5", lambda d: data.Loader(data.ScanFolder(d / "ds"), 2, lambda p, r, g: 0, seed=1.5),
     (ValueError, r"seed must be a whole number >= 0 .*got 1\.5")),
    ("Loader seed True", lambda d: data.Loader(data.ScanFolder(d / "ds"), 2, lambda p, r, g: 0, seed=True),
     (ValueError, r"seed must be a whole number")),
    ("MinkUNet42 width True", lambda d: models.MinkUNet42(2, 19, width=True),
     (ValueError, r"width must be a positive finite number")),
    ("MinkUNet42 width inf", lambda d: models.MinkUNet42(2, 19, width=float("inf")),
     (ValueError, r"width must be a positive finite number")),
    ("MinkUNet42 seed 1.5", lambda d: models.MinkUNet42(2, 19, width=0.125, seed=1.5),
     (ValueError, r"seed must be a whole number >= 0")),
    ("MinkUNet42 seed True", lambda d: models.MinkUNet42(2, 19, width=0.125, seed=True),
     (ValueError, r"seed must be a whole number")),
    ("fit_dataset epochs 2.0", lambda d: tr.fit_dataset(None, None, [], 2.0), (ValueError, r"epochs must be a whole")),
    ("fit_dataset start_epoch True", lambda d: tr.fit_dataset(None, None, [], 2, start_epoch=True),
     (ValueError, r"start_epoch must be a whole number")),
    ("fit_scan steps 2.0", lambda d: loop.fit_scan(None, None, None, None, None, None, 2.0),
     (ValueError, r"steps must be a whole number >= 1")),
    ("a label file of unknown ids", lambda d: labels.load_semantickitti_labels(d / "badone" / KITTI_LABEL),
     (labels.DataError, r"badone/semantickitti_000000\.label: raw semantic ids .*77")),
    ("read_checkpoint cut short", lambda d: tr.read_checkpoint(d / "cut.npz"),
     (ValueError, r"cut\.npz: its contents are damaged or incomplete .*cannot be read as a numba-sc checkpoint")),
    ("read_checkpoint of a run", lambda d: tr.read_checkpoint(d / "run.npz")["epochs_done"], lambda n: n == 1),
]


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge(call, expected, d):
    if isinstance(expected, tuple):
        with pytest.raises(expected[0], match=expected[1]):
            call(d)
    else:
        assert expected(call(d))


def test_figures_and_book_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """From an installed wheel there is no prose, no results and no notebooks beside the
    package: `figures` once said "every quoted figure is the recorded one" after checking
    0 files, and `book` failed with a traceback (#34). Both now say why on one line, exit 2."""
    from numba_sc.__main__ import main
    from numba_sc.tools import book, results

    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.delenv("NUMBA_SC_RESULTS", raising=False)
    assert main(["figures"]) == 2
    out, err = capsys.readouterr()
    assert "every quoted figure" not in out
    assert len(err.strip().splitlines()) == 1 and "no numba-sc checkout here" in err, err
    monkeypatch.setattr(book, "NOTEBOOK_DIR", tmp_path / "notebooks")
    assert main(["book", "--out", str(tmp_path / "book")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no notebooks in" in err, err
    assert not (tmp_path / "book").exists()
