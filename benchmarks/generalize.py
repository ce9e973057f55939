"""Does a network trained here generalize? The checkerboard split of issue #25, measured.

Only one labelled scan is shared, so it is split into a checkerboard of 10 m squares
(``numba_sc.train.checkerboard``): the network trains on the points of one colour and
is scored on the other, ground it has never seen. Both colours hold the same classes.

Two recipes, run in one process on the same split, scored the same way (point
accuracy, per-class IoU, and the mIoU over the classes present in both halves):

* ``baseline``: today's loop (``fit_scan``'s step): MinkUNet42, AdamW without weight
  decay, no augmentation, the features ``scan_tensor`` builds (centred x, y, z and
  remission: a voxel's absolute position is one of its features, so the network can
  learn "where" instead of "what");
* ``augmented``: features that do not encode the position on the ground (remission and
  height z only), every step on a freshly augmented copy of the training points
  (rotation about the vertical axis, flips, scaling, jitter): ``numba_sc.train.run.prepare_scan``,
  what ``numba-sc train --epochs`` runs; weight decay, a cosine schedule;
* ``weighted``: ``augmented``, with the loss of each class weighted by
  ``1 / sqrt(its share of the training voxels)`` (normalized to a mean of 1), so that
  thin, rare classes (poles, signs, people) are not drowned by road and vegetation.

Run on a GPU (``. benchmarks/gpu_env.sh`` first), e.g.
``python3 benchmarks/generalize.py --out benchmarks/results/generalize.json``.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from common import find_data, recorded


def _score(model, x, inverse, point_target, classes):
    from numba_sc import train

    pred = train.predict(model, x)[np.asarray(inverse)]
    return train.evaluate(pred, point_target, classes=classes)


def run(recipe, points, raw, mask, steps, lr, width, seed, log):
    import numba_sc as ns
    from numba_sc import train
    from numba_sc.core.backend import to_device
    from numba_sc.train import labels as lb, optim, run

    on_gpu = ns.gpu_present()
    tr_pts, ev_pts = points[mask], points[~mask]
    tr_t, ev_t = lb.learning_map(raw[mask]), lb.learning_map(raw[~mask])
    classes = sorted((set(np.unique(tr_t)) & set(np.unique(ev_t))) - {lb.IGNORE_INDEX})
    model = ns.models.MinkUNet42(4 if recipe == "baseline" else len(run.FEATURES), lb.NUM_CLASSES, width=width,
                                 seed=seed)
    if on_gpu:
        model.cuda()
    if recipe == "baseline":
        x, target, _, _ = train.scan_tensor(tr_pts, raw[mask], 0.05)
        xe, _, inv_e, _ = train.scan_tensor(ev_pts, raw[~mask], 0.05)
        opt = optim.AdamW(model.trainable_parameters(), lr=lr, weight_decay=0.0)
    else:  # the recipe of numba_sc.train.run: remission and height, augmented every step
        xe, _, inv_e, _ = run.prepare_scan(ev_pts, raw[~mask], None, augmentation=False, device=on_gpu)
        opt = optim.AdamW(model.trainable_parameters(), lr=lr, weight_decay=1e-2)
    weight = None
    if recipe == "weighted":
        _, t0_target, _, _ = run.prepare_scan(tr_pts, raw[mask], None, augmentation=False)
        counts = np.bincount(t0_target[t0_target != lb.IGNORE_INDEX], minlength=lb.NUM_CLASSES).astype(np.float64)
        w = np.where(counts > 0, 1.0 / np.sqrt(np.maximum(counts, 1) / counts.sum()), 0.0)
        w = np.where(counts > 0, w / w[counts > 0].mean(), 1.0).astype(np.float32)
        weight = to_device(w) if on_gpu else w
    rng = np.random.default_rng(seed)
    history, t0 = [], time.perf_counter()
    for step in range(steps):
        if recipe != "baseline":
            opt.lr = optim.cosine_lr(step, steps, lr, warmup=min(10, steps))
            x, target, _, _ = run.prepare_scan(tr_pts, raw[mask], rng, device=on_gpu)
        loss = train.train_step(model, x, target, opt, weight=weight)
        if step % 50 == 0 or step == steps - 1:
            r = _score(model, xe, inv_e, ev_t, classes)
            history.append({"step": step, "loss": float(loss), "eval_accuracy": r["accuracy"], "eval_miou": r["miou"],
                            "seconds": time.perf_counter() - t0})
            log(f"{recipe:9s} step {step:4d}  loss {float(loss):.3f}  unseen squares: accuracy "
                f"{r['accuracy']:.3f}  mIoU {r['miou']:.3f}  ({history[-1]['seconds']:.0f} s)")
    final = _score(model, xe, inv_e, ev_t, classes)
    fit = None
    if recipe == "baseline":
        fit = train.scores(model, x, *train.scan_tensor(tr_pts, raw[mask], 0.05)[2:])
    return {"recipe": recipe, "classes": [int(c) for c in classes], "history": history,
            "accuracy": final["accuracy"], "miou": final["miou"], "iou": final["iou"],
            "train_points": int(mask.sum()), "eval_points": int((~mask).sum()),
            "train_fit": None if fit is None else {"accuracy": fit[0], "miou": fit[1]}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder with semantickitti_000000.bin/.label")
    ap.add_argument("--recipes", default="baseline,augmented,weighted")
    ap.add_argument("--steps", type=int, default=450, help="steps of the augmented recipes (default 450)")
    ap.add_argument("--baseline-steps", type=int, default=100, help="steps of the baseline (default 100)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    from numba_sc import train
    from numba_sc.train import labels as lb

    data = find_data(args.data)
    points = np.fromfile(data / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    raw = lb.load_semantickitti_labels(data / "semantickitti_000000.label")
    mask = train.checkerboard(points, 10.0)
    results = {}
    for recipe in args.recipes.split(","):
        steps = args.baseline_steps if recipe == "baseline" else args.steps
        results[recipe] = run(recipe, points, raw, mask, steps, args.lr, args.width, args.seed,
                              lambda s: print(s, flush=True))
    classes = results[next(iter(results))]["classes"]
    table = train.iou_table({k: {"iou": v["iou"], "accuracy": v["accuracy"], "miou": v["miou"]}
                             for k, v in results.items()}, classes=classes)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"recorded": recorded(args.note), "split": "checkerboard 10 m, train on even squares",
                       "results": results, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
