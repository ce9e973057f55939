"""Metadata (stage 7): the plan's tables and the lists the kernels read.

The kernels (under the simulator here) equal the NumPy reference, and both equal
the layout's definition checked without the reference (``check_plan_tables``):
offset k's pairs take rows base[k], base[k] + 1, ... in output order. Synthetic
maps put pairs on every chunk and thread boundary of the chunked rank.
"""
import dataclasses

import numpy as np
import pytest

from numba_sc.core.backend import to_host
from numba_sc.core.pieces import as_array
from numba_sc.gmas.gather import gather_cuda, gather_reference
from numba_sc.map.kernel_map import KernelMap
from numba_sc.map.map_step import build_kernel_map
from numba_sc.core.conventions import ITEMS_PER_THREAD, chunk_size
from numba_sc.gmas.layout import lists_from_table, table_from_lists
from numba_sc.gmas.metadata import (chunk_counts_cuda, chunk_counts_reference, chunk_rank_reference,
                                    masks_cuda, masks_reference)
from numba_sc.gmas.plan import build_plan, build_plan_cuda
from numba_sc.gmas.scatter import scatter_cuda, scatter_reference

from helpers import tensor


def test_metadata_worked_example():
    """The example in metadata's docstring, exactly, on both backends."""
    km = synthetic_map([[1, -1, 0], [0, 1, 2]], 3, offsets=[[0, 0, -1], [0, 0, 1]])
    for bk in ("reference", "cuda"):
        plan = build_plan(km, max_padding=0.0, backend=bk)
        assert plan.centre == -1 and plan.rows == 5
        np.testing.assert_array_equal(plan.base, [0, 2])
        np.testing.assert_array_equal(to_host(plan.out_table), [[0, 2], [-1, 3], [1, 4]])
        np.testing.assert_array_equal(to_host(plan.in_table), [[1, 2], [0, 3], [-1, 4]])
        # ... and as the lists the kernels read
        for lists, masks, rows in [(plan.out_lists, [0b11, 0b10, 0b11], [[0, 2], [3], [1, 4]]),
                                   (plan.in_lists, [0b11, 0b11, 0b10], [[1, 2], [0, 3], [4]])]:
            np.testing.assert_array_equal(to_host(as_array(lists.masks))[0], masks)
            count, got = to_host(lists.count), to_host(lists.rows)
            assert [got[n, :count[n]].tolist() for n in range(3)] == rows


def test_metadata_kernel_matches_reference(rng):
    x = tensor(rng, 200, 1)
    for ks, stride in [(3, 1), (2, 2), (5, 1)]:  # 5: K = 125, four words of offset bits
        km = build_kernel_map(x.coords, ks, stride)
        for sort in (True, False):
            a = build_plan(km, sort=sort, max_padding=0.3, backend="cuda")
            b = build_plan(km, sort=sort, max_padding=0.3, backend="reference")
            check_plan_tables(a, km)
            out_table = to_host(a.out_table)
            np.testing.assert_array_equal(to_host(a.in_table), b.in_table)
            np.testing.assert_array_equal(out_table, b.out_table)
            assert a.rows == b.rows and a.centre == b.centre
            assert (a.centre >= 0) == (stride == 1)
            # every pair has exactly one row, rows are distinct
            rows = out_table[out_table >= 0]
            assert len(rows) == len(np.unique(rows)) == km.counts.sum() - (
                km.counts[a.centre] if a.centre >= 0 else 0)


# The chunked rank of the metadata kernels: chunks of CHUNK outputs (128 under the
# simulator), each thread of a block a run of ITEMS_PER_THREAD (8) of them.
CHUNK = chunk_size()


PER = ITEMS_PER_THREAD


def synthetic_map(table, n_in, offsets=None):
    """A kernel map made of a table alone (what build_plan reads of a map): no chunk
    counts, no masks, as a map from outside the kernel path comes."""
    table = np.asarray(table, np.int32)
    K, n_out = table.shape
    if offsets is None:  # K distinct offsets, none of them the centre
        offsets = np.stack([np.zeros(K), np.zeros(K), np.arange(1, K + 1)], axis=1)
    return KernelMap(np.zeros((n_in, 3), np.int32), np.zeros((n_out, 3), np.int32), None,
                     np.asarray(offsets, np.int32), table, (table >= 0).sum(axis=1).astype(np.int64))


