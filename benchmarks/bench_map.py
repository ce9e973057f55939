#!/usr/bin/env python
"""Benchmark of the Map step (build_kernel_map) on a CUDA GPU.

Only runs when invoked by hand; it is not a test and CI never collects it::

    python3 benchmarks/bench_map.py --out results/map.json [--data DIR] [--repeats 20]

What it measures, each as the median of ``--repeats`` runs after warm-up:

* ``gpu_ms``: GPU time between two CUDA events around the call (cupy.cuda.Event on
  the legacy default stream, where both CuPy and Numba launch by default);
* ``wall_ms``: host wall time (time.perf_counter) around the whole call plus a
  device synchronize - what a Python caller waits for, launch overheads included.

Workloads: a submanifold 3x3x3 layer on SemanticKITTI voxelized at 0.05 m
(94k voxels) and on 1,000,000 random unique voxels in a 400^3 box. For each: a
check of the GPU table against the NumPy reference (KITTI), the whole Map step
on the sorted voxels (as voxelize hands them out), with ``assume_sorted=True``
(as sparse_conv3d calls it) and on a shuffled copy (the sort included), the
stage breakdown (pack, sort, backward search + scan, forward search), spconv
2.x's ``get_indice_pairs`` (subm) in the same run when spconv imports, and a
sweep of B x C. A short table is printed; everything goes to the
JSON file given by ``--out``. Every section is wrapped so that one failure is
printed and recorded and the rest still runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import numpy as np

from common import (KITTI, SCANS, device_name, find_data, gpu_ms, host_and_gpu_ms, recorded, repeated,
                    scan_points, torch_events, wall_ms, write_json)

SWEEP_B = (64, 128, 256, 512, 1024)
SWEEP_C = (128, 256, 512, 1024)


# ------------------------------------------------------------------- helpers
def time_gpu(fn, repeats, warmup):
    """Median GPU milliseconds between CUDA events recorded before and after fn()."""
    return repeated(fn, repeats, warmup, {"gpu_ms": gpu_ms})["gpu_ms"]


def time_wall(fn, repeats, warmup):
    """Median host milliseconds around fn() and a device synchronize."""
    return repeated(fn, repeats, warmup, {"wall_ms": wall_ms})["wall_ms"]


def section(results, name, fn):
    """Run one benchmark section; print and record an error instead of stopping."""
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not crash
        if not isinstance(e, ImportError):  # a missing peer needs no traceback
            traceback.print_exc()
        print(f"  [{name}] failed: {type(e).__name__}: {e}")
        results[name] = {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------- workloads
def scan_coords(data_dir, name):
    """A scan voxelized on the GPU (CuPy int32 coordinates, sorted)."""
    import cupy

    import numba_sc as ns

    pts, voxel = scan_points(data_dir, name)
    return ns.voxelize(cupy.asarray(np.ascontiguousarray(pts[:, :3])), voxel, backend="cuda").coords


def random_coords(n=1_000_000, box=400, seed=0):
    """n unique random voxels, sorted as voxelize / SparseTensor hand coordinates out
    (``shuffled`` gives the same voxels in random order, to time the sort too)."""
    import cupy

    rng = np.random.default_rng(seed)
    cells = np.sort(rng.choice(box ** 3, size=n, replace=False))  # row-major cell index = sorted xyz
    c = np.stack(np.unravel_index(cells, (box, box, box)), axis=1) - box // 2
    return cupy.asarray(c.astype(np.int32))


def shuffled(coords, seed=1):
    import cupy

    perm = np.random.default_rng(seed).permutation(int(coords.shape[0]))
    return cupy.ascontiguousarray(coords[cupy.asarray(perm)])


# ------------------------------------------------------------------ sections
def bench_map(coords, args, **kw):
    import numba_sc as ns

    def run():
        return ns.build_kernel_map(coords, 3, backend="cuda", **kw)

    m = run()
    return {"n": int(coords.shape[0]), "pairs": int(m.stats["pairs"]),
            "balanced_blocks": int(m.stats["query_blocks_after_balancing"]),
            "gpu_ms": time_gpu(run, args.repeats, args.warmup),
            "wall_ms": time_wall(run, args.repeats, args.warmup)}


def bench_stages(coords, args, B=512, C=1024):
    """Each stage alone, with the inputs the previous stage made (the default B, C), and
    the symmetric search's ceil(K/2) segments as build_kernel_map runs them."""
    import cupy

    import numba_sc as ns
    from numba_sc.core import conventions as cv
    from numba_sc.core.backend import to_device
    from numba_sc.map.backward_search import backward_search_cuda, max_balanced_blocks
    from numba_sc.map.forward_search import forward_search_cuda
    from numba_sc.map.sorting import sort_rows_cuda

    offs = cv.kernel_offsets(3)
    deltas = to_device(cv.key_delta(offs))
    K, n = len(offs), int(coords.shape[0])
    h = (K + 1) // 2  # segments searched by a symmetric submanifold layer
    deltas = deltas[:h]
    upper = max_balanced_blocks(h, n, n, B, C)
    flags = cupy.zeros(3, np.int64)
    keys = cupy.empty(n, np.int64)

    def pack():
        cv.launch_pack(coords, offs.min(0), offs.max(0), keys, flags[:2])

    pack()
    skeys, _, _ = sort_rows_cuda(keys, coords, flags[2:])
    bounds, rows, n_rows = backward_search_cuda(skeys, skeys, deltas, B, C, upper)
    out = {"B": B, "C": C, "segments_searched": h, "forward_grid_upper_bound": upper,
           "balanced_blocks": int(n_rows[0])}
    stages = {
        "pack (kernel, no read)": pack,
        "sort (argsort + permute kernel)": lambda: sort_rows_cuda(keys, coords, flags[2:]),
        "backward search (+ rows)": lambda: backward_search_cuda(skeys, skeys, deltas, B, C, upper),
        "forward search (incl. table fill)": lambda: forward_search_cuda(
            skeys, skeys, deltas, rows, n_rows, B, C, upper, n_offsets=K),
        "whole build_kernel_map": lambda: ns.build_kernel_map(coords, 3, backend="cuda"),
        "whole build_kernel_map, symmetric=False (all 27 segments)": lambda: ns.build_kernel_map(
            coords, 3, backend="cuda", symmetric=False),
    }
    for name, fn in stages.items():
        out[name] = {"gpu_ms": time_gpu(fn, args.repeats, args.warmup),
                     "wall_ms": time_wall(fn, args.repeats, args.warmup)}
    return out


