#!/usr/bin/env python
"""One training step (forward + backward) of numba-sc's networks beside spconv 2.3.8's
(PyTorch autograd), on the same inputs and weights, in fp32 and in mixed precision.

Needs a CUDA GPU with CuPy, PyTorch and spconv (the GPU machine; never CI)::

    . benchmarks/gpu_env.sh
    python3 benchmarks/bench_train.py --out results/train_step.json
    python3 benchmarks/bench_train.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --out results/train_step_20k.json

For each network x cloud, fp32 then fp16 (``--dtypes``), one record each (its ``dtype``):

1. the same weights in ours and in spconv's twins (``spconv_nets.py``, Native and
   MaskImplicitGemm), BatchNorm in training mode on both sides, and one fixed random
   gradient ``g`` of the output (float32, unit norm; the same for both dtypes);
2. correctness (see below);
3. the step, timed as a user meets it: a new tensor each call (every map built
   again), forward in training mode, backward from ``g``, wall clock between
   device-wide synchronizes, the contenders interleaved call by call, median of
   ``--reps`` after ``--warmup``; ours also forward alone, to split the step.

**fp32.** Ours: forward under a :class:`numba_sc.nn.Tape`, ``tape.backward(y, g)``.
spconv: ``zero_grad``, forward, ``y.features.backward(g)``. Correctness (MinkUNet42,
whose output rows are the input's on both sides, so ``g`` means the same there):
every parameter's gradient, ours against spconv's autograd, as ||ours - spconv|| /
||spconv||, and the worst layer.

**fp16: what each side's user runs for a mixed-precision step.** Both start from the
same float32 weights (the calibrated state) and the same float32 input features.

* ours, :mod:`numba_sc.train.amp` as :class:`numba_sc.train.trainer.Trainer` uses it
  (``amp=True``, its steps 2-6 on one GPU, less the loss and the optimizer's update):
  the model built in float32, an optimizer on its parameters and
  :class:`~numba_sc.train.amp.MasterWeights` (the convolution and linear weights now
  float16 copies of the float32 masters; BatchNorm and biases stay float32), a
  :class:`~numba_sc.train.amp.LossScaler`. The step: the input features cast to
  float16, the forward, ``g`` times the scale in float32 then rounded to float16, the
  backward, then *unscale and check*: the gradients packed into float32 buckets
  (:class:`numba_sc.train.parallel.GradientBuckets`), multiplied by ``1 / scale``,
  every bucket checked for NaN/inf with the verdict read to the host (where the
  Trainer decides to skip a step), and ``scaler.update(finite)``. ``amp`` has no
  single "unscale and check" call: these are the Trainer's own lines.
* spconv: the float32 twin, its forward under ``torch.autocast("cuda",
  dtype=torch.float16)`` (spconv's convolutions cast their input and weight to
  float16 at every call; BatchNorm keeps float32 parameters), a
  ``torch.amp.GradScaler`` and a dummy SGD over the twin's parameters (never
  stepped). The step: ``zero_grad``, the forward, ``y.features.backward(
  scaler.scale(g).to(y.features.dtype))``, ``scaler.unscale_(sgd)`` (the unscale
  and the inf check, in one fused kernel per dtype), ``scaler.update()``.

  ``scaler.scale(g)`` is ``g`` times the scale in float32, rounded to float16 by the
  ``.to``: the very gradient ours starts its backward from. It is what
  ``scaler.scale((y.features.float() * g).sum()).backward()`` would hand the
  network's last layer, without the two extra kernels of a loss neither side computes.
  ``scaler.update()`` is there because a user's loop calls it every step (after
  ``scaler.step``) and ``unscale_`` refuses to run twice without it; it adds a tiny
  kernel. The difference left: the Trainer reads the finite flag to the host at once,
  while GradScaler leaves it on the device until ``scaler.step`` (not timed) would
  read it; the timer synchronizes the device right after anyway, so the read costs
  ours only its latency.

The loss scale: both scalers start at the same power of two, the largest from
``2**16`` down at which neither ours nor either twin overflows on this cloud (the
scale a dynamic scaler settles at; ``g`` has unit norm, larger than a mean loss's
gradient, so ``2**16`` itself may overflow), recorded as ``loss_scale``; both follow
their dynamic rule during the timing (halve on overflow; no growth within so few
steps), and ``loss_scale_after`` says where each ended.

Correctness (fp16): ours' float16 output against each twin's autocast output
(``rel_err``, rows matched by coordinates), and for MinkUNet42 the unscaled float32
gradients after the timed code's own unscale, ours against each twin's
(``grad_rel_err``: float16's rounding, summed in different orders, so far looser
than fp32's; reported, never a failure), beside the spread between the two spconv
algorithms (``*_native_vs_mig``), which is float16's own; ``finite`` says whether
each side's gradients were finite in that step.

``--memory``: the peak device memory of one step of each contender (the timed step
functions, once each), recorded per run in ``memory`` (:func:`step_memory`; bytes
allocated from CuPy's pool for ours and from PyTorch's allocator for spconv, weights,
inputs and our fp16 step's master weights and gradient buckets included).
``--reps 0 --memory`` measures memory alone.

No optimizer update is timed (it is the same few element-wise passes on both sides).
A short table goes to stdout, everything to ``--out``: per run, ``step`` (ms of each
contender; the fp32 rows' structure is unchanged) and ``ours_over_best`` (ours' step
over the faster spconv's).
"""
import argparse
import traceback

