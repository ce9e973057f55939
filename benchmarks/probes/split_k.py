"""The weight gradient's split-K, measured: a training step with and without it.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/split_k.py [--clouds kitti_20k,kitti]
        [--out split_k.json]

``numba_sc.gmas.gemm_grouping.transposed_products_cuda`` cuts a long ``A.T @ B`` (the
weight gradient of the submanifold centre or of a solo group) into chunks of
``SPLIT_ROWS`` rows. This times one MinkUNet42 training step (forward in training
mode under a Tape, backward from a fixed output gradient) with ``SPLIT_ROWS`` as
shipped and with 0 (no split), interleaved call by call (``common.interleaved``: wall
clock between device-wide synchronizes, medians), in fp32 and fp16, and checks that
both give the same weight gradients to rounding.

Never runs in CI.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, interleaved, recorded  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--clouds", default="kitti_20k,kitti")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="split_k.json")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns
    from numba_sc import nn
    from numba_sc.gmas import gemm_grouping as gg
    from bench_net import build_ours, calibrated_state, load_cloud

    data = find_data(args.data)
    shipped = gg.SPLIT_ROWS
    out = {"recorded": recorded("probes/split_k.py"), "split_rows": shipped, "runs": []}
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

            def step(split):
                def run():
                    gg.SPLIT_ROWS = shipped if split else 0
                    try:
                        with nn.Tape() as tape:
                            y = model(x.without_maps())
                        return tape.backward(y, g)
                    finally:
                        gg.SPLIT_ROWS = shipped
                return run

            a, b = step(True)(), step(False)()
            worst = max(float(cupy.linalg.norm((a[k] - b[k]).astype(np.float32))
                              / max(float(cupy.linalg.norm(b[k].astype(np.float32))), 1e-30)) for k in a)
            del a, b
            t = interleaved({"split": step(True), "no split": step(False)}, args.rounds, block=2, warmup=3)
            rec = {"net": "unet42", "cloud": cloud, "n": int(len(coords)), "dtype": dt,
                   "step_ms": {k: v["ms"] for k, v in t.items()}, "worst_grad_rel_diff": worst}
            rec["split_over_no_split"] = rec["step_ms"]["split"] / rec["step_ms"]["no split"]
            out["runs"].append(rec)
            print(f"{cloud:10s} {dt:8s} step split {rec['step_ms']['split']:8.2f} ms, no split "
                  f"{rec['step_ms']['no split']:8.2f} ms: {rec['split_over_no_split']:.2f}x; "
                  f"worst gradient difference {worst:.1e}", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
