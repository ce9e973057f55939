#!/usr/bin/env python
"""Benchmark whole networks: numba-sc's SparseResNet21 and MinkUNet42 beside spconv 2.3.8.

Needs a CUDA GPU with CuPy, and PyTorch + spconv for the peers (the GPU
machine; never CI). Example::

    . benchmarks/gpu_env.sh
    python3 benchmarks/bench_net.py --out results/net_scans.json --clouds kitti,scannet,sunrgbd --layers

For each network x cloud x dtype:

1. the numba-sc model (seed 0), its BatchNorm statistics set from the cloud
   itself (one training-mode pass with momentum 1, in fp32: the activations of
   a trained network have unit scale, not the growth of random weights); the
   same weights loaded into the spconv twins (``spconv_nets.py``), one per
   algorithm (Native, MaskImplicitGemm);
2. correctness: the outputs, rows matched by coordinates, as ||ours - spconv||
   / ||spconv|| (targets: 1e-5 fp32, 1e-2 fp16);
3. the forward pass, timed the way a user meets it: a new tensor each call (so
   every map is built again, on both sides), wall clock between device-wide
   synchronizes (work on every stream counts), the contenders interleaved call
   by call, median of ``--reps`` after ``--warmup``;
4. with ``--layers``: every layer alone, as it runs inside the network (its
   input recorded from a network pass; a layer that built its map there builds
   it again, one that reused a map reuses it), interleaved the same way, and
   summed by kind: stem, submanifold (map built), submanifold (map reused),
   strided, transposed, 1x1x1 (shortcuts), BatchNorm (+ReLU, +residual add),
   classifier. Each layer row also holds ``flops`` and ``bytes``, the napkin work of
   our call (``roofline.layer_napkin``: from the kernel map's pairs, the rows and
   channels, the weight), and the run measures the device's peaks once (``peaks``
   in the file: a large cuBLAS GEMM in fp32 and fp16, a large device copy, and the
   datasheet-style peaks; ``roofline.measured_peaks``; ``--no-peaks`` skips it), so
   that each kind's achieved TFLOP/s and GB/s are read against the hardware;
5. with ``--memory``: the peak device memory of one forward pass of each
   contender (``common.cupy_peak`` for ours, ``common.torch_peak`` for spconv's
   twins under ``torch.no_grad()``; bytes allocated, weights and input included),
   in each run's ``memory``. ``--reps 0 --memory`` measures memory alone.

Clouds: SemanticKITTI at 0.05 m, ScanNet and SUN RGB-D at 0.02 m (features:
the voxel mean of the first four columns), and 1,000,000 random voxels in
400^3 (random features). A short table goes to stdout, everything to ``--out``.
"""
import argparse
import sys
import traceback

import numpy as np

from common import CROPS, SCANS, cupy_peak, find_data, interleaved, random_coords, recorded, rounds_for, scan_points, torch_peak, write_json
from roofline import layer_napkin, measured_peaks

NETS = ("resnet21", "unet42")


def load_cloud(name, data):
    """(sorted unique int32 coords (N, 3), float32 features (N, 4))."""
    import numba_sc as ns

    if name == "random":
        c = random_coords()
        f = np.random.default_rng(1).standard_normal((len(c), 4)).astype(np.float32)
        x = ns.SparseTensor(c, f)
        return np.asarray(x.coords), np.asarray(x.features)
    pts, vs = scan_points(data, name)
    v = ns.voxelize(pts[:, :3], vs, features=np.ascontiguousarray(pts[:, :4]), backend="reference")
    return v.coords, v.features.astype(np.float32)


def wall_interleaved(contenders, warmup, reps, block=4):
    """:func:`common.interleaved` (wall clock between device-wide synchronizes) in this
    benchmark's record format: key -> {"ms": median, "all": every sample}."""
    t = interleaved(contenders, rounds_for(reps, block), block=block, warmup=warmup)
    return {k: {"ms": v["ms"], "all": [round(s, 4) for s in v["ms_all"]]} for k, v in t.items()}


