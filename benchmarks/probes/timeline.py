"""Where a call's wall time goes on the GPU: its kernel timeline, ours beside spconv's.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/timeline.py [--clouds kitti_20k,kitti]
        [--out timeline.json]

For issue #27's misses: is a call host-bound (the GPU idles between short kernels while
the host launches the next) or GPU-bound (kernels back to back)? PyTorch's profiler
(CUPTI) records every kernel, memset and copy on the device, whichever library launched
it (Numba, CuPy, cuBLAS, spconv), so both sides are traced the same way. For each
workload (MinkUNet42 fp32: the forward pass, and a training step: forward in training
mode + backward from a fixed output gradient; the strided 2x2x2 Map step alone) it
records, per call: the wall time (without the profiler, median of ``--reps``), the
number of device operations, the time the device was busy (the union of their
intervals, with the profiler on), the operations with the most device time, and the
most frequent ones.
Busy / wall near 1 means GPU-bound; far below, host-bound: what the GPU waited for is
the host's launches and reads.

Never runs in CI.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, recorded, scan_coords, sync, write_json  # noqa: E402


def busy_ms(intervals):
    """Length of the union of (start, end) intervals, in ms (profiler times are in us)."""
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def trace(fn, reps):
    """(wall ms median without the profiler, device operations a call, busy ms a call,
    top operations by device ms a call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    walls = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name, count = {}, {}
    for e in ops:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        count[e.name] = count.get(e.name, 0) + 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    frequent = sorted(count.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": round(statistics.median(walls), 4), "ops": len(ops) / reps,
            "busy_ms": round(busy_ms([(e.time_range.start, e.time_range.end) for e in ops]) / reps, 4),
            "top": [(n[:90], round(ms / reps, 4)) for n, ms in top],
            "frequent": [(n[:90], c / reps) for n, c in frequent]}


def workloads(cloud, data):
    import cupy
    import spconv.pytorch as spconv
    import torch

    import numba_sc as ns
    from numba_sc import nn
    from bench_net import build_ours, build_spconv, calibrated_state, load_cloud, spconv_input
    from numba_sc.nn.spconv_format import state_dict_to_spconv

    coords, feats = load_cloud(cloud, data)
    state = calibrated_state("unet42", coords, feats)
    ours = build_ours("unet42", feats.shape[1])
    ours.load_state_dict(state)
    ours.cuda()
    twin = build_spconv("unet42", feats.shape[1], "MaskImplicitGemm")
    twin.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict_to_spconv(ours).items()})
    indices, spatial, lo = spconv_input(coords, feats)
    tfeats = torch.from_numpy(feats).cuda()
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))
    rng = np.random.default_rng(0)
    g = cupy.asarray((rng.standard_normal((len(coords), 19)) / np.sqrt(len(coords) * 19)).astype(np.float32))
    gt = torch.as_tensor(g, device="cuda")

    def ours_forward():
        ours.eval()
        return ours(x.without_maps())

    def ours_step():
        ours.train()
        with nn.Tape() as tp:
            y = ours(x.without_maps())
        tp.backward(y, g)

    def sp_forward():
        twin.eval()
        with torch.no_grad():
            return twin(spconv.SparseConvTensor(tfeats, indices, spatial, 1))

    def sp_step():
        twin.train()
        twin.zero_grad(set_to_none=True)
        twin(spconv.SparseConvTensor(tfeats, indices, spatial, 1)).features.backward(gt)

    c = cupy.asarray(coords)
    return {"MinkUNet42 forward": {"ours": ours_forward, "spconv MaskImplicitGemm": sp_forward},
            "MinkUNet42 training step": {"ours": ours_step, "spconv MaskImplicitGemm": sp_step},
            "strided 2x2x2 Map step": {"ours": lambda: ns.build_kernel_map(c, 2, stride=2, assume_sorted=True)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--clouds", default="kitti_20k,kitti")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="timeline.json")
    ap.add_argument("--only", default="", help="only the workloads whose name holds this text")
    ap.add_argument("--frequent", action="store_true", help="also print the most frequent device operations")
    args = ap.parse_args()
    data = find_data(args.data)
    out = {"recorded": recorded("probes/timeline.py"), "clouds": {}}
    for cloud in args.clouds.split(","):
        n = len(scan_coords(data, cloud))
        row = out["clouds"][cloud] = {"voxels": n}
        for work, contenders in workloads(cloud, data).items():
            if args.only not in work:
                continue
            for who, fn in contenders.items():
                t = row.setdefault(work, {})[who] = trace(fn, args.reps)
                print(f"{cloud:10s} {work:26s} {who:24s} wall {t['wall_ms']:8.3f} ms  busy {t['busy_ms']:8.3f} ms "
                      f"({t['busy_ms'] / t['wall_ms']:.0%})  {t['ops']:.0f} device ops", flush=True)
                for name, ms in t["top"][:4]:
                    print(f"{'':40s}{ms:8.3f} ms  {name}")
                if args.frequent:
                    for name, c in t["frequent"]:
                        print(f"{'':40s}{c:8.1f} x   {name}")
        write_json(args.out, out)


if __name__ == "__main__":
    main()
