"""Fetch-on-demand's driver (numba_sc.dataflows.fetch_driver): the device pair list equals
the NumPy one, and the library's launcher gives the reference's result."""
import numpy as np
import pytest

import numba_sc
from numba_sc.core.backend import to_host
from numba_sc.dataflows import fetch_driver as fdr
from numba_sc.dataflows import fetch_on_demand as fd


def _layer(rng, c_in=5, c_out=4):
    c = np.unique(rng.integers(0, 5, size=(40, 3)), axis=0).astype(np.int32)
    km = numba_sc.build_kernel_map(c, 3, backend="reference")
    f = rng.standard_normal((len(c), c_in)).astype(np.float32)
    w = (rng.standard_normal((27, c_in, c_out)) / 3).astype(np.float32)
    return np.asarray(km.table), km.host_counts(), f, w


def test_device_plan_is_the_numpy_plan(rng):
    table, counts, _, _ = _layer(rng)
    got = fdr.fetch_plan(table, counts, skip=13, tile_p=16)
    want = fd.fetch_plan_reference(table, counts, skip=13, tile_p=16)
    for name in ("in_rows", "out_rows", "block_offset", "block_start", "block_stop"):
        np.testing.assert_array_equal(to_host(getattr(got, name)), getattr(want, name))
    assert not np.array_equal(to_host(got.in_rows), fd.fetch_plan_reference(table, counts, tile_p=16).in_rows)


def test_v1_and_the_library_give_the_reference(rng):
    rung = "v1"  # (the library runs v2)
    table, counts, f, w = _layer(rng)
    init = rng.standard_normal((table.shape[1], 4)).astype(np.float32)
    plan = fdr.fetch_plan(table, counts, skip=13)
    want = fd.fetch_on_demand_reference(f, w, table, init, 13)
    got = to_host(fdr.fetch_on_demand_rung(rung, f, w, plan, table.shape[1], init))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    lib = to_host(fdr.fetch_on_demand_cuda(f, w, plan, table.shape[1], init))
    np.testing.assert_allclose(lib, want, rtol=1e-5, atol=1e-5)
    bad = to_host(fdr.fetch_on_demand_rung(rung, f, np.roll(w, 1, axis=0), plan, table.shape[1], init))
    assert not np.allclose(bad, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rung must be one of"):
        fdr.fetch_on_demand_rung("v3", f, w, plan, table.shape[1])
