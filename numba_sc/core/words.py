"""Channels as words: how the gather and the scatter move several channels per load.

A thread of the gather or the scatter handles a *tile* of ``T`` consecutive
channels of one row. Read channel by channel, a fp16 tile of 8 channels is eight
2-byte loads; read as two 8-byte words it is two. Fewer, wider loads speed up
the fp16 gather at many channels, and let the scatter use tiles of 16 and 32
channels, which channel by channel are much slower than tiles of 8 (rung v4 of
both ladders; figures in ``docs/performance.md``). So both kernels see the feature
arrays as rows of signed integer *words* whenever a tile's bytes are a whole
number of them (:func:`word_view`), and unpack a word into its channels only
where they must be added (the scatter):

=========  ========  ===============  ===================================
features   word      lanes per word   lane ``l`` of word ``x``
=========  ========  ===============  ===================================
fp16       int64     4                bits ``16 l .. 16 l + 15``
fp16       int32     2                (tiles of 2 mod 4 channels)
fp32       int64     2                bits ``32 l .. 32 l + 31``
fp32       int32     1                (odd tiles)
=========  ========  ===============  ===================================

Lane 0 is the lowest-addressed channel: the GPU is little-endian, so the
channel at byte offset ``2 l`` of a word is its bits ``16 l ..``.

Turning a lane's bits into a number is a reinterpretation, not a conversion.
On the GPU that is libdevice's ``__nv_half2float`` / ``__nv_int_as_float`` (one
instruction or none; ``float2half_rn`` / ``float_as_int`` going back). Numba's
CUDA simulator has no libdevice (its functions are stubs there), so under the
simulator the same four helpers are NumPy views of one scalar. That is the only
place where the simulated kernels differ from the compiled ones.
:func:`unpack_reference` and :func:`pack_reference` are the NumPy versions of a
lane and a packed word: views of the same bytes, which the tests compare with.

Worked example, one fp16 word holding channels ``[1.0, -2.0, 0.5, 0.0]``::

    bits per lane     0x3C00  0xC000  0x3800  0x0000
    word (int64)      0x0000_3800_C000_3C00
    lane 1            (word >> 16) & 0xFFFF = 0xC000 -> half2float -> -2.0
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int16, int32, int64, uint64

from .device import simulating
from .pieces import piece, piece_template
from .state import cached


def word_view(itemsize: int, tile: int):
    """The widest signed word (8 or 4 bytes) that a tile of ``tile`` channels of
    ``itemsize`` bytes is a whole number of, and the tile in those words; or
    ``(None, tile)`` when there is none (odd tiles of fp16 are moved channel by
    channel)."""
    for word in (np.int64, np.int32):
        size = np.dtype(word).itemsize
        if (tile * itemsize) % size == 0:
            return word, tile * itemsize // size
    return None, tile


@cached
def row_words(itemsize: int, tile: int, channels: int):
    """``(word, tile, per_row)`` for rows of ``channels`` channels of ``itemsize``
    bytes cut into tiles of ``tile`` channels: :func:`word_view`'s word and tile,
    and the words in a row (``word=None``: the tile and the row in channels).
    Remembered: the gather and the scatter ask it at every call."""
    word, tile_words = word_view(itemsize, tile)
    per_row = channels if word is None else channels * itemsize // np.dtype(word).itemsize
    return word, tile_words, per_row


def as_words(a, rows: int, per_row: int, word):
    """The bytes of the C-contiguous device array ``a`` as ``(rows, per_row)`` words of
    type ``word``: what the gather and the scatter hand their kernels (a
    :class:`numba_sc.core.pieces.Piece`, no library call; a NumPy view under the
    simulator). ``rows * per_row`` words must be ``a``'s bytes: the callers
    take both numbers from ``a``'s own shape (:func:`row_words`)."""
    if simulating():
        return piece(a, 0, (rows, per_row), word)
    t = _words_template(rows, per_row, word)
    if t.size * t.itemsize > a.nbytes:  # (piece() checks this; the template's move does not)
        raise ValueError(f"{rows} rows of {per_row} words do not fit in an array of {a.nbytes} bytes")
    return t.rebased(a)


