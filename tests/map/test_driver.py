"""The Map step's driver (numba_sc/map/driver.py): the library's fast path gives
the reference's map (submanifold, strided, given outputs, transposed; every
method), hands out arrays (never pieces), and its report's flags become clear
errors."""
import numpy as np
import pytest

from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.core.pieces import Piece
from numba_sc.gmas.metadata import chunk_counts_reference, masks_reference
from numba_sc.map import driver
from numba_sc.map.kernel_map import build_kernel_map_reference

from helpers import assert_same_map, random_coords


def _sorted(c):
    return c[np.lexsort(c.T[::-1])]


def _host(a):
    return None if a is None else np.asarray(to_host(a))


def _check_same(got, want):
    """The driver's map ``got`` against the reference's ``want``, field by field."""
    for name in ("in_coords", "out_coords", "in_order", "out_order", "table", "counts"):
        assert np.array_equal(_host(getattr(got, name)), getattr(want, name)), name
    assert np.array_equal(got.offsets, want.offsets)
    for name in ("kernel_size", "stride", "dilation", "tensor_stride", "out_tensor_stride", "is_transposed"):
        assert getattr(got, name) == getattr(want, name), name
    assert np.array_equal(got.host_counts(), _host(want.counts))


LAYERS = [dict(kernel_size=3), dict(kernel_size=3, symmetric=False), dict(kernel_size=2, stride=2),
          dict(kernel_size=3, stride=2), dict(kernel_size=3, stride=(1, 2, 2), tensor_stride=2),
          dict(kernel_size=(1, 3, 3), dilation=2)]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_the_driver_gives_the_reference_map(rng, layer):
    c = random_coords(rng, 300, span=6, batch=2, multiple=layer.get("tensor_stride", 1))
    want = build_kernel_map_reference(c, **layer)
    _check_same(driver.build_kernel_map_cuda(c, masks=True, **layer), want)  # caller's order: sorts
    s = _sorted(c)
    got = driver.build_kernel_map_cuda(s, assume_sorted=True, masks=True, **layer)  # a network's call
    _check_same(got, build_kernel_map_reference(s, **layer))
    assert not got.stats["sorted_on_device"]


@pytest.mark.parametrize("method", ["hash", "grid"])
def test_every_method_gives_the_reference_map(rng, method):
    c = _sorted(random_coords(rng, 250, span=5))
    for layer in (dict(kernel_size=3), dict(kernel_size=3, stride=2)):
        got = driver.build_kernel_map_cuda(c, assume_sorted=True, method=method, **layer)
        assert got.stats["method"] == method
        _check_same(got, build_kernel_map_reference(c, method="sorted", **layer))


