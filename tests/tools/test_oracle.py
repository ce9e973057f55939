"""The float64 oracle (numba_sc.tools.oracle): its gradients against central finite
differences in float64, its layers against a brute-force loop over the rule, and
the report it gives."""
import copy

import numpy as np
import pytest

import numba_sc as ns
from numba_sc import nn
from numba_sc.train.loss import cross_entropy

from helpers import oracle, scan_crop


def _loss_and_grads(model, x, target):
    """Cross-entropy of the model's output in float64 on the reference backend:
    ``(loss, parameter gradients, input gradient)``."""
    with nn.Tape() as tape:
        y = model(x, backend="reference")
    if target is None:  # no classifier: a fixed linear functional of the output
        r = np.random.default_rng(7).standard_normal(y.features.shape)
        loss, g = float(np.sum(y.features * r)), r
    else:
        loss, g = cross_entropy(y.features, target, backend="reference")
    grads = tape.backward(y, g)
    return loss, grads, tape.grad(x)


def _central_difference(model, x, target, array, index, h):
    old = array[index]
    array[index] = old + h
    up = _loss_and_grads(model, x, target)[0]
    array[index] = old - h
    down = _loss_and_grads(model, x, target)[0]
    array[index] = old
    return (up - down) / (2 * h)


def _check_against_differences(model, x, target, names, h=1e-6):
    """For each parameter named (and for the input features): the entry of largest
    gradient and one drawn at random, against central differences."""
    loss, grads, dx = _loss_and_grads(model, x, target)
    params = dict(model.named_parameters())
    rng = np.random.default_rng(3)
    checked = []
    for name, array, grad in [(k, params[k], grads[k]) for k in names] + [("input", x.features, dx)]:
        assert grad.dtype == np.float64 and array.dtype == np.float64, name
        scale = np.abs(grad).max()
        assert scale > 0, f"{name}: no gradient reaches it; pick another parameter"
        for flat in {int(np.argmax(np.abs(grad))), int(rng.integers(grad.size))}:
            index = np.unravel_index(flat, grad.shape)
            fd = _central_difference(model, x, target, array, index, h)
            # float64 differences: truncation ~h^2, roundoff ~1e-16 |loss| / h
            assert abs(fd - grad[index]) <= 1e-6 * scale + 1e-8 * abs(grad[index]), \
                f"{name}{index}: tape {grad[index]!r}, central difference {fd!r}"
            checked.append(name)
    return checked


def test_minkunet_float64_gradients_match_central_differences():
    x = scan_crop(120).to(np.float64)
    model = ns.models.MinkUNet42(4, 5, width=0.125, seed=1).train().double()
    target = np.random.default_rng(0).integers(0, 5, len(x))
    names = ["stem.0.weight",            # submanifold convolution
             "stem.1.weight", "stem.1.bias",  # BatchNorm in training mode (+ ReLU)
             "stage2.0.0.weight",        # strided convolution
             "stage3.1.shortcut.0.weight",  # 1x1x1 convolution (a matrix product)
             "up2.0.weight",             # transposed convolution
             "dec3.0.main.4.weight",     # BatchNorm with the residual add and ReLU
             "classifier.weight", "classifier.bias"]  # Linear
    checked = _check_against_differences(model, x, target, names)
    assert set(checked) == set(names) | {"input"}


def test_resnet_float64_gradients_match_central_differences_in_eval_mode():
    x = scan_crop(120).to(np.float64)
    model = ns.models.SparseResNet21(4, width=0.25, seed=2).double()
    for bn in model.modules(nn.BatchNorm):  # running statistics that are not the identity
        c = bn.num_features
        bn.running_mean = np.random.default_rng(c).uniform(-0.2, 0.2, c)
        bn.running_var = np.random.default_rng(c + 1).uniform(0.5, 2.0, c)
    names = ["stem.0.0.weight", "stem.0.1.weight", "stage1.0.0.weight", "stage4.0.weight"]
    _check_against_differences(model, x, None, names)


def test_float64_layers_equal_a_brute_force_loop_over_the_rule():
    x = scan_crop(150).to(np.float64)
    rng = np.random.default_rng(4)
    sub = nn.SubMConv3d(4, 3, 3, rng=rng).double()
    down = nn.SparseConv3d(3, 5, 2, stride=2, rng=rng).double()
    up = nn.SparseInverseConv3d(5, 2, 2, stride=2, inverts=down, rng=rng).double()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub, self.down, self.up = sub, down, up

        def forward(self, t):
            a = self.sub(t)
            b = self.down(a)
            return a, b, self.up(b)

    a, b, c = Net()(x, backend="reference")
    coords = np.asarray(x.coords)
    offsets = ns.kernel_offsets(3)
    want_a = oracle(coords, x.features, coords, sub.weight, offsets)
    want_b = oracle(coords, a.features, b.coords, down.weight, ns.kernel_offsets(2))
    # transposed: output p receives input q through delta_k when p = q + delta_k
    fine = {tuple(p): i for i, p in enumerate(coords.tolist())}
    want_c = np.zeros((len(coords), 2))
    for i, q in enumerate(np.asarray(b.coords).tolist()):
        for k, d in enumerate(ns.kernel_offsets(2).tolist()):
            j = fine.get((q[0] + d[0], q[1] + d[1], q[2] + d[2]))
            if j is not None:
                want_c[j] += b.features[i] @ up.weight[k]
    for got, want in ((a, want_a), (b, want_b), (c, want_c)):
        assert got.features.dtype == np.float64
        assert np.abs(got.features - want).max() <= 1e-12 * np.abs(want).max()
    # the comparison sees a planted off-by-one: the rule read with one offset moved
    wrong = offsets.copy()
    wrong[0, 0] += 1
    planted = oracle(coords, x.features, coords, sub.weight, wrong)
    assert np.abs(a.features - planted).max() > 1e-3 * np.abs(want_a).max()


