"""The full sparse convolution (numba_sc.conv.layer), through the GMaS dataflow.

Every layer is checked three ways: the kernels (backend="cuda", under the CUDA
simulator here), the NumPy reference, and a float64 oracle written in helpers.py
from the definition alone (a dictionary of input coordinates; for every output q
and offset d, if q + d is an input, add its features times W[d]). Nothing of the
package but ``kernel_offsets`` (the documented weight order) is used by the oracle.

Tolerances (RTOL32, RTOL16 in helpers.py): float32 results must match the oracle
to 1e-5 of the result's norm (fp32 rounding of sums of ~27 products); float16
(features, weights, buffers, output in half precision; sums in fp32) to 5e-3 of
the norm: half precision keeps 11 significant bits (unit roundoff 4.9e-4), and a
partial result is rounded in the output buffer and again at the end.

The stages have their own files in tests/gmas: test_metadata.py, test_gather.py,
test_gemm_grouping.py, test_scatter.py, test_autotune.py; the layer's other modules
theirs beside this one (test_arguments.py, test_prepare.py, test_dataflow.py, ...).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_sc
import numba_sc as ns
from numba_sc import SparseTensor, kernel_offsets, sparse_conv3d
from numba_sc.core.backend import to_host
from numba_sc.conv import prepare
from numba_sc.conv.layer import LayerSettings, convolve
from numba_sc.conv.dataflow import gather_gemm_scatter
from numba_sc.gmas.gather import divisors
from numba_sc.map.map_step import build_kernel_map
from numba_sc.gmas.plan import build_plan

from conftest import crop, load_scan
from helpers import RTOL16, RTOL32, assert_close, cloud, downsampled, host, oracle, rel_err, tensor, weights


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


def test_transposed_layer_reads_the_strided_plan_backwards(rng, monkeypatch):
    """sparse_conv3d(transposed=True) builds neither a map nor a plan: it reads the
    strided layer's plan with its lists swapped, and equals the oracle."""
    c = np.unique(rng.integers(0, 9, size=(200, 3)), axis=0).astype(np.int32)
    x = ns.SparseTensor(c, rng.standard_normal((len(c), 3)).astype(np.float32))
    for k in (2, 3):
        y = ns.sparse_conv3d(x, rng.standard_normal((k ** 3, 3, 4)).astype(np.float32), k, stride=2,
                             backend="cuda")
        kept = y.kernel_map.kept_plan[1]
        w2 = rng.standard_normal((k ** 3, 4, 2)).astype(np.float32)
        monkeypatch.setattr(prepare, "build_plan", lambda *a, **kw: pytest.fail("a plan was built"))
        monkeypatch.setattr(prepare, "build_kernel_map", lambda *a, **kw: pytest.fail("a map was built"))
        up = ns.sparse_conv3d(y, w2, transposed=True, kernel_map=y.kernel_map, backend="cuda")
        monkeypatch.undo()
        assert y.kernel_map.kept_plan[1] is kept
        np.testing.assert_array_equal(host(up.coords), x.coords)
        want = oracle(y.coords, y.features, x.coords, w2, -kernel_offsets(k))
        assert rel_err(host(up.features), want) < 1e-5
        t = up.kernel_map  # the map in the transposed direction, made when asked for
        assert t.is_transposed and np.array_equal(host(t.out_coords), x.coords)


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


# ------------------------------------------------------ maps and plans reused
def test_layers_sharing_a_map_share_its_plan(rng):
    """A map passed in keeps the plan built from it: the next layer given it reuses the
    plan (and is still right); another policy builds a new one. A map a layer
    builds for itself keeps none (memory is held only where a map is reused). (The gmas
    dataflow's plan: with so few channels, auto would run the implicit GEMM on a given map.)"""
    x = tensor(rng, 150, 3)
    w, w2 = weights(rng, 27, 3, 4), weights(rng, 27, 3, 4)
    y = sparse_conv3d(x, w, 3, backend="cuda", dataflow="gmas")
    km = y.kernel_map
    assert getattr(km, "kept_plan", None) is None
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


