"""numba_sc.nn.torch_layers and torch_models: every layer kind as a torch module on one torch-side
sparse tensor, composing in torch.nn.Sequential; the two networks loading numba-sc's state dicts
and computing what numba-sc computes; torch.autocast. Skipped where torch is absent. On the CPU the
kernels run under the simulator (tiny clouds); on a GPU with CUDA tensors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_sc as ns  # noqa: E402
from numba_sc.core.backend import to_host  # noqa: E402
from numba_sc.core.device import gpu_present, simulating  # noqa: E402
from numba_sc.nn import models  # noqa: E402
from numba_sc.nn import torch_layers as tl  # noqa: E402
from numba_sc.nn.torch_models import TorchMinkUNet42, TorchSparseResNet21  # noqa: E402

from helpers import random_bn, scan_crop  # noqa: E402

ON_GPU = gpu_present() and not simulating() and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _input(n=120, channels=4, seed=0):
    x = scan_crop(n, seed=seed)
    coords = np.asarray(to_host(x.coords))
    f = torch.tensor(np.asarray(to_host(x.features))[:, :channels], device=DEVICE)
    return coords, f


def test_layers_compose_in_sequential_and_train_a_step():
    torch.manual_seed(0)
    coords, f = _input()
    net = torch.nn.Sequential(tl.SubMConv3d(4, 8), tl.BatchNorm(8), tl.ReLU(),
                              tl.SparseConv3d(8, 8, kernel_size=2, stride=2), tl.BatchNorm(8), tl.ReLU(),
                              tl.SubMConv3d(8, 8), tl.SparseInverseConv3d(8, 8, kernel_size=2, stride=2),
                              tl.Linear(8, 3)).to(DEVICE)
    x = tl.TorchSparseTensor.from_coords(coords, f)
    y = net(x)
    assert isinstance(y, tl.TorchSparseTensor) and y.features.shape == (len(x), 3) and y.stride == (1, 1, 1)
    np.testing.assert_array_equal(to_host(y.coords), to_host(x.coords))  # back on the input's coordinates
    labels = torch.arange(len(x), device=DEVICE) % 3
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    before = [p.detach().clone() for p in net.parameters()]
    loss0 = torch.nn.functional.cross_entropy(y.features, labels)
    loss0.backward()
    opt.step()
    for (name, p), b in zip(net.named_parameters(), before):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert not torch.equal(p.detach(), b), f"{name} did not move"
    # the step lowered the loss of the same batch (still in train mode: BatchNorm's batch statistics)
    assert torch.nn.functional.cross_entropy(net(x).features, labels) < loss0


def test_add_cat_and_their_checks():
    coords, f = _input(80)
    x = tl.TorchSparseTensor.from_coords(coords, f)
    np.testing.assert_allclose(tl.Add()(x, x).features.cpu(), 2 * x.features.cpu())
    assert tl.Add(relu=True)(x, x.with_features(-3 * x.features)).features.min() >= 0
    assert tl.Cat()(x, x).features.shape == (len(x), 8)
    down = tl.SparseConv3d(4, 4).to(DEVICE)(x)
    with pytest.raises(ValueError, match="not on the same coordinates"):
        tl.Add()(x, down)
    with pytest.raises(ValueError, match="expects 5 input channels"):
        tl.SubMConv3d(5, 2).to(DEVICE)(x)
    with pytest.raises(TypeError, match="TorchSparseTensor.from_coords"):
        tl.ReLU()(f)
    with pytest.raises(ValueError, match="needs the map of the strided layer"):
        tl.SparseInverseConv3d(4, 4, kernel_size=3, stride=2).to(DEVICE)(x)


def test_rows_follow_the_sorted_coordinates_and_input_order_restores_the_callers():
    coords, f = _input(80)
    perm = np.random.default_rng(1).permutation(len(coords))
    conv = tl.SubMConv3d(4, 3).to(DEVICE)
    a = conv(tl.TorchSparseTensor.from_coords(coords, f))
    b = conv(tl.TorchSparseTensor.from_coords(coords[perm], f[torch.as_tensor(perm, device=DEVICE)]))
    torch.testing.assert_close(a.features, b.features)  # the same sorted rows, whatever order came in
    torch.testing.assert_close(b.input_order(), a.input_order()[torch.as_tensor(perm, device=DEVICE)])
    assert not torch.equal(b.input_order(), a.input_order())  # (the permutation did move rows)


def test_one_layer_equals_the_numba_sc_layer_forward_and_backward():
    coords, f = _input(100)
    ours = ns.nn.SubMConv3d(4, 5, bias=True, rng=np.random.default_rng(3))
    ours.bias = np.linspace(-1, 1, 5).astype(np.float32)
    twin = tl.SubMConv3d(4, 5, bias=True).to(DEVICE)
    twin.load_state_dict(tl.numpy_state(ours.state_dict()))
    x = ns.SparseTensor(coords, f.cpu().numpy())
    with ns.nn.Tape() as tape:
        y = ours(x)
    g = np.random.default_rng(4).standard_normal(y.features.shape).astype(np.float32)
    grads = tape.backward(y, g)
    t = tl.TorchSparseTensor.from_coords(coords, f.clone().requires_grad_(True))
    out = twin(t)
    np.testing.assert_allclose(out.features.detach().cpu(), to_host(y.features), rtol=1e-5, atol=1e-5)
    out.features.backward(torch.tensor(g, device=DEVICE))
    np.testing.assert_allclose(twin.weight.grad.cpu(), to_host(grads["weight"]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(twin.bias.grad.cpu(), to_host(grads["bias"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("net", ["resnet21", "unet42"])
def test_networks_load_numba_sc_state_dicts_and_compute_the_same(net):
    """A numba-sc network's state dict (BatchNorm drawn at random, so a mix-up shows) loads
    into the torch twin as it is, and the twin computes the same output; and back."""
    coords, f = _input(110, seed=2)
    if net == "unet42":
        ours, twin = models.MinkUNet42(4, 5, width=0.125, seed=1), TorchMinkUNet42(4, 5, width=0.125)
    else:
        ours, twin = models.SparseResNet21(4, width=0.25, seed=1), TorchSparseResNet21(4, width=0.25)
    random_bn(ours, np.random.default_rng(5))
    twin.load_state_dict(ours.state_dict())
    twin = twin.to(DEVICE).eval()
    y = ours(ns.SparseTensor(coords, f.cpu().numpy()))
    with torch.no_grad():
        out = twin(tl.TorchSparseTensor.from_coords(coords, f))
    np.testing.assert_array_equal(to_host(out.coords), to_host(y.coords))
    assert out.stride == y.stride
    want = to_host(y.features)
    np.testing.assert_allclose(out.features.cpu(), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    state = ours.state_dict()
    key = next(k for k in state if k.endswith("weight") and state[k].ndim == 3)
    state[key] = state[key] * 1.5
    twin.load_state_dict(state)
    if net == "resnet21":  # a wrong weight is seen: the check above is not vacuous (shown on
        with torch.no_grad():  # the smaller network: each pass takes a minute under the simulator)
            bad = twin(tl.TorchSparseTensor.from_coords(coords, f)).features.cpu().numpy()
        assert not np.allclose(bad, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    # and back: the torch twin's weights load into numba-sc's network
    back = (models.MinkUNet42(4, 5, width=0.125, seed=9) if net == "unet42"
            else models.SparseResNet21(4, width=0.25, seed=9))
    back.load_state_dict(twin.numba_sc_state_dict())
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)


def test_autocast_float16_computes_in_float16_and_bfloat16_is_refused():
    coords, f = _input(80)
    conv = tl.SubMConv3d(4, 3).to(DEVICE)
    x = tl.TorchSparseTensor.from_coords(coords, f)
    full = conv(x).features
    with torch.autocast(DEVICE, dtype=torch.float16):
        half = conv(x).features
    assert full.dtype == torch.float32 and half.dtype == torch.float16
    torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=2e-2)
    assert not torch.equal(half.float(), full)  # computed in float16, not a cast of the float32 answer
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="no bfloat16 path.*dtype=torch.float16"):
            conv(x)
    with pytest.raises(TypeError, match="float32 or float16"):
        tl.TorchSparseTensor.from_coords(coords, f.to(torch.bfloat16))
