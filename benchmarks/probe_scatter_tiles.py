#!/usr/bin/env python
"""One scatter per (cloud, dtype, channels, tile), of this checkout and of a baseline copy,
between profilerStart/Stop: for Nsight Compute, which times each kernel alone.

    git worktree add /tmp/base <commit>; mkdir -p .ab && cp -r /tmp/base/numba_sc .ab/base_sc
    . benchmarks/gpu_env.sh
    ncu --profile-from-start off --csv --kernel-name regex:scatter \\
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread \\
        python3 benchmarks/probe_scatter_tiles.py > scatter_tiles.csv

The ``JOB`` lines it prints name the kernels of the CSV, in order. Each scatter
sums into a centre product, as in a layer. Why: the word scatter
(:mod:`numba_sc.words`) made tiles of 16 and 32 channels pay, which channel by
channel were 2-3.5x slower than tiles of 8 (run-to-run noise on the lent GPU
hides such a comparison in wall-clock timings). Never runs in CI.
"""
import argparse
import importlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conv import kitti_coords, random_coords  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".devdata")
    ap.add_argument("--base", default=".ab", help="folder holding base_sc/, a copy of the baseline package")
    ap.add_argument("--tiles", default="4,8,16,32")
    args = ap.parse_args()
    import cupy

    import numba_sc as new
    packages = [("new", new)]
    if (Path(args.base) / "base_sc").is_dir():
        sys.path.insert(0, str(Path(args.base).resolve()))
        packages.append(("base", importlib.import_module("base_sc")))
    clouds = {"kitti": kitti_coords(Path(args.data)), "random1M": random_coords()}
    rng = np.random.default_rng(0)
    jobs = []
    for cname, coords in clouds.items():
        for dt, ch in ((np.float16, 128), (np.float32, 64)):
            for pname, pkg in packages:
                conv = importlib.import_module(pkg.__name__ + ".conv")
                sc = importlib.import_module(pkg.__name__ + ".scatter")
                x = pkg.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.normal(size=(len(coords), ch)).astype(dt)))
                w = cupy.asarray(rng.normal(size=(27, ch, ch)).astype(dt))
                f, wd, km, plan = conv._prepare_layer(x, w, 3, 1, 1, False, None, "cuda")
                init = cupy.asarray(rng.normal(size=(len(coords), ch)).astype(dt))
                obuf = cupy.asarray(rng.normal(size=(plan.rows, ch)).astype(dt))
                for t in (int(v) for v in args.tiles.split(",")):
                    def fn(sc=sc, obuf=obuf, plan=plan, t=t, init=init, dt=dt, ch=ch):
                        return sc.scatter_cuda(obuf, plan.out_lists, init, plan.n_out, ch, dt, t)
                    fn()
                    fn()  # compiled and warm
                    jobs.append((f"{cname} {np.dtype(dt).name} {ch} T{t} {pname}", fn))
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    for _, fn in jobs:
        fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()
    for name, _ in jobs:
        print("JOB", name)


if __name__ == "__main__":
    main()
