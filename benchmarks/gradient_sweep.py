#!/usr/bin/env python
"""Whose gradient is right? Ours and spconv's, each against the float64 oracle (#33).

One training step of MinkUNet42 in float32 (training-mode BatchNorm, the benchmark's
calibrated weights, one fixed output gradient ``g``) on many clouds. For each cloud the
same weights and inputs go to

* the truth: our NumPy reference in float64 (:func:`numba_sc.check_gradients`);
* ours on the GPU in float32 ("cuda float32");
* ours' NumPy reference in float32 ("reference float32": float32 arithmetic, but the
  reference's order of sums and no fast math; where it is close to the truth and the GPU
  path is not, our kernels are at fault; where both drift, float32 itself is);
* spconv 2.3.8's twin (``spconv_nets.py``), Native and MaskImplicitGemm, its gradients
  converted to our names and layouts and judged by the same truth.

Needs the GPU machine with CuPy, PyTorch and spconv::

    . benchmarks/gpu_env.sh
    python3 benchmarks/gradient_sweep.py --out $OUT/gradient_sweep.json
    python3 benchmarks/gradient_sweep.py --clouds kitti_32beam_0.1 --out x.json
    python3 benchmarks/gradient_sweep.py --merge a.json b.json --out results/gradient_sweep.json

The clouds (20 by default, :data:`CLOUDS`): the three shared scans at 0.05, 0.1 and 0.2 m;
their 20k-voxel crops; SemanticKITTI with every other laser ring ("32 beams") at 0.1 and
0.2 m, the kind of sparse scan the issue met the drift on; the synthetic street scene
with input channels that are constant, nearly constant or nearly empty. Per cloud the
record holds each path's distance over all parameters, per parameter in network order,
its worst parameter, and per BatchNorm layer what the float64 forward saw (channels whose
batch variance is below eps, and values before the ReLU so close to zero that float32
rounding can flip the ReLU's mask).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import find_data, recorded, scan_points, write_json  # noqa: E402

VOXELS = (0.05, 0.1, 0.2)
SCAN_FILES = {"kitti": ("semantickitti_000000.bin", 4), "scannet": ("scannet_scene0000_00.bin", 6),
              "sunrgbd": ("sunrgbd_000017.bin", 6)}
SYNTHETIC = {  # name -> (scene seed, what happens to the 4th input channel)
    "synthetic_constant": (0, "constant"),
    "synthetic_near_constant": (1, "near constant"),
    "synthetic_near_empty": (2, "near empty"),
    "synthetic_near_empty_b": (3, "near empty"),
    "synthetic_zero": (4, "zero"),
}
CLOUDS = ([f"{s}_{v}" for s in SCAN_FILES for v in VOXELS] + ["kitti_20k", "scannet_20k", "sunrgbd_20k"]
          + ["kitti_32beam_0.1", "kitti_32beam_0.2"] + list(SYNTHETIC) + ["synthetic_near_empty_0.2"])


def every_other_ring(points):
    """SemanticKITTI's points on every other of its 64 laser rings: a 32-beam scan.
    The .bin has no ring index, so the rings are the 64 quantiles of the elevation angle
    (the HDL-64E's beams are not evenly spaced, but each holds about as many points)."""
    elev = np.arctan2(points[:, 2], np.hypot(points[:, 0], points[:, 1]))
    ring = np.searchsorted(np.quantile(elev, np.linspace(0, 1, 65)[1:-1]), elev)
    return points[ring % 2 == 0]


def cloud_points(name, data):
    """(points float32 (N, >= 4): x, y, z and features, voxel size) of one cloud."""
    from numba_sc.tools.synthetic import lidar_scene

    if name.endswith("_20k"):
        return scan_points(data, name)
    if name.startswith("kitti_32beam_"):
        pts = np.fromfile(Path(data) / SCAN_FILES["kitti"][0], np.float32).reshape(-1, 4)
        return every_other_ring(pts), float(name.rsplit("_", 1)[1])
    if name.startswith("synthetic"):
        base = name[:-4] if name.endswith("_0.2") else name
        seed, what = SYNTHETIC[base]
        xyz, _ = lidar_scene(seed=seed)
        rng = np.random.default_rng(seed)
        f = {"constant": np.ones(len(xyz)),
             "near constant": 1 + 1e-4 * rng.standard_normal(len(xyz)),
             "near empty": np.where(rng.random(len(xyz)) < 0.002, rng.random(len(xyz)), 0.0),
             "zero": np.zeros(len(xyz))}[what]
        return np.column_stack([xyz, f]).astype(np.float32), (0.2 if name.endswith("_0.2") else 0.1)
    scan, voxel = name.rsplit("_", 1)
    fname, cols = SCAN_FILES[scan]
    return np.fromfile(Path(data) / fname, np.float32).reshape(-1, cols), float(voxel)


def load(name, data):
    """(sorted unique int32 coords (N, 3), float32 features (N, 4): x, y, z, one more)."""
    import numba_sc as ns

    pts, voxel = cloud_points(name, data)
    v = ns.voxelize(np.ascontiguousarray(pts[:, :3]), voxel, features=np.ascontiguousarray(pts[:, :4]),
                    backend="reference")
    return v.coords, v.features.astype(np.float32)


# ------------------------------------------------------------------ spconv's side
def spconv_gradients(model, coords, feats, g):
    """(algo -> our parameter name -> spconv's float32 gradient in our layout, algo -> its
    output features in our rows' order), one step of each twin (training mode, the
    model's weights, the output gradient ``g``)."""
    import spconv.pytorch as spconv
    import torch

    from bench_net import build_spconv, spconv_output
    from spconv_nets import spconv_input
    from numba_sc.nn.spconv_format import state_dict_from_spconv, state_dict_to_spconv

    indices, spatial, lo = spconv_input(coords, feats)
    tfeats = torch.from_numpy(feats).cuda()
    sp_state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict_to_spconv(model).items()}
    names = [n for n, _ in model.trainable_parameters()]
    out, outputs = {}, {}
    for algo in ("Native", "MaskImplicitGemm"):
        t = build_spconv("unet42", feats.shape[1], algo)
        t.load_state_dict(sp_state)
        t.train()
        y = t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
        cs, fs = spconv_output(y, lo, np.ones(3, np.int64))
        assert np.array_equal(cs, coords), "spconv's output rows are not ours"
        outputs[f"spconv {algo}"] = fs
        y.features.backward(torch.as_tensor(g, device="cuda"))
        state = {k: v.detach().cpu().numpy() for k, v in t.state_dict().items()}
        state.update({k: p.grad.detach().cpu().numpy() for k, p in t.named_parameters()})
        ours = state_dict_from_spconv(model, state)
        out[f"spconv {algo}"] = {n: ours[n] for n in names}
        del t, y
    torch.cuda.empty_cache()
    return out, outputs


