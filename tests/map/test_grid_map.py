"""numba_sc.map.grid_map: the box, the grid filled on the device and its lookups
against the NumPy references; a box shifted by one voxel is caught."""
import numpy as np
import pytest
from numba import cuda

from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.map import grid_map as gm

from helpers import random_coords, scan_crop


@cuda.jit
def lookups(grid, box, queries, out):
    i = cuda.grid(1)
    if i < queries.shape[0]:
        out[i] = gm.lookup_device(grid, box, queries[i])


def sorted_keys(coords):
    coords = coords[np.lexsort(coords.T[::-1])]
    return coords, cv.pack_keys(coords, (-1, -1, -1), (1, 1, 1))


def test_worked_example():
    coords, keys = sorted_keys(np.array([[0, 0, 3], [0, 0, 4], [0, 0, 7]], np.int32))
    box, cells = gm.grid_box_reference(coords)
    assert cells == 5 and gm.build_reference(keys, box).tolist() == [0, 1, -1, -1, 2]
    found, reads = gm.lookup_reference(gm.build_reference(keys, box), box, cv.pack_keys(np.array([[0, 0, 6], [0, 0, 8]])))
    assert found.tolist() == [-1, -1] and reads.tolist() == [1, 0]


@pytest.mark.parametrize("batch", [0, 2])
def test_build_and_lookup_match_the_reference(rng, batch):
    coords = np.asarray(scan_crop(150).coords) if not batch else random_coords(rng, 200, span=5, batch=batch)
    coords, keys = sorted_keys(coords)
    box, cells = gm.box_cuda(coords)
    np.testing.assert_array_equal(box, gm.grid_box_reference(coords)[0])
    grid, d_box = gm.build_cuda(keys, coords)
    np.testing.assert_array_equal(to_host(grid), gm.build_reference(keys, box))
    deltas = cv.key_delta(cv.kernel_offsets(3))
    queries = (keys[None, :] + deltas[:, None]).ravel()
    out = np.zeros(len(queries), np.int64)
    lookups[-(-len(queries) // 128), 128](grid, d_box, queries, out)
    want, _ = gm.lookup_reference(gm.build_reference(keys, box), box, queries)
    assert (want >= 0).any() and (want < 0).any()
    np.testing.assert_array_equal(out, want)


def test_a_shifted_box_is_caught(rng):
    coords, keys = sorted_keys(random_coords(rng, 300, span=6))
    grid, _ = gm.build_cuda(keys, coords)
    box = gm.grid_box_reference(coords)[0].copy()
    box[2] -= 1  # z0 one voxel off: every input lands one cell further on
    assert not np.array_equal(to_host(grid), gm.build_reference(keys, box))


def test_too_large_a_box_is_refused():
    coords = np.array([[0, 0, 0], [5000, 5000, 50]], np.int32)
    with pytest.raises(ValueError, match="method='sorted'"):
        gm.grid_box_reference(coords)
