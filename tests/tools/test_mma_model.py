"""tools/mma_model.py: the NumPy model of a warp's mma.m16n8k16 and ldmatrix (notebook 12).

The fragment layouts are checked three ways: each covers its matrix once; lane 5 holds
what the PTX ISA's table (as tensor_cores.py writes it) says; and ldmatrix, fed the
addresses of mma.cu's lanes, hands every lane exactly those elements. The model of v4's
whole tile loop equals the stage's NumPy reference bit for bit on exact data (small
integers), and to fp16 rounding on random data; each comparison is shown to fail on a
wrong answer. On a GPU, the model also equals v4 itself."""
import numpy as np
import pytest

from numba_sc.dataflows import implicit_gemm as ig
from numba_sc.tools import mma_model as mm


def covers_once(layout, shape):
    seen = np.zeros(shape, int)
    np.add.at(seen, (layout[..., 0].ravel(), layout[..., 1].ravel()), 1)
    return bool((seen == 1).all())


def test_each_layout_holds_its_matrix_once():
    assert covers_once(mm.a_fragment(), (16, 16))
    assert covers_once(mm.b_fragment(), (16, 8))
    assert covers_once(mm.c_fragment(), (16, 8))
    # and the check can fail: lane 0 holding lane 1's values leaves lane 0's uncovered
    wrong = mm.a_fragment().copy()
    wrong[0] = wrong[1]
    assert not covers_once(wrong, (16, 16))


def test_lane_5_holds_what_the_table_says():
    """tensor_cores.py's example: lane 5 (g = 1, t = 1) holds A[1, 2:4], A[9, 2:4], A[1, 10:12],
    A[9, 10:12], B[2:4, 1], B[10:12, 1], and the results D[1, 2:4], D[9, 2:4]."""
    assert mm.a_fragment()[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3], [1, 10], [1, 11], [9, 10], [9, 11]]
    assert mm.b_fragment()[5].tolist() == [[2, 1], [3, 1], [10, 1], [11, 1]]
    assert mm.c_fragment()[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3]]


def test_the_mma_equals_the_product(rng):
    a = rng.integers(-8, 9, (16, 16)).astype(np.float16)
    b = rng.integers(-8, 9, (16, 8)).astype(np.float16)
    c = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    d = mm.mma_m16n8k16(mm.fragments(a, mm.a_fragment()), mm.fragments(b, mm.b_fragment()),
                        mm.fragments(c, mm.c_fragment()))
    want = a.astype(np.float32) @ b.astype(np.float32) + c  # exact: small integers
    np.testing.assert_array_equal(mm.unfragment(d, mm.c_fragment(), (16, 8)), want)
    # random values: float32 rounding of the float64 product
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    d = mm.mma_m16n8k16(mm.fragments(a, mm.a_fragment()), mm.fragments(b, mm.b_fragment()),
                        np.zeros((32, 4), np.float32))
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(mm.unfragment(d, mm.c_fragment(), (16, 8)) - want).max() <= 1e-6 * np.abs(want).max()


def test_fragments_read_with_a_wrong_layout_give_a_wrong_product(rng):
    """The comparison above can fail: A's fragments taken with rows g and g + 8 swapped."""
    a = rng.integers(-8, 9, (16, 16)).astype(np.float16)
    b = rng.integers(-8, 9, (16, 8)).astype(np.float16)
    wrong = mm.a_fragment().copy()
    wrong[..., 0] = (wrong[..., 0] + 8) % 16
    d = mm.mma_m16n8k16(mm.fragments(a, wrong), mm.fragments(b, mm.b_fragment()), np.zeros((32, 4), np.float32))
    assert not np.array_equal(mm.unfragment(d, mm.c_fragment(), (16, 8)), a.astype(np.float32) @ b)


def test_the_mma_refuses_wrong_shapes_and_dtypes():
    a, b, c = np.zeros((32, 8), np.float16), np.zeros((32, 4), np.float16), np.zeros((32, 4), np.float32)
    with pytest.raises(ValueError, match="one row a lane"):
        mm.mma_m16n8k16(a[:16], b, c)
    with pytest.raises(TypeError, match="fp16 into fp32"):
        mm.mma_m16n8k16(a.astype(np.float32), b, c)


