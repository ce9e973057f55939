"""What a layer reads before its dataflow (numba_sc.conv.prepare): the map and its plan,
compared with the map and plan built directly, and kept on the map when asked."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import prepare
from numba_sc.gmas import gemm_grouping as gg

from helpers import random_coords


def _tensor(rng, n=120, c=4):
    coords = np.unique(random_coords(rng, n, span=5), axis=0)
    return ns.SparseTensor(coords, rng.standard_normal((len(coords), c)).astype(np.float32))


def _same_plan(a, b):
    assert a.rows == b.rows and a.n_out == b.n_out and a.centre == b.centre
    np.testing.assert_array_equal(np.asarray(a.in_table), np.asarray(b.in_table))
    np.testing.assert_array_equal(np.asarray(a.out_table), np.asarray(b.out_table))


def test_prepare_layer_is_the_map_and_plan_built_directly(rng):
    x = _tensor(rng)
    w = (rng.standard_normal((27, 4, 4)) / 3).astype(np.float32)
    f, wd, km, plan = prepare.prepare_layer(x, w, 3, 1, 1, False, None, "reference")
    want_km = ns.build_kernel_map(x.coords, 3, backend="reference")
    np.testing.assert_array_equal(np.asarray(km.table), np.asarray(want_km.table))
    _same_plan(plan, ns.build_plan(want_km, backend="reference",
                                   launch_rows=gg.launch_rows(4, 4, 4)))
    assert f is x.features or np.array_equal(f, x.features)
    with pytest.raises(AssertionError):  # the comparison sees a plan of another policy
        _same_plan(plan, ns.build_plan(want_km, sort=False, max_padding=0.0, launch_rows=0, backend="reference"))


def test_layer_plan_is_kept_on_the_map_per_policy(rng):
    km = ns.build_kernel_map(_tensor(rng).coords, 3, backend="reference")
    args = (True, gg.DEFAULT_MAX_PADDING, gg.DEFAULT_SOLO_ROWS, None, 0, "reference")
    first = prepare.layer_plan(km, *args)
    assert prepare.layer_plan(km, *args) is first
    assert prepare.gmas_plan(km, True, False, *args) is first  # keep: the kept plan
    fresh = prepare.gmas_plan(km, False, False, *args)
    assert fresh is not first  # not kept: built for the call, the same plan
    _same_plan(fresh, first)
    assert prepare.layer_plan(km, False, *args[1:]) is not first  # another policy: another plan


def test_transposed_layer_needs_the_strided_map(rng):
    x = _tensor(rng)
    w = np.zeros((8, 4, 4), np.float32)
    with pytest.raises(ValueError, match="transposed=True needs kernel_map="):
        prepare.map_layer(x, w, 2, 2, 1, True, None, "reference")
    with pytest.raises(TypeError, match="x must be a numba_sc.SparseTensor"):
        prepare.map_layer(x.features, w, 2, 2, 1, False, None, "reference", layer="enc1")
