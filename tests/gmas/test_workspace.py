"""The bounded workspace (numba_sc.gmas.workspace): its windows cover every GEMM row once
and stay within the bound; a layer and its gradient run window by window equal the
same layer run whole (under the simulator here; on the GPU with NUMBA_ENABLE_CUDASIM=0),
down to windows that split one offset's rows; the setting's errors and its reset."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import dataflow
from numba_sc.conv.gradient import sparse_conv3d_backward
from numba_sc.gmas import workspace as ws
from numba_sc.gmas.gather import gather_cuda
from numba_sc.gmas.gemm_grouping import Group
from numba_sc.gmas.plan import build_plan

from helpers import layer_weight, small_tensor


@pytest.fixture(autouse=True)
def _default_workspace():
    ns.clear_caches()
    yield
    ns.clear_caches()


GROUPS = [Group((3, 5), 40, 0), Group((1,), 25, 80), Group((0, 2, 4), 10, 105)]  # 135 rows


def covered(wins):
    """(member, absolute row) of every GEMM row of ``wins``, with the row's slot."""
    rows = []
    for w in wins:
        for g in w.gemms:
            for i, k in enumerate(g.group.members):
                for r in range(g.group.rows):
                    rows.append((k, w.lo + g.group.start + i * g.group.rows + r, g.slot + i))
    return rows


def test_one_window_when_the_buffer_fits_or_the_bound_is_off():
    for limit in (0, 135, 1000):
        (w,) = ws.windows(GROUPS, 135, limit)
        assert (w.lo, w.hi) == (0, 135) and w.groups == GROUPS
        assert [g.slot for g in w.gemms] == [0, 2, 3] and not any(g.accumulate for g in w.gemms)


@pytest.mark.parametrize("limit", [1, 7, 10, 24, 25, 40, 79, 80, 100, 134])
def test_windows_cover_every_row_once_within_the_bound(limit):
    wins = ws.windows(GROUPS, 135, limit)
    whole = covered(ws.windows(GROUPS, 135, 0))
    got = covered(wins)
    assert sorted(got) == sorted(whole)  # every row once, with its member's slot
    assert all(0 < w.hi - w.lo <= limit for w in wins)
    assert [w.lo for w in wins] == sorted(w.lo for w in wins) and wins[0].lo == 0 and wins[-1].hi == 135
    for a, b in zip(wins, wins[1:]):
        assert a.hi <= b.lo  # windows do not overlap
    for w in wins:  # each GEMM inside its window
        assert all(0 <= g.group.start and g.group.start + g.group.padded_rows <= w.hi - w.lo for g in w.gemms)


def test_a_member_split_by_rows_adds_its_later_pieces():
    wins = ws.windows(GROUPS, 135, 15)  # offsets 3 and 5 (40 rows each) and 1 (25 rows) split
    pieces = [(g.group.members, g.group.rows, g.slot, g.accumulate) for w in wins for g in w.gemms]
    assert pieces[:3] == [((3,), 15, 0, False), ((3,), 15, 0, True), ((3,), 10, 0, True)]
    assert ((1,), 15, 2, False) in pieces and ((1,), 10, 2, True) in pieces
    assert ((0,), 10, 3, False) in pieces  # whole members of a group split by members
    firsts = [m for m, _, _, acc in pieces if not acc]
    assert sorted(k for m in firsts for k in m) == [0, 1, 2, 3, 4, 5]  # each member written once, then added to


