"""What fp16 layers' per-offset products cost in float32 against fp16: the GMaS step with each buffer.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/fp16_products.py [--channels 32,64,128]
        [--out benchmarks/results/fp16_products.json]

Issue #33: with float16 features the grouped GEMMs wrote their per-offset products into
a float16 buffer, so a product beyond 65504 became inf (and inf - inf NaN) where the
scatter's sum, and the other two dataflows, give a representable value. Issue #33 kept
that buffer in float32 (cuBLAS reads fp16 and writes fp32, the scatter reads fp32), which
doubles the buffer's bytes; issue #37 measured the price on the 1M cloud (MinkUNet42 in
fp16, 1.4x) and went back to the fp16 buffer with a guard: the scatter computes a product
it reads as inf or NaN again in fp32 (``numba_sc.gmas.scatter.product_of``). The library's
rule is ``numba_sc.gmas.gemm_grouping.product_dtype``.

For a 3x3x3 submanifold layer on the SemanticKITTI scan at 0.05 m, C -> C channels for
each C of ``--channels``, fp16 features, one map and plan built up front, this times the
GMaS step (centre product, gather, grouped GEMMs, scatter: ``numba_sc.conv.dataflow.gather_gemm_scatter``)
with the float32 buffer (``products=np.float32``, issue #33's) and the float16 one (now),
interleaved call by call (``common.interleaved``; wall clock between device-wide
synchronizes, and CUDA events), and the largest difference of the two outputs (they
agree within fp16 rounding when nothing overflows). The float32 layer is timed beside
them for scale.

Never runs in CI.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, gpu_ms, interleaved, recorded, scan_coords, wall_ms, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--channels", default="32,64,128")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--net", default="kitti,kitti_20k",
                    help="clouds for the whole-network A/B (MinkUNet42 fp16 forward); empty: none")
    ap.add_argument("--out", default="benchmarks/results/fp16_products.json")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns
    from numba_sc.conv.arguments import resolve_tiles
    from numba_sc.conv.dataflow import gather_gemm_scatter
    from numba_sc.conv.prepare import prepare_layer

    coords = scan_coords(find_data(args.data), "kitti")
    rng = np.random.default_rng(0)
    out = {"recorded": recorded("probes/fp16_products.py"), "cloud": "kitti", "voxels": int(len(coords)),
           "layer": "submanifold 3x3x3, C -> C", "runs": []}
    print(f"SemanticKITTI at 0.05 m: {len(coords)} voxels; GMaS step of a 3x3x3 submanifold layer, ms (median)")
    print(f"{'C':>4s} {'fp16, fp32 products':>20s} {'fp16, fp16 products':>20s} {'ratio':>6s} "
          f"{'fp32 layer':>11s} {'max |diff|':>11s}")
    for c in (int(v) for v in args.channels.split(",")):
        feats = rng.standard_normal((len(coords), c)).astype(np.float32)
        weight = (rng.standard_normal((27, c, c)) / np.sqrt(27 * c)).astype(np.float32)
        calls, outputs = {}, {}
        for dt in (np.float16, np.float32):
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(dt)))
            f, w, km, plan = prepare_layer(x, cupy.asarray(weight.astype(dt)), 3, 1, 1, False, None, "cuda")
            tiles = resolve_tiles(None, c, c, f.shape[0], plan.n_out, f.dtype, 27, False)
            kinds = ([("fp16, fp32 products", np.float32), ("fp16, fp16 products", None)] if dt is np.float16
                     else [("fp32 layer", None)])
            for name, products in kinds:
                calls[name] = (lambda f=f, w=w, plan=plan, tiles=tiles, products=products:
                               gather_gemm_scatter(f, w, plan, tiles, "cuda", products=products))
                outputs[name] = calls[name]()
        diff = float(cupy.abs(outputs["fp16, fp32 products"].astype(np.float32)
                              - outputs["fp16, fp16 products"].astype(np.float32)).max())
        t = interleaved(calls, args.rounds, block=2, warmup=3, timers={"ms": wall_ms, "gpu_ms": gpu_ms})
        rec = {"channels": c, "ms": {k: v["ms"] for k, v in t.items()}, "gpu_ms": {k: v["gpu_ms"] for k, v in t.items()},
               "max_abs_diff": diff}
        rec["ratio"] = rec["ms"]["fp16, fp32 products"] / rec["ms"]["fp16, fp16 products"]
        rec["gpu_ratio"] = rec["gpu_ms"]["fp16, fp32 products"] / rec["gpu_ms"]["fp16, fp16 products"]
        out["runs"].append(rec)
        ms = rec["ms"]
        print(f"{c:4d} {ms['fp16, fp32 products']:20.3f} {ms['fp16, fp16 products']:20.3f} {rec['ratio']:6.2f} "
              f"{ms['fp32 layer']:11.3f} {diff:11.2e}  (GPU time ratio {rec['gpu_ratio']:.2f})", flush=True)
        write_json(args.out, out)
    out["net"] = [network_ab(cloud, args) for cloud in args.net.split(",") if cloud]
    write_json(args.out, out)
    print(f"wrote {args.out}")


def network_ab(cloud, args):
    """What a user of fp16 meets: MinkUNet42's fp16 forward (eval mode, every map built
    again each call), with the float16 buffer (the library's) and the float32 one (the
    library's ``gemm_grouping.product_dtype`` swapped for the call), interleaved."""
    import cupy

    import numba_sc as ns
    from bench_net import build_ours, load_cloud
    from numba_sc.gmas import gemm_grouping as gg

    coords, feats = load_cloud(cloud, find_data(args.data))
    model = build_ours("unet42", feats.shape[1]).cuda().half().eval()
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(np.float16)))
    now = gg.product_dtype

    def run(rule):
        def call():
            gg.product_dtype = rule
            try:
                model(x.without_maps())
            finally:
                gg.product_dtype = now
        return call

    t = interleaved({"fp32 products": run(lambda dt: np.promote_types(dt, np.float32)), "fp16 products": run(now)},
                    args.rounds, block=2, warmup=3, timers={"ms": wall_ms})
    rec = {"cloud": cloud, "voxels": int(len(coords)), "net": "MinkUNet42 fp16 forward",
           "ms": {k: v["ms"] for k, v in t.items()}}
    rec["ratio"] = rec["ms"]["fp32 products"] / rec["ms"]["fp16 products"]
    print(f"MinkUNet42 fp16 forward on {cloud} ({len(coords)} voxels): fp32 products "
          f"{rec['ms']['fp32 products']:.2f} ms, fp16 products {rec['ms']['fp16 products']:.2f} ms, "
          f"ratio {rec['ratio']:.3f}", flush=True)
    return rec


if __name__ == "__main__":
    main()
