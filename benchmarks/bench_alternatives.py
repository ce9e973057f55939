#!/usr/bin/env python
"""Issue #17's benchmark: every Map method and every dataflow beside spconv 2.3.8, interleaved.

    . benchmarks/gpu_env.sh
    python3 benchmarks/bench_alternatives.py --out results/alternatives.json
        [--clouds kitti,scannet,sunrgbd,random1M,dense] [--only map|layer] [--reuse]
        [--rows 4-16,32-32,64-64,128-128,256-256] [--dtypes float32,float16]

What a user meets: the public API, timed with ``common.interleaved`` (as ``ab_compare.py``
does): wall clock between device-wide synchronizes (host time) and CUDA events around the
call (GPU time); every contender of a workload gets, in each of ``--rounds`` rounds, one
untimed call and a block of timed ones, in an order shuffled afresh every round; medians
over all timed calls.

Clouds: the three real scans (and their crops of ``common.CROPS``), 1M random voxels in a 400^3 box, and ``dense``: those voxels
at stride 4 (~635k voxels, ~17 pairs per voxel). Workloads per cloud:

* **map**: ``build_kernel_map(coords, 3, assume_sorted=True, method=m)`` for
  m in sorted, hash, grid (when the box fits) and auto, beside spconv's
  ``get_indice_pairs`` (submanifold, Native);
* **layer C_in -> C_out, dtype**: ``sparse_conv3d(x, w, 3, dataflow=d)`` for d in
  gmas, fetch, implicit and auto (its Map step included: a fresh layer; ``--reuse``: also
  with the map given), beside spconv's ``SubMConv3d`` with Native and MaskImplicitGemm
  (fresh tensors, so its pairs are rebuilt as well).

Every contender's output is checked against the gmas dataflow's before timing.
Never runs in CI.
"""
import argparse
import time
import traceback

import numpy as np

from common import (CROPS, HOST_THEN_GPU, dense_coords, find_data, interleaved, random_coords, recorded, scan_coords,
                    write_json)

ROWS = "4-16,32-32,64-64,128-128,256-256"


def map_calls(ns, coords):
    import cupy

    c = cupy.asarray(coords)
    calls = {}
    for m in ("sorted", "hash", "grid", "auto"):
        try:
            ns.build_kernel_map(c, 3, assume_sorted=True, method=m)
        except ValueError as e:  # the grid of an outdoor scan does not fit
            print(f"   map {m}: not run: {str(e)[:90]}")
            continue
        calls[("map", m)] = lambda m=m: ns.build_kernel_map(c, 3, assume_sorted=True, method=m)
    return calls


def spconv_map(coords):
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops
    import torch

    c = coords - coords.min(0)
    shape = (c.max(0) + 1).tolist()
    ind = torch.from_numpy(np.column_stack([np.zeros(len(c), np.int32), c]).astype(np.int32)).cuda()
    return {("map", "spconv"): lambda: ops.get_indice_pairs(ind, 1, shape, ConvAlgo.Native, [3, 3, 3], [1, 1, 1],
                                                            [1, 1, 1], [1, 1, 1], [0, 0, 0], subm=True)}


def layer_calls(ns, coords, cin, cout, dtype, reuse=False):
    import cupy

    rng = np.random.default_rng(0)
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.standard_normal((len(coords), cin)).astype(dtype)))
    w = cupy.asarray((rng.standard_normal((27, cin, cout)) / np.sqrt(cin)).astype(dtype))
    name = f"layer {cin}->{cout} {np.dtype(dtype).name}" + (" (map given)" if reuse else "")
    km = ns.sparse_conv3d(x, w, 3, dataflow="gmas").kernel_map if reuse else None
    want = ns.sparse_conv3d(x, w, 3, dataflow="gmas").features
    scale = float(cupy.abs(want).max())
    calls, errors = {}, {}
    for d in ("gmas", "fetch", "implicit", "auto"):
        got = ns.sparse_conv3d(x, w, 3, dataflow=d, kernel_map=km).features
        errors[d] = float(cupy.abs(got.astype(np.float32) - want.astype(np.float32)).max()) / scale
        calls[(name, d)] = lambda d=d: ns.sparse_conv3d(x, w, 3, dataflow=d, kernel_map=km)
    return name, calls, errors


