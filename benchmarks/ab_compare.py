#!/usr/bin/env python
"""Two versions of numba-sc and spconv, timed call by call, interleaved, in one process.

    git worktree add /tmp/base <commit>          # the baseline to compare against
    mkdir -p .ab && cp -r /tmp/base/numba_sc .ab/base_sc   # .ab/ is git-ignored
    . benchmarks/gpu_env.sh; python3 benchmarks/ab_compare.py --out ab.json

Why: the lent GPU machine's medians drift by up to ~40 % between runs (and
between minutes of one run), so "before" and "after" measured in two runs cannot
resolve a 10 % change. Here every round gives each contender, in turn, a short
block of calls timed for host time (wall clock around the call and a
synchronize) and for GPU time (CUDA events around the call), so drift hits them
all alike; the medians over all rounds are compared. The package imports itself under a second name
(``base_sc``): all its imports are relative, so the copy is self-contained.

Workloads, on SemanticKITTI at 0.05 m and on 1M random voxels in a 400^3 box:
with ``--nets``, the paper's two networks (SparseResNet21, MinkUNet42) with the same
weights in both packages, each call a whole forward pass on a tensor without maps;
otherwise the Map step (``assume_sorted=True``, as a layer calls it, and the default call
on sorted input) beside spconv's ``get_indice_pairs`` (subm), and a C -> C
layer (``--channels``, default 64, ``--cout``; ``--dtype``, default fp32; Map + GMaS with
the tiles ``--tiles``) beside spconv's ``SubMConv3d`` (Native and
MaskImplicitGemm, fresh indices so its pairs are rebuilt). Never runs in CI.
"""
import argparse

import numpy as np

from common import HOST_THEN_GPU, find_data, interleaved, package_copies, random_coords, recorded, scan_coords, write_json


def ours(pkg, coords, ch, dtype=np.float32, tiles=(8, 8), cout=None):
    import cupy

    rng = np.random.default_rng(0)
    x = pkg.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.standard_normal((len(coords), ch)).astype(dtype)))
    cout = cout or ch
    w = cupy.asarray((rng.standard_normal((27, ch, cout)) / np.sqrt(ch)).astype(dtype))
    return {
        "map": lambda: pkg.build_kernel_map(x.coords, 3, assume_sorted=True),
        "map default": lambda: pkg.build_kernel_map(x.coords, 3),
        f"layer {ch}->{cout}": lambda: pkg.sparse_conv3d(x, w, 3, tile_size=tiles),
    }


def nets(packages, coords, dtype=np.float32):
    """Both networks of the paper, one per package, with the same weights: the new
    package's SparseResNet21 and MinkUNet42 (seed 0, 4 input channels, BatchNorm
    statistics from one training-mode pass over this cloud with momentum 1), loaded
    into each package's own model. A call runs the whole network on a tensor
    without maps (every map built again), as bench_net.py times it."""
    import cupy

    feats = np.random.default_rng(1).standard_normal((len(coords), 4)).astype(np.float32)
    calls = {}
    for net in ("resnet21", "unet42"):
        state = None
        for pname, pkg in packages.items():
            m = pkg.models.SparseResNet21(4) if net == "resnet21" else pkg.models.MinkUNet42(4, 19)
            m = m.cuda()
            if state is None:  # calibrate once, on the first package (the new one)
                for bn in m.modules(pkg.nn.BatchNorm):
                    bn.momentum = 1.0
                m.train()
                m(pkg.SparseTensor(cupy.asarray(coords), cupy.asarray(feats)))
                state = m.state_dict()
            m.load_state_dict(state)
            m.eval()
            m.to(np.dtype(dtype))
            x = pkg.SparseTensor(cupy.asarray(coords), cupy.asarray(feats.astype(dtype)))
            calls[(net, pname)] = (lambda m=m, x=x: m(x.without_maps()))
    return calls