def random_pairs(rng, n_out, n_in, density, forced=()):
    """One table row: about density * n_out pairs (and one at each forced output),
    distinct inputs, as every offset of a real map has."""
    hit = rng.random(n_out) < density
    hit[list(forced)] = True
    row = np.full(n_out, -1, np.int32)
    row[hit] = rng.permutation(n_in)[:hit.sum()]
    return row


def boundary_table(rng):
    """K = 4 offsets over 3 chunks and a short fourth: one without pairs, one full,
    one random with pairs forced on chunk and thread boundaries, one with pairs only
    on the last output of each chunk."""
    n_out = 3 * CHUNK + 7
    edges = [PER - 1, PER, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, n_out - 1]
    last_of_chunk = [c * CHUNK + CHUNK - 1 for c in range(3)] + [n_out - 1]
    table = np.full((4, n_out), -1, np.int32)
    table[1] = rng.permutation(n_out + 50)[:n_out]
    table[2] = random_pairs(rng, n_out, n_out + 50, 0.3, edges)
    table[2, 0] = -1  # and none on the very first output
    table[3] = random_pairs(rng, n_out, n_out + 50, 0.0, last_of_chunk)
    return table, n_out + 50


def check_plan_tables(plan, km):
    """The layout's definition, checked without the reference: offset k's pairs take
    rows base[k], base[k] + 1, ... in output order; the input table agrees; every
    other entry is -1. And the lists the kernels read hold exactly those rows: an
    output's in offset order, an input's in any order."""
    table = to_host(km.table)
    out_table, in_table = to_host(plan.out_table), to_host(plan.in_table)
    want_in = np.full_like(in_table, -1)
    for k in range(table.shape[0]):
        has = table[k] >= 0
        if plan.base[k] < 0:
            assert (out_table[:, k] == -1).all()
            continue
        rows = plan.base[k] + np.arange(has.sum())
        np.testing.assert_array_equal(out_table[has, k], rows)
        assert (out_table[~has, k] == -1).all()
        want_in[table[k, has], k] = rows
    np.testing.assert_array_equal(in_table, want_in)
    check_lists(plan.out_lists, out_table)
    check_lists(plan.in_lists, in_table)


def check_lists(lists, dense):
    """``lists`` hold each point's valid entries of ``dense``, in offset order, read
    straight from the lists' arrays, not through the plan's dense view."""
    count, rows = to_host(lists.count), to_host(lists.rows)
    np.testing.assert_array_equal(count, (dense >= 0).sum(axis=1))
    for n in range(len(count)):
        np.testing.assert_array_equal(rows[n, :count[n]], dense[n][dense[n] >= 0])


def on_host(lists, **changes):
    """A copy of ``lists`` with every array on the host, some replaced."""
    host = {f.name: to_host(getattr(lists, f.name)) for f in dataclasses.fields(lists)}
    return dataclasses.replace(lists, **{**host, **changes})


def assert_plans_equal(a, b):
    np.testing.assert_array_equal(to_host(a.out_table), to_host(b.out_table))
    np.testing.assert_array_equal(to_host(a.in_table), to_host(b.in_table))
    np.testing.assert_array_equal(a.base, b.base)
    assert a.rows == b.rows and a.centre == b.centre


