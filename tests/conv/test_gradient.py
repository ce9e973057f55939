"""The convolution's backward pass: the reference against central finite differences of
a float64 forward written here (not the library's), the kernels against the reference
(under the simulator here; on the GPU with NUMBA_ENABLE_CUDASIM=0), and its errors. Every
comparison is shown to catch an off-by-one. The pointwise kernels' backward is in
test_pointwise.py, the tape through whole networks in test_tape.py, a few training
steps in test_loop.py; the crop they share is conftest's ``coords``."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.core.backend import to_host
from numba_sc.conv.gradient import sparse_conv3d_backward, sparse_conv3d_backward_reference


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


