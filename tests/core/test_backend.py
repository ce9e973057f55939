"""The API edge: backend choice and arrays moving to and from the device side."""
import os

import numpy as np
import pytest

from numba_sc.core import backend
from numba_sc.core.state import STATE, clear_caches

SIMULATING = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_resolve_backend():
    assert backend.resolve_backend("reference") == "reference"
    if SIMULATING:
        assert backend.resolve_backend(None) == "cuda"
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.resolve_backend("gpu")


def test_to_device_makes_column_slices_contiguous_and_keeps_0d_arrays():
    scan = np.arange(24, dtype=np.float32).reshape(6, 4)
    got = backend.to_host(backend.to_device(scan[:, :3]))
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, scan[:, :3])
    assert backend.to_host(backend.to_device(np.float32(3.5))).shape == ()  # not made 1-d
    assert backend.to_device(None) is None


def test_filled_writes_only_byte_patterns():
    np.testing.assert_array_equal(backend.to_host(backend.filled((2, 3), np.int32, -1)), np.full((2, 3), -1))
    np.testing.assert_array_equal(backend.to_host(backend.filled(4, np.int64, 0)), np.zeros(4))
    with pytest.raises(ValueError, match="0 or -1"):
        backend.filled(4, np.int32, 7)


def test_to_device_async_is_a_copy():
    host = np.arange(5, dtype=np.int64)
    dev = backend.to_device_async(host)
    host[0] = 99
    assert backend.to_host(dev)[0] == 0


def test_read_later_and_like():
    a = np.arange(3)
    np.testing.assert_array_equal(backend.read_later(a)(), a)
    assert isinstance(backend.like([1, 2], np.zeros(1)), np.ndarray)
    assert backend.like(None, np.zeros(1)) is None


def test_staging_is_registered_and_waits_before_it_forgets():
    """clear_caches() must not free a pinned buffer under a running copy: the list of
    buffers in flight waits for each copy's event, then empties."""
    assert any(c is backend._STAGING for c in STATE.caches)
    waited = []

    class Event:
        def synchronize(self):
            waited.append(self)

    backend._STAGING.append((np.zeros(2), Event()))
    clear_caches()
    assert len(waited) == 1 and len(backend._STAGING) == 0
