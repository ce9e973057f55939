#!/usr/bin/env python
"""Data-parallel training on two GPUs of one machine, and mixed precision on one.

Needs two CUDA GPUs with CuPy and NCCL (the GPU machine; never CI)::

    . benchmarks/gpu_env.sh
    python3 benchmarks/data_parallel.py --out benchmarks/results/data_parallel.json

The script starts two processes (ranks) of itself with ``numba_sc.train.parallel.spawn``, the
launcher of ``numba-sc train --gpus N``; each selects its GPU and joins NCCL through CuPy. The
data: ``--crops`` crops of the SemanticKITTI scan (squares of ``--crop-size`` metres around
points drawn with a fixed seed), each scan of a batch augmented by its own generator
``[seed, epoch, index]`` (``numba_sc.train.run.prepare_scan``), so every run sees the same
batches. MinkUNet42 (width 1, the two features of ``prepare_scan``), fp32 unless said.

1. **Equality.** The gradients at the initial weights on one global batch of 4 scans: one GPU
   (the tape on the whole batch) against two GPUs with 2 scans each (``Trainer`` with NCCL: the
   labelled count all-reduced, synced BatchNorm, bucketed gradient all-reduce;
   ``Trainer.last_gradients``). Then the weights (BatchNorm's statistics included) after
   ``--steps`` steps from the same initial weights, one GPU (the plain step,
   ``loop.train_step``) against two, with AdamW (the run's optimizer) and with SGD (no
   per-weight normalization). Each difference is read beside a floor: the one-GPU step on the
   same batches with their scans in the other order (the same sums, added in another order).
   Recorded: ``||a - b|| / ||b||`` over all arrays at once, the largest and the median per
   array; whether the two ranks hold the same bits; the one-GPU run on GPU 1 against GPU 0.
2. **Throughput** of the training step, steady state: the step's wall time between device-wide
   synchronizes, median over ``--timed`` steps after ``--warmup``; scans per second of the
   global batch. One GPU with batches of 4; two GPUs with the same global batch (2 each: strong
   scaling) and with twice it (4 each: weak scaling). Efficiency = throughput on 2 GPUs /
   (2 x throughput on one). Each step's batch is collated afresh from prepared scans (new
   coordinates: every map is built again, as in training), outside the timed region.
3. **With the loader** (``ShardedLoader``, ``--workers`` threads per rank preparing the next
   batches from the crops): one GPU with batches of 4 and two GPUs with 8, each iteration timed
   (waiting for the batch included), and the loader's time waited per step (``Loader.waits``).
   The threads prepare *host* (NumPy) batches here, and a layer returns arrays of its input's
   kind, so each layer's output goes to the host and back: these times measure that, not a GPU
   step beside the loader. Then a check of what ``numba-sc train`` does on a GPU, device arrays
   made in the loader's threads: the batches equal those the main thread makes, and one GPU
   trains on them (steps done, or the error met).
4. **Mixed precision** on one GPU: the amp step (``Trainer(amp=True)``) timed after the fp32
   one (one block each, not interleaved), batches of 4, and the loss of both over the same steps.

Writes ``--out`` (JSON) with the device, date, command and commit (``common.recorded``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import CyclingScans, find_data, recorded, scan_crops, sync, write_json


# ------------------------------------------------------------------ the parent
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder with semantickitti_000000.bin/.label")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--crops", type=int, default=4, help="crops of the scan the batches are drawn from")
    ap.add_argument("--crop-size", type=float, default=20.0, help="crop square, metres (default 20)")
    ap.add_argument("--steps", type=int, default=5, help="steps of the equality runs (default 5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timed", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="loader threads per rank (default 4)")
    ap.add_argument("--out")
    ap.add_argument("--note", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from numba_sc.train import parallel

    with tempfile.TemporaryDirectory() as scratch:
        part = Path(scratch) / "rank0.json"
        argv = [a for a in sys.argv[1:]]
        t0 = time.perf_counter()
        status = parallel.spawn(args.gpus, [sys.executable, str(Path(__file__).resolve()), *argv, "--worker",
                                            "--part", str(part), "--scratch", scratch])
        if status != 0:
            print(f"a rank failed (status {status})", file=sys.stderr)
            return status
        result = json.loads(part.read_text())
    result["seconds"] = time.perf_counter() - t0
    result = {"recorded": recorded(args.note), **result}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    summary(result)
    return 0


def summary(r):
    e = r["equality"]
    g = e["gradients"]
    print(f"gradients at the initial weights, global batch 4: 2 GPUs vs 1 {g['two_vs_one']['rel_norm_all']:.2e} "
          f"(worst array {g['two_vs_one']['max_rel_norm']:.2e}); the batch reversed on 1 GPU vs 1 "
          f"{g['reversed_vs_one']['rel_norm_all']:.2e} ({g['reversed_vs_one']['max_rel_norm']:.2e})")
    for opt, w in e["weights"].items():
        print(f"weights after {r['config']['steps']} steps, {opt}: 2 GPUs vs 1 {w['two_vs_one']['rel_norm_all']:.2e} "
              f"(worst {w['two_vs_one']['max_rel_norm']:.2e}), reversed vs 1 {w['reversed_vs_one']['rel_norm_all']:.2e}"
              f" ({w['reversed_vs_one']['max_rel_norm']:.2e}), 1 GPU on GPU1 vs GPU0 "
              f"{w['one_gpu1_vs_gpu0']['rel_norm_all']:.2e}; ranks identical {w['ranks_identical']}")
    s = r["throughput"]["step"]
    for k, v in s["runs"].items():
        print(f"  {k:24s} {v['ms']:8.1f} ms/step  {v['scans_per_second']:6.1f} scans/s")
    print(f"  efficiency: strong {s['efficiency_strong']:.2f}, weak {s['efficiency_weak']:.2f}")
    for k, v in r["throughput"]["with_loader"]["runs"].items():
        print(f"  loader {k:17s} {v['ms']:8.1f} ms/step  {v['scans_per_second']:6.1f} scans/s  waited "
              f"{v['waited_ms_median']:.1f} ms/step (median)")
    print(f"  device arrays made in the loader's threads: {r['device_arrays_from_threads']}")
    a = r["amp"]
    print(f"  amp {a['amp']['ms']:.1f} ms/step vs fp32 {a['fp32']['ms']:.1f}: {a['speedup']:.2f}x; "
          f"scale {a['loss_scale']}, skipped {a['skipped']}")


# ------------------------------------------------------------------ a rank
def _prepare(points, raw, rng):
    from numba_sc.train import run as tr

    return tr.prepare_scan(points, raw, rng, device=True)


def _model(opt_name, comm, amp=False):
    from numba_sc import models
    from numba_sc.train import labels, optim
    from numba_sc.train import run as tr
    from numba_sc.train.trainer import Trainer

    model = models.MinkUNet42(len(tr.FEATURES), labels.NUM_CLASSES, width=1.0, seed=0).cuda()
    if opt_name == "AdamW":
        opt = optim.AdamW(model.trainable_parameters(), lr=1e-3, weight_decay=1e-2)
    else:
        opt = optim.SGD(model.trainable_parameters(), lr=0.02, momentum=0.9)
    return Trainer(model, opt, comm=comm, amp=amp)


def _steps(trainer, batches, n, warmup=0):
    """``n`` steps on ``batches(k)`` (a list of prepared scans, collated here, untimed);
    returns the losses and the timed steps' milliseconds (after ``warmup``)."""
    from numba_sc.train import data

    losses, ms = [], []
    for k in range(n):
        b = data.collate_items(batches(k))
        sync()
        t0 = time.perf_counter()
        loss = trainer.step(b.tensor, b.concat(0), scans=len(b))
        sync()
        if k >= warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss)
    return losses, ms


