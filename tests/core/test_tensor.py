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
