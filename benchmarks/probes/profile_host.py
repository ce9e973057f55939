"""Where the host time of a layer goes: cProfile of repeated calls on the GPU.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/profile_host.py [--net unet42] [--dtype float16]

Runs a network of :mod:`numba_sc.nn.models` once on SemanticKITTI at 0.05 m,
records its layer calls, and for the first layer of each kind (strided,
submanifold reusing a map, transposed, BatchNorm) and for the whole network
prints the wall time per call and the functions with the most own time.
Never runs in CI.
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, scan_points, sync  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--net", default="unet42")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()

    import cupy

    import numba_sc as ns
    from numba_sc import models, nn

    scan, _ = scan_points(find_data(args.data), "kitti")
    v = ns.voxelize(np.ascontiguousarray(scan[:, :3]), 0.05, features=scan, backend="reference")
    model = (models.MinkUNet42(4, 19) if args.net == "unet42" else models.SparseResNet21(4))
    model.to(np.dtype(args.dtype)).cuda()
    x = ns.SparseTensor(cupy.asarray(v.coords), cupy.asarray(v.features.astype(args.dtype)))
    first = {}

    def obs(m, a, y, kw):
        if isinstance(m, nn.SparseInverseConv3d):
            kind = "transposed"
        elif isinstance(m, nn.SparseConv3d) and m.stride != (1, 1, 1):
            kind = "strided"
        elif isinstance(m, nn.SubMConv3d) and not m.pointwise and a.maps.subm:
            kind = "subm"
        elif isinstance(m, nn.BatchNorm):
            kind = "batchnorm"
        else:
            return
        if kind not in first:
            fresh = kind == "strided"
            first[kind] = (m.name, (lambda m=m, a=a: m(a.without_maps())) if fresh else
                           (lambda m=m, a=a, kw=kw: m(a, **kw)))

    with nn.observe(obs):
        model(x.without_maps())
    first["network"] = ("whole", lambda: model(x.without_maps()))
    for kind, (name, fn) in first.items():
        for _ in range(10):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        wall = (time.perf_counter() - t0) / args.calls * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        sync()
        prof.disable()
        print(f"==== {kind} ({name}): {wall:.3f} ms a call, back to back, no profiler")
        pstats.Stats(prof).strip_dirs().sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