# ------------------------------------------------------------- the models
def build_ours(net, in_channels):
    from numba_sc import models

    return models.SparseResNet21(in_channels) if net == "resnet21" else models.MinkUNet42(in_channels, 19)


def build_spconv(net, in_channels, algo, select=True):
    import spconv_nets
    from spconv.core import ConvAlgo

    a = getattr(ConvAlgo, algo)
    m = spconv_nets.SparseResNet21(in_channels, algo=a, select=select) if net == "resnet21" else \
        spconv_nets.MinkUNet42(in_channels, 19, algo=a)
    return m.cuda().eval()


def calibrated_state(net, coords, feats):
    """The fp32 state dict of our model with BatchNorm statistics from this cloud."""
    import cupy

    import numba_sc as ns
    from numba_sc import nn

    m = build_ours(net, feats.shape[1]).cuda()
    bns = m.modules(nn.BatchNorm)
    for bn in bns:
        bn.momentum = 1.0
    m.train()
    m(ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats)))
    m.eval()
    return m.state_dict()


def spconv_output(y, lo, stride_of_index):
    """(coords (M, 3) in finest voxels, features float64) of a spconv output."""
    ind = y.indices.cpu().numpy()
    return ind[:, 1:].astype(np.int64) * np.asarray(stride_of_index) + lo, y.features.detach().float().cpu().numpy()


def rel_err_by_coords(c_ours, f_ours, c_sp, f_sp):
    """||ours - spconv|| / ||spconv||, rows matched by coordinates (both sets must agree)."""
    import numba_sc as ns

    ko = ns.pack_keys(np.ascontiguousarray(c_ours, dtype=np.int32))
    ks = ns.pack_keys(np.ascontiguousarray(c_sp, dtype=np.int32))
    if len(ko) != len(ks):
        return float("inf"), f"{len(ko)} rows vs spconv's {len(ks)}"
    oo, os_ = np.argsort(ko), np.argsort(ks)
    if not np.array_equal(ko[oo], ks[os_]):
        return float("inf"), "different coordinates"
    a = np.asarray(f_ours, np.float64)[oo]
    b = np.asarray(f_sp, np.float64)[os_]
    if not np.isfinite(a).all():
        return float("inf"), "ours has NaN/inf"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), ""


# ---------------------------------------------------------- layer by layer
KINDS = ["stem", "subm build", "subm reuse", "strided", "transposed", "1x1x1", "batchnorm", "classifier"]


