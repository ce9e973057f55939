"""numba_sc.map.hash_map: the hash, the table built on the device and its lookups
against the NumPy references; a changed answer is caught."""
import numpy as np
from numba import cuda

from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.map import hash_map as hm

from helpers import random_coords, scan_crop


@cuda.jit
def hashes(keys, out):
    i = cuda.grid(1)
    if i < keys.shape[0]:
        out[i] = hm.hash_device(keys[i])


@cuda.jit
def lookups(slot_keys, slot_vals, queries, out):
    i = cuda.grid(1)
    if i < queries.shape[0]:
        out[i] = hm.lookup_device(slot_keys, slot_vals, queries[i])


def keys_and_queries(coords):
    coords = coords[np.lexsort(coords.T[::-1])]
    keys = cv.pack_keys(coords, (-1, -1, -1), (1, 1, 1))
    deltas = cv.key_delta(cv.kernel_offsets(3))
    return keys, (keys[None, :] + deltas[:9, None]).ravel()  # hits and misses


def device_lookups(keys, queries):
    slot_keys, slot_vals = hm.build_cuda(keys)
    out = np.zeros(len(queries), np.int64)
    lookups[-(-len(queries) // 128), 128](slot_keys, slot_vals, queries, out)
    return to_host(slot_keys), out


def test_reference_finds_what_it_stored():
    keys = np.array([5, 9, 12, 40, 41], np.int64)
    slot_keys, slot_vals, probes = hm.build_reference(keys, 8)
    assert sorted(slot_keys[slot_keys != hm.EMPTY].tolist()) == keys.tolist() and probes >= len(keys)
    found, reads = hm.lookup_reference(slot_keys, slot_vals, np.array([9, 41, 7]))
    assert found.tolist() == [1, 4, -1] and reads.min() >= 1


def test_hash_kernel_matches_the_reference(rng):
    keys = rng.integers(0, 1 << 62, 500, dtype=np.int64)
    out = np.zeros(500, np.uint64)
    hashes[4, 128](keys, out)
    np.testing.assert_array_equal(out, hm.hash_reference(keys))


def test_build_and_lookup_match_the_reference(rng):
    for coords in (np.asarray(scan_crop(150).coords), random_coords(rng, 200, span=5)):
        keys, queries = keys_and_queries(coords)
        slot_keys, got = device_lookups(keys, queries)
        ref_keys, ref_vals, _ = hm.build_reference(keys)
        assert len(slot_keys) == hm.capacity_for(len(keys)) == len(ref_keys)
        # the same keys stored (in another layout where CAS races differ)
        np.testing.assert_array_equal(np.sort(slot_keys[slot_keys != hm.EMPTY]), np.sort(keys))
        want, _ = hm.lookup_reference(ref_keys, ref_vals, queries)
        assert (want >= 0).any() and (want < 0).any()
        np.testing.assert_array_equal(got, want)


def test_a_changed_answer_is_caught(rng):
    keys, queries = keys_and_queries(random_coords(rng, 300, span=6))
    _, got = device_lookups(keys, queries)
    want, _ = hm.lookup_reference(*hm.build_reference(keys)[:2], queries)
    want[np.flatnonzero(want >= 0)[0]] += 1
    assert not np.array_equal(got, want)
