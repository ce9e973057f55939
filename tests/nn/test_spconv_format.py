"""Weights in spconv's layout: the worked example, the kernel positions against this
library's offsets, and whole state dicts of both networks round-tripped."""
import numpy as np
import pytest

from numba_sc import kernel_offsets
from numba_sc.nn.models import MinkUNet42, SparseResNet21
from numba_sc.nn.spconv_format import (conv_weight_from_spconv, conv_weight_to_spconv,
                                       state_dict_from_spconv, state_dict_to_spconv)

from helpers import random_bn


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