def test_ldmatrix_with_mma_cu_addresses_gives_the_fragments(rng):
    """mma.cu's A addresses through ldmatrix.x4 give the A fragment of rows row0.., channels
    16 ks..; its B addresses through ldmatrix.x4.trans give B's fragments of two column
    tiles. Without .trans the B registers are wrong (the check can fail)."""
    a_tile = rng.standard_normal((64, 40)).astype(np.float16)  # 64 rows, 32 channels + 8 of padding
    b_tile = rng.standard_normal((32, 40)).astype(np.float16)  # 32 channels, 32 output channels + 8
    for ks in (0, 1):
        for row0 in (0, 16, 48):
            got = mm.ldmatrix_x4(a_tile, *mm.a_addresses(row0, ks)).reshape(32, 8)
            want = mm.fragments(a_tile[row0:row0 + 16, 16 * ks:16 * ks + 16], mm.a_fragment())
            np.testing.assert_array_equal(got, want)
        for col0 in (0, 16):
            got = mm.ldmatrix_x4(b_tile, *mm.b_addresses(col0, ks), trans=True)
            for p in (0, 1):
                want = mm.fragments(b_tile[16 * ks:16 * ks + 16, col0 + 8 * p:col0 + 8 * p + 8], mm.b_fragment())
                np.testing.assert_array_equal(got[:, 2 * p:2 * p + 2].reshape(32, 4), want)
    untransposed = mm.ldmatrix_x4(b_tile, *mm.b_addresses(0, 0))
    assert not np.array_equal(untransposed[:, :2].reshape(32, 4), mm.fragments(b_tile[:16, :8], mm.b_fragment()))


def test_ldmatrix_refuses_unaligned_and_outside_addresses():
    tile = np.zeros((16, 24), np.float16)
    rows, cols = mm.a_addresses(0, 0)
    with pytest.raises(ValueError, match="lane 3 gives column 4"):
        mm.ldmatrix_x4(tile, rows, np.where(np.arange(32) == 3, 4, cols))
    with pytest.raises(ValueError, match="outside"):
        mm.ldmatrix_x4(tile, rows + 1, cols)
    with pytest.raises(TypeError, match="2-D float16"):
        mm.ldmatrix_x4(tile.astype(np.float32), rows, cols)


def test_padding_by_8_values_spreads_the_rows_over_the_banks():
    """v4 pads each shared row by 8 fp16 values: 16 and 32 channel rows then read their 8
    ldmatrix rows at once; without it, 2 and 4 rows share a bank."""
    assert [mm.row_conflicts(p) for p in (16, 32, 64)] == [2, 4, 8]
    assert [mm.row_conflicts(p + 8) for p in (16, 32, 64)] == [1, 1, 1]
    with pytest.raises(ValueError, match="multiple of 8"):
        mm.row_conflicts(20)


def test_warp_tile_is_the_warps_block_of_the_product(rng):
    a_tile = rng.integers(-4, 5, (64, 40)).astype(np.float16)
    b_tile = rng.integers(-4, 5, (32, 40)).astype(np.float16)
    acc = mm.warp_tile(np.zeros((32, 2, 4, 4), np.float32), a_tile, b_tile, row0=32, col0=0, k_steps=2)
    want = a_tile[32:64, :32].astype(np.float32) @ b_tile[:, :32].astype(np.float32)
    got = np.zeros((32, 32), np.float32)
    for i in range(2):
        for j in range(4):
            got[16 * i:16 * i + 16, 8 * j:8 * j + 8] = mm.unfragment(acc[:, i, j], mm.c_fragment(), (16, 8))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="warp tiles mma.cu defines"):
        mm.warp_tile(np.zeros((32, 3, 3, 4), np.float32), a_tile, b_tile, 0, 0, 1)


def layer(coords_, channels, rng, integers):
    """A crop's 3x3x3 submanifold layer: features, weights, init, table, centre."""
    import numba_sc as ns
    from numba_sc.gmas.layout import submanifold_centre

    km = ns.build_kernel_map(coords_, 3, backend="reference")
    n, k = len(coords_), len(km.offsets)
    if integers:
        draw = lambda shape: rng.integers(-2, 3, shape).astype(np.float16)  # noqa: E731
    else:
        draw = lambda shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    return draw((n, channels)), draw((k, channels, channels)), draw((n, channels)), km.table, submanifold_centre(km)


