"""A strided layer's Map step with its outputs counted on the device: one device read.

``build_kernel_map`` with default outputs and the sorted search sizes everything by
the input (a stride never makes more outputs than inputs), lets the searches read
the output count on the device, and reads it back with the report
(``driver._start_counted``). These tests count the reads and check the map,
its metadata and its errors against the references.
"""
import numpy as np
import pytest
from helpers import assert_matches_oracle, oracle_map, random_coords

import numba_sc as ns
from numba_sc.coords import output_coords as oc
from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_host
from numba_sc.core.pieces import as_array
from numba_sc.gmas.metadata import chunk_counts_reference, masks_reference
from numba_sc.map import driver
from numba_sc.map import kernel_map as km


@pytest.fixture
def reads(monkeypatch):
    """Every device->host read the Map step and the output coordinates make."""
    seen = []

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kw):
            seen.append(f"{module.__name__}.{name}")
            return real(*args, **kw)
        monkeypatch.setattr(module, name, wrapper)

    counting(driver, "read_later")
    counting(driver, "to_host")
    counting(km, "to_host")  # (KernelMap.host_counts)
    counting(oc, "to_host")
    return seen


def _host(a):
    return None if a is None else np.asarray(to_host(as_array(a)))


@pytest.mark.parametrize("layer", [dict(kernel_size=2, stride=2), dict(kernel_size=3, stride=2),
                                   dict(kernel_size=3, stride=(1, 2, 2)),
                                   dict(kernel_size=3, stride=2, tensor_stride=2)])
def test_one_read_and_the_reference_map(rng, reads, layer):
    """Sorted input (what a network hands on): one read; the map is the oracle's and
    the reference's, and the metadata the search counted (chunk counts, masks) is
    what the metadata stage's references make from the table."""
    c = random_coords(rng, 500, span=8, batch=2, multiple=layer.get("tensor_stride", 1))
    c = c[np.lexsort(c.T[::-1])]  # sorted, as voxelize and every layer hand them out
    k = ns.build_kernel_map(c, backend="cuda", masks=True, **layer)
    assert reads == ["numba_sc.map.driver.read_later"]  # the report, with the count in it
    assert k.stats["n_out"] == len(k.out_coords) < len(c)  # a real stride: fewer outputs than the bound
    assert_matches_oracle(k, c, oracle_map(c, **layer))
    r = ns.build_kernel_map(c, backend="reference", **layer)
    assert np.array_equal(k.table, r.table) and np.array_equal(k.out_coords, r.out_coords)
    np.testing.assert_array_equal(_host(k.chunk_counts), chunk_counts_reference(k.table, k.chunk))
    out_masks, in_masks = masks_reference(k.table, len(c))
    np.testing.assert_array_equal(_host(k.out_masks), out_masks)
    np.testing.assert_array_equal(_host(k.in_masks), in_masks)


def test_unsorted_input_is_sorted_and_searched_again(rng, reads):
    """Input in the caller's order: the report says so, the inputs are sorted on the
    device and searched again with the outputs' count now known."""
    c = random_coords(rng, 400, span=7, batch=3)
    k = ns.build_kernel_map(c, 3, stride=2, backend="cuda")
    assert k.stats["sorted_on_device"]
    assert_matches_oracle(k, c, oracle_map(c, 3, stride=2))
    assert len(reads) == 2  # the first report, then the second search's


def test_output_range_errors_name_the_outputs():
    """A snapped output that leaves the packable range, or would with the kernel's
    reach, is an error naming the output coordinates, as on the reference path; an
    input out of range is named as the input."""
    near_top = np.array([[cv.COORD_MAX - 1, 0, 0], [0, 0, 0]], np.int32)
    for backend in ("reference", "cuda"):
        with pytest.raises(ValueError, match="output coordinates.*reach -3..3"):
            ns.build_kernel_map(near_top, 3, stride=2, dilation=3, backend=backend)
    too_far = np.array([[cv.COORD_MAX + 5, 0, 0], [0, 0, 0]], np.int32)  # the input itself: named as such
    for backend in ("reference", "cuda"):
        with pytest.raises(ValueError, match="^in_coords: .*packable range"):
            ns.build_kernel_map(too_far, 2, stride=2, backend=backend)
    bottom = np.array([[cv.COORD_MIN, 0, 0], [0, 0, 0]], np.int32)  # floor(-131072 / 3) * 3 < COORD_MIN
    for backend in ("reference", "cuda"):
        with pytest.raises(ValueError, match="output coordinates: axis x spans -131073"):
            ns.build_kernel_map(bottom, 3, stride=(3, 1, 1), backend=backend)


def test_one_output():
    """Every input in one output cell: |Q| = 1 against a bound of |P|."""
    c = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 1, 1]], np.int32)
    k = ns.build_kernel_map(c, 2, stride=2, backend="cuda")
    assert k.out_coords.tolist() == [[0, 0, 0]]
    assert k.table[:, 0].tolist() == [0, 1, 2, -1, -1, -1, -1, 3]