def _rate(ms, scans):
    m = statistics.median(ms)
    return {"ms": m, "ms_all": [round(v, 2) for v in ms], "scans_per_batch": scans, "scans_per_second": scans / m * 1e3}


def _compare(a, b):
    """``a`` against the reference ``b`` (name -> array): the difference of everything at once
    (all arrays as one vector; BatchNorm's step counters left out), and the largest per array."""
    names = [k for k in b if not k.endswith("num_batches_tracked")]
    got = [np.asarray(a[k], np.float64).ravel() for k in names]
    want = [np.asarray(b[k], np.float64).ravel() for k in names]
    rel = [np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30) for g, w in zip(got, want)]
    worst = int(np.argmax(rel))
    g, w = np.concatenate(got), np.concatenate(want)
    return {"rel_norm_all": float(np.linalg.norm(g - w) / np.linalg.norm(w)),
            "max_rel_norm": float(rel[worst]), "worst": names[worst], "median_rel_norm": float(np.median(rel)),
            "identical_arrays": int(sum(np.array_equal(x, y) for x, y in zip(got, want))), "arrays": len(names)}


def _gradients_one(items):
    """One GPU's gradients at the initial weights on the batch ``items``: the tape, the mean loss."""
    from numba_sc import nn
    from numba_sc.core.backend import to_host
    from numba_sc.train import data
    from numba_sc.train.loss import cross_entropy

    t = _model("SGD", None)
    b = data.collate_items(items)
    t.model.train()
    with nn.Tape() as tape:
        y = t.model(b.tensor)
    _, g = cross_entropy(y.features, b.concat(0))
    return {k: to_host(v) for k, v in tape.backward(y, g).items()}


