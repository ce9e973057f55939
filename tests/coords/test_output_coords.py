"""Output coordinates Q = floor(P / (s*t)) * (s*t): kernel == reference == oracle."""
import numpy as np
import pytest
from conftest import crop

import numba_sc as ns


def oracle(coords, stride):
    s = coords.shape[1] - 3
    q = coords.astype(np.int64).copy()
    st = np.broadcast_to(np.asarray(stride, np.int64), (3,))
    q[:, s:] = np.floor(q[:, s:] / st).astype(np.int64) * st  # float floor, not //
    return np.unique(q, axis=0)


def random_coords(rng, n, batch=False, span=40):
    c = rng.integers(-span, span, size=(n, 3))
    if batch:
        c = np.column_stack([rng.integers(0, 3, n), c])
    return np.unique(c, axis=0).astype(np.int32)


@pytest.mark.parametrize("stride, tensor_stride", [(1, 1), (2, 1), (2, 2), (3, 1), ((1, 2, 2), 1), (2, (1, 1, 4))])
@pytest.mark.parametrize("batch", [False, True])
def test_kernel_reference_oracle(rng, stride, tensor_stride, batch):
    c = random_coords(rng, 800, batch)
    k = ns.output_coordinates(c, stride, tensor_stride, backend="cuda")
    r = ns.output_coordinates(c, stride, tensor_stride, backend="reference")
    total = np.array(ns.core.conventions.as_int_tuple(stride, "s")) * ns.core.conventions.as_int_tuple(tensor_stride, "t")
    assert k.dtype == np.int32
    assert np.array_equal(k, r)
    assert np.array_equal(r, oracle(c, total))


def test_stride_one_is_identity(rng):
    c = random_coords(rng, 300)
    assert np.array_equal(ns.output_coordinates(c, 1, backend="cuda"), c)  # np.unique sorted it


def test_real_scans(scan):
    name, points, vs = scan
    v = ns.voxelize(np.ascontiguousarray(points[:, :3]), vs, backend="reference")
    for s in (2, 4):
        assert np.array_equal(ns.output_coordinates(v.coords, s, backend="reference"), oracle(v.coords, s))
    small = ns.voxelize(np.ascontiguousarray(crop(points, 1500)[:, :3]), vs, backend="reference").coords
    assert np.array_equal(ns.output_coordinates(small, 2, backend="cuda"), oracle(small, 2))


def test_corrupted_output_is_caught(rng):
    c = random_coords(rng, 300)
    k = ns.output_coordinates(c, 2, backend="cuda")
    k[3, 2] += 2
    assert not np.array_equal(k, oracle(c, 2))


def test_bad_inputs():
    c = np.zeros((3, 3), np.int32)
    with pytest.raises(ValueError, match="stride"):
        ns.output_coordinates(c, 0)
    with pytest.raises(ValueError, match="tensor_stride"):
        ns.output_coordinates(c, 2, tensor_stride=-1)
    with pytest.raises(TypeError, match="integer"):
        ns.output_coordinates(c.astype(np.float32), 2)
    edge = np.array([[ns.core.conventions.COORD_MIN, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="packable"):
        ns.output_coordinates(edge, 3)  # floor(-131072 / 3) * 3 = -131073 leaves the range
