"""Every layer past the workspace, run both ways: by ranges of outputs, and by windows of rows.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/ranges_vs_windows.py \
        [--nets resnet21,unet42] [--dtypes float16,float32] [--out ranges_vs_windows.json]

A layer whose GMaS buffers pass the workspace (``NUMBA_SC_WORKSPACE_MB``, default
1 GiB) runs by ranges of its outputs (:mod:`numba_sc.gmas.output_ranges`) or, when
there are none, by windows of buffer rows (:mod:`numba_sc.gmas.workspace`). This
probe runs each network's forward pass on the 1M random cloud once; each time a
layer calls :func:`numba_sc.conv.dataflow.gather_gemm_scatter` past the bound, it
times that call both ways on the layer's own arrays (wall clock between device-wide
synchronizes, the two interleaved call by call, median of 20 after warm-up), then
lets the pass go on. Either way is forced through ``output_ranges.MIN_SUMS_BYTES``
(0: every such layer by ranges where it can be cut; infinite: by windows). Each row: the layer's shape (channels, outputs, buffer rows, rows the
workspace allows), the outputs' fp32 sums in MB and whether
:func:`numba_sc.gmas.output_ranges.ranges_pay` picks the ranges for it, the ranges'
and windows' counts, the two medians, and the two outputs' largest difference over
the largest value. Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py, ab_compare.py

from ab_compare import nets  # noqa: E402
from common import interleaved, random_coords, recorded, sync, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default="resnet21,unet42")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ranges_vs_windows.json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    import cupy

    import numba_sc
    from numba_sc.conv import dataflow, layer
    from numba_sc.core.device import l2_cache_bytes
    from numba_sc.gmas import output_ranges as orr
    from numba_sc.gmas.workspace import window_rows, windows
    floor = orr.MIN_SUMS_BYTES
    original = dataflow.gather_gemm_scatter
    state = {"rows": None, "net": None}

    def timed(features, weight, plan, tiles=(1, 1), backend=None, init=None, keep_buffer=None, products=None,
              kernel_map=None, transposed=False):
        c_out = weight.shape[2]
        obuf_t = dataflow.gg.product_dtype(features.dtype) if products is None else np.dtype(products)
        limit = window_rows(features.shape[1] * features.itemsize + c_out * obuf_t.itemsize)
        if state["rows"] is None or kernel_map is None or not 0 < limit < plan.rows:
            return original(features, weight, plan, tiles, backend, init, keep_buffer, products,
                            kernel_map=kernel_map, transposed=transposed)

        def run(by_ranges):
            start = None if init is None else init.copy()  # (both ways sum into it in place)
            orr.MIN_SUMS_BYTES = 0 if by_ranges else float("inf")  # whatever ranges_pay would say
            try:
                return original(features, weight, plan, tiles, backend, start, None, products,
                                kernel_map=kernel_map, transposed=transposed)
            finally:
                orr.MIN_SUMS_BYTES = floor

        a_out, b_out = run(True), run(False)
        sync()
        ref = cupy.asnumpy(b_out).astype(np.float32)
        diff = float(np.abs(cupy.asnumpy(a_out).astype(np.float32) - ref).max() / max(np.abs(ref).max(), 1e-6))
        times = interleaved({"ranges": lambda: run(True), "windows": lambda: run(False)},
                            rounds=a.rounds, block=4, warmup=2)
        kept = kernel_map.kept_plans.get(("output ranges", transposed))
        n_ranges = 0 if kept is None or kept[1] is None else len(kept[1])
        row = {"net": state["net"], "c_in": int(features.shape[1]), "c_out": int(c_out),
               "n_in": int(features.shape[0]), "n_out": int(plan.n_out), "transposed": bool(transposed),
               "rows": int(plan.rows), "limit": int(limit), "ranges": n_ranges,
               "windows": len(list(windows(plan.groups, plan.rows, limit))),
               "sums_MB": round(plan.n_out * c_out * 4 / 1e6, 1), "ranges_pay": orr.ranges_pay(plan.n_out, c_out),
               "ranges_ms": round(times["ranges"]["ms"], 3), "windows_ms": round(times["windows"]["ms"], 3),
               "max_diff_over_max": diff}
        state["rows"].append(row)
        print(f"{row['net']:9s} {row['c_in']:4d}->{row['c_out']:4d} n_out {row['n_out']:8d} rows {row['rows']:9d} "
              f"ranges {n_ranges:3d} {row['ranges_ms']:8.3f} ms  windows {row['windows']:3d} "
              f"{row['windows_ms']:8.3f} ms", flush=True)
        return original(features, weight, plan, tiles, backend, init, keep_buffer, products,
                        kernel_map=kernel_map, transposed=transposed)

    layer.gather_gemm_scatter = timed
    coords = random_coords()
    out = {}
    for dtype in a.dtypes.split(","):
        calls = nets({"new": numba_sc}, coords, np.dtype(dtype))
        for (net, _), fn in calls.items():
            if net not in a.nets.split(","):
                continue
            fn()  # warm-up: compiles, and keeps nothing between passes
            sync()
            state["rows"], state["net"] = [], f"{net} {dtype}"
            fn()
            sync()
            out[f"{net} {dtype}"] = state["rows"]
            state["rows"] = None
        del calls
        cupy.get_default_memory_pool().free_all_blocks()
    write_json(a.out, {"recorded": recorded(a.note), "l2_MB": round(l2_cache_bytes() / 1e6, 1), "layers": out})


if __name__ == "__main__":
    main()
