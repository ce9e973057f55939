"""A layer past the workspace, cut by ranges of its outputs (numba_sc.gmas.output_ranges):
the ranges cover every output and every pair once within the bound, and a layer run by
them gives the layer run whole (forward, transposed, gradient, fp16 past fp16's range)."""
from dataclasses import replace

import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import dataflow
from numba_sc.conv.gradient import sparse_conv3d_backward
from numba_sc.core.backend import to_host
from numba_sc.gmas import output_ranges as orr

from helpers import layer_weight, small_tensor


@pytest.fixture(autouse=True)
def _default_workspace(monkeypatch):
    # chunks of 8 outputs (blocks of one thread), so that clouds of a few hundred points
    # (what the simulator runs) make several ranges
    monkeypatch.setattr(orr, "CHUNK_THREADS", 1)
    # and every layer past the workspace by ranges, whatever the card's L2 (ranges_pay)
    monkeypatch.setattr(orr, "MIN_SUMS_BYTES", 0)
    ns.clear_caches()
    yield
    ns.clear_caches()


@pytest.fixture
def ranges_run(monkeypatch):
    """The number of ranges of each layer run by ranges (a list that fills as layers run)."""
    ran = []
    real = dataflow.by_output_ranges
    monkeypatch.setattr(dataflow, "by_output_ranges", lambda *a, **k: ran.append(len(a[3])) or real(*a, **k))
    return ran


def test_cut_points_mark_where_the_running_count_passes_each_target():
    pairs = np.array([3, 3, 4, 2, 2, 3, 3, 4, 1, 1])  # the module docstring's example, by chunk
    assert orr.cut_points(pairs, 8) == [2, 5, 8]
    assert orr.cut_points(pairs, 26) == []  # one range
    assert orr.cut_points(np.array([30, 1, 1]), 8) == [1]  # a chunk past several marks: one cut


def _subm_map(rng, n=400, span=4):
    x = small_tensor(rng, n, 2, span=span)
    return x, ns.sparse_conv3d(x, layer_weight(rng, 27, 2, 2, np.float32), backend="cuda", dataflow="gmas").kernel_map


@pytest.mark.parametrize("limit", [700, 1000, 1500])
def test_ranges_cover_every_output_and_pair_once_within_the_bound(rng, limit):
    _, km = _subm_map(rng)
    table = to_host(km.table)
    policy = (0.25, 1 << 17, 0)
    ranges = orr.output_ranges(km.table, 13, limit, policy)
    assert ranges is not None and len(ranges) >= 2
    assert ranges[0].q0 == 0 and ranges[-1].q1 == len(table[0])
    assert all(a.q1 == b.q0 for a, b in zip(ranges, ranges[1:]))  # back to back, in order
    pairs = set()
    for r in ranges:
        plan = orr.range_plan(km.table, r, km.in_coords, km.out_coords, km.offsets, 13, limit, policy)
        assert plan.rows <= limit and plan.centre == -1
        part = table[:, r.q0:r.q1]
        hit = part >= 0
        hit[13] = False  # the centre is made whole, not in the ranges
        assert np.array_equal(r.counts, hit.sum(axis=1))
        assert part[hit].min() >= r.p0 and part[hit].max() < r.p1  # every input a pair reads is in range
        # the range's plan holds exactly these pairs: its dense output table, row by row
        out_table = to_host(plan.out_table)  # (q1 - q0, K)
        assert np.array_equal(out_table.T >= 0, hit)
        in_table = to_host(plan.in_table)  # (p1 - p0, K): each pair's row, gathered from its input
        for k, q in zip(*np.nonzero(hit)):
            assert in_table[part[k, q] - r.p0, k] == out_table[q, k]
            pairs.add((k, r.q0 + q))
    hit = table >= 0
    hit[13] = False
    assert pairs == set(zip(*np.nonzero(hit)))


