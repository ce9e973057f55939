"""numba_sc.map.forward_search: every rung (v1-v3, and v4 as the library launches it)
against the NumPy references, and the ladder's passes (:func:`table_passes`) against
what v4 finds with the pairs; a changed table entry is caught."""
import numpy as np
import pytest

from numba_sc.core import conventions as cv
from numba_sc.core.backend import filled, to_host
from numba_sc.map import backward_search as bs
from numba_sc.map import forward_search as fs

from helpers import random_coords, scan_crop


B, C = 64, 64


def search(coords, half=False):
    """Keys, the deltas searched (all 27, or the first 14), and the backward search's rows."""
    coords = coords[np.lexsort(coords.T[::-1])]
    offsets = cv.kernel_offsets(3)
    keys = cv.pack_keys(coords, offsets.min(axis=0), offsets.max(axis=0))
    deltas = cv.key_delta(offsets)
    d = np.ascontiguousarray(deltas[:14] if half else deltas)
    upper = bs.max_balanced_blocks(len(d), len(keys), len(keys), B, C)
    bounds, rows, n_rows = bs.backward_search_cuda(keys, keys, d, B, C, upper)
    return keys, d, to_host(bounds), rows, n_rows, upper


def reference_table(coords):
    keys, d, bounds, *_ = search(coords)
    return fs.forward_search_reference(keys, keys, d, bounds, B)[0]


def run_rung(kernel, coords, half=False):
    keys, d, _, rows, n_rows, _ = search(coords, half)
    table = filled((27, len(keys)), np.int32, -1)
    grid = int(to_host(n_rows)[0])
    kernel(B)[grid, fs.forward_threads(C)](keys, keys, d, rows, table)
    return to_host(table)


def test_worked_example():
    bounds = np.array([[0, 4, 5, 6]])
    table, _ = fs.forward_search_reference([1, 4, 6, 7, 9], [0, 2, 3, 4, 5, 8, 12], [0], bounds, 2)
    assert table.tolist() == [[-1, -1, -1, 1, -1, -1, -1]]


@pytest.fixture(scope="module")
def clouds():
    rng = np.random.default_rng(3)
    return {"scan": np.asarray(scan_crop(120).coords), "random": random_coords(rng, 200, span=5)}


@pytest.mark.parametrize("rung", ["v1", "v2", "v3"])
@pytest.mark.parametrize("source", ["scan", "random"])
def test_rungs_match_the_reference(clouds, source, rung):
    coords = clouds[source]
    want = reference_table(coords)
    assert (want >= 0).any() and (want < 0).any()
    kernel = {"v1": fs.forward_search_v1, "v2": fs.forward_search_v2, "v3": fs.forward_search_v3}[rung]
    np.testing.assert_array_equal(run_rung(kernel, coords, half=rung == "v3"), want)


def test_mirror_reference_completes_the_half_search(clouds):
    coords = clouds["random"]
    keys, d, bounds, *_ = search(coords, half=True)
    half, _ = fs.forward_search_reference(keys, keys, d, bounds, B)
    np.testing.assert_array_equal(fs.mirror_reference(half, 27), reference_table(coords))


def test_library_rung_and_the_ladder_passes_agree(clouds):
    coords = clouds["scan"]
    keys, d, _, rows, n_rows, upper = search(coords, half=True)
    P, W = len(keys), cv.mask_words(27)
    masks = [filled(W * P, np.int64, 0) for _ in range(2)]
    chunk = cv.chunk_size()
    table, counts, chunk_counts = fs.forward_search_cuda(keys, keys, d, rows, n_rows, B, C, upper, n_offsets=27,
                                                         chunk=chunk, out_masks=masks[0], in_masks=masks[1])
    table = to_host(table)
    np.testing.assert_array_equal(table, reference_table(coords))
    passes = fs.table_passes(table, P, chunk)
    np.testing.assert_array_equal(to_host(counts), passes[0])
    np.testing.assert_array_equal(to_host(chunk_counts), passes[1])
    np.testing.assert_array_equal(to_host(masks[0]).reshape(W, P), passes[2])
    np.testing.assert_array_equal(to_host(masks[1]).reshape(W, P), passes[3])


def test_a_changed_entry_is_caught(clouds):
    coords = clouds["random"]
    want = reference_table(coords)
    k, i = np.argwhere(want >= 0)[len(np.argwhere(want >= 0)) // 2]
    want[k, i] += 1  # the pair points one input further on
    assert not np.array_equal(run_rung(fs.forward_search_v2, coords), want)
