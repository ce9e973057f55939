"""The GMaS step and the full sparse convolution.

Every layer is checked three ways: the kernels (backend="cuda", under the CUDA
simulator here), the NumPy reference, and a float64 oracle written below from
the definition alone (a dictionary of input coordinates; for every output q and
offset d, if q + d is an input, add its features times W[d]). Nothing of the
package but ``kernel_offsets`` (the documented weight order) is used by the oracle.

Tolerances: float32 results must match the oracle to 1e-5 of the result's norm
(fp32 rounding of sums of ~27 products); float16 (features, weights, buffers,
output in half precision; sums in fp32) to 5e-3 of the norm: half precision keeps
11 significant bits (unit roundoff 4.9e-4), and a partial result is rounded in
the output buffer and again at the end.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_sc
from numba_sc import SparseTensor, kernel_offsets, sparse_conv3d
from numba_sc import autotune as autotune_mod_fn  # the function
from numba_sc.core.device import simulating
from numba_sc.core.backend import to_device, to_host
from numba_sc.core.pieces import as_array
from numba_sc.gmas.conv import gmas, resolve_tiles
from numba_sc.gmas.gather import divisors, gather_cuda, gather_reference
from numba_sc.gmas.gemm_grouping import launch_rows, make_groups, offset_order, padding_report
from numba_sc.map.kernel_map import build_kernel_map
from numba_sc.gmas.metadata import (ITEMS_PER_THREAD, build_plan, build_plan_cuda,
                               chunk_counts_cuda, chunk_counts_reference, chunk_rank_reference,
                               chunk_size, lists_from_table, masks_cuda, masks_reference,
                               table_from_lists)
from numba_sc.gmas.scatter import scatter, scatter_cuda, scatter_reference

from conftest import crop, load_scan

RTOL32 = 1e-5
RTOL16 = 5e-3


# ------------------------------------------------------------------- helpers
def oracle(in_coords, in_feats, out_coords, weight, offsets):
    """float64 ``out[q] = sum_k in[q + offsets[k]] @ W[k]`` by dictionary lookups.

    Coordinates may carry a batch column (N, 4): offsets move x, y, z only.
    """
    s = in_coords.shape[1] - 3
    where = {tuple(c): j for j, c in enumerate(np.asarray(in_coords).tolist())}
    f = np.asarray(in_feats, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    out = np.zeros((len(out_coords), w.shape[2]))
    pairs = [([], []) for _ in offsets]
    for i, q in enumerate(np.asarray(out_coords).tolist()):
        for k, d in enumerate(np.asarray(offsets).tolist()):
            p = tuple(q[:s]) + (q[s] + d[0], q[s + 1] + d[1], q[s + 2] + d[2])
            j = where.get(p)
            if j is not None:
                pairs[k][0].append(i)
                pairs[k][1].append(j)
    for k, (ii, jj) in enumerate(pairs):  # the arithmetic vectorized, per offset
        if ii:
            np.add.at(out, np.array(ii), f[np.array(jj)] @ w[k])
    return out


def downsampled(coords, st):
    """Expected output coordinates of a strided layer: floor(P / st) * st, unique, sorted."""
    c = np.array(coords, dtype=np.int64)
    s = c.shape[1] - 3
    c[:, s:] = np.floor_divide(c[:, s:], st) * st
    return np.unique(c, axis=0).astype(np.int32)  # np.unique sorts rows lexicographically


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close(got, want, rtol=RTOL32):
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def cloud(rng, n, extent=8, batch=0):
    """About n unique random voxels in an extent^3 box (batch > 0: (N, 4) coords)."""
    c = rng.integers(0, extent, size=(n, 3))
    if batch:
        c = np.concatenate([rng.integers(0, batch, size=(n, 1)), c], axis=1)
    c = np.unique(c, axis=0)
    return c[rng.permutation(len(c))].astype(np.int32)  # unsorted, as a user may pass


def tensor(rng, n, c_in, extent=8, batch=0, dtype=np.float32):
    c = cloud(rng, n, extent, batch)
    return SparseTensor(c, rng.standard_normal((len(c), c_in)).astype(dtype))


def weights(rng, K, c_in, c_out, dtype=np.float32):
    return (rng.standard_normal((K, c_in, c_out)) / np.sqrt(c_in)).astype(dtype)


def check_layer(x, w, kernel_size=3, stride=1, dilation=1, tile_size=None, rtol=RTOL32):
    """Kernel == reference == oracle for one forward layer; returns the kernel output."""
    got = sparse_conv3d(x, w, kernel_size, stride, dilation, backend="cuda", tile_size=tile_size)
    ref = sparse_conv3d(x, w, kernel_size, stride, dilation, backend="reference")
    st = np.array(numba_sc.core.conventions.as_int_tuple(stride, "s")) * np.array(x.stride)
    want_coords = x.coords if stride == 1 else downsampled(x.coords, st)
    np.testing.assert_array_equal(got.coords, want_coords)
    np.testing.assert_array_equal(ref.coords, want_coords)
    assert got.stride == tuple(int(v) for v in st) == ref.stride
    offs = kernel_offsets(kernel_size, dilation, x.stride)
    want = oracle(x.coords, x.features, want_coords, w, offs)
    assert got.features.dtype == x.features.dtype
    assert_close(got.features, want, rtol)
    assert_close(ref.features, want, rtol)
    assert_close(got.features, ref.features, rtol / 2)  # same sums in the same order
    return got


# -------------------------------------------------------- layers, three ways
@pytest.mark.parametrize("k", [3, 5])
def test_submanifold(rng, k):
    x = tensor(rng, 220 if k == 3 else 120, 4)
    check_layer(x, weights(rng, k ** 3, 4, 6), k)


@pytest.mark.parametrize("k", [2, 3])
def test_downsample_stride2(rng, k):
    x = tensor(rng, 200, 3)
    y = check_layer(x, weights(rng, k ** 3, 3, 5), k, stride=2)
    assert len(y) < len(x)


@pytest.mark.parametrize("k", [2, 3])
def test_transposed_undoes_stride2(rng, k):
    x = tensor(rng, 180, 3)
    y = sparse_conv3d(x, weights(rng, k ** 3, 3, 4), k, stride=2, backend="cuda")
    w2 = weights(rng, k ** 3, 4, 2)
    got = sparse_conv3d(y, w2, transposed=True, kernel_map=y.kernel_map, backend="cuda")
    ref = sparse_conv3d(y, w2, transposed=True, kernel_map=y.kernel_map, backend="reference")
    np.testing.assert_array_equal(got.coords, x.coords)
    assert got.stride == x.stride == (1, 1, 1)
    # Read backwards: out[p] += in[q] @ W[k] whenever p = q + delta_k, i.e. the oracle
    # with inputs on Q and offsets -delta_k.
    want = oracle(y.coords, y.features, x.coords, w2, -kernel_offsets(k))
    assert_close(got.features, want)
    assert_close(ref.features, want)


def test_isolated_points(rng):
    """No neighbours at all: only the centre product (empty buffers, no GEMM group)."""
    c = (cloud(rng, 40, 10) * 3).astype(np.int32)  # spacing 3: nothing within reach 1
    x = SparseTensor(c, rng.standard_normal((len(c), 3)).astype(np.float32))
    w = weights(rng, 27, 3, 2)
    y = check_layer(x, w, 3)
    assert_close(y.features, x.features.astype(np.float64) @ w[13])
    assert build_plan(y.kernel_map, backend="cuda").rows == 0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), extent=st.integers(1, 6), k=st.sampled_from([1, 2, 3, (1, 3, 1), (2, 1, 3)]),
       s=st.sampled_from([1, 2, (1, 2, 1)]), d=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_reference_matches_oracle_property(n, extent, k, s, d, seed):
    """Random small layers through the reference: any kernel, stride, dilation."""
    r = np.random.default_rng(seed)
    x = tensor(r, n, 2, extent=extent)
    K = int(np.prod(numba_sc.core.conventions.as_int_tuple(k, "k")))
    w = weights(r, K, 2, 3)
    y = sparse_conv3d(x, w, k, s, d, backend="reference")
    st_ = np.array(numba_sc.core.conventions.as_int_tuple(s, "s"))
    np.testing.assert_array_equal(y.coords, downsampled(x.coords, st_))
    want = oracle(x.coords, x.features, y.coords, w, kernel_offsets(k, d))
    assert_close(y.features, want)


def test_second_level_uses_tensor_stride(rng):
    """Two stride-2 layers: the second's offsets are scaled by the tensor stride 2."""
    x = tensor(rng, 250, 2, extent=12)
    y = sparse_conv3d(x, weights(rng, 8, 2, 3), 2, stride=2, backend="reference")
    assert y.stride == (2, 2, 2)
    check_layer(y, weights(rng, 27, 3, 2), 3, stride=2)


