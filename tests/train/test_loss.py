"""Cross-entropy: the reference against calculus, the kernel against the reference.

* the reference's gradient is the derivative of its loss: central finite
  differences in float64, with ignored rows and class weights;
* the kernel (under the simulator here) equals the reference on 257 rows (two
  thread blocks, the second with one row), in float32 and float16, with huge
  logits;
* the worked example of the module docstring, ignore handling, class weights,
  and the errors a user gets; PyTorch's ``cross_entropy`` when it is installed.
"""
import numpy as np
import pytest

from numba_sc.core.backend import to_host
from numba_sc.train.loss import cross_entropy, cross_entropy_reference

BACKENDS = ("reference", "cuda")


def random_case(rng, n=257, c=19, ignored=0.2, scale=3.0, dtype=np.float32):
    logits = (scale * rng.standard_normal((n, c))).astype(dtype)
    target = rng.integers(0, c, n)
    target[rng.random(n) < ignored] = 255
    return logits, target


def formula(logits, target, weight=None, ignore_index=255):
    """The loss and gradient written out row by row, float64, from the definitions."""
    x = np.asarray(logits, np.float64)
    n, c = x.shape
    w = np.ones(c) if weight is None else np.asarray(weight, np.float64)
    num, den, grad = 0.0, 0.0, np.zeros((n, c))
    for i in range(n):
        t = int(target[i])
        if t == ignore_index:
            continue
        m = x[i].max()
        p = np.exp(x[i] - m)
        num += w[t] * (m + np.log(p.sum()) - x[i, t])  # -log softmax, without underflowing to log(0)
        p /= p.sum()
        den += w[t]
        grad[i] = w[t] * (p - np.eye(c)[t])
    return num / den, grad / den


# ------------------------------------------------------------------ examples
@pytest.mark.parametrize("backend", BACKENDS)
def test_docstring_worked_example(backend):
    logits = np.array([[2, 1, 0], [0, 0, 3], [5, 5, 5]], np.float32)
    loss, grad = cross_entropy(logits, np.array([0, 1, 255]), backend=backend)
    assert loss == pytest.approx(1.751, abs=1e-3)
    np.testing.assert_allclose(grad, [[-0.167, 0.122, 0.045], [0.023, -0.477, 0.455], [0, 0, 0]], atol=1e-3)
    assert grad.dtype == np.float32 and isinstance(loss, float)


# ------------------------------------------------------------------ reference
@pytest.mark.parametrize("weighted", [False, True])
def test_reference_gradient_is_the_derivative(rng, weighted):
    """Central differences of the float64 reference, every logit of a small case."""
    n, c = 7, 5
    x = rng.standard_normal((n, c)) * 2
    t = np.array([0, 4, 255, 2, 2, 255, 1])
    w = rng.uniform(0.2, 3.0, c) if weighted else None
    loss, grad = cross_entropy_reference(x, t, weight=w)
    assert grad.dtype == np.float64
    h = 1e-6
    fd = np.zeros_like(x)
    for i in range(n):
        for j in range(c):
            xp, xm = x.copy(), x.copy()
            xp[i, j] += h
            xm[i, j] -= h
            fd[i, j] = (cross_entropy_reference(xp, t, weight=w)[0] - cross_entropy_reference(xm, t, weight=w)[0]) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    want_loss, want_grad = formula(x, t, w)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert (grad[t == 255] == 0).all()
    np.testing.assert_allclose(grad.sum(axis=1), 0, atol=1e-15)  # each row sums to zero


# ------------------------------------------------------------------ kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_equals_reference(rng, dtype, weighted):
    logits, target = random_case(rng, dtype=dtype)
    weight = rng.uniform(0.1, 4.0, 19).astype(np.float32) if weighted else None
    loss_k, grad_k = cross_entropy(logits, target, weight=weight, backend="cuda")
    loss_r, grad_r = cross_entropy(logits, target, weight=weight, backend="reference")
    assert grad_k.dtype == grad_r.dtype == dtype and grad_k.shape == logits.shape
    assert loss_k == pytest.approx(loss_r, rel=1e-6)
    # float32: a few roundings of exp/log apart; float16: one rounding of the stored value apart
    np.testing.assert_allclose(grad_k.astype(np.float64), grad_r.astype(np.float64),
                               rtol=1e-5 if dtype == np.float32 else 1e-3, atol=1e-8)
    want_loss, want_grad = formula(logits, target, weight)
    assert loss_k == pytest.approx(want_loss, rel=1e-5)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(grad_k.astype(np.float64), want_grad, rtol=tol, atol=tol / len(target))


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_stay_finite(backend):
    """exp(1000) overflows; after subtracting the row maximum nothing does."""
    logits = np.array([[1000, 0, -1000], [500, 520, 510], [-80, -80, -80], [0, 0, 1000]], np.float32)
    target = np.array([0, 0, 2, 0])
    loss, grad = cross_entropy(logits, target, backend=backend)
    want_loss, want_grad = formula(logits, target)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert loss == pytest.approx(want_loss, rel=1e-6)  # (0 + 20 + log(1 + e^-10 + e^-20) + log 3 + 1000) / 4
    np.testing.assert_allclose(grad, want_grad, atol=1e-7)


