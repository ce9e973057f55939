"""The implicit GEMM's shapes (numba_sc.dataflows.implicit_shapes): tile choices, checks,
and the per-split launcher, whose result is compared with the NumPy reference."""
import numpy as np
import pytest

import numba_sc
from numba_sc.core.backend import to_device, to_host
from numba_sc.dataflows import implicit_gemm as ig
from numba_sc.dataflows import implicit_shapes as ish


def _layer(rng, c_in=6, c_out=5):
    c = np.unique(rng.integers(0, 5, size=(40, 3)), axis=0).astype(np.int32)
    table = np.asarray(numba_sc.build_kernel_map(c, 3, backend="reference").table)
    f = rng.standard_normal((len(c), c_in)).astype(np.float32)
    w = (rng.standard_normal((table.shape[0], c_in, c_out)) / 3).astype(np.float32)
    return table, f, w


def test_tiles_follow_the_channels():
    tiles = ish.implicit_tiles(16, 3, 16)
    assert tiles.tile_k == max(4, ish.pow2_at_least(3)) and tiles.tile_n == 16
    assert ish.tensor_tiles(16, 16) == ish.TensorTiles(16, 16, 4, 4)
    assert ish.tensor_tiles(33, 6) == ish.TensorTiles(16, 32, 1, 2)
    assert ish.v4_shape(64, 64) == (2, 2, 2, 4)  # 2 x 2 warps of 32 x 32
    assert ish.v4_shape(64, 16) == (4, 1, 1, 2)
    assert ish.cdiv(7, 2) == 4 and ish.pow2_at_least(5) == 8


def test_checks_refuse_by_name(rng):
    table, f, w = _layer(rng)
    assert ish.check_inputs(f, w, table) == (27, table.shape[1], 6, 5)
    with pytest.raises(TypeError, match="table must be int32"):
        ish.check_inputs(f, w, table.astype(np.int64))
    with pytest.raises(ValueError, match="skip must be"):
        ish.check_skip(27, 27)
    with pytest.raises(ValueError, match="tile_m must be one of"):
        ish.check_plan_args(table, 1, -1, 48)
    with pytest.raises(ValueError, match="features has"):
        ish.check_rows(np.array([[0, 5]], np.int32), 3)


@pytest.mark.parametrize("splits", [1, 3])
def test_run_splits_is_the_reference(rng, splits):
    """One launch of v3 per split, each later split adding onto the last: the reference's
    sum; a weight shifted by one offset is caught."""
    table, f, w = _layer(rng)
    init = rng.standard_normal((table.shape[1], 5)).astype(np.float32)
    plan = ig.implicit_plan_reference(table, splits, 13).device()
    tiles = ish.implicit_tiles(plan.tile_m, 6, 5)
    threads = (plan.tile_m // tiles.thread_m) * (tiles.tile_n // tiles.thread_n)
    blocks = plan.n_tiles * ish.cdiv(5, tiles.tile_n)

    def run(weight):
        return to_host(ish.run_splits(ig.implicit_gemm_v3(plan.tile_m, *tiles), to_device(f), to_device(weight),
                                      to_device(table), plan, init, 5, np.float32, threads, blocks))

    want = ig.implicit_gemm_reference(f, w, table, init, 13)
    np.testing.assert_allclose(run(w), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(run(np.roll(w, 1, axis=0)), want, rtol=1e-5, atol=1e-5)
