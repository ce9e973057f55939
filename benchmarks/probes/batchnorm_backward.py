"""BatchNorm's backward, v1 (array-library steps, ~12 launches) against v2 (two kernels and
a zeroing, the library's), on the BatchNorm shapes of MinkUNet42 on the SemanticKITTI scan,
and one MinkUNet42 training step (forward + backward, fp32) with each rung in the layers.

    python3 benchmarks/probes/batchnorm_backward.py --out benchmarks/results/batchnorm_backward.json

Training mode with the ReLU's mask (what the training step runs after a convolution).
The rungs are timed interleaved call by call (``common.interleaved``): host wall clock
between device-wide synchronizes and CUDA events of the same call, medians of ``--reps``.
Each rung's error against the float64 reference is recorded beside its time. For the
step, ``numba_sc.nn.pointwise.batch_norm_backward`` (which every BatchNorm calls) is
pointed at v1 or v2 before each call.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import HOST_AND_GPU, find_data, interleaved, recorded, rounds_for, scan_coords, write_json  # noqa: E402


def shape_rows(args, n_scan):
    rows = []
    for spec in args.shapes.split(","):
        n, c = spec.split("x")
        rows.append((n_scan if n == "scan" else int(n), int(c)))
    return rows


def time_shape(n, c, dtype, reps):
    import cupy

    from numba_sc.nn import pointwise as pw

    rng = np.random.default_rng(0)
    x = cupy.asarray((rng.standard_normal((n, c)) * 2 + 1).astype(dtype))
    g = cupy.asarray(rng.standard_normal((n, c)).astype(dtype))
    w = cupy.asarray(rng.uniform(0.5, 1.5, c).astype(np.float32))
    b = cupy.asarray(rng.normal(0, 0.3, c).astype(np.float32))
    mean, var = pw.batch_statistics(x)
    y = pw.batch_norm(x, w, b, mean, var, relu=True)
    want = pw.batch_norm_backward_reference(*(v.get() for v in (g, x, y, w, mean, var)), 1e-5, True, True)
    rec = {"n": n, "channels": c, "dtype": np.dtype(dtype).name, "rel_err": {}}
    fns = {}
    for name, fn in (("v1", pw.batch_norm_backward_v1), ("v2", pw.batch_norm_backward_v2)):
        got = fn(g, x, y, w, mean, var, 1e-5, True, True)
        rec["rel_err"][name] = {k: float(np.abs(a.get().astype(np.float64) - ref).max() / max(1.0, np.abs(ref).max()))
                                for k, a, ref in zip(("dx", "dweight", "dbias"), got, want)}
        fns[name] = (lambda f: lambda: f(g, x, y, w, mean, var, 1e-5, True, True))(fn)
    t = interleaved(fns, rounds_for(reps, 3), block=3, timers=HOST_AND_GPU)
    for name in fns:
        rec[name] = {"host_ms": t[name]["host_ms"], "gpu_ms": t[name]["gpu_ms"]}
    rec["speedup_host"] = rec["v1"]["host_ms"] / rec["v2"]["host_ms"]
    return rec


def time_step(data, reps):
    import cupy

    import numba_sc as ns
    from numba_sc import models, nn
    from numba_sc.nn import pointwise as pw
    from common import scan_points

    pts, vs = scan_points(data, "kitti")
    v = ns.voxelize(pts[:, :3], vs, features=np.ascontiguousarray(pts[:, :4]), backend="reference")
    x = ns.SparseTensor(cupy.asarray(v.coords), cupy.asarray(v.features.astype(np.float32)))
    model = models.MinkUNet42(4, 19).cuda().train()
    with nn.Tape():
        y = model(x.without_maps())
    g = cupy.asarray((np.random.default_rng(0).standard_normal(y.features.shape)
                      / np.sqrt(y.features.size)).astype(np.float32))
    rungs = {"v1": pw.batch_norm_backward_v1, "v2": pw.batch_norm_backward_v2}
    real_v2 = rungs["v2"]

    def step_with(name):
        def step():
            pw.batch_norm_backward_v2 = rungs[name]  # what batch_norm_backward (every BatchNorm) calls
            try:
                with nn.Tape() as tp:
                    yy = model(x.without_maps())
                tp.backward(yy, g)
            finally:
                pw.batch_norm_backward_v2 = real_v2
        return step

    t = interleaved({k: step_with(k) for k in rungs}, rounds_for(reps, 2), block=2, warmup=2)
    out = {"n": int(len(v.coords)), "dtype": "float32", "net": "MinkUNet42"}
    for k in rungs:
        out[k] = {"ms": t[k]["ms"]}
    out["speedup"] = out["v1"]["ms"] / out["v2"]["ms"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--shapes", default="scanx32,scanx64,24000x128",
                    help="NxC,...; N 'scan': the SemanticKITTI scan's voxel count")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--step-reps", type=int, default=10)
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--out", default="batchnorm_backward.json")
    ap.add_argument("--note", default="", help="what code this run measures (recorded)")
    args = ap.parse_args()
    data = find_data(args.data)
    n_scan = len(scan_coords(data, "kitti"))
    res = {"recorded": recorded(args.note), "shapes": []}
    for n, c in shape_rows(args, n_scan):
        for dtype in (np.float32, np.float16):
            r = time_shape(n, c, dtype, args.reps)
            res["shapes"].append(r)
            print(f"{n} x {c} {r['dtype']}: v1 {r['v1']['host_ms']:.3f} ms (gpu {r['v1']['gpu_ms']:.3f}), "
                  f"v2 {r['v2']['host_ms']:.3f} ms (gpu {r['v2']['gpu_ms']:.3f}), "
                  f"max err v2 {max(r['rel_err']['v2'].values()):.1e}", flush=True)
            write_json(args.out, res)
    if not args.no_step:
        s = time_step(data, args.step_reps)
        res["step"] = s
        print(f"MinkUNet42 step ({s['n']} voxels, fp32): v1 {s['v1']['ms']:.2f} ms, v2 {s['v2']['ms']:.2f} ms",
              flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
