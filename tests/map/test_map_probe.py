"""numba_sc.map.map_probe: the probe kernel over a hash table and over a grid against
the NumPy probe step (table, pairs per offset, per chunk, masks); a shifted delta is caught."""
import numpy as np
import pytest

from numba_sc.core import conventions as cv
from numba_sc.core.backend import filled, to_host
from numba_sc.map import grid_map as gm
from numba_sc.map import hash_map as hm
from numba_sc.map import map_probe as mp
from numba_sc.map.forward_search import table_passes

from helpers import random_coords, scan_crop

K, H = 27, 14  # a 3x3x3 submanifold layer: the first 14 offsets probed, the rest mirrored


def layer(coords):
    coords = coords[np.lexsort(coords.T[::-1])]
    return coords, cv.pack_keys(coords, (-1, -1, -1), (1, 1, 1)), cv.key_delta(cv.kernel_offsets(3))


def probe(method, coords, keys, deltas, with_masks=True):
    if method == "hash":
        a, b = hm.build_cuda(keys)
        lookup = hm.lookup_device
    else:
        a, b = gm.build_cuda(keys, coords)
        lookup = gm.lookup_device
    P, chunk, W = len(keys), cv.chunk_size(), cv.mask_words(K)
    table = filled((K, P), np.int32, -1)
    counts = filled(K, np.int64, 0)
    chunk_counts = filled((K, -(-P // chunk)), np.int32, 0)
    masks = [filled((W, P), np.int64, 0) for _ in range(2)] if with_masks else [None, None]
    mp.probe_cuda(lookup, a, b, keys, np.ascontiguousarray(deltas[:H]), table, counts, chunk, chunk_counts, *masks)
    return [to_host(x) for x in (table, counts, chunk_counts, *masks) if x is not None]


def reference(method, coords, keys, deltas):
    if method == "hash":
        slot_keys, slot_vals, _ = hm.build_reference(keys)
        table, _ = mp.probe_reference(lambda q: hm.lookup_reference(slot_keys, slot_vals, q), keys, deltas[:H], K)
    else:
        box, _ = gm.grid_box_reference(coords)
        grid = gm.build_reference(keys, box)
        table, _ = mp.probe_reference(lambda q: gm.lookup_reference(grid, box, q), keys, deltas[:H], K)
    return table


@pytest.mark.parametrize("method", ["hash", "grid"])
def test_probe_matches_the_reference(rng, method):
    for coords in (np.asarray(scan_crop(120).coords), random_coords(rng, 200, span=5)):
        coords, keys, deltas = layer(coords)
        table, counts, chunk_counts, out_masks, in_masks = probe(method, coords, keys, deltas)
        want = reference(method, coords, keys, deltas)
        assert (want >= 0).any() and (want < 0).any()
        np.testing.assert_array_equal(table, want)
        passes = table_passes(want, len(keys), cv.chunk_size())
        for got, w, name in zip((counts, chunk_counts, out_masks, in_masks), passes, ("counts", "chunks", "out", "in")):
            np.testing.assert_array_equal(got, w, err_msg=name)


def test_a_shifted_delta_is_caught(rng):
    coords, keys, deltas = layer(random_coords(rng, 300, span=6))
    bad = deltas.copy()
    bad[2] += 1
    table = probe("hash", coords, keys, bad, with_masks=False)[0]
    assert not np.array_equal(table, reference("hash", coords, keys, deltas))
