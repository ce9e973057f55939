"""numba_sc.map.sorting: the Map step's sort of keys and coordinate rows (with the
repeat count) on the device against its NumPy reference; a planted change is caught."""
import numpy as np

from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.map import sorting

from helpers import random_coords


def sorted_rows(rows):
    keys = cv.pack_keys(rows)
    dups = np.zeros(1, np.int64)
    skeys, order, scoords = sorting.sort_rows_cuda(keys, rows, dups)
    return keys, (to_host(skeys), to_host(order), to_host(scoords), int(to_host(dups)[0]))


def test_sort_rows_matches_the_reference(rng):
    for batch in (0, 3):
        rows = random_coords(rng, 1500, span=12, batch=batch)  # unique rows, shuffled
        keys, got = sorted_rows(rows)
        want = sorting.sort_rows_reference(keys, rows)
        for g, w, name in zip(got, want, ("keys", "order", "rows", "repeats")):
            np.testing.assert_array_equal(g, w, err_msg=name)
        assert got[3] == 0 and np.all(np.diff(got[0]) > 0)


def test_repeats_are_counted(rng):
    rows = random_coords(rng, 400, span=6)
    rows = np.concatenate([rows, rows[:7], rows[:2]])[rng.permutation(len(rows) + 9)]
    keys, got = sorted_rows(rows)
    assert got[3] == sorting.sort_rows_reference(keys, rows)[3] == 9
    assert sorting.count_duplicates_reference(np.array([3, 5, 7])) == 0


def test_a_changed_row_is_caught(rng):
    rows = random_coords(rng, 500, span=8)
    keys, got = sorted_rows(rows)
    want = sorting.sort_rows_reference(keys, rows)[2].copy()
    want[100, 2] += 1  # one coordinate off by one
    assert not np.array_equal(got[2], want)
