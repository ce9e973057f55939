"""The layer's argument checks (numba_sc.conv.arguments): each refuses what it must, by
name, and accepts what it must."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import arguments as ar
from numba_sc.gmas.autotune import heuristic_tile

from helpers import random_coords


def _tensor(rng, n=80, c=4):
    coords = np.unique(random_coords(rng, n, span=5), axis=0)
    return ns.SparseTensor(coords, rng.standard_normal((len(coords), c)).astype(np.float32))


def test_check_weight_names_the_kernel_and_the_layer():
    ar.check_weight(np.zeros((27, 4, 8), np.float32), 27, 4, np.float32, (3, 3, 3), "enc1")
    with pytest.raises(ValueError, match=r"layer 'enc1'.*kernel_size \(3, 3, 3\) \(K = 27"):
        ar.check_weight(np.zeros((9, 4, 8), np.float32), 27, 4, np.float32, (3, 3, 3), "enc1")


def test_layer_name_must_be_hashable():
    ar.check_layer_name("enc1")
    ar.check_layer_name(None)
    with pytest.raises(TypeError, match="layer must be a name"):
        ar.check_layer_name(["enc1"])
    assert ar.where(None) == "" and ar.where("a") == "layer 'a': "


def test_check_map_fits_refuses_another_cloud(rng):
    x = _tensor(rng)
    km = ns.build_kernel_map(x.coords, 3, backend="reference")
    ar.check_map_fits(x, km, False)
    moved = ns.SparseTensor(x.coords + 1, x.features)
    with pytest.raises(ValueError, match="other coordinates"):
        ar.check_map_fits(moved, km, False, "dec")
    with pytest.raises(ValueError, match="does not fit"):
        ar.check_map_fits(ns.SparseTensor(x.coords[:-1], x.features[:-1]), km, False)


def test_resolve_tiles():
    assert ar.resolve_tiles(4, 8, 16, 100, 100, np.float32, 27, False) == (4, 4)
    assert ar.resolve_tiles((2, 8), 8, 16, 100, 100, np.float32, 27, False) == (2, 8)
    assert ar.resolve_tiles(None, 8, 16, 100, 90, np.float32, 27, False, "never-tuned") == (
        heuristic_tile(8, 100, 4), heuristic_tile(16, 90, 4))
    with pytest.raises(ValueError, match="pass a pair"):
        ar.resolve_tiles(8, 8, 12, 100, 100, np.float32, 27, False)
    with pytest.raises(ValueError, match="an int or a pair"):
        ar.resolve_tiles((1, 2, 3), 8, 12, 100, 100, np.float32, 27, False)


def test_launch_rows_for():
    w = np.zeros((27, 4, 8), np.float32)
    assert ar.launch_rows_for(0, w) == 0 and ar.launch_rows_for(np.int64(7), w) == 7
    assert ar.launch_rows_for(None, w) == ns.gmas.gemm_grouping.launch_rows(4, 8, 4)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="launch_rows must be"):
            ar.launch_rows_for(bad, w)
