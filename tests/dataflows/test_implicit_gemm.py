"""The implicit GEMM dataflow (numba_sc.dataflows.implicit_gemm): plan, reference and every rung.

Three ways again: the kernels (under the CUDA simulator here, on the GPU with
NUMBA_ENABLE_CUDASIM=0), the NumPy reference, and a float64 oracle written below
from the output rule alone (a loop over the table's pairs).

Tolerances, relative to the norm of the result: float32 1e-5 (sums of a few
dozen products in another order); float16 5e-3 (inputs and output in half
precision, 11 significant bits; sums in float32, rounded once).

v4 (tensor cores) calls linked CUDA C++, which the simulator cannot run: its
tests against the reference run on a GPU only (skipped here, with the reason);
under the simulator the tests check that the ladder says so and runs v3.

The simulator runs one Python thread per CUDA thread, so the clouds are small
(a few dozen to a few hundred outputs) and sparse, and the channel counts are
picked to cross the simulator's tiles (chunks of 8 input channels, 16 output
channels, 16 outputs) rather than to be large.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import numba_sc
from numba_sc.dataflows import implicit_driver as idr
from numba_sc.dataflows import implicit_gemm as ig
from numba_sc.dataflows import implicit_shapes as ish
from numba_sc.dataflows import tensor_cores as tc
from numba_sc.core.backend import to_device, to_host
from numba_sc.core.conventions import MASK_BITS
from numba_sc.core.rungs import Ladder
from numba_sc.tools import ladder

RTOL32 = 1e-5
RTOL16 = 5e-3
CENTRE = 13  # the centre offset of a 3x3x3 kernel


# ------------------------------------------------------------------- helpers
def cloud(rng, n, extent):
    """About n unique random voxels in an extent^3 box, int32."""
    c = np.unique(rng.integers(0, extent, size=(n, 3)), axis=0)
    return c[rng.permutation(len(c))].astype(np.int32)


def layer(rng, n=120, extent=9, kernel_size=3, stride=1, c_in=6, c_out=5, dtype=np.float32):
    """A map's table, features in the map's input order and weights."""
    km = numba_sc.build_kernel_map(cloud(rng, n, extent), kernel_size, stride, backend="reference")
    table = np.asarray(km.table)
    f = rng.standard_normal((len(km.in_coords), c_in)).astype(dtype)
    w = (rng.standard_normal((table.shape[0], c_in, c_out)) / np.sqrt(c_in)).astype(dtype)
    return table, f, w


def oracle(features, weight, table, init=None, skip=-1):
    """float64, pair by pair: out[i] += features[table[k, i]] @ weight[k]."""
    f = np.asarray(features, np.float64)
    w = np.asarray(weight, np.float64)
    out = np.zeros((table.shape[1], w.shape[2])) if init is None else np.array(init, np.float64)
    for k in range(table.shape[0]):
        if k == skip:
            continue
        for i in range(table.shape[1]):
            j = table[k, i]
            if j >= 0:
                out[i] += f[j] @ w[k]
    return out


def rel_err(got, want):
    got = np.asarray(to_host(got), np.float64)
    want = np.asarray(to_host(want), np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close(got, want, rtol):
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def tol(dtype):
    return RTOL32 if np.dtype(dtype) == np.float32 else RTOL16


def centre_init(f, w, rng):
    """A stand-in for the caller's centre product (any array of the right shape)."""
    return rng.standard_normal((f.shape[0], w.shape[2])).astype(f.dtype)


# -------------------------------------------------------------- the reference
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("with_centre", [False, True])
def test_reference_matches_oracle(rng, dtype, with_centre):
    table, f, w = layer(rng, c_in=5, c_out=7, dtype=dtype)
    init = centre_init(f, w, rng) if with_centre else None
    skip = CENTRE if with_centre else -1
    got = ig.implicit_gemm_reference(f, w, table, init, skip)
    assert got.dtype == np.dtype(dtype)
    assert_close(got, oracle(f, w, table, init, skip), tol(dtype))


