"""The backward pass: each reference against central finite differences of a float64
forward written here (not the library's), each kernel against its reference (under the
simulator here; on the GPU with NUMBA_ENABLE_CUDASIM=0), the tape through whole networks,
and a few training steps on a crop. Every comparison is shown to catch an off-by-one."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc import models, nn
from numba_sc.train import optim
from numba_sc import train
from numba_sc.nn import pointwise as pw
from numba_sc.core.backend import to_host
from numba_sc.train.conv_gradient import sparse_conv3d_backward, sparse_conv3d_backward_reference
from numba_sc.train.labels import load_semantickitti_labels
from numba_sc.train.loss import cross_entropy

from conftest import DATA_DIR, crop, load_scan


@pytest.fixture(scope="module")
def coords():
    pts = crop(load_scan("semantickitti"), 260, seed=5)
    return ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords


def _layer(coords, kind, c_in=3, c_out=5, seed=0):
    """(x, weight, kernel_map, transposed, y) of one layer of each kind, on the crop."""
    rng = np.random.default_rng(seed)
    x = ns.SparseTensor(coords, rng.standard_normal((len(coords), c_in)).astype(np.float32))
    if kind == "subm":
        w = rng.standard_normal((27, c_in, c_out)).astype(np.float32)
        y = ns.sparse_conv3d(x, w, 3, backend="reference")
        return x, w, y.kernel_map, False, y
    down = ns.sparse_conv3d(x, rng.standard_normal((8, c_in, c_out)).astype(np.float32), 2, stride=2,
                            backend="reference")
    if kind == "strided":
        w = rng.standard_normal((8, c_in, c_out)).astype(np.float32)
        return x, w, down.kernel_map, False, ns.sparse_conv3d(x, w, kernel_map=down.kernel_map, backend="reference")
    xc = down.with_features(rng.standard_normal((len(down), c_out)).astype(np.float32))
    w = rng.standard_normal((8, c_out, c_in)).astype(np.float32)
    y = ns.sparse_conv3d(xc, w, transposed=True, kernel_map=down.kernel_map, backend="reference")
    return xc, w, down.kernel_map, True, y


def _oracle(features, weight, kernel_map, transposed):
    """float64 forward, offset by offset from the map's table (not the library's code)."""
    table = np.asarray(to_host(kernel_map.table))
    n_out = table.shape[1] if not transposed else len(kernel_map.in_coords)
    y = np.zeros((n_out, weight.shape[2]))
    for k in range(table.shape[0]):
        i = np.flatnonzero(table[k] >= 0)
        j = table[k, i]
        if transposed:
            np.add.at(y, j, features[i] @ weight[k])
        else:
            y[i] += features[j] @ weight[k]
    return y


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
def test_conv_reference_equals_finite_differences(coords, kind):
    x, w, km, tr, y = _layer(coords, kind)
    f64, w64 = x.features.astype(np.float64), w.astype(np.float64)
    assert np.allclose(_oracle(f64, w64, km, tr), y.features, atol=1e-4)  # the oracle is the layer
    rng = np.random.default_rng(1)
    g = rng.standard_normal(y.features.shape)
    dx, dw = sparse_conv3d_backward_reference(f64, w64, g, km, tr)

    def loss(f, ww):
        return float((_oracle(f, ww, km, tr) * g).sum())

    h = 1e-6
    for _ in range(6):
        j, c = rng.integers(len(f64)), rng.integers(f64.shape[1])
        e = np.zeros_like(f64)
        e[j, c] = h
        assert abs((loss(f64 + e, w64) - loss(f64 - e, w64)) / (2 * h) - dx[j, c]) < 1e-6 * max(1, abs(dx[j, c]))
        k, a, b = (rng.integers(s) for s in w64.shape)
        e = np.zeros_like(w64)
        e[k, a, b] = h
        assert abs((loss(f64, w64 + e) - loss(f64, w64 - e)) / (2 * h) - dw[k, a, b]) < 1e-6 * max(1, abs(dw[k, a, b]))


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
def test_conv_backward_kernels_equal_the_reference(coords, kind):
    """The kernels (dgrad through the transposed plan, wgrad by grouped GEMMs over the
    forward's buffer rows) against the reference; a pair read through the wrong offset
    (the weights shifted by one) must show."""
    x, w, km, tr, y = _layer(coords, kind)
    g = np.random.default_rng(2).standard_normal(y.features.shape).astype(np.float32)
    want_dx, want_dw = sparse_conv3d_backward(x, w, g, km, tr, backend="reference")
    dx, dw = sparse_conv3d_backward(x, w, g, km, tr, backend="cuda")
    dx, dw = to_host(dx), to_host(dw)
    assert dx.dtype == np.float32 and dw.shape == w.shape
    tol = 2e-5 * max(1.0, np.abs(want_dx).max())
    assert np.abs(dx - want_dx).max() < tol
    assert np.abs(dw - want_dw).max() < 2e-5 * max(1.0, np.abs(want_dw).max())
    off_dx, off_dw = sparse_conv3d_backward(x, np.roll(w, 1, axis=0), g, km, tr, backend="reference")
    assert np.abs(off_dx - want_dx).max() > 100 * tol
    # the identity of a bilinear map: <y, g> = <x, dx> = <W, dW>
    yg = float((y.features.astype(np.float64) * g).sum())
    assert np.isclose(yg, float((x.features * dx).sum()), rtol=1e-4)
    assert np.isclose(yg, float((w * dw).sum()), rtol=1e-4)


def test_conv_backward_errors(coords):
    x, w, km, tr, y = _layer(coords, "subm")
    g = np.zeros(y.features.shape, np.float32)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        sparse_conv3d_backward(x, w, g[:-1], km)
    with pytest.raises(TypeError, match="grad_out is float64"):
        sparse_conv3d_backward(x, w, g.astype(np.float64), km)
    with pytest.raises(ValueError, match="weight must have shape"):
        sparse_conv3d_backward(x, w[:, :2], g, km)
    with pytest.raises(ValueError, match="input_buffer must be"):
        sparse_conv3d_backward(x, w, g, km, backend="cuda", input_buffer=np.zeros((3, 3), np.float32))
    other = ns.SparseTensor(coords[:-1], x.features[:-1])
    with pytest.raises(ValueError, match="does not fit x"):
        sparse_conv3d_backward(other, w, g, km)


@pytest.mark.parametrize("training,relu,residual", [(True, True, True), (True, False, False), (False, True, False)])
def test_batch_norm_backward(training, relu, residual):
    rng = np.random.default_rng(3)
    n, c = 40, 6
    x = rng.standard_normal((n, c)) * 2 + 1
    r = rng.standard_normal((n, c)) if residual else None
    wt, b = rng.uniform(0.5, 1.5, c), rng.normal(0, 0.3, c)
    rm, rv = rng.normal(0, 0.5, c), rng.uniform(0.5, 2, c)
    g = rng.standard_normal((n, c))

    def fwd(x, wt, b, r):  # float64 forward written here
        m, v = (x.mean(0), x.var(0)) if training else (rm, rv)
        y = (x - m) / np.sqrt(v + 1e-5) * wt + b
        if r is not None:
            y = y + r
        return np.maximum(y, 0) if relu else y

    y = fwd(x, wt, b, r)
    m, v = (x.mean(0), x.var(0)) if training else (rm, rv)
    dx, dwt, db, dres = pw.batch_norm_backward_reference(g, x, y, wt, m, v, 1e-5, relu, training)
    h = 1e-6
    for arr, grad in ((x, dx), (wt, dwt), (b, db)) + (((r, dres),) if residual else ()):
        for _ in range(4):
            idx = tuple(rng.integers(s) for s in arr.shape)
            old = arr[idx]
            arr[idx] = old + h
            up = (fwd(x, wt, b, r) * g).sum()
            arr[idx] = old - h
            down = (fwd(x, wt, b, r) * g).sum()
            arr[idx] = old
            assert abs((up - down) / (2 * h) - grad[idx]) < 1e-5 * max(1, abs(grad[idx]))
    # the kernel (float32) against the reference
    f32 = np.float32
    got = pw.batch_norm_backward(g.astype(f32), x.astype(f32), y.astype(f32), wt.astype(f32), m.astype(f32),
                                 v.astype(f32), 1e-5, relu, training, backend="cuda")
    for a, want in zip(got, (dx, dwt, db, dres)):
        assert np.abs(to_host(a) - want).max() < 1e-4 * max(1, np.abs(want).max())
    wrong = pw.batch_norm_backward_reference(g, x, y, wt, m, v, 1e-5, relu, not training)[0]
    assert np.abs(wrong - dx).max() > 1e-3 or not training


def test_relu_backward():
    g = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    y = np.array([[0.5, 0.0], [-1.0, 2.0]], np.float32)
    want = np.array([[1.0, 0.0], [0.0, 4.0]], np.float32)
    assert np.array_equal(pw.relu_backward_reference(g, y), want)
    assert np.array_equal(to_host(pw.relu_backward(g, y, backend="cuda")), want)


class _Small(nn.Module):
    """Every kind of layer and both joins, on a few hundred voxels."""

    def __init__(self, rng):
        super().__init__()
        self.stem = nn.Sequential(nn.SubMConv3d(4, 6, 3, rng=rng), nn.BatchNorm(6), nn.ReLU())
        self.down = nn.SparseConv3d(6, 8, 2, stride=2, rng=rng)
        self.bn = nn.BatchNorm(8)
        self.up = nn.SparseInverseConv3d(8, 6, 2, inverts=self.down, rng=rng)
        self.short = nn.SubMConv3d(6, 6, 1, rng=rng)
        self.head = nn.Linear(12, 3, rng=rng)

    def forward(self, x):
        a = self.stem(x)
        b = self.up(self.bn(self.down(a), relu=True))
        s = nn.add(b, self.short(a), relu=True)
        return self.head(nn.cat(s, a))


def test_tape_through_a_network_kernels_reference_and_finite_differences(coords):
    """The tape's gradients: kernels == reference for every parameter and the input;
    the reference against a central difference of the loss along a random direction."""
    rng = np.random.default_rng(4)
    net = _Small(rng)
    net.train()
    x = ns.SparseTensor(coords, rng.standard_normal((len(coords), 4)).astype(np.float32))
    target = rng.integers(0, 3, len(coords))
    got = {}
    for bk in ("reference", "cuda"):
        with nn.Tape() as tape:
            y = net(x, backend=bk)
        loss, g = cross_entropy(y.features, target, backend=bk)
        got[bk] = (tape.backward(y, g), tape.grad(x))
    params = dict(net.trainable_parameters())
    assert set(got["reference"][0]) == set(params)
    for name, want in got["reference"][0].items():
        assert np.abs(to_host(got["cuda"][0][name]) - want).max() <= 1e-4 * max(1e-3, np.abs(want).max()), name
    assert np.abs(to_host(got["cuda"][1]) - got["reference"][1]).max() < 1e-5

    grads, _ = got["reference"]
    direction = {k: np.random.default_rng(5).standard_normal(p.shape).astype(np.float32) for k, p in params.items()}
    slope = sum(float((direction[k] * grads[k]).sum()) for k in params)
    saved = {k: p.copy() for k, p in params.items()}

    def loss_at(t):
        for k, p in params.items():
            p[...] = saved[k] + t * direction[k]
        return cross_entropy(net(x, backend="reference").features, target, backend="reference")[0]

    # float32 forward: h small enough to cross few ReLU kinks, large enough for float32
    h = 3e-4
    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    loss_at(0.0)
    assert abs(numeric - slope) < 0.02 * abs(slope), (numeric, slope)
    wrong = slope - float((direction["down.weight"] * grads["down.weight"]).sum())  # one layer's part lost
    assert abs(numeric - wrong) > 0.02 * abs(slope)


def test_a_few_training_steps_lower_the_loss():
    """The CI half of the training demonstration: MinkUNet42, narrow, on a crop of the
    labelled scan under the reference backend."""
    points = load_scan("semantickitti")
    raw = load_semantickitti_labels(DATA_DIR / "semantickitti_000000.label")
    keep = np.argsort(np.abs(points[:, :3] - points[100, :3]).max(axis=1), kind="stable")[:500]
    x, target, inverse, point_target = train.scan_tensor(points[keep], raw[keep], 0.05, backend="reference")
    net = models.MinkUNet42(4, 19, width=0.25, seed=0)
    opt = optim.AdamW(net.trainable_parameters(), lr=3e-3, weight_decay=0.0)
    losses = [train.train_step(net, x, target, opt, backend="reference") for _ in range(8)]
    assert losses[-1] < 0.6 * losses[0], losses
    acc, miou = train.scores(net, x, inverse, point_target, backend="reference")
    assert 0.0 <= miou <= acc <= 1.0


def test_tape_errors(coords):
    net = nn.Sequential(nn.SubMConv3d(4, 2, 3))
    x = ns.SparseTensor(coords, np.ones((len(coords), 4), np.float32))
    y = net(x, backend="reference")  # no tape open
    with nn.Tape() as tape:
        net(x, backend="reference")
    with pytest.raises(ValueError, match="not made by a layer"):
        tape.backward(y, np.ones_like(y.features))
    with pytest.raises(ValueError, match="shape"):
        tape.backward(y, np.ones((3, 2), np.float32))
    with nn.Tape() as tape:
        y = net(x, backend="reference")
    with pytest.raises(TypeError, match="grad is float64"):
        tape.backward(y, np.ones(y.features.shape))


def test_train_command(tmp_path, capsys):
    """``python -m numba_sc train`` on a crop with the references: short runs included
    (the warm-up of the schedule fits in them), the curve written, bad --steps refused."""
    from numba_sc.__main__ import main

    load_scan("semantickitti")  # skips without the data
    out = tmp_path / "curve.json"
    assert main(["train", "--steps", "3", "--crop", "150", "--log-every", "1", "--out", str(out)]) == 0
    import json

    rec = json.loads(out.read_text())
    assert [h["step"] for h in rec["history"]] == [0, 1, 2] and rec["points"] == 150
    assert main(["train", "--steps", "0"]) == 2
