"""Edges of the float64 oracle (#33): float64 runs on backend="reference", computing in
float64 (no hidden float32 step: each result is compared with a float64 formula to a
tolerance float32 arithmetic could not meet), and is refused, by name and with the fix,
on the kernels' backend. Same table shape as tests/test_edges.py: (id, call, expected)."""
import numpy as np
import pytest
from helpers import check_case

import numba_sc as ns
from numba_sc import nn
from numba_sc.nn import pointwise as pw
from numba_sc.train.loss import cross_entropy

from helpers import oracle

C3 = np.array([[0, 0, 0], [0, 1, 0], [1, 0, 0]], np.int32)  # sorted: rows stay where they are
RNG = np.random.default_rng(33)
F64 = RNG.standard_normal((3, 2))  # float64 features, not representable in float32
W64 = RNG.standard_normal((27, 2, 2))
REFUSED = r"float64, which runs only on backend='reference'.*float32"


def _x64():
    return ns.SparseTensor(C3, F64)


def _conv64(dataflow):
    y = ns.sparse_conv3d(_x64(), W64, backend="reference", dataflow=dataflow)
    want = oracle(y.coords, F64, y.coords, W64, ns.kernel_offsets(3))
    return y.features.dtype == np.float64 and np.abs(y.features - want).max() <= 1e-14 * np.abs(want).max()


def _batch_norm64(relu):
    rng = np.random.default_rng(1)
    x, res = rng.standard_normal((50, 3)), rng.standard_normal((50, 3))
    w, b, m, v = rng.uniform(0.5, 2, 3), rng.standard_normal(3), rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    got = pw.batch_norm(x, w, b, m, v, 1e-5, res, relu, backend="reference")
    want = (x - m) / np.sqrt(v + 1e-5) * w + b + res
    want = np.maximum(want, 0) if relu else want
    return got.dtype == np.float64 and np.abs(got - want).max() <= 1e-14


def _training_bn64():
    bn = nn.BatchNorm(2).double().train()
    x = ns.SparseTensor(C3, F64)
    y = bn(x, backend="reference")
    want = (F64 - F64.mean(0)) / np.sqrt(F64.var(0) + 1e-5)
    unbiased = F64.var(0) * 3 / 2
    return (np.abs(y.features - want).max() <= 1e-14 and bn.running_mean.dtype == np.float64
            and np.abs(bn.running_var - (0.9 + 0.1 * unbiased)).max() <= 1e-15)


def _linear_backward64():
    lin = nn.Linear(2, 3, rng=np.random.default_rng(2)).double()
    with nn.Tape() as tape:
        y = lin(_x64(), backend="reference")
    g = np.random.default_rng(3).standard_normal((3, 3))
    grads = tape.backward(y, g)
    return (np.abs(grads["weight"] - F64.T @ g).max() <= 1e-15 and np.abs(grads["bias"] - g.sum(0)).max() <= 1e-15
            and grads["weight"].dtype == np.float64)


def _cross_entropy64():
    x = np.random.default_rng(4).standard_normal((6, 4)) * 3
    t = np.array([0, 1, 2, 3, 0, 1])
    loss, g = cross_entropy(x, t, backend="reference", weight=np.array([0.1, 0.2, 0.3, 0.4]))
    p = np.exp(x) / np.exp(x).sum(1, keepdims=True)
    w = np.array([0.1, 0.2, 0.3, 0.4])[t]  # (0.1 and 0.3 are not float32 numbers)
    want = -(w * np.log(p[np.arange(6), t])).sum() / w.sum()
    wg = p.copy()
    wg[np.arange(6), t] -= 1
    wg *= (w / w.sum())[:, None]
    return g.dtype == np.float64 and abs(loss - want) <= 1e-15 and np.abs(g - wg).max() <= 1e-16


def _conv_backward_cuda64():
    y = ns.sparse_conv3d(_x64(), W64, backend="reference")
    return ns.sparse_conv3d_backward(_x64(), W64, y.features, y.kernel_map, backend="cuda")


def _small_model():
    return nn.Sequential(nn.SubMConv3d(2, 2, 3, rng=np.random.default_rng(0)), nn.ReLU())


def _report(**kw):
    return ns.check_gradients(_small_model(), ns.SparseTensor(C3, F64.astype(np.float32)),
                              kw.pop("g", np.ones((3, 2))), **kw)


