"""What the bounded workspace (numba_sc.gmas.workspace) costs and saves, by bound.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/workspace.py [--clouds random,kitti_20k]
        [--bounds 0,1024,256] [--nets unet42] [--dtypes float32,float16] [--train] [--out workspace.json]

Issue #37: on 1M random voxels one forward pass of MinkUNet42 peaked at 4.3x spconv's
memory, the gather-GEMM-scatter buffers of its dense coarse levels. For each network,
cloud, dtype and bound (MiB; 0 = unbounded, every layer in one window), this records:

* the peak of the bytes allocated from CuPy's pool during one forward pass (and one
  training step with ``--train``), above what was allocated before it (weights and input);
* the forward pass's wall clock (between device-wide synchronizes), the bounds
  interleaved call by call, median of ``--reps``;
* the largest layer buffers of the pass (bytes of both buffers of the tallest layer).

Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import cupy_peak, find_data, interleaved, random_coords, recorded, scan_coords, write_json  # noqa: E402


def cloud(name, data):
    if name == "random":
        c = random_coords()
    else:
        c = scan_coords(data, name)
    rng = np.random.default_rng(0)
    return np.ascontiguousarray(c, dtype=np.int32), rng.standard_normal((len(c), 4)).astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clouds", default="random,kitti_20k")
    ap.add_argument("--nets", default="unet42")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--bounds", default="0,1024,256", help="workspace bounds in MiB (0: unbounded)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--train", action="store_true", help="also the peak of one training step")
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", default="workspace.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns
    from numba_sc import nn

    data = find_data(args.data, required=False)
    bounds = [int(b) for b in args.bounds.split(",")]
    out = {"recorded": recorded(args.note), "bounds_mib": bounds, "runs": []}
    for net in args.nets.split(","):
        for cname in args.clouds.split(","):
            coords, feats = cloud(cname, data)
            for dt in args.dtypes.split(","):
                model = (nn.models.MinkUNet42 if net == "unet42" else nn.models.SparseResNet21)(in_channels=4)
                model.to(np.dtype(dt)).cuda()
                x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(dt)))
                rec = {"net": net, "cloud": cname, "n": len(coords), "dtype": dt, "by_bound": {}}
                ref = None
                for b in bounds:
                    ns.set_workspace(b << 20)
                    y = model(x.without_maps())
                    f = cupy.asnumpy(y.features).astype(np.float32)
                    del y
                    ref = f if ref is None else ref
                    scale = max(float(np.abs(ref).max()), 1e-30)
                    r = {"rel_err_vs_first": float(np.abs(f - ref).max() / scale)}
                    r["forward"] = cupy_peak(lambda: model(x.without_maps()))
                    rec["by_bound"][str(b)] = r
                    cupy.get_default_memory_pool().free_all_blocks()
                if args.train:  # after the forward passes: a training-mode pass moves BatchNorm's statistics
                    model.train()

                    def step():
                        with nn.Tape() as tape:
                            yy = model(x.without_maps())
                        tape.backward(yy, cupy.ones_like(yy.features) / yy.features.size)

                    for b in bounds:
                        ns.set_workspace(b << 20)
                        try:
                            rec["by_bound"][str(b)]["train_step"] = cupy_peak(step)
                        except Exception as e:  # noqa: BLE001 - a probe reports
                            rec["by_bound"][str(b)]["train_step"] = {"error": repr(e)}
                        cupy.get_default_memory_pool().free_all_blocks()
                    model.eval()

                def at(b):
                    def call():
                        ns.set_workspace(b << 20)
                        return model(x.without_maps())
                    return call

                t = interleaved({str(b): at(b) for b in bounds}, rounds=args.reps, block=1, warmup=2)
                for b in bounds:
                    rec["by_bound"][str(b)]["wall_ms"] = t[str(b)]["ms"]
                ns.set_workspace(None)
                out["runs"].append(rec)
                line = " | ".join(f"{b} MiB: {rec['by_bound'][str(b)]['wall_ms']:.2f} ms, "
                                  f"{rec['by_bound'][str(b)]['forward']['extra_bytes'] / 2**20:.0f} MiB"
                                  + (f", step {rec['by_bound'][str(b)]['train_step'].get('extra_bytes', 0) / 2**20:.0f}"
                                     f" MiB" if args.train else "")
                                  + f", err {rec['by_bound'][str(b)]['rel_err_vs_first']:.1e}" for b in bounds)
                print(f"{net} {cname} {len(coords)} {dt}: {line}", flush=True)
                write_json(args.out, out)
                del model, x
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
