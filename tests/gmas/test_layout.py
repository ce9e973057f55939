"""The buffer layout (numba_sc.gmas.layout): the offsets laid out on the host (order,
groups, base rows), the submanifold centre, the per-point lists and their dense
tables, and the plan read backwards for the transposed layer.
"""
import dataclasses

import numpy as np

from numba_sc.gmas.layout import (GmasPlan, PointLists, buffered_bits, centre_offset, lists_from_table,
                                  masks_from_hits, offset_layout, submanifold_centre, table_from_lists)
from numba_sc.map.kernel_map import KernelMap
from numba_sc.map.map_step import build_kernel_map

from helpers import tensor


def small_map(table, offsets, n_in):
    """A map of a table alone: 3 outputs, as in metadata's worked example."""
    table = np.asarray(table, np.int32)
    return KernelMap(np.zeros((n_in, 3), np.int32), np.zeros((table.shape[1], 3), np.int32), None,
                     np.asarray(offsets, np.int32), table, (table >= 0).sum(axis=1).astype(np.int64))


def test_offset_layout_of_the_worked_example():
    km = small_map([[1, -1, 0], [0, 1, 2]], [[0, 0, -1], [0, 0, 1]], 3)
    counts, order, groups, base, rows, centre, policy = offset_layout(km, True, 0.0, 1 << 17, True)
    assert counts.tolist() == [2, 3] and order.tolist() == [0, 1] and centre == -1
    assert base.tolist() == [0, 2] and rows == 5 and policy == (0.0, 1 << 17, 0)
    # map order with the counts reversed: the same offsets, the bigger one first
    km = small_map([[0, 1, 2], [1, -1, 0]], [[0, 0, -1], [0, 0, 1]], 3)
    assert offset_layout(km, True, 0.0, 1 << 17, True)[3].tolist() == [2, 0]
    assert offset_layout(km, False, 0.0, 1 << 17, True)[3].tolist() == [0, 3]
    assert buffered_bits(np.array([0, -1, 3])) == [0b101]


def test_submanifold_centre_is_found_and_remembered(rng):
    x = tensor(rng, 60, 1)
    km = build_kernel_map(x.coords, 3)
    c = centre_offset(km)
    assert c == 13 and (km.offsets[c] == 0).all()
    assert submanifold_centre(km) == c and km.known_centre == c
    km.known_centre = -1  # remembered: the map's word is taken
    assert submanifold_centre(km) == -1
    strided = build_kernel_map(x.coords, 3, 2)  # (0, 0, 0) exists but does not map every point
    assert submanifold_centre(strided) == -1
    # an identity row at (0, 0, 0) with as many inputs as outputs is a centre; one pair missing is not
    assert submanifold_centre(small_map([[0, 1, 2]], [[0, 0, 0]], 3)) == 0
    assert submanifold_centre(small_map([[0, -1, 2]], [[0, 0, 0]], 3)) == -1


def test_lists_and_tables_round_trip(rng):
    table = np.full((5, 3), -1, np.int32)  # (N, K): point n's rows, or -1
    table[0] = [4, -1, 7]
    table[2] = [-1, 1, -1]
    table[4] = [0, 2, 5]
    row_offset = np.array([0, 1, 1, -1, 0, 2, -1, 2])  # the offset of each buffer row
    lists = lists_from_table(table)
    assert lists.count.tolist() == [2, 0, 1, 0, 3]
    assert [lists.rows[n, :c].tolist() for n, c in enumerate(lists.count)] == [[4, 7], [], [1], [], [0, 2, 5]]
    np.testing.assert_array_equal(lists.masks, masks_from_hits((table >= 0).T))
    np.testing.assert_array_equal(table_from_lists(lists, row_offset, 3), table)
    # a row moved to another offset's column shows in the dense table
    wrong = dataclasses.replace(lists, slots=lists.slots.copy())
    wrong.slots[0, 0] = 5
    assert not np.array_equal(table_from_lists(wrong, row_offset, 3), table)


def test_transposed_plan_swaps_the_lists():
    ins = PointLists(np.zeros((2, 3), np.int32), np.ones((1, 3), np.int64), np.ones(1, np.int64))
    outs = PointLists(np.ones((2, 4), np.int32), np.ones((1, 4), np.int64), np.ones(1, np.int64))
    plan = GmasPlan(np.array([3]), np.array([0]), [], np.array([0]), 3, -1, ins, outs)
    back = plan.transposed()
    assert back.in_lists is outs and back.out_lists is ins and (back.n_in, back.n_out) == (4, 3)
    assert back.transposed().in_lists is ins
