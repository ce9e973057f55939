"""The training step with the gathered input buffers kept for the weight gradient, and without.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/tape_buffers.py \
        [--clouds kitti_20k,random] [--nets resnet21,unet42] [--out tape_buffers.json]

On an open :class:`numba_sc.nn.Tape`, a convolution keeps the input buffer its
forward gathered (K slots of every input's row: many times the layer's input),
so that its weight gradient reads it instead of gathering again
(``Tape.keep_buffer``; bounded by the workspace). This probe times one training
step (forward on the tape, backward from a fixed gradient; fp16 through the
benchmarks' mixed-precision step, ``bench_train.OursAmp``, at a fixed scale) both
ways, interleaved call by call (wall clock between device-wide synchronizes,
median of 20 after warm-up), and the bytes each takes from CuPy's pool at most
(``cupy_peak``, each after the pool is emptied). "gather again" makes
``keep_buffer`` answer no. Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/

from bench_train import OursAmp  # noqa: E402
from common import cupy_peak, find_data, interleaved, random_coords, recorded, scan_coords, sync, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clouds", default="kitti_20k,random")
    ap.add_argument("--nets", default="resnet21,unet42")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="tape_buffers.json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    import cupy

    import numba_sc as ns
    from numba_sc import nn
    real_keep = nn.Tape.keep_buffer

    def mode(step, keep):
        def call():
            nn.Tape.keep_buffer = real_keep if keep else (lambda self, nbytes: False)
            try:
                return step()
            finally:
                nn.Tape.keep_buffer = real_keep
        return call

    rows = {}
    for cloud in a.clouds.split(","):
        coords = random_coords() if cloud == "random" else scan_coords(find_data(), cloud)
        feats = np.random.default_rng(1).standard_normal((len(coords), 4)).astype(np.float32)
        x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))
        for net in a.nets.split(","):
            for dtype in a.dtypes.split(","):
                m = (ns.models.SparseResNet21(4) if net == "resnet21" else ns.models.MinkUNet42(4, 19)).cuda().train()
                with nn.Tape():
                    shape = m(x.without_maps()).features.shape
                g = cupy.asarray((np.random.default_rng(0).standard_normal(shape) / np.sqrt(np.prod(shape)))
                                 .astype(np.float32))
                if dtype == "float16":
                    amp = OursAmp(m, g)

                    def step(amp=amp):
                        amp.step(x, scale=1024.0)
                else:
                    def step(m=m, g=g):
                        with nn.Tape() as tape:
                            y = m(x.without_maps())
                        tape.backward(y, g)
                calls = {"keep": mode(step, True), "gather again": mode(step, False)}
                times = interleaved(calls, rounds=a.rounds, block=4, warmup=2)
                row = {"voxels": len(coords)}
                for name, fn in calls.items():
                    sync()
                    cupy.get_default_memory_pool().free_all_blocks()
                    peak = cupy_peak(fn)
                    row[name] = {"ms": round(times[name]["ms"], 2), "extra_MB": round(peak["extra_bytes"] / 1e6, 1)}
                rows[f"{net} {cloud} {dtype}"] = row
                print(f"{net:9s} {cloud:10s} {dtype}  keep {row['keep']['ms']:8.2f} ms {row['keep']['extra_MB']:9.1f} MB"
                      f" | gather again {row['gather again']['ms']:8.2f} ms {row['gather again']['extra_MB']:9.1f} MB",
                      flush=True)
                del m, calls, step, g
                cupy.get_default_memory_pool().free_all_blocks()
    write_json(a.out, {"recorded": recorded(a.note), "rows": rows})


if __name__ == "__main__":
    main()
