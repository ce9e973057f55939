"""Fetch-on-demand (numba_sc.dataflows.fetch_on_demand): the plan, the reference and every rung.

Checked against a float64 oracle written here from the rule alone (a loop over
the table's pairs: ``out[i] += features[table[k, i]] @ W[k]`` for every k != skip),
under the CUDA simulator (conftest), on small clouds: the simulator runs every
CUDA thread as a Python thread, so a kernel's cost grows with pairs x C_in x C_out.

Tolerances (relative to the result's norm): float32 1e-5 (fp32 rounding of sums
of up to K products, in an order the atomics choose); float16 2e-3 (inputs in
half precision, sums in fp32, one rounding to half precision at the end: unit
roundoff 4.9e-4, with the kernel and the reference free to round a sum either
way when their fp32 sums differ in the last bit).
"""
import numpy as np
import pytest

import numba_sc
from numba_sc.dataflows import fetch_driver as fdr
from numba_sc.dataflows import fetch_on_demand as fd
from numba_sc.dataflows import fetch_shapes as fsh
from numba_sc.core.backend import to_host

RTOL32 = 1e-5
RTOL16 = 2e-3


# ------------------------------------------------------------------- helpers
def cloud(rng, n, extent=8, flat=False):
    """About n unique random voxels in an extent^3 box (flat: all at z = 0)."""
    c = rng.integers(0, extent, size=(n, 3))
    if flat:
        c[:, 2] = 0
    c = np.unique(c, axis=0)
    return c[rng.permutation(len(c))].astype(np.int32)  # unsorted, as a user may pass


def kmap(rng, n, kernel_size=3, stride=1, extent=8, flat=False):
    return numba_sc.build_kernel_map(cloud(rng, n, extent, flat), kernel_size, stride, backend="reference")


def data(rng, n_in, K, c_in, c_out, dtype=np.float32):
    f = rng.standard_normal((n_in, c_in)).astype(dtype)
    w = (rng.standard_normal((K, c_in, c_out)) / np.sqrt(c_in)).astype(dtype)
    return f, w


def oracle(features, weight, table, init=None, skip=-1):
    """float64, pair by pair: the rule as the module docstring states it."""
    f = np.asarray(features, np.float64)
    w = np.asarray(weight, np.float64)
    K, n_out = table.shape
    out = np.zeros((n_out, w.shape[2])) if init is None else np.array(init, np.float64)
    for k in range(K):
        if k == skip:
            continue
        for i in range(n_out):
            j = table[k, i]
            if j >= 0:
                out[i] += f[j] @ w[k]
    return out


def rel_err(got, want):
    got, want = to_host(got).astype(np.float64), to_host(want).astype(np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close(got, want, rtol):
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def rtol(dtype):
    return RTOL32 if np.dtype(dtype) == np.float32 else RTOL16


def run_all(f, w, km, init=None, skip=-1, rungs=fd.LADDER.names, tile_p=None):
    """Reference and each rung, each checked against the oracle and the reference."""
    table = km.table
    want = oracle(f, w, table, init, skip)
    ref = fd.fetch_on_demand_reference(f, w, table, init, skip)
    assert ref.dtype == f.dtype and ref.shape == want.shape
    assert_close(ref, want, rtol(f.dtype))
    plan = fdr.fetch_plan(table, km.host_counts(), skip, tile_p)
    for rung in rungs:
        got = fdr.fetch_on_demand_rung(rung, f, w, plan, table.shape[1], init)
        assert got.dtype == f.dtype, rung
        assert_close(got, want, rtol(f.dtype))
        assert_close(got, ref, rtol(f.dtype))
    return ref


def plans_equal(a, b):
    for name in ("in_rows", "out_rows", "block_offset", "block_start", "block_stop", "starts"):
        x, y = to_host(getattr(a, name)), to_host(getattr(b, name))
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.n_out, a.tile_p, a.skip, a.K, a.n_pairs) == (b.n_out, b.tile_p, b.skip, b.K, b.n_pairs)