def record_ours(model, x):
    """Run the network once and return, per layer call: (name, kind, replay fn, info), where
    ``info`` holds ``napkin`` (:func:`roofline.layer_napkin` of the call: its flops and
    bytes) and, for BatchNorm, ``residual`` and ``relu``."""
    from numba_sc import nn

    seen_maps, calls = set(), []

    def napkin(kind, mod, xin, y, pairs=None, residual=False):
        weight = getattr(mod, "weight", None) if kind != "batchnorm" else None
        return layer_napkin(kind, len(xin), len(y), xin.features.shape[1], y.features.shape[1],
                            np.dtype(xin.features.dtype).itemsize, pairs=pairs,
                            weight_bytes=0 if weight is None else int(weight.nbytes), residual=residual)

    def obs(mod, xin, y, kw):
        name = mod.name
        if isinstance(mod, nn.BatchNorm):
            res, relu = kw.get("residual"), kw.get("relu", False)
            calls.append((name, "batchnorm", lambda m=mod, a=xin, r=res, z=relu: m(a, residual=r, relu=z),
                          {"residual": res is not None, "relu": bool(relu),
                           "napkin": napkin("batchnorm", mod, xin, y, residual=res is not None)}))
        elif isinstance(mod, nn.Linear):
            calls.append((name, "classifier", lambda m=mod, a=xin: m(a), {"napkin": napkin("classifier", mod, xin, y)}))
        elif isinstance(mod, nn.SparseInverseConv3d):
            # the transposed map is the strided one read backwards: the same pairs
            pairs = int(y.kernel_map.host_counts().sum())
            calls.append((name, "transposed", lambda m=mod, a=xin: m(a),
                          {"napkin": napkin("transposed", mod, xin, y, pairs)}))
        elif isinstance(mod, nn.ConvLayer):
            if mod.pointwise:
                calls.append((name, "1x1x1", lambda m=mod, a=xin: m(a), {"napkin": napkin("1x1x1", mod, xin, y)}))
                return
            built = id(y.kernel_map) not in seen_maps
            seen_maps.add(id(y.kernel_map))
            if mod.stride != (1, 1, 1):
                kind = "strided"
            elif name.endswith("stem.0") or name.endswith("stem.0.0"):
                kind = "stem"
            else:
                kind = "subm build" if built else "subm reuse"
            fresh = built  # a layer that built its map builds it again in the replay
            pairs = int(y.kernel_map.host_counts().sum())
            calls.append((name, kind, (lambda m=mod, a=xin: m(a.without_maps())) if fresh
                          else (lambda m=mod, a=xin: m(a)), {"napkin": napkin(kind, mod, xin, y, pairs)}))

    with nn.observe(obs):
        model(x)
    return calls


def record_spconv(twin, feats, indices, spatial, ours_calls):
    """Replay fns for the twin's layers, by the names of ours."""
    import torch
    import spconv.pytorch as spconv

    mods = dict(twin.named_modules())
    inputs = {}

    def grab(name):
        def hook(mod, inp, out):
            inputs[name] = inp[0]
        return hook

    hooks = [mods[n].register_forward_hook(grab(n)) for n, _, _, _ in ours_calls if n in mods]
    with torch.no_grad():
        twin(spconv.SparseConvTensor(feats, indices, spatial, 1))
    for h in hooks:
        h.remove()
    fns = {}
    for name, kind, _, info in ours_calls:
        if name not in inputs:
            continue
        mod, a = mods[name], inputs[name]
        if kind == "batchnorm":
            def fn(mod=mod, a=a, info=info):
                y = mod(a)
                if info["residual"]:
                    y = y + a  # the block's add (a tensor of the same shape stands in for the shortcut)
                if info["relu"] or info["residual"]:
                    y = torch.relu(y)
                return y
        elif kind in ("stem", "subm build", "strided"):
            def fn(mod=mod, a=a):  # a fresh tensor: the pairs are built again
                return mod(spconv.SparseConvTensor(a.features, a.indices, a.spatial_shape, a.batch_size))
        else:  # reuse, transposed, 1x1x1, classifier: the input as it was (its indice_dict)
            def fn(mod=mod, a=a):
                return mod(a)
        fns[name] = fn
    return fns


