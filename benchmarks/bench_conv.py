#!/usr/bin/env python
"""Benchmark one submanifold 3x3x3 layer: numba-sc (Map + GMaS) beside spconv 2.3.8.

Needs a CUDA GPU with CuPy; spconv and torch are optional peers (each peer runs in
its own try/except, and its error is printed instead of its numbers). Never run
in CI. Example::

    python3 benchmarks/bench_conv.py --out results/conv.json

For each dataset (SemanticKITTI voxelized at 0.05 m; 1,000,000 random unique
voxels in a 400^3 box) and each channel pair (4->16, 32->32, ..., 256->256) it
times, median of ``--reps`` runs after ``--warmup`` runs:

* numba-sc end to end (Map + GMaS) and the GMaS step alone (given the kernel map),
  fp32 and fp16, with the autotuned tile sizes;
* numba-sc per stage: map, metadata, centre product, gather, GEMMs, scatter;
* spconv ``SubMConv3d`` with ``ConvAlgo.Native`` and ``ConvAlgo.MaskImplicitGemm``,
  fp32 and fp16, end to end (fresh tensor: its indice pairs are rebuilt) and with
  the pairs reused (its "GMaS alone").

Host time is wall clock around the call plus a synchronisation; GPU time comes
from CUDA events recorded on the current stream around the call. The end-to-end
and GMaS-alone calls of a row's contenders are timed interleaved, call by call
(``common.interleaved``; ``--sequential``: one contender after the other). A short table
goes to stdout, everything to ``--out`` (JSON).
"""
# (numba_sc.core.launch.launch switches off Numba's per-launch host sync on CuPy
# arguments itself, so the benchmark measures what a user gets.)
import argparse
import sys
import traceback

import numpy as np

from common import (HOST_AND_GPU, SCANS, device_name, find_data, host_and_gpu_ms, interleaved,
                    random_coords, recorded, repeated, rounds_for, scan_coords, torch_events, write_json)

CHANNELS = [(4, 16), (32, 32), (64, 64), (128, 128), (256, 256)]


