"""The library's plan builder (numba_sc.gmas.plan): the plan ``build_plan`` makes on the
device (the metadata stage's v2, its base rows kept per layout) equals the NumPy
reference's on small clouds, for submanifold, strided and transposed maps; the
comparison catches one wrong buffer row; the kept layouts are the library's state.
"""
import dataclasses

import numpy as np
import pytest

import numba_sc
from numba_sc.core.backend import to_host
from numba_sc.core.pieces import as_array
from numba_sc.gmas import plan as plan_module
from numba_sc.gmas.gemm_grouping import padding_report
from numba_sc.gmas.layout import submanifold_centre
from numba_sc.gmas.plan import build_plan, build_plan_cuda, grouping_report
from numba_sc.map.map_step import build_kernel_map

from helpers import tensor


def plan_differences(a, b) -> list:
    """What differs between two plans (empty: the same plan)."""
    diffs = [name for name in ("rows", "centre", "policy") if getattr(a, name) != getattr(b, name)]
    diffs += [name for name in ("counts", "order", "base") if not np.array_equal(getattr(a, name), getattr(b, name))]
    if [dataclasses.astuple(g) for g in a.groups] != [dataclasses.astuple(g) for g in b.groups]:
        diffs.append("groups")
    diffs += [side for side in ("in_table", "out_table")
              if not np.array_equal(to_host(getattr(a, side)), to_host(getattr(b, side)))]
    return diffs


def layer_map(rng, kernel_size, stride, transposed):
    x = tensor(rng, 150, 1)
    km = build_kernel_map(x.coords, kernel_size, stride)
    return km.transposed() if transposed else km


@pytest.mark.parametrize("kernel_size, stride, transposed",
                         [(3, 1, False), (2, 2, False), (3, 2, False), (2, 2, True), (3, 2, True)])
def test_plan_equals_the_reference(rng, kernel_size, stride, transposed):
    km = layer_map(rng, kernel_size, stride, transposed)
    for kw in ({}, {"sort": False}, {"max_padding": 0.0}, {"launch_rows": 64}):
        got = build_plan(km, backend="cuda", **kw)
        want = build_plan(km, backend="reference", **kw)
        assert plan_differences(got, want) == []
        assert got.rows > 0 and (got.centre >= 0) == (stride == 1)
        # every pair has one row, and no two pairs share one
        rows = to_host(got.out_table)
        rows = rows[rows >= 0]
        centre_pairs = km.host_counts()[got.centre] if got.centre >= 0 else 0
        assert len(rows) == len(np.unique(rows)) == km.host_counts().sum() - centre_pairs


def test_block_size_and_centre_choice(rng):
    km = layer_map(rng, 3, 1, False)
    want = build_plan(km, backend="reference")
    for threads in (1, 4, 64):  # chunks of 8 .. 512 outputs: many chunk borders inside the cloud
        assert plan_differences(build_plan_cuda(km, threads=threads), want) == []
    through = build_plan(km, direct_centre=False, backend="cuda")
    assert through.centre == -1 and through.rows > want.rows
    assert plan_differences(through, build_plan(km, direct_centre=False, backend="reference")) == []


def test_a_planted_wrong_row_is_caught(rng):
    km = layer_map(rng, 3, 1, False)
    good = build_plan(km, backend="cuda")
    want = build_plan(km, backend="reference")
    assert plan_differences(good, want) == []
    for side in ("in_lists", "out_lists"):
        lists = getattr(good, side)
        slots = to_host(lists.slots).copy()
        # the first row of the first point with one: moved to its neighbour in the same offset
        p = int(np.flatnonzero(to_host(lists.count) > 0)[0])
        r = int(slots[0, p])
        step = 1 if r + 1 < good.rows and good.row_offset[r + 1] == good.row_offset[r] else -1
        assert good.row_offset[r + step] == good.row_offset[r]
        slots[0, p] = r + step
        # the planted lists all on the host (on a GPU the plan's are device arrays or pieces)
        planted = dataclasses.replace(lists, slots=slots, masks=to_host(as_array(lists.masks)),
                                      buffered=to_host(as_array(lists.buffered)))
        bad = dataclasses.replace(good, _tables={}, **{side: planted})
        assert plan_differences(bad, want) == [side.replace("lists", "table")]


def test_grouping_report_is_the_padding_report(rng):
    km = layer_map(rng, 3, 1, False)
    centre = submanifold_centre(km)
    assert centre >= 0
    assert grouping_report(km) == padding_report(km.host_counts(), centre)
    assert grouping_report(km, direct_centre=False) == padding_report(km.host_counts(), -1)


def test_kept_layouts_are_cleared_with_the_library_state():
    plan_module._LAYOUTS[("a layout", 0)] = "kept"
    numba_sc.clear_caches()
    assert plan_module._LAYOUTS == {}
