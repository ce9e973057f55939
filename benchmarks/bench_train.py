#!/usr/bin/env python
"""One training step (forward + backward) of numba-sc's networks beside spconv 2.3.8's
(PyTorch autograd), on the same inputs and weights.

Needs a CUDA GPU with CuPy, PyTorch and spconv (the GPU machine; never CI)::

    . benchmarks/gpu_env.sh
    python3 benchmarks/bench_train.py --out results/train_step.json

For each network x cloud (fp32, BatchNorm in training mode on both sides):

1. the same weights in ours and in spconv's twins (``spconv_nets.py``, Native and
   MaskImplicitGemm), and one fixed random gradient ``g`` of the output;
2. correctness (MinkUNet42, whose output rows are the input's on both sides):
   every parameter's gradient, ours (:class:`numba_sc.nn.Tape`) against
   spconv's autograd, as ||ours - spconv|| / ||spconv||, and the worst layer;
3. the step, timed as a user meets it: a new tensor each call (every map built
   again), forward in training mode, backward from ``g`` (spconv: ``zero_grad``,
   then ``y.features.backward(g)``), wall clock between device-wide
   synchronizes, the contenders interleaved call by call, median of ``--reps``
   after ``--warmup``; ours also forward alone, to split the step.

No optimizer update is timed (it is the same few element-wise passes on both
sides). A short table goes to stdout, everything to ``--out``.
"""
import argparse
import json
import traceback
from pathlib import Path

import numpy as np

from bench_net import (build_ours, build_spconv, calibrated_state, free_memory, load_cloud, spconv_input,
                       spconv_output, wall_interleaved)
from common import SCANS, find_data, recorded


def grads_in_spconv_layout(ours, grads, in_channels):
    """Our gradients by spconv's parameter names and layouts: a copy of the model whose
    weights are the gradients, converted as the weights are."""
    from numba_sc.nn.spconv_format import state_dict_to_spconv

    state = {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in ours.state_dict().items()}
    for k, g in grads.items():
        state[k] = np.asarray(g.get() if hasattr(g, "get") else g).astype(state[k].dtype)
    copy = build_ours("unet42", in_channels)
    copy.load_state_dict(state)
    return state_dict_to_spconv(copy)