def test_skip_plus_centre_product_is_the_whole_sum(rng):
    """Skipping the centre and passing its product as init gives the full sum."""
    table, f, w = layer(rng, c_in=4, c_out=3)
    full = ig.implicit_gemm_reference(f, w, table)
    centre = oracle(f, w[CENTRE:CENTRE + 1], table[CENTRE:CENTRE + 1]).astype(np.float32)
    assert_close(ig.implicit_gemm_reference(f, w, table, centre, skip=CENTRE), full, RTOL32)
    plan = idr.implicit_plan(table, skip=CENTRE)
    assert_close(idr.implicit_gemm_cuda(f, w, table, plan, centre), full, RTOL32)


# ------------------------------------------------------------------- the plan
def test_worked_example_of_the_docstring():
    table = np.array([[5, -1, 7, -1], [-1, 2, -1, 3], [0, -1, 4, -1]], dtype=np.int32)
    for make in (ig.implicit_plan_reference, idr.implicit_plan):
        plan = make(table, tile_m=16).host()
        assert plan.order.tolist() == [[1, 3, 0, 2]]
        assert ig.output_masks_reference(table).tolist() == [[0b101, 0b010, 0b101, 0b010]]
    # with tiles of two rows (built by hand: the kernels take tile_m >= 16)
    masks = ig.output_masks_reference(table)[0]
    natural = [masks[0] | masks[1], masks[2] | masks[3]]
    ordered = [masks[1] | masks[3], masks[0] | masks[2]]
    assert sum(2 * int(m).bit_count() for m in natural) == 12
    assert sum(2 * int(m).bit_count() for m in ordered) == 6 == int((table >= 0).sum())


@pytest.mark.parametrize("kernel_size,splits,skip,tile_m", [
    (3, 1, -1, 16), (3, 2, CENTRE, 16), (3, 3, CENTRE, 32), (3, 27, 0, 16), (5, 1, 62, 16), (5, 4, -1, 64)])
