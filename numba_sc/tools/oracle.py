"""A float64 oracle for a network's gradients: whose answer is right?

Two engines (or two algorithms of one engine) train the same network on the same
cloud and their gradients differ by 1e-2. Comparing them with each other says
*that* they differ, never which one drifted: that needs a third answer known to be
closer to the truth than either. This module computes it. ``backend="reference"``
runs every layer (the three convolutions, BatchNorm in training and eval mode with
its residual and ReLU fusions, ReLU, Linear, add, cat), the loss and every backward
step of :class:`numba_sc.nn.Tape` in float64 throughout, from the exact upcast of the
model's weights and of the input's features; the float32 and float16 paths are then
measured against it, parameter by parameter.

Worked example (``width=0.125``: a MinkUNet42 of 4 to 12 channels)::

    model = numba_sc.models.MinkUNet42(4, 19, width=0.125).train()
    g = rng.standard_normal((len(x), 19))        # dL/d(output), one fixed gradient
    report = numba_sc.check_gradients(model, x, g, others={"spconv": theirs})
    print(report)                                # one row per parameter, in network order
    report.worst("reference float32")            # the parameter that drifted most

Each row gives the float64 gradient's norm and, per path, the relative distance
``||grad_path - grad64|| / ||grad64||`` (absolute, and flagged ``*``, where the
float64 gradient is 0). Distances in float32 are of the order of the unit roundoff
(6e-8) times the depth's error growth; a jump at one layer, from one row to the next,
names the layer where a path loses precision.

Why trust the oracle? Its gradients are checked against central finite differences
in float64 for weights of every layer kind and for the input features
(``tests/tools/test_oracle.py``), and each float64 layer against a brute-force loop
over the convolution's rule, so neither depends on the code it judges.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from ..core.backend import like, to_host
from ..core.device import gpu_present, simulating
from ..core.tensor import SparseTensor
from ..nn.layers import Module
from ..nn.tape import Tape

__all__ = ["gradients", "GradientReport", "ParameterDistance", "PATHS"]

# The paths that can be measured: "<backend> <dtype>". "cuda" is the GPU, or the
# kernels under Numba's CUDA simulator when it is on.
PATHS = ("reference float32", "reference float16", "cuda float32", "cuda float16")
TRUTH = "reference float64"


@dataclass
class ParameterDistance:
    """One parameter's row: its float64 gradient's norm and each path's distance to it.

    ``distance[path]`` is relative (``||g_path - g64|| / ||g64||``), or absolute
    (``||g_path - g64||``) when ``absolute`` is set: the float64 gradient is 0 there
    (a layer the output does not reach, a bias before a BatchNorm in training mode)."""

    name: str
    norm64: float
    distance: dict = field(default_factory=dict)
    absolute: bool = False


@dataclass
class GradientReport:
    """What :func:`gradients` measured.

    ``parameters``: one :class:`ParameterDistance` per trainable parameter, in the
    order of ``model.named_parameters()``. ``total[path]``: the relative distance of
    all parameters' gradients as one vector. ``output[path]``: the relative
    distance of the forward's output (None for a path given as ``others``, whose
    outputs are not known). ``mode``: ``"train"`` or ``"eval"``, the model's."""

    model: str
    mode: str
    points: int
    paths: list
    parameters: list
    total: dict
    output: dict

    def worst(self, path: str) -> ParameterDistance:
        """The parameter whose gradient is farthest from float64's on ``path``."""
        self._check_path(path)
        return max(self.parameters, key=lambda p: p.distance[path])

    def table(self) -> str:
        """The report as a fixed-width table, one row per parameter."""
        w = max([len("all parameters")] + [len(p.name) for p in self.parameters])
        cols = [max(12, len(p)) for p in self.paths]
        head = f"{'parameter':<{w}}  {'|grad64|':>10}  " + "  ".join(f"{p:>{c}}" for p, c in zip(self.paths, cols))
        lines = [f"gradients against float64 ({self.model}, {self.mode} mode, {self.points} points); "
                 "relative distance, * absolute (float64 gradient is 0)", head, "-" * len(head)]
        for p in self.parameters:
            mark = "*" if p.absolute else " "
            lines.append(f"{p.name:<{w}}  {p.norm64:10.3e}  "
                         + "  ".join(f"{p.distance[q]:>{c - 1}.2e}{mark}" for q, c in zip(self.paths, cols)))
        lines.append("-" * len(head))
        lines.append(f"{'all parameters':<{w}}  {'':>10}  "
                     + "  ".join(f"{self.total[q]:>{c - 1}.2e} " for q, c in zip(self.paths, cols)))
        lines.append(f"{'output':<{w}}  {'':>10}  "
                     + "  ".join((f"{self.output[q]:>{c - 1}.2e} " if self.output[q] is not None
                                  else f"{'-':>{c - 1}} ") for q, c in zip(self.paths, cols)))
        for q in self.paths:
            p = self.worst(q)
            lines.append(f"worst on {q}: {p.name} ({p.distance[q]:.2e}{', absolute' if p.absolute else ''})")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict:
        """Plain numbers, strings and lists (``json.dumps`` takes it as is)."""
        return {"model": self.model, "mode": self.mode, "points": self.points, "truth": TRUTH,
                "paths": list(self.paths),
                "parameters": [{"name": p.name, "norm64": p.norm64, "absolute": p.absolute,
                                "distance": dict(p.distance)} for p in self.parameters],
                "total": dict(self.total), "output": dict(self.output),
                "worst": {q: self.worst(q).name for q in self.paths}}

    def _check_path(self, path):
        if path not in self.paths:
            raise KeyError(f"path {path!r} was not measured; this report has {self.paths}")


