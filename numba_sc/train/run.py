"""Training over a dataset: epochs of batches, evaluation, checkpoints that resume exactly.

:mod:`numba_sc.train.loop` is one step and one scan; this module is the run a
researcher starts on their data (``numba-sc train fit --data ROOT --epochs E``)::

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
run (:mod:`numba_sc.train.parallel`), where only rank 0 reports, evaluates and
saves.
"""
from __future__ import annotations

import json
import logging
import time

import numpy as np

from . import augment
from . import labels as lb
from .checkpoint import load, save
from .loop import evaluate, predict
from .trainer import Trainer
from ..core.backend import to_device, to_host
from ..core.conventions import is_int, whole_number
from ..core.files import atomic_write, write_text
from ..core.device import gpu_present, simulating
from ..core.progress import bar
from ..core.tensor import SparseTensor
from ..coords.voxelization import voxelize

FEATURES = ("remission", "height")  # what prepare_scan gives each voxel

log = logging.getLogger(__name__)


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
    :class:`numba_sc.train.data.ScanFolder` with labels), no augmentation: the result of
    :func:`numba_sc.train.loop.evaluate`, plus ``"voxels"``, each class's number of
    held-out voxels (by their majority label), for :func:`eval_table`.
    ``dtype``: the features' dtype the model computes in (float16 for a model
    trained with mixed precision; default float32). A progress bar over the scans
    is drawn on stderr where bars are on (:mod:`numba_sc.core.progress`)."""
    pred_all, target_all = [], []
    voxels = np.zeros(lb.NUM_CLASSES, np.int64)
    for i in bar(range(len(scans)), desc="held-out scans", unit="scan", leave=False):
        points, raw = scans[i]
        if raw is None:
            raise ValueError(f"scan {scans.names[i]} has no labels: evaluation needs labelled scans")
        x, voxel_target, inverse, point_target = prepare_scan(points, raw, None, voxel_size, False, device)
        if dtype is not None and np.dtype(dtype) != x.features.dtype:
            x = x.with_features(x.features.astype(dtype))
        pred_all.append(predict(model, x, backend)[np.asarray(inverse)])
        target_all.append(point_target)
        vt = np.asarray(to_host(voxel_target))
        voxels += np.bincount(vt[vt != lb.IGNORE_INDEX], minlength=lb.NUM_CLASSES)[:lb.NUM_CLASSES]
    result = evaluate(np.concatenate(pred_all), np.concatenate(target_all))
    result["voxels"] = {name: int(n) for name, n in zip(lb.CLASS_NAMES, voxels)}
    return result


def eval_table(result) -> str:
    """One evaluation as a plain-text table: per class its IoU, its held-out voxels and
    points (classes with neither a point nor a prediction left out: their IoU is
    undefined), then the point accuracy and the mIoU. ``result``: what
    :func:`evaluate_scans` returns (without ``"voxels"``, that column says ``-``)."""
    cm = np.asarray(result["confusion"])
    voxels = result.get("voxels") or {}
    names = list(result["iou"])
    w = max(len(n) for n in names + ["point accuracy"])
    lines = [f"{'class':{w}s}  {'IoU':>6s}  {'voxels':>9s}  {'points':>9s}"]
    for c, name in enumerate(names):
        v = result["iou"][name]
        if v is None:
            continue
        n_vox = voxels.get(name)
        lines.append(f"{name:{w}s}  {v:6.3f}  {'-' if n_vox is None else f'{n_vox:,}':>9s}  {int(cm[c].sum()):>9,}")
    lines.append(f"{'point accuracy':{w}s}  {result['accuracy']:6.3f}")
    lines.append(f"{'mIoU':{w}s}  {result['miou']:6.3f}")
    return "\n".join(lines)


def fit_dataset(model, optimizer, loader, epochs, schedule=None, start_epoch=0, history=None, save_to=None,
                eval_scans=None, settings=None, backend=None, log_every=10, print_=print, trainer=None):
    """Train ``model`` for epochs ``start_epoch .. epochs - 1`` over ``loader``'s batches
    (each a :class:`numba_sc.train.data.Batch` of :func:`prepare_scan` results).

    ``schedule(step) -> lr`` (the step counted from the run's start). After each
    epoch: the mean loss, scans per second and (with ``eval_scans``) the per-class
    IoU of the held-out scans go into the history; with ``save_to`` a checkpoint is
    written there (:func:`numba_sc.save`), from which :func:`resume` continues
    exactly. Returns the history: one dict per epoch, with every step's loss.

    What the run says as it goes: a progress bar over its batches with an ETA and the
    last loss, on stderr where bars are on (:mod:`numba_sc.core.progress`); each
    epoch's summary on this module's logger at INFO, and every ``log_every``-th
    batch's loss at DEBUG (0 or None: none). Each evaluation's per-class IoU table
    (:func:`eval_table`) is the output a caller asked for with ``eval_scans``: it goes
    to ``print_`` (default ``print``; None: not printed, still in the history).

    ``trainer``: the :class:`numba_sc.train.trainer.Trainer` that runs each step
    (mixed precision, one rank of several); default the plain step on ``model``
    and ``optimizer``. On a rank other than 0 nothing is shown, evaluated or
    saved."""
    epochs = whole_number(epochs, "epochs", 1)
    start_epoch = whole_number(start_epoch, "start_epoch")
    log_every = whole_number(log_every or 0, "log_every")  # (0 or None: no step is logged)
    history = list(history or [])
    trainer = trainer or Trainer(model, optimizer, backend=backend)
    main_rank = trainer.rank == 0
    print_ = print_ or (lambda s: None)
    if not main_rank:
        print_, save_to, eval_scans = (lambda s: None), None, None
    steps_per_epoch = len(loader)
    # One bar for the run (its ETA is the run's end), renamed at each epoch.
    progress = bar(total=max(epochs - start_epoch, 0) * steps_per_epoch, unit="batch", disable=not main_rank)
    try:
        for epoch in range(start_epoch, epochs):
            loader.epoch = epoch
            progress.set_description(f"epoch {epoch + 1}/{epochs}")
            losses, t0, scans0 = [], time.perf_counter(), trainer.scans
            waited0 = loader.waited
            for k, batch in enumerate(loader):
                step = epoch * steps_per_epoch + k
                if schedule is not None:
                    optimizer.lr = schedule(step)
                loss = trainer.step(batch.tensor, batch.concat(0), scans=len(batch))
                progress.update(1)
                if loss is None:
                    if main_rank:
                        log.info("epoch %d/%d  batch %d: no labelled point, skipped", epoch + 1, epochs, k + 1)
                    continue
                losses.append(float(loss))
                progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                scans = trainer.scans - scans0
                if main_rank and log_every and (k % log_every == 0 or k == steps_per_epoch - 1):
                    rate = scans / (time.perf_counter() - t0)
                    log.debug("epoch %d/%d  batch %d/%d  loss %.4f  %.1f scans/s", epoch + 1, epochs, k + 1,
                              steps_per_epoch, losses[-1], rate)
            seconds = time.perf_counter() - t0
            rec = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else None, "losses": losses,
                   "seconds": seconds, "scans_per_second": (trainer.scans - scans0) / seconds,
                   "waited_for_data": loader.waited - waited0}
            if trainer.scaler is not None:
                rec.update(loss_scale=trainer.scaler.scale, skipped_steps=trainer.scaler.skipped)
            if eval_scans is not None:
                r = evaluate_scans(model, eval_scans, device=device_of_run(), backend=backend, dtype=trainer.dtype)
                rec.update(eval_accuracy=r["accuracy"], eval_miou=r["miou"], eval_iou=r["iou"],
                           eval_voxels=r["voxels"])
            history.append(rec)
            if main_rank:
                log.info("epoch %d/%d done: mean loss %s, %.1f scans/s, waited %.1f s for data%s", epoch + 1, epochs,
                         rec["loss"] if rec["loss"] is None else round(rec["loss"], 4), rec["scans_per_second"],
                         rec["waited_for_data"],
                         f"; held-out accuracy {rec['eval_accuracy']:.3f}, mIoU {rec['eval_miou']:.3f}"
                         if eval_scans is not None else "")
            if eval_scans is not None:
                progress.clear()  # (the table on stdout, the bar on stderr: lift the bar first on a terminal)
                print_(f"held-out scans after epoch {epoch + 1}/{epochs} ({len(eval_scans)} scans):\n{eval_table(r)}")
                progress.refresh()
            if save_to is not None:
                save({**trainer.state_dict(), "epochs_done": epoch + 1, "history": history,
                      "settings": dict(settings or {})}, save_to)
    finally:
        progress.close()
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
                         "short or another kind of file: resume from a checkpoint numba-sc train fit --save "
                         "wrote") from e
    for key in ("model", "optimizer", "epochs_done"):
        if key not in ckpt:
            raise ValueError(f"{path} is a checkpoint but not of a training run (no {key!r}); write one with "
                             "numba-sc train fit --save")
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
    (``path`` with ``.png``): one legend for both curves, whole epochs on the x axis.
    Both are written atomically: a kill leaves the old file or the new one."""
    path = write_text(path, json.dumps(history, indent=1), name="log")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.3))
    epochs = [h["epoch"] + 1 for h in history]  # (epoch e done = e + 1 passes over the training scans)
    lines = ax.plot(epochs, [np.nan if h["loss"] is None else h["loss"] for h in history], "o-",
                    label="training loss (mean over the epoch)")
    ax.set_xlabel("epochs done (passes over the training scans)")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (no epoch 1.5)
    if any("eval_miou" in h for h in history):
        ax2 = ax.twinx()
        lines += ax2.plot(epochs, [h.get("eval_miou", np.nan) for h in history], "s--", color="C1",
                          label="held-out mIoU")
        ax2.set_ylabel("held-out mIoU (0 to 1)")
        ax2.set_ylim(0, 1)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    ax.set_title(f"training run: {len(history)} epoch(s)", fontsize=9)
    fig.tight_layout()
    png = path.with_suffix(".png")
    atomic_write(png, lambda f: fig.savefig(f, format="png", dpi=100), name="log")
    plt.close(fig)
    return png


def device_of_run():
    """Whether a run's tensors go to the GPU (a GPU present and not the simulator)."""
    return gpu_present() and not simulating()


__all__ = ["FEATURES", "device_of_run", "eval_table", "evaluate_scans", "fit_dataset", "prepare_scan",
           "read_checkpoint", "resume", "scan_features", "write_log"]
