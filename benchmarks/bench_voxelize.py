"""Voxelization of a full SemanticKITTI scan: GPU kernels against the NumPy reference.

Run on a GPU machine (never in CI):

    python3 benchmarks/bench_voxelize.py --out results/voxelize.json

GPU time: CUDA events around one call, median of --repeat after --warmup calls.
Host wall time: perf_counter around one call including the final synchronize
(what a caller waits). Inputs live on the device already (CuPy), as in a network.
Napkin math, N = 123k points, M = 94k voxels, C = 1: the quantize pass reads 1.5 MB
and writes 1 MB; sort + unique ~8 MB; so the bandwidth floor is a few microseconds
and launch overheads dominate.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from common import HOST_AND_GPU, find_data, recorded, repeated, scan_points, write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--voxel-size", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns

    scan, _ = scan_points(find_data(args.data), "kitti")
    xyz, feat = np.ascontiguousarray(scan[:, :3]), np.ascontiguousarray(scan[:, 3:])
    xyz_d, feat_d = cupy.asarray(xyz), cupy.asarray(feat)

    ref = ns.voxelize(xyz, args.voxel_size, feat, backend="reference")
    got = ns.voxelize(xyz_d, args.voxel_size, feat_d, backend="cuda")
    assert np.array_equal(got.coords.get(), ref.coords) and np.array_equal(got.inverse.get(), ref.inverse)
    assert np.allclose(got.features.get(), ref.features, rtol=1e-5)

    rows = {}
    for name, f in [("coords only", lambda: ns.voxelize(xyz_d, args.voxel_size, backend="cuda")),
                    ("coords + mean features", lambda: ns.voxelize(xyz_d, args.voxel_size, feat_d, backend="cuda"))]:
        t = repeated(f, args.repeat, args.warmup, HOST_AND_GPU)
        g, h = t["gpu_ms"], t["host_ms"]
        t_ref = []
        for _ in range(5):
            t0 = time.perf_counter()
            ns.voxelize(xyz, args.voxel_size, feat if "features" in name else None, backend="reference")
            t_ref.append((time.perf_counter() - t0) * 1e3)
        rows[name] = {"gpu_ms": g, "host_ms": h, "numpy_ms": statistics.median(t_ref)}

    result = {"recorded": recorded(args.note), "bench": "voxelize", "points": len(xyz), "voxels": len(ref.coords),
              "voxel_size": args.voxel_size, "host": platform.processor() or platform.machine(), "rows": rows}
    print(f"voxelize SemanticKITTI ({len(xyz)} points -> {len(ref.coords)} voxels) on {result['recorded']['device']}")
    print(f"{'variant':26s} {'GPU ms':>8s} {'host ms':>8s} {'NumPy ms':>9s} {'speed-up (host)':>16s}")
    for k, v in rows.items():
        print(f"{k:26s} {v['gpu_ms']:8.3f} {v['host_ms']:8.3f} {v['numpy_ms']:9.2f} {v['numpy_ms'] / v['host_ms']:15.1f}x")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
