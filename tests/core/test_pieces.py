"""Small device arrays cut from one allocation (Piece), and their NumPy views under the simulator."""
import numpy as np
import pytest

from numba_sc.core import device, pieces
from numba_sc.core.state import STATE, clear_caches


@pytest.mark.skipif(not device.simulating(), reason="a Piece, not a view, on a GPU")
def test_piece_under_the_simulator_is_a_view_of_the_base():
    base = np.zeros(64, np.uint8)
    p = pieces.piece(base, 8, (2, 3), np.int32)
    p[...] = [[1, 2, 3], [4, 5, 6]]
    assert p.shape == (2, 3) and p.dtype == np.int32
    np.testing.assert_array_equal(base[8:32].view(np.int32), [1, 2, 3, 4, 5, 6])


@pytest.mark.parametrize("offset, shape", [(2, (1,)), (60, (2,))])
def test_piece_refuses_misaligned_or_too_large(offset, shape):
    with pytest.raises(ValueError, match="does not fit or align"):
        pieces.piece(np.zeros(64, np.uint8), offset, shape, np.int32)


class _Base:
    """An allocation at a made-up address (a Piece only reads ``data.ptr``)."""

    def __init__(self, ptr):
        self.data = type("data", (), {"ptr": ptr})()


def test_piece_fields_are_numbas_array_struct():
    p = pieces.Piece(_Base(4096), 16, (3, 5), np.dtype(np.float32))
    assert p.ptr == 4112 and p.size == 15 and p.strides == (20, 4)
    assert p.flat == (0, 0, 15, 4, 4112, 3, 5, 20, 4)  # meminfo, parent, size, itemsize, data, shape, strides
    assert p.sig == ("f", 2, True)
    assert p.__cuda_array_interface__["data"] == (4112, False)
    assert not hasattr(p, "_c_contiguous")  # the fast launcher knows Piece; no CuPy flag is faked


def test_rebased_and_template_move_a_layout():
    t = pieces.piece_template(8, (4,), np.int64)
    p = t.rebased(_Base(1000))
    assert p.ptr == 1008 and p.flat[4] == 1008 and p.flat[:4] == t.flat[:4] and p.sig == t.sig
    assert pieces.as_array(np.zeros(2)).shape == (2,)


@pytest.mark.skipif(not device.simulating(), reason="pieces of NumPy arrays: the simulator's")
def test_dtypes_memo_is_registered():
    pieces.piece(np.zeros(8, np.uint8), 0, (2,), "int32")
    assert any(c is pieces._DTYPES for c in STATE.caches) and "int32" in pieces._DTYPES
    clear_caches()
    assert pieces._DTYPES == {}
    assert pieces.piece(np.zeros(8, np.uint8), 0, (2,), "int32").dtype == np.int32  # works again