def test_dilation2(rng):
    check_layer(tensor(rng, 220, 3), weights(rng, 27, 3, 4), 3, dilation=2)


def test_anisotropic_kernel(rng):
    check_layer(tensor(rng, 200, 3), weights(rng, 3, 3, 4), (1, 3, 1))


@pytest.mark.parametrize("c", [1, 3, 16, 33])
def test_channel_counts(rng, c):
    # tiles: the largest divisor up to 11 for the gather, the smallest > 1 for the scatter
    tg = max(d for d in divisors(c) if d <= 11)
    ts = min([d for d in divisors(c) if d > 1] or [1])
    check_layer(tensor(rng, 80, c, extent=6), weights(rng, 27, c, c), 3, tile_size=(tg, ts))


def test_fp16(rng):
    x = tensor(rng, 200, 8, dtype=np.float16)
    got = check_layer(x, weights(rng, 27, 8, 8, np.float16), 3, rtol=RTOL16)
    assert got.features.dtype == np.float16


def test_fp16_downsample(rng):
    x = tensor(rng, 200, 4, dtype=np.float16)
    check_layer(x, weights(rng, 8, 4, 4, np.float16), 2, stride=2, rtol=RTOL16)


def test_batches_do_not_mix(rng):
    # Two clouds with the same spatial coordinates: a layer must keep them apart.
    c = cloud(rng, 120, 6)
    coords = np.concatenate([np.c_[np.zeros(len(c), np.int32), c], np.c_[np.ones(len(c), np.int32), c]])
    f = rng.standard_normal((len(coords), 3)).astype(np.float32)
    x = SparseTensor(coords, f)
    w = weights(rng, 27, 3, 4)
    y = check_layer(x, w, 3)
    # each batch alone gives the same rows
    half = SparseTensor(x.coords[x.coords[:, 0] == 1][:, 1:], x.features[x.coords[:, 0] == 1])
    alone = sparse_conv3d(half, w, backend="reference")
    assert_close(y.features[y.coords[:, 0] == 1], alone.features)
    check_layer(x, weights(rng, 8, 3, 2), 2, stride=2)


