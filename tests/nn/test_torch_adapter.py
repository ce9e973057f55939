"""numba_sc.nn.torch_adapter: a sparse convolution inside PyTorch's autograd. Skipped where torch is
absent (CI); run on the GPU machine, which has it (CUDA tensors there, CPU tensors and the
simulator or the references elsewhere)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_sc as ns  # noqa: E402
from numba_sc.core.device import gpu_present, simulating  # noqa: E402
from numba_sc.core.backend import to_host
from numba_sc.conv.gradient import sparse_conv3d_backward  # noqa: E402
from numba_sc.nn.torch_adapter import (SparseConv, TorchSparseConv3d, TorchSparseInverseConv3d,  # noqa: E402
                                       TorchSubMConv3d, sparse_conv, to_array, to_tensor)

from conftest import crop, load_scan  # noqa: E402

ON_GPU = gpu_present() and not simulating() and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _coords(n):
    pts = crop(load_scan("semantickitti"), n, seed=7)
    c = ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords
    if ON_GPU:
        import cupy

        c = cupy.asarray(c)
    return c


def test_no_copies():
    t = torch.arange(12, dtype=torch.float32, device=DEVICE).reshape(4, 3)
    a = to_array(t)
    a[0, 0] = 42.0
    assert float(t[0, 0]) == 42.0  # the same memory
    back = to_tensor(a)
    back[1, 1] = -1.0
    assert float(t[1, 1]) == -1.0


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
def test_forward_and_backward_equal_the_library(kind):
    coords = _coords(200)
    rng = np.random.default_rng(0)
    x = ns.SparseTensor(coords, np.zeros((len(coords), 3), np.float32) if not ON_GPU else
                        __import__("cupy").zeros((len(coords), 3), np.float32))
    f = torch.tensor(rng.standard_normal((len(coords), 3)).astype(np.float32), device=DEVICE, requires_grad=True)
    kmap = None
    if kind == "subm":
        w = torch.tensor(rng.standard_normal((27, 3, 4)).astype(np.float32), device=DEVICE, requires_grad=True)
        out, y = sparse_conv(x, f, w, 3)
        src, x_used, transposed = f, x, False
    else:
        w0 = torch.tensor(rng.standard_normal((8, 3, 4)).astype(np.float32), device=DEVICE)
        down, yd = sparse_conv(x, f.detach(), w0, 2, stride=2)
        if kind == "strided":
            w = torch.tensor(rng.standard_normal((8, 3, 4)).astype(np.float32), device=DEVICE, requires_grad=True)
            out, y = sparse_conv(x, f, w, kernel_map=yd.kernel_map)
            src, x_used, transposed = f, x, False
        else:
            fc = torch.tensor(rng.standard_normal((len(yd), 4)).astype(np.float32), device=DEVICE, requires_grad=True)
            w = torch.tensor(rng.standard_normal((8, 4, 3)).astype(np.float32), device=DEVICE, requires_grad=True)
            out, y = sparse_conv(yd, fc, w, transposed=True, kernel_map=yd.kernel_map)
            src, x_used, transposed, kmap = fc, yd, True, yd.kernel_map
    want = ns.sparse_conv3d(x_used.with_features(to_array(src)), to_array(w), 3 if kind == "subm" else 2,
                            stride=1, transposed=transposed, kernel_map=kmap if transposed else
                            (None if kind == "subm" else yd.kernel_map))
    assert np.allclose(to_host(want.features), out.detach().cpu().numpy(), atol=1e-5)
    g = torch.tensor(rng.standard_normal(tuple(out.shape)).astype(np.float32), device=DEVICE)
    out.backward(g)
    dx, dw = sparse_conv3d_backward(x_used.with_features(to_array(src)), to_array(w.detach()), to_array(g),
                                    kmap if transposed else y.kernel_map, transposed, backend="reference")
    assert np.allclose(src.grad.cpu().numpy(), to_host(dx), atol=1e-4)
    assert np.allclose(w.grad.cpu().numpy(), to_host(dw), atol=1e-4)


def test_gradcheck():
    """torch.autograd.gradcheck on a few voxels, in float32 (the kernels have no float64):
    a step of 1e-2 and tolerances of 1e-3 (the layer is linear in each argument)."""
    coords = _coords(40)
    rng = np.random.default_rng(1)
    x = ns.SparseTensor(coords, to_array(torch.zeros(len(coords), 2, device=DEVICE)))
    f = torch.tensor(rng.standard_normal((len(coords), 2)).astype(np.float32), device=DEVICE, requires_grad=True)
    w = torch.tensor(rng.standard_normal((27, 2, 2)).astype(np.float32), device=DEVICE, requires_grad=True)
    backend = None if ON_GPU else "reference"
    assert torch.autograd.gradcheck(lambda a, b: sparse_conv(x, a, b, 3, backend=backend)[0], (f, w),
                                    eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=True)


def test_module_trains_with_torch_optim():
    coords = _coords(150)
    x = ns.SparseTensor(coords, to_array(torch.zeros(len(coords), 4, device=DEVICE)))
    conv = SparseConv(4, 2, 3).to(DEVICE)
    f = torch.randn(len(coords), 4, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    target = torch.randn(len(coords), 2, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    opt = torch.optim.SGD(conv.parameters(), lr=0.02)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out, _ = conv(x, f)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    with pytest.raises(TypeError, match="features must be a torch.Tensor"):
        sparse_conv(x, np.zeros((len(coords), 4), np.float32), conv.weight)


def test_unsorted_coordinates_give_the_sorted_result_in_the_callers_order():
    """Features go in, and a submanifold layer's outputs come out, in the row order of the
    coordinates the caller gave (SparseTensor sorts its own rows)."""
    coords = to_host(_coords(150))
    perm = np.random.default_rng(3).permutation(len(coords))
    f = torch.tensor(np.random.default_rng(4).standard_normal((len(coords), 3)).astype(np.float32), device=DEVICE)
    w = torch.tensor(np.random.default_rng(5).standard_normal((27, 3, 2)).astype(np.float32), device=DEVICE)

    def run(c, feats):
        c = __import__("cupy").asarray(c) if ON_GPU else c
        x = ns.SparseTensor(c, to_array(torch.zeros(len(c), 3, device=DEVICE)))
        return sparse_conv(x, feats, w, 3)[0].cpu().numpy()

    in_order = run(coords, f)
    shuffled = run(coords[perm], f[torch.as_tensor(perm, device=DEVICE)])
    np.testing.assert_allclose(shuffled, in_order[perm], rtol=1e-5, atol=1e-5)
    assert not np.allclose(shuffled, in_order)  # (the permutation did move rows)


def test_initial_weights_follow_torch_manual_seed_and_bias_is_added():
    torch.manual_seed(0)
    a = TorchSubMConv3d(4, 3, bias=True)
    torch.manual_seed(0)
    b = TorchSubMConv3d(4, 3)
    torch.manual_seed(1)
    c = TorchSubMConv3d(4, 3)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
    # one bias default: the numba_sc.nn layers' (False); bias=True asks for one
    assert b.bias is None and ns.nn.SubMConv3d(4, 3).__dict__.get("bias") is None and a.bias is not None
    coords = _coords(80)
    x = ns.SparseTensor(coords, to_array(torch.zeros(len(coords), 4, device=DEVICE)))
    a = a.to(DEVICE)
    f = torch.randn(len(coords), 4, device=DEVICE)
    with torch.no_grad():
        a.bias.fill_(0.5)
        with_bias = a(x, f)[0]
        a.bias.zero_()
        without = a(x, f)[0]
    torch.testing.assert_close(with_bias - without, torch.full_like(without, 0.5))


def test_maps_are_kept_on_the_coordinates_and_the_three_kinds_chain():
    coords = _coords(200)
    x = ns.SparseTensor(coords, to_array(torch.zeros(len(coords), 4, device=DEVICE)))
    f = torch.randn(len(coords), 4, device=DEVICE)
    first, second = TorchSubMConv3d(4, 4).to(DEVICE), TorchSubMConv3d(4, 4).to(DEVICE)
    _, y1 = first(x, f)
    _, y2 = second(x, f)
    assert y2.kernel_map is y1.kernel_map  # built once, read by both layers
    down, up = TorchSparseConv3d(4, 6).to(DEVICE), TorchSparseInverseConv3d(6, 4).to(DEVICE)
    g, yd = down(x, f)
    back, yb = up(yd, g)
    assert tuple(back.shape) == (len(x), 4) and len(yb) == len(x)
    np.testing.assert_array_equal(to_host(yb.coords), to_host(x.coords))
    back.sum().backward()
    assert down.weight.grad is not None and up.weight.grad is not None
    with pytest.raises(ValueError, match="transposed layer .* needs the map of the strided layer"):
        TorchSparseInverseConv3d(4, 4, kernel_size=3, stride=2).to(DEVICE)(x, f)
