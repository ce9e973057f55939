"""numba_sc.core.unique: sorted keys -> unique keys, order, starts and inverse; kernels
against the NumPy reference and np.unique, and a planted bug that the comparison catches."""
import numpy as np
import pytest

from numba_sc.core import conventions as cv
from numba_sc.core import unique
from numba_sc.core.backend import to_host


def rows_and_keys(rng, n, span, batch=0):
    rows = rng.integers(-span, span, size=(n, 3))
    if batch:
        rows = np.column_stack([rng.integers(0, batch, n), rows])
    rows = rows.astype(np.int32)
    return rows, cv.pack_keys(rows)


def test_reference_is_the_worked_example():
    su = unique.sort_unique_reference(np.array([7, 3, 7, 5, 3], np.int64))
    assert su.keys.tolist() == [3, 5, 7]
    assert su.order.tolist() == [1, 4, 3, 0, 2]
    assert su.starts.tolist() == [0, 2, 3, 5]
    assert su.inverse.tolist() == [2, 0, 2, 1, 0]


@pytest.mark.parametrize("n, span, batch", [(1, 5, 0), (400, 4, 0), (1500, 30, 3)])
def test_sort_unique_cuda_matches_the_reference(rng, n, span, batch):
    _, keys = rows_and_keys(rng, n, span, batch)
    want = unique.sort_unique_reference(keys)
    got = unique.sort_unique_cuda(keys.copy())
    for name in ("keys", "starts", "inverse"):
        np.testing.assert_array_equal(to_host(getattr(got, name)), getattr(want, name), err_msg=name)
    # the order: a permutation that sorts the keys (CuPy's argsort on a GPU need not keep
    # equal keys in input order, so within a run of equal keys any order is right)
    order = to_host(got.order)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(keys)))
    np.testing.assert_array_equal(keys[order], keys[want.order])
    np.testing.assert_array_equal(want.keys, np.unique(keys))


@pytest.mark.parametrize("batch", [0, 2])
def test_unpack_kernel_is_unpack_keys(rng, batch):
    rows, keys = rows_and_keys(rng, 300, 50, batch)
    ukeys = np.unique(keys)
    out = np.empty((len(ukeys), rows.shape[1]), np.int32)
    unique.unpack_kernel[4, 128](ukeys, 1 if batch else 0, out)
    np.testing.assert_array_equal(out, cv.unpack_keys(ukeys, with_batch=bool(batch)))


@pytest.mark.parametrize("one_block", [True, False])
def test_sort_unique_keys_kernel(rng, monkeypatch, one_block):
    """The keys-only unique of strided layers, both ways (one thread block; mark, library
    scan, compact): the first M keys are np.unique's and the first M coordinate rows
    their unpacked rows, M is written into the report slot asked for, and no other."""
    if not one_block:
        monkeypatch.setattr(unique, "ONE_BLOCK_MAX", 0)
    for n, span, batch in [(1, 5, 0), (300, 4, 3), (700, 300, 0), (2000, 6, 2)]:
        rows, keys = rows_and_keys(rng, n, span, batch)
        report = np.full(3, -5, np.int64)
        got, coords = unique.sort_unique_keys_cuda(keys.copy(), report, 2, 1 if batch else 0)
        want = np.unique(keys)
        assert report[2] == len(want) and report[0] == report[1] == -5
        np.testing.assert_array_equal(to_host(got)[:len(want)], want)
        np.testing.assert_array_equal(to_host(coords)[:len(want)], np.unique(rows, axis=0))


def test_a_shifted_run_start_is_caught(rng):
    """The comparison can fail: a reference whose run starts are off by one differs."""
    _, keys = rows_and_keys(rng, 500, 4)
    got = unique.sort_unique_cuda(keys.copy())
    bad = unique.sort_unique_reference(keys)
    bad.starts[1] += 1
    assert not np.array_equal(to_host(got.starts), bad.starts)
    assert np.array_equal(to_host(got.starts)[2:], bad.starts[2:])