import numpy as np

from bench_net import (NETS, build_ours, build_spconv, calibrated_state, contender_peaks, free_memory,
                       load_cloud, rel_err_by_coords, spconv_input, spconv_output, wall_interleaved)
from common import CROPS, SCANS, find_data, recorded, write_json

DTYPES = ("float32", "float16")
SPCONV_ALGOS = ("Native", "MaskImplicitGemm")
FIRST_SCALE = 2.0 ** 16  # amp's and GradScaler's default start


# ------------------------------------------------------------------ ours, mixed precision
class OursAmp:
    """Ours' mixed-precision step without the loss and the update: the Trainer's amp
    path (``numba_sc/train/trainer.py``, steps 2-6) on one GPU, with a fixed output
    gradient ``g`` (float32) in place of the loss's.

    Built on a float32 model (on its device, in training mode): the model becomes
    float16 here (:class:`~numba_sc.train.amp.MasterWeights`). Works on NumPy arrays
    too (the simulator)."""

    def __init__(self, model, g, init_scale=FIRST_SCALE):
        from numba_sc.train.amp import LossScaler, MasterWeights
        from numba_sc.train.optim import SGD

        self.model, self.g = model, g
        # never stepped: it is there because the masters are an optimizer's arrays
        optimizer = SGD(model.trainable_parameters(), lr=0.0)
        self.masters = MasterWeights(model, optimizer)
        self.scaler = LossScaler(init_scale)
        self.names = list(optimizer.params)
        self.buckets = None  # made at the first step, from the gradients' shapes (as the Trainer does)

    def forward(self, x):
        """(tape, y): the forward pass on ``x``'s float32 features cast to float16, maps built afresh."""
        from numba_sc import nn
        from numba_sc.train.amp import HALF

        with nn.Tape() as tape:
            y = self.model(x.without_maps().with_features(x.features.astype(HALF)))
        return tape, y

    def step(self, x, scale=None):
        """Forward, backward from ``g`` times the scale (the scaler's unless ``scale`` is
        given), unscale and check; the scaler told the verdict only when ``scale`` is
        None. Returns (y, finite)."""
        s = self.scaler.scale if scale is None else scale
        tape, y = self.forward(x)
        grads = tape.backward(y, (self.g * np.float32(s)).astype(y.features.dtype))
        finite = self.unscale_and_check(grads, s)
        if scale is None:
            self.scaler.update(finite)
        return y, finite

    def unscale_and_check(self, grads, scale) -> bool:
        """The gradients into float32 buckets, divided by ``scale``; True when all are finite."""
        from numba_sc.core.backend import to_host
        from numba_sc.core.device import array_module
        from numba_sc.train.parallel import GradientBuckets

        if self.buckets is None:
            self.buckets = GradientBuckets.for_gradients(self.names, grads)
        self.buckets.pack(grads)
        xp = array_module(self.buckets.buffers[0])
        for b in self.buckets.buffers:
            b *= np.float32(1.0 / scale)  # a power of two: exact
        return bool(to_host(xp.stack([xp.isfinite(b).all() for b in self.buckets.buffers]).all()))

    def gradients(self) -> dict:
        """The last step's unscaled float32 gradients, by parameter name (views into the buckets)."""
        return self.buckets.views()