# -------------------------------------------------------------------- main
def run_one(net, cloud, coords, feats, dtypes, args, out):
    import cupy
    import torch
    import spconv.pytorch as spconv

    import numba_sc as ns
    from numba_sc.nn.spconv_format import state_dict_to_spconv

    state32 = calibrated_state(net, coords, feats)
    indices, spatial, lo = spconv_input(coords, feats)
    truth = None  # our fp32 output (it agrees with spconv's fp32 to ~1e-6): what fp16 is measured against
    for dt in dtypes:
        rec = {"net": net, "cloud": cloud, "n": int(len(coords)), "dtype": dt}
        try:
            ours = build_ours(net, feats.shape[1])
            ours.load_state_dict(state32)
            ours.to(np.dtype(dt)).cuda()
            tdt = torch.float16 if dt == "float16" else torch.float32
            twins = {}
            sp_state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict_to_spconv(ours).items()}
            tfeats = torch.from_numpy(feats).cuda().to(tdt)
            for algo in ("Native", "MaskImplicitGemm"):
                t = build_spconv(net, feats.shape[1], algo)
                t.load_state_dict(sp_state)
                t = t.to(tdt)
                twins[algo] = t
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(dt)))
            y = ours(x.without_maps())
            stride_of_index = np.asarray(y.stride)
            errs = {}
            for algo, t in twins.items():
                with torch.no_grad():
                    ys = t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
                cs, fs = spconv_output(ys, lo, stride_of_index)
                errs[algo] = rel_err_by_coords(cupy.asnumpy(y.coords), cupy.asnumpy(y.features), cs, fs)
            rec["rel_err"] = {a: e[0] for a, e in errs.items()}
            if dt == "float32":
                truth = (cupy.asnumpy(y.coords), cupy.asnumpy(y.features))
            elif truth is not None:  # each fp16 network against the fp32 one
                rec["rel_err_vs_fp32"] = {"numba-sc": rel_err_by_coords(cupy.asnumpy(y.coords),
                                                                        cupy.asnumpy(y.features), *truth)[0]}
                for algo, t in twins.items():
                    with torch.no_grad():
                        ys = t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
                    rec["rel_err_vs_fp32"][algo] = rel_err_by_coords(*spconv_output(ys, lo, stride_of_index),
                                                                     *truth)[0]
            if args.diagnose:
                for algo, t in twins.items():
                    print(f"  diagnose {net} {cloud} {dt} spconv {algo}:")
                    diagnose(ours, t, x, tfeats, indices, spatial, lo)
            rec["rel_err_note"] = {a: e[1] for a, e in errs.items() if e[1]}
            rec["out_points"] = int(len(y))

            def sp_call(t):
                def call():
                    with torch.no_grad():
                        return t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
                return call

            contenders = {"numba-sc": lambda: ours(x.without_maps()),
                          "spconv Native": sp_call(twins["Native"]),
                          "spconv MaskImplicitGemm": sp_call(twins["MaskImplicitGemm"])}
            if args.compare_lazy:  # the same model with its maps built layer by layer, as before #27
                def lazy():
                    ours.maps_up_front = False
                    try:
                        return ours(x.without_maps())
                    finally:
                        ours.maps_up_front = True
                contenders["numba-sc (maps lazily)"] = lazy
            if net == "resnet21":  # for context: spconv's own downsampling (another network)
                for algo in ("Native", "MaskImplicitGemm"):
                    own = build_spconv(net, feats.shape[1], algo, select=False)
                    own.load_state_dict(sp_state)
                    contenders[f"({algo}, own outputs)"] = sp_call(own.to(tdt))
            if args.reps > 0:
                rec["network"] = wall_interleaved(contenders, args.warmup, args.reps, args.block)
            del contenders, y
            ys = own = None  # (spconv's last output and twin: they would count in its memory's before_bytes)
            free_memory()
            if args.memory:
                rec["memory"] = measure_memory(ours, x, twins, tfeats, indices, spatial)
            if args.layers:
                rec["layers"] = time_layers(ours, x, twins, tfeats, indices, spatial, args)
        except Exception as e:
            rec["error"] = repr(e)
            rec["traceback"] = traceback.format_exc()
            print(f"[{net} {cloud} {dt}] failed: {e!r}")
            print(rec["traceback"][-2000:])
        ours = twins = x = None
        free_memory()
        out["runs"].append(rec)
        report(rec, out.get("peaks"))
        write_json(args.out, out)


