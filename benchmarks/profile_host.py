"""Where the host time of one layer goes: cProfile of repeated calls on the GPU.

    . benchmarks/gpu_env.sh; python3 benchmarks/profile_host.py

Prints the functions with the most own time for build_kernel_map and for a whole
64 -> 64 submanifold layer on SemanticKITTI at 0.05 m. Never runs in CI.
"""
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    import cupy

    import numba_sc as ns

    data = Path(sys.argv[1] if len(sys.argv) > 1 else ".devdata")
    scan = np.fromfile(data / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    coords = ns.voxelize(np.ascontiguousarray(scan[:, :3]), 0.05, backend="reference").coords
    c = cupy.asarray(coords)
    x = ns.SparseTensor(c, cupy.asarray(np.random.default_rng(0).normal(size=(len(c), 64)).astype(np.float32)))
    w = cupy.asarray(np.random.default_rng(1).normal(size=(27, 64, 64)).astype(np.float32))
    for name, fn in [("build_kernel_map", lambda: ns.build_kernel_map(c, 3)),
                     ("build_kernel_map assume_sorted", lambda: ns.build_kernel_map(x.coords, 3, assume_sorted=True)),
                     ("sparse_conv3d 64->64", lambda: ns.sparse_conv3d(x, w, 3, tile_size=(16, 8)))]:
        for _ in range(5):
            fn()
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fn()
        cupy.cuda.Device().synchronize()
        prof.disable()
        print(f"==== {name}: 50 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(sys.argv[2]) if len(sys.argv) > 2 else 18)


if __name__ == "__main__":
    main()
