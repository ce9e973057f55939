"""Layers, networks, weights from spconv, and the kernels between the convolutions.

Three levels of checking, as for the single layer (test_conv.py):

* every pointwise kernel (BatchNorm, ReLU, add, bias, concatenation) equals its
  NumPy reference, and the reference equals the formula written out here;
* both networks of the paper run on a crop of a real scan, kernels (under the
  simulator here) == NumPy reference == a float64 *oracle network* written
  below from the definitions alone (a dictionary of coordinates per
  convolution, as test_conv's oracle; nothing of the package's maps, plans or
  caches);
* the map bookkeeping: how many Map steps and plans a network builds, and the
  errors a user gets for a map, a tensor or a checkpoint that does not fit.
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc import kernel_offsets, nn
from numba_sc.gmas import conv
from numba_sc.nn import pointwise as pw
from numba_sc.core.backend import to_host
from numba_sc.nn.models import MinkUNet42, SparseResNet21
from numba_sc.nn.spconv_format import (conv_weight_from_spconv, conv_weight_to_spconv,
                                    state_dict_from_spconv, state_dict_to_spconv)

from conftest import crop, load_scan
from test_conv import downsampled, oracle, rel_err


def host(a):
    return np.asarray(to_host(a))


def scan_crop(n=160, voxel=0.05, seed=0):
    """A SparseTensor of about n voxels from a crop of SemanticKITTI (4 features)."""
    pts = crop(load_scan("semantickitti"), 4 * n, seed)
    v = ns.voxelize(np.ascontiguousarray(pts[:, :3]), voxel, features=np.ascontiguousarray(pts[:, :4]),
                    backend="reference")
    return ns.SparseTensor(v.coords, v.features.astype(np.float32))


def random_bn(model, rng):
    """BatchNorm parameters and statistics drawn at random (not the identity), so a
    channel mix-up or a missing layer shows."""
    for bn in model.modules(nn.BatchNorm):
        c = bn.num_features
        bn.weight = rng.uniform(0.5, 1.5, c).astype(np.float32)
        bn.bias = rng.uniform(-0.2, 0.2, c).astype(np.float32)
        bn.running_mean = rng.uniform(-0.2, 0.2, c).astype(np.float32)
        bn.running_var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    if hasattr(model, "classifier"):
        model.classifier.bias = rng.uniform(-0.1, 0.1, model.classifier.out_features).astype(np.float32)


# ------------------------------------------------------ pointwise kernels
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
    """The library launches batch_norm_kernel_v2 (above); the plain kernel the
    module teaches with must compute the same."""
    from numba_sc.core.launch import launch

    a = rng.standard_normal((30, 13)).astype(dtype)
    r = rng.standard_normal((30, 13)).astype(dtype)
    w, bias, mean = (rng.standard_normal(13).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 2.0, 13).astype(np.float32)
    out = np.zeros_like(a)
    launch(pw.batch_norm_kernel, a.size, a, w, bias, mean, var, 1e-3, r, True, True, out)
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
        pw.relu(a.astype(np.float64))


# ------------------------------------------------------- an oracle network
class Oracle:
    """The networks of numba_sc.nn.models evaluated in float64 from their state dicts,
    with test_conv's dictionary oracle for every convolution and the coordinates
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
    real_map, real_plan = conv.build_kernel_map, conv.build_plan

    def count(kind, fn):
        def wrapped(*a, **k):
            built[kind] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(conv, "build_kernel_map", count("map", real_map))
    monkeypatch.setattr(conv, "build_plan", count("plan", real_plan))
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


