"""Optimizers: SGD and AdamW against the PyTorch update rules written out here in float64.

The oracles below are written from PyTorch's documented algorithms (the
pseudo-code of ``torch.optim.SGD`` and ``torch.optim.AdamW``), step by step,
in float64 and with nothing of ``numba_sc.train.optim``. The optimizer must follow
them over several steps, with momentum, Nesterov, weight decay and Adam's bias
correction, to float32 rounding; a test also shows that the tolerance is tight
enough to catch a bias correction off by one step. If PyTorch is installed the
same runs are compared with ``torch.optim`` itself.
"""
import itertools
import math

import numpy as np
import pytest

from numba_sc.train.optim import SGD, AdamW, cosine_lr


# ------------------------------------------------------------------ oracles
def sgd_oracle(w0, grads, lrs, momentum=0.0, weight_decay=0.0, nesterov=False):
    """The weights after each step, float64."""
    w, b, out = np.array(w0, np.float64), None, []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = np.array(g, np.float64)
        if weight_decay != 0:
            g = g + weight_decay * w
        if momentum != 0:
            b = g.copy() if t == 1 else momentum * b + g
            g = g + momentum * b if nesterov else b
        w = w - lr * g
        out.append(w)
    return out


def adamw_oracle(w0, grads, lrs, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, step_offset=0):
    """The weights after each step, float64. ``step_offset`` shifts the step count
    of the bias correction (0 is right; the test shows +-1 is caught)."""
    b1, b2 = betas
    w = np.array(w0, np.float64)
    m, v, out = np.zeros_like(w), np.zeros_like(w), []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = np.array(g, np.float64)
        w = w * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        tc = t + step_offset
        m_hat = m / (1 - b1 ** tc)
        v_hat = v / (1 - b2 ** tc)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
        out.append(w)
    return out


SHAPES = {"conv.weight": (27, 4, 8), "bn.bias": (8,), "head.weight": (8, 19)}