# (id, call, expected): expected is (exception class, regex) or a function of the result -> bool
CASES = [
    # float64 on the reference backend: accepted, and computed in float64
    ("float64 SparseTensor", lambda: _x64().features.dtype, lambda d: d == np.float64),
    ("SparseTensor.to(np.float64)", lambda: ns.SparseTensor(C3, F64.astype(np.float32)).to(np.float64).features.dtype,
     lambda d: d == np.float64),
    ("float64 conv, gmas", lambda: _conv64("gmas"), lambda ok: ok),
    ("float64 conv, fetch-on-demand", lambda: _conv64("fetch"), lambda ok: ok),
    ("float64 conv, implicit GEMM", lambda: _conv64("implicit"), lambda ok: ok),
    ("float64 BatchNorm + residual", lambda: _batch_norm64(False), lambda ok: ok),
    ("float64 BatchNorm + residual + ReLU", lambda: _batch_norm64(True), lambda ok: ok),
    ("float64 BatchNorm, training statistics", _training_bn64, lambda ok: ok),
    ("float64 add", lambda: pw.add(F64, 2 * F64, backend="reference"), lambda a: np.array_equal(a, F64 + 2 * F64)),
    ("float64 bias add", lambda: pw.bias_add(F64, np.array([0.1, 0.2]), backend="reference"),
     lambda a: np.array_equal(a, F64 + np.array([0.1, 0.2]))),
    ("float64 column sums", lambda: pw.column_sums(F64), lambda s: s.dtype == np.float64 and np.allclose(s, F64.sum(0), 0, 1e-15)),
    ("float64 Linear backward", _linear_backward64, lambda ok: ok),
    ("float64 cross-entropy and its gradient", _cross_entropy64, lambda ok: ok),
    ("model.double()", lambda: {v.dtype.name for k, v in nn.BatchNorm(2).double().named_parameters()},
     lambda d: d == {"float64", "int64"}),
    ("model.to(np.float64) then .half()", lambda: nn.BatchNorm(2).double().half().weight.dtype, lambda d: d == np.float32),
    # float64 on the kernels' backend: refused up front, the fix named
    ("float64 model on cuda", lambda: _small_model().double()(_x64(), backend="cuda"), (TypeError, REFUSED)),
    ("float64 sparse_conv3d on cuda", lambda: ns.sparse_conv3d(_x64(), W64, backend="cuda"), (TypeError, REFUSED)),
    ("float64 conv backward on cuda", _conv_backward_cuda64, (TypeError, REFUSED)),
    ("float64 relu on cuda", lambda: pw.relu(F64, backend="cuda"), (TypeError, r"x are float64, which runs only")),
    ("float64 batch_norm on cuda", lambda: pw.batch_norm(F64, *np.ones((4, 2)), backend="cuda"), (TypeError, REFUSED)),
    ("float64 logits on cuda", lambda: cross_entropy(F64, np.zeros(3, int), backend="cuda"),
     (TypeError, r"logits are float64, which runs only")),
    ("SparseTensor.to('cuda', float64)", lambda: _x64().to("cuda"), (TypeError, REFUSED)),
    ("model.to('cuda', float64)", lambda: _small_model().to("cuda", np.float64), (TypeError, REFUSED)),
    ("float64 model moved to cuda", lambda: _small_model().double().cuda(), (TypeError, REFUSED)),
    ("longdouble features", lambda: ns.SparseTensor(C3, F64.astype(np.longdouble)) if np.longdouble != np.float64
     else ns.SparseTensor(C3, F64.astype(np.int32)), (TypeError, r"features must be float32 or float16 \(or float64 on backend='reference'\)")),
    # the report's arguments
    ("oracle: the truth as a path", lambda: _report(paths=["reference float64"]),
     (ValueError, r"'reference float64' is not a path; choose among")),
    ("oracle: a path twice", lambda: _report(paths=["reference float32"] * 2), (ValueError, r"names a path twice")),
    ("oracle: g of another shape", lambda: _report(g=np.ones((3, 5))), (ValueError, r"g must have the shape .*\(3, 2\)")),
    ("oracle: g with NaN", lambda: _report(g=np.full((3, 2), np.nan)), (ValueError, r"g holds NaN")),
    ("oracle: others missing a parameter", lambda: _report(others={"spconv": {}}),
     (KeyError, r"missing \['0.weight'\]")),
    ("oracle: others of another shape", lambda: _report(others={"spconv": {"0.weight": np.ones((27, 2))}}),
     (ValueError, r"others\['spconv'\]\['0.weight'\] must have the parameter's shape \(27, 2, 2\)")),
    ("oracle: others named as a path", lambda: _report(others={"reference float32": {}}),
     (ValueError, r"must be a name of its own")),
    ("oracle: not a model", lambda: ns.check_gradients(lambda x: x, _x64(), np.ones((3, 2))),
     (TypeError, r"model must be a numba_sc.nn.Module")),
    ("oracle: default paths without a GPU", lambda: _report().paths,
     lambda p: p == ["reference float32"] + (["cuda float32"] if ns.gpu_present() else [])),
]


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge(call, expected):
    check_case(call, expected)
