"""The implicit GEMM's driver (numba_sc.dataflows.implicit_driver): the device plan equals
the NumPy plan, the library's rung and launcher give the reference's result, and the
tensor-core switch is read through numba_sc.core.state."""
import numpy as np
import pytest

import numba_sc
from numba_sc.core.backend import to_host
from numba_sc.dataflows import implicit_driver as idr
from numba_sc.dataflows import implicit_gemm as ig


def _layer(rng, c_in=6, c_out=5):
    c = np.unique(rng.integers(0, 5, size=(40, 3)), axis=0).astype(np.int32)
    table = np.asarray(numba_sc.build_kernel_map(c, 3, backend="reference").table)
    f = rng.standard_normal((len(c), c_in)).astype(np.float32)
    w = (rng.standard_normal((table.shape[0], c_in, c_out)) / 3).astype(np.float32)
    return table, f, w


@pytest.mark.parametrize("splits", [1, 2])
def test_device_plan_is_the_numpy_plan(rng, splits):
    table, _, _ = _layer(rng)
    got = idr.implicit_plan(table, splits, 13).host()
    want = ig.implicit_plan_reference(table, splits, 13)
    np.testing.assert_array_equal(got.order, want.order)
    np.testing.assert_array_equal(got.tile_masks, want.tile_masks)
    assert got.bounds == want.bounds
    other = ig.implicit_plan_reference(table, splits, -1)  # the centre kept: other masks
    assert not np.array_equal(got.tile_masks, other.tile_masks)


@pytest.mark.parametrize("rung", ["v1", "v3"])  # (v2, slow under the simulator: test_implicit_gemm.py)
def test_rungs_and_the_library_give_the_reference(rng, rung):
    table, f, w = _layer(rng)
    plan = idr.implicit_plan(table, 2, 13)
    want = ig.implicit_gemm_reference(f, w, table, None, 13)
    got = to_host(idr.implicit_gemm_rung(rung, f, w, table, plan))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_host(idr.implicit_gemm_cuda(f, w, table, plan)), want, rtol=1e-5, atol=1e-5)
    bad = to_host(idr.implicit_gemm_rung(rung, f, np.roll(w, 1, axis=0), table, plan))
    assert not np.allclose(bad, want, rtol=1e-5, atol=1e-5)


def test_tensor_core_switch(monkeypatch):
    numba_sc.clear_caches()
    monkeypatch.setenv("NUMBA_SC_TENSOR_CORES", "0")
    try:
        assert idr.tensor_cores_here() is False
        assert idr.library_rung(np.float16, 64, 64) == "v3"
    finally:
        monkeypatch.delenv("NUMBA_SC_TENSOR_CORES")
        numba_sc.clear_caches()
    assert idr.library_rung(np.float16, 64, 64) == "v4"  # (the simulator runs the mma's stand-in)
    assert idr.library_rung(np.float32, 64, 64) == "v3"
    assert idr.library_rung(np.float16, 4, 64) == "v3"  # below TENSOR_CORE_MIN_CHANNELS