def _default_paths():
    return ["reference float32"] + (["cuda float32"] if gpu_present() else [])


def _check_paths(paths):
    if paths is None:
        return _default_paths()
    if isinstance(paths, str):
        paths = [paths]
    paths = list(paths)
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"paths: {p!r} is not a path; choose among {list(PATHS)} ({TRUTH!r} is the "
                             "truth every path is measured against)")
        if p.startswith("cuda") and not (gpu_present() or simulating()):
            raise ValueError(f"paths: {p!r} needs a CUDA GPU (or the simulator: NUMBA_ENABLE_CUDASIM=1 "
                             "before numba is imported); leave it out to measure the reference paths only")
    if len(set(paths)) != len(paths):
        raise ValueError(f"paths: {paths} names a path twice")
    return paths


def _run(model, x, g, backend, dtype, device):
    """Forward and backward of a copy of ``model`` on ``backend`` in ``dtype``: the
    output (float64, host) and ``{parameter name: gradient}`` (float64, host)."""
    m = copy.deepcopy(model).to(device, dtype)  # (the user's model, statistics included, untouched)
    xin = SparseTensor.from_layer(x[0], x[1].astype(dtype), x[2], None).to(device)
    with Tape() as tape:
        y = m(xin, backend=backend)
        if tuple(g.shape) != tuple(y.features.shape):
            raise ValueError(f"g must have the shape of the model's output {tuple(y.features.shape)} "
                             f"(one row per output point, one column per channel), got {tuple(g.shape)}")
        grads = tape.backward(y, like(g.astype(dtype), y.features))  # (on the output's side)
    out = np.asarray(to_host(y.features), np.float64)
    return out, {k: np.asarray(to_host(v), np.float64) for k, v in grads.items()}


def _distance(a, b):
    """(relative distance of ``a`` from the truth ``b``, whether it is absolute)."""
    nb = float(np.linalg.norm(b))
    d = float(np.linalg.norm(a - b))
    return (d, True) if nb == 0 else (d / nb, False)


def _check_others(others, shapes):
    if others is None:
        return {}
    if not isinstance(others, dict):
        raise TypeError(f"others must be a dict {{path name: {{parameter name: gradient}}}}, got "
                        f"{type(others).__name__}")
    out = {}
    for path, grads in others.items():
        if not isinstance(path, str) or path in PATHS or path == TRUTH:
            raise ValueError(f"others: {path!r} must be a name of its own (a string other than "
                             f"{list(PATHS) + [TRUTH]}), e.g. 'spconv implicit'")
        if not isinstance(grads, dict):
            raise TypeError(f"others[{path!r}] must be a dict {{parameter name: gradient}}, got "
                            f"{type(grads).__name__}")
        missing = [k for k in shapes if k not in grads]
        extra = [k for k in grads if k not in shapes]
        if missing or extra:
            raise KeyError(f"others[{path!r}] must hold a gradient for every trainable parameter, in this "
                           f"library's names: missing {missing[:6]}, unknown {extra[:6]} (spconv's weights: "
                           "convert with numba_sc.nn.spconv_format)")
        out[path] = {}
        for k, shape in shapes.items():
            v = grads[k]
            if not hasattr(v, "shape") or tuple(v.shape) != shape:
                got = tuple(v.shape) if hasattr(v, "shape") else type(v).__name__
                raise ValueError(f"others[{path!r}][{k!r}] must have the parameter's shape {shape}, got {got}")
            v = np.asarray(to_host(v), np.float64)
            if not np.isfinite(v).all():
                raise ValueError(f"others[{path!r}][{k!r}] holds NaN or infinite values")
            out[path][k] = v
    return out


