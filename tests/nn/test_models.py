"""The paper's two networks, checked as the single layer is (conv/test_layer.py):

* both run on a crop of a real scan, kernels (under the simulator here) == NumPy
  reference == a float64 *oracle network* written below from the definitions
  alone (a dictionary of coordinates per convolution, the convolution oracle of
  helpers.py; nothing of the package's maps, plans or caches);
* the map bookkeeping: how many Map steps and plans a network builds.

The pointwise kernels, the layers (and the errors a user gets for a layer, a
tensor or a checkpoint that does not fit) and spconv's weight format have their
own files beside this one.
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc import kernel_offsets, nn
from numba_sc.conv import prepare
from numba_sc.nn.models import MinkUNet42, SparseResNet21

from helpers import downsampled, host, oracle, random_bn, rel_err, scan_crop


# ------------------------------------------------------- an oracle network
class Oracle:
    """The networks of numba_sc.nn.models evaluated in float64 from their state dicts,
    with the dictionary oracle of helpers.py for every convolution and the coordinates
    of each level worked out here (floor(P / s) * s)."""

    def __init__(self, model):
        self.p = {k: v.astype(np.float64) for k, v in model.state_dict().items()}

    def conv(self, name, c, f, ts, ks, dil=1):
        return oracle(c, f, c, self.p[name + ".weight"], kernel_offsets(ks, dil, ts))

    def down(self, name, c, f, ts, ks, st):
        q = downsampled(c, np.asarray(st) * np.asarray(ts))
        return q, oracle(c, f, q, self.p[name + ".weight"], kernel_offsets(ks, 1, ts))

    def up(self, name, cq, fq, cp, ts_fine, ks):
        # out[p] += in[q] @ W[k] where p = q + delta_k: inputs on Q, offsets -delta_k
        return oracle(cq, fq, cp, self.p[name + ".weight"], -kernel_offsets(ks, 1, ts_fine))

    def bn(self, name, f, residual=None, relu=False):
        g = lambda s: self.p[f"{name}.{s}"]  # noqa: E731
        y = (f - g("running_mean")) / np.sqrt(g("running_var") + 1e-5) * g("weight") + g("bias")
        if residual is not None:
            y = y + residual
        return np.maximum(y, 0) if relu else y

    def res(self, name, c, f, ts):
        h = self.bn(f"{name}.main.1", self.conv(f"{name}.main.0", c, f, ts, 3), relu=True)
        h = self.conv(f"{name}.main.3", c, h, ts, 3)
        sc = f
        if f"{name}.shortcut.0.weight" in self.p:
            sc = self.bn(f"{name}.shortcut.1", f @ self.p[f"{name}.shortcut.0.weight"][0])
        return self.bn(f"{name}.main.4", h, residual=sc, relu=True)

    def unet(self, c, f):
        p = self.p
        f = self.bn("stem.1", self.conv("stem.0", c, f, 1, 3), relu=True)
        f = self.bn("stem.4", self.conv("stem.3", c, f, 1, 3), relu=True)
        levels = [(c, f, 1)]
        for i in range(1, 5):
            ts = 2 ** (i - 1)
            q, g = self.down(f"stage{i}.0.0", c, f, ts, 2, 2)
            g = self.bn(f"stage{i}.0.1", g, relu=True)
            g = self.res(f"stage{i}.2", q, self.res(f"stage{i}.1", q, g, 2 * ts), 2 * ts)
            c, f = q, g
            levels.append((c, f, 2 * ts))
        for i in range(1, 5):
            cp, fp, ts = levels[4 - i]
            g = self.bn(f"up{i}.1", self.up(f"up{i}.0", c, f, cp, ts, 2), relu=True)
            g = np.hstack([g, fp])
            f = self.res(f"dec{i}.1", cp, self.res(f"dec{i}.0", cp, g, ts), ts)
            c = cp
        return c, f @ p["classifier.weight"] + p["classifier.bias"]

    def resnet(self, c, f):
        ts = (1, 1, 1)
        for i, name in enumerate(["stem", "stage1", "stage2", "stage3"]):
            if i == 0:
                f = self.conv(f"{name}.0.0", c, f, ts, 3)
            else:
                c, f = self.down(f"{name}.0.0", c, f, ts, 3, 2)
                ts = tuple(2 * t for t in ts)
            f = self.bn(f"{name}.0.1", f, relu=True)
            f = self.res(f"{name}.2", c, self.res(f"{name}.1", c, f, ts), ts)
        c, f = self.down("stage4.0", c, f, ts, (1, 3, 1), (1, 2, 1))
        return c, self.bn("stage4.1", f, relu=True)


@pytest.mark.parametrize("net", ["unet42", "resnet21"])
def test_networks_kernels_reference_oracle(net):
    """The paper's two networks (narrow, to keep the simulator quick) on a crop of a
    real scan: kernels == reference == the float64 oracle network, fp32."""
    rng = np.random.default_rng(3)
    x = scan_crop(150)
    model = MinkUNet42(4, 7, width=0.125, seed=1) if net == "unet42" else SparseResNet21(4, width=0.25, seed=1)
    random_bn(model, rng)
    got = model(x)
    ref = model(x.without_maps(), backend="reference")
    c_want, f_want = (Oracle(model).unet if net == "unet42" else Oracle(model).resnet)(
        x.coords, x.features.astype(np.float64))
    np.testing.assert_array_equal(host(got.coords), c_want)
    np.testing.assert_array_equal(ref.coords, c_want)
    assert got.features.dtype == np.float32 and got.features.shape == f_want.shape
    assert rel_err(host(got.features), f_want) < 1e-5
    assert rel_err(ref.features, f_want) < 1e-5
    if net == "unet42":
        assert got.stride == (1, 1, 1) and len(got) == len(x)
    else:
        assert got.stride == (8, 16, 8)


def test_network_fp16_close_to_fp32():
    rng = np.random.default_rng(4)
    x = scan_crop(90)
    model = MinkUNet42(4, 5, width=0.125, seed=2)
    random_bn(model, rng)
    want = host(model(x, backend="reference").features)  # (the kernels equal it: see above)
    model.half()
    assert model.stem[0].weight.dtype == np.float16 and model.stem[1].weight.dtype == np.float32
    x16 = ns.SparseTensor(x.coords, x.features.astype(np.float16))
    got = host(model(x16).features)
    assert got.dtype == np.float16
    assert rel_err(got, want) < 1e-2


def test_unet_builds_each_map_and_plan_once(monkeypatch):
    """MinkUNet42 meets 5 coordinate sets: 5 submanifold maps and 4 strided ones, each
    built once (Map step and metadata); the 4 transposed layers build nothing; the
    decoder reuses the encoder's maps."""
    built = {"map": 0, "plan": 0}
    real_map, real_plan = prepare.build_kernel_map, prepare.build_plan

    def count(kind, fn):
        def wrapped(*a, **k):
            built[kind] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(prepare, "build_kernel_map", count("map", real_map))
    monkeypatch.setattr(prepare, "build_plan", count("plan", real_plan))
    model = MinkUNet42(4, 3, width=0.125)
    x = scan_crop(100)
    calls = []
    with nn.observe(lambda m, a, y, kw: calls.append((m, a, y))):
        model(x, backend="reference")
    assert built == {"map": 9, "plan": 9}
    ups = [(a, y) for m, a, y in calls if isinstance(m, nn.SparseInverseConv3d)]
    assert len(ups) == 4
    for _, y in ups:  # back on the finer level's coordinate set, with the encoder's maps
        assert y.maps.subm
    assert ups[-1][1].maps is calls[0][1].maps  # the last up lands on the input's own set


