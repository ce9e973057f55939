"""SparseTensor: coordinates sorted once on construction, features that are not
finite refused. (The errors of a tensor given to a layer are in conv/test_layer.py.)"""
import numpy as np
import pytest

import numba_sc
import numba_sc as ns
from numba_sc import SparseTensor

from helpers import cloud, scan_crop


def test_sparse_tensor_sorts_once(rng):
    c = cloud(rng, 50) * 2  # a stride-2 tensor lives on even coordinates
    f = rng.standard_normal((len(c), 2)).astype(np.float32)
    x = SparseTensor(c, f, stride=2)
    keys = numba_sc.pack_keys(x.coords)
    assert (np.diff(keys) > 0).all()
    np.testing.assert_array_equal(x.coords, c[x.order])
    np.testing.assert_array_equal(x.features, f[x.order])
    assert x.stride == (2, 2, 2) and x.kernel_map is None and len(x) == len(c)


def test_features_that_are_not_finite_are_refused(rng):
    x = scan_crop(30)
    f = x.features.copy()
    f[7, 2] = np.nan
    with pytest.raises(ValueError, match=r"NaN or infinite values \(first in row 7"):
        ns.SparseTensor(x.coords, f)
    f[7, 2] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        ns.SparseTensor(x.coords, f.astype(np.float16))


def _down_up(rng):
    """A stride-2 layer and the transposed layer that inverts it, on the reference backend."""
    from numba_sc import nn

    down = nn.SparseConv3d(2, 3, 2, stride=2, rng=rng)
    up = nn.SparseInverseConv3d(3, 2, 2, inverts=down, rng=rng)
    return down, up


def test_a_network_s_maps_go_with_its_tensors_without_the_cycle_collector(rng):
    """The finer coordinate set holds the coarser (``down``); the coarser's link back
    (``up``) is weak, so the two make no reference cycle: once the tensors are gone,
    their maps are freed at once, not whenever Python's cyclic collector runs (for
    device arrays: memory held into the next pass)."""
    import gc
    import weakref

    down, up = _down_up(rng)
    c = cloud(rng, 200)
    x = SparseTensor(c, rng.standard_normal((len(c), 2)).astype(np.float32))
    gc.collect()
    gc.disable()
    try:
        coarse = down(x, backend="reference")
        y = up(coarse, backend="reference")
        assert y.maps is x.maps  # back on the input's set, with its maps
        gone = [weakref.ref(x.maps), weakref.ref(coarse.maps), weakref.ref(coarse.kernel_map)]
        del x, coarse, y
        assert [r() for r in gone] == [None, None, None]
    finally:
        gc.enable()


def test_the_link_back_to_a_finer_set_that_is_gone_gives_a_fresh_set(rng):
    down, up = _down_up(rng)
    c = cloud(rng, 200)
    x = SparseTensor(c, rng.standard_normal((len(c), 2)).astype(np.float32))
    coarse = down(x, backend="reference")
    key, (km, fine, layer) = coarse.maps.up.items()[0]
    assert fine is x.maps and layer is down and km is coarse.kernel_map
    want = up(coarse, backend="reference").features
    del x, fine
    km2, fresh, layer2 = coarse.maps.up[key]  # the finer set is gone: an empty one on its coordinates
    assert km2 is km and layer2 is down and not fresh.subm and not fresh.down
    assert coarse.maps.up.get(key)[1] is fresh  # kept (weakly) for the next reader while it lives
    y = up(coarse, backend="reference")  # the transposed layer still finds the map, lands on that set
    assert y.maps is fresh
    np.testing.assert_array_equal(y.features, want)
