"""The kernels between the convolutions: BatchNorm, ReLU, add, bias, concatenation,
forward and backward.

Every kernel equals its NumPy reference (under the simulator here), and the
reference equals the formula written out here; the backward references equal
central finite differences of a float64 forward written here.
"""
import numpy as np
import pytest

from numba_sc.nn import pointwise as pw
from numba_sc.core.backend import to_device, to_host

from helpers import host, rel_err, scan_crop


def test_pointwise_worked_example():
    """The module docstring's example, by hand."""
    x = np.array([[3, -1], [-1, 2]], np.float32)
    args = ([1, 2], [0, 1], [1, 0], [4, 1])
    args = [np.array(a, np.float32) for a in args]
    for bk in ("reference", "cuda"):
        y = host(pw.batch_norm(x, *args, eps=0.0, backend=bk))
        np.testing.assert_array_equal(y, [[1, -1], [-1, 5]])
        y = host(pw.batch_norm(x, *args, eps=0.0, relu=True, backend=bk))
        np.testing.assert_array_equal(y, [[1, 0], [0, 5]])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pointwise_kernels_equal_references(rng, dtype):
    """On the features of a real crop, 37 channels (not a power of two: a wrong
    row/channel split shows), every flag combination."""
    x = scan_crop(60)
    n, c = len(x), 37
    a = rng.standard_normal((n, c)).astype(dtype)
    b = rng.standard_normal((n, c)).astype(dtype)
    w, bias, mean = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 2.0, c).astype(np.float32)
    # float32: the same arithmetic but the GPU's fast-math root and division (2 ulp each);
    # half: a rounding apart at most. A wrong channel or row is off by O(1).
    tol = 4e-6 if dtype == np.float32 else 1e-3
    for residual in (None, b):
        for relu in (False, True):
            got = host(pw.batch_norm(a, w, bias, mean, var, 1e-3, residual, relu, backend="cuda"))
            ref = pw.batch_norm_reference(a, w, bias, mean, var, 1e-3, residual, relu)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=tol, atol=tol)
            # the formula, written out (float64)
            want = (a.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + 1e-3) * w + bias
            if residual is not None:
                want = want + residual
            if relu:
                want = np.maximum(want, 0)
            assert rel_err(ref, want) < (1e-6 if dtype == np.float32 else 1e-3)
    np.testing.assert_array_equal(host(pw.relu(a, backend="cuda")), pw.relu_reference(a))
    np.testing.assert_array_equal(pw.relu_reference(a), np.where(a > 0, a, 0).astype(dtype))
    for relu in (False, True):
        np.testing.assert_array_equal(host(pw.add(a, b, relu, backend="cuda")), pw.add_reference(a, b, relu))
    np.testing.assert_array_equal(host(pw.bias_add(a, bias, backend="cuda")), pw.bias_add_reference(a, bias))
    np.testing.assert_allclose(pw.bias_add_reference(a, bias).astype(np.float64), a.astype(np.float64) + bias,
                               rtol=1e-6 if dtype == np.float32 else 1e-3)
    cat = host(pw.concat(a, b[:, :5], backend="cuda"))
    np.testing.assert_array_equal(cat, np.hstack([a, b[:, :5]]))
    np.testing.assert_array_equal(pw.concat_reference(a, b[:, :5]), np.hstack([a, b[:, :5]]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batch_norm_plain_kernel_equals_reference(rng, dtype):
    """The library launches batch_norm_v2 (above); the plain kernel the
    module teaches with must compute the same."""
    from numba_sc.core.launch import launch

    a = rng.standard_normal((30, 13)).astype(dtype)
    r = rng.standard_normal((30, 13)).astype(dtype)
    w, bias, mean = (rng.standard_normal(13).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 2.0, 13).astype(np.float32)
    out = np.zeros_like(a)
    launch(pw.batch_norm_v1, a.size, a, w, bias, mean, var, 1e-3, r, True, True, out)
    want = pw.batch_norm_reference(a, w, bias, mean, var, 1e-3, r, True)
    tol = 1e-6 if dtype == np.float32 else 1e-3
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_pointwise_comparison_catches_a_channel_shift(rng):
    """The comparisons above are exact: statistics read one channel off (an
    off-by-one in the kernel's channel index) would fail them by far."""
    a = rng.standard_normal((20, 7)).astype(np.float32)
    w, bias, mean = (rng.standard_normal(7).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 2.0, 7).astype(np.float32)
    right = pw.batch_norm_reference(a, w, bias, mean, var)
    shifted = pw.batch_norm_reference(a, np.roll(w, 1), np.roll(bias, 1), np.roll(mean, 1), np.roll(var, 1))
    assert rel_err(shifted, right) > 0.1


def test_pointwise_bad_input(rng):
    a = rng.standard_normal((5, 3)).astype(np.float32)
    p = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"running_var must have shape \(3,\)"):
        pw.batch_norm(a, p, p, p, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="same shape"):
        pw.add(a, a[:4])
    with pytest.raises(TypeError, match="float16"):
        pw.add(a, a.astype(np.float16))
    with pytest.raises(ValueError, match="same number of rows"):
        pw.concat(a, a[:2])
    with pytest.raises(TypeError, match="float32 or float16"):
        pw.relu(a.astype(np.int32))
    with pytest.raises(TypeError, match="x are float64, which runs only on backend='reference'"):
        pw.relu(a.astype(np.float64), backend="cuda")


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


def _bn_backward_case(n, c, dtype, relu, seed=5):
    """g, x, y (the forward's output: BatchNorm of x with the batch's statistics, plus a
    residual, then the ReLU when asked) in ``dtype``, and float32 weight, mean, var."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, c)) * 2 + 1).astype(dtype)
    g = rng.standard_normal((n, c)).astype(dtype)
    wt = rng.uniform(0.5, 1.5, c).astype(np.float32)
    b = rng.normal(0, 0.3, c).astype(np.float32)
    m, v = x.astype(np.float64).mean(0).astype(np.float32), x.astype(np.float64).var(0).astype(np.float32)
    r = rng.standard_normal((n, c)).astype(dtype)
    y = pw.batch_norm_reference(x, wt, b, m, v, 1e-5, r, relu)
    return g, x, y, wt, m, v


def _bn_backward_close(got, want, tol):
    """Each of (dx, dweight, dbias) within ``tol`` of the reference, relative to its largest value."""
    return all(np.abs(to_host(a).astype(np.float64) - w).max() <= tol * max(1.0, np.abs(w).max())
               for a, w in zip(got[:3], want[:3]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("relu", [True, False])
def test_batch_norm_backward_v2_equals_reference(dtype, relu):
    """The library's two-kernel backward against the float64 reference (v1: in
    :func:`test_batch_norm_backward_ladder`): 13 channels (a block of the sums kernel
    is 19 rows of 13, 9 threads idle), 150 rows (not a multiple of 19 or of a block:
    the last rows partly filled; several blocks in the test below), training mode; the
    residual's gradient is the masked g exactly. Tolerances as in
    :func:`test_batch_norm_backward` (float32), and one half-precision rounding of the
    result for float16. Once (float16, ReLU): inference mode, 260 channels (two
    channel tiles of the sums kernel)."""
    g, x, y, wt, m, v = _bn_backward_case(150, 13, dtype, relu)
    want = pw.batch_norm_backward_reference(g, x, y, wt, m, v, 1e-5, relu, True)
    tol = 1e-4 if dtype == np.float32 else 2e-3
    got = pw.batch_norm_backward_v2(g, x, y, wt, m, v, 1e-5, relu, True)
    assert to_host(got[0]).dtype == dtype and to_host(got[3]).dtype == dtype
    assert _bn_backward_close(got, want, tol)
    np.testing.assert_array_equal(to_host(got[3]), want[3])
    if dtype == np.float32 or not relu:
        return
    # inference mode (a = b = 0) through the library's entry, wider than a block's 256 channels
    g, x, y, wt, m, v = _bn_backward_case(9, 260, dtype, relu)
    got = pw.batch_norm_backward(g, x, y, wt, m, v, 1e-5, relu, training=False, backend="cuda")
    assert _bn_backward_close(got, pw.batch_norm_backward_reference(g, x, y, wt, m, v, 1e-5, relu, False), tol)


def test_batch_norm_backward_sums_see_every_row_and_channel():
    """Off-by-one catcher for the sums kernel: a gradient that is 1 at a single value
    must give a dbias that is 1 at that channel and 0 elsewhere, exactly (the sums
    start at zero), wherever the value is: the first and last row and channel, and the
    first row of the second block. The same comparison rejects a planted answer that
    drops the last row or shifts the channels by one."""
    n, c = 331, 13
    g, x, y, wt, m, v = _bn_backward_case(n, c, np.float32, False)
    per_block = (pw.SUMS_THREADS // c) * pw.SUMS_ROWS_PER_THREAD
    for i, j in ((0, 0), (n - 1, c - 1), (per_block, 5), (per_block - 1, 12)):
        one = np.zeros((n, c), np.float32)
        one[i, j] = 1
        sums = to_host(pw.batch_norm_backward_sums(one, x, y, m, v, 1e-5, relu=False))
        want = np.zeros(c, np.float32)
        want[j] = 1
        np.testing.assert_array_equal(sums[:c], want, err_msg=f"one at ({i}, {j})")
        assert sums[2 * c] == n
        assert sums[c + j] == pytest.approx((x[i, j] - m[j]) / np.sqrt(v[j] + 1e-5), rel=1e-5)
    want = pw.batch_norm_backward_reference(g, x, y, wt, m, v, 1e-5, False, True)
    assert _bn_backward_close(want, want, 1e-4)
    dropped = pw.batch_norm_backward_reference(g[:-1], x[:-1], y[:-1], wt, m, v, 1e-5, False, True)
    assert not _bn_backward_close((np.vstack([dropped[0], want[0][-1:]]),) + dropped[1:3], want, 1e-4)
    shifted = [np.roll(a, 1, axis=-1) for a in want[:3]]
    assert not _bn_backward_close(shifted, want, 1e-4)


def test_batch_norm_backward_ladder():
    """The backward's ladder declaration: both rungs within its tolerance of its
    reference (relative to the largest value), on a tiny crop."""
    from numba_sc.tools.ladder import Context

    ladder = pw.BACKWARD_LADDER
    assert ladder.names == ("v1", "v2")
    coords = to_host(scan_crop(25).coords)  # (the workload reads only the row count)
    for dtype in ("float32", "float16"):
        work = ladder.workload(Context(coords=coords, channels=13, dtype=dtype))
        want = ladder.reference(work)
        for name in ladder.names:
            got = ladder.result(name, work)
            assert np.abs(got.astype(np.float64) - want).max() <= ladder.tolerance[dtype] * np.abs(want).max()


def test_relu_backward():
    g = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    y = np.array([[0.5, 0.0], [-1.0, 2.0]], np.float32)
    want = np.array([[1.0, 0.0], [0.0, 4.0]], np.float32)
    assert np.array_equal(pw.relu_backward_reference(g, y), want)
    assert np.array_equal(to_host(pw.relu_backward(g, y, backend="cuda")), want)


@pytest.mark.parametrize("n,c,dtype", [(203, 5, np.float32), (40, 260, np.float16)])
def test_training_statistics_in_two_passes(n, c, dtype):
    """Training-mode BatchNorm's statistics from kernel A's two passes equal float64
    NumPy's: the mean, the biased variance (of data far from zero: the second pass sums
    deviations, not squares), the running averages with the unbiased variance. 260
    channels take two channel tiles of the sums kernel."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((n, c)) * 0.5 + 40.0).astype(dtype)
    rm, rv = rng.normal(0, 1, c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    mean, var, new_rm, new_rv = (host(a) for a in pw.batch_statistics_update(to_device(x), rm, rv, 0.25))
    xf = x.astype(np.float64)
    tol = dict(rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(mean, xf.mean(0), **tol)
    np.testing.assert_allclose(var, xf.var(0), rtol=2e-4)  # a variance 1/6400 of the mean's square
    np.testing.assert_allclose(new_rm, 0.75 * rm + 0.25 * xf.mean(0), **tol)
    np.testing.assert_allclose(new_rv, 0.75 * rv + 0.25 * xf.var(0, ddof=1), rtol=2e-4)