def test_given_outputs_and_the_transposed_map(rng):
    """A strided layer with its outputs given (any order), and the transposed layer
    that inverts it: both the reference's."""
    c = random_coords(rng, 300, span=6)
    outs = np.unique(c // 2 * 2, axis=0)[::-1].copy()  # the caller's order: reversed
    got = driver.build_kernel_map_cuda(c, 3, stride=2, out_coords=outs)
    want = build_kernel_map_reference(c, 3, stride=2, out_coords=outs)
    _check_same(got, want)
    assert np.array_equal(_host(got.out_coords), outs[_host(got.out_order)])
    down = driver.build_kernel_map_cuda(_sorted(c), 2, stride=2, assume_sorted=True)
    ref_down = build_kernel_map_reference(_sorted(c), 2, stride=2)
    up, ref_up = down.transposed(), ref_down.transposed()
    assert up.is_transposed and np.array_equal(_host(up.table), ref_up.table)
    assert_same_map(up.transposed(), down)


def test_public_fields_are_arrays_and_hold_the_counts(rng):
    """chunk_counts and the masks are arrays (a Piece stays the driver's) holding what
    the metadata stage's references count from the table; both the plain and the
    counted (strided) path."""
    c = _sorted(random_coords(rng, 400, span=7, batch=2))
    for layer in (dict(kernel_size=3), dict(kernel_size=3, stride=2)):
        m = driver.build_kernel_map_cuda(c, assume_sorted=True, masks=True, **layer)
        for name in ("in_coords", "out_coords", "table", "counts", "chunk_counts", "out_masks", "in_masks"):
            assert type(getattr(m, name)) is not Piece and hasattr(getattr(m, name), "shape"), name
        table = _host(m.table)
        np.testing.assert_array_equal(_host(m.chunk_counts), chunk_counts_reference(table, m.chunk))
        out_masks, in_masks = masks_reference(table, len(c))
        np.testing.assert_array_equal(_host(m.out_masks), out_masks)
        np.testing.assert_array_equal(_host(m.in_masks), in_masks)
    m = driver.build_kernel_map_cuda(c, 3, assume_sorted=True)  # no masks asked: none made
    assert m.out_masks is None and m.in_masks is None and m.chunk_counts is not None


def test_pending_map_read_by_the_caller(rng):
    """Started with read=False, the map is finished from the report the caller read."""
    c = _sorted(random_coords(rng, 200, span=5))
    for layer in (dict(kernel_size=3), dict(kernel_size=2, stride=2)):
        p = driver.start_kernel_map_cuda(c, assume_sorted=True, read=False, **layer)
        assert isinstance(p, driver.PendingMap) and p.read is None
        assert (p.map is None) == (p.counted is not None) == ("stride" in layer)
        assert p.sizes.K == len(p.work.counts_array()) and p.sizes.P == len(c)
        m = p.result(to_host(p.report))
        _check_same(m, build_kernel_map_reference(c, **layer))


def test_report_flags_raise_clear_errors(rng):
    c = _sorted(random_coords(rng, 100, span=5))
    out_of_range = c.copy()
    out_of_range[-1] = cv.COORD_MAX + 5
    with pytest.raises(ValueError, match="in_coords"):
        driver.build_kernel_map_cuda(out_of_range, 3)
    with pytest.raises(ValueError, match="assume_sorted=True but is not sorted"):
        driver.build_kernel_map_cuda(c[::-1].copy(), 3, assume_sorted=True)
    repeated = np.concatenate([c, c[:3]])
    with pytest.raises(ValueError, match="3 repeated coordinate"):
        driver.build_kernel_map_cuda(repeated, 3)
    with pytest.raises(ValueError, match="not sorted and unique|repeated coordinate"):
        driver.build_kernel_map_cuda(_sorted(repeated), 3, assume_sorted=True)
    outs = np.concatenate([c[:5], c[:1]])
    with pytest.raises(ValueError, match="out_coords holds 1 repeated"):
        driver.build_kernel_map_cuda(c, 3, stride=2, out_coords=outs)


def test_check_report_reads_each_slot():
    """Each flag of the report, at its documented offset, raises its own error; range
    errors first."""
    K = 3
    side_in = driver.Side(driver.REPORT_IN, np.zeros((1, 3), np.int32), ((0, 0, 0), (0, 0, 0)), "in_coords", True)
    side_out = driver.Side(driver.REPORT_OUT, np.zeros((1, 3), np.int32), ((0, 0, 0), (0, 0, 0)), "out_coords",
                           False)
    clean = np.zeros(driver.REPORT_COUNTS + K, np.int64)
    driver._check_report(clean, [side_in, side_out])  # nothing flagged: no error
    rep = clean.copy()
    rep[driver.REPORT_OUT + 2] = 4
    with pytest.raises(ValueError, match="out_coords holds 4 repeated"):
        driver._check_report(rep, [side_in, side_out])
    rep[driver.REPORT_IN + cv.FLAG_UNSORTED] = 1
    with pytest.raises(ValueError, match="in_coords was passed with assume_sorted=True"):
        driver._check_report(rep, [side_in, side_out])
    rep[driver.REPORT_OUT + cv.FLAG_UNSORTED] = 1  # not vouched for: sorted, no error of its own
    rep[driver.REPORT_IN + cv.FLAG_UNSORTED] = 0
    rep[driver.REPORT_OUT + 2] = 0
    driver._check_report(rep, [side_in, side_out])


def test_a_planted_wrong_table_is_caught(rng, monkeypatch):
    """The comparisons above can fail: a forward search that loses one pair is seen."""
    real = driver.forward_search_cuda

    def broken(*args, **kw):
        table, report, chunk_counts = real(*args, **kw)
        hits = np.argwhere(to_host(table) >= 0)
        k, i = hits[len(hits) // 2]
        table[k, i] = -1  # the planted bug
        return table, report, chunk_counts

    monkeypatch.setattr(driver, "forward_search_cuda", broken)
    c = _sorted(random_coords(rng, 150, span=5))
    with pytest.raises(AssertionError, match="table"):
        _check_same(driver.build_kernel_map_cuda(c, 3, assume_sorted=True), build_kernel_map_reference(c, 3))
