"""v4 (and v5) compiled with register caps, and v4 with less prefetch, timed against v4.

Nsight Compute found v4 register-bound (``ncu_implicit_v4_v5.json``: 158 registers a
thread, 3 blocks of 128 threads an SM, 16 % of the warp slots in use), and
``kernel_resources.py`` reads, without a GPU, what a cap does: at 128 registers 4 blocks
an SM for 36 bytes of spills a thread, at 96 five for 168 bytes, and v4 without its
prefetch (``prefetch=False``) needs 126 registers, with only its gathered rows early
(``prefetch="rows"``) 128: 4 blocks an SM, spilling nothing (``kernel_resources.json``). Whether more warps are worth the spills, or the waits, is a
measurement::

    . benchmarks/gpu_env.sh
    python3 benchmarks/probes/v4_registers.py --cloud kitti --out v4_registers_kitti.json
    python3 benchmarks/probes/v4_registers.py --cloud dense --out v4_registers_dense.json

The ladder's layer (one 3x3x3 submanifold layer C -> C, fp16, the plan's 64-row tiles),
each contender ``run_v4`` / ``run_v5`` with ``max_registers`` (:func:`numba_sc.dataflows.
tensor_cores.kernel_options`); CUDA events around each call, the contenders interleaved
round by round, medians after a warm-up, each printed with the first rung's uncapped time
over it (above 1: faster). Every output must equal uncapped v4's bit for bit (v5's: its
own uncapped one's): a cap moves values between registers and local memory, a later load
moves a wait, neither changes the arithmetic. Never runs in CI.
"""
import argparse
import dataclasses
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import dense_coords, find_data, recorded, scan_coords, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--cloud", default="kitti", choices=("kitti", "dense"))
    ap.add_argument("--channels", default="32,64,128")
    ap.add_argument("--rungs", default="v4,v4late,v4rows,v5",
                    help="v4, v5, v4late (v4 with prefetch=False), v4rows (prefetch='rows')")
    ap.add_argument("--caps", default="none,128", help="register caps (none: the compiler's choice)")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="v4_registers.json")
    ap.add_argument("--note", default="", help="what code this run measures (recorded)")
    args = ap.parse_args()
    if not re.fullmatch(r"(none|\d+)(,(none|\d+))*", args.caps):
        ap.error(f"--caps must be register counts or none, comma-separated (none,128), got {args.caps!r}")
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    if None not in caps:
        ap.error("--caps must include none: each capped output is checked against the uncapped one")

    import cupy

    from numba_sc.core.backend import to_device
    from numba_sc.dataflows import implicit_gemm as ig
    from numba_sc.tools.ladder import Context

    coords = scan_coords(find_data(args.data), "kitti") if args.cloud == "kitti" else dense_coords()
    base = Context(coords, 64)
    runs = {"v4": ig.run_v4, "v5": ig.run_v5,
            "v4late": lambda *a, **k: ig.run_v4(*a, prefetch=False, **k),  # each chunk after the last one's math
            "v4rows": lambda *a, **k: ig.run_v4(*a, prefetch="rows", **k)}  # only the gathered rows early
    rungs = args.rungs.split(",")
    if not set(rungs) <= set(runs):
        ap.error(f"--rungs must name some of {sorted(runs)}, got {args.rungs!r}")
    rows = []
    for c in (int(x) for x in args.channels.split(",")):
        work = ig.LADDER.workload(dataclasses.replace(base, channels=c, dtype="float16"))
        f, w = to_device(work["features"]), to_device(work["weight"])
        t, plan = to_device(work["km"].table), work["implicit_plan"]
        init = None if work["init"] is None else to_device(work["init"])  # (once: no copy in the timed calls)
        calls = {(r, cap): (lambda r=r, cap=cap: runs[r](f, w, t, plan, init, max_registers=cap))
                 for r in rungs for cap in caps}
        for (r, cap), call in calls.items():  # compile, and check against the uncapped output: v4's for
            same = ("v4", None) if r.startswith("v4") and "v4" in rungs else (r, None)  # v4's variants
            got, want = cupy.asnumpy(call()), cupy.asnumpy(calls[same]())
            if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                raise AssertionError(f"{r} with max_registers={cap} differs from {same[0]} uncapped at C={c}")
        times = {k: [] for k in calls}
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for i in range(args.warmup + args.rounds):
            for k in np.random.default_rng(i).permutation(len(calls)):
                key = list(calls)[k]
                start.record()
                calls[key]()
                stop.record()
                stop.synchronize()
                if i >= args.warmup:
                    times[key].append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        for (r, cap), ts in times.items():
            rows.append(dict(channels=c, rung=r, cap=cap, gpu_us=float(np.median(ts)), all_us=[float(x) for x in ts]))
        first = np.median(times[rungs[0], None])
        print(f"C={c:4d}: " + "  ".join(f"{r} cap {cap}: {np.median(ts):7.1f} us ({first / np.median(ts):.2f}x)"
                                        for (r, cap), ts in times.items()), flush=True)
    write_json(args.out, {"cloud": args.cloud, "points": int(len(coords)), "rows": rows, "rounds": args.rounds,
                          "recorded": recorded(args.note)})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