def test_the_search_counts_serve_when_their_chunks_are_the_ranges_chunks(rng, monkeypatch):
    _, km = _subm_map(rng)
    policy = (0.25, 1 << 17, 0)
    counted = []
    real = orr.chunk_counts_cuda
    monkeypatch.setattr(orr, "chunk_counts_cuda", lambda *a, **k: counted.append(1) or real(*a, **k))
    mine = orr.output_ranges(km.table, 13, 1000, policy)
    assert counted == [1]
    known = (8, real(km.table, 1))
    again = orr.output_ranges(km.table, 13, 1000, policy, known)
    assert counted == [1]  # not counted again
    assert [(r.q0, r.q1, r.p0, r.p1, r.counts.tolist()) for r in again] == \
        [(r.q0, r.q1, r.p0, r.p1, r.counts.tolist()) for r in mine]
    other = orr.output_ranges(km.table, 13, 1000, policy, (16, known[1]))
    assert counted == [1, 1] and len(other) == len(mine)  # other chunks: counted here


def test_no_ranges_when_one_chunk_could_pass_the_workspace(rng):
    _, km = _subm_map(rng)
    # 260 rows: less than one chunk's 8 x 26 pairs and their padding; windows of rows instead
    assert orr.output_ranges(km.table, 13, 260, (0.25, 1 << 17, 0)) is None


def _layer(kind, x, w, w2):
    """A submanifold 3x3x3 layer, a strided 2x2x2 one, or (``w2`` first) the transposed
    layer that inverts the strided one, by gmas."""
    if kind == "subm":
        return ns.sparse_conv3d(x, w, backend="cuda", dataflow="gmas")
    down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend="cuda", dataflow="gmas")
    if kind == "strided":
        return down
    return ns.sparse_conv3d(down, w, transposed=True, kernel_map=down.kernel_map, backend="cuda", dataflow="gmas")


LIMIT = {"subm": 900, "strided": 150, "transposed": 150}  # buffer rows, of about 4,000 / 280 / 280


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_layer_by_ranges_equals_the_layer_whole(rng, kind, dtype, ranges_run):
    x = small_tensor(rng, 400, 3, dtype, span=4)
    w = layer_weight(rng, 27 if kind == "subm" else 8, 3, 3, dtype)
    w2 = layer_weight(rng, 8, 3, 3, dtype)
    ns.set_workspace(0)
    whole = _layer(kind, x, w, w2)
    assert not ranges_run
    ns.set_workspace(LIMIT[kind] * 6 * np.dtype(dtype).itemsize)
    part = _layer(kind, x.without_maps(), w, w2)
    assert ranges_run[-1] >= 3  # the layer, by three ranges or more
    assert np.array_equal(part.coords, whole.coords)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    scale = max(float(np.abs(whole.features.astype(np.float32)).max()), 1.0)
    np.testing.assert_allclose(part.features.astype(np.float32), whole.features.astype(np.float32),
                               atol=tol * scale, rtol=0)


def test_a_layer_whose_sums_are_below_the_floor_keeps_the_windows(rng, monkeypatch, ranges_run):
    x = small_tensor(rng, 400, 3, span=4)
    w = layer_weight(rng, 27, 3, 3, np.float32)
    ns.set_workspace(0)
    whole = _layer("subm", x, w, None)
    sums = whole.features.shape[0] * 3 * 4  # the layer's fp32 running sums, in bytes
    assert orr.ranges_pay(whole.features.shape[0], 3)  # (the fixture's floor 0: every layer pays)
    monkeypatch.setattr(orr, "MIN_SUMS_BYTES", sums)  # at the floor: not past it
    assert not orr.ranges_pay(whole.features.shape[0], 3) and orr.ranges_pay(whole.features.shape[0] + 1, 3)
    ns.set_workspace(LIMIT["subm"] * 6 * 4)
    by_windows = _layer("subm", x.without_maps(), w, None)
    assert not ranges_run  # past the workspace, by windows
    monkeypatch.setattr(orr, "MIN_SUMS_BYTES", sums - 1)
    by_ranges = _layer("subm", x.without_maps(), w, None)
    assert ranges_run
    for part in (by_windows, by_ranges):
        np.testing.assert_allclose(part.features, whole.features, atol=1e-5 * float(np.abs(whole.features).max()))


