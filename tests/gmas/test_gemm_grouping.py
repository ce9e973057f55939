"""GEMM grouping (stage 9): which offsets share a launch, the padding it costs, the
price of a launch in rows, and the weights taken in buffer order."""
import numpy as np
import pytest

from numba_sc import SparseTensor, sparse_conv3d
from numba_sc.core.backend import to_device, to_host
from numba_sc.gmas.gemm_grouping import launch_rows, make_groups, offset_order, padding_report
from numba_sc.gmas.plan import build_plan


def test_grouping_padding_by_hand():
    counts = np.array([9, 2, 8, 3, 9, 2])
    np.testing.assert_array_equal(offset_order(counts), [1, 5, 3, 2, 0, 4])
    groups = make_groups(counts, offset_order(counts), max_padding=0.25)
    assert [g.members for g in groups] == [(1, 5), (3,), (2, 0, 4)]
    assert [(g.rows, g.start) for g in groups] == [(2, 0), (3, 4), (9, 7)]
    rep = padding_report(counts, max_padding=0.25)
    assert rep["sorted"] == dict(real_rows=33, padding_rows=1, total_rows=34,
                                 overhead=1 / 33, launches=3)
    assert rep["map"] == dict(real_rows=33, padding_rows=0, total_rows=33, overhead=0.0,
                              launches=6)
    # A looser policy groups more: everything in one GEMM, padded to 9 rows each.
    rep = padding_report(counts, max_padding=1.0)
    assert rep["sorted"]["launches"] == 2  # [2 2 3] (pads 2 of 7), then [8 9 9]
    one = padding_report(counts, max_padding=10.0)["sorted"]
    assert one["launches"] == 1 and one["padding_rows"] == 6 * 9 - 33
    # Empty offsets and the centre (skip) are dropped; solo_rows keeps big ones alone.
    rep = padding_report(np.array([0, 5, 5, 100, 5]), skip=3, max_padding=0.1)
    assert rep["sorted"] == dict(real_rows=15, padding_rows=0, total_rows=15, overhead=0.0,
                                 launches=1)
    solo = make_groups(np.array([50, 50, 50]), [0, 1, 2], max_padding=0.1, solo_rows=50)
    assert len(solo) == 3


def test_grouping_prices_launches_by_hand():
    """launch_rows: an extension that adds at most that many padding rows saves a
    launch and is taken even past max_padding; 0 is the plain padding policy."""
    counts = np.array([9, 2, 8, 3, 9, 2])  # sorted: 2 2 3 8 9 9
    order = offset_order(counts)

    def members(lr):
        return [g.members for g in make_groups(counts, order, max_padding=0.25, launch_rows=lr)]

    assert members(0) == members(1) == [(1, 5), (3,), (2, 0, 4)]
    assert members(2) == [(1, 5, 3), (2, 0, 4)]  # [2 2] + 3 pads 2 rows: worth one launch
    assert members(14) == [(1, 5, 3), (2, 0, 4)]  # [2 2 3] + 8 would add 15
    assert members(15) == [(1, 5, 3, 2, 0, 4)]
    rep = padding_report(counts, max_padding=0.25, launch_rows=15)["sorted"]
    assert rep["launches"] == 1 and rep["padding_rows"] == 6 * 9 - 33
    # solo_rows still keeps a tall offset alone, whatever a launch is worth.
    assert len(make_groups(np.array([50, 50, 50]), [0, 1, 2], 0.1, solo_rows=50, launch_rows=10**9)) == 3
    with pytest.raises(ValueError, match="launch_rows"):
        make_groups(counts, order, launch_rows=-1)
    # The price: fewer channels, more padding rows per launch.
    prices = [launch_rows(c, c, 4) for c in (4, 16, 64, 256)]
    assert prices == sorted(prices, reverse=True) and prices[-1] > 0
    assert launch_rows(64, 64, 2) > launch_rows(64, 64, 4)  # fp16 rows are half the bytes


def test_layer_launch_rows_argument(rng):
    """sparse_conv3d prices launches by its channels unless told: the groups differ,
    the result does not (padding rows are never read back)."""
    # A line (60 pairs through the two x offsets) beside a 3x3x3 block (a few pairs
    # through every offset): counts far apart, which max_padding keeps in
    # separate groups.
    line = np.stack([np.arange(60), np.zeros(60), np.zeros(60)], 1)
    block = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3) + 100
    c = np.concatenate([line, block]).astype(np.int32)
    x = SparseTensor(c, rng.standard_normal((len(c), 4)).astype(np.float32))
    w = rng.normal(size=(27, 4, 4)).astype(np.float32)
    plain = sparse_conv3d(x, w, 3, backend="reference", launch_rows=0)
    priced = sparse_conv3d(x, w, 3, backend="reference")
    km = priced.kernel_map
    fewer = build_plan(km, backend="reference", launch_rows=launch_rows(4, 4, 4)).launches
    assert fewer == 1 < build_plan(km, backend="reference").launches  # the groups do differ
    np.testing.assert_allclose(to_host(priced.features), to_host(plain.features), rtol=1e-5, atol=1e-5)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="launch_rows"):
            sparse_conv3d(x, w, 3, backend="reference", launch_rows=bad)


def test_offset_order_is_a_stable_sort_without_empties(rng):
    """offset_order sorts K Python ints by hand: it must equal NumPy's stable argsort
    with the empty offsets and the skipped one left out (ties in map order)."""
    for _ in range(50):
        counts = rng.integers(0, 4, 27)  # few values: many ties
        skip = int(rng.integers(-1, 27))
        ks = np.argsort(counts, kind="stable")
        expect = ks[(counts[ks] > 0) & (ks != skip)]
        np.testing.assert_array_equal(offset_order(counts, True, skip), expect)
        np.testing.assert_array_equal(offset_order(counts, False, skip),
                                      [k for k in range(27) if counts[k] > 0 and k != skip])
        assert offset_order(counts).dtype == np.int64


def test_take_weights_kernel_matches_reference(rng):
    """The weights in buffer order: kernel == weight[order], repeats and all."""
    from numba_sc.gmas.gemm_grouping import take_weights_cuda, take_weights_reference

    for dtype in (np.float32, np.float16):
        w = rng.normal(size=(7, 3, 5)).astype(dtype)
        order = np.array([6, 0, 3, 3, 1], np.int64)
        got = to_host(take_weights_cuda(to_device(w), to_device(order)))
        np.testing.assert_array_equal(got, take_weights_reference(w, order))
        np.testing.assert_array_equal(got[2], w[3])  # not a shifted copy


def test_device_orders_are_kept_until_the_library_state_is_cleared():
    import numba_sc
    from numba_sc.gmas import gemm_grouping as gg

    groups = make_groups([5, 3, 4], [1, 2, 0], max_padding=0.5)
    order = gg.device_order(groups, np)
    np.testing.assert_array_equal(order, [k for g in groups for k in g.members])
    assert gg.device_order(groups, np) is order  # kept: no second copy
    numba_sc.clear_caches()
    assert gg._ORDER_CACHE == {} and gg.device_order(groups, np) is not order