def test_the_setting_its_environment_and_its_errors(monkeypatch):
    monkeypatch.delenv(ws.ENV, raising=False)
    assert ws.workspace_bytes() == ws.DEFAULT_BYTES
    monkeypatch.setenv(ws.ENV, "2")
    assert ws.workspace_bytes() == 2 << 20
    ns.set_workspace(4096)
    assert ns.workspace_bytes() == 4096 and ws.window_rows(100) == 40
    ns.clear_caches()
    assert ws.workspace_bytes() == 2 << 20
    ns.set_workspace(0)
    assert ws.window_rows(100) == 0  # unbounded
    ns.set_workspace(None)
    monkeypatch.setenv(ws.ENV, "lots")
    with pytest.raises(ValueError, match="NUMBA_SC_WORKSPACE_MB"):
        ws.workspace_bytes()
    monkeypatch.setenv(ws.ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        ws.workspace_bytes()
    for bad in (-1, 1.5, "1GB", True):
        with pytest.raises(ValueError, match="nbytes"):
            ns.set_workspace(bad)


def test_a_gathered_window_is_that_slice_of_the_whole_buffer(rng):
    x = small_tensor(rng, 70, 4, span=4)
    y = ns.sparse_conv3d(x, layer_weight(rng, 27, 4, 4, np.float32), backend="cuda", dataflow="gmas")
    plan = build_plan(y.kernel_map, backend="cuda")
    whole = gather_cuda(x.features, plan.in_lists, plan.rows, 1, zero_padding=True)
    lo, hi = plan.rows // 3, 2 * plan.rows // 3
    part = gather_cuda(x.features, plan.in_lists, plan.rows, 1, zero_padding=True, window=(lo, hi))
    assert part.shape == (hi - lo, 4) and np.array_equal(part, whole[lo:hi])
    shifted = gather_cuda(x.features, plan.in_lists, plan.rows, 1, zero_padding=True, window=(lo + 1, hi + 1))
    assert not np.array_equal(shifted, whole[lo:hi])  # the comparison sees a window off by one row


def _layers(x, weights):
    """A submanifold 3x3x3, a strided 2x2x2 and the transposed layer that inverts it, by gmas."""
    w3, w2, wt = weights
    sub = ns.sparse_conv3d(x, w3, backend="cuda", dataflow="gmas")
    down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend="cuda", dataflow="gmas")
    up = ns.sparse_conv3d(down, wt, transposed=True, kernel_map=down.kernel_map, backend="cuda", dataflow="gmas")
    return sub, down, up


# (the simulator runs every thread of every window's three launches: few points, few windows)
@pytest.mark.parametrize("dtype, nbytes", [(np.float32, 200), (np.float32, 1500), (np.float16, 2000)])
def test_a_layer_in_windows_equals_the_layer_whole(rng, dtype, nbytes, monkeypatch):
    x = small_tensor(rng, 70, 5, dtype, span=4)
    weights = (layer_weight(rng, 27, 5, 6, dtype), layer_weight(rng, 8, 5, 6, dtype), layer_weight(rng, 8, 6, 3, dtype))
    ns.set_workspace(0)
    whole = _layers(x, weights)
    ran = []
    real = dataflow.gather_cuda
    monkeypatch.setattr(dataflow, "gather_cuda", lambda *a, **k: ran.append(k.get("window")) or real(*a, **k))
    ns.set_workspace(nbytes)
    parts = _layers(x.without_maps(), weights)
    assert sum(w is not None for w in ran) > 3  # it ran window by window
    tol = 1e-5 if dtype == np.float32 else 2e-3
    for a, b in zip(parts, whole):
        assert np.array_equal(a.coords, b.coords)
        scale = max(float(np.abs(b.features.astype(np.float32)).max()), 1.0)
        np.testing.assert_allclose(a.features.astype(np.float32), b.features.astype(np.float32), atol=tol * scale,
                                   rtol=0)