def bench_spconv(coords, args):
    """spconv 2.x get_indice_pairs, submanifold 3x3x3, on the same voxels."""
    import spconv
    import torch
    from spconv.pytorch import ops
    try:
        from spconv.core import ConvAlgo
    except ImportError:
        from spconv.pytorch import ConvAlgo

    c = coords.get().astype(np.int64)
    c -= c.min(axis=0)  # spconv wants non-negative coordinates
    shape = (c.max(axis=0) + 1).tolist()
    ind = torch.from_numpy(np.column_stack([np.zeros(len(c), np.int64), c]).astype(np.int32)).cuda()

    def run():
        return ops.get_indice_pairs(ind, 1, shape, ConvAlgo.Native, [3, 3, 3], [1, 1, 1],
                                    [1, 1, 1], [1, 1, 1], [0, 0, 0], subm=True)

    res = run()
    pairs = None
    try:
        pairs = int(res[-1].sum().item())  # per-offset pair counts are the last result
    except Exception:  # noqa: BLE001 - the layout of the result may differ across versions
        pass
    ev = torch_events()
    t = repeated(run, args.repeats, args.warmup, {"gpu_ms": lambda fn: host_and_gpu_ms(fn, ev)[1]})
    wall = repeated(run, args.repeats, 0, {"wall_ms": wall_ms})
    return {"version": getattr(spconv, "__version__", "?"), "pairs": pairs,
            "gpu_ms": t["gpu_ms"], "wall_ms": wall["wall_ms"]}


def bench_sweep(coords, args):
    import numba_sc as ns

    out = []
    for B in SWEEP_B:
        for C in SWEEP_C:
            entry = {"B": B, "C": C}
            try:
                def run(B=B, C=C):
                    return ns.build_kernel_map(coords, 3, backend="cuda", source_block=B, query_block=C)

                entry["balanced_blocks"] = int(run().stats["query_blocks_after_balancing"])
                entry["gpu_ms"] = time_gpu(run, args.repeats, args.warmup)
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"  sweep B={B} C={C} failed: {entry['error']}")
            out.append(entry)
    return out


def verify_against_reference(coords):
    """The GPU table equals the NumPy reference's (one run, not timed)."""
    import numba_sc as ns
    from numba_sc.core.backend import to_host

    g = ns.build_kernel_map(coords, 3, backend="cuda")
    r = ns.build_kernel_map(to_host(coords), 3, backend="reference")
    return {"table_equal": bool(np.array_equal(to_host(g.table), r.table)),
            "in_coords_equal": bool(np.array_equal(to_host(g.in_coords), r.in_coords)),
            "reference_comparisons_per_query": r.stats["comparisons_per_query"],
            "hit_rate": r.stats["hit_rate"]}


