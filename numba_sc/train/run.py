"""Training over a dataset: epochs of batches, evaluation, checkpoints that resume exactly.

:mod:`numba_sc.train.loop` is one step and one scan; this module is the run a
researcher starts on their data (``numba-sc train --data ROOT --epochs E``)::

    scans  = data.ScanFolder(root, split="train")          # what is on disk
    loader = data.Loader(scans, batch_size, prepare_scan)  # batches, prepared in threads
    for epoch in range(start, epochs):                     # fit_dataset
        for batch in loader:                               #   a step per batch (loop.train_step)
            ...
        evaluate on the held-out scans, save a checkpoint  #   per-class IoU, numba_sc.save

**What a scan becomes** (:func:`prepare_scan`): its points are augmented (a
random rotation about the vertical axis, flips, scaling, jitter:
:mod:`numba_sc.train.augment`), voxelized, and each voxel gets two features,
the mean remission and the mean height of its points. Absolute x and y are left
out on purpose: a network that sees them can learn *where* things were in the
training scans instead of *what* they look like (the checkerboard experiment,
``benchmarks/generalize.py``, measures the difference).

**Resuming exactly.** A checkpoint holds the model's and the optimizer's state
dicts, the number of epochs done, the history, and the run's settings. The
loader draws every scan's augmentation from ``(seed, epoch, index)`` and its
order from ``(seed, epoch)``, and the learning rate is a function of the step,
so a run resumed from the checkpoint of epoch e continues with the very losses
the uninterrupted run had.

**Mixed precision and several GPUs.** The step is a
:class:`numba_sc.train.trainer.Trainer`'s: ``Trainer(model, optimizer, amp=True)``
trains in float16 with float32 master weights and a dynamic loss scale
(:mod:`numba_sc.train.amp`; the checkpoint then holds the full-precision
weights and the scale); ``Trainer(..., comm=...)`` with a
:class:`numba_sc.train.parallel.ShardedLoader` is one rank of a data-parallel
run (:mod:`numba_sc.train.parallel`), where only rank 0 prints, evaluates and
saves.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from . import augment
from . import labels as lb
from .checkpoint import load, save
from .loop import evaluate, predict
from .trainer import Trainer
from ..core.backend import to_device
from ..core.conventions import is_int, whole_number
from ..core.files import atomic_write, write_text
from ..core.device import gpu_present, simulating
from ..core.tensor import SparseTensor
from ..coords.voxelization import voxelize

FEATURES = ("remission", "height")  # what prepare_scan gives each voxel


def scan_features(points) -> np.ndarray:
    """Per-point features that say what a point is, not where it is on the ground:
    remission and height (z, metres). float32 (N, 2)."""
    points = np.asarray(points)
    return np.stack([points[:, 3], points[:, 2]], axis=1).astype(np.float32)


def prepare_scan(points, raw_labels, rng, voxel_size=0.05, augmentation=True, device=False):
    """One scan as training data: ``(x, voxel_target, inverse, point_target)``.

    ``points`` (N, 4) x, y, z, remission; ``raw_labels`` SemanticKITTI's label words
    (or None: the targets are then all ignored); ``rng`` draws the augmentation
    (:mod:`numba_sc.train.augment`), none when ``augmentation`` is False.
    ``device``: put the tensor and the target on the GPU."""
    points = np.asarray(points, np.float32)
    if points.ndim != 2 or points.shape[1] < 4:
        raise ValueError(f"points must be (N, 4): x, y, z, remission, got {points.shape}")
    if augmentation:
        rng = augment.as_rng(rng)  # once: each step draws on from the one generator
        points = augment.jitter(augment.scale(augment.flip(augment.rotate_z(points, rng), rng), rng, 0.9, 1.1),
                                rng, 0.01, 0.05)
    point_target = (np.full(len(points), lb.IGNORE_INDEX, np.int64) if raw_labels is None
                    else lb.learning_map(raw_labels))
    v = voxelize(np.ascontiguousarray(points[:, :3]), voxel_size, features=scan_features(points),
                 backend="reference")
    target = lb.voxel_labels(point_target, v.inverse, lb.NUM_CLASSES, num_voxels=len(v))
    coords, f = v.coords, v.features
    if device:
        coords, f, target = to_device(coords), to_device(f), to_device(target)
    return SparseTensor(coords, f), target, v.inverse, point_target


def evaluate_scans(model, scans, voxel_size=0.05, device=False, backend=None, dtype=None):
    """Per-class IoU over every point of every scan of ``scans`` (a
    :class:`numba_sc.train.data.ScanFolder` with labels), no augmentation.
    ``dtype``: the features' dtype the model computes in (float16 for a model
    trained with mixed precision; default float32)."""
    pred_all, target_all = [], []
    for i in range(len(scans)):
        points, raw = scans[i]
        if raw is None:
            raise ValueError(f"scan {scans.names[i]} has no labels: evaluation needs labelled scans")
        x, _, inverse, point_target = prepare_scan(points, raw, None, voxel_size, False, device)
        if dtype is not None and np.dtype(dtype) != x.features.dtype:
            x = x.with_features(x.features.astype(dtype))
        pred_all.append(predict(model, x, backend)[np.asarray(inverse)])
        target_all.append(point_target)
    return evaluate(np.concatenate(pred_all), np.concatenate(target_all))


def fit_dataset(model, optimizer, loader, epochs, schedule=None, start_epoch=0, history=None, save_to=None,
                eval_scans=None, settings=None, backend=None, log_every=10, print_=None, trainer=None):
    """Train ``model`` for epochs ``start_epoch .. epochs - 1`` over ``loader``'s batches
    (each a :class:`numba_sc.train.data.Batch` of :func:`prepare_scan` results).

    ``schedule(step) -> lr`` (the step counted from the run's start). After each
    epoch: the mean loss, scans per second and (with ``eval_scans``) the per-class
    IoU of the held-out scans go into the history, printed; with ``save_to`` a
    checkpoint is written there (:func:`numba_sc.save`), from which :func:`resume`
    continues exactly. Returns the history: one dict per epoch, with every step's loss.

    ``trainer``: the :class:`numba_sc.train.trainer.Trainer` that runs each step
    (mixed precision, one rank of several); default the plain step on ``model``
    and ``optimizer``. On a rank other than 0 nothing is printed, evaluated or
    saved."""
    epochs = whole_number(epochs, "epochs", 1)
    start_epoch = whole_number(start_epoch, "start_epoch")
    log_every = whole_number(log_every or 0, "log_every")  # (0 or None: no step is printed)
    history = list(history or [])
    trainer = trainer or Trainer(model, optimizer, backend=backend)
    print_ = print_ or (lambda s: print(s, flush=True))
    if trainer.rank != 0:
        print_, save_to, eval_scans = (lambda s: None), None, None
    steps_per_epoch = len(loader)
    for epoch in range(start_epoch, epochs):
        loader.epoch = epoch
        losses, t0, scans0 = [], time.perf_counter(), trainer.scans
        waited0 = loader.waited
        for k, batch in enumerate(loader):
            step = epoch * steps_per_epoch + k
            if schedule is not None:
                optimizer.lr = schedule(step)
            loss = trainer.step(batch.tensor, batch.concat(0), scans=len(batch))
            if loss is None:
                print_(f"epoch {epoch:3d}  batch {k + 1:4d}: no labelled point, skipped")
                continue
            losses.append(float(loss))
            scans = trainer.scans - scans0
            if log_every and (k % log_every == 0 or k == steps_per_epoch - 1):
                rate = scans / (time.perf_counter() - t0)
                print_(f"epoch {epoch:3d}  batch {k + 1:4d}/{steps_per_epoch}  loss {losses[-1]:.4f}  "
                       f"{rate:.1f} scans/s")
        seconds = time.perf_counter() - t0
        rec = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else None, "losses": losses, "seconds": seconds,
               "scans_per_second": (trainer.scans - scans0) / seconds, "waited_for_data": loader.waited - waited0}
        if trainer.scaler is not None:
            rec.update(loss_scale=trainer.scaler.scale, skipped_steps=trainer.scaler.skipped)
        if eval_scans is not None:
            r = evaluate_scans(model, eval_scans, device=device_of_run(), backend=backend, dtype=trainer.dtype)
            rec.update(eval_accuracy=r["accuracy"], eval_miou=r["miou"], eval_iou=r["iou"])
        history.append(rec)
        print_(f"epoch {epoch:3d} done: mean loss {rec['loss'] if rec['loss'] is None else round(rec['loss'], 4)}, "
               f"{rec['scans_per_second']:.1f} scans/s, "
               f"waited {rec['waited_for_data']:.1f} s for data"
               + (f"; held-out accuracy {rec['eval_accuracy']:.3f}, mIoU {rec['eval_miou']:.3f}"
                  if eval_scans is not None else ""))
        if save_to is not None:
            save({**trainer.state_dict(), "epochs_done": epoch + 1, "history": history,
                  "settings": dict(settings or {})}, save_to)
    return history


def read_checkpoint(path) -> dict:
    """The checkpoint at ``path`` that :func:`fit_dataset` wrote, read and checked, not yet
    loaded into anything (so its settings can be compared first).

    A missing file raises FileNotFoundError; a damaged one (cut short, of another
    kind) or a checkpoint of something other than a training run raises a
    ValueError naming the file."""
    try:
        ckpt = load(path)
    except (FileNotFoundError, IsADirectoryError, ValueError):
        raise  # numba_sc.load names the file and says what it holds instead
    except OSError as e:  # (a file it may not read, say: load reports every damaged file itself)
        raise ValueError(f"{path} cannot be read as a numba-sc checkpoint ({type(e).__name__}: {e}); it is cut "
                         "short or another kind of file: resume from a checkpoint numba-sc train --save "
                         "wrote") from e
    for key in ("model", "optimizer", "epochs_done"):
        if key not in ckpt:
            raise ValueError(f"{path} is a checkpoint but not of a training run (no {key!r}); write one with "
                             "numba-sc train --save")
    done = ckpt["epochs_done"]
    if not is_int(done) or done < 0:
        raise ValueError(f"{path}: epochs_done must be a whole number >= 0, got {done!r}")
    if not isinstance(ckpt.get("settings", {}), dict):
        raise ValueError(f"{path}: settings must be a dict, got {type(ckpt['settings']).__name__}")
    return ckpt


def resume(checkpoint, model, optimizer, trainer=None):
    """Load a checkpoint :func:`fit_dataset` wrote (a path, or what
    :func:`read_checkpoint` read) into ``model`` and ``optimizer`` (in place), through
    ``trainer`` when given (with amp: into the float32 masters, and the loss scale);
    returns ``(epochs done, history, settings)``."""
    ckpt = checkpoint if isinstance(checkpoint, dict) else read_checkpoint(checkpoint)
    if trainer is not None:
        trainer.load_state_dict(ckpt)
    else:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    return int(ckpt["epochs_done"]), list(ckpt.get("history", [])), dict(ckpt.get("settings", {}))


def write_log(history, path):
    """The history as JSON (every step's loss; per epoch the mean, speed and scores) and,
    when matplotlib is there, a plot of the loss and the held-out mIoU per epoch beside it
    (``path`` with ``.png``). Both are written atomically: a kill leaves the old file or
    the new one."""
    path = write_text(path, json.dumps(history, indent=1), name="log")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return None
    fig, ax = plt.subplots(figsize=(5, 3))
    epochs = [h["epoch"] + 1 for h in history]
    ax.plot(epochs, [h["loss"] for h in history], "o-", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    if any("eval_miou" in h for h in history):
        ax2 = ax.twinx()
        ax2.plot(epochs, [h.get("eval_miou", np.nan) for h in history], "s--", color="C1", label="held-out mIoU")
        ax2.set_ylabel("mIoU")
    fig.tight_layout()
    png = path.with_suffix(".png")
    atomic_write(png, lambda f: fig.savefig(f, format="png", dpi=100), name="log")
    plt.close(fig)
    return png


def device_of_run():
    """Whether a run's tensors go to the GPU (a GPU present and not the simulator)."""
    return gpu_present() and not simulating()


__all__ = ["FEATURES", "device_of_run", "evaluate_scans", "fit_dataset", "prepare_scan", "read_checkpoint", "resume",
           "scan_features", "write_log"]