def grads_in_spconv_layout(ours, grads, in_channels):
    """Our gradients by spconv's parameter names and layouts: a float32 copy of the model
    whose weights are the gradients, converted as the weights are (float16 weights'
    gradients stay float32 here, for the comparison)."""
    from numba_sc.nn.spconv_format import state_dict_to_spconv

    state = {**ours.state_dict(), **grads}
    state = {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in state.items()}
    state = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in state.items()}
    copy = build_ours("unet42", in_channels)
    copy.load_state_dict(state)
    return state_dict_to_spconv(copy)


def grad_errors(mine, twins, rec):
    """``rec["grad_rel_err"][algo]`` (ours against each twin's ``.grad``: all parameters
    as one vector, and the worst one) and ``rec["grad_rel_err_native_vs_mig"]``."""
    rec["grad_rel_err"] = {}
    spgrads = {}
    for algo, t in twins.items():
        errs = {}
        for name, p in t.named_parameters():
            want = p.grad.detach().double().cpu().numpy()
            got = np.asarray(mine[name], np.float64).reshape(want.shape)
            errs[name] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        worst = max(errs, key=errs.get)
        total_got = np.concatenate([np.asarray(mine[n], np.float64).ravel() for n in errs])
        spgrads[algo] = np.concatenate([p.grad.detach().double().cpu().numpy().ravel()
                                        for _, p in t.named_parameters()])
        rec["grad_rel_err"][algo] = {
            "all": float(np.linalg.norm(total_got - spgrads[algo]) / np.linalg.norm(spgrads[algo])),
            "worst": errs[worst], "worst_name": worst, "parameters": len(errs)}
    a, b = spgrads["Native"], spgrads["MaskImplicitGemm"]  # the two spconv algorithms: the dtype's own spread
    rec["grad_rel_err_native_vs_mig"] = float(np.linalg.norm(a - b) / np.linalg.norm(a))


# ------------------------------------------------------------------ one network x cloud
def run_one(net, cloud, coords, feats, args, out):
    """Every dtype of ``args.dtypes`` for one network on one cloud, a record each."""
    import torch

    setup = None
    for dt in args.dtypes:
        rec = {"net": net, "cloud": cloud, "n": int(len(coords)), "dtype": dt}
        try:
            if setup is None:
                state = calibrated_state(net, coords, feats)
                indices, spatial, lo = spconv_input(coords, feats)
                setup = dict(state=state, indices=indices, spatial=spatial, lo=lo,
                             tfeats=torch.from_numpy(feats).cuda())
            (run_fp32 if dt == "float32" else run_fp16)(net, coords, feats, setup, args, rec)
            if "step" in rec:
                s = {k: v["ms"] for k, v in rec["step"].items()}
                rec["ours_over_best"] = s["numba-sc"] / min(s[f"spconv {a}"] for a in SPCONV_ALGOS)
        except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not crash
            rec["error"] = repr(e)
            rec["traceback"] = traceback.format_exc()
            print(f"[{net} {cloud} {dt}] failed: {e!r}\n{rec['traceback'][-1500:]}")
        free_memory()
        out["runs"].append(rec)
        report(rec)
        write_json(args.out, out)