@pytest.mark.parametrize("channels, splits, tile_m", [(16, 1, 64), (24, 2, 16), (40, 1, 32)])
def test_the_v4_model_equals_the_reference_on_exact_data(coords, rng, channels, splits, tile_m):
    """Small integers: every product and sum is exact in float32 and the outputs in fp16, so
    the tile loop (order, masks, chunks, warps, epilogue, splits) must give the reference's
    values bit for bit. 24 and 40 channels leave a chunk partly empty."""
    f, w, init, table, centre = layer(coords, channels, rng, integers=True)
    plan = ig.implicit_plan_reference(table, splits=splits, skip=centre, tile_m=tile_m)
    want = ig.implicit_gemm_reference(f, w, table, init, centre)
    np.testing.assert_array_equal(mm.implicit_gemm_v4_model(f, w, table, plan, init), want)
    # and the comparison can fail: a plan whose tile masks skip every offset leaves only init
    empty = ig.ImplicitPlan(plan.order, np.zeros_like(plan.tile_masks), plan.bounds, plan.skip, plan.tile_m,
                            plan.kernel_volume, plan.n_out)
    assert not np.array_equal(mm.implicit_gemm_v4_model(f, w, table, empty, init), want)


def test_the_v4_model_is_within_fp16_rounding_on_random_data(coords, rng):
    f, w, init, table, centre = layer(coords, 32, rng, integers=False)
    plan = ig.implicit_plan_reference(table, skip=centre, tile_m=64)
    got = mm.implicit_gemm_v4_model(f, w, table, plan, init).astype(np.float64)
    want = ig.implicit_gemm_reference(f, w, table, init, centre).astype(np.float64)
    # both round a float32 sum once to fp16: at most one fp16 step apart (2^-10 relative)
    assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -10 + 2.0 ** -24).all()


def test_the_v4_model_refuses_fp32(coords, rng):
    f, w, init, table, centre = layer(coords, 16, rng, integers=True)
    plan = ig.implicit_plan_reference(table, skip=centre, tile_m=16)
    with pytest.raises(TypeError, match="astype\\(np.float16\\)"):
        mm.implicit_gemm_v4_model(f.astype(np.float32), w.astype(np.float32), table, plan)


def test_the_v4_model_equals_v4(coords, rng):
    """On exact data v4 and the model agree bit for bit; on random data to one fp16 step
    of the largest output (the tensor cores add in an order of their own, and near zero a
    step is smaller than float32's rounding of the terms). On a GPU v4's tile products run
    on the tensor cores; under the simulator on the C++'s stand-in, so there this checks
    v4's Python half (gathers, shared tiles, epilogue) against the model's."""
    from numba_sc.core.backend import to_host
    from numba_sc.dataflows.implicit_driver import implicit_gemm_rung

    for integers in (True, False):
        f, w, init, table, centre = layer(coords, 32, rng, integers=integers)
        plan = ig.implicit_plan_reference(table, skip=centre, tile_m=64)
        got = to_host(implicit_gemm_rung("v4", f, w, table, plan.device(), init)).astype(np.float64)
        model = mm.implicit_gemm_v4_model(f, w, table, plan, init).astype(np.float64)
        if integers:
            np.testing.assert_array_equal(got, model)
        else:
            assert np.abs(got - model).max() <= 2.0 ** -10 * np.abs(model).max()


# -- the checkers of notebook 12 (tools/exercises/nb12.py): their slips are declared there
# and run by tests/tools/test_exercises.py; here, an answer of the wrong kind
def test_12_1_refuses_an_answer_that_is_not_a_pair():
    from numba_sc.tools.exercises import EXERCISES, ExerciseFailed

    with pytest.raises(ExerciseFailed, match=r"c_position\(0, 0\) returned 0") as failed:
        EXERCISES["12.1"].checker(lambda lane, r: lane)
    assert "a pair (row, column)" in failed.value.rule
