"""Exercises of notebook 12, the tensor-core rung: where a warp's values live, and how they get there.

* 12.1 where a lane's results belong: ``c_position(lane, r)``, the (row, column) of the
  16 x 8 tile of ``mma.m16n8k16`` that float ``r`` of ``lane``'s ``C``/``D`` fragment is (what
  v4's epilogue computes with ``c_row``/``c_col`` to store its results). The wrong answer
  reads ``r`` the other way round: its low bit as the row half, its high bit as the
  column, so that results 0 and 1 land 8 rows apart instead of side by side;
* 12.2 the addresses of ``B``: ``b_address(lane, col0, ks)``, the (row, column) of the
  row-major weight tile in shared memory that ``lane`` gives ``ldmatrix.x4.trans``, so
  that its registers 0, 1 come back as ``b0, b1`` of the 8-column tile at ``col0`` and
  2, 3 as those of the tile at ``col0 + 8``, for the 16 channels of step ``ks``. The
  wrong answer swaps the two lane bits that pick a matrix's channel half and its column
  tile: every value lands in a lane, but in the wrong register.

The references are the library's (:func:`numba_sc.dataflows.tensor_cores.c_layout_reference`,
the table v4's epilogue follows) and the NumPy model of ``ldmatrix`` and the ``B``
fragment (:mod:`numba_sc.tools.mma_model`).
"""
from __future__ import annotations

import numpy as np

from ...dataflows.tensor_cores import c_layout_reference
from ..mma_model import b_fragment, fragments, ldmatrix_x4
from . import ExerciseFailed, Slip, exercise


def _pair(value, call: str) -> tuple:
    """``value`` as a (row, column) pair of ints, or ExerciseFailed saying what came back."""
    try:
        row, col = value
        return int(row), int(col)
    except (TypeError, ValueError):
        raise ExerciseFailed(f"{call} returned {value!r}",
                             "an address or a position is a pair (row, column) of ints") from None


# -- 12.1 -----------------------------------------------------------------------------

def _c_position_swapped(lane, r):
    """Wrong: the low bit of r picks the row half, the high bit the column."""
    return lane // 4 + (r % 2) * 8, (lane % 4) * 2 + r // 2


def _c_position_transposed(lane, r):
    """Wrong: rows and columns swapped (the tile read as 8 x 16)."""
    return (lane % 4) * 2 + r % 2, lane // 4 + (r // 2) * 8


@exercise("12.1", "where a lane's results belong", answer="c_position",
          wrong=[Slip(_c_position_swapped, says="results 0 and 1 are row g"),
                 Slip(_c_position_transposed, says="c_position(0, 1) = (1, 0), expected (0, 1)")])
def check_c_position(c_position):
    """``c_position(lane, r)`` for every lane 0..31 and result 0..3, against the library's
    table of the ``C`` fragment."""
    table = c_layout_reference()
    for lane in range(32):
        for r in range(4):
            got = _pair(c_position(lane, r), f"c_position({lane}, {r})")
            want = tuple(int(v) for v in table[lane, r])
            if got != want:
                g, t = lane // 4, lane % 4
                raise ExerciseFailed(
                    f"c_position({lane}, {r}) = {got}, expected {want}",
                    f"lane {lane} is in group "
                    f"g = lane // 4 = {g} at place t = lane % 4 = {t}; its results 0 and 1 are row g, "
                    f"columns 2t and 2t + 1 (neighbours on a row, one 8-byte pair), results 2 and 3 the "
                    f"same columns of row g + 8")


# -- 12.2 -----------------------------------------------------------------------------

def _b_address_swapped(lane, col0, ks):
    """Wrong: lane bit 4 picks the channel half and bit 3 the column tile (mma.cu: the other way round)."""
    return ks * 16 + (lane & 7) + (lane >> 4) * 8, col0 + ((lane >> 3) & 1) * 8


PITCH = 40  # the checker's tile: 32 channels (two mma steps) x 32 output channels, rows padded by 8


def _needed(lane, col0, ks) -> tuple:
    """The address lane must give: row lane % 8 of matrix lane // 8, where matrix m is the
    channel half m % 2 of column tile m // 2."""
    m, i = lane // 8, lane % 8
    return ks * 16 + (m % 2) * 8 + i, col0 + (m // 2) * 8


def _b_address_one_half(lane, col0, ks):
    """Wrong: lanes 8-15 point at the same channels as lanes 0-7, so b1 is b0 again."""
    return ks * 16 + (lane & 7), col0 + (lane >> 4) * 8


def _b_address_unaligned(lane, col0, ks):
    """Wrong: the second column tile starts 4 values on, not at a 16-byte row boundary."""
    return ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col0 + (lane >> 4) * 4


@exercise("12.2", "the addresses that load B", answer="b_address",
          wrong=[Slip(_b_address_swapped, says="lanes 8m .. 8m + 7 give the rows of matrix m"),
                 Slip(_b_address_one_half, says="expected (8, 0)"),
                 Slip(_b_address_unaligned, says="16-byte aligned")])
def check_b_address(b_address):
    """``b_address(lane, col0, ks)`` for both steps of a 32-channel chunk and two column
    tiles: its 32 addresses go through the model of ``ldmatrix.x4.trans``, and the four
    registers must be the ``B`` fragments of the tiles at ``col0`` and ``col0 + 8``."""
    # every element of the tile a distinct small integer (exact in fp16): a value says where it came from
    tile = np.arange(32 * PITCH).reshape(32, PITCH).astype(np.float16)
    for ks in (0, 1):
        for col0 in (0, 16):
            addresses = [_pair(b_address(lane, col0, ks), f"b_address({lane}, {col0}, {ks})") for lane in range(32)]
            rows, cols = (np.array(v) for v in zip(*addresses))
            try:
                regs = ldmatrix_x4(tile, rows, cols, trans=True)
            except ValueError as err:
                raise ExerciseFailed(f"b_address(lane, {col0}, {ks}): {err}",
                                     "ldmatrix reads 16-byte rows: every address starts a row of 8 values "
                                     "inside the tile") from None
            for p in (0, 1):  # registers 2p, 2p + 1: the column tile at col0 + 8p
                got = regs[:, 2 * p:2 * p + 2].reshape(32, 4)
                want = fragments(tile[16 * ks:16 * ks + 16, col0 + 8 * p:col0 + 8 * p + 8], b_fragment())
                if np.array_equal(got, want):
                    continue
                lane, e = (int(v) for v in np.argwhere(got != want)[0])
                at = divmod(int(got[lane, e]), PITCH)
                expected = divmod(int(want[lane, e]), PITCH)
                giver = next(q for q in range(32) if addresses[q] != _needed(q, col0, ks))  # (one differs)
                raise ExerciseFailed(
                    f"b_address(lane, {col0}, {ks}): lane {lane}'s register {2 * p + e // 2} holds tile element "
                    f"{at}, expected {expected} (b{e // 2} of the column tile at {col0 + 8 * p}). The cause: lane "
                    f"{giver} gives {addresses[giver]} as the start of row {giver % 8} of matrix {giver // 8}, "
                    f"which must be {_needed(giver, col0, ks)}",
                    "lanes 8m .. 8m + 7 give the rows of "
                    "matrix m, which comes back in register m; matrices 0 and 1 are channels 16 ks + 0..7 and "
                    "16 ks + 8..15 at column col0 (b0, b1 of the first tile), matrices 2 and 3 the same at "
                    "column col0 + 8")