def _models(net, feats, setup):
    """(ours: float32, on the GPU, training mode; twins: algo -> the spconv twin, same weights)."""
    import torch

    from numba_sc.nn.spconv_format import state_dict_to_spconv

    ours = build_ours(net, feats.shape[1])
    ours.load_state_dict(setup["state"])
    ours.cuda().train()
    sp_state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict_to_spconv(ours).items()}
    twins = {}
    for algo in SPCONV_ALGOS:
        t = build_spconv(net, feats.shape[1], algo)
        t.load_state_dict(sp_state)
        twins[algo] = t.train()
    return ours, twins


def _output_gradient(shape):
    """The fixed output gradient: random, unit norm, float32 (the same for every dtype)."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape))).astype(np.float32)


def run_fp32(net, coords, feats, setup, args, rec):
    import cupy
    import spconv.pytorch as spconv
    import torch

    import numba_sc as ns
    from numba_sc import nn

    indices, spatial, lo, tfeats = setup["indices"], setup["spatial"], setup["lo"], setup["tfeats"]
    ours, twins = _models(net, feats, setup)
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))
    with nn.Tape() as tape:
        y = ours(x.without_maps())
    g = cupy.asarray(_output_gradient(y.features.shape))
    grads = tape.backward(y, g)
    rec["out_points"] = int(len(y))
    if net == "unet42":  # output rows = input rows on both sides: g means the same there
        with torch.no_grad():
            ys = twins["Native"](spconv.SparseConvTensor(tfeats, indices, spatial, 1))
        cs, _ = spconv_output(ys, lo, np.asarray(y.stride))
        assert np.array_equal(cs, cupy.asnumpy(y.coords)), "output rows differ from spconv's"
        for t in twins.values():
            t.zero_grad(set_to_none=True)
            t(spconv.SparseConvTensor(tfeats, indices, spatial, 1)).features.backward(torch.as_tensor(g, device="cuda"))
        grad_errors(grads_in_spconv_layout(ours, grads, feats.shape[1]), twins, rec)
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
    ys = None  # (the correctness pass's spconv output: it would count in spconv's memory)
    if args.reps > 0:
        rec["step"] = wall_interleaved(contenders, args.warmup, args.reps)
    if args.memory:
        rec["memory"] = step_memory(contenders, twins)


def run_fp16(net, coords, feats, setup, args, rec):
    import cupy
    import spconv.pytorch as spconv
    import torch

    import numba_sc as ns
    from numba_sc.train.amp import LossScaler

    indices, spatial, lo, tfeats = setup["indices"], setup["spatial"], setup["lo"], setup["tfeats"]
    ours, twins = _models(net, feats, setup)  # (the twins' weights taken while ours is still float32)
    x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))  # float32, as a user's loader gives it
    y = ours(x.without_maps())  # (float32, once: the output's shape and stride)
    g = cupy.asarray(_output_gradient(y.features.shape))
    stride = np.asarray(y.stride)
    del y
    amp = OursAmp(ours, g)  # ours is float16 from here on
    gt = torch.as_tensor(g, device="cuda")

    def sp_forward(t):
        with torch.autocast("cuda", dtype=torch.float16):
            return t(spconv.SparseConvTensor(tfeats, indices, spatial, 1))

    def sp_output_gradient(yy):
        return gt if yy.features.shape == gt.shape else torch.ones_like(yy.features, dtype=torch.float32) / \
            yy.features.numel() ** 0.5

    def sp_finite_at(t, scale):
        """Are the twin's gradients finite when the output gradient is scaled by ``scale``?"""
        t.zero_grad(set_to_none=True)
        yy = sp_forward(t)
        yy.features.backward((sp_output_gradient(yy) * scale).to(yy.features.dtype))
        return all(bool(torch.isfinite(p.grad).all()) for p in t.parameters() if p.grad is not None)

    # The loss scale both sides start at: the largest from 2**16 down that nobody overflows.
    scale = FIRST_SCALE
    while not (amp.step(x, scale)[1] and all(sp_finite_at(t, scale) for t in twins.values())):
        if scale <= 1.0:
            raise FloatingPointError("gradients overflow float16 even unscaled: the output gradient is too large")
        scale /= 2.0
    rec["loss_scale"] = scale
    amp.scaler = LossScaler(scale)
    scalers = {a: torch.amp.GradScaler("cuda", init_scale=scale) for a in SPCONV_ALGOS}
    sgds = {a: torch.optim.SGD(t.parameters(), lr=0.0) for a, t in twins.items()}  # never stepped

    def sp_step(algo):
        t, scaler, sgd = twins[algo], scalers[algo], sgds[algo]

        def step():
            t.zero_grad(set_to_none=True)
            yy = sp_forward(t)
            yy.features.backward(scaler.scale(sp_output_gradient(yy)).to(yy.features.dtype))
            scaler.unscale_(sgd)
            scaler.update()
            return yy
        return step

    contenders = {"numba-sc": lambda: amp.step(x), "numba-sc forward only": lambda: amp.forward(x),
                  **{f"spconv {a}": sp_step(a) for a in SPCONV_ALGOS}}

    # Correctness: one step of each timed contender (the scale is where nobody overflows).
    y, finite = contenders["numba-sc"]()
    rec["out_points"] = int(len(y))
    rec["finite"] = {"numba-sc": finite}
    ours_out = (cupy.asnumpy(y.coords), cupy.asnumpy(y.features))
    mine = grads_in_spconv_layout(ours, amp.gradients(), feats.shape[1]) if net == "unet42" else None
    del y
    outs, rec["rel_err"] = {}, {}
    for algo in SPCONV_ALGOS:
        ys = contenders[f"spconv {algo}"]()
        rec["finite"][f"spconv {algo}"] = all(bool(torch.isfinite(p.grad).all()) for p in twins[algo].parameters())
        outs[algo] = spconv_output(ys, lo, stride)
    for algo in SPCONV_ALGOS:
        rec["rel_err"][algo] = rel_err_by_coords(*ours_out, *outs[algo])[0]
    rec["rel_err_native_vs_mig"] = rel_err_by_coords(*outs["Native"], *outs["MaskImplicitGemm"])[0]
    if mine is not None:
        grad_errors(mine, twins, rec)
    del outs, ys
    if args.reps > 0:
        rec["step"] = wall_interleaved(contenders, args.warmup, args.reps)
    if args.memory:
        rec["memory"] = step_memory(contenders, twins)
    rec["loss_scale_after"] = {"numba-sc": amp.scaler.scale,
                               **{f"spconv {a}": float(s.get_scale()) for a, s in scalers.items()}}