# ------------------------------------------------------------------ what the float64 forward saw
def batchnorm_diagnostics(model, x, gpu):
    """Per BatchNorm (network order), from a float64 forward in training mode on a copy:
    channels whose batch variance is below eps, the share of values before its ReLU (the
    residual added) within 1e-6 and 1e-4 of zero, and, with ``gpu``, how many of those
    values ours' float32 forward on the GPU puts on the other side of zero (the ReLU's
    mask flipped: a gradient element passed where float64 stops it, or the reverse).
    Returns ``(rows, float64 output features)``."""
    import copy

    from numba_sc import nn

    m = copy.deepcopy(model).cpu().to(np.float64)
    m.train()
    seen, signs = [], {}

    def obs(mod, xin, y, kw):
        if isinstance(mod, nn.BatchNorm):
            f = np.asarray(xin.features, np.float64)
            mean, var = f.mean(axis=0), f.var(axis=0)
            # the value before the ReLU (the residual added), where its sign decides the mask
            v = (f - mean) / np.sqrt(var + mod.eps) * np.asarray(mod.weight, np.float64) \
                + np.asarray(mod.bias, np.float64)
            if kw.get("residual") is not None:
                v = v + np.asarray(kw["residual"].features, np.float64)
            seen.append({"layer": mod.name, "channels": int(f.shape[1]), "rows": int(f.shape[0]),
                         "var_below_eps": int((var < mod.eps).sum()), "min_var": float(var.min()),
                         "relu": bool(kw.get("relu")),
                         "pre_relu_within_1e-6": float((np.abs(v) < 1e-6).mean()),
                         "pre_relu_within_1e-4": float((np.abs(v) < 1e-4).mean())})
            if kw.get("relu"):
                signs[mod.name] = np.asarray(y.features) > 0

    with nn.observe(obs):
        y64 = np.asarray(m(x.cpu().to(np.float64), backend="reference").features)
    if gpu:
        import cupy

        flips = {}

        def obs32(mod, xin, y, kw):
            if isinstance(mod, nn.BatchNorm) and kw.get("relu"):
                flips[mod.name] = int(((cupy.asnumpy(y.features) > 0) != signs[mod.name]).sum())

        mc = copy.deepcopy(model).cuda()
        mc.train()
        with nn.observe(obs32):
            mc(x.cuda())
        for row in seen:
            if row["layer"] in flips:
                row["relu_flips_cuda_float32"] = flips[row["layer"]]
    return seen, y64


def calibrated_cpu(coords, feats):
    """Without a GPU (a dry run of this script): the fp32 state with BatchNorm statistics
    from this cloud, computed by the float32 reference as :func:`bench_net.calibrated_state`
    computes them on the GPU."""
    import numba_sc as ns
    from bench_net import build_ours
    from numba_sc import nn

    m = build_ours("unet42", feats.shape[1])
    for bn in m.modules(nn.BatchNorm):
        bn.momentum = 1.0
    m.train()
    m(ns.SparseTensor(coords, feats), backend="reference")
    return m.state_dict()


