"""GPU time of every kernel of one Map step and one whole layer, from Nsight Compute.

    . benchmarks/gpu_env.sh
    ncu --profile-from-start off --print-summary per-kernel \
        --metrics gpu__time_duration.sum python3 benchmarks/probes/ncu_layer.py [DATA_DIR] [C]

CUDA events around a whole call measure host gaps as well as kernels when the
host is the bottleneck; Nsight Compute times each kernel alone. Profiles one
``build_kernel_map`` (``assume_sorted=True``, as a layer calls it) and one
``sparse_conv3d`` C -> C (default 64) on SemanticKITTI at 0.05 m, after a
warm-up that compiles everything. Never runs in CI.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, scan_coords, sync  # noqa: E402


def main():
    import cupy

    import numba_sc as ns

    data = find_data(sys.argv[1] if len(sys.argv) > 1 else None)
    ch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    coords = scan_coords(data, "kitti")
    rng = np.random.default_rng(0)
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.normal(size=(len(coords), ch)).astype(np.float32)))
    w = cupy.asarray(rng.normal(size=(27, ch, ch)).astype(np.float32))
    for _ in range(2):  # compile and warm up
        ns.build_kernel_map(x.coords, 3, assume_sorted=True)
        ns.sparse_conv3d(x, w, 3)
    sync()
    cupy.cuda.runtime.profilerStart()
    ns.build_kernel_map(x.coords, 3, assume_sorted=True)
    sync()
    ns.sparse_conv3d(x, w, 3)
    sync()
    cupy.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
