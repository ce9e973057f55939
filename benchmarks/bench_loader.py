#!/usr/bin/env python
"""The loader beside a GPU step, mixed precision against fp32, and device batches made in threads.

One GPU (CuPy; never CI). On the lent GPU machine, from the checkout's root::

    . benchmarks/gpu_env.sh
    python3 benchmarks/bench_loader.py --out benchmarks/results/loader.json

The data: ``--crops`` crops of the SemanticKITTI scan (squares of ``--crop-size`` metres
around points drawn with a fixed seed), cycled through; scan ``i`` of an epoch is augmented
by its own generator ``[seed, epoch, i]`` and becomes a *device* tensor
(``numba_sc.train.run.prepare_scan(..., device=True)``), as ``numba-sc train --data`` makes
its batches on a GPU: ``parallel.ShardedLoader`` (one rank), whose threads each select the
GPU of the thread that built it. MinkUNet42 (``--width``, the two features of
``prepare_scan``), AdamW, batches of ``--batch`` scans. ``benchmarks/data_parallel.py``
measured the loader with *host* batches (every layer's output then went to the host and
back); this script measures the path ``numba-sc train`` takes.

1. **The loader's wait.** For ``--workers`` 0, 1 and 2 threads (0: every batch prepared on
   the training thread, between steps), a fresh model trains ``--warmup`` + ``--timed``
   steps over the loader. Per step: ``wait`` (``Loader.waits``, what the loop waited in
   ``next(loader)``), ``step`` (the training step, wall clock until a device-wide
   synchronize) and ``iteration`` (the end of one step to the end of the next: wait + step +
   the loop's own time). Medians over the timed steps, ``waited_fraction`` (waits / iteration
   times) and whether every worker count gave the same losses. With 0 workers ``wait`` is the
   preparation's whole cost (augment, voxelize, copy to the GPU, collate): what the threads
   have to hide.
2. **Mixed precision against fp32**, timed call by call: ``common.interleaved`` (each round
   takes the two in a shuffled order; one untimed step, then ``--block`` timed ones; wall
   clock between device-wide synchronizes; medians). Each call trains its own model
   (``Trainer(amp=True)`` or fp32) on the next batch, collated beforehand from prepared
   scans (a new tensor every call: every map is built again, as in training; the collating
   itself is not timed). ``ratio`` = fp32 median / amp median; the spread is the ratio of
   each round's medians (``per_round``).
3. **Device batches made in the loader's threads**, a stress check: ``--stress-steps``
   steps from the same initial weights over the same batches, compared by loss (bitwise;
   the step is deterministic: ``reference_again`` shows the floor) against the batches made
   on the training thread (``workers=0``). A once-seen failure (non-finite logits on every
   row, ``data_parallel.json``'s notes) is looked for in:

   * ``loader_threads`` (repeated ``--stress-repeats`` times): 2 workers preparing device
     batches, as ``numba-sc train`` does (its threads on ``data.loader_stream``, the fix
     this check led to);
   * ``legacy_stream_threads`` (as often): the same with that fix switched off, the threads
     on the legacy default stream, as before it (``loader.json``'s ``loader_threads_*`` runs
     were made before the fix existed: they are these);
   * ``own_streams``: the threads on a stream of their own made here (one per thread),
     waited for before the batch is handed over (the fix as first tried);

   and in a probe of one suspected cause. CuPy's memory pool is shared by all threads of a
   process, its blocks kept per stream, and every thread's default stream is the same
   legacy stream: a block freed by the training thread can be handed at once to another
   thread. ``gmas.gemm_grouping.grouped_gemm_cuda`` frees the weights it gathered into
   group order (``take_weights_cuda``) as soon as it has their address, while GEMMs on its
   side streams (non-blocking: not ordered with the legacy stream) have still to read them;
   the training thread itself allocates nothing before its stream waits for those GEMMs,
   but another thread can. The probe runs the step beside a thread that takes blocks of
   random sizes from the pool and fills them with NaN, over and over (``Hammer``):

   * ``hammer``: that thread on the legacy stream, as a loader thread was before the fix;
   * ``hammer_weights_kept``: the same, with the gathered weights kept alive until the next
     layer's gather (by then the caller's stream has waited for the GEMMs that read them);
   * ``hammer_own_stream``: that thread on its own stream (its own blocks).

   Each run records its losses, a checksum of each batch (sums of coordinates, features and
   targets), the first step whose loss differs from the reference's, and the error met.

Sections are written to ``--out`` as they finish (``common.recorded``: device, date, command,
commit); ``--mark-timed-done PATH`` creates PATH once the timed sections are over, so that
other work (a test suite) can share the machine with the stress check alone. ``--workers``,
``--stress-*`` and the sizes are options; under the simulator (``NUMBA_ENABLE_CUDASIM=1``, no
GPU) the script runs as a smoke test of itself on tiny crops with the NumPy reference
layers (no timing in it means anything).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

import common
from common import CyclingScans, find_data, interleaved, recorded, scan_crops, write_json


# ------------------------------------------------------------------ the set-up
def _on_gpu():
    from numba_sc.core.device import gpu_present, simulating

    return gpu_present() and not simulating()


def _sync():
    """Wait for all work on the device, on every stream (``common.sync``)."""
    common.sync()


def _prepare(points, raw, rng):
    """What ``numba-sc train --data`` does with a scan: augmented, voxelized, on the device."""
    from numba_sc.train import run as tr

    return tr.prepare_scan(points, raw, rng, 0.05, True, _on_gpu())


def _trainer(width, amp=False):
    """MinkUNet42 from seed 0 with AdamW, as ``numba-sc train`` builds it."""
    from numba_sc import models
    from numba_sc.train import labels, optim
    from numba_sc.train import run as tr
    from numba_sc.train.trainer import Trainer

    model = models.MinkUNet42(len(tr.FEATURES), labels.NUM_CLASSES, width=width, seed=0)
    if _on_gpu():
        model.cuda()
    opt = optim.AdamW(model.trainable_parameters(), lr=1e-3, weight_decay=1e-2)
    return Trainer(model, opt, amp=amp, backend="cuda" if _on_gpu() else "reference")


def _loader(crops, args, batches, workers, prepare=_prepare, **kwargs):
    """``batches`` batches of ``args.batch`` scans, made as ``numba-sc train`` makes them (one rank)."""
    from numba_sc.train import parallel

    return parallel.ShardedLoader(CyclingScans(crops, args.batch * batches), args.batch, prepare, seed=1,
                                  shuffle=False, workers=workers, prefetch=args.prefetch, **kwargs)


def _median(v):
    return float(statistics.median(v)) if v else None


def _rounded(v, digits=3):
    return [round(float(x), digits) for x in v]


# ------------------------------------------------------------------ 1. the loader's wait
def loader_wait(args, crops, log):
    n = args.warmup + args.timed
    runs, losses = {}, {}
    for workers in args.workers:
        t = _trainer(args.width)
        loader = _loader(crops, args, n, workers)
        wait, step, iteration, ls = [], [], [], []
        _sync()
        t_prev = time.perf_counter()
        for b in loader:
            t1 = time.perf_counter()
            ls.append(t.step(b.tensor, b.concat(0), scans=len(b)))
            _sync()
            t2 = time.perf_counter()
            step.append((t2 - t1) * 1e3)
            iteration.append((t2 - t_prev) * 1e3)
            t_prev = t2
        wait = [w * 1e3 for w in loader.waits]
        w, s, it = wait[args.warmup:], step[args.warmup:], iteration[args.warmup:]
        runs[str(workers)] = {
            "workers": workers, "wait_ms": _median(w), "step_ms": _median(s), "iteration_ms": _median(it),
            "waited_fraction": sum(w) / sum(it), "scans_per_second": args.batch / _median(it) * 1e3,
            "first_wait_ms": wait[0], "wait_ms_all": _rounded(w), "step_ms_all": _rounded(s),
            "iteration_ms_all": _rounded(it)}
        losses[str(workers)] = ls
        r = runs[str(workers)]
        log(f"loader, {workers} worker(s): wait {r['wait_ms']:.1f} ms, step {r['step_ms']:.1f} ms, iteration "
            f"{r['iteration_ms']:.1f} ms per step (medians), waited {100 * r['waited_fraction']:.1f} %")
    first = next(iter(losses.values()))
    return {"runs": runs, "losses": losses,
            "same_losses_for_every_worker_count": all(v == first for v in losses.values())}


# ------------------------------------------------------------------ 2. amp against fp32
def amp_against_fp32(args, crops, log):
    from numba_sc.train import data

    calls = 1 + args.amp_warmup + args.rounds * (1 + args.block)  # (1: the step that compiles)
    kinds = ("fp32", "amp")
    n_items = args.batch * args.amp_batches
    items = [_prepare(*CyclingScans(crops, n_items)[i], np.random.default_rng([1, 0, i])) for i in range(n_items)]
    voxels = [int(x.coords.shape[0]) for x, *_ in items]

    def batch(k):
        k %= args.amp_batches
        return data.collate_items(items[args.batch * k:args.batch * (k + 1)])

    queued = {kind: deque(batch(k) for k in range(calls)) for kind in kinds}  # a fresh tensor per call
    trainers = {"fp32": _trainer(args.width), "amp": _trainer(args.width, amp=True)}
    losses = {kind: [] for kind in kinds}

    def step(kind):
        b = queued[kind].popleft()
        losses[kind].append(trainers[kind].step(b.tensor, b.concat(0), scans=len(b)))

    for kind in kinds:  # one untimed step each: the fp16 kernels compile
        step(kind)
    _sync()
    got = interleaved({kind: (lambda kind=kind: step(kind)) for kind in kinds}, args.rounds, block=args.block,
                      warmup=args.amp_warmup)
    f32, f16 = got["fp32"]["ms_all"], got["amp"]["ms_all"]
    b = args.block
    per_round = [statistics.median(f32[r * b:(r + 1) * b]) / statistics.median(f16[r * b:(r + 1) * b])
                 for r in range(args.rounds)]
    q = np.percentile(per_round, [0, 25, 50, 75, 100])
    scaler = trainers["amp"].scaler
    out = {"fp32_ms": got["fp32"]["ms"], "amp_ms": got["amp"]["ms"], "ratio": got["fp32"]["ms"] / got["amp"]["ms"],
           "per_round": {"min": q[0], "q25": q[1], "median": q[2], "q75": q[3], "max": q[4],
                         "all": _rounded(per_round)},
           "fp32_ms_iqr": list(np.percentile(f32, [25, 75])), "amp_ms_iqr": list(np.percentile(f16, [25, 75])),
           "fp32_ms_all": _rounded(f32, 2), "amp_ms_all": _rounded(f16, 2), "rounds": args.rounds,
           "block": args.block, "voxels_per_scan": voxels, "loss_scale": scaler.scale, "skipped": scaler.skipped,
           "losses_fp32": losses["fp32"], "losses_amp": losses["amp"]}
    log(f"amp {out['amp_ms']:.1f} ms vs fp32 {out['fp32_ms']:.1f} ms per step: fp32/amp {out['ratio']:.2f} "
        f"(rounds {q[0]:.2f}..{q[4]:.2f}), skipped {scaler.skipped}")
    return out


# ------------------------------------------------------------------ 3. the stress check
class Hammer:
    """A thread that takes device memory from CuPy's pool and fills it with NaN, over and over.

    Blocks of random sizes (1 KiB to 8 MiB), the last ``live`` of them kept, the oldest
    given back: so the thread keeps asking the pool for blocks, as a loader thread does
    (each scan it prepares is a few allocations), but far more often. Whatever block it is
    handed, it writes; a block some queued GPU work still reads shows up as NaN there.
    ``own_stream``: on a stream of its own (the pool then gives it blocks of that stream
    only) instead of the legacy default stream every thread shares. Without a GPU it fills
    NumPy arrays (a smoke test of this class, nothing more).
    """

    def __init__(self, own_stream=False, live=16, seed=7):
        self.own_stream, self.live, self.seed = own_stream, live, seed
        self.fills, self.error = 0, None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        from numba_sc.train import parallel

        device = parallel.current_device()
        self._thread = threading.Thread(target=self._run, args=(device,), name="numba-sc-hammer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self, device):
        try:
            from numba_sc.core.device import device_xp
            from numba_sc.train import parallel

            xp = device_xp()
            stream = contextlib.nullcontext()
            if device is not None:
                parallel.use_device(device)
                stream = xp.cuda.Stream(non_blocking=False) if self.own_stream else xp.cuda.Stream.null
            rng = np.random.default_rng(self.seed)
            held = deque(maxlen=self.live)
            with stream:
                while not self._stop.is_set():
                    a = xp.empty(int(2 ** rng.uniform(8, 21)), np.float32)  # 1 KiB .. 8 MiB
                    a.fill(np.nan)
                    held.append(a)
                    self.fills += 1
                    time.sleep(0)  # (let the training thread run)
                if device is not None:
                    xp.cuda.get_current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - recorded with the run
            self.error = f"{type(e).__name__}: {e}"[:300]


@contextlib.contextmanager
def weights_kept():
    """``grouped_gemm_cuda`` with its gathered weights kept alive until the next gather
    (by then the caller's stream waits for the GEMMs that read them): the probe of the
    suspected cause, the package itself untouched once the block ends."""
    from numba_sc.gmas import gemm_grouping as gg

    original, kept = gg.take_weights_cuda, []

    def take_and_keep(weight, order):
        out = original(weight, order)
        kept[:] = [out]
        return out

    gg.take_weights_cuda = take_and_keep
    try:
        yield
    finally:
        gg.take_weights_cuda = original


@contextlib.contextmanager
def legacy_stream_loader():
    """The loader's threads on the legacy default stream, as before ``data.loader_stream``
    (``data``'s private switch, turned off for the block only: a diagnostic)."""
    from numba_sc.train import data

    original = data._on_loader_stream
    data._on_loader_stream = contextlib.nullcontext
    try:
        yield
    finally:
        data._on_loader_stream = original


def on_own_stream(fn):
    """``fn`` run with a CuPy stream of the calling thread's own current, waited for before
    its result is handed over (one stream per thread, made on first use)."""
    local = threading.local()

    def wrapped(*a):
        if not _on_gpu():
            return fn(*a)
        import cupy

        s = getattr(local, "stream", None)
        if s is None:
            s = local.stream = cupy.cuda.Stream(non_blocking=False)
        with s:
            out = fn(*a)
        s.synchronize()
        return out

    return wrapped


def _checksum(b):
    """Sums of a batch's coordinates, features and targets (one small device read)."""
    from numba_sc.core.backend import to_host
    from numba_sc.core.device import array_module

    xp = array_module(b.tensor.features)
    t = b.concat(0)
    v = to_host(xp.stack([b.tensor.coords.sum(dtype=xp.float64), b.tensor.features.sum(dtype=xp.float64),
                          t.sum(dtype=xp.float64)]))
    return [float(x) for x in v]


def _stress_run(crops, args, workers, hammer=None, kept=False, own_streams=False, legacy=False):
    from numba_sc.train import data

    kwargs = {"prepare": on_own_stream(_prepare), "collate": on_own_stream(data.collate_items)} if own_streams else {}
    loader = _loader(crops, args, args.stress_steps, workers, **kwargs)
    t = _trainer(args.width)
    out = {"losses": [], "checksums": [], "error": None}
    old = sys.getswitchinterval()
    t0 = time.perf_counter()
    try:
        with (hammer or contextlib.nullcontext()), (weights_kept() if kept else contextlib.nullcontext()), \
                (legacy_stream_loader() if legacy else contextlib.nullcontext()):
            if hammer is not None:
                sys.setswitchinterval(args.switch_interval)  # more turns between threads: more chances
            for b in loader:
                out["checksums"].append(_checksum(b))
                loss = t.step(b.tensor, b.concat(0), scans=len(b))
                out["losses"].append(loss)
                if loss is None or not np.isfinite(loss):
                    out["error"] = f"non-finite loss {loss} at step {len(out['losses']) - 1}"
                    break
    except Exception as e:  # noqa: BLE001 - what a training run would have met: recorded
        out["error"] = f"{type(e).__name__} at step {len(out['losses'])}: {e}"[:400]
    finally:
        sys.setswitchinterval(old)
    _sync()
    out["seconds"] = time.perf_counter() - t0
    if hammer is not None:
        out.update(hammer_fills=hammer.fills, hammer_error=hammer.error, switch_interval_s=args.switch_interval)
    return out


def _against(run, ref):
    """How ``run`` compares with the reference run: same losses (bitwise), first difference."""
    a, b = run["losses"], ref["losses"]
    diff = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    same_batches = all(x == y for x, y in zip(run["checksums"], ref["checksums"]))
    finite = [x for x, y in zip(a, b) if x is not None and np.isfinite(x)]
    gap = max((abs(x - y) for x, y in zip(a, b) if x is not None and np.isfinite(x)), default=0.0)
    return {"identical": diff is None and run["error"] is None, "first_different_step": diff,
            "max_abs_loss_difference": float(gap), "steps": len(a), "finite_steps": len(finite),
            "same_batches": same_batches}


def stress(args, crops, log, out, write):
    runs = out["runs"]
    runs["reference"] = _stress_run(crops, args, 0)
    ref = runs["reference"]
    plan = [("reference_again", dict(workers=0))]
    plan += [(f"loader_threads_{r}", dict(workers=2)) for r in range(args.stress_repeats)]
    plan += [(f"legacy_stream_threads_{r}", dict(workers=2, legacy=True)) for r in range(args.stress_repeats)]
    plan += [("own_streams", dict(workers=2, own_streams=True)),
             ("hammer", dict(workers=0, hammer=Hammer())),
             ("hammer_weights_kept", dict(workers=0, hammer=Hammer(), kept=True)),
             ("hammer_own_stream", dict(workers=0, hammer=Hammer(own_stream=True)))]
    for name, kw in plan:
        runs[name] = _stress_run(crops, args, **kw)
        out["against_reference"][name] = _against(runs[name], ref)
        c = out["against_reference"][name]
        log(f"stress {name}: identical {c['identical']}, first different step {c['first_different_step']}, "
            f"same batches {c['same_batches']}, error {runs[name]['error']}")
        write()  # (a run that kills the process leaves the earlier ones recorded)
    cmp_ = out["against_reference"]
    threads = [k for k in cmp_ if k.startswith("loader_threads_")]
    legacy = [k for k in cmp_ if k.startswith("legacy_stream_threads_")]
    out["verdict"] = {
        "deterministic": cmp_["reference_again"]["identical"],
        "loader_threads_reproduced": any(not cmp_[k]["identical"] for k in threads),
        "legacy_stream_threads_reproduced": any(not cmp_[k]["identical"] for k in legacy),
        "own_streams_identical": cmp_["own_streams"]["identical"],
        "hammer_corrupts": not cmp_["hammer"]["identical"],
        "weights_kept_cures_it": cmp_["hammer_weights_kept"]["identical"],
        "own_stream_isolates_it": cmp_["hammer_own_stream"]["identical"]}
    log(f"stress verdict: {out['verdict']}")


# ------------------------------------------------------------------ the run
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder with semantickitti_000000.bin/.label")
    ap.add_argument("--crops", type=int, default=8, help="crops of the scan the batches cycle through")
    ap.add_argument("--crop-size", type=float, default=20.0, help="crop square, metres (default 20)")
    ap.add_argument("--batch", type=int, default=4, help="scans per batch (default 4)")
    ap.add_argument("--width", type=float, default=1.0, help="MinkUNet42's width (default 1)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="loader threads to try")
    ap.add_argument("--prefetch", type=int, default=2, help="batches the loader prepares ahead (default 2)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each loader run")
    ap.add_argument("--timed", type=int, default=24, help="timed steps of each loader run")
    ap.add_argument("--amp-batches", type=int, default=8, help="distinct batches the amp/fp32 steps cycle through")
    ap.add_argument("--amp-warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds of amp/fp32")
    ap.add_argument("--block", type=int, default=3, help="timed steps per contender and round")
    ap.add_argument("--stress-steps", type=int, default=40)
    ap.add_argument("--stress-repeats", type=int, default=2, help="runs of the plain loader-thread check")
    ap.add_argument("--switch-interval", type=float, default=1e-4,
                    help="Python's thread switch interval during the hammer runs, seconds")
    ap.add_argument("--only", nargs="+", choices=("loader", "amp", "stress"), default=("loader", "amp", "stress"))
    ap.add_argument("--mark-timed-done", metavar="PATH",
                    help="create PATH once sections 1 and 2 (the timed ones) are done: a caller may then start "
                         "other work on the machine beside the untimed stress check")
    ap.add_argument("--out")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    def log(s):
        print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True)

    if not _on_gpu():  # a smoke run: no device to wait for (common.interleaved calls common.sync too)
        common.sync = lambda: None
    t0 = time.perf_counter()
    crops = scan_crops(find_data(args.data), args.crops, args.crop_size)
    result = {"recorded": recorded(args.note),
              "config": {"crops": args.crops, "crop_size_m": args.crop_size, "points_per_crop": [len(c[0]) for c in
                                                                                                  crops],
                         "batch": args.batch, "net": "MinkUNet42", "width": args.width, "optimizer": "AdamW",
                         "workers": args.workers, "prefetch": args.prefetch, "warmup": args.warmup,
                         "timed": args.timed, "rounds": args.rounds, "block": args.block,
                         "stress_steps": args.stress_steps, "stress_repeats": args.stress_repeats,
                         "gpu": _on_gpu()}}
    log(f"{len(crops)} crops, points {result['config']['points_per_crop']}")

    def write():
        result["seconds"] = time.perf_counter() - t0
        if args.out:
            write_json(args.out, result)

    sections = [("loader", "loader_wait", lambda: loader_wait(args, crops, log)),
                ("amp", "amp_vs_fp32", lambda: amp_against_fp32(args, crops, log))]
    for key, name, fn in sections:
        if key in args.only:
            try:
                result[name] = fn()
            except Exception as e:  # noqa: BLE001 - the other sections still run; the error is recorded
                result[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                log(f"{name} failed: {result[name]['error']}")
            write()
    if args.mark_timed_done:
        Path(args.mark_timed_done).touch()
    if "stress" in args.only:
        result["device_batches_from_threads"] = out = {"runs": {}, "against_reference": {}}
        try:
            stress(args, crops, log, out, write)
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"[:400]
            log(f"stress failed: {out['error']}")
        write()
    write()
    log(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