def test_plan_variants_agree(rng):
    """Sorted or map order, grouped or not, centre direct or through the buffers."""
    x = tensor(rng, 150, 3)
    w = weights(rng, 27, 3, 3)
    km = build_kernel_map(x.coords, 3)
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    for kw in [dict(sort=False), dict(max_padding=0.0), dict(max_padding=5.0),
               dict(direct_centre=False), dict(solo_rows=1)]:
        plan = build_plan(km, backend="cuda", **kw)
        assert_close(to_host(gather_gemm_scatter(x.features, w, plan, (1, 1), backend="cuda")), want)


def test_kernel_map_reuse_skips_map_step(rng, monkeypatch):
    x = tensor(rng, 150, 3)
    w1, w2 = weights(rng, 27, 3, 4), weights(rng, 27, 4, 2)
    y = sparse_conv3d(x, w1, backend="cuda")

    def no_map(*a, **k):
        raise AssertionError("the Map step ran again")

    monkeypatch.setattr(prepare, "build_kernel_map", no_map)
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


# ---------------------------------------------------------------- bad input
def test_bad_inputs(rng):
    x = tensor(rng, 60, 4)
    w = weights(rng, 27, 4, 4)
    with pytest.raises(ValueError, match="coords must be unique"):
        SparseTensor(np.zeros((2, 3), np.int32), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="one feature row per coordinate"):
        SparseTensor(x.coords, x.features[:-1])
    with pytest.raises(TypeError, match="float32 or float16"):
        SparseTensor(x.coords, x.features.astype(np.int32))
    with pytest.raises(TypeError, match="x's features are float64, which runs only on backend='reference'"):
        sparse_conv3d(SparseTensor(x.coords, x.features.astype(np.float64)), weights(rng, 27, 4, 4).astype(
            np.float64), backend="cuda")
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


def test_map_of_another_cloud_is_refused():
    """The issue's example: a map built on one cloud, given to a tensor of the same size
    on other coordinates, used to return that cloud's coordinates and wrong features."""
    a = ns.SparseTensor(np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32), np.ones((3, 1), np.float32))
    b = ns.SparseTensor(np.array([[5, 5, 5], [6, 5, 5], [9, 9, 9]], np.int32), np.ones((3, 1), np.float32))
    w = np.ones((27, 1, 1), np.float32)
    m = ns.sparse_conv3d(a, w, backend="reference").kernel_map
    for bk in ("reference", "cuda"):
        with pytest.raises(ValueError, match="built on other coordinates than x's"):
            ns.sparse_conv3d(b, w, kernel_map=m, backend=bk)
    # the same coordinates in a tensor made anew are fine (one comparison)
    a2 = ns.SparseTensor(np.array([[2, 0, 0], [0, 0, 0], [1, 0, 0]], np.int32), np.ones((3, 1), np.float32))
    assert np.allclose(host(ns.sparse_conv3d(a2, w, kernel_map=m, backend="reference").features), [[2], [3], [2]])
    y = ns.sparse_conv3d(a, np.ones((8, 1, 1), np.float32), 2, stride=2, backend="reference")
    with pytest.raises(ValueError, match="other coordinates"):
        ns.sparse_conv3d(ns.SparseTensor(np.array([[4, 4, 4], [8, 8, 8]], np.int32),
                                         np.ones((2, 1), np.float32), stride=2),
                         np.ones((8, 1, 1), np.float32), transposed=True, kernel_map=y.kernel_map,
                         backend="reference")


def test_convolve_takes_the_settings_of_sparse_conv3d(rng):
    """convolve(x, w, LayerSettings(...)) and convolve(x, w, **keywords) are sparse_conv3d;
    a keyword it does not know is refused (not ignored)."""
    x = tensor(rng, 150, 4)
    w = weights(rng, 8, 4, 5)
    want = sparse_conv3d(x, w, 2, 2, backend="reference", sort_offsets=False)
    for got in (convolve(x, w, LayerSettings(2, 2, backend="reference", sort_offsets=False)),
                convolve(x, w, kernel_size=2, stride=2, backend="reference", sort_offsets=False)):
        np.testing.assert_array_equal(got.coords, want.coords)
        np.testing.assert_array_equal(got.features, want.features)
    other = convolve(x, w, kernel_size=2, stride=1, backend="reference")
    assert len(other) != len(want)  # the settings are read, not defaulted
    with pytest.raises(TypeError, match="kernel_sise"):
        convolve(x, w, kernel_sise=2)