def make_run(rng, steps, dtype=np.float32, scale=1.0):
    """Initial parameters and a list of gradient dicts, drawn at random."""
    params = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    grads = [{n: (scale * rng.standard_normal(s)).astype(dtype) for n, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def run(opt, grads, lrs=None):
    """Step ``opt`` through ``grads``; the float64 copies of its parameters after each step."""
    history = []
    for k, g in enumerate(grads):
        if lrs is not None:
            opt.lr = lrs[k]
        opt.step(g)
        history.append({n: p.astype(np.float64) for n, p in opt.params.items()})
    return history


def assert_follows(history, oracle_by_name, rtol=2e-5, atol=2e-6):
    for k, got in enumerate(history):
        for name, want in oracle_by_name.items():
            np.testing.assert_allclose(got[name], want[k], rtol=rtol, atol=atol, err_msg=f"{name}, step {k + 1}")


# --------------------------------------------------------------- worked examples
def test_docstring_worked_examples():
    w = np.array([1.0], np.float32)
    opt = SGD({"w": w}, lr=0.1, momentum=0.9)
    opt.step({"w": np.array([0.5], np.float32)})
    np.testing.assert_allclose(w, [0.95], rtol=1e-6)
    opt.step({"w": np.array([0.5], np.float32)})
    np.testing.assert_allclose(w, [0.855], rtol=1e-6)

    # Adam's first step is lr times the gradient's sign, whatever its size
    for g in (0.5, 1e-3, -40.0):
        w = np.array([1.0], np.float32)
        AdamW({"w": w}, lr=0.1, eps=0.0, weight_decay=0.0).step({"w": np.array([g], np.float32)})
        np.testing.assert_allclose(w, [1.0 - 0.1 * np.sign(g)], rtol=1e-6)


# ------------------------------------------------------------------ SGD
@pytest.mark.parametrize("momentum,weight_decay,nesterov", [
    (0.0, 0.0, False), (0.0, 0.05, False), (0.9, 0.0, False), (0.9, 0.05, False), (0.8, 0.05, True)])
def test_sgd_follows_pytorch_rule(rng, momentum, weight_decay, nesterov):
    params, grads = make_run(rng, 6)
    w0 = {n: p.copy() for n, p in params.items()}
    lrs = [0.1, 0.1, 0.05, 0.2, 0.01, 0.1]  # changed between steps through opt.lr
    opt = SGD(list(params.items()), lr=lrs[0], momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    history = run(opt, grads, lrs)
    assert_follows(history, {n: sgd_oracle(w0[n], [g[n] for g in grads], lrs, momentum, weight_decay, nesterov)
                             for n in SHAPES})


def test_sgd_nesterov_and_momentum_differ(rng):
    """The configurations are not accidentally the same rule (each oracle is distinct)."""
    params, grads = make_run(rng, 3)
    runs = []
    for kw in ({}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}):
        p = {n: a.copy() for n, a in params.items()}
        runs.append(run(SGD(p, lr=0.1, **kw), grads)[-1]["head.weight"])
    assert min(np.abs(runs[i] - runs[j]).max() for i in range(3) for j in range(i)) > 1e-2


# ------------------------------------------------------------------ AdamW
@pytest.mark.parametrize("betas,eps,weight_decay", [
    ((0.9, 0.999), 1e-8, 1e-2), ((0.9, 0.999), 1e-8, 0.0), ((0.8, 0.99), 1e-3, 0.1), ((0.0, 0.5), 1e-6, 0.0)])
def test_adamw_follows_pytorch_rule(rng, betas, eps, weight_decay):
    params, grads = make_run(rng, 7)
    w0 = {n: p.copy() for n, p in params.items()}
    lrs = [1e-2, 1e-2, 5e-3, 2e-2, 1e-3, 1e-2, 1e-2]
    opt = AdamW(params, lr=lrs[0], betas=betas, eps=eps, weight_decay=weight_decay)
    history = run(opt, grads, lrs)
    assert_follows(history, {n: adamw_oracle(w0[n], [g[n] for g in grads], lrs, betas, eps, weight_decay)
                             for n in SHAPES})
    assert all(s["step"] == 7 for s in opt.state.values())


def test_adamw_bias_correction_off_by_one_is_caught(rng):
    """The comparison above can fail: a bias correction one step ahead (t + 1)
    moves the weights far beyond its tolerance, at every one of the steps."""
    params, grads = make_run(rng, 5)
    w0 = params["head.weight"].copy()
    lrs = [1e-2] * 5
    history = run(AdamW(params, lr=1e-2), grads)
    right = adamw_oracle(w0, [g["head.weight"] for g in grads], lrs)
    wrong = adamw_oracle(w0, [g["head.weight"] for g in grads], lrs, step_offset=1)
    for k in range(5):
        np.testing.assert_allclose(history[k]["head.weight"], right[k], rtol=2e-5, atol=2e-6)
        assert not np.allclose(history[k]["head.weight"], wrong[k], rtol=2e-5, atol=2e-6), k
    # and a bias correction computed from step 0 (t - 1) is not even finite at step 1
    with np.errstate(divide="ignore", invalid="ignore"):
        assert not np.isfinite(adamw_oracle(w0, [grads[0]["head.weight"]], lrs[:1], step_offset=-1)[0]).all()


def test_adamw_weight_decay_is_decoupled():
    """With zero gradients Adam's term is 0 / (0 + eps) = 0, so only the decay acts:
    w * (1 - lr * wd) per step. Coupled (L2 through the gradient) it would instead
    take Adam's normalized step of size ~lr."""
    w = np.full(4, 2.0, np.float32)
    opt = AdamW({"w": w}, lr=0.1, weight_decay=0.5)
    for _ in range(3):
        opt.step({"w": np.zeros(4, np.float32)})
    np.testing.assert_allclose(w, 2.0 * (1 - 0.05) ** 3, rtol=1e-6)


# ------------------------------------------------------------- in place, dtypes
@pytest.mark.parametrize("make", [
    lambda: SGD, lambda: (lambda p, lr: SGD(p, lr, momentum=0.9, weight_decay=0.1, nesterov=True)),
    lambda: AdamW])
def test_updates_in_place_and_leaves_gradients_alone(rng, make):
    class Layer:  # holds its arrays, as numba_sc.nn layers do
        def __init__(self):
            self.weight = rng.standard_normal((3, 5)).astype(np.float32)
            self.bias = np.zeros(5, np.float32)

    layer = Layer()
    weight, bias = layer.weight, layer.bias
    before = weight.copy()
    opt = make()([("weight", layer.weight), ("bias", layer.bias)], 0.1)
    for _ in range(2):
        grads = {"weight": rng.standard_normal((3, 5)).astype(np.float32), "bias": np.ones(5, np.float32)}
        kept = {n: g.copy() for n, g in grads.items()}
        opt.step(grads)
        for n, g in grads.items():
            np.testing.assert_array_equal(g, kept[n])  # the caller's gradients are not modified
    assert layer.weight is weight and layer.bias is bias
    assert not np.array_equal(layer.weight, before) and (layer.bias < 0).all()


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_float16_parameters_use_float32_master_weights(rng, cls):
    params, grads = make_run(rng, 5, np.float16, scale=0.5)
    w0 = {n: p.astype(np.float64) for n, p in params.items()}
    opt = cls(params, lr=0.01, **({"momentum": 0.9} if cls is SGD else {}))
    run(opt, grads)
    for name, p in params.items():
        assert p.dtype == np.float16
        state = opt.state[name]
        assert state["master"].dtype == np.float32
        assert all(v.dtype == np.float32 for k, v in state.items() if k != "step")
        np.testing.assert_array_equal(p, state["master"].astype(np.float16))  # written back, rounded
        gs = [g[name] for g in grads]
        want = (sgd_oracle(w0[name], gs, [0.01] * 5, 0.9) if cls is SGD
                else adamw_oracle(w0[name], gs, [0.01] * 5))[-1]
        np.testing.assert_allclose(state["master"], want, rtol=1e-5, atol=1e-6)


def test_float16_small_updates_accumulate():
    """100 updates of 1e-4 each: on 1.0 in float16 (spacing ~1e-3) each alone would
    round away; through the fp32 master copy they add up to 0.99."""
    w = np.ones(3, np.float16)
    opt = SGD({"w": w}, lr=1e-4)
    for _ in range(100):
        opt.step({"w": np.ones(3, np.float16)})
    np.testing.assert_array_equal(w, np.float16(0.99))
    assert (np.float16(1.0) - np.float16(1e-4)) == np.float16(1.0)  # what a direct update would do


def test_float16_master_copy_follows_outside_changes():
    w = np.ones(2, np.float16)
    opt = SGD({"w": w}, lr=0.5)
    opt.step({"w": np.ones(2, np.float16)})
    assert (w == 0.5).all()
    w[...] = 4.0  # e.g. a checkpoint loaded into the model
    opt.step({"w": np.ones(2, np.float16)})
    np.testing.assert_array_equal(w, [3.5, 3.5])


def test_float64_parameters_keep_float64_state(rng):
    params, grads = make_run(rng, 4, np.float64)
    w0 = {n: p.copy() for n, p in params.items()}
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    history = run(opt, grads)
    assert opt.state["bn.bias"]["exp_avg"].dtype == np.float64 and "master" not in opt.state["bn.bias"]
    assert_follows(history, {n: adamw_oracle(w0[n], [g[n] for g in grads], [1e-2] * 4, weight_decay=0.1)
                             for n in SHAPES}, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ state
@pytest.mark.parametrize("cls,kw", [(SGD, {"momentum": 0.9, "nesterov": True}), (AdamW, {"weight_decay": 0.1}),
                                    (SGD, {"momentum": 0.9})])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_state_dict_round_trip_resumes_exactly(rng, cls, kw, dtype):
    params, grads = make_run(rng, 5, dtype)
    a = cls(params, lr=0.05, **kw)
    run(a, grads[:3])
    saved = a.state_dict()
    assert saved["optimizer"] == cls.__name__ and saved["hyperparameters"]["lr"] == 0.05
    assert all(isinstance(v, np.ndarray) for s in saved["state"].values() for k, v in s.items() if k != "step")
    copy = {n: p.copy() for n, p in params.items()}
    b = cls(copy, lr=1.0)  # other settings, replaced by the load
    b.load_state_dict(saved)
    assert b.lr == 0.05 and b.hyperparameters() == a.hyperparameters()
    run(a, grads[3:])
    run(b, grads[3:])
    for n in SHAPES:
        np.testing.assert_array_equal(copy[n], params[n])
    # the saved state is a copy: stepping did not change it
    assert saved["state"]["bn.bias"]["step"] == 3


def test_load_state_dict_errors(rng):
    params, grads = make_run(rng, 1)
    sgd = SGD(params, lr=0.1, momentum=0.9)
    sgd.step(grads[0])
    with pytest.raises(ValueError, match="SGD optimizer, not a AdamW"):
        AdamW(params).load_state_dict(sgd.state_dict())
    fewer = SGD({n: p for n, p in params.items() if n != "bn.bias"}, lr=0.1)
    with pytest.raises(KeyError, match="bn.bias"):
        fewer.load_state_dict(sgd.state_dict())
    bad = sgd.state_dict()
    bad["state"]["bn.bias"]["momentum_buffer"] = np.zeros(3)
    with pytest.raises(ValueError, match="momentum_buffer.*bn.bias"):
        SGD(params, lr=0.1).load_state_dict(bad)


# ------------------------------------------------------------------ errors
def test_step_errors_name_the_parameter(rng):
    params, grads = make_run(rng, 1)
    g = grads[0]
    opt = AdamW(params)
    with pytest.raises(KeyError, match="bn.bias.*leave it out"):
        opt.step({n: v for n, v in g.items() if n != "bn.bias"})
    with pytest.raises(KeyError, match="conv.wieght"):
        opt.step({**g, "conv.wieght": g["conv.weight"]})
    with pytest.raises(ValueError, match=r"head.weight.*shape \(19, 8\).*\(8, 19\)"):
        opt.step({**g, "head.weight": g["head.weight"].T.copy()})
    with pytest.raises(TypeError, match="bn.bias.*float16.*float32"):
        opt.step({**g, "bn.bias": g["bn.bias"].astype(np.float16)})
    with pytest.raises(TypeError, match="dict"):
        opt.step(list(g.values()))
    with pytest.raises(TypeError, match="bn.bias.*must be an array"):
        opt.step({**g, "bn.bias": [0.0] * 8})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_refused_before_anything_changes(rng, bad):
    params, grads = make_run(rng, 2)
    opt = AdamW(params)
    opt.step(grads[0])
    before = {n: p.copy() for n, p in params.items()}
    state = {n: {k: (v if isinstance(v, int) else v.copy()) for k, v in s.items()} for n, s in opt.state.items()}
    g = dict(grads[1])
    g["head.weight"] = g["head.weight"].copy()
    g["head.weight"][3, 4] = bad
    with pytest.raises(FloatingPointError, match=r"\['head.weight'\].*NaN or inf"):
        opt.step(g)
    for n in SHAPES:  # conv.weight comes first and was not touched either
        np.testing.assert_array_equal(params[n], before[n])
        assert opt.state[n]["step"] == state[n]["step"] == 1
        np.testing.assert_array_equal(opt.state[n]["exp_avg"], state[n]["exp_avg"])


def test_constructor_errors():
    w = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        SGD({"w": w}, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lr must be"):
        SGD({"w": w}, lr=-1.0)
    with pytest.raises(ValueError, match="momentum must be"):
        SGD({"w": w}, lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="betas"):
        AdamW({"w": w}, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        AdamW({"w": w}, weight_decay=float("nan"))
    with pytest.raises(TypeError, match="parameter 'i' is int32"):
        SGD({"w": w, "i": np.zeros(3, np.int32)}, lr=0.1)
    with pytest.raises(TypeError, match="parameter 'w' must be a NumPy or CuPy array"):
        SGD({"w": [0.0]}, lr=0.1)
    with pytest.raises(ValueError, match="'a' and 'b' are the same array"):
        SGD([("a", w), ("b", w)], lr=0.1)
    with pytest.raises(ValueError, match="'a' is given twice"):
        SGD([("a", w), ("a", w.copy())], lr=0.1)
    with pytest.raises(ValueError, match="params is empty"):
        SGD({}, lr=0.1)
    opt = SGD({"w": w}, lr=0.1)
    with pytest.raises(ValueError, match="lr must be"):
        opt.lr = float("inf")


# ------------------------------------------------------------------ schedule
def test_cosine_lr():
    assert cosine_lr(0, 100, 1.0) == 1.0
    assert cosine_lr(50, 100, 2.0) == pytest.approx(1.0)
    assert cosine_lr(100, 100, 1.0) == pytest.approx(0.0)
    assert cosine_lr(500, 100, 1.0, min_lr=0.1) == pytest.approx(0.1)
    # warm-up: (step + 1) / warmup of base_lr, then the cosine from base_lr
    assert [cosine_lr(s, 100, 1.0, warmup=10) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert cosine_lr(10, 100, 1.0, warmup=10) == 1.0
    assert cosine_lr(55, 100, 1.0, warmup=10) == pytest.approx(0.5)
    assert cosine_lr(99, 100, 1.0, warmup=10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))
    lrs = [cosine_lr(s, 50, 3e-3, warmup=5, min_lr=1e-4) for s in range(50)]
    assert all(a >= b for a, b in itertools.pairwise(lrs[5:])) and min(lrs) > 1e-4
    for bad in ({"total": 0}, {"warmup": 200}, {"step": -1}, {"base_lr": -1.0}, {"step": 1.5}):
        args = {"step": 0, "total": 100, "base_lr": 1.0, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            cosine_lr(**args)


# ------------------------------------------------------------------ PyTorch
@pytest.mark.parametrize("cls,kw", [
    (SGD, {"momentum": 0.9, "weight_decay": 0.05}), (SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01}),
    (SGD, {}), (AdamW, {}), (AdamW, {"betas": (0.8, 0.99), "eps": 1e-4, "weight_decay": 0.2})])
def test_matches_torch_optim(rng, cls, kw):
    torch = pytest.importorskip("torch")
    params, grads = make_run(rng, 6)
    tparams = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params.items()}
    topt = getattr(torch.optim, cls.__name__)(list(tparams.values()), lr=0.01, **kw)
    opt = cls(params, lr=0.01, **kw)
    for k, g in enumerate(grads):
        lr = 0.01 * (1 + k % 3)
        opt.lr = lr
        for group in topt.param_groups:
            group["lr"] = lr
        for n, tp in tparams.items():
            tp.grad = torch.from_numpy(g[n].copy())
        topt.step()
        opt.step(g)
        for n in SHAPES:
            np.testing.assert_allclose(params[n], tparams[n].detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{n}, step {k + 1}")
