"""numba_sc.map.backward_search: both rungs (v1, and v2 as the library launches it)
against the NumPy references on a crop of SemanticKITTI and on random coordinates;
a shifted delta is caught."""
import numpy as np
import pytest

from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.map import backward_search as bs

from helpers import random_coords, scan_crop


def layer(coords):
    """Sorted keys (packed for a 3x3x3 kernel's reach) and the kernel's key deltas."""
    coords = coords[np.lexsort(coords.T[::-1])]
    offsets = cv.kernel_offsets(3)
    return cv.pack_keys(coords, offsets.min(axis=0), offsets.max(axis=0)), cv.key_delta(offsets)


def sorted_rows(rows, n_rows):
    rows = to_host(rows)[:int(to_host(n_rows)[0])]
    return rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]


def test_worked_example():
    bounds, _ = bs.backward_search_reference([1, 4, 6, 7, 9], [0, 2, 3, 4, 5, 8, 12], [0], 2)
    assert bounds.tolist() == [[0, 4, 5, 6]]
    rows = bs.split_query_blocks_reference(bounds, 2)
    assert rows[:2].tolist() == [[0, 0, 0, 2], [0, 0, 2, 4]]


@pytest.mark.parametrize("source", ["scan", "random"])
@pytest.mark.parametrize("B, C", [(32, 8), (64, 100)])
def test_rungs_match_the_reference(rng, source, B, C):
    coords = np.asarray(scan_crop(150).coords) if source == "scan" else random_coords(rng, 300, span=6)
    keys, deltas = layer(coords)
    want_bounds, _ = bs.backward_search_reference(keys, keys, deltas, B)
    want_rows = bs.split_query_blocks_reference(want_bounds, C)
    upper = bs.max_balanced_blocks(len(deltas), len(keys), len(keys), B, C)
    assert len(want_rows) <= upper
    for run in (bs.backward_search_v1, lambda *a: bs.backward_search_cuda(*a, upper)):
        bounds, rows, n_rows = run(keys, keys, deltas, B, C)
        np.testing.assert_array_equal(to_host(bounds), want_bounds)
        np.testing.assert_array_equal(sorted_rows(rows, n_rows), want_rows)


def test_a_shifted_delta_is_caught(rng):
    keys, deltas = layer(random_coords(rng, 300, span=6))
    B, C = 32, 16
    bad = deltas.copy()
    bad[3] += 1  # one segment searched one voxel off along z
    bounds, _, _ = bs.backward_search_cuda(keys, keys, bad, B, C, bs.max_balanced_blocks(27, len(keys), len(keys), B, C))
    assert not np.array_equal(to_host(bounds), bs.backward_search_reference(keys, keys, deltas, B)[0])


def test_block_sizes_are_checked():
    assert bs.check_block_sizes(512, 1024) == (512, 1024)
    with pytest.raises(ValueError, match="power of two"):
        bs.check_block_sizes(48, 1024)
    with pytest.raises(TypeError, match="query_block"):
        bs.check_block_sizes(64, 1.5)
