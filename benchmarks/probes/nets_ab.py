"""Both networks on the 1M random cloud: this package against older copies of it, whole.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/nets_ab.py --base .ab --copies main \
        [--dtypes float16,float32] [--out nets_ab.json]

For SparseResNet21 and MinkUNet42 (the same weights in every copy, as
``ab_compare.nets`` builds them), in each dtype, it records:

* the outputs' agreement with the first copy's (largest difference over the largest value);
* the forward pass's wall clock between device-wide synchronizes, the copies interleaved
  call by call, median of 20 after warm-up;
* the bytes allocated from CuPy's pool during one pass (``cupy_peak``): the peak, and the
  peak above what was allocated before it (what the pass itself took).

The copies are older trees of the package in ``--base`` as ``<name>_sc/`` (see
``kernel_breakdown.py``); the workspace (``NUMBA_SC_WORKSPACE_MB``) applies to each.
Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py, ab_compare.py

from ab_compare import nets  # noqa: E402
from common import cupy_peak, interleaved, package_copies, random_coords, recorded, sync, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=".ab", help="folder holding the copies, <name>_sc/")
    ap.add_argument("--copies", default="main", help="comma-separated names of the copies")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--out", default="nets_ab.json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    import cupy

    packages = package_copies(a.base, a.copies)
    coords = random_coords()
    rows = {}
    for dtype in a.dtypes.split(","):
        calls = nets(packages, coords, np.dtype(dtype))
        outs = {}
        for key, fn in calls.items():
            y = fn()
            sync()
            outs[key] = cupy.asnumpy(y.features).astype(np.float32)
        times = interleaved({f"{n} {p}": fn for (n, p), fn in calls.items()}, rounds=5, block=4, warmup=3)
        for (net, pname), fn in calls.items():
            ref = outs[(net, "new")]
            cupy.get_default_memory_pool().free_all_blocks()
            peak = cupy_peak(fn)
            rows[f"{net} {pname} {dtype}"] = {
                "ms": round(times[f"{net} {pname}"]["ms"], 2),
                "peak_MiB": round(peak["peak_bytes"] / 2**20), "extra_MiB": round(peak["extra_bytes"] / 2**20),
                "max_diff_over_max": float(np.abs(outs[(net, pname)] - ref).max() / max(np.abs(ref).max(), 1e-6)),
                "finite": bool(np.isfinite(outs[(net, pname)]).all())}
        del calls, outs
        cupy.get_default_memory_pool().free_all_blocks()
    for k, v in rows.items():
        print(f"{k:28s} {v['ms']:8.2f} ms  peak {v['peak_MiB']:6d} MiB  extra {v['extra_MiB']:6d} MiB")
    write_json(a.out, {"recorded": recorded(a.note), "rows": rows})


if __name__ == "__main__":
    main()