# ---------------------------------------------------------- worked example
def test_worked_example_of_the_docstring():
    table = np.array([[-1, 0, -1], [0, 1, 2], [1, -1, -1]], np.int32)
    counts = np.array([1, 3, 1])
    f = np.array([[1], [2], [3]], np.float32)
    w = np.array([10, 100, 1000], np.float32).reshape(3, 1, 1)
    init = f * 100  # the centre, done densely
    plan = fdr.fetch_plan(table, counts, skip=1, tile_p=64)
    assert plan.in_rows.tolist() == [0, 1] and plan.out_rows.tolist() == [1, 0]
    assert plan.block_offset.tolist() == [0, 2]
    assert plan.block_start.tolist() == [0, 1] and plan.block_stop.tolist() == [1, 2]
    want = [[2100], [210], [300]]
    assert fd.fetch_on_demand_reference(f, w, table, init, skip=1).tolist() == want
    for rung in fd.LADDER.names:
        assert fdr.fetch_on_demand_rung(rung, f, w, plan, 3, init).tolist() == want
    assert init.tolist() == [[100], [200], [300]]  # not modified


# ------------------------------------------------ reference against the oracle
@pytest.mark.parametrize("kernel_size, stride", [(3, 1), (2, 2), (3, 2), (5, 1)])
def test_reference_matches_oracle(rng, kernel_size, stride):
    km = kmap(rng, 300, kernel_size, stride)
    f, w = data(rng, len(km.in_coords), km.table.shape[0], 7, 5)
    for skip in (-1, km.table.shape[0] // 2):
        init = rng.standard_normal((km.table.shape[1], 5)).astype(np.float32) if skip >= 0 else None
        assert_close(fd.fetch_on_demand_reference(f, w, km.table, init, skip), oracle(f, w, km.table, init, skip),
                     RTOL32)


# --------------------------------------------------------------- the rungs
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rungs_match_reference(rng, dtype):
    km = kmap(rng, 250, extent=10)
    assert km.table.shape[1] > 200
    f, w = data(rng, len(km.in_coords), 27, 7, 6, dtype)  # neither a multiple of a tile
    run_all(f, w, km)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_v2_several_channel_tiles(rng, dtype):
    """C_in = 19 and C_out = 17: three depth steps and three channel tiles (simulated
    tiles are 8 deep and 8 wide), the last of each partly past the end."""
    km = kmap(rng, 50)
    f, w = data(rng, len(km.in_coords), 27, 19, 17, dtype)
    assert fsh.v2_tiles(19, 17, simulated=True)[1:3] == (8, 8)
    run_all(f, w, km, rungs=("v2",))


@pytest.mark.parametrize("dtype, rungs", [(np.float32, ("v1", "v2")), (np.float16, ("v2",))])
def test_skip_with_init(rng, dtype, rungs):
    km = kmap(rng, 100)
    f, w = data(rng, len(km.in_coords), 27, 6, 5, dtype)
    centre = 13  # (0, 0, 0): every point its own pair
    init = (f.astype(np.float32) @ w[centre].astype(np.float32)).astype(dtype)
    ref = run_all(f, w, km, init, skip=centre, rungs=rungs)
    # the same as running the centre through the pairs (up to the extra rounding of init)
    assert_close(ref, oracle(f, w, km.table), rtol(dtype) * 2)


def test_strided_map(rng):
    km = kmap(rng, 150, kernel_size=3, stride=2)
    assert km.table.shape[1] < len(km.in_coords)  # n_out != n_in
    f, w = data(rng, len(km.in_coords), 27, 5, 6)
    run_all(f, w, km)


def test_5x5x5_kernel(rng):
    km = kmap(rng, 50, kernel_size=5)
    assert km.table.shape[0] == 125
    f, w = data(rng, len(km.in_coords), 125, 4, 3)
    run_all(f, w, km, skip=62)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_three_channels_in_one_out(rng, dtype):
    km = kmap(rng, 150)
    f, w = data(rng, len(km.in_coords), 27, 3, 1, dtype)
    run_all(f, w, km)


def test_offsets_with_zero_pairs(rng):
    km = kmap(rng, 40, flat=True)  # one plane: every offset with dz != 0 has no pair
    counts = km.host_counts()
    assert (counts == 0).sum() == 18 and counts.sum() > 0
    f, w = data(rng, len(km.in_coords), 27, 5, 4)
    run_all(f, w, km, tile_p=5)
    plan = fdr.fetch_plan(km.table, counts, tile_p=5)
    assert set(to_host(plan.block_offset).tolist()) == set(np.flatnonzero(counts).tolist())  # no block for them


def test_plan_blocks_span_several_kernel_tiles(rng):
    """A plan block of 20 pairs is 3 of the simulator's 8-pair kernel tiles (8, 8, 4)."""
    km = kmap(rng, 80)
    f, w = data(rng, len(km.in_coords), 27, 5, 6)
    run_all(f, w, km, skip=13, init=np.ones((km.table.shape[1], 6), np.float32), tile_p=20, rungs=("v2",))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_tiles_under_the_simulator(rng, dtype):
    """The tiles the H100 runs (64 pairs a block, 128 threads) on a small map of a
    (1, 3, 1) kernel (K = 3: few blocks), the centre's 150 pairs in three blocks."""
    km = kmap(rng, 150, kernel_size=(1, 3, 1))
    assert km.table.shape[0] == 3 and km.host_counts()[1] > 128
    f, w = data(rng, len(km.in_coords), 3, 6, 5, dtype)
    tiles = fsh.v2_tiles(6, 5, simulated=False)
    assert tiles == (64, 8, 8, 4, 1)
    plan = fdr.fetch_plan(km.table, km.host_counts(), tile_p=64)
    got = fdr.fetch_on_demand_rung("v2", f, w, plan, km.table.shape[1], tiles=tiles)
    assert_close(got, fd.fetch_on_demand_reference(f, w, km.table), rtol(dtype))


def test_no_pairs_gives_init(rng):
    table = np.full((27, 10), -1, np.int32)
    table[13] = np.arange(10)
    f, w = data(rng, 10, 27, 4, 3)
    init = rng.standard_normal((10, 3)).astype(np.float32)
    plan = fdr.fetch_plan(table, (table >= 0).sum(1), skip=13)
    assert plan.n_pairs == 0 and plan.n_blocks == 0
    for rung in fd.LADDER.names:
        np.testing.assert_array_equal(to_host(fdr.fetch_on_demand_rung(rung, f, w, plan, 10, init)), init)
        np.testing.assert_array_equal(to_host(fdr.fetch_on_demand_rung(rung, f, w, plan, 10)),
                                      np.zeros((10, 3), np.float32))
    assert fdr.fetch_on_demand_cuda(f, w, plan, 10, init) is not init


# ------------------------------------------------------------------ the plan
def test_plan_kernel_matches_reference(rng):
    for km in (kmap(rng, 200), kmap(rng, 150, 3, 2), kmap(rng, 50, flat=True)):
        counts = km.host_counts()
        K = km.table.shape[0]
        for skip, tile_p in ((-1, None), (K // 2, 1), (0, 7), (K - 1, 64)):
            plan = fdr.fetch_plan(km.table, counts, skip, tile_p)
            plans_equal(plan, fd.fetch_plan_reference(km.table, counts, skip, tile_p))
            # every pair once, blocks within their offset's range and at most tile_p long
            n = int(counts.sum() - (counts[skip] if skip >= 0 else 0))
            assert plan.n_pairs == n == len(plan.in_rows)
            s = plan.starts
            b_off, b0, b1 = (to_host(a) for a in (plan.block_offset, plan.block_start, plan.block_stop))
            assert np.all(b0 >= s[b_off]) and np.all(b1 <= s[b_off + 1]) and np.all(b1 - b0 >= 1)
            assert np.all(b1 - b0 <= plan.tile_p) and np.array_equal(np.sort(b0), b0)
            k_of_pair = np.repeat(np.arange(K), np.diff(s))
            assert np.array_equal(km.table[k_of_pair, to_host(plan.out_rows)], to_host(plan.in_rows))


def test_plan_reference_checks_counts(rng):
    km = kmap(rng, 80)
    counts = km.host_counts().copy()
    counts[3] += 1
    with pytest.raises(ValueError, match="counts_host"):
        fd.fetch_plan_reference(km.table, counts)


# ------------------------------------------- the comparison catches mistakes
def test_comparison_catches_an_off_by_one(rng):
    km = kmap(rng, 60)
    f, w = data(rng, len(km.in_coords), 27, 4, 4)
    ref = fd.fetch_on_demand_reference(f, w, km.table)
    plan = fdr.fetch_plan(km.table, km.host_counts())
    assert_close(fdr.fetch_on_demand_rung("v2", f, w, plan, km.table.shape[1]), ref, RTOL32)

    shifted = fsh.FetchPlan(**{**plan.__dict__, "out_rows": plan.out_rows.copy()})
    p = int(np.flatnonzero(to_host(plan.out_rows) < km.table.shape[1] - 1)[0])
    shifted.out_rows[p] += 1  # one pair's output row off by one
    err = rel_err(fdr.fetch_on_demand_rung("v2", f, w, shifted, km.table.shape[1]), ref)
    assert err > 1000 * RTOL32, err  # one product moved: far beyond the fp32 tolerance
    with pytest.raises(AssertionError):
        assert_close(fdr.fetch_on_demand_rung("v1", f, w, shifted, km.table.shape[1]), ref, RTOL32)

    counts = km.host_counts()
    k = int(np.flatnonzero((counts > 0) & (np.arange(27) != 13))[0])
    dropped = fdr.fetch_plan(km.table, counts, skip=k)  # one offset left out, no init for it
    assert rel_err(fdr.fetch_on_demand_rung("v2", f, w, dropped, km.table.shape[1]), ref) > 1000 * RTOL32


# ---------------------------------------------------------------- bad input
def test_bad_input(rng):
    km = kmap(rng, 40)
    K, n_out = km.table.shape
    counts = km.host_counts()
    f, w = data(rng, len(km.in_coords), K, 4, 3)
    plan = fdr.fetch_plan(km.table, counts)
    with pytest.raises(TypeError, match="weight"):
        fdr.fetch_on_demand_cuda(f, w.astype(np.float16), plan, n_out)
    with pytest.raises(TypeError, match="features"):
        fdr.fetch_on_demand_cuda(f.astype(np.float64), w, plan, n_out)
    with pytest.raises(ValueError, match="weight"):
        fdr.fetch_on_demand_cuda(f, w[:, :3], plan, n_out)  # C_in 3 != 4
    with pytest.raises(ValueError, match="weight"):
        fdr.fetch_on_demand_cuda(f, w[:5], plan, n_out)  # K 5 != 27
    with pytest.raises(ValueError, match="weight"):
        fd.fetch_on_demand_reference(f, w[0], km.table)
    with pytest.raises(TypeError, match="table"):
        fdr.fetch_plan(km.table.astype(np.int64), counts)
    with pytest.raises(ValueError, match="table"):
        fdr.fetch_plan(km.table[0], counts)
    with pytest.raises(TypeError, match="table"):
        fd.fetch_on_demand_reference(f, w, km.table.astype(np.int64))
    with pytest.raises(ValueError, match="counts_host"):
        fdr.fetch_plan(km.table, counts[:-1])
    with pytest.raises(ValueError, match="skip"):
        fdr.fetch_plan(km.table, counts, skip=K)
    with pytest.raises(ValueError, match="tile_p"):
        fdr.fetch_plan(km.table, counts, tile_p=0)
    with pytest.raises(ValueError, match="init"):
        fdr.fetch_on_demand_cuda(f, w, plan, n_out, init=np.zeros((n_out, 4), np.float32))
    with pytest.raises(ValueError, match="init"):
        fd.fetch_on_demand_reference(f, w, km.table, init=np.zeros((n_out + 1, 3), np.float32))
    with pytest.raises(ValueError, match="n_out"):
        fdr.fetch_on_demand_cuda(f, w, plan, n_out + 1)
    with pytest.raises(TypeError, match="plan"):
        fdr.fetch_on_demand_cuda(f, w, km.table, n_out)
    with pytest.raises(ValueError, match="rung"):
        fdr.fetch_on_demand_rung("v9", f, w, plan, n_out)