def step_memory(contenders, twins):
    """The peak device memory of one training step of each contender (``contenders``'
    ``numba-sc`` and ``spconv <algo>``, the timed step functions), by
    :func:`bench_net.contender_peaks`, every twin's ``.grad`` dropped first and after its
    step (so a twin's ``before_bytes`` holds its own weights and the inputs, as ours'
    does; our float16 step's float32 masters and gradient buckets are ours' own, as a
    user of the Trainer holds them)."""
    return contender_peaks(contenders["numba-sc"], twins, lambda algo: contenders[f"spconv {algo}"],
                           reset=lambda t: t.zero_grad(set_to_none=True))


# ------------------------------------------------------------------ output
def report(rec):
    head = f"{rec['net']:8s} {rec['cloud']:11s} {rec['n']:>8,} {rec['dtype']:7s}"
    if "step" in rec:
        s = {k: v["ms"] for k, v in rec["step"].items()}
        print(f"{head}  step ms: ours {s['numba-sc']:.2f} (forward {s['numba-sc forward only']:.2f}), "
              f"spconv Native {s['spconv Native']:.2f}, MaskImplicitGemm {s['spconv MaskImplicitGemm']:.2f}"
              f"  ours / best {rec['ours_over_best']:.2f}x", flush=True)
    pad = " " * 40
    if "memory" in rec:
        m = rec["memory"]
        best = min(v["peak_bytes"] for k, v in m.items() if k.startswith("spconv"))
        print(f"{head}  step peak MB (extra): "
              + ", ".join(f"{k} {v['peak_bytes'] / 1e6:.1f} ({v['extra_bytes'] / 1e6:.1f})" for k, v in m.items())
              + f"  ours / best {m['numba-sc']['peak_bytes'] / best:.2f}x", flush=True)
    if "loss_scale" in rec:
        after = ", ".join(f"{k} {v:g}" for k, v in rec.get("loss_scale_after", {}).items())
        print(f"{pad}loss scale {rec['loss_scale']:g} (after the timing: {after}); finite: {rec['finite']}")
    if "rel_err" in rec:
        print(f"{pad}output vs spconv autocast: " + ", ".join(f"{a} {e:.1e}" for a, e in rec["rel_err"].items())
              + f" (Native vs MaskImplicitGemm {rec['rel_err_native_vs_mig']:.1e})")
    if "grad_rel_err_native_vs_mig" in rec:
        print(f"{pad}gradients, spconv Native vs MaskImplicitGemm: {rec['grad_rel_err_native_vs_mig']:.1e}")
    for algo, e in rec.get("grad_rel_err", {}).items():
        print(f"{pad}gradients vs spconv {algo}: all {e['all']:.1e}, worst {e['worst']:.1e} "
              f"({e['worst_name']}, {e['parameters']} parameters)")