@cached(maxsize=1024)
def _words_template(rows, per_row, word):
    # A piece of no allocation yet, moved into each new array: about half the host
    # time of a new piece (docs/performance.md, "core/"), and a layer asks for the
    # same few shapes call after call.
    return piece_template(0, (rows, per_row), word)


def lanes(word, itemsize: int) -> int:
    """Channels per word (1 when ``word`` is None: the arrays are read channel by channel)."""
    return 1 if word is None else np.dtype(word).itemsize // itemsize


# ------------------------------------------------------------------ reference
def unpack_reference(words, itemsize: int):
    """NumPy version of :func:`lane_codec`'s ``lane``: every channel of an array of
    words (int64 or int32), as float32, lane 0 first. The same bytes seen as
    channels (``view``): what the kernel does one shift and mask at a time."""
    words = np.ascontiguousarray(words)
    return words.view(np.float16 if itemsize == 2 else np.float32).astype(np.float32)


def pack_reference(values, word, itemsize: int):
    """NumPy version of :func:`lane_codec`'s ``packed``: float32 channels rounded to
    fp16 or fp32 (to nearest even), then seen as words of type ``word``."""
    channels = np.asarray(values, dtype=np.float32).astype(np.float16 if itemsize == 2 else np.float32)
    return np.ascontiguousarray(channels).view(word)


# ------------------------------------------------- bit reinterpretation (scalars)
if simulating():
    def half_from_bits(h):
        """The fp16 number whose bits are ``h`` (0 <= h < 2**16), as float32."""
        return np.float32(np.uint16(h).view(np.float16))

    def bits_from_half(f):
        """The bits (0 <= result < 2**16) of ``f`` rounded to fp16 (to nearest even)."""
        return np.int64(np.float16(f).view(np.uint16))  # np.int64: shifts wrap as on the GPU

    def float_from_bits(b):
        """The float32 whose bits are ``b`` (0 <= b < 2**32)."""
        return np.uint32(b).view(np.float32)

    def bits_from_float(f):
        """The bits (0 <= result < 2**32) of the float32 ``f``."""
        return np.int64(np.float32(f).view(np.uint32))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def half_from_bits(h):
        return libdevice.half2float(int16(h))  # cvt.f32.f16: exact

    @cuda.jit(device=True)
    def bits_from_half(f):
        return int64(libdevice.float2half_rn(f)) & 0xFFFF  # (int16: sign-extended, so masked)

    @cuda.jit(device=True)
    def float_from_bits(b):
        return libdevice.int_as_float(int32(b))  # a register rename, no instruction

    @cuda.jit(device=True)
    def bits_from_float(f):
        return int64(libdevice.float_as_int(f)) & 0xFFFFFFFF


def lane_codec(word, itemsize: int):
    """Two device functions for arrays seen as ``word``s of ``itemsize``-byte channels:

    * ``lane(x, l)``: channel ``l`` of the value ``x`` read from such an array, as float32;
    * ``packed(acc, i)``: the value to store for channels ``acc[i : i + lanes]``
      (a local float32 array), rounded to the channels' dtype.

    With ``word=None`` the arrays hold the channels themselves (one lane): ``lane``
    is a float32 conversion and ``packed`` returns ``acc[i]`` (the store rounds it).
    """
    n = lanes(word, itemsize)
    if word is None:
        @cuda.jit(device=True)
        def lane(x, lane_index):
            return float32(x)

        @cuda.jit(device=True)
        def packed(acc, i):
            return acc[i]

        return lane, packed
    bits = 8 * itemsize
    mask = (1 << bits) - 1
    as_word = int64 if np.dtype(word).itemsize == 8 else int32  # keeps the low bits
    from_bits, to_bits = (half_from_bits, bits_from_half) if itemsize == 2 else (
        float_from_bits, bits_from_float)

    @cuda.jit(device=True)
    def lane(x, lane_index):
        return from_bits((int64(x) >> (int64(lane_index) * bits)) & mask)

    @cuda.jit(device=True)
    def packed(acc, i):
        v = int64(0)
        for m in range(n):  # constant trip count: unrolled
            v |= to_bits(acc[i + uint64(m)]) << (bits * m)
        return as_word(v)

    return lane, packed