# ------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="folder with semantickitti_000000.bin "
                    "(default ../shared/data, then .devdata/)")
    ap.add_argument("--out", required=True, help="write the full results as JSON here")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--random-n", type=int, default=1_000_000)
    ap.add_argument("--box", type=int, default=400)
    ap.add_argument("--no-sweep", action="store_true", help="skip the B x C sweep")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    ap.add_argument("--verify-random", action="store_true",
                    help="also check the 1M-voxel table against the NumPy reference (slow, ~GBs of RAM)")
    args = ap.parse_args(argv)
    args.repeats = max(args.repeats, 1)

    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        sys.exit("bench_map: unset NUMBA_ENABLE_CUDASIM; this benchmark needs a real GPU")
    import numba_sc as ns

    if not ns.gpu_present():
        sys.exit("bench_map: no CUDA GPU found")
    data_dir = find_data(args.data, required=False)
    results = {"meta": {"data": str(data_dir), "repeats": args.repeats, "warmup": args.warmup}}
    print(f"device: {device_name()}")

    workloads = {}  # name -> CuPy int32 coordinates

    def load(name, make):
        workloads[name] = make()
        return {"voxels": int(workloads[name].shape[0])}

    if data_dir is None:
        print(f"no {KITTI} under --data / ../shared/data / .devdata: skipping SemanticKITTI")
    else:
        section(results, "load_kitti", lambda: load("kitti_0.05m", lambda: scan_coords(data_dir, "kitti")))
        for name, tag in (("scannet", "scannet_0.02m"), ("sunrgbd", "sunrgbd_0.02m")):
            if (data_dir / SCANS[name][0]).exists():
                section(results, "load_" + tag, lambda n=name, t=tag: load(t, lambda: scan_coords(data_dir, n)))
    section(results, "make_random", lambda: load(
        f"random_{args.random_n}_in_{args.box}^3", lambda: random_coords(args.random_n, args.box)))

    for name, coords in workloads.items():
        print(f"\n== {name}: {int(coords.shape[0]):,} voxels, submanifold 3x3x3")
        r = results.setdefault(name, {})
        if name.startswith("kitti") or args.verify_random:
            section(r, "verify", lambda: verify_against_reference(coords))
        section(r, "map", lambda: bench_map(coords, args))
        section(r, "map_assume_sorted", lambda: bench_map(coords, args, assume_sorted=True))
        section(r, "map_shuffled_input", lambda: bench_map(shuffled(coords), args))
        section(r, "stages", lambda: bench_stages(coords, args))
        section(r, "spconv", lambda: bench_spconv(coords, args))
        if not args.no_sweep:
            section(r, "sweep", lambda: bench_sweep(coords, args))
        print_summary(name, r)

    results["recorded"] = recorded(args.note)
    write_json(args.out, results, indent=2, default=str)
    print(f"\nwrote {args.out}")


def print_summary(name, r):
    def ms(d):
        return f"{d['gpu_ms']:8.3f} gpu ms  {d['wall_ms']:8.3f} wall ms" if "gpu_ms" in d else d.get("error", "?")

    if "verify" in r:
        print(f"  verify vs reference: {r['verify']}")
    print(f"  numba-sc Map step : {ms(r.get('map', {}))}")
    print(f"   assume_sorted    : {ms(r.get('map_assume_sorted', {}))}")
    print(f"   shuffled input   : {ms(r.get('map_shuffled_input', {}))}")
    sp = r.get("spconv", {})
    print(f"  spconv subm pairs : {ms(sp)}" + (f"  (pairs {sp.get('pairs')} vs ours "
                                                f"{r.get('map', {}).get('pairs')})" if "gpu_ms" in sp else ""))
    for stage, d in r.get("stages", {}).items():
        if isinstance(d, dict):
            print(f"    {stage:36s} {ms(d)}")
    sweep = r.get("sweep")
    if isinstance(sweep, list):
        print("  sweep (gpu ms)   " + "".join(f"   C={c:<5d}" for c in SWEEP_C))
        for B in SWEEP_B:
            cells = {e["C"]: e.get("gpu_ms") for e in sweep if e["B"] == B}
            print(f"    B={B:<5d}       " + "".join(
                f"{cells[c]:10.3f}" if cells.get(c) is not None else "       err" for c in SWEEP_C))


if __name__ == "__main__":
    main()