def test_the_floor_by_default_is_twice_the_l2_cache(monkeypatch):
    monkeypatch.setattr(orr, "MIN_SUMS_BYTES", None)
    monkeypatch.setattr(orr, "l2_cache_bytes", lambda: 50_000_000)
    assert not orr.ranges_pay(100_000_000 // 4, 1) and orr.ranges_pay(100_000_000 // 4 + 1, 1)


def test_the_comparison_catches_a_range_that_reads_its_inputs_one_row_off(rng, monkeypatch, ranges_run):
    x = small_tensor(rng, 400, 3, span=4)
    w = layer_weight(rng, 27, 3, 3, np.float32)
    ns.set_workspace(0)
    whole = _layer("subm", x, w, None).features
    real = dataflow.range_plan
    # each range's map numbered from one input before its first: every pair reads the input before its own
    monkeypatch.setattr(dataflow, "range_plan",
                        lambda table, r, *a: real(table, replace(r, p0=r.p0 - 1) if r.p0 else r, *a))
    ns.set_workspace(LIMIT["subm"] * 6 * 4)
    off = _layer("subm", x.without_maps(), w, None).features
    assert ranges_run and not np.allclose(off, whole, atol=1e-3)


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
def test_the_input_gradient_by_ranges_equals_the_gradient_whole(rng, kind, ranges_run):
    x = small_tensor(rng, 400, 3, span=4)
    if kind == "subm":
        w = layer_weight(rng, 27, 3, 4, np.float32)
        km, inp = ns.sparse_conv3d(x, w, backend="cuda", dataflow="gmas").kernel_map, x
    else:
        down = ns.sparse_conv3d(x, layer_weight(rng, 8, 3, 4, np.float32), kernel_size=2, stride=2,
                                backend="cuda", dataflow="gmas")
        km = down.kernel_map
        if kind == "strided":
            w, inp = layer_weight(rng, 8, 3, 4, np.float32), x
        else:
            inp = down.with_features(rng.standard_normal((len(down), 3)).astype(np.float32))
            w = layer_weight(rng, 8, 3, 4, np.float32)
    n_out = len(km.in_coords) if kind == "transposed" else len(km.out_coords)
    g = rng.standard_normal((n_out, 4)).astype(np.float32)
    ns.set_workspace(0)
    dx0, dw0 = sparse_conv3d_backward(inp, w, g, km, transposed=kind == "transposed", backend="cuda")
    assert not ranges_run
    ns.set_workspace(LIMIT[kind] * 7 * 4)
    dx1, dw1 = sparse_conv3d_backward(inp, w, g, km, transposed=kind == "transposed", backend="cuda")
    assert ranges_run and min(ranges_run) >= 2
    for a, b in ((dx1, dx0), (dw1, dw0)):
        scale = max(float(np.abs(b).max()), 1.0)
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("centre", [0.5, 2.0])
def test_fp16_ranges_mend_products_and_centres_past_fp16(centre, ranges_run):
    """Forty points on a line, kernel 3 along x: neighbours' products of 2 * 40000 pass
    fp16's 65504 (and with ``centre`` 2 the centre products too) where the outputs do not.
    By ranges, each range's guard computes them again in fp32, as the layer whole does."""
    line = np.stack([np.arange(40), np.zeros(40), np.zeros(40)], axis=1).astype(np.int32)
    f = np.tile([40000, 1, -40000] if centre == 0.5 else [40000, -30000, -9000], 14)[:40]
    x = ns.SparseTensor(line, f[:, None].astype(np.float16))
    w = np.full((3, 1, 1), 2, np.float16)
    w[1] = centre
    want = ns.sparse_conv3d(x, w, kernel_size=(3, 1, 1), backend="reference").features.astype(np.float32)
    assert np.isfinite(want).all()
    ns.set_workspace(40 * 4)  # 40 rows of the 78 (2 bytes in, 2 out)
    y = ns.sparse_conv3d(x, w, kernel_size=(3, 1, 1), backend="cuda", dataflow="gmas")
    assert len(ranges_run) == 1 and ranges_run[0] >= 3
    np.testing.assert_array_equal(to_host(y.features).astype(np.float32), want)