def test_transposed_layer_reads_the_strided_plan_backwards(rng, monkeypatch):
    """sparse_conv3d(transposed=True) builds neither a map nor a plan: it reads the
    strided layer's plan with its lists swapped, and equals the oracle."""
    c = np.unique(rng.integers(0, 9, size=(200, 3)), axis=0).astype(np.int32)
    x = ns.SparseTensor(c, rng.standard_normal((len(c), 3)).astype(np.float32))
    for k in (2, 3):
        y = ns.sparse_conv3d(x, rng.standard_normal((k ** 3, 3, 4)).astype(np.float32), k, stride=2,
                             backend="cuda")
        kept = y.kernel_map.kept_plan[1]
        w2 = rng.standard_normal((k ** 3, 4, 2)).astype(np.float32)
        monkeypatch.setattr(conv, "build_plan", lambda *a, **kw: pytest.fail("a plan was built"))
        monkeypatch.setattr(conv, "build_kernel_map", lambda *a, **kw: pytest.fail("a map was built"))
        up = ns.sparse_conv3d(y, w2, transposed=True, kernel_map=y.kernel_map, backend="cuda")
        monkeypatch.undo()
        assert y.kernel_map.kept_plan[1] is kept
        np.testing.assert_array_equal(host(up.coords), x.coords)
        want = oracle(y.coords, y.features, x.coords, w2, -kernel_offsets(k))
        assert rel_err(host(up.features), want) < 1e-5
        t = up.kernel_map  # the map in the transposed direction, made when asked for
        assert t.is_transposed and np.array_equal(host(t.out_coords), x.coords)


def test_batchnorm_training_mode(rng):
    x = scan_crop(80)
    f = rng.standard_normal((len(x), 6)).astype(np.float32) * 3 + 1
    t = x.with_features(f)
    bn = nn.BatchNorm(6, momentum=0.25)
    bn.running_mean = np.full(6, 0.5, np.float32)
    bn.train()
    y = bn(t)
    mean, var = f.astype(np.float64).mean(0), f.astype(np.float64).var(0)
    assert rel_err(host(y.features), (f - mean) / np.sqrt(var + 1e-5)) < 1e-5
    np.testing.assert_allclose(bn.running_mean, 0.75 * 0.5 + 0.25 * mean, rtol=1e-5)
    np.testing.assert_allclose(bn.running_var, 0.75 + 0.25 * f.astype(np.float64).var(0, ddof=1), rtol=1e-5)
    assert int(bn.num_batches_tracked) == 1
    bn.eval()
    np.testing.assert_allclose(host(bn(t).features), pw.batch_norm_reference(
        f, bn.weight, bn.bias, bn.running_mean, bn.running_var), rtol=1e-6)


def test_sequential_fuses_batchnorm_and_relu(rng):
    x = scan_crop(60)
    seq = nn.Sequential(nn.SubMConv3d(4, 5, 3, rng=rng), nn.BatchNorm(5), nn.ReLU())
    random_bn(seq, rng)
    got = host(seq(x).features)
    step = seq[2](seq[1](seq[0](x.without_maps())))
    np.testing.assert_allclose(got, host(step.features), rtol=1e-6, atol=1e-6)
    assert (got >= 0).all() and (got == 0).any()


# ----------------------------------------------------------------- weights
def test_spconv_layout_worked_example():
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    sp = np.array([[[[[a]]], [[[b]]]], [[[[c]]], [[[d]]]]], np.float32)  # (C_out 2, 2, 1, 1, C_in 1)
    ours = conv_weight_from_spconv(sp)
    np.testing.assert_array_equal(ours, [[[a, c]], [[b, d]]])
    np.testing.assert_array_equal(conv_weight_to_spconv(ours, (2, 1, 1)), sp)


