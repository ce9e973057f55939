"""Voxelization of a full SemanticKITTI scan: GPU kernels against the NumPy reference.

Run on a GPU machine (never in CI):

    python benchmarks/bench_voxelize.py --data ../shared/data --out results.json

GPU time: CUDA events around one call, median of --repeat after --warmup calls.
Host wall time: perf_counter around one call including the final synchronize
(what a caller waits). Inputs live on the device already (CuPy), as in a network.
Napkin math, N = 123k points, M = 94k voxels, C = 1: the quantize pass reads 1.5 MB
and writes 1 MB; sort + unique ~8 MB; so the bandwidth floor is a few microseconds
and launch overheads dominate.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def find_data(arg):
    for d in [arg, "../shared/data", ".devdata"]:
        if d and (Path(d) / "semantickitti_000000.bin").exists():
            return Path(d)
    raise SystemExit("semantickitti_000000.bin not found; pass --data DIR")


def gpu_times(fn, warmup, repeat):
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    gpu, host = [], []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        t0 = time.perf_counter()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
        gpu.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(gpu), statistics.median(host)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data")
    ap.add_argument("--voxel-size", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns

    scan = np.fromfile(find_data(args.data) / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    xyz, feat = np.ascontiguousarray(scan[:, :3]), np.ascontiguousarray(scan[:, 3:])
    xyz_d, feat_d = cupy.asarray(xyz), cupy.asarray(feat)

    ref = ns.voxelize(xyz, args.voxel_size, feat, backend="reference")
    got = ns.voxelize(xyz_d, args.voxel_size, feat_d, backend="cuda")
    assert np.array_equal(got.coords.get(), ref.coords) and np.array_equal(got.inverse.get(), ref.inverse)
    assert np.allclose(got.features.get(), ref.features, rtol=1e-5)

    rows = {}
    for name, f in [("coords only", lambda: ns.voxelize(xyz_d, args.voxel_size, backend="cuda")),
                    ("coords + mean features", lambda: ns.voxelize(xyz_d, args.voxel_size, feat_d, backend="cuda"))]:
        g, h = gpu_times(f, args.warmup, args.repeat)
        t_ref = []
        for _ in range(5):
            t0 = time.perf_counter()
            ns.voxelize(xyz, args.voxel_size, feat if "features" in name else None, backend="reference")
            t_ref.append((time.perf_counter() - t0) * 1e3)
        rows[name] = {"gpu_ms": g, "host_ms": h, "numpy_ms": statistics.median(t_ref)}

    result = {"bench": "voxelize", "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "date": time.strftime("%Y-%m-%d"), "points": len(xyz), "voxels": len(ref.coords),
              "voxel_size": args.voxel_size, "host": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "rows": rows}
    print(f"voxelize SemanticKITTI ({len(xyz)} points -> {len(ref.coords)} voxels) on {result['device']}")
    print(f"{'variant':26s} {'GPU ms':>8s} {'host ms':>8s} {'NumPy ms':>9s} {'speed-up (host)':>16s}")
    for k, v in rows.items():
        print(f"{k:26s} {v['gpu_ms']:8.3f} {v['host_ms']:8.3f} {v['numpy_ms']:9.2f} {v['numpy_ms'] / v['host_ms']:15.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