def _names(value, known, what):
    """``value`` (comma-separated) as a list, every name one of ``known``."""
    names = [v for v in value.split(",") if v]
    wrong = [v for v in names if v not in known]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {wrong or value!r}: give a comma-separated list of "
                                         f"{', '.join(known)}")
    return names


CLOUD_NAMES = (*SCANS, *CROPS, "random")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--clouds", default="kitti,scannet,sunrgbd", type=lambda v: _names(v, CLOUD_NAMES, "cloud"),
                    help=f"comma-separated, any of: whole scans {', '.join(SCANS)}; crops of ~20k voxels "
                         f"{', '.join(CROPS)}; random (1M voxels)")
    ap.add_argument("--nets", default=",".join(NETS), type=lambda v: _names(v, NETS, "network"),
                    help=f"comma-separated, any of {', '.join(NETS)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), type=lambda v: _names(v, DTYPES, "dtype"),
                    help="comma-separated: float32 (plain step), float16 (mixed precision: fp32 masters, "
                         "loss scaling; spconv under torch.autocast with a GradScaler)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per contender (0: none, with --memory)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--memory", action="store_true",
                    help="also the peak device memory of one training step of each contender (bytes allocated: "
                         "CuPy's pool for ours, PyTorch's allocator for spconv), in each run's 'memory'")
    ap.add_argument("--out", default="train.json")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    args = ap.parse_args(argv)
    if args.reps < 0 or args.warmup < 0:
        ap.error(f"--reps and --warmup must be >= 0, got {args.reps} and {args.warmup}")
    if args.reps == 0 and not args.memory:
        ap.error("--reps 0 times nothing: give --memory, or reps > 0")
    data = find_data(args.data)
    out = {"recorded": recorded(args.note), "reps": args.reps, "warmup": args.warmup, "memory": args.memory,
           "runs": []}
    from numba_sc.core.progress import bar, prints_above_bars  # (after common put the checkout on sys.path)

    # A bar over the (cloud, network) runs, on stderr where bars are on (NUMBA_SC_PROGRESS=1 forces
    # it): each run's lines still print as they come, above it; the JSON file is not touched by it.
    with bar(total=len(args.clouds) * len(args.nets), unit="run") as progress, prints_above_bars():
        for cloud in args.clouds:
            coords, feats = load_cloud(cloud, data)
            for net in args.nets:
                progress.set_description(f"{net} on {cloud}")
                run_one(net, cloud, coords, feats, args, out)
                progress.update(1)
    out["recorded"] = recorded(args.note)  # again, now that the peers' versions are known
    write_json(args.out, out)
    print(f"full results: {args.out}")


if __name__ == "__main__":
    main()
