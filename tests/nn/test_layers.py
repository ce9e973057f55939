"""The layers of numba_sc.nn: BatchNorm in training mode, Sequential's fusion, the
stride-one convention, and the errors a user gets for a layer, a tensor or a
checkpoint that does not fit (each names the layer)."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc import nn
from numba_sc.nn import pointwise as pw
from numba_sc.nn.models import MinkUNet42
from numba_sc.nn.spconv_format import state_dict_from_spconv, state_dict_to_spconv

from helpers import host, random_bn, rel_err, scan_crop


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
        m.up4(ns.SparseTensor(x.coords * 2, np.zeros((len(x), 12), np.float32), stride=2))
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
    with pytest.raises(TypeError, match=r"dtype must be float32 or float16 \(or float64 for backend='reference'\)"):
        m.to(np.int32)


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