# --------------------------------------------------------------------- numba-sc
def bench_numba_sc(coords, cin, cout, dtype, args, rec):
    import cupy

    import numba_sc
    from numba_sc.conv.prepare import prepare_layer
    from numba_sc.gmas.gather import gather_cuda
    from numba_sc.gmas.gemm_grouping import centre_product_cuda, grouped_gemm_cuda, product_dtype
    from numba_sc.map.map_step import build_kernel_map
    from numba_sc.gmas.plan import build_plan
    from numba_sc.gmas.scatter import scatter_cuda

    rng = np.random.default_rng(0)
    feats = cupy.asarray(rng.standard_normal((len(coords), cin)).astype(dtype))
    w = cupy.asarray((rng.standard_normal((27, cin, cout)) / np.sqrt(cin)).astype(dtype))
    x = numba_sc.SparseTensor(cupy.asarray(coords), feats)
    y = numba_sc.sparse_conv3d(x, w, 3, backend="cuda")
    km = y.kernel_map
    choice = numba_sc.autotune(x, w, kernel_map=km, rounds=5, backend="cuda")
    tiles = (choice.gather, choice.scatter)
    rec["tiles"] = {"gather": tiles[0], "scatter": tiles[1], "source": choice.source,
                    "timings": {s: {str(t): v for t, v in d.items()} for s, d in choice.timings.items()}}
    rec["grouping"] = numba_sc.grouping_report(km)
    rec["pairs"] = int(np.asarray(numba_sc.core.backend.to_host(km.counts)).sum())
    calls = {"end_to_end": lambda: numba_sc.sparse_conv3d(x, w, 3, backend="cuda", tile_size=tiles),
             "gmas": lambda: numba_sc.sparse_conv3d(x, w, kernel_map=km, backend="cuda", tile_size=tiles)}
    if args.sequential:
        for name, fn in calls.items():
            rec[name] = repeated(fn, args.reps, args.warmup, HOST_AND_GPU)
    # per stage, on prepared arrays
    f, wd, km2, plan = prepare_layer(x, w, 3, 1, 1, False, km, "cuda")
    ibuf = gather_cuda(f, plan.in_lists, plan.rows, tiles[0])
    obuf = cupy.empty((plan.rows, cout), dtype=product_dtype(dtype))  # as the layer has it
    init = centre_product_cuda(f, wd, plan.centre) if plan.centre >= 0 else None
    stages = {
        "map": lambda: build_kernel_map(x.coords, 3, backend="cuda", assume_sorted=True, masks=True),
        "metadata": lambda: build_plan(km, backend="cuda", launch_rows=plan.policy[2]),
        "centre": (lambda: centre_product_cuda(f, wd, plan.centre)) if plan.centre >= 0 else None,
        "gather": lambda: gather_cuda(f, plan.in_lists, plan.rows, tiles[0]),
        "gemm": lambda: grouped_gemm_cuda(ibuf, wd, plan.groups, obuf),
        # with init: the same read-add-write a real layer does (values drift; harmless)
        "scatter": lambda: scatter_cuda(obuf, plan.out_lists, init, plan.n_out,
                                        cout, dtype, tiles[1]),
    }
    rec["stages"] = {}
    for name, fn in stages.items():
        if fn is None:
            continue
        try:
            rec["stages"][name] = repeated(fn, args.reps, args.warmup, HOST_AND_GPU)
        except Exception as e:  # one broken stage should not hide the others
            rec["stages"][name] = {"error": repr(e)}
    rec["gemm_launches"] = plan.launches  # the layer's grouping (launches priced by its channels)
    rec["launch_rows"] = plan.policy[2]
    rec["buffer_rows"] = plan.rows
    # a correctness sanity check against the NumPy reference (small channels only)
    if cin <= 32:
        ref = numba_sc.sparse_conv3d(
            numba_sc.SparseTensor(coords, cupy.asnumpy(feats)), cupy.asnumpy(w), 3, backend="reference")
        got = cupy.asnumpy(y.features).astype(np.float64)
        want = ref.features.astype(np.float64)
        rec["rel_err_vs_reference"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return calls, HOST_AND_GPU


# ----------------------------------------------------------------------- spconv
def bench_spconv(coords, cin, cout, dtype, algo_name, args, rec):
    import torch
    import spconv.pytorch as spconv
    from spconv.core import ConvAlgo

    ev = torch_events()
    timers = {("host_ms", "gpu_ms"): lambda fn: host_and_gpu_ms(fn, ev)}  # PyTorch's stream
    tdtype = torch.float16 if dtype == np.float16 else torch.float32
    dev = torch.device("cuda")
    lo = coords.min(0)
    spatial = (coords.max(0) - lo + 1).tolist()
    idx = np.concatenate([np.zeros((len(coords), 1), np.int32), coords - lo], 1).astype(np.int32)
    indices = torch.from_numpy(idx).to(dev)
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.standard_normal((len(coords), cin)).astype(np.float32)).to(dev, tdtype)
    conv = spconv.SubMConv3d(cin, cout, 3, bias=False, indice_key="bench",
                             algo=getattr(ConvAlgo, algo_name)).to(dev, tdtype).eval()

    def fresh():
        return conv(spconv.SparseConvTensor(feats, indices, spatial, 1))

    with torch.no_grad():
        pairs = fresh().indice_dict

    def reuse():
        t = spconv.SparseConvTensor(feats, indices, spatial, 1)
        t.indice_dict = pairs  # the same indice_key finds its pairs: no map step
        return conv(t)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    calls = {"end_to_end": no_grad(fresh), "gmas": no_grad(reuse)}
    if args.sequential:
        for name, fn in calls.items():
            rec[name] = repeated(fn, args.reps, args.warmup, timers)
    return calls, timers