def test_spconv_layout_follows_the_offsets(rng):
    """spconv's kernel position (kx, ky, kz) is this library's offset (kx, ky, kz) - 1 for a
    3x3x3 kernel: converting a weight that is zero but at one position gives a layer
    that reads only that offset's neighbour."""
    offsets = kernel_offsets(3)
    for kx, ky, kz in [(0, 1, 2), (2, 0, 1), (1, 1, 1)]:
        sp = np.zeros((1, 3, 3, 3, 1), np.float32)
        sp[0, kx, ky, kz, 0] = 1
        w = conv_weight_from_spconv(sp)
        k = int(np.flatnonzero(w[:, 0, 0])[0])
        np.testing.assert_array_equal(offsets[k], [kx - 1, ky - 1, kz - 1])
    w = rng.standard_normal((6, 5, 7)).astype(np.float32)  # an anisotropic (1, 3, 2) kernel
    sp = conv_weight_to_spconv(w, (1, 3, 2))
    assert sp.shape == (7, 1, 3, 2, 5)
    np.testing.assert_array_equal(conv_weight_from_spconv(sp), w)


@pytest.mark.parametrize("net", ["unet42", "resnet21"])
def test_state_dict_round_trips(net):
    rng = np.random.default_rng(5)
    make = (lambda s: MinkUNet42(4, 5, width=0.25, seed=s)) if net == "unet42" else \
        (lambda s: SparseResNet21(4, width=0.25, seed=s))
    a, b = make(0), make(1)
    random_bn(a, rng)
    sp = state_dict_to_spconv(a)
    first = "stem.0.weight" if net == "unet42" else "stem.0.0.weight"
    conv0 = a.stem[0] if net == "unet42" else a.stem[0][0]
    assert sp[first].shape == (conv0.out_channels, 3, 3, 3, 4)
    if net == "unet42":
        assert sp["classifier.weight"].shape == (5, 24)  # nn.Linear's (out, in)
    b.load_state_dict(state_dict_from_spconv(b, sp))
    for (k, va), (k2, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2
        np.testing.assert_array_equal(va, vb)


def test_checkpoint_errors_name_the_layer():
    m = MinkUNet42(4, 5, width=0.25)
    sd = m.state_dict()
    bad = dict(sd)
    bad["stage2.1.main.0.weight"] = np.zeros((27, 8, 17), np.float32)
    with pytest.raises(ValueError, match=r"stage2\.1\.main\.0\.weight.*\(27, 8, 17\).*'stage2\.1\.main\.0'"):
        m.load_state_dict(bad)
    bad = dict(sd)
    del bad["dec3.0.shortcut.1.running_var"]
    bad["extra.weight"] = np.zeros(3)
    with pytest.raises(KeyError, match="dec3.0.shortcut.1.running_var.*extra.weight"):
        m.load_state_dict(bad)
    sp = state_dict_to_spconv(m)
    with pytest.raises(ValueError, match="spconv checkpoint"):
        m.load_state_dict(sp)  # 5-D weights: the hint says to convert
    sp["up2.0.weight"] = sp["up2.0.weight"][:, :1]
    with pytest.raises(ValueError, match=r"up2\.0\.weight.*'up2\.0'"):
        state_dict_from_spconv(m, sp)
    bad = dict(sd)
    bad["stem.1.weight"] = np.full_like(sd["stem.1.weight"], np.nan)
    with pytest.raises(ValueError, match="NaN"):
        m.load_state_dict(bad)


# --------------------------------------------------------------- bad input
def test_map_of_another_cloud_is_refused():
    """The issue's example: a map built on one cloud, given to a tensor of the same size
    on other coordinates, used to return that cloud's coordinates and wrong features."""
    a = ns.SparseTensor(np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32), np.ones((3, 1), np.float32))
    b = ns.SparseTensor(np.array([[5, 5, 5], [6, 5, 5], [9, 9, 9]], np.int32), np.ones((3, 1), np.float32))
    w = np.ones((27, 1, 1), np.float32)
    m = ns.sparse_conv3d(a, w, backend="reference").kernel_map
    for bk in ("reference", "cuda"):
        with pytest.raises(ValueError, match="built on other coordinates than x's"):
            ns.sparse_conv3d(b, w, kernel_map=m, backend=bk)
    # the same coordinates in a tensor made anew are fine (one comparison)
    a2 = ns.SparseTensor(np.array([[2, 0, 0], [0, 0, 0], [1, 0, 0]], np.int32), np.ones((3, 1), np.float32))
    assert np.allclose(host(ns.sparse_conv3d(a2, w, kernel_map=m, backend="reference").features), [[2], [3], [2]])
    y = ns.sparse_conv3d(a, np.ones((8, 1, 1), np.float32), 2, stride=2, backend="reference")
    with pytest.raises(ValueError, match="other coordinates"):
        ns.sparse_conv3d(ns.SparseTensor(np.array([[4, 4, 4], [8, 8, 8]], np.int32),
                                         np.ones((2, 1), np.float32), stride=2),
                         np.ones((8, 1, 1), np.float32), transposed=True, kernel_map=y.kernel_map,
                         backend="reference")