def test_plan_kernel_equals_plan_reference(rng, kernel_size, splits, skip, tile_m):
    table, _, _ = layer(rng, n=150, extent=8, kernel_size=kernel_size)
    got = idr.implicit_plan(table, splits, skip, tile_m).host()
    want = ig.implicit_plan_reference(table, splits, skip, tile_m)
    np.testing.assert_array_equal(got.order, want.order)
    np.testing.assert_array_equal(got.tile_masks, want.tile_masks)
    assert got.bounds == want.bounds and got.skip == skip and got.tile_m == tile_m
    # what the plan promises, checked from the table alone
    K, n_out = table.shape
    for s, (k0, k1) in enumerate(want.bounds):
        assert sorted(want.order[s].tolist()) == list(range(n_out))  # a permutation
        ks = [k for k in range(k0, k1) if k != skip]
        sub = (table[ks] >= 0)[:, want.order[s]]  # the split's sub-masks, in order
        key = [tuple(col[::-1]) for col in sub.T.tolist()]  # highest offset most significant
        assert key == sorted(key)  # sorted by mask
        for t in range(want.n_tiles):
            rows = sub[:, t * tile_m:(t + 1) * tile_m].any(axis=1)
            bits = [k for k in range(K) if (want.tile_masks[s, k // MASK_BITS, t] >> (k % MASK_BITS)) & 1]
            assert bits == [k for k, r in zip(ks, rows) if r]  # the OR of the tile's masks


def test_sorting_reduces_the_work(rng):
    """A sparse cloud: sorted tiles multiply fewer zeros than the natural order's,
    and more splits fewer still; a plan never computes fewer products than pairs."""
    table, _, _ = layer(rng, n=200, extent=12)
    natural = ig.implicit_plan_reference(table, skip=CENTRE)
    natural.order[0] = np.arange(table.shape[1])
    masks, m = ig.output_masks_reference(table, CENTRE), natural.tile_m
    for t in range(natural.n_tiles):
        natural.tile_masks[0, :, t] = np.bitwise_or.reduce(masks[:, t * m:(t + 1) * m], axis=1)
    waste = [ig.plan_work(p, table)["waste"] for p in
             (natural, *(ig.implicit_plan_reference(table, s, CENTRE) for s in (1, 3)))]
    assert 1.0 <= waste[2] <= waste[1] < waste[0]


# ---------------------------------------------------------------- the kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_rung_equals_the_reference(rng, dtype):
    """A 3x3x1 kernel (v2 meets a barrier per offset and chunk, which the simulator
    makes slow), C_in 10 (two chunks of 8), C_out 18 (two column tiles), the centre
    (offset 4) skipped with an init, two mask splits for v3."""
    table, f, w = layer(rng, n=70, extent=7, kernel_size=(3, 3, 1), c_in=10, c_out=18, dtype=dtype)
    init = centre_init(f, w, rng)
    want = ig.implicit_gemm_reference(f, w, table, init, 4)
    assert_close(want, oracle(f, w, table, init, 4), tol(dtype))
    plan = idr.implicit_plan(table, splits=2, skip=4)
    for rung in ig.LADDER.names:
        got = to_host(idr.implicit_gemm_rung(rung, f, w, table, plan, init))
        assert got.dtype == np.dtype(dtype), rung
        assert rel_err(got, want) <= tol(dtype) / 2, rung


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_splits(rng, splits):
    table, f, w = layer(rng, n=150, extent=9, c_in=6, c_out=5)
    init = centre_init(f, w, rng)
    plan = idr.implicit_plan(table, splits=splits, skip=CENTRE)
    got = idr.implicit_gemm_cuda(f, w, table, plan, init)
    assert_close(got, oracle(f, w, table, init, CENTRE), RTOL32)
    assert_close(idr.implicit_gemm_cuda(f, w, table, plan), oracle(f, w, table, None, CENTRE), RTOL32)


def test_fp16_splits_round_once(rng):
    """With splits the running sum stays float32 between launches: one rounding, so
    the kernel's fp16 result is as close to the reference as with one split."""
    table, f, w = layer(rng, n=150, extent=9, c_in=6, c_out=5, dtype=np.float16)
    init = centre_init(f, w, rng)
    want = ig.implicit_gemm_reference(f, w, table, init, CENTRE)
    for splits in (1, 3):
        got = to_host(idr.implicit_gemm_cuda(f, w, table, idr.implicit_plan(table, splits, CENTRE), init))
        assert got.dtype == np.float16
        ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
        slack = 1e-6 * float(np.abs(want.astype(np.float32)).max())  # (sums in another order)
        assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp + slack).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_strided_map(rng, dtype):
    """Stride 2, 2x2x2 kernel: n_out != n_in, no centre."""
    table, f, w = layer(rng, n=200, extent=10, kernel_size=2, stride=2, c_in=7, c_out=9, dtype=dtype)
    assert table.shape[1] != f.shape[0]
    got = idr.implicit_gemm_cuda(f, w, table, idr.implicit_plan(table, splits=2))
    assert_close(got, oracle(f, w, table), tol(dtype))


def test_5x5x5_kernel_needs_four_mask_words(rng):
    """K = 125 > 64: offsets 64..124 live in words 2 and 3 of the masks."""
    table, f, w = layer(rng, n=60, extent=9, kernel_size=5, c_in=3, c_out=4)
    assert table.shape[0] == 125 and (table[100:] >= 0).any()
    init = centre_init(f, w, rng)
    for splits in (1, 2):
        plan = idr.implicit_plan(table, splits=splits, skip=62)
        assert plan.tile_masks.shape[1] == 4
        got = idr.implicit_gemm_cuda(f, w, table, plan, init)
        assert_close(got, oracle(f, w, table, init, 62), RTOL32)


@pytest.mark.parametrize("c_in,c_out", [(3, 1), (4, 1), (1, 3)])
def test_first_and_last_layer_channels(rng, c_in, c_out):
    table, f, w = layer(rng, n=100, extent=8, c_in=c_in, c_out=c_out)
    got = idr.implicit_gemm_cuda(f, w, table, idr.implicit_plan(table))
    assert got.shape == (table.shape[1], c_out)
    assert_close(got, oracle(f, w, table), RTOL32)


def test_the_gpu_tile_shape(rng):
    """The GPU's register tile (4x4 per thread, 64-row tiles, 32-channel column tile,
    chunks of 16, the next chunk prefetched) under the simulator, on outputs that do
    not fill the last tile; and the same without the prefetch."""
    table, f, w = layer(rng, n=90, extent=8, c_in=20, c_out=20)
    plan = idr.implicit_plan(table, skip=CENTRE, tile_m=64)
    init = centre_init(f, w, rng)
    want = oracle(f, w, table, init, CENTRE)
    assert_close(idr.implicit_gemm_cuda(f, w, table, plan, init, tiles=ish.Tiles(32, 16, 4, 4)), want, RTOL32)
    table, f, w = layer(rng, n=60, extent=7, c_in=10, c_out=6)
    no_prefetch = ish.Tiles(8, 4, 4, 4, prefetch=False)  # chunks of 4: three of them
    got = idr.implicit_gemm_cuda(f, w, table, idr.implicit_plan(table), tiles=no_prefetch)
    assert_close(got, oracle(f, w, table), RTOL32)


def test_the_comparison_can_fail(rng):
    """An off-by-one row, or one offset dropped, is far outside the tolerance."""
    table, f, w = layer(rng, n=120, extent=8, c_in=6, c_out=5)
    plan = idr.implicit_plan(table)
    got = idr.implicit_gemm_cuda(f, w, table, plan)
    want = oracle(f, w, table)
    assert rel_err(got, want) <= RTOL32
    shifted = np.where(table >= 0, (table + 1) % f.shape[0], -1).astype(np.int32)
    assert rel_err(idr.implicit_gemm_cuda(f, w, shifted, plan), want) > 100 * RTOL32
    k = int(np.argmin(np.where((table >= 0).sum(1) > 0, (table >= 0).sum(1), 10 ** 9)))  # fewest pairs
    dropped = table.copy()
    dropped[k] = -1
    assert rel_err(idr.implicit_gemm_cuda(f, w, dropped, idr.implicit_plan(dropped)), want) > 100 * RTOL32


# ----------------------------------------------------------------- bad input
def test_bad_input(rng):
    table, f, w = layer(rng, n=40, extent=5, c_in=3, c_out=2)
    plan = idr.implicit_plan(table)
    run = idr.implicit_gemm_cuda
    with pytest.raises(TypeError, match="weight is float16 but features are float32"):
        run(f, w.astype(np.float16), table, plan)
    with pytest.raises(TypeError, match="features are float64, which runs only on backend='reference'"):
        run(f.astype(np.float64), w.astype(np.float64), table, plan)
    with pytest.raises(TypeError, match="features must be float32 or float16"):
        run(f.astype(np.int32), w.astype(np.int32), table, plan)
    with pytest.raises(ValueError, match=r"weight must have shape \(K, C_in, C_out\) = \(27, 3, C_out\)"):
        run(f, w[:, :2], table, plan)
    with pytest.raises(ValueError, match="weight must have shape"):
        run(f, w[:26], table, plan)
    with pytest.raises(TypeError, match="table must be int32"):
        run(f, w, table.astype(np.int64), plan)
    with pytest.raises(ValueError, match=r"table must have shape \(K, n_out\)"):
        run(f, w, table[0], plan)
    with pytest.raises(ValueError, match="init must have shape"):
        run(f, w, table, plan, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="plan was made for a table of shape"):
        run(f, w, table[:, :-1].copy(), plan)
    with pytest.raises(TypeError, match="plan must be an ImplicitPlan"):
        run(f, w, table, None)
    with pytest.raises(ValueError, match="features has .* rows"):
        ig.implicit_gemm_reference(f[:-1], w, table)
    with pytest.raises(ValueError, match="skip must be"):
        ig.implicit_gemm_reference(f, w, table, skip=27)
    with pytest.raises(ValueError, match="splits must be"):
        idr.implicit_plan(table, splits=0)
    with pytest.raises(ValueError, match="tile_m must be one of"):
        ig.implicit_plan_reference(table, tile_m=48)
    with pytest.raises(TypeError, match="table must be an int32 array"):
        idr.implicit_plan(table.astype(np.int64))
    with pytest.raises(ValueError, match="rung must be one of"):
        idr.implicit_gemm_rung("v9", f, w, table, plan)


# ------------------------------------------------------- v4: tensor cores
# On a GPU v4's tile products run on the tensor cores (linked C++); under the simulator on
# the C++'s Python stand-in (tensor_cores.emulated_warp_mma), so the tests below check v4's
# Python half (gathers, shared tiles, barriers, epilogue) everywhere.


def test_ladder_runs_v4_everywhere_and_the_library_picks_it_for_fp16(rng, capsys, monkeypatch):
    """v4 is declared and runs here (GPU or simulator); the library picks it for fp16
    from TENSOR_CORE_MIN_CHANNELS channels, v3 for fp32; the ladder table has a v4 row
    that agrees with the reference, as v3's does."""
    assert [r.name for r in ig.LADDER.declared] == ["v1", "v2", "v3", "v4", "v5"]
    assert ig.LADDER.names == ("v1", "v2", "v3", "v4", "v5") and not any(r.gpu_only for r in ig.LADDER.declared)
    ladder.list_ladders()
    listed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  v4  + the tile's multiply")]
    assert len(listed) == 1 and not listed[0].endswith("[GPU only]")
    assert idr.library_rung(np.float16, 64, 64) == "v4" and idr.library_rung(np.float32, 64, 64) == "v3"
    assert idr.library_rung(np.float16, idr.TENSOR_CORE_MIN_CHANNELS - 1, 64) == "v3"
    table, f, w = layer(rng, n=25, extent=4, c_in=16, c_out=16, dtype=np.float16)
    work = {"features": f, "weight": w, "km": SimpleNamespace(table=table),
            "implicit_plan": idr.implicit_plan(table), "init": centre_init(f, w, rng), "centre": -1}
    short = Ladder("implicit_gemm", (ig.LADDER.rung("v3"), ig.LADDER.rung("v4")), lambda ctx: work,
                   ig.LADDER.reference, tolerance=ig.LADDER.tolerance)
    monkeypatch.setattr(ladder, "ladders", lambda: {"implicit_gemm": short})
    rows = ladder.run_ladder(["implicit_gemm"], cloud(rng, 30, 4), channels=4, dtypes=("float16",))
    assert [r["rung"] for r in rows] == ["v3", "v4"] and all(r["agrees"] for r in rows)


@pytest.mark.parametrize("tile_m", ish.TILE_M_CHOICES)
@pytest.mark.parametrize("c_in,c_out", [(3, 5), (16, 16), (24, 40), (40, 96), (96, 24), (64, 64), (256, 256)])
def test_v4_tile_shapes(tile_m, c_in, c_out):
    """Every plan tile and channel count gets a warp grid of at most four warps whose
    warp tiles mma.cu defines, covering the block's tile exactly; loads that divide
    the channels; and a row tile the threads split evenly."""
    tiles = ish.tensor_tiles(c_in, c_out)
    warps_m, warps_n, mi, ni = ish.v4_shape(tile_m, tiles.tile_n)
    assert (mi, ni) in tc.MMA_SHAPES and warps_m * warps_n <= 4
    assert (warps_m * 16 * mi, warps_n * 8 * ni) == (tile_m, tiles.tile_n)
    assert tiles.tile_n >= min(c_out, 64) and tiles.tile_k in (16, 32)
    assert c_in % tiles.a_vec == 0 and c_out % tiles.b_vec == 0
    assert (tile_m * tiles.tile_k // tiles.a_vec) % (32 * warps_m * warps_n) == 0


V4_CASES = [  # (n, extent, kernel, c_in, c_out, splits, centre skipped with init, tile_m)
    (310, 10, 3, 16, 16, 1, True, 64),
    (257, 9, 3, 24, 40, 2, True, 64),  # loads of 4 values; C_out in two 32-wide column tiles
    (250, 11, 3, 96, 24, 1, False, 32),
    (200, 10, 3, 40, 96, 3, True, 128),  # 96 outputs: a 64-wide and a part-filled column tile
    (150, 8, 3, 3, 5, 1, True, 16),  # the first layer's channels: loads of one value
    (200, 9, 2, 6, 18, 2, False, 64),  # strided 2x2x2 map, loads of two values
]


def tensor_core_case(rng, case):
    """A fp16 layer of V4_CASES / V5_CASES: (features, weights, table, init, skip, plan,
    the reference's output)."""
    n, extent, ks, c_in, c_out, splits, centre, tile_m = case
    stride = 2 if ks == 2 else 1
    table, f, w = layer(rng, n=n, extent=extent, kernel_size=ks, stride=stride, c_in=c_in, c_out=c_out,
                        dtype=np.float16)
    skip = CENTRE if centre else -1
    init = centre_init(f, w, rng) if centre else None
    assert table.shape[1] % tile_m, "the last tile must be part-filled"
    plan = idr.implicit_plan(table, splits, skip, tile_m)
    want = ig.implicit_gemm_reference(f, w, table, init, skip)
    return f, w, table, init, skip, plan, want


def assert_within_an_ulp(got, want):
    """fp16 ``got`` within one fp16 ulp of ``want`` plus the float32 slack of another
    summation order (the tensor-core rungs sum in float32 and round once)."""
    assert got.dtype == np.float16 and got.shape == want.shape
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
    slack = 1e-5 * float(np.abs(want.astype(np.float32)).max())
    assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp + slack).all()


@pytest.mark.parametrize("case", V4_CASES)
def test_v4_equals_the_reference(rng, case):
    """v4 against implicit_gemm_reference: rows that do not fill the last tile,
    channels that fill no tile, the centre skipped with an init, mask splits. Sums
    are float32 rounded once, so within one fp16 ulp of the reference (plus the
    float32 slack of another summation order)."""
    f, w, table, init, skip, plan, want = tensor_core_case(rng, case)
    got = to_host(idr.implicit_gemm_cuda(f, w, table, plan, init, tiles=ish.tensor_tiles(f.shape[1], w.shape[2])))
    assert_within_an_ulp(got, want)
    assert_close(got, oracle(f, w, table, init, skip), RTOL16)
    if case is V4_CASES[0]:  # the ladder's entry point runs the same kernel (once: v4 is slow on the CPU)
        np.testing.assert_array_equal(to_host(idr.implicit_gemm_rung("v4", f, w, table, plan, init)), got)


def test_a_register_cap_or_no_prefetch_does_not_change_v4s_output(rng):
    """v4 with ``max_registers`` (a new kernel: the cap is part of the factory's key)
    or with ``prefetch=False`` or ``"rows"`` gives v4's output bit for bit (a cap moves
    values to local memory, a later load moves a wait; neither changes the arithmetic). The
    channels span two chunks, so the prefetch has a next chunk to load."""
    c, c_out = 64, 16
    assert c == 2 * ig.tensor_tiles(c, c_out).tile_k  # two chunks of input channels
    table, f, w = layer(rng, n=40, extent=5, c_in=c, c_out=c_out, dtype=np.float16)
    plan = idr.implicit_plan(table)
    args = (to_device(f), to_device(w), to_device(table), plan, None)
    plain, capped = to_host(ig.run_v4(*args)), to_host(ig.run_v4(*args, max_registers=96))
    np.testing.assert_array_equal(capped.view(np.uint16), plain.view(np.uint16))
    # and without the next chunk's loads in flight during the math, or with its rows only:
    # the same sums in the same order
    for prefetch in (False, "rows"):
        late = to_host(ig.run_v4(*args, prefetch=prefetch))
        np.testing.assert_array_equal(late.view(np.uint16), plain.view(np.uint16), err_msg=str(prefetch))
    for bad in (0, 1, "weights", None):
        with pytest.raises(TypeError, match="prefetch must be True, False or 'rows'"):
            ig.run_v4(*args, prefetch=bad)
    assert ig.implicit_gemm_v4(plan.tile_m, *ig.tensor_tiles(c, c_out), 96) is not ig.implicit_gemm_v4(
        plan.tile_m, *ig.tensor_tiles(c, c_out))
    with pytest.raises(ValueError, match="max_registers"):
        ig.run_v4(*args, max_registers=300)


def test_the_library_runs_v4_for_wide_fp16_layers(rng):
    """implicit_gemm_cuda runs v4 for fp16 from TENSOR_CORE_MIN_CHANNELS channels (the
    same result as the explicit v4 tiles), v3 for fp32 and narrower layers."""
    c = idr.TENSOR_CORE_MIN_CHANNELS
    assert idr.library_rung(np.float16, c, c) == "v4"
    assert idr.library_rung(np.float32, c, c) == "v3" and idr.library_rung(np.float16, c - 1, c) == "v3"
    table, f, w = layer(rng, n=200, extent=9, c_in=c, c_out=c, dtype=np.float16)
    plan = idr.implicit_plan(table, skip=CENTRE)
    auto = to_host(idr.implicit_gemm_cuda(f, w, table, plan))
    v4 = to_host(idr.implicit_gemm_cuda(f, w, table, plan, tiles=ish.tensor_tiles(c, c)))
    np.testing.assert_array_equal(auto, v4)
    with pytest.raises(TypeError, match="v4 multiplies fp16"):
        idr.implicit_gemm_cuda(f.astype(np.float32), w.astype(np.float32), table, plan, tiles=ish.tensor_tiles(c, c))


# ------------------------------------------------------- v5: double-buffered, running ahead
@pytest.mark.parametrize("tile_m", ish.TILE_M_CHOICES)
@pytest.mark.parametrize("c_in,c_out", [(3, 5), (16, 16), (24, 40), (40, 96), (96, 24), (64, 64), (128, 128),
                                        (256, 256)])
def test_v5_tile_shapes(tile_m, c_in, c_out):
    """Every plan tile and channel count gets warps whose tiles mma.cu defines, covering
    the block exactly, at most 512 threads, loads that divide the channels, and two
    stages of both shared tiles within the 48 KB a block may declare statically."""
    tiles = ish.v5_tiles(c_in, c_out)
    warps_m, warps_n, mi, ni = ish.v5_shape(tile_m, tiles.tile_n)
    assert (mi, ni) in tc.MMA_SHAPES and warps_m * warps_n <= 16
    assert (warps_m * 16 * mi, warps_n * 8 * ni) == (tile_m, tiles.tile_n)
    assert tiles.tile_n >= min(c_out, 128) and tiles.tile_k in (16, 32)
    assert c_in % tiles.a_vec == 0 and c_out % tiles.b_vec == 0
    shared = 2 * 2 * (tile_m * (tiles.tile_k + 8) + tiles.tile_k * (tiles.tile_n + 8))
    assert shared <= 48 * 1024


V5_CASES = [  # as V4_CASES; the widest block (128 channels) on tiles of 32 rows (the simulator's threads)
    (310, 10, 3, 16, 16, 1, True, 64),
    (257, 9, 3, 24, 40, 2, True, 64),  # loads of 4 values; 40 outputs in one 64-wide block
    (400, 11, 3, 96, 24, 1, False, 32),  # three chunks an offset
    (200, 10, 3, 40, 96, 3, True, 32),  # a 128-wide block, part-filled; three mask splits
    (260, 10, 3, 16, 8, 2, True, 128),  # 128-row tiles, one chunk an offset: every step a new offset
    (150, 8, 3, 3, 5, 1, True, 16),  # loads of one value; more threads than words of a chunk
    (200, 9, 2, 6, 18, 2, False, 64),  # strided 2x2x2 map, loads of two values
]


@pytest.mark.parametrize("case", V5_CASES)
def test_v5_equals_the_reference(rng, case):
    """v5 against implicit_gemm_reference, as v4 is (within one fp16 ulp plus float32
    slack); its steps run across offsets, so cases with one and several chunks an offset,
    and mask splits whose first offsets are dead for some tiles."""
    f, w, table, init, skip, plan, want = tensor_core_case(rng, case)
    got = to_host(idr.implicit_gemm_rung("v5", f, w, table, plan, init))
    assert_within_an_ulp(got, want)


def test_v5_refuses_fp32_and_runs_v3_for_it_in_the_ladder(rng):
    table, f, w = layer(rng, n=60, extent=5, c_in=8, c_out=8, dtype=np.float32)
    plan = idr.implicit_plan(table)
    with pytest.raises(TypeError, match="v5 multiplies fp16"):
        ig.run_v5(f, w, table, plan, None)
    assert_close(idr.implicit_gemm_rung("v5", f, w, table, plan), oracle(f, w, table), 1e-5)
