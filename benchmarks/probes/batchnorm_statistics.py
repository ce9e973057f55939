"""Training-mode BatchNorm's statistics, measured: six launches against the array library's steps.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/batchnorm_statistics.py [--out bn_stats.json]

``numba_sc.nn.pointwise.batch_statistics_update`` (two passes of a column-sum kernel, a
fixed-order sum, one finishing kernel) against what it replaced: ``batch_statistics``
(matrix-vector column sums and element-wise steps) and the running averages updated
by array-library arithmetic, about fifteen device operations a layer. Times one
MinkUNet42 training step (forward in training mode under a Tape, backward from a fixed
gradient) with each, interleaved call by call (``common.interleaved``), and the
largest difference of the two steps' weight gradients.

Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, interleaved, recorded, write_json  # noqa: E402


def array_library_update(x, running_mean, running_var, momentum):
    """The replaced path: the statistics and the running averages by array-library steps."""
    from numba_sc.nn import pointwise as pw

    mean, var = pw.batch_statistics(x)
    n = x.shape[0]
    unbiased = var * (n / max(n - 1, 1))
    return mean, var, (1 - momentum) * running_mean + momentum * mean, (1 - momentum) * running_var + momentum * unbiased


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--clouds", default="kitti_20k,kitti")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="bn_stats.json")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns
    from numba_sc import nn
    from numba_sc.nn import pointwise as pw
    from bench_net import build_ours, calibrated_state, load_cloud

    fused = pw.batch_statistics_update
    data = find_data(args.data)
    out = {"recorded": recorded("probes/batchnorm_statistics.py"), "runs": []}
    for cloud in args.clouds.split(","):
        coords, feats = load_cloud(cloud, data)
        state = calibrated_state("unet42", coords, feats)
        for dt in args.dtypes.split(","):
            model = build_ours("unet42", feats.shape[1])
            model.load_state_dict(state)
            model.to(np.dtype(dt)).cuda().train()
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(dt)))
            g = cupy.asarray((np.random.default_rng(0).standard_normal((len(coords), 19))
                              / np.sqrt(len(coords) * 19)).astype(dt))

            def step(update):
                def run():
                    pw.batch_statistics_update = update
                    try:
                        with nn.Tape() as tape:
                            y = model(x.without_maps())
                        return tape.backward(y, g)
                    finally:
                        pw.batch_statistics_update = fused
                return run

            a, b = step(fused)(), step(array_library_update)()
            worst = max(float(cupy.linalg.norm((a[k] - b[k]).astype(np.float32))
                              / max(float(cupy.linalg.norm(b[k].astype(np.float32))), 1e-30)) for k in a)
            del a, b
            t = interleaved({"six launches": step(fused), "array library": step(array_library_update)},
                            args.rounds, block=2, warmup=3)
            rec = {"net": "unet42", "cloud": cloud, "n": int(len(coords)), "dtype": dt,
                   "step_ms": {k: v["ms"] for k, v in t.items()}, "worst_grad_rel_diff": worst}
            rec["ratio"] = rec["step_ms"]["six launches"] / rec["step_ms"]["array library"]
            out["runs"].append(rec)
            print(f"{cloud:10s} {dt:8s} step: six launches {rec['step_ms']['six launches']:8.2f} ms, array library "
                  f"{rec['step_ms']['array library']:8.2f} ms: {rec['ratio']:.2f}x; worst gradient difference "
                  f"{worst:.1e}", flush=True)
            write_json(args.out, out)


if __name__ == "__main__":
    main()