def spconv_layer(coords, cin, cout, dtype, reuse=False):
    import spconv.pytorch as spconv
    import torch
    from spconv.core import ConvAlgo

    c = coords - coords.min(0)
    shape = (c.max(0) + 1).tolist()
    ind = torch.from_numpy(np.column_stack([np.zeros(len(c), np.int32), c]).astype(np.int32)).cuda()
    feats = torch.from_numpy(np.random.default_rng(0).standard_normal((len(c), cin)).astype(dtype)).cuda()
    name = f"layer {cin}->{cout} {np.dtype(dtype).name}" + (" (map given)" if reuse else "")
    calls = {}
    for algo in ("Native", "MaskImplicitGemm"):
        conv = spconv.SubMConv3d(cin, cout, 3, bias=False, indice_key="alt", algo=getattr(ConvAlgo, algo)).cuda().eval()
        if np.dtype(dtype) == np.float16:
            conv = conv.half()

        pairs = {}
        if reuse:
            with torch.no_grad():
                pairs = conv(spconv.SparseConvTensor(feats, ind, shape, 1)).indice_dict

        def layer(conv=conv, pairs=pairs):
            t = spconv.SparseConvTensor(feats, ind, shape, 1)
            if pairs:
                t.indice_dict = pairs  # the same indice_key finds its pairs: no Map step
            with torch.no_grad():
                return conv(t)
        calls[(name, f"spconv {algo}")] = layer
    return calls


def timed(contenders, args):
    """:func:`common.interleaved`: host (wall clock between device-wide synchronizes) and GPU
    (CUDA events) milliseconds, a block of each per round; keys joined as "workload / contender"."""
    times = interleaved(contenders, args.rounds, block=args.block, warmup=args.warmup, timers=HOST_THEN_GPU)
    return {" / ".join(k): {"host_ms": t["host_ms"], "gpu_ms": t["gpu_ms"]} for k, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--clouds", default="kitti,scannet,sunrgbd,random1M,dense")
    ap.add_argument("--only", default="", help="map or layer: one kind of workload")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reuse", action="store_true",
                    help="also time each layer with its map given (plans kept), as layers sharing a map run")
    ap.add_argument("--out", default="alt.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    import numba_sc as ns

    makers = {n: (lambda n=n: scan_coords(find_data(args.data), n)) for n in ("kitti", "scannet", "sunrgbd", *CROPS)}
    makers["random1M"] = random_coords
    makers["dense"] = dense_coords
    out = {"recorded": recorded(args.note), "clouds": {}}
    t0 = time.time()
    for cname in args.clouds.split(","):
        coords = np.unique(makers[cname](), axis=0)  # sorted, as a SparseTensor holds them
        res = out["clouds"][cname] = {"voxels": len(coords)}
        print(f"== {cname}, {len(coords):,} voxels ({time.time() - t0:.0f} s)")
        groups = []
        if args.only in ("", "map"):
            calls = map_calls(ns, coords)
            try:
                calls.update(spconv_map(coords))
            except Exception as e:  # noqa: BLE001
                print(f"   spconv map not run: {e}")
            groups.append(("map", calls, None))
        if args.only in ("", "layer"):
            for row in args.rows.split(","):
                cin, cout = (int(v) for v in row.split("-"))
                for dt in args.dtypes.split(","):
                    for reuse in (False, True) if args.reuse else (False,):
                        try:
                            name, calls, errors = layer_calls(ns, coords, cin, cout, np.dtype(dt), reuse)
                            calls.update(spconv_layer(coords, cin, cout, np.dtype(dt), reuse))
                            groups.append((name, calls, errors))
                        except Exception:  # noqa: BLE001
                            traceback.print_exc()
        for name, calls, errors in groups:
            times = timed(calls, args)
            res[name] = {"times": times, "errors": errors}
            best = {}
            for key, t in times.items():
                best[key.split(" / ")[1]] = t["host_ms"]
            spc = min((v for k, v in best.items() if k.startswith("spconv")), default=float("nan"))
            mine = min((v for k, v in best.items() if not k.startswith("spconv")), default=float("nan"))
            line = "  ".join(f"{k} {v:.3f}" for k, v in best.items())
            print(f"   {name:26s} {line}  | best ours / best spconv {mine / spc:.2f}")
            if errors:
                print("      errors vs gmas: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        out["recorded"] = recorded(args.note)  # again, now that the peers' versions are known
        write_json(args.out, out)


if __name__ == "__main__":
    main()