# ------------------------------------------------------------------ ignore, weights
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_rows(rng, backend):
    logits, target = random_case(rng, n=120, c=6, ignored=0.4)
    loss, grad = cross_entropy(logits, target, backend=backend)
    keep = target != 255
    loss_kept, grad_kept = cross_entropy(logits[keep], target[keep], backend=backend)
    assert loss == pytest.approx(loss_kept, rel=1e-6)
    np.testing.assert_array_equal(grad[~keep], 0)
    np.testing.assert_allclose(grad[keep], grad_kept, rtol=1e-6, atol=1e-9)
    # another ignore index, which may also be a class id (that class is then ignored)
    t2 = np.where(keep, target, -100)
    assert cross_entropy(logits, t2, ignore_index=-100, backend=backend)[0] == pytest.approx(loss, rel=1e-6)
    t3 = np.where(keep, target, 3)
    l3, g3 = cross_entropy(logits, t3, ignore_index=3, backend=backend)
    assert l3 == pytest.approx(cross_entropy(logits[t3 != 3], t3[t3 != 3], backend=backend)[0], rel=1e-6)
    assert (g3[t3 == 3] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weights(rng, backend):
    logits, target = random_case(rng, n=100, c=4, ignored=0.1)
    unweighted = cross_entropy(logits, target, backend=backend)
    ones = cross_entropy(logits, target, weight=np.ones(4, np.float32), backend=backend)
    assert ones[0] == pytest.approx(unweighted[0], rel=1e-6)
    np.testing.assert_allclose(ones[1], unweighted[1], rtol=1e-6)
    w = np.array([0.5, 2.0, 0.0, 1.0], np.float32)
    loss, grad = cross_entropy(logits, target, weight=w, backend=backend)
    want_loss, want_grad = formula(logits, target, w)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert (grad[target == 2] == 0).all()  # weight 0: the class does not count
    # a weighted mean: scaling every weight changes nothing
    loss3, grad3 = cross_entropy(logits, target, weight=3 * w, backend=backend)
    assert loss3 == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(grad3, grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_dtypes(rng, backend):
    logits, target = random_case(rng, n=40, c=5)
    want = cross_entropy(logits, target, backend=backend)
    for dt in (np.uint8, np.int32, np.int16):
        got = cross_entropy(logits, target.astype(dt), backend=backend)
        assert got[0] == pytest.approx(want[0], rel=1e-7)
        np.testing.assert_array_equal(got[1], want[1])


def test_float16_logits_close_to_float32(rng):
    logits, target = random_case(rng, n=200, c=19)
    half = logits.astype(np.float16)
    l16, g16 = cross_entropy(half, target, backend="cuda")
    l32, g32 = cross_entropy(half.astype(np.float32), target, backend="cuda")
    assert g16.dtype == np.float16
    assert l16 == pytest.approx(l32, rel=1e-6)  # the same float32 arithmetic on the same values
    np.testing.assert_allclose(g16.astype(np.float32), g32, rtol=1e-3, atol=1e-7)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("backend", BACKENDS)
def test_errors(backend):
    x = np.zeros((4, 3), np.float32)
    t = np.array([0, 1, 2, 255])
    with pytest.raises(ValueError, match=r"logits must have shape \(N, C\)"):
        cross_entropy(x[0], t, backend=backend)
    with pytest.raises(TypeError, match="logits must be float32 or float16"):
        cross_entropy(x.astype(np.int32), t, backend=backend)
    if backend == "cuda":  # float64 is the oracle's, on the reference backend only
        with pytest.raises(TypeError, match="logits are float64, which runs only on backend='reference'"):
            cross_entropy(x.astype(np.float64), t, backend=backend)
    with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
        cross_entropy(x, t[:3], backend=backend)
    with pytest.raises(TypeError, match="target must be an integer array"):
        cross_entropy(x, t.astype(np.float32), backend=backend)
    with pytest.raises(ValueError, match=r"target has values \[-1, 3, 7\] \(4 rows\).*\[0, 3\)"):
        cross_entropy(np.zeros((5, 3), np.float32), np.array([3, 7, -1, 3, 0]), backend=backend)
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(FloatingPointError, match=r"NaN or inf in 1 rows \(the first: row 2\)"):
        cross_entropy(bad, t, backend=backend)
    bad[2, 1] = np.inf
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        cross_entropy(bad, t, backend=backend)
    with pytest.raises(ValueError, match="every row of target is ignore_index=255"):
        cross_entropy(x, np.full(4, 255), backend=backend)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        cross_entropy(x, t, weight=np.ones(4, np.float32), backend=backend)
    with pytest.raises(ValueError, match="weight must be finite and >= 0"):
        cross_entropy(x, t, weight=np.array([1, -1, 1], np.float32), backend=backend)
    with pytest.raises(ValueError, match="sum to 0"):
        cross_entropy(x, t, weight=np.array([0, 0, 0], np.float32), backend=backend)
    with pytest.raises(TypeError, match="ignore_index must be an integer"):
        cross_entropy(x, t, ignore_index=255.0, backend=backend)


# ------------------------------------------------------------------ PyTorch
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_torch(rng, weighted):
    torch = pytest.importorskip("torch")
    logits, target = random_case(rng, n=150, c=19)
    weight = rng.uniform(0.1, 4.0, 19).astype(np.float32) if weighted else None
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(x, torch.from_numpy(target), ignore_index=255,
                                           weight=None if weight is None else torch.from_numpy(weight).double())
    tl.backward()
    for backend in BACKENDS:
        loss, grad = cross_entropy(logits, target, weight=weight, backend=backend)
        assert loss == pytest.approx(tl.item(), rel=1e-6)
        np.testing.assert_allclose(to_host(grad), x.grad.numpy(), rtol=1e-5, atol=1e-9)
