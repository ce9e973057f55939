"""numba_sc.map.query_segments: the query key made on the fly on the device equals its
NumPy twin and the materialized segments; a shifted delta is caught."""
import numpy as np
from numba import cuda

from numba_sc.core import conventions as cv
from numba_sc.map import query_segments as qs

from helpers import random_coords


@cuda.jit
def all_queries(qkeys, deltas, out):
    """One thread per (k, i): the key of query i of segment k."""
    t = cuda.grid(1)
    Q = qkeys.shape[0]
    if t < deltas.shape[0] * Q:
        k = t // Q
        out[k, t - k * Q] = qs.query_key(qkeys, deltas, k, t - k * Q)


def device_segments(qkeys, deltas):
    out = np.zeros((len(deltas), len(qkeys)), np.int64)
    all_queries[-(-out.size // 128), 128](qkeys, deltas, out)
    return out


def test_worked_example():
    seg = qs.query_segments_reference(np.array([0, 3, 4, 9]), np.array([-1, 0, 1]))
    assert seg.tolist() == [[-1, 2, 3, 8], [0, 3, 4, 9], [1, 4, 5, 10]]


def test_kernel_matches_the_references(rng):
    coords = random_coords(rng, 250, span=8)
    coords = coords[np.lexsort(coords.T[::-1])]  # sorted lexicographically: sorted keys
    offsets = cv.kernel_offsets(3)
    qkeys = cv.pack_keys(coords, offsets.min(axis=0), offsets.max(axis=0))
    deltas = cv.key_delta(offsets)
    got = device_segments(qkeys, deltas)
    want = qs.query_segments_reference(qkeys, deltas)
    np.testing.assert_array_equal(got, want)
    k, i = np.meshgrid(np.arange(len(deltas)), np.arange(len(qkeys)), indexing="ij")
    np.testing.assert_array_equal(qs.query_key_reference(qkeys, deltas, k, i), want)
    assert np.all(np.diff(got, axis=1) > 0)  # every segment sorted
    # key(q + d) == key(q) + key(d): the segments are the moved coordinates' keys
    np.testing.assert_array_equal(got[5], cv.pack_keys((coords + offsets[5]).astype(np.int32)))


def test_a_shifted_delta_is_caught(rng):
    coords = random_coords(rng, 300, span=8)
    qkeys = np.sort(cv.pack_keys(coords, (-1, -1, -1), (1, 1, 1)))
    deltas = cv.key_delta(cv.kernel_offsets(3))
    bad = deltas.copy()
    bad[4] += 1
    assert not np.array_equal(device_segments(qkeys, bad), qs.query_segments_reference(qkeys, deltas))
