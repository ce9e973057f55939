"""Voxelization: kernel (simulator) == NumPy reference == an independent np.unique oracle."""
import numpy as np
import pytest
from conftest import crop

import numba_sc as ns
from numba_sc.core import conventions as cv


def oracle(points, voxel_size, features=None):
    """Brute force, written independently of the package: np.unique on coordinate rows."""
    s = points.shape[1] - 3
    q = np.floor(points[:, s:].astype(np.float64) / voxel_size).astype(np.int64)
    if s:
        q = np.column_stack([points[:, 0].astype(np.int64), q])
    coords, inverse, counts = np.unique(q, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    feats = None
    if features is not None:
        feats = np.zeros((len(coords), features.shape[1]))
        np.add.at(feats, inverse, features.astype(np.float64))
        feats /= counts[:, None]
    return coords, inverse, feats


def check_against_oracle(v, points, voxel_size, features=None):
    coords, inverse, feats = oracle(points, voxel_size, features)
    assert v.coords.dtype == np.int32 and v.inverse.dtype == np.int64
    assert np.array_equal(v.coords, coords)
    assert np.array_equal(v.inverse, inverse)
    if features is not None:
        np.testing.assert_allclose(v.features, feats, rtol=1e-5, atol=1e-6)


def random_cloud(rng, n, batch=False):
    pts = (rng.normal(size=(n, 3)) * [4, 4, 1]).astype(np.float32)
    if batch:
        pts = np.column_stack([rng.integers(0, 3, n).astype(np.float32), pts])
    return pts


@pytest.mark.parametrize("batch", [False, True])
def test_kernel_matches_reference_and_oracle_random(rng, batch):
    pts = random_cloud(rng, 1500, batch)
    feats = rng.normal(size=(len(pts), 3)).astype(np.float32)
    k = ns.voxelize(pts, 0.3, feats, backend="cuda")
    r = ns.voxelize(pts, 0.3, feats, backend="reference")
    for a, b in [(k.coords, r.coords), (k.inverse, r.inverse), (k.counts, r.counts)]:
        assert np.array_equal(a, b)
    np.testing.assert_allclose(k.features, r.features, rtol=1e-6)
    check_against_oracle(k, pts, 0.3, feats)
    assert k.coords.shape[1] == (4 if batch else 3)


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_other_reductions(rng, reduce):
    pts = random_cloud(rng, 600)
    feats = rng.normal(size=(600, 2)).astype(np.float32)
    k = ns.voxelize(pts, 0.5, feats, reduce=reduce, backend="cuda")
    r = ns.voxelize(pts, 0.5, feats, reduce=reduce, backend="reference")
    np.testing.assert_allclose(k.features, r.features, rtol=1e-6)
    expect = np.full((len(r.coords), 2), -np.inf) if reduce == "max" else np.zeros((len(r.coords), 2))
    (np.maximum if reduce == "max" else np.add).at(expect, r.inverse, feats)
    np.testing.assert_allclose(r.features, expect, rtol=1e-5)


def test_kernel_on_real_crops(scan):
    name, points, vs = scan
    pts = crop(points, 1200)
    xyz, feats = np.ascontiguousarray(pts[:, :3]), np.ascontiguousarray(pts[:, 3:])
    k = ns.voxelize(xyz, vs, feats, backend="cuda")
    check_against_oracle(k, xyz, vs, feats)
    assert len(k) > 50, f"crop of {name} too sparse to test anything"


def test_reference_on_full_real_scans(scan):
    name, points, vs = scan
    xyz, feats = np.ascontiguousarray(points[:, :3]), np.ascontiguousarray(points[:, 3:])
    r = ns.voxelize(xyz, vs, feats, backend="reference")
    check_against_oracle(r, xyz, vs, feats)
    if name == "semantickitti":
        assert len(r) == 94444  # the size the data README reports at 0.05 m


def test_corrupted_kernel_output_is_caught(rng):
    """The cross-check is able to fail: an off-by-one in one coordinate is detected."""
    pts = random_cloud(rng, 400)
    k = ns.voxelize(pts, 0.5, backend="cuda")
    k.coords[len(k.coords) // 2, 1] += 1
    with pytest.raises(AssertionError):
        check_against_oracle(k, pts, 0.5)
    k = ns.voxelize(pts, 0.5, backend="cuda")
    k.inverse[7] -= 1
    with pytest.raises(AssertionError):
        check_against_oracle(k, pts, 0.5)


def test_negative_coordinates_floor_not_truncate():
    pts = np.array([[-0.1, 0.0, 0.0], [0.1, 0.0, 0.0], [-1.0, -1.5, 2.0]], np.float32)
    for backend in ("cuda", "reference"):
        v = ns.voxelize(pts, 1.0, backend=backend)
        assert v.coords.tolist() == [[-1, -2, 2], [-1, 0, 0], [0, 0, 0]]
        assert v.inverse.tolist() == [1, 2, 0]


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_bad_inputs(backend):
    good = np.zeros((4, 3), np.float32)
    vox = lambda *a, **k: ns.voxelize(*a, backend=backend, **k)  # noqa: E731
    bad_nan = good.copy()
    bad_nan[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        vox(bad_nan, 0.1)
    bad_inf = good.copy()
    bad_inf[0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        vox(bad_inf, 0.1)
    far = good.copy()
    far[1, 2] = 1e5
    with pytest.raises(ValueError, match="packable range"):
        vox(far, 0.1)  # 1e6 voxels from the origin does not fit 18 bits
    with pytest.raises(ValueError, match="voxel_size"):
        vox(good, 0.0)
    with pytest.raises(ValueError, match="voxel_size"):
        vox(good, -1)
    with pytest.raises(ValueError, match="voxel_size"):
        vox(good, float("nan"))
    with pytest.raises(TypeError, match="float32 or float64"):
        vox(good.astype(np.int32), 0.1)
    with pytest.raises(ValueError, match="shape"):
        vox(np.zeros((4, 5), np.float32), 0.1)
    with pytest.raises(ValueError, match="empty"):
        vox(np.zeros((0, 3), np.float32), 0.1)
    with pytest.raises(ValueError, match="features"):
        vox(good, 0.1, features=np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="reduce"):
        vox(good, 0.1, features=np.zeros((4, 2), np.float32), reduce="median")
    batched = np.column_stack([np.array([0, 1, 2.5, 0], np.float32), good])
    with pytest.raises(ValueError, match="batch"):
        vox(batched, 0.1)


def test_key_packing_limits_are_the_documented_ones():
    pts = np.array([[cv.COORD_MAX + 0.5, cv.COORD_MIN, 0]], np.float64)
    assert ns.voxelize(pts, 1.0, backend="reference").coords.tolist() == [[cv.COORD_MAX, cv.COORD_MIN, 0]]
    with pytest.raises(ValueError, match="packable"):
        ns.voxelize(pts + [1, 0, 0], 1.0, backend="cuda")


def test_column_slices_are_accepted(rng):
    """A (N, 4) scan sliced to x, y, z is not contiguous; both backends take it."""
    scan = rng.normal(size=(300, 4)).astype(np.float32)
    k = ns.voxelize(scan[:, :3], 0.5, scan[:, 3:], backend="cuda")
    r = ns.voxelize(scan[:, :3], 0.5, scan[:, 3:], backend="reference")
    assert np.array_equal(k.coords, r.coords)
    np.testing.assert_allclose(k.features, r.features, rtol=1e-6)