def _model_and_input(points=120, seed=5):
    x = scan_crop(points)
    model = ns.models.MinkUNet42(4, 5, width=0.125, seed=seed).train()
    g = np.random.default_rng(seed).standard_normal((len(x), 5))
    return model, x, g


def test_report_finds_a_perturbed_gradient_with_its_distance_and_leaves_the_model_alone():
    model, x, g = _model_and_input()
    before = {k: v.copy() for k, v in model.state_dict().items()}
    features = x.features.copy()
    # the float64 truth, computed here the plain way, on a copy
    m64 = copy.deepcopy(model).double()
    with nn.Tape() as tape:
        y = m64(x.to(np.float64), backend="reference")
    truth = tape.backward(y, g)
    other = {k: truth[k].copy() for k, _ in model.trainable_parameters()}
    name = "dec2.1.main.1.weight"
    bump = np.zeros_like(other[name])
    bump[0] = 1.0
    other[name] = other[name] + 0.3 * np.linalg.norm(truth[name]) * bump
    report = ns.check_gradients(model, x, g, paths=["reference float32"], others={"engine B": other})

    assert [p.name for p in report.parameters] == [k for k, _ in model.trainable_parameters()]
    worst = report.worst("engine B")
    assert worst.name == name and worst.distance["engine B"] == pytest.approx(0.3, rel=1e-9)
    assert all(p.distance["engine B"] < 1e-12 for p in report.parameters if p.name != name)
    assert report.output["engine B"] is None
    # float32 arithmetic really ran: small, but not zero
    f32 = [p.distance["reference float32"] for p in report.parameters]
    assert 0 < min(f32) and max(f32) < 1e-4
    assert 0 < report.output["reference float32"] < 1e-4
    assert 0 < report.total["reference float32"] < 1e-4
    text = str(report)
    assert name in text and "engine B" in text and "worst on engine B: " + name in text
    d = report.to_dict()
    assert d["worst"]["engine B"] == name and len(d["parameters"]) == len(report.parameters)
    # the user's model (running statistics, num_batches_tracked) and input are untouched
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert np.array_equal(x.features, features) and x.features.dtype == np.float32


def test_report_flags_a_parameter_the_output_does_not_reach():
    # eval mode, and one layer whose gradient is exactly 0: a ReLU that kills everything
    model = nn.Sequential(nn.SubMConv3d(4, 3, 3, rng=np.random.default_rng(0)), nn.ReLU(),
                          nn.Linear(3, 2, rng=np.random.default_rng(1)))
    model[0].weight[...] = -np.abs(model[0].weight)  # all outputs <= 0 for these positive features
    x = scan_crop(60)
    x = ns.SparseTensor(x.coords, np.abs(x.features))
    g = np.ones((len(x), 2))
    report = ns.check_gradients(model, x, g, paths=["reference float32"])
    row = {p.name: p for p in report.parameters}["0.weight"]
    assert row.norm64 == 0 and row.absolute and row.distance["reference float32"] == 0
    assert report.mode == "eval" and "*" in str(report)


def test_the_cuda_path_runs_the_kernels():
    model = nn.Sequential(nn.SubMConv3d(4, 4, 3, rng=np.random.default_rng(0)), nn.BatchNorm(4), nn.ReLU(),
                          nn.Linear(4, 3, rng=np.random.default_rng(1))).train()
    x = scan_crop(40)
    g = np.random.default_rng(2).standard_normal((len(x), 3))
    report = ns.check_gradients(model, x, g, paths=["cuda float32", "reference float32"])
    assert 0 < report.total["cuda float32"] < 1e-4
    assert 0 < report.total["reference float32"] < 1e-4


def test_float64_model_keeps_batchnorm_in_float64_and_returns_to_float32():
    model = ns.models.MinkUNet42(4, 5, width=0.125).double()
    dtypes = {k: v.dtype for k, v in model.named_parameters()}
    assert all(dtypes[k] == np.float64 for k in dtypes if not k.endswith("num_batches_tracked"))
    model.train()
    x = scan_crop(80).to(np.float64)
    model(x, backend="reference")
    bn = model.stem[1]
    assert bn.running_mean.dtype == bn.running_var.dtype == np.float64
    model.float()
    assert all(v.dtype == np.float32 for k, v in model.named_parameters() if not k.endswith("tracked"))
