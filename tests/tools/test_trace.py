"""trace(): every intermediate, kernels == reference, and a difference located.
(A broken Map kernel located by the checker is in test_check.py.)"""
import numpy as np

import numba_sc
from numba_sc import SparseTensor, sparse_conv3d, trace

from conftest import crop, load_scan


def small_layer(rng, n=300, c_in=4, c_out=3, k=3):
    coords = np.unique(rng.integers(0, 12, size=(n, 3)), axis=0).astype(np.int32)
    feats = rng.normal(size=(len(coords), c_in)).astype(np.float32)
    weight = rng.normal(size=(k ** 3, c_in, c_out)).astype(np.float32)
    return coords, feats, weight


def test_trace_names_every_stage_and_matches_the_layer(rng):
    coords, feats, weight = small_layer(rng)
    t = trace(coords, feats, weight, backend="reference", source_block=32, query_block=16)
    for name in ["P", "Q", "offsets", "source_keys", "query_keys", "pivots", "borders", "balanced_blocks",
                 "kernel_map", "pair_counts", "offset_order", "gemm_groups", "input_metadata_table",
                 "output_metadata_table", "input_buffer", "output_buffer", "centre_product", "output_features"]:
        assert name in t, name
    y = sparse_conv3d(SparseTensor(coords, feats), weight, backend="reference")
    np.testing.assert_allclose(t["output_features"], y.features, rtol=1e-5, atol=1e-5)
    # the pieces are consistent with each other
    assert t["borders"].shape == (27, len(t["pivots"]) + 1)
    assert np.all(np.diff(t["source_keys"]) > 0)
    assert (t["balanced_blocks"][:, 3] - t["balanced_blocks"][:, 2]).max() <= 16
    assert np.array_equal(t["pair_counts"], (t["kernel_map"] >= 0).sum(axis=1))
    assert "kernel_map" in t.describe()


def test_trace_kernels_equal_reference(rng):
    coords, feats, weight = small_layer(rng, n=250)
    ref = trace(coords, feats, weight, backend="reference", source_block=32, query_block=16)
    ker = trace(coords, feats, weight, backend="cuda", source_block=32, query_block=16)
    results = ref.compare(ker)
    assert len(results) == len(ref)
    assert all(ok for _, ok, _ in results), [r for r in results if not r[1]]


def test_trace_compare_locates_a_difference(rng):
    coords, feats, weight = small_layer(rng, n=200)
    ref = trace(coords, feats, weight, backend="reference")
    other = {k: np.array(v, copy=True) for k, v in ref.items()}
    i = int(np.argwhere(other["kernel_map"] >= 0)[5][1])
    other["kernel_map"][:, i] = np.roll(other["kernel_map"][:, i], 1)  # a wrong map column
    bad = {n: d for n, ok, d in ref.compare(other) if not ok}
    assert list(bad) == ["kernel_map"] and "first at" in bad["kernel_map"]


def test_trace_on_a_real_crop():
    pts = crop(load_scan("semantickitti"), 800)
    vox = numba_sc.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, pts[:, 3:], backend="reference")
    w = np.random.default_rng(0).normal(size=(27, 1, 2)).astype(np.float32)
    t = trace(vox.coords, vox.features.astype(np.float32), w, backend="cuda")
    r = trace(vox.coords, vox.features.astype(np.float32), w, backend="reference")
    assert all(ok for _, ok, _ in r.compare(t))


