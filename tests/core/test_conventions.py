"""Key packing, kernel offsets and backend selection: the conventions every stage uses."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from numba_sc.core import conventions as cv
from numba_sc.core.backend import resolve_backend

coord = st.integers(cv.COORD_MIN, cv.COORD_MAX)
batch = st.integers(0, cv.BATCH_MAX)
rows4 = st.lists(st.tuples(batch, coord, coord, coord), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(rows4)
def test_pack_round_trip(rows):
    c = np.array(rows, dtype=np.int32)
    assert np.array_equal(cv.unpack_keys(cv.pack_keys(c), with_batch=True), c)
    assert np.array_equal(cv.unpack_keys(cv.pack_keys(c[:, 1:]), with_batch=False), c[:, 1:])


@settings(max_examples=200, deadline=None)
@given(rows4)
def test_key_order_is_lexicographic_order(rows):
    c = np.array(rows, dtype=np.int32)
    by_key = np.argsort(cv.pack_keys(c), kind="stable")
    by_lex = np.lexsort(c.T[::-1])  # lexsort: last key is primary
    assert np.array_equal(c[by_key], c[by_lex])


@settings(max_examples=200, deadline=None)
@given(st.tuples(batch, coord, coord, coord), st.tuples(*[st.integers(-40, 40)] * 3))
def test_offset_addition(q, d):
    q = np.array([q], dtype=np.int64)
    moved = q.copy()
    moved[0, 1:] += d
    if moved[0, 1:].min() < cv.COORD_MIN or moved[0, 1:].max() > cv.COORD_MAX:
        with pytest.raises(ValueError, match="packable range"):
            cv.pack_keys(q.astype(np.int32), np.minimum(d, 0), np.maximum(d, 0))
        return
    kq = cv.pack_keys(q.astype(np.int32), np.minimum(d, 0), np.maximum(d, 0))
    assert kq[0] + cv.key_delta([d])[0] == cv.pack_keys(moved.astype(np.int32))[0]


def test_overflow_raises_instead_of_wrapping():
    edge = np.array([[0, cv.COORD_MAX, 0, 0]], dtype=np.int32)
    cv.pack_keys(edge)  # fits by itself
    with pytest.raises(ValueError, match="kernel's reach"):
        cv.pack_keys(edge, reach_lo=(-1, -1, -1), reach_hi=(1, 1, 1))
    with pytest.raises(ValueError, match="packable"):
        cv.pack_keys(np.array([[cv.COORD_MIN - 1, 0, 0]], dtype=np.int64))
    with pytest.raises(ValueError, match="batch"):
        cv.pack_keys(np.array([[cv.BATCH_MAX + 1, 0, 0, 0]], dtype=np.int32))
    with pytest.raises(ValueError, match="batch"):
        cv.pack_keys(np.array([[-1, 0, 0, 0]], dtype=np.int32))


def test_bad_coordinate_arrays():
    with pytest.raises(TypeError, match="integer"):
        cv.validate_coords(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        cv.validate_coords(np.zeros((3, 5), np.int32))
    with pytest.raises(ValueError, match="empty"):
        cv.validate_coords(np.zeros((0, 3), np.int32))
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        cv.validate_coords([[1, 2, 3]])


def test_device_packing_matches_numpy():
    @cuda.jit
    def pack_all(c, out):
        i = cuda.grid(1)
        if i < c.shape[0]:
            out[i] = cv.pack_key_device(c[i, 0], c[i, 1], c[i, 2], c[i, 3])

    rng = np.random.default_rng(3)
    c = np.column_stack([rng.integers(0, cv.BATCH_MAX + 1, 64),
                         rng.integers(cv.COORD_MIN, cv.COORD_MAX + 1, (64, 3))]).astype(np.int32)
    out = np.zeros(64, np.int64)
    pack_all[1, 64](c, out)
    assert np.array_equal(out, cv.pack_keys(c))


@pytest.mark.parametrize("k, expect", [
    (1, [0]), (2, [0, 1]), (3, [-1, 0, 1]), (4, [-1, 0, 1, 2]), (5, [-2, -1, 0, 1, 2])])
def test_axis_offsets(k, expect):
    assert cv.axis_offsets(k).tolist() == expect


def test_kernel_offsets_order_dilation_stride_anisotropy():
    off = cv.kernel_offsets(3)
    assert off.dtype == np.int32 and off.shape == (27, 3)
    assert off[0].tolist() == [-1, -1, -1] and off[13].tolist() == [0, 0, 0]
    assert np.array_equal(off, off[np.lexsort(off.T[::-1])])  # lexicographically sorted
    assert np.all(np.diff(cv.key_delta(off)) > 0)  # ... and so are their key deltas
    assert cv.kernel_offsets(3, dilation=2, tensor_stride=2)[0].tolist() == [-4, -4, -4]
    assert cv.kernel_offsets((1, 3, 1)).tolist() == [[0, -1, 0], [0, 0, 0], [0, 1, 0]]
    assert cv.kernel_offsets((2, 1, 3)).shape == (6, 3)
    with pytest.raises(ValueError, match="kernel_size"):
        cv.kernel_offsets(0)
    with pytest.raises(ValueError, match="kernel_size"):
        cv.kernel_offsets((3, 3))


def test_backend_selection():
    assert resolve_backend("reference") == "reference"
    assert resolve_backend(None) == "cuda"  # the simulator is on in the tests
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("gpu-please")


def test_pack_kernel_matches_numpy_and_refuses_the_reach():
    from numba_sc.core.backend import to_host
    from numba_sc.core.conventions import pack_keys_device

    rng = np.random.default_rng(7)
    c = np.column_stack([rng.integers(0, cv.BATCH_MAX + 1, 300),
                         rng.integers(cv.COORD_MIN + 2, cv.COORD_MAX - 1, (300, 3))]).astype(np.int32)
    assert np.array_equal(to_host(pack_keys_device(c, (-2, -2, -2), (1, 1, 1))), cv.pack_keys(c))
    assert np.array_equal(to_host(pack_keys_device(c[:, 1:])), cv.pack_keys(c[:, 1:]))
    c[17, 2] = cv.COORD_MAX
    with pytest.raises(ValueError, match="kernel's reach"):
        pack_keys_device(c, (-1, -1, -1), (1, 1, 1))
    with pytest.raises(TypeError, match="integer"):
        pack_keys_device(c.astype(np.float32))