def run_cloud(name, data, with_reference32, gpu, rec):
    import numba_sc as ns
    from bench_net import build_ours, calibrated_state
    from bench_train import _output_gradient

    coords, feats = load(name, data)
    rec.update(cloud=name, voxels=int(len(coords)))
    state = calibrated_state("unet42", coords, feats) if gpu else calibrated_cpu(coords, feats)
    model = build_ours("unet42", feats.shape[1])
    model.load_state_dict(state)
    model.train()
    x = ns.SparseTensor(coords, feats)
    g = _output_gradient((len(coords), 19))
    t0 = time.perf_counter()
    others, sp_out = spconv_gradients(model, coords, feats, g) if gpu else (None, {})
    paths = (("cuda float32",) if gpu else ()) + (("reference float32",) if with_reference32 else ())
    report = ns.check_gradients(model, x, g, paths=paths, others=others)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["report"] = report.to_dict()
    rec["batchnorm"], y64 = batchnorm_diagnostics(model, x, gpu)
    rec["spconv_output_distance"] = {k: float(np.linalg.norm(v - y64) / np.linalg.norm(y64)) for k, v in sp_out.items()}
    rec["relu_flips_cuda_float32"] = sum(r.get("relu_flips_cuda_float32", 0) for r in rec["batchnorm"])
    if gpu:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    return report


def summary_line(rec):
    r = rec.get("report")
    if r is None:
        return f"{rec['cloud']:<26} failed: {rec.get('error', '')[:90]}"
    tot = r["total"]
    cells = "  ".join(f"{k.replace('spconv ', 'sp ').replace('reference', 'ref')}={v:.2e}" for k, v in tot.items())
    flips = rec.get("relu_flips_cuda_float32")
    return f"{rec['cloud']:<26} {rec['voxels']:>7}  {cells}" + ("" if flips is None else f"  flips={flips}")


def first_drift(rec, path, threshold=1e-4):
    """The first parameter, walking the network from its output back (the order the
    backward pass reaches them), whose distance on ``path`` passes ``threshold``."""
    for p in reversed(rec["report"]["parameters"]):
        if p["distance"][path] > threshold:
            return p["name"]
    return None


def summarize(runs):
    """One row per cloud: each path's distance over all parameters, the farther of spconv's
    two algorithms, whether ours (the GPU, float32) is no farther from float64 than that,
    the ReLU masks ours' forward flipped, and where each path's gradient first drifts past
    1e-4 walking back from the output."""
    rows = []
    for rec in runs:
        if "report" not in rec:
            continue
        t = rec["report"]["total"]
        farther = max(t["spconv Native"], t["spconv MaskImplicitGemm"])
        rows.append({"cloud": rec["cloud"], "voxels": rec["voxels"], "total": t, "spconv_farther": farther,
                     "ours_within_spconv": t["cuda float32"] <= farther,
                     "ours_over_spconv_farther": t["cuda float32"] / farther,
                     "relu_flips_cuda_float32": rec.get("relu_flips_cuda_float32"),
                     "first_drift": {k: first_drift(rec, k) for k in t}})
    within = sum(r["ours_within_spconv"] for r in rows)
    return {"clouds": len(rows), "ours_within_spconv": within, "rows": rows}


def merge(files, out):
    """The runs of several sweep files in one (the first run of each cloud; later runs of
    a cloud go to ``repeats``: spconv's algorithms sum with atomics, so their distances
    move between runs, while ours repeat to the bit), with :func:`summarize`."""
    merged = {"recorded": [], "runs": [], "repeats": []}
    seen = set()
    for f in files:
        d = json.loads(Path(f).read_text())
        merged["recorded"].append(d["recorded"])
        for r in d["runs"]:
            (merged["repeats"] if r["cloud"] in seen else merged["runs"]).append(r)
            seen.add(r["cloud"])
    merged["summary"] = summarize(merged["runs"])
    write_json(out, merged)
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clouds", default=",".join(CLOUDS))
    ap.add_argument("--data", default=None)
    ap.add_argument("--reference32-max", type=int, default=60_000,
                    help="also run the float32 NumPy reference on clouds of at most this many voxels")
    ap.add_argument("--no-gpu", action="store_true",
                    help="a dry run without a GPU: the float32 reference against float64 only")
    ap.add_argument("--merge", nargs="+", metavar="FILE",
                    help="merge these sweep files into --out (with the summary) and exit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.merge:
        m = merge(args.merge, args.out)
        for r in m["summary"]["rows"]:
            print(f"{r['cloud']:<26} ours/farther spconv {r['ours_over_spconv_farther']:5.2f}  "
                  f"flips {r['relu_flips_cuda_float32']}")
        print(f"ours no farther than the farther spconv on {m['summary']['ours_within_spconv']} of "
              f"{m['summary']['clouds']} clouds")
        return
    data = find_data(args.data)
    names = [c for c in args.clouds.split(",") if c]
    out = {"recorded": recorded(), "runs": []}
    for name in names:
        rec = {"cloud": name}
        try:
            coords, _ = load(name, data)
            run_cloud(name, data, len(coords) <= args.reference32_max, not args.no_gpu, rec)
        except Exception as e:  # noqa: BLE001 - a sweep reports, it does not stop
            rec["error"] = repr(e)
            rec["traceback"] = traceback.format_exc()[-2000:]
        out["runs"].append(rec)
        print(summary_line(rec), flush=True)
        write_json(args.out, out)


if __name__ == "__main__":
    main()
