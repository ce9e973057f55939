"""Nsight Compute figures of the three dataflows' kernels: how close each gets to the H100's roofs.

    . benchmarks/gpu_env.sh
    ncu --profile-from-start off --print-summary per-kernel \
        --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
smsp__sass_thread_inst_executed_op_ffma_pred_on.sum \
        python3 benchmarks/probes/ncu_dataflows.py [DATA_DIR] [C] [dtype]

Profiles one ``sparse_conv3d`` C -> C (default 64, float32) per dataflow (gmas,
fetch, implicit) with its map given and its plans built (so only the layer's
own kernels are captured), on SemanticKITTI at 0.05 m and on the dense cloud of
``bench_alternatives.py`` (1M random voxels at stride 4). The FFMA count over the
kernel's time is its achieved FP32 rate, to set beside the H100's ~67 TFLOP/s
FP32 peak (cuBLAS's fp16 GEMMs run on tensor cores instead). Never runs in CI.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, random_coords, scan_coords, sync  # noqa: E402


def main():
    import cupy

    import numba_sc as ns

    data = find_data(sys.argv[1] if len(sys.argv) > 1 else None)
    ch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    dtype = np.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
    clouds = {"kitti": scan_coords(data, "kitti"), "dense": np.unique(random_coords() // 4, axis=0)}
    rng = np.random.default_rng(0)
    w = cupy.asarray((rng.standard_normal((27, ch, ch)) / np.sqrt(ch)).astype(dtype))
    for name, coords in clouds.items():
        x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.standard_normal((len(coords), ch)).astype(dtype)))
        km = ns.sparse_conv3d(x, w, 3, dataflow="gmas").kernel_map
        for flow in ("gmas", "fetch", "implicit"):
            for _ in range(3):  # compile, build and keep the plans
                ns.sparse_conv3d(x, w, 3, kernel_map=km, dataflow=flow)
            sync()
            print(f"profiling {name} {flow} {ch}->{ch} {dtype.name}", flush=True)
            cupy.cuda.runtime.profilerStart()
            ns.sparse_conv3d(x, w, 3, kernel_map=km, dataflow=flow)
            sync()
            cupy.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
