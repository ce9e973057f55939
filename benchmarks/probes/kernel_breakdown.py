"""Where a network's device time goes, kernel by kernel: this package beside older copies of it.

    . benchmarks/gpu_env.sh; NUMBA_SC_WORKSPACE_MB=0 python3 benchmarks/probes/kernel_breakdown.py \
        --base .ab --copies base --dtype float16 [--net unet42] [--out breakdown.json]

An A/B of whole networks (``benchmarks/ab_compare.py --nets``) says *that* two versions
differ; this says *where*. For one network (MinkUNet42 or SparseResNet21, the same weights
in every copy, as ``ab_compare.nets`` builds them) on the 1M random cloud, it runs a few
forward passes of each package under PyTorch's profiler (CUPTI: every kernel, memset and
copy, whoever launched it) and sums the device time and the launches of each kernel,
named without its Numba mangling (``gmas::scatter::scatter_v3``) or by its cuBLAS tile;
and it times the call by wall clock between device-wide synchronizes (median of 5).
The copies are older trees of the package, put in ``--base`` as ``<name>_sc/``
(``git worktree add /tmp/x <commit> && cp -r /tmp/x/numba_sc .ab/x_sc``), imported under
that name. The workspace (``NUMBA_SC_WORKSPACE_MB``) applies to every copy that has one.

Never runs in CI.
"""
import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py, ab_compare.py

from ab_compare import nets  # noqa: E402
from common import package_copies, random_coords, recorded, sync, write_json  # noqa: E402


def kernel_name(name):
    """A short, stable name: Numba's ``module::function`` without its ABI tags, cuBLAS's
    and CUTLASS's GEMMs by their tile, CUB's sort as one."""
    name = re.sub(r"\[abi:[^\]]*\]", "", name)
    if "_sc::" in name or name.startswith("numba_sc"):
        parts = [p for p in name.split("(")[0].split("::")[1:] if not p.startswith("_3c")]
        return "::".join(parts[:3])
    if "xmma" in name or "gemm" in name.lower() or "cutlass" in name or name.startswith("nvjet"):
        m = re.search(r"tilesize(\w+?)_", name)
        return "GEMM " + (m.group(1) if m else name[:48])
    if "cub::" in name:
        return "CUB sort" if "Sort" in name else "CUB " + name.split("::")[-1][:40]
    return name[:60]


def breakdown(fn, reps):
    """(wall ms median of 5, {kernel: [device ms a call, launches a call]})."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    walls = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    ms, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernel_name(e.name)
            ms[k] += (e.time_range.end - e.time_range.start) / 1e3 / reps
            count[k] += 1 / reps
    return statistics.median(walls), {k: [round(ms[k], 3), round(count[k], 1)] for k in ms}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=".ab", help="folder holding the copies, <name>_sc/")
    ap.add_argument("--copies", default="base", help="comma-separated names of the copies (none: '')")
    ap.add_argument("--net", default="unet42", choices=("unet42", "resnet21"))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="kernels printed (all are kept in --out)")
    ap.add_argument("--out", default="breakdown.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    import torch  # noqa: F401 - the profiler; listed in the record
    packages = package_copies(args.base, args.copies)
    coords = random_coords()
    calls = nets(packages, coords, np.dtype(args.dtype))
    res = {}
    for (net, pname), fn in calls.items():
        if net == args.net:
            wall, kernels = breakdown(fn, args.reps)
            res[pname] = {"wall_ms": round(wall, 3), "device_ms": round(sum(v[0] for v in kernels.values()), 3),
                          "launches": round(sum(v[1] for v in kernels.values())), "kernels": kernels}
            print(f"{pname:8s} wall {wall:8.2f} ms  device {res[pname]['device_ms']:8.2f} ms  "
                  f"launches {res[pname]['launches']}")
    names = sorted({k for r in res.values() for k in r["kernels"]},
                   key=lambda k: -max(r["kernels"].get(k, [0, 0])[0] for r in res.values()))
    print(f"{'kernel (ms a call / launches)':44s}" + "".join(f"{p:>15s}" for p in res))
    for k in names[:args.top]:
        print(f"{k[:44]:44s}" + "".join("{:9.2f}/{:<5.0f}".format(*r["kernels"].get(k, [0, 0])) for r in res.values()))
    out = {"recorded": recorded(args.note), "net": args.net, "dtype": args.dtype, "voxels": len(coords),
           "workspace_mb": os.environ.get("NUMBA_SC_WORKSPACE_MB", "default"), "packages": res}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