def test_features_that_are_not_finite_are_refused(rng):
    x = scan_crop(30)
    f = x.features.copy()
    f[7, 2] = np.nan
    with pytest.raises(ValueError, match=r"NaN or infinite values \(first in row 7"):
        ns.SparseTensor(x.coords, f)
    f[7, 2] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        ns.SparseTensor(x.coords, f.astype(np.float16))


def test_layer_errors_name_the_layer():
    x = scan_crop(40)
    m = MinkUNet42(4, 5, width=0.125)
    with pytest.raises(ValueError, match=r"layer 'stem\.0' .*expects 4 input channels, but x has 3"):
        m(x.with_features(x.features[:, :3].copy()))
    with pytest.raises(TypeError, match=r"layer 'stem\.0': its weight is float32 but x's features are "
                                        r"float16.*model\.to\(np\.float16\)"):
        m(x.with_features(x.features.astype(np.float16)))
    # a transposed layer whose strided layer never ran on these coordinates
    with pytest.raises(ValueError, match=r"layer 'up4\.0' .*inverts 'stage1\.0\.0', but x .* came from "
                                         r"no strided layer"):
        m.up4(ns.SparseTensor(x.coords, np.zeros((len(x), 12), np.float32), stride=2))
    # by name, as spconv's indice_key: the right name works, another one is refused
    y = m.stage1[0][0](x)
    good = nn.SparseInverseConv3d(4, 2, 2, stride=2, inverts="stage1.0.0")
    np.testing.assert_array_equal(host(good(y).coords), x.coords)
    with pytest.raises(ValueError, match=r"inverts 'stage2\.0\.0', but x .* came from 'stage1\.0\.0'"):
        nn.SparseInverseConv3d(4, 2, 2, stride=2, inverts="stage2.0.0")(y)
    with pytest.raises(ValueError, match="not on the same coordinates"):
        nn.cat(x, ns.SparseTensor(x.coords[:-1], x.features[:-1]))
    with pytest.raises(ValueError, match="stride= .* or inverts="):
        nn.SparseInverseConv3d(4, 4, 2)
    with pytest.raises(TypeError, match="dtype must be float32 or float16"):
        m.to(np.float64)


def test_stride_one_sparse_conv_is_submanifold(rng):
    """SparseConv3d with stride 1 keeps the coordinates (the Minkowski convention): a
    kernel of 3 is the submanifold layer, a kernel of 1 the product with W[0]."""
    x = scan_crop(50)
    for k in (1, 3):
        a, b = nn.SparseConv3d(4, 6, k, rng=rng), nn.SubMConv3d(4, 6, k)
        b.weight = a.weight.copy()
        ya, yb = a(x.without_maps()), b(x.without_maps())
        np.testing.assert_array_equal(host(ya.coords), x.coords)
        np.testing.assert_allclose(host(ya.features), host(yb.features), rtol=1e-6, atol=1e-6)
        if k == 1:
            np.testing.assert_allclose(host(ya.features), x.features @ a.weight[0], rtol=1e-5, atol=1e-5)