def test_chunk_counts_kernel_matches_reference(rng):
    for K, n_out in [(1, 1), (3, CHUNK - 1), (2, CHUNK), (3, CHUNK + 1), (2, 3 * CHUNK + 5)]:
        # an offset without pairs, one with a pair on the very last output, a full one
        table = np.stack([random_pairs(rng, n_out, n_out, d, [n_out - 1] if d else [])
                          for d in (0.0, 0.5, 1.0)[-K:]])
        got = to_host(chunk_counts_cuda(table))
        want = chunk_counts_reference(table, CHUNK)
        assert got.shape == (K, -(-n_out // CHUNK))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(want.sum(axis=1), (table >= 0).sum(axis=1))
    # Smaller blocks, smaller chunks: 4 threads, chunks of 32 outputs.
    table = np.stack([random_pairs(rng, 100, 100, 0.4), random_pairs(rng, 100, 100, 0.9)])
    np.testing.assert_array_equal(to_host(chunk_counts_cuda(table, threads=4)),
                                  chunk_counts_reference(table, 4 * PER))


def test_masks_from_the_search_and_from_the_table(rng):
    """The forward search's masks (mirrored pairs included) == the masks kernel's ==
    the reference's, on both sides, for one word of offsets and for four (K = 125)."""
    x = tensor(rng, 150, 1)
    for ks, stride, symmetric in [(3, 1, True), (3, 1, False), (2, 2, True), (5, 1, True)]:
        km = build_kernel_map(x.coords, ks, stride, symmetric=symmetric, masks=True)
        n_in = len(km.in_coords)
        want_out, want_in = masks_reference(km.table, n_in)
        W = -(-len(km.offsets) // 32)
        assert want_out.shape == (W, len(km.out_coords)) and want_out.any()
        assert want_in.shape == (W, n_in) and want_in.any()
        got_out, got_in = masks_cuda(km.table, n_in)
        for got, want in [(km.out_masks, want_out), (km.in_masks, want_in), (got_out, want_out),
                          (got_in, want_in)]:
            np.testing.assert_array_equal(to_host(as_array(got)), want)
    plain = build_kernel_map(x.coords, 3)  # the Map step alone makes none
    assert plain.out_masks is None and plain.in_masks is None
    # the docstring's worked example: output 1 has a pair through offset 1 only;
    # input 2 is fed through offset 1 only (table[1, 2] = 2), input 1 through both
    out_m, in_m = masks_reference(np.array([[1, -1, 0], [0, 1, 2]]), 3)
    np.testing.assert_array_equal(out_m, [[3, 2, 3]])
    np.testing.assert_array_equal(in_m, [[3, 3, 2]])


def test_chunk_rank_is_the_rank_at_each_chunk_start(rng):
    """E[k, c] - E[k, 0] of the flat scan == the per-offset scan at the chunk's start."""
    table, _ = boundary_table(rng)
    for chunk in (CHUNK, 32, 8, 1):
        start = chunk_rank_reference(chunk_counts_reference(table, chunk))
        rank = np.cumsum(table >= 0, axis=1) - (table >= 0)  # pairs before each output
        np.testing.assert_array_equal(start, rank[:, ::chunk])
    # The docstring's example, chunks of 2 outputs.
    table = np.array([[1, -1, 0], [0, 1, 2]])
    counts2d = chunk_counts_reference(table, 2)
    np.testing.assert_array_equal(counts2d, [[1, 1], [2, 1]])
    np.testing.assert_array_equal(chunk_rank_reference(counts2d), [[0, 1], [0, 2]])


def test_metadata_tables_across_chunks(rng):
    """Pairs over several chunks, on every chunk and thread boundary, an empty offset."""
    table, n_in = boundary_table(rng)
    km = synthetic_map(table, n_in)
    for kw in [dict(max_padding=0.0), dict(sort=False)]:
        a = build_plan(km, backend="cuda", **kw)
        assert a.base[0] == -1 and (a.base[1:] >= 0).all()
        check_plan_tables(a, km)
        assert_plans_equal(a, build_plan(km, backend="reference", **kw))
    # 4 threads a block: chunks of 32 outputs, 13 of them per offset.
    a = build_plan_cuda(km, max_padding=0.0, threads=4)
    check_plan_tables(a, km)
    assert_plans_equal(a, build_plan(km, max_padding=0.0, backend="reference"))
    # 64 threads a block: two scan groups of 32 (the GPU has four), chunks of 512
    # outputs; pairs forced on the group boundary (thread 32's first output).
    forced = [32 * PER - 1, 32 * PER, 511, 512, 1099]
    big = synthetic_map(np.stack([random_pairs(rng, 1100, 1200, d, forced if d else [])
                                  for d in (0.0, 0.2, 0.9)]), 1200)
    a = build_plan_cuda(big, max_padding=0.0, threads=64)
    check_plan_tables(a, big)
    assert_plans_equal(a, build_plan(big, max_padding=0.0, backend="reference"))
    # No outputs at all: no chunks, nothing launched, empty tables of the right shape.
    empty = build_plan(synthetic_map(np.full((2, 0), -1), 5), backend="cuda")
    assert to_host(empty.out_table).shape == (0, 2) and (to_host(empty.in_table) == -1).all()


def test_metadata_single_offset(rng):
    """K = 1: an ordinary offset, then the centre alone, direct or through the buffers."""
    n = CHUNK + 40
    km = synthetic_map(random_pairs(rng, n, n, 0.5, [CHUNK - 1])[None], n)
    a = build_plan(km, backend="cuda")
    check_plan_tables(a, km)
    assert_plans_equal(a, build_plan(km, backend="reference"))
    centre = synthetic_map(np.arange(n)[None], n, offsets=[[0, 0, 0]])
    direct = build_plan(centre, backend="cuda")
    assert direct.centre == 0 and direct.rows == 0 and (to_host(direct.out_table) == -1).all()
    assert (to_host(direct.in_table) == -1).all()
    buffered = build_plan(centre, direct_centre=False, backend="cuda")
    assert buffered.centre == -1 and buffered.rows == n
    np.testing.assert_array_equal(to_host(buffered.out_table)[:, 0], np.arange(n))
    np.testing.assert_array_equal(to_host(buffered.in_table)[:, 0], np.arange(n))


def test_metadata_centre_through_buffers(rng):
    """direct_centre=False on a real map: the centre is an offset like the others."""
    x = tensor(rng, 200, 1)
    km = build_kernel_map(x.coords, 3)  # two chunks under the simulator (CHUNK = 128)
    a = build_plan(km, direct_centre=False, backend="cuda")
    b = build_plan(km, direct_centre=False, backend="reference")
    assert a.centre == -1 and a.base[13] >= 0  # offset 13 is (0, 0, 0)
    check_plan_tables(a, km)
    assert_plans_equal(a, b)


def test_metadata_check_sees_one_corrupted_entry(rng):
    """The checks above can fail: one wrong table entry changes the kernel's tables."""
    table, n_in = boundary_table(rng)
    good = build_plan(synthetic_map(table, n_in), max_padding=0.0, backend="cuda")
    # Remove the pair on the last output of the first chunk of offset 3: the later
    # pairs of offset 3 move up one row.
    bad_table = table.copy()
    bad_table[3, CHUNK - 1] = -1
    km = synthetic_map(bad_table, n_in)
    bad = build_plan(km, max_padding=0.0, backend="cuda")
    check_plan_tables(bad, km)
    with pytest.raises(AssertionError):
        assert_plans_equal(bad, good)
    with pytest.raises(AssertionError):  # the old tables do not fit the new map
        check_plan_tables(good, km)
    # One entry of the kernel's lists off by one is caught by the definition check.
    for side in ("out_lists", "in_lists"):
        lists = getattr(good, side)
        rows = to_host(lists.rows).copy()
        n = int(np.flatnonzero(to_host(lists.count) > 0)[-1])
        rows[n, 0] += 1
        bad = dataclasses.replace(good, **{side: on_host(lists, slots=np.ascontiguousarray(rows.T))})
        with pytest.raises(AssertionError):
            check_plan_tables(bad, synthetic_map(table, n_in))
    # ... and so are two entries of one list swapped (the order is offset order), and
    # one bit of a mask cleared.
    for side in ("out_lists", "in_lists"):
        lists = getattr(good, side)
        count, rows = to_host(lists.count), to_host(lists.rows).copy()
        n = int(np.flatnonzero(count > 1)[0])
        rows[n, [0, 1]] = rows[n, [1, 0]]
        swapped = on_host(lists, slots=np.ascontiguousarray(rows.T))
        with pytest.raises(AssertionError):
            check_plan_tables(dataclasses.replace(good, **{side: swapped}), synthetic_map(table, n_in))
        masks = to_host(lists.masks).copy()
        masks[0, n] &= masks[0, n] - 1  # the lowest set bit
        cleared = on_host(lists, masks=masks)
        with pytest.raises(AssertionError):
            check_plan_tables(dataclasses.replace(good, **{side: cleared}), synthetic_map(table, n_in))


def test_point_lists_round_trip(rng):
    """Dense table -> lists -> dense table, and the kernels take either form."""
    table, n_in = boundary_table(rng)
    plan = build_plan(synthetic_map(table, n_in), max_padding=0.0, backend="reference")
    for dense in (plan.out_table, plan.in_table):
        lists = lists_from_table(dense)
        check_lists(lists, dense)
        np.testing.assert_array_equal(table_from_lists(lists, plan.row_offset, dense.shape[1]), dense)
    f = rng.standard_normal((n_in, 4)).astype(np.float32)
    real = np.zeros(plan.rows, bool)
    real[plan.in_table[plan.in_table >= 0]] = True
    for arg in (plan.in_table, plan.in_lists):
        np.testing.assert_array_equal(to_host(gather_cuda(f, arg, plan.rows, 2))[real],
                                      gather_reference(f, plan.in_table, plan.rows)[real])
    obuf = rng.standard_normal((plan.rows, 4)).astype(np.float32)
    for arg in (plan.out_table, plan.out_lists):
        np.testing.assert_allclose(to_host(scatter_cuda(obuf, arg, tile=4)),
                                   scatter_reference(obuf, plan.out_table), rtol=1e-6)