def _host(items):
    """Prepared scans with their arrays copied to the host (to compare)."""
    from numba_sc.core.backend import to_host

    return [(to_host(x.coords), to_host(x.features), to_host(t)) for x, t, *_ in items]


def worker(args):
    import cupy

    import numba_sc
    from numba_sc.core.backend import to_host
    from numba_sc.train import parallel

    comm = parallel.connect(parallel.placement_from_environment())  # this rank's GPU, NCCL
    rank, size, solo = comm.rank, comm.size, parallel.Solo()
    scratch = Path(args.scratch)
    log = (lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True)) if rank == 0 else (lambda s: None)
    crops = scan_crops(find_data(args.data), args.crops, args.crop_size)
    n_batches = max(args.steps, 2)
    scans = CyclingScans(crops, 4 * n_batches)
    # the prepared scans of global batches of 4 (as Loader prepares item i of epoch 0); the timed
    # runs cycle through them, each step collating a new batch tensor (its maps built again)
    items = [_prepare(*scans[i], np.random.default_rng([0, 0, i])) for i in range(4 * n_batches)]
    voxels = [int(len(it[0])) for it in items[:4]]
    log(f"{len(crops)} crops, {len(items)} prepared scans, voxels of the first batch {voxels}")

    def batch4(k):  # global batch k of 4 scans
        k %= n_batches
        return items[4 * k:4 * k + 4]

    def reversed4(k):  # the same batch, its scans in the other order: the same sums, in another order
        return batch4(k)[::-1]

    def share(k):  # this rank's share of it
        return [batch4(k)[i] for i in np.array_split(np.arange(4), size)[rank]]

    def barrier():
        comm.all_reduce(cupy.ones(1, np.float32))
        cupy.cuda.runtime.deviceSynchronize()

    def exchanged(name, state):
        """Write ``state``; after the barrier rank 0 reads rank 1's."""
        numba_sc.save(state, scratch / f"{name}_rank{rank}.npz")
        barrier()
        return numba_sc.load(scratch / f"{name}_rank1.npz") if rank == 0 else None

    out = {"config": {"gpus": size, "crops": args.crops, "crop_size_m": args.crop_size, "steps": args.steps,
                      "warmup": args.warmup, "timed": args.timed, "workers": args.workers, "net": "MinkUNet42",
                      "width": 1.0, "voxels_first_batch": voxels, "nccl": cupy.cuda.nccl.get_version()}}
    # 1. equality: the gradients at the initial weights, then the weights after --steps steps -----
    g_one, g_rev = _gradients_one(batch4(0)), _gradients_one(reversed4(0))
    t = _model("SGD", comm)
    t.optimizer.lr = 0.0  # (the step only to get the summed gradients)
    _steps(t, share, 1)
    g_two = {k: to_host(v) for k, v in t.last_gradients.items()}
    g_two_other = exchanged("grads_two", g_two)
    eq = {"gradients": {}, "weights": {}}
    if rank == 0:
        eq["gradients"] = {"two_vs_one": _compare(g_two, g_one), "reversed_vs_one": _compare(g_rev, g_one),
                           "ranks_identical": all(np.array_equal(g_two_other[k], g_two[k]) for k in g_two)}
        log(f"gradients: {eq['gradients']}")
    for opt_name in ("AdamW", "SGD"):
        one = _model(opt_name, solo)
        losses_one, ms_one = _steps(one, batch4, args.steps)
        rev = _model(opt_name, solo)
        losses_rev, _ = _steps(rev, reversed4, args.steps)
        two = _model(opt_name, comm)
        losses_two, _ = _steps(two, share, args.steps)
        w_one, w_two = one.model_state_dict(), two.model_state_dict()
        other_one = exchanged(f"one_{opt_name}", w_one)
        other_two = exchanged(f"two_{opt_name}", w_two)
        if rank == 0:
            eq["weights"][opt_name] = {
                "two_vs_one": _compare(w_two, w_one), "reversed_vs_one": _compare(rev.model_state_dict(), w_one),
                "one_gpu1_vs_gpu0": _compare(other_one, w_one),
                "ranks_identical": all(np.array_equal(other_two[k], w_two[k]) for k in w_two),
                "losses_one": losses_one, "losses_reversed": losses_rev, "losses_two": losses_two,
                "first_steps_ms_one": ms_one}
            log(f"weights {opt_name}: two vs one {eq['weights'][opt_name]['two_vs_one']}, reversed vs one "
                f"{eq['weights'][opt_name]['reversed_vs_one']}")
    out["equality"] = eq
    # 2. the step's throughput ------------------------------------------------------------------
    n = args.warmup + args.timed
    runs = {}
    t = _model("AdamW", solo)  # (each rank alone on its GPU; rank 0's times are recorded)
    runs["1 GPU, batch 4"] = _rate(_steps(t, batch4, n, args.warmup)[1], 4)
    barrier()
    t = _model("AdamW", comm)
    runs["2 GPUs, global batch 4"] = _rate(_steps(t, share, n, args.warmup)[1], 4)
    t = _model("AdamW", comm)
    runs["2 GPUs, global batch 8"] = _rate(_steps(t, lambda k: batch4(2 * k + rank), n, args.warmup)[1], 8)
    one = runs["1 GPU, batch 4"]["scans_per_second"]
    out["throughput"] = {"step": {
        "runs": runs,
        "efficiency_strong": runs["2 GPUs, global batch 4"]["scans_per_second"] / (2 * one),
        "efficiency_weak": runs["2 GPUs, global batch 8"]["scans_per_second"] / (2 * one)}}
    log(f"step throughput: {[(k, round(v['scans_per_second'], 2)) for k, v in runs.items()]}")
    # 3. with the loader: worker threads prepare host arrays, the step moves them --------------
    def host_prepare(points, raw, rng):
        from numba_sc.train import run as tr

        return tr.prepare_scan(points, raw, rng, device=False)

    loader_runs = {}
    for name, c, batch in (("1 GPU, batch 4", solo, 4), ("2 GPUs, global batch 8", comm, 8)):
        barrier()
        t = _model("AdamW", c)
        loader = parallel.ShardedLoader(CyclingScans(crops, batch * n), batch, host_prepare, rank=c.rank, size=c.size,
                                        seed=1, shuffle=False, workers=args.workers, prefetch=2)
        ms, it = [], iter(loader)
        for k in range(n):
            sync()
            t0 = time.perf_counter()
            b = next(it)
            t.step(b.tensor, b.concat(0), scans=len(b))
            sync()
            if k >= args.warmup:
                ms.append((time.perf_counter() - t0) * 1e3)
        waits = [w * 1e3 for w in loader.waits[args.warmup:]]
        loader_runs[name] = {**_rate(ms, batch), "waited_ms_median": statistics.median(waits),
                             "waited_ms_all": [round(w, 2) for w in waits],
                             "waited_fraction": sum(waits) / sum(ms)}
    out["throughput"]["with_loader"] = {
        "prepare": "in the loader's threads, on the host (NumPy); the step copies the batch to the GPU",
        "runs": loader_runs,
        "efficiency_weak": loader_runs["2 GPUs, global batch 8"]["scans_per_second"]
        / (2 * loader_runs["1 GPU, batch 4"]["scans_per_second"])}
    log("with the loader: " + ", ".join(f"{k}: {v['scans_per_second']:.2f} scans/s, waited "
                                        f"{v['waited_ms_median']:.1f} ms" for k, v in loader_runs.items()))
    # 3b. device arrays made in the loader's threads (as numba-sc train --data does on a GPU), one
    # GPU: are the batches those the main thread makes, and does training on them stay finite?
    barrier()
    check = {"batches_equal": None, "steps_done": 0, "error": None}
    try:
        dev = parallel.ShardedLoader(CyclingScans(crops, 4 * n), 4, _prepare, seed=1, shuffle=False,
                                     workers=args.workers, collate=lambda its: its)
        ref = parallel.ShardedLoader(CyclingScans(crops, 4 * n), 4, _prepare, seed=1, shuffle=False, workers=0,
                                     collate=lambda its: its)
        check["batches_equal"] = all(
            all(all(np.array_equal(p, q) for p, q in zip(x, y)) for x, y in zip(_host(a), _host(b)))
            for a, b in zip(dev, ref))
        t = _model("AdamW", solo)
        loader = parallel.ShardedLoader(CyclingScans(crops, 4 * n), 4, _prepare, seed=1, shuffle=False,
                                        workers=args.workers)
        for b in loader:
            t.step(b.tensor, b.concat(0), scans=len(b))
            check["steps_done"] += 1
    except Exception as e:  # noqa: BLE001 - recorded: what a user of train --data on a GPU would meet
        check["error"] = f"{type(e).__name__}: {e}"[:300]
    out["device_arrays_from_threads"] = check
    log(f"device arrays made in the loader's threads: {check}")
    # 4. mixed precision on one GPU --------------------------------------------------------------
    barrier()
    fp32 = _model("AdamW", solo)
    losses32, ms32 = _steps(fp32, batch4, n, args.warmup)
    half = _model("AdamW", solo, amp=True)
    losses16, ms16 = _steps(half, batch4, n + 1, args.warmup + 1)  # (one more warm-up: the fp16 kernels compile)
    out["amp"] = {"fp32": _rate(ms32, 4), "amp": _rate(ms16, 4),
                  "speedup": statistics.median(ms32) / statistics.median(ms16),
                  "loss_scale": half.scaler.scale, "skipped": half.scaler.skipped,
                  "losses_fp32": losses32, "losses_amp": losses16[:n]}
    log(f"amp: {out['amp']['speedup']:.2f}x, scale {half.scaler.scale}, skipped {half.scaler.skipped}")
    barrier()
    if rank == 0:
        write_json(args.part, out, indent=None, name="--part")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