def diagnose(ours, twin, x, tfeats, indices, spatial, lo):
    """Print, for every convolution, ||ours - spconv|| / ||spconv|| on its output (spconv's
    rows at our coordinates): where the two networks part, if they do."""
    import cupy
    import torch
    import spconv.pytorch as spconv

    import numba_sc as ns
    from numba_sc import nn

    mine = {}

    def obs(m, a, y, kw):
        if isinstance(m, nn.ConvLayer):
            mine[m.name] = (cupy.asnumpy(y.coords), cupy.asnumpy(y.features).astype(np.float64), y.stride)

    with nn.observe(obs):
        ours(x.without_maps())
    theirs = {}
    mods = dict(twin.named_modules())

    def grab(name):
        def hook(mod, inp, out):
            theirs[name] = (out.indices.cpu().numpy(), out.features.float().cpu().numpy())
        return hook

    hooks = [mods[n].register_forward_hook(grab(n)) for n in mine if n in mods]
    with torch.no_grad():
        twin(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
    for h in hooks:
        h.remove()
    for name, (c, f, stride) in mine.items():
        if name not in theirs:
            print(f"    {name:28s} (no spconv twin layer)")
            continue
        ind, g = theirs[name]
        cs = ind[:, 1:].astype(np.int64) * np.asarray(stride) + lo
        ks = ns.pack_keys(np.ascontiguousarray(cs, dtype=np.int32))
        kc = ns.pack_keys(np.ascontiguousarray(c, dtype=np.int32))
        order = np.argsort(ks)
        pos = np.clip(np.searchsorted(ks[order], kc), 0, len(ks) - 1)
        found = ks[order][pos] == kc
        rows = g[order[pos]]
        err = np.linalg.norm(f[found] - rows[found]) / max(np.linalg.norm(rows[found]), 1e-30)
        print(f"    {name:28s} ours {len(c):7d} rows, spconv {len(cs):7d}, missing {int((~found).sum()):6d}, "
              f"rel err {err:.2e}", flush=True)


def free_memory():
    """Give the memory the last phase no longer uses back to the device, from both
    allocators' pools (CuPy's and PyTorch's keep freed blocks for themselves)."""
    import gc

    import cupy
    import torch

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def spconv_input(coords, feats):
    import spconv_nets

    return spconv_nets.spconv_input(coords, feats)


def time_layers(ours, x, twins, tfeats, indices, spatial, args):
    import torch

    calls = record_ours(ours, x.without_maps())
    free_memory()
    sp = {a: record_spconv(t, tfeats, indices, spatial, calls) for a, t in twins.items()}
    free_memory()
    rows = []
    with torch.no_grad():
        for name, kind, fn, info in calls:
            contenders = {"numba-sc": fn}
            for a, fns in sp.items():
                if name in fns:
                    contenders[f"spconv {a}"] = fns[name]
            t = wall_interleaved(contenders, 3, args.layer_reps)
            rows.append({"name": name, "kind": kind, **{k: v["ms"] for k, v in t.items()},
                         "flops": info["napkin"]["flops"], "bytes": info["napkin"]["bytes"]})
    return rows


def contender_peaks(ours, twins, twin_call, reset=None):
    """The peak device memory of one call of each contender: ``ours()`` under
    :func:`common.cupy_peak`, each spconv twin's ``twin_call(algo)()`` under
    :func:`common.torch_peak`, with the other twins moved to the host meanwhile (so that
    only its own weights count in its ``before_bytes``, as only ours' count in ours').
    ``reset(twin)``: run on every twin first and on each after its call (a training
    step drops its ``.grad``). Each record also holds ``other_extra_bytes``: what the
    other allocator grew by during the call (a check that each side allocates from its
    own pool: about 0)."""
    out = {}
    for t in twins.values() if reset else ():
        reset(t)
    free_memory()
    inner = {}
    outer = torch_peak(lambda: inner.update(cupy_peak(ours)))
    out["numba-sc"] = {**inner, "other_extra_bytes": outer["extra_bytes"]}
    for algo, t in twins.items():
        others = [u for a, u in twins.items() if a != algo]
        for u in others:
            u.cpu()
        free_memory()
        try:
            inner = {}
            outer = cupy_peak(lambda: inner.update(torch_peak(twin_call(algo))))
            out[f"spconv {algo}"] = {**inner, "other_extra_bytes": outer["extra_bytes"]}
        finally:
            if reset:
                reset(t)
            for u in others:
                u.cuda()
    free_memory()
    return out


def measure_memory(ours, x, twins, tfeats, indices, spatial):
    """:func:`contender_peaks` of one forward pass: ours on a tensor without maps (every
    map built inside, as in the timing), each twin under ``torch.no_grad()``."""
    import torch
    import spconv.pytorch as spconv

    def twin_call(algo):
        def call():
            with torch.no_grad():
                return twins[algo](spconv.SparseConvTensor(tfeats, indices, spatial, 1))
        return call

    return contender_peaks(lambda: ours(x.without_maps()), twins, twin_call)


def best_spconv(d):
    vals = [v for k, v in d.items() if k.startswith("spconv")]
    return min(vals) if vals else float("nan")


def report(rec, peaks=None):
    if "memory" in rec:
        m = rec["memory"]
        print(f"{rec['net']:8} {rec['cloud']:8} {rec['n']:8d} {rec['dtype']:8} peak MB (extra): "
              + " | ".join(f"{k} {v['peak_bytes'] / 1e6:.1f} ({v['extra_bytes'] / 1e6:.1f})" for k, v in m.items())
              + f" | ours / best {memory_ratio(m):.2f}", flush=True)
    if "layers" in rec:
        report_layers(rec, peaks)
    if "network" not in rec:
        return
    n = rec["network"]
    ours, nat, mig = n["numba-sc"]["ms"], n["spconv Native"]["ms"], n["spconv MaskImplicitGemm"]["ms"]
    best = min(nat, mig)
    own = [v["ms"] for k, v in n.items() if "own outputs" in k]
    errs = " ".join(f"{a[:6]} {e:.1e}" for a, e in rec["rel_err"].items())
    if "rel_err_vs_fp32" in rec:
        errs += " | vs fp32: " + " ".join(f"{a[:6]} {e:.1e}" for a, e in rec["rel_err_vs_fp32"].items())
    print(f"{rec['net']:8} {rec['cloud']:8} {rec['n']:8d} {rec['dtype']:8} ours {ours:8.2f} ms | Native "
          f"{nat:8.2f} | MIG {mig:8.2f} | ours/best {ours / best:5.2f} | err {errs}"
          + (f" | spconv own outputs: best {min(own):.2f}" if own else "")
          + (f" | lazy maps {n['numba-sc (maps lazily)']['ms']:.2f}" if "numba-sc (maps lazily)" in n else ""),
          flush=True)


def memory_ratio(m):
    """Our peak bytes over the lowest spconv peak of a ``memory`` record."""
    return m["numba-sc"]["peak_bytes"] / min(v["peak_bytes"] for k, v in m.items() if k.startswith("spconv"))


def report_layers(rec, peaks=None):
    """Per layer kind: ours / best spconv (summed ms) and, where the run measured the
    peaks, ours' achieved TFLOP/s and GB/s (:func:`roofline.achieved`)."""
    from roofline import achieved

    sums = {}
    for r in rec["layers"]:
        s = sums.setdefault(r["kind"], [0.0, 0.0, 0, 0, 0])
        s[0] += r["numba-sc"]
        s[1] += best_spconv(r)
        s[2] += 1
        s[3] += r.get("flops", 0)
        s[4] += r.get("bytes", 0)
    print("    " + " | ".join(f"{k} x{v[2]}: {v[0]:.2f}/{v[1]:.2f} = {v[0] / v[1]:.2f}"
                              for k, v in sums.items() if v[1] > 0), flush=True)
    for k, v in sums.items():
        if v[0] > 0 and (v[3] or v[4]):
            a = achieved(v[3], v[4], v[0], rec["dtype"], peaks)
            pct = f" ({a['pct_flops']:.1f} % of GEMM, {a['pct_bandwidth']:.1f} % of copy)" if peaks else ""
            print(f"      {k:11s} {a['tflops']:7.2f} TFLOP/s {a['gbps']:8.1f} GB/s{pct}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--out", default="bench_net.json")
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--clouds", default="kitti,scannet,sunrgbd,random")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--reps", type=int, default=20,
                    help="timed forward passes per contender (0: no network timing, e.g. with --memory alone)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block", type=int, default=4,
                    help="timed calls per contender and round (fewer: more rounds, finer interleaving)")
    ap.add_argument("--layers", action="store_true", help="also time every layer alone, by kind")
    ap.add_argument("--compare-lazy", action="store_true",
                    help="also time our model with its maps built layer by layer (maps_up_front=False)")
    ap.add_argument("--layer-reps", type=int, default=20)
    ap.add_argument("--memory", action="store_true",
                    help="also the peak device memory of one forward pass of each contender (bytes allocated: "
                         "CuPy's pool for ours, PyTorch's allocator for spconv), in each run's 'memory'")
    ap.add_argument("--no-peaks", action="store_true",
                    help="with --layers: skip measuring the device's GEMM and copy peaks (the roofline's "
                         "denominators, 'peaks' in the file)")
    ap.add_argument("--diagnose", action="store_true",
                    help="print every convolution's error against spconv (where the networks part)")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    args = ap.parse_args()
    for name in ("reps", "warmup", "layer_reps"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.block < 1:
        ap.error(f"--block must be >= 1, got {args.block}")
    if args.layers and args.layer_reps < 1:
        ap.error("--layers needs --layer-reps >= 1")
    if args.reps == 0 and not (args.layers or args.memory):
        ap.error("--reps 0 times nothing: give --memory and/or --layers, or reps > 0")
    wrong = [c for c in args.clouds.split(",") if c not in (*SCANS, *CROPS, "random")]
    if wrong:
        ap.error(f"unknown cloud(s) {wrong}: any of {', '.join((*SCANS, *CROPS, 'random'))}")
    wrong = [n for n in args.nets.split(",") if n not in NETS]
    if wrong:
        ap.error(f"unknown network(s) {wrong}: any of {', '.join(NETS)}")
    wrong = [d for d in args.dtypes.split(",") if d not in ("float32", "float16")]
    if wrong:
        ap.error(f"unknown dtype(s) {wrong}: float32, float16")
    data = find_data(args.data)
    out = {"runs": [], "reps": args.reps, "warmup": args.warmup, "block": args.block, "layer_reps": args.layer_reps,
           "memory": args.memory, "recorded": recorded(args.note)}
    if args.layers and not args.no_peaks:  # the roofline's denominators, once per run
        out["peaks"] = measured_peaks()
        p = out["peaks"]
        print(f"peaks: GEMM fp32 {p['gemm_tflops']['float32']:.1f} TFLOP/s, fp16 {p['gemm_tflops']['float16']:.1f} "
              f"TFLOP/s; copy {p['copy_gbps']:.0f} GB/s (datasheet: {p['datasheet']})", flush=True)
    from numba_sc.core.progress import bar, prints_above_bars  # (after common put the checkout on sys.path)

    clouds, nets = args.clouds.split(","), args.nets.split(",")
    # A bar over the (cloud, network) runs, on stderr where bars are on (NUMBA_SC_PROGRESS=1 forces
    # it): each run's lines still print as they come, above it; the JSON file is not touched by it.
    with bar(total=len(clouds) * len(nets), unit="run") as progress, prints_above_bars():
        for cloud in clouds:
            coords, feats = load_cloud(cloud, data)
            for net in nets:
                progress.set_description(f"{net} on {cloud}")
                run_one(net, cloud, coords, feats, args.dtypes.split(","), args, out)
                progress.update(1)
    out["recorded"] = recorded(args.note)
    write_json(args.out, out)
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
