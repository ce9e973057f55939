#!/usr/bin/env python
"""Each stage of one layer, this checkout against a baseline copy, interleaved, beside
spconv's whole layer: where a round's host time went.

    mkdir -p .ab && cp -r /tmp/base/numba_sc .ab/base_sc   # as for ab_compare.py
    . benchmarks/gpu_env.sh; python3 benchmarks/probe_stages.py --cloud kitti --cin 64 --cout 64 \\
        --dtype float16 --tiles 8,16 --out stages.json

Stages, each on arrays prepared once: the Map step, the metadata (``build_plan``), the
centre product, the gather, the grouped GEMMs, the scatter; then the GMaS step and the
whole layer. For each, three medians: wall time with a final synchronize, GPU time
(CUDA events), and submit time (host time until the call returns, no final
synchronize: for a host-bound layer, what sets the pace). Never runs in CI.
"""
import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import recorded  # noqa: E402
from ab_compare import spconv_calls  # noqa: E402
from bench_conv import kitti_coords, random_coords  # noqa: E402


def stage_calls(pkg, coords, cin, cout, dtype, tiles):
    import cupy

    m = lambda name: importlib.import_module(pkg.__name__ + "." + name)  # noqa: E731
    conv, md, ga, sc, gg, kmod = (m(n) for n in ("conv", "metadata", "gather", "scatter", "gemm_grouping",
                                                 "kernel_map"))
    rng = np.random.default_rng(0)
    x = pkg.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.standard_normal((len(coords), cin)).astype(dtype)))
    w = cupy.asarray((rng.standard_normal((27, cin, cout)) / np.sqrt(cin)).astype(dtype))
    f, wd, km, plan = conv._prepare_layer(x, w, 3, 1, 1, False, None, "cuda")
    policy = plan.policy
    ibuf = ga.gather_cuda(f, plan.in_lists, plan.rows, tiles[0])
    obuf = cupy.empty((plan.rows, cout), dtype)
    init = gg.centre_product_cuda(f, wd, plan.centre)
    return {
        "map": lambda: kmod.build_kernel_map(x.coords, 3, assume_sorted=True, masks=True),
        # the layer's own grouping policy (a baseline without launch_rows: its default)
        "metadata": (lambda: md.build_plan(km, True, policy[0], policy[1], launch_rows=policy[2]))
        if len(policy) > 2 else (lambda: md.build_plan(km)),
        "centre": lambda: gg.centre_product_cuda(f, wd, plan.centre),
        "gather": lambda: ga.gather_cuda(f, plan.in_lists, plan.rows, tiles[0]),
        "gemm": lambda: gg.grouped_gemm_cuda(ibuf, wd, plan.groups, obuf),
        "scatter": lambda: sc.scatter_cuda(obuf, plan.out_lists, init, plan.n_out, cout, dtype, tiles[1]),
        "gmas": lambda: conv.gmas(f, wd, plan, tiles, "cuda"),
        "layer": lambda: pkg.sparse_conv3d(x, w, 3, tile_size=tiles),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".devdata")
    ap.add_argument("--base", default=".ab", help="folder holding base_sc/, a copy of the baseline package")
    ap.add_argument("--cloud", default="kitti", help="kitti or random1M")
    ap.add_argument("--cin", type=int, default=64)
    ap.add_argument("--cout", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tiles", default="8,8")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default="stages.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    import cupy

    import numba_sc as new

    dtype, tiles = np.dtype(args.dtype), tuple(int(t) for t in args.tiles.split(","))
    coords = kitti_coords(Path(args.data)) if args.cloud == "kitti" else random_coords()
    packages = {"new": new}
    if (Path(args.base) / "base_sc").is_dir():
        sys.path.insert(0, str(Path(args.base).resolve()))
        packages["base"] = importlib.import_module("base_sc")
    calls = {}
    for pname, pkg in packages.items():
        for stage, fn in stage_calls(pkg, coords, args.cin, args.cout, dtype, tiles).items():
            calls[(stage, pname)] = fn
    for (wname, who), fn in spconv_calls(coords, args.cin, dtype, args.cout).items():
        if wname.startswith("layer"):
            calls[("layer", who)] = fn
    sync = cupy.cuda.Device().synchronize
    for fn in calls.values():
        for _ in range(5):
            fn()
    sync()
    samples = {key: {"wall": [], "gpu": [], "submit": []} for key in calls}
    keys = list(calls)
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        for key in [keys[i] for i in rng.permutation(len(keys))]:
            fn, s = calls[key], samples[key]
            fn()
            sync()
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                sync()
                s["wall"].append((time.perf_counter() - t0) * 1e6)
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                a.record()
                fn()
                b.record()
                b.synchronize()
                s["gpu"].append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                sync()
                s["submit"].append((t1 - t0) * 1e6)
    out = {"recorded": recorded(args.note), "stages": {}}
    print(f"{args.cloud} {dtype.name} {args.cin}->{args.cout}, tiles {tiles}: wall / gpu / submit us, median")
    for stage in dict.fromkeys(k[0] for k in keys):
        line = []
        for (st, who) in keys:
            if st == stage:
                med = {k: statistics.median(v) for k, v in samples[(st, who)].items()}
                out["stages"][f"{st} / {who}"] = {**med, "all": samples[(st, who)]}
                line.append(f"{who} {med['wall']:6.1f} / {med['gpu']:6.1f} / {med['submit']:6.1f}")
        print(f"  {stage:8s} " + "   ".join(line))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