def gradients(model, x, g, paths=None, others=None) -> GradientReport:
    """Measure each path's parameter gradients against the float64 oracle's.

    Parameters
    ----------
    model : numba_sc.nn.Module
        Run in its current mode (``model.train()``: BatchNorm on the batch's
        statistics; ``model.eval()``: on the running ones). Every path runs on a
        copy: the model, its weights and its BatchNorm running statistics are
        never changed.
    x : SparseTensor
        The input. Every path starts from its features (the float64 run from
        their exact upcast, a float16 path from their rounding).
    g : array (N_out, C_out)
        ``dL/d(output)``: one fixed output gradient (of the loss, or random), the
        same for every path (in its dtype).
    paths : None or list of str
        Among :data:`PATHS`: ``"reference float32"``, ``"reference float16"`` (the
        NumPy references), ``"cuda float32"``, ``"cuda float16"`` (the kernels: the
        GPU, or the simulator when it is on). Default: ``"reference float32"``,
        and ``"cuda float32"`` when a GPU is present.
    others : None or dict
        ``{path name: {parameter name: gradient}}``: gradients computed elsewhere
        (another engine, the same weights and input), in this library's names and
        layouts (:mod:`numba_sc.nn.spconv_format` converts spconv's weights), judged
        by the same float64 truth.

    Returns a :class:`GradientReport`: ``print(report)`` shows the table,
    ``report.worst(path)`` the parameter farthest from float64, and
    ``report.to_dict()`` the numbers for a JSON file.
    """
    if not isinstance(model, Module):
        raise TypeError(f"model must be a numba_sc.nn.Module, got {type(model).__name__}")
    if not isinstance(x, SparseTensor):
        raise TypeError(f"x must be a numba_sc.SparseTensor, got {type(x).__name__}; make one with "
                        "numba_sc.SparseTensor(coords, features)")
    if not hasattr(g, "shape") or not hasattr(g, "dtype") or not np.issubdtype(np.dtype(g.dtype), np.floating):
        raise TypeError(f"g must be a float array (the output's gradient), got "
                        f"{getattr(g, 'dtype', type(g).__name__)}")
    g = np.asarray(to_host(g), np.float64)
    if not np.isfinite(g).all():
        raise ValueError("g holds NaN or infinite values")
    paths = _check_paths(paths)
    shapes = {k: tuple(v.shape) for k, v in model.trainable_parameters()}
    given = _check_others(others, shapes)
    xs = (np.asarray(to_host(x.coords)), np.asarray(to_host(x.features)), x.stride)

    out64, grads64 = _run(model, xs, g, "reference", np.float64, "cpu")
    measured, outputs = {}, {}
    for p in paths:
        backend, dtype = p.split()
        outputs[p], measured[p] = _run(model, xs, g, backend, np.dtype(dtype), "cuda" if backend == "cuda" else "cpu")
    measured.update(given)
    names = list(paths) + list(given)

    def grad(source, k):  # a parameter the output does not reach has no gradient: 0
        return source.get(k, np.zeros(shapes[k]))

    rows = []
    for k in shapes:
        truth = grad(grads64, k)
        row = ParameterDistance(k, float(np.linalg.norm(truth)))
        for p in names:
            row.distance[p], row.absolute = _distance(grad(measured[p], k), truth)
        rows.append(row)
    flat64 = np.concatenate([grad(grads64, k).ravel() for k in shapes])
    total = {p: _distance(np.concatenate([grad(measured[p], k).ravel() for k in shapes]), flat64)[0]
             for p in names}
    output = {p: (_distance(outputs[p], out64)[0] if p in outputs else None) for p in names}
    return GradientReport(type(model).__name__, "train" if model.training else "eval", len(x), names, rows,
                          total, output)