@pytest.mark.parametrize("c_in,c_out", [(12, 6)])
def test_every_tile_size(rng, c_in, c_out):
    """Gather with every divisor of C_in and scatter with every divisor of C_out."""
    x = tensor(rng, 60, c_in, extent=5)
    km = build_kernel_map(x.coords, 3)
    plan = build_plan(km, backend="cuda")
    in_table, out_table = to_host(plan.in_table), to_host(plan.out_table)
    ref_buf = gather_reference(x.features, in_table, plan.rows)
    real = np.zeros(plan.rows, bool)
    real[in_table[in_table >= 0]] = True  # padding rows are never written
    for t in divisors(c_in):
        buf = to_host(gather_cuda(x.features, plan.in_table, plan.rows, t))
        np.testing.assert_array_equal(buf[real], ref_buf[real])
    # fp16: tiles of 2, 6 (4-byte words), 4, 12 (8-byte words) and 1, 3 (channels)
    half = x.features.astype(np.float16)
    half[0, 0] = np.nan  # stays a NaN (its payload may not: fp16 -> fp32 -> fp16 on the channel path)
    ref_half = gather_reference(half, in_table, plan.rows)
    for t in divisors(c_in):
        buf = to_host(gather_cuda(half, plan.in_lists, plan.rows, t))
        assert buf.dtype == np.float16
        np.testing.assert_array_equal(buf[real], ref_half[real])  # (NaN equals NaN here)
    obuf = rng.standard_normal((plan.rows, c_out)).astype(np.float32)
    want = scatter_reference(obuf, out_table)
    for t in divisors(c_out):
        got = to_host(scatter_cuda(obuf, plan.out_table, tile=t))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The scatter reads words and unpacks them (numba_sc.core.words). With a centre
    # product to start from, fp32 and fp16, every tile of 12 channels: fp16 tiles
    # 4 and 12 are 8-byte words, 2 and 6 4-byte words, 1 and 3 channel by channel;
    # fp32 tiles 2, 4, 6, 12 are 8-byte words, 1 and 3 4-byte ones. Negative,
    # subnormal and infinite values check the bits of every lane: the kernel sums in
    # fp32 in offset order and rounds once, as the reference does, so the results
    # must be equal to the bit.
    for dt in (np.float16, np.float32):
        ob = (rng.standard_normal((plan.rows, 12)) * 100).astype(dt)
        ob[:, 5] = -ob[:, 5] * 1e-7  # fp16 subnormals (and tiny fp32 values)
        ob[plan.rows // 2, 7] = np.inf
        init = rng.standard_normal((len(x), 12)).astype(dt)
        want = scatter_reference(ob, out_table, init)
        for t in divisors(12):
            got = to_host(scatter(ob, out_table, init, tile=t, backend="cuda"))
            assert got.dtype == dt
            np.testing.assert_array_equal(got, want, err_msg=f"{np.dtype(dt).name} tile {t}")
    # and end to end, for a few pairs
    w = weights(rng, 27, c_in, c_out)
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    for tiles in [(1, 1), (4, 3), (12, 6), 2, 3]:
        got = sparse_conv3d(x, w, backend="cuda", tile_size=tiles)
        assert_close(got.features, want)


# ---------------------------------------------------------------- real scans
def test_full_kitti_reference():
    """A 3x3x3 submanifold layer, 4 -> 8 channels, on the whole SemanticKITTI scan."""
    pts = load_scan("semantickitti")
    vox = numba_sc.voxelize(pts[:, :3], 0.05, pts, backend="reference")
    assert len(vox) == 94444
    x = SparseTensor(vox.coords, vox.features.astype(np.float32))
    w = weights(np.random.default_rng(1), 27, 4, 8)
    y = sparse_conv3d(x, w, backend="reference")
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    assert_close(y.features, want)
    rep = numba_sc.grouping_report(y.kernel_map)
    # Sorting the offsets by pair count never needs more launches than map order.
    assert rep["sorted"]["launches"] <= rep["map"]["launches"]
    assert rep["sorted"]["overhead"] <= 0.25


def test_scan_crops_through_kernels(scan, rng):
    name, pts, voxel = scan
    part = crop(pts, 600, seed=3)
    vox = numba_sc.voxelize(part[:, :3], voxel, part[:, 3:], backend="reference")
    x = SparseTensor(vox.coords, vox.features.astype(np.float32))
    c_in = x.channels
    check_layer(x, weights(rng, 27, c_in, 4), 3)
    check_layer(x, weights(rng, 8, c_in, 4), 2, stride=2)


# ------------------------------------------------------------- metadata, plan
def test_metadata_worked_example():
    """The example in metadata's docstring, exactly, on both backends."""
    from types import SimpleNamespace

    km = SimpleNamespace(
        table=np.array([[1, -1, 0], [0, 1, 2]], np.int32), counts=np.array([2, 3]),
        offsets=np.array([[0, 0, -1], [0, 0, 1]], np.int32),
        in_coords=np.zeros((3, 3), np.int32), out_coords=np.zeros((3, 3), np.int32))
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


def test_layers_sharing_a_map_share_its_plan(rng):
    """A map passed in keeps the plan built from it: the next layer given it reuses the
    plan (and is still right); another policy builds a new one. A map a layer
    builds for itself keeps none (memory is held only where a map is reused). (The gmas
    dataflow's plan: with so few channels, auto would run the implicit GEMM on a given map.)"""
    x = tensor(rng, 150, 3)
    w, w2 = weights(rng, 27, 3, 4), weights(rng, 27, 3, 4)
    y = sparse_conv3d(x, w, 3, backend="cuda", dataflow="gmas")
    km = y.kernel_map
    assert getattr(km, "_plan", None) is None
    want = to_host(sparse_conv3d(x, w2, 3, backend="reference").features)
    z = sparse_conv3d(x, w2, kernel_map=km, backend="cuda", dataflow="gmas")
    plan = km.kept_plan[1]
    z2 = sparse_conv3d(x, w2, kernel_map=km, backend="cuda", dataflow="gmas")
    assert km.kept_plan[1] is plan
    for got in (z, z2):
        np.testing.assert_allclose(to_host(got.features), want, rtol=1e-4, atol=1e-4)
    z0 = sparse_conv3d(x, w2, kernel_map=km, backend="cuda", max_padding=0.0, launch_rows=0, dataflow="gmas")
    assert km.kept_plan[1] is not plan and km.kept_plan[1].policy[:1] == (0.0,)
    np.testing.assert_allclose(to_host(z0.features), want, rtol=1e-4, atol=1e-4)


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
    """A kernel map made of a table alone (what build_plan reads of a map)."""
    from types import SimpleNamespace

    table = np.asarray(table, np.int32)
    K, n_out = table.shape
    if offsets is None:  # K distinct offsets, none of them the centre
        offsets = np.stack([np.zeros(K), np.zeros(K), np.arange(1, K + 1)], axis=1)
    return SimpleNamespace(
        table=table, counts=(table >= 0).sum(axis=1), offsets=np.asarray(offsets, np.int32),
        in_coords=np.zeros((n_in, 3), np.int32), out_coords=np.zeros((n_out, 3), np.int32))


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


def test_plan_variants_agree(rng):
    """Sorted or map order, grouped or not, centre direct or through the buffers."""
    x = tensor(rng, 150, 3)
    w = weights(rng, 27, 3, 3)
    km = build_kernel_map(x.coords, 3)
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    for kw in [dict(sort=False), dict(max_padding=0.0), dict(max_padding=5.0),
               dict(direct_centre=False), dict(solo_rows=1)]:
        plan = build_plan(km, backend="cuda", **kw)
        assert_close(to_host(gmas(x.features, w, plan, (1, 1), backend="cuda")), want)


def test_kernel_map_reuse_skips_map_step(rng, monkeypatch):
    x = tensor(rng, 150, 3)
    w1, w2 = weights(rng, 27, 3, 4), weights(rng, 27, 4, 2)
    y = sparse_conv3d(x, w1, backend="cuda")

    def no_map(*a, **k):
        raise AssertionError("the Map step ran again")

    monkeypatch.setattr(numba_sc.gmas.conv, "build_kernel_map", no_map)
    z = sparse_conv3d(y, w2, kernel_map=y.kernel_map, backend="cuda")
    want = oracle(y.coords, y.features, y.coords, w2, kernel_offsets(3))
    assert_close(z.features, want)
    assert z.kernel_map is y.kernel_map


# --------------------------------------------------------- the check can fail
def test_cross_check_catches_one_wrong_row(rng):
    x = tensor(rng, 150, 4)
    w = weights(rng, 27, 4, 4)
    y = sparse_conv3d(x, w, backend="cuda")
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    assert_close(y.features, want)
    bad = y.features.copy()
    bad[len(bad) // 2, 1] += 0.01 * np.abs(want).max()  # one channel of one row
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(bad, want)
    swapped = y.features.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two rows exchanged: right values, wrong place
    with pytest.raises(AssertionError):
        assert_close(swapped, want)


# ------------------------------------------------------------ SparseTensor
def test_sparse_tensor_sorts_once(rng):
    c = cloud(rng, 50)
    f = rng.standard_normal((len(c), 2)).astype(np.float32)
    x = SparseTensor(c, f, stride=2)
    keys = numba_sc.pack_keys(x.coords)
    assert (np.diff(keys) > 0).all()
    np.testing.assert_array_equal(x.coords, c[x.order])
    np.testing.assert_array_equal(x.features, f[x.order])
    assert x.stride == (2, 2, 2) and x.kernel_map is None and len(x) == len(c)


# ---------------------------------------------------------------- bad input
def test_bad_inputs(rng):
    x = tensor(rng, 60, 4)
    w = weights(rng, 27, 4, 4)
    with pytest.raises(ValueError, match="coords must be unique"):
        SparseTensor(np.zeros((2, 3), np.int32), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="one feature row per coordinate"):
        SparseTensor(x.coords, x.features[:-1])
    with pytest.raises(TypeError, match="float32 or float16"):
        SparseTensor(x.coords, x.features.astype(np.float64))
    with pytest.raises(ValueError, match=r"weight must have shape \(K, C_in, C_out\) = \(27, 4"):
        sparse_conv3d(x, weights(rng, 8, 4, 4))
    with pytest.raises(ValueError, match="4 input channels"):
        sparse_conv3d(x, weights(rng, 27, 3, 4))
    with pytest.raises(TypeError, match=r"weight.astype\(np.float32\)"):
        sparse_conv3d(x, w.astype(np.float16))
    with pytest.raises(ValueError, match="transposed=True needs kernel_map="):
        sparse_conv3d(x, w, transposed=True)
    with pytest.raises(ValueError, match="does not divide the input channels"):
        sparse_conv3d(x, w, tile_size=3)
    with pytest.raises(ValueError, match="not the output channels"):
        sparse_conv3d(x, weights(rng, 27, 4, 6), tile_size=4)
    with pytest.raises(ValueError, match=r"tile_size\[1\] \(scatter\)=4 does not divide"):
        sparse_conv3d(x, weights(rng, 27, 4, 6), tile_size=(4, 4))
    y = sparse_conv3d(x, weights(rng, 8, 4, 4), 2, stride=2, backend="reference")
    with pytest.raises(ValueError, match="kernel_map does not fit x"):
        sparse_conv3d(x, w, kernel_map=y.kernel_map, transposed=True)
    with pytest.raises(TypeError, match="SparseTensor"):
        sparse_conv3d(x.features, w)


# ---------------------------------------------------------------- autotune
def test_autotune_search_with_injected_timer(rng):
    from numba_sc.gmas.autotune import cached, clear_cache, layer_key

    clear_cache()
    x = tensor(rng, 40, 4, extent=5)
    w = weights(rng, 27, 4, 6)
    # One round times gather T = 1, 2, 4 then scatter T = 1, 2, 3, 6; the next
    # round the other way round. Fastest: gather T = 2, scatter T = 3.
    steady = [3.0, 1.0, 2.0, 5.0, 4.0, 1.0, 6.0]
    burst = [3.0, 9.0, 2.0, 5.0, 4.0, 9.0, 6.0]  # the GPU slowed down while T = 2 and 3 ran
    script = iter(steady + burst[::-1] + steady)  # 3 rounds, interleaved
    calls = []

    def timer(fn):
        fn()  # runs the kernel (simulator) with that tile size
        calls.append(1)
        return next(script)

    choice = autotune_mod_fn(x, w, layer="enc1", timer=timer, rounds=3, backend="cuda")
    # the burst cost the best tiles one round of three: the median drops it
    assert (choice.gather, choice.scatter, choice.source) == (2, 3, "autotuned")
    assert choice.timings["gather"] == {1: 3.0, 2: 1.0, 4: 2.0} and len(calls) == 21
    assert cached(layer_key("enc1", 4, 6, 27, np.float32, False)) is choice
    assert resolve_tiles(None, 4, 6, len(x), len(x), np.float32, 27, False, "enc1") == (2, 3)
    y = sparse_conv3d(x, w, backend="cuda", layer="enc1")  # runs with the tuned tiles
    assert_close(y.features, oracle(x.coords, x.features, x.coords, w, kernel_offsets(3)))
    # Without a timer: on a GPU the kernels are timed; under the simulator the
    # heuristic is used, with no timing (simulated times mean nothing).
    h = autotune_mod_fn(x, w, layer="enc2", backend="cuda")
    if simulating():
        assert h.source == "heuristic" and h.timings == {}
    else:
        assert h.source == "autotuned" and sorted(h.timings["gather"]) == [1, 2, 4]
    assert 4 % h.gather == 0 and 6 % h.scatter == 0
    clear_cache()


def test_heuristic_tile():
    from numba_sc.gmas.autotune import heuristic_tile

    assert heuristic_tile(64, 10) == 1  # tiny cloud: all the parallelism
    assert heuristic_tile(64, 1_000_000) == 8  # big cloud: 32-byte tiles
    assert heuristic_tile(64, 1_000_000, itemsize=2) == 16
    assert heuristic_tile(33, 1_000_000) == 3
    assert heuristic_tile(64, 20_000) == 8 and heuristic_tile(64, 5_000) == 2


def test_public_scatter_leaves_init_untouched():
    from numba_sc.gmas.scatter import scatter

    obuf = np.arange(12, dtype=np.float32).reshape(6, 2)
    table = np.array([[0, 3], [1, -1], [2, 5]], dtype=np.int32)
    init = np.ones((3, 2), np.float32)
    for backend in ("cuda", "reference"):
        out = to_host(scatter(obuf, table, init, backend=backend))
        assert np.array_equal(init, np.ones((3, 2), np.float32))
        assert np.array_equal(out, 1 + np.array([[6, 8], [2, 3], [14, 16]], np.float32))


def test_take_weights_kernel_matches_reference(rng):
    """The weights in buffer order: kernel == weight[order], repeats and all."""
    from numba_sc.gmas.gemm_grouping import take_weights_cuda, take_weights_reference

    for dtype in (np.float32, np.float16):
        w = rng.normal(size=(7, 3, 5)).astype(dtype)
        order = np.array([6, 0, 3, 3, 1], np.int64)
        got = to_host(take_weights_cuda(to_device(w), to_device(order)))
        np.testing.assert_array_equal(got, take_weights_reference(w, order))
        np.testing.assert_array_equal(got[2], w[3])  # not a shifted copy