def test_the_comparison_catches_a_window_scattered_one_row_off(rng, monkeypatch):
    x = small_tensor(rng, 70, 5, span=4)
    weights = (layer_weight(rng, 27, 5, 6, np.float32), layer_weight(rng, 8, 5, 6, np.float32),
               layer_weight(rng, 8, 6, 3, np.float32))
    ns.set_workspace(0)
    whole = _layers(x, weights)[0].features
    real = dataflow.scatter_cuda
    monkeypatch.setattr(dataflow, "scatter_cuda", lambda *a, lo=0, **k: real(*a, lo=lo + 1, **k))
    ns.set_workspace(4000)
    off = _layers(x.without_maps(), weights)[0].features
    # (on a GPU the rows read past the window are whatever the pool held, NaN included)
    assert not np.allclose(off, whole, atol=1e-3)


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
@pytest.mark.parametrize("nbytes", [150, 2000])  # offsets split by rows; groups split
def test_the_gradient_in_windows_equals_the_gradient_whole(rng, kind, nbytes):
    x = small_tensor(rng, 70, 4, span=4)
    w3, w2 = layer_weight(rng, 27, 4, 5, np.float32), layer_weight(rng, 8, 4, 5, np.float32)
    if kind == "subm":
        w, y = w3, ns.sparse_conv3d(x, w3, backend="cuda", dataflow="gmas")
        km, inp = y.kernel_map, x
    else:
        down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend="cuda", dataflow="gmas")
        km = down.kernel_map
        if kind == "strided":
            w, inp = w2, x
        else:
            inp = down.with_features(rng.standard_normal((len(down), 5)).astype(np.float32))
            w = layer_weight(rng, 8, 5, 4, np.float32)
    n_out = len(km.in_coords) if kind == "transposed" else len(km.out_coords)
    g = rng.standard_normal((n_out, w.shape[2])).astype(np.float32)
    ns.set_workspace(0)
    dx0, dw0 = sparse_conv3d_backward(inp, w, g, km, transposed=kind == "transposed", backend="cuda")
    ns.set_workspace(nbytes)
    dx1, dw1 = sparse_conv3d_backward(inp, w, g, km, transposed=kind == "transposed", backend="cuda")
    for a, b in ((dx1, dx0), (dw1, dw0)):
        scale = max(float(np.abs(b).max()), 1.0)
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)
    assert np.abs(dw1 - np.roll(dw0, 1, axis=0)).max() > 1e-3  # an offset off by one shows


def test_fp16_windows_sum_in_fp32_and_repair_products_past_fp16():
    """Output 1 of three points on a line reads +40000 and -40000 through offsets -1 and +1
    (weight 2): products of +-80000, past fp16's 65504, in two windows of one row each. Rounded
    to fp16 between the windows, the first would be inf and stay so; the sum is 0."""
    line = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32)
    x = ns.SparseTensor(line, np.array([[40000], [1], [-40000]], np.float16))
    w = np.full((27, 1, 1), 2, np.float16)
    w[13] = 0.5  # the centre: 20000, 0.5, -20000
    ns.set_workspace(4)  # one buffer row (2 bytes in, 2 out) a window
    ran = []
    real = dataflow.gather_cuda
    try:
        dataflow.gather_cuda = lambda *a, **k: ran.append(k.get("window")) or real(*a, **k)
        y = ns.sparse_conv3d(x, w, backend="cuda", dataflow="gmas")
    finally:
        dataflow.gather_cuda = real
    assert len(ran) == 4  # one window per buffer row
    # 20000 + 2 rounds to 20000 in fp16 (its spacing there is 16); output 1: 0.5 + 80000 - 80000
    assert ns.core.backend.to_host(y.features).ravel().tolist() == [20000, 0.5, -20000]


@pytest.mark.parametrize("nbytes", [0, 4])  # the layer whole (the guard), and in windows (an fp32 centre)
def test_an_fp16_centre_product_past_fp16_whole_and_in_windows(nbytes):
    """Every weight 2: output 0's centre product 2 * 40000 passes 65504, its output 80000 - 60000 does not."""
    line = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32)
    x = ns.SparseTensor(line, np.array([[40000], [-30000], [0]], np.float16))
    ns.set_workspace(nbytes)
    y = ns.sparse_conv3d(x, np.full((27, 1, 1), 2, np.float16), backend="cuda", dataflow="gmas")
    assert ns.core.backend.to_host(y.features).ravel().tolist() == [20000, 20000, -60000]