def spconv_calls(coords, ch, dtype=np.float32, cout=None):
    import spconv.pytorch as spconv
    import torch
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    dev = torch.device("cuda")
    c = coords - coords.min(0)
    shape = (c.max(0) + 1).tolist()
    ind = torch.from_numpy(np.column_stack([np.zeros(len(c), np.int32), c]).astype(np.int32)).to(dev)
    feats = torch.from_numpy(np.random.default_rng(0).standard_normal((len(c), ch)).astype(dtype)).to(dev)
    calls = {("map", "spconv"): lambda: ops.get_indice_pairs(ind, 1, shape, ConvAlgo.Native, [3, 3, 3], [1, 1, 1],
                                                 [1, 1, 1], [1, 1, 1], [0, 0, 0], subm=True)}
    for algo in ("Native", "MaskImplicitGemm"):
        cout = cout or ch
        conv = spconv.SubMConv3d(ch, cout, 3, bias=False, indice_key="ab",
                                 algo=getattr(ConvAlgo, algo)).to(dev).eval()
        if np.dtype(dtype) == np.float16:
            conv = conv.half()

        def layer(conv=conv):
            with torch.no_grad():
                return conv(spconv.SparseConvTensor(feats, ind, shape, 1))
        calls[(f"layer {ch}->{cout}", f"spconv {algo}")] = layer
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--base", default=".ab", help="folder holding base_sc/ (a copy of the baseline package) and any other *_sc/ copies")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=4, help="calls per contender and round, after one not kept")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--cout", type=int, default=None, help="output channels of the layer (default: --channels)")
    ap.add_argument("--dtype", default="float32", help="features and weights: float32 or float16")
    ap.add_argument("--tiles", default="8,8", help="gather,scatter tile sizes of our layers")
    ap.add_argument("--clouds", default="kitti,random1M", help="any of kitti, scannet, sunrgbd, random1M")
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("--note", default="")
    ap.add_argument("--only", default="", help="keep the workloads whose name starts with this (e.g. map)")
    ap.add_argument("--nets", action="store_true",
                    help="time the two networks (both packages, same weights) instead of the Map step and one layer")
    args = ap.parse_args()

    tiles = tuple(int(t) for t in args.tiles.split(","))
    packages = package_copies(args.base)  # every copy there: base_sc/ as "base", x_sc/ as "x"
    makers = {name: (lambda n=name: scan_coords(find_data(args.data), n)) for name in ("kitti", "scannet", "sunrgbd")}
    makers["random1M"] = random_coords
    out = {"recorded": recorded(args.note), "clouds": {}}
    for cname in args.clouds.split(","):
        coords = makers[cname]()
        contenders = {}
        if args.nets:
            contenders = nets(packages, coords, np.dtype(args.dtype))
        else:
            for pname, pkg in packages.items():
                for wname, fn in ours(pkg, coords, args.channels, np.dtype(args.dtype), tiles, args.cout).items():
                    contenders[(wname, pname)] = fn
            try:
                contenders.update(spconv_calls(coords, args.channels, np.dtype(args.dtype), args.cout))
            except Exception as e:  # noqa: BLE001 - a missing peer: compare the two versions only
                print(f"spconv not run: {type(e).__name__}: {e}")
        contenders = {key: fn for key, fn in contenders.items() if key[0].startswith(args.only)}
        # A contender's first call after another one's runs on cold host caches (measured:
        # up to 50 % slower), so each gets a short block of calls, the first not kept. What
        # ran just before still matters (a Map step after a spconv layer was ~15 % slower
        # than after another Map step, 2026-11-23), so the order is shuffled afresh every
        # round: every contender follows every other about equally often.
        times = interleaved(contenders, args.rounds, block=args.block, warmup=args.warmup, timers=HOST_THEN_GPU)
        res = {}
        print(f"== {cname}, {len(coords):,} voxels, {args.rounds} interleaved rounds (ms, median)")
        for key, t in times.items():
            h, g = t["host_ms"], t["gpu_ms"]
            res[" / ".join(key)] = t
            print(f"   {key[0]:12s} {key[1]:24s} host {h:7.3f}  gpu {g:7.3f}")
        # Paired: sample i of two contenders was taken in the same round, so the median of
        # their per-round ratios cancels the machine's slow minutes (on the lent H200 a
        # whole run's samples fall into two clock regimes ~40 % apart, which can move a
        # ratio of medians by several per cent; a copy of the same code measured beside
        # itself showed that, ab_redesign.json "control").
        for key in times:
            if key[1] == "new":
                continue
            mine = times.get((key[0], "new"))
            if mine is None:
                continue
            a, b = np.asarray(mine["host_ms_all"]), np.asarray(times[key]["host_ms_all"])
            if len(a) == len(b):
                paired = float(np.median(a / b))
                res[" / ".join(key)]["paired_new_over_this"] = paired
                print(f"   {key[0]:12s} new / {key[1]:18s} paired host ratio {paired:.3f}")
        out["clouds"][cname] = res
    out["recorded"] = recorded(args.note)  # again, now that the peers' versions are known
    write_json(args.out, out)


if __name__ == "__main__":
    main()
