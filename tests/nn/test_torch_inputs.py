"""PyTorch tensors and devices where numba-sc takes arrays and devices: SparseTensor's coords
and features (through DLPack, without numba-sc importing torch), and ``.to`` given
``"cuda:0"`` or a ``torch.device``. Skipped where torch is absent."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_sc as ns  # noqa: E402
from numba_sc.core.device import gpu_present, simulating  # noqa: E402
from numba_sc.core.tensor import as_array, device_kind  # noqa: E402

ON_GPU = gpu_present() and not simulating() and torch.cuda.is_available()


def _cloud(n=120, seed=0):
    rng = np.random.default_rng(seed)
    c = np.unique(rng.integers(0, 12, size=(n, 3)).astype(np.int32), axis=0)
    return c, rng.standard_normal((len(c), 4)).astype(np.float32)


def test_import_numba_sc_does_not_import_torch():
    code = "import sys, numba_sc, numba_sc.nn; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_tensor_from_torch_cpu_tensors_equals_the_numpy_one():
    c, f = _cloud()
    want = ns.SparseTensor(c, f)
    # the reverse row order, requires_grad on the features: both must still come out sorted
    got = ns.SparseTensor(torch.from_numpy(c[::-1].copy()), torch.tensor(f[::-1].copy(), requires_grad=True))
    assert isinstance(got.coords, np.ndarray) and isinstance(got.features, np.ndarray)
    np.testing.assert_array_equal(got.coords, want.coords)
    np.testing.assert_array_equal(got.features, want.features)
    # int64 coordinates (torch's default integer) are accepted as NumPy's are
    assert len(ns.SparseTensor(torch.from_numpy(c.astype(np.int64)), torch.from_numpy(f))) == len(c)


def test_torch_inputs_are_checked_as_arrays_are():
    c, f = _cloud()
    with pytest.raises(TypeError, match="integer"):
        ns.SparseTensor(torch.from_numpy(c).float(), torch.from_numpy(f))
    with pytest.raises(TypeError, match="float32 or float16"):
        ns.SparseTensor(torch.from_numpy(c), torch.from_numpy(f).to(torch.bfloat16))
    with pytest.raises(ValueError, match="one feature row per coordinate"):
        ns.SparseTensor(torch.from_numpy(c), torch.from_numpy(f[:-1]))


def test_as_array_shares_memory_on_the_cpu():
    t = torch.zeros(3, 2)
    a = as_array(t, "x")
    a[0, 0] = 5.0
    assert float(t[0, 0]) == 5.0
    n = np.ones(2)
    assert as_array(n, "x") is n


def test_device_kind_accepts_torchs_names():
    assert device_kind("cpu") == "cpu" and device_kind(torch.device("cpu")) == "cpu"
    assert device_kind("cuda") == "cuda" and device_kind(torch.device("cuda")) == "cuda"
    assert device_kind(None) is None
    for bad in ("gpu", "cuda:x", "cpu:1", "mps"):
        with pytest.raises(ValueError, match="'cuda' or 'cpu' \\(or 'cuda:N', a torch.device\\)"):
            device_kind(bad)
    with pytest.raises(TypeError, match="device must be"):
        device_kind(3)


@pytest.mark.skipif(not (simulating() or ON_GPU), reason="'cuda' needs a GPU or the simulator")
def test_to_takes_cuda_0_and_torch_devices():
    c, f = _cloud()
    x = ns.SparseTensor(c, f)
    for dev in ("cuda:0", torch.device("cuda:0"), torch.device("cuda")):
        y = x.to(dev)
        np.testing.assert_array_equal(np.asarray(ns.core.backend.to_host(y.features)), x.features)
    assert x.to(torch.device("cpu")) is x  # already there: nothing moves
    assert x.to(torch.float16).features.dtype == np.float16
    # another GPU than the current one is refused with the fix, never run on the current one
    with pytest.raises(ValueError, match="select that GPU first"):
        x.to("cuda:7")
    m = ns.nn.SubMConv3d(4, 2)
    m.to(torch.device("cuda:0"), torch.float16)
    assert m.weight.dtype == np.float16


def test_voxelize_and_the_layer_weight_take_torch_tensors():
    """The other two places a user hands numba-sc arrays: the points (and features) to
    voxelize, and a layer's weight; the results equal those of the NumPy arrays."""
    rng = np.random.default_rng(4)
    pts = rng.uniform(0, 2, size=(200, 3)).astype(np.float32)
    feats = rng.standard_normal((200, 2)).astype(np.float32)
    want = ns.voxelize(pts, 0.25, feats, backend="reference")
    got = ns.voxelize(torch.from_numpy(pts), 0.25, torch.from_numpy(feats), backend="reference")
    np.testing.assert_array_equal(got.coords, want.coords)
    np.testing.assert_array_equal(got.features, want.features)
    x = ns.SparseTensor(want.coords, want.features)
    w = (rng.standard_normal((27, 2, 3)) / 3).astype(np.float32)
    ref = ns.sparse_conv3d(x, w, 3, backend="reference").features
    out = ns.sparse_conv3d(x, torch.tensor(w, requires_grad=True), 3, backend="reference").features
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="weight must have shape"):
        ns.sparse_conv3d(x, torch.from_numpy(w[:9]), 3, backend="reference")