# ------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--out", default="bench_conv.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--channels", default=",".join(f"{a}-{b}" for a, b in CHANNELS),
                    help="e.g. 4-16,64-64")
    ap.add_argument("--datasets", default="kitti,random", help="any of kitti, scannet, sunrgbd, random")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--no-spconv", action="store_true")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    ap.add_argument("--sequential", action="store_true",
                    help="time each contender of a row in one block, one after the other (the "
                         "rounds before session 7); default: interleaved, call by call")
    args = ap.parse_args()
    channels = [tuple(int(v) for v in c.split("-")) for c in args.channels.split(",")]

    datasets = {}
    for name in args.datasets.split(","):
        try:
            if name in SCANS:
                datasets[name] = scan_coords(find_data(args.data), name)
            elif name == "random":
                datasets[name] = random_coords()
        except Exception as e:
            print(f"[dataset {name}] skipped: {e!r}")
    try:
        gpu = device_name()
    except Exception as e:
        print(f"CuPy / GPU unavailable ({e!r}): this benchmark needs a GPU")
        return 1
    results = {"reps": args.reps, "warmup": args.warmup, "runs": []}
    print(f"GPU: {gpu}")
    print(f"{'dataset':8} {'N':>8} {'ch':>9} {'impl':22} {'dtype':8} {'e2e host':>9} "
          f"{'e2e gpu':>9} {'gmas host':>9} {'gmas gpu':>9}  (ms)")
    for dname, coords in datasets.items():
        for cin, cout in channels:
            for dt in args.dtypes.split(","):
                dtype = np.dtype(dt).type
                peers = [("numba-sc", None)]
                if not args.no_spconv:
                    peers += [("spconv Native", "Native"), ("spconv MaskImplicitGemm", "MaskImplicitGemm")]
                row, contenders = [], {}
                for impl, algo in peers:
                    rec = {"dataset": dname, "n": int(len(coords)), "cin": cin, "cout": cout,
                           "impl": impl, "dtype": dt}
                    try:
                        if algo is None:
                            calls, timers = bench_numba_sc(coords, cin, cout, dtype, args, rec)
                        else:
                            calls, timers = bench_spconv(coords, cin, cout, dtype, algo, args, rec)
                        for name, fn in calls.items():
                            contenders[(impl, name)] = (fn, timers)
                    except Exception as e:
                        rec["error"] = repr(e)
                        rec["traceback"] = traceback.format_exc()
                        print(f"[{impl} {dname} {cin}->{cout} {dt}] failed: {e!r}")
                    row.append(rec)
                if not args.sequential and contenders:
                    times = interleaved(contenders, rounds_for(args.reps, 4), block=4, warmup=args.warmup)
                    for rec in row:
                        for name in ("end_to_end", "gmas"):
                            if (rec["impl"], name) in times:
                                rec[name] = times[(rec["impl"], name)]
                for rec in row:
                    impl = rec["impl"]
                    results["runs"].append(rec)
                    # written after every row: a run cut short still leaves what it measured
                    results["recorded"] = recorded(args.note)
                    write_json(args.out, results)
                    if "end_to_end" in rec:
                        e2e, gm = rec["end_to_end"], rec.get("gmas", {})
                        print(f"{dname:8} {len(coords):8d} {cin:>4}->{cout:<4} {impl:22} {dt:8} "
                              f"{e2e['host_ms']:9.3f} {e2e['gpu_ms']:9.3f} "
                              f"{gm.get('host_ms', float('nan')):9.3f} {gm.get('gpu_ms', float('nan')):9.3f}")
                    if "stages" in rec:
                        st = " ".join(f"{k}={v['gpu_ms']:.3f}" for k, v in rec["stages"].items()
                                      if "gpu_ms" in v)
                        g = rec["grouping"]
                        print(f"{'':10} stages gpu ms: {st} | tiles {rec['tiles']['gather']}/"
                              f"{rec['tiles']['scatter']} | layer GEMMs {rec['gemm_launches']}; "
                              f"paper policy {g['sorted']['launches']} "
                              f"(pad {g['sorted']['overhead']:.1%}) vs map order "
                              f"{g['map']['launches']} (pad {g['map']['overhead']:.1%})"
                              + (f" | rel err {rec['rel_err_vs_reference']:.1e}"
                                 if "rel_err_vs_reference" in rec else ""))
    results["recorded"] = recorded(args.note)
    write_json(args.out, results)
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