def run_one(net, cloud, coords, feats, args, out):
    import cupy
    import spconv.pytorch as spconv
    import torch

    import numba_sc as ns
    from numba_sc import nn
    from numba_sc.nn.spconv_format import state_dict_to_spconv

    rec = {"net": net, "cloud": cloud, "n": int(len(coords)), "dtype": "float32"}
    try:
        state = calibrated_state(net, coords, feats)
        indices, spatial, lo = spconv_input(coords, feats)
        ours = build_ours(net, feats.shape[1])
        ours.load_state_dict(state)
        ours.cuda().train()
        sp_state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict_to_spconv(ours).items()}
        twins = {}
        for algo in ("Native", "MaskImplicitGemm"):
            t = build_spconv(net, feats.shape[1], algo)
            t.load_state_dict(sp_state)
            twins[algo] = t.train()
        x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))
        tfeats = torch.from_numpy(feats).cuda()
        with nn.Tape() as tape:
            y = ours(x.without_maps())
        rng = np.random.default_rng(0)
        g = cupy.asarray((rng.standard_normal(y.features.shape) / np.sqrt(y.features.size)).astype(np.float32))
        grads = tape.backward(y, g)
        rec["out_points"] = int(len(y))
        if net == "unet42":  # output rows = input rows on both sides: g means the same there
            with torch.no_grad():
                ys = twins["Native"](spconv.SparseConvTensor(tfeats, indices, spatial, 1))
            cs, _ = spconv_output(ys, lo, np.asarray(y.stride))
            assert np.array_equal(cs, cupy.asnumpy(y.coords)), "output rows differ from spconv's"
            mine = grads_in_spconv_layout(ours, grads, feats.shape[1])
            rec["grad_rel_err"] = {}
            for algo, t in twins.items():
                t.zero_grad(set_to_none=True)
                t(spconv.SparseConvTensor(tfeats, indices, spatial, 1)).features.backward(torch.as_tensor(g, device="cuda"))
                errs = {}
                for name, p in t.named_parameters():
                    want = p.grad.detach().double().cpu().numpy()
                    got = np.asarray(mine[name], np.float64).reshape(want.shape)
                    errs[name] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                worst = max(errs, key=errs.get)
                total_got = np.concatenate([np.asarray(mine[n], np.float64).ravel() for n in errs])
                total_want = np.concatenate([p.grad.double().cpu().numpy().ravel() for _, p in t.named_parameters()])
                spgrads = [p.grad.detach().double().cpu().numpy().ravel() for _, p in t.named_parameters()]
                if "spconv" in rec:  # the two spconv algorithms against each other: fp32's own spread
                    a, b = np.concatenate(rec.pop("spconv")), np.concatenate(spgrads)
                    rec["grad_rel_err_native_vs_mig"] = float(np.linalg.norm(a - b) / np.linalg.norm(a))
                else:
                    rec["spconv"] = spgrads
                rec["grad_rel_err"][algo] = {
                    "all": float(np.linalg.norm(total_got - total_want) / np.linalg.norm(total_want)),
                    "worst": errs[worst], "worst_name": worst, "parameters": len(errs)}
        del y, grads, tape
        gt = torch.as_tensor(g, device="cuda")

        def ours_step():
            with nn.Tape() as tp:
                yy = ours(x.without_maps())
            tp.backward(yy, g)

        def ours_forward():
            with nn.Tape():
                ours(x.without_maps())

        def sp_step(t):
            def step():
                t.zero_grad(set_to_none=True)
                yy = t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))
                yy.features.backward(gt if yy.features.shape == gt.shape else
                                     torch.ones_like(yy.features) / yy.features.numel() ** 0.5)
            return step

        contenders = {"numba-sc": ours_step, "numba-sc forward only": ours_forward,
                      "spconv Native": sp_step(twins["Native"]),
                      "spconv MaskImplicitGemm": sp_step(twins["MaskImplicitGemm"])}
        rec["step"] = wall_interleaved(contenders, args.warmup, args.reps)
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not crash
        rec["error"] = repr(e)
        rec["traceback"] = traceback.format_exc()
        print(f"[{net} {cloud}] failed: {e!r}\n{rec['traceback'][-1500:]}")
    free_memory()
    out["runs"].append(rec)
    report(rec)
    Path(args.out).write_text(json.dumps(out, indent=1))


def report(rec):
    head = f"{rec['net']:8s} {rec['cloud']:8s} {rec['n']:>8,}"
    if "step" in rec:
        s = {k: v["ms"] for k, v in rec["step"].items()}
        best = min(s["spconv Native"], s["spconv MaskImplicitGemm"])
        print(f"{head}  step ms: ours {s['numba-sc']:.2f} (forward {s['numba-sc forward only']:.2f}), "
              f"spconv Native {s['spconv Native']:.2f}, MaskImplicitGemm {s['spconv MaskImplicitGemm']:.2f}"
              f"  ours / best {s['numba-sc'] / best:.2f}x")
    if "grad_rel_err_native_vs_mig" in rec:
        print(f"{'':28s} gradients, spconv Native vs MaskImplicitGemm: {rec['grad_rel_err_native_vs_mig']:.1e}")
    for algo, e in rec.get("grad_rel_err", {}).items():
        print(f"{'':28s} gradients vs spconv {algo}: all {e['all']:.1e}, worst {e['worst']:.1e} "
              f"({e['worst_name']}, {e['parameters']} parameters)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--clouds", default="kitti,scannet,sunrgbd", help=f"any of {', '.join(SCANS)}, random")
    ap.add_argument("--nets", default="unet42,resnet21")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="train.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    data = find_data(args.data)
    out = {"recorded": recorded(args.note), "runs": []}
    for cloud in args.clouds.split(","):
        coords, feats = load_cloud(cloud, data)
        for net in args.nets.split(","):
            run_one(net, cloud, coords, feats, args, out)
    out["recorded"] = recorded(args.note)  # again, now that the peers' versions are known
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"full results: {args.out}")


if __name__ == "__main__":
    main()
