"""Stage 10, tiled scatter: partial results in the output buffer -> output features.

After the GEMMs, output i has one partial result per offset it received a pair
through, each in its own row of the output buffer (the output table of
:mod:`numba_sc.gmas.metadata`). The scatter sums them::

    out[i] = init[i] + sum over k with out_table[i, k] >= 0 of obuf[out_table[i, k]]

where ``init`` is the submanifold centre's product ``F @ W[centre]`` (or zero).

One thread per (channel tile, output point), mirroring the gather: the thread
owns its tile of its output, accumulates its partial results in registers and
writes the tile once. No other thread touches that tile, so there are no atomics
and the sum is taken in a fixed order (offset order: the order of the output's
list, :class:`numba_sc.gmas.layout.PointLists`): the result is deterministic, run
after run. Sums are accumulated in fp32 also for fp16 data, so each output is
rounded to fp16 once. In fp16 the buffer holds each partial result rounded to fp16,
and one of them may pass fp16's range where the sum does not: the library's launch
(:func:`scatter_cuda`) compiles in a guard that computes such a value again in fp32
("the guard of fp16 products" below). A buffer and an output of different dtypes
(fp16 products into the fp32 sums of a layer run in windows) are read as words too,
each in its own.

Worked example, ``C_out = 2``, ``T = 1``, output 3 with rows ``[4, 9]`` (its
table row ``[4, -1, 9]``)::

    thread (output 3, tile 0): acc = init[3, 0] + obuf[4, 0] + obuf[9, 0]; out[3, 0] = acc
    thread (output 3, tile 1): acc = init[3, 1] + obuf[4, 1] + obuf[9, 1]; out[3, 1] = acc

As in the gather, the buffer and the output are read as words (8 or 4 bytes,
:mod:`numba_sc.core.words`) whenever a tile is a whole number of them; here each
word is then unpacked into its channels (libdevice's bit reinterpretations) to
be added, and the sums packed back into words for the one store. At equal tiles
words and channels are within a few percent; the gain is that bigger tiles now
pay: channel by channel a tile of 32 channels is much slower than a tile of 8,
as words it is the fastest on 1M voxels.

The ladder, one idea a rung. ``python -m numba_sc ladder scatter`` checks and
times them; what each bought on SemanticKITTI at 0.05 m, 64 channels, is recorded
in ``benchmarks/results/ladder_all_kitti.json``
(``numba_sc.tools.lesson.bought("scatter")`` prints it, with the device and date):

    v1  each thread walks its output's row of the dense output table, a channel
          at a time (:func:`scatter_v1`)
    v2  + the per-point lists: a mask and the rows that exist
          (:func:`scatter_v2`)
    v3  + sizes compiled in, the tile's sums in registers, unsigned indices
          (:func:`scatter_v3`)
    v4  + whole words, unpacked into channels to be added (:func:`scatter_v4`:
          v3 given a word type; the library's); it pays in fp16, where a word
          holds more channels, and breaks even in fp32

v1 reads its output's table row once per channel, which the tile's registers of
v3 and the lists of v2 each remove. The launchers: :func:`scatter_cuda` (the
library's), :func:`scatter_rung` (any rung), :func:`scatter` (reference or
device). Fuller figures: ``docs/performance.md``, "gmas/scatter.py".

Napkin math, fp32: every pair's row is read once (``4 * pairs * C_out``), the
output's mask word and rows ``C_out/T`` times (``8|Q| + 4 * pairs`` each, mostly
cache hits), the output written once (``4|Q|C_out`` at most, plus the same read
when a centre product is added; an output without pairs is not touched).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint64

from ..core import conventions as cv
from ..core.conventions import MASK_BITS
from ..core.device import device_id, device_xp
from ..core.backend import resolve_backend, to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.state import cached
from .gather import check_tile, has_row_in_window, in_window
from .layout import as_point_lists
from ..core.words import as_words, lane_codec, lanes, row_words


# ------------------------------------------------------------------ reference
def scatter_reference(obuf, out_table, init=None, n_out=None, channels=None, dtype=None):
    """NumPy version: add each valid (output, offset) entry's row, offset by offset.

    Sums in fp32 (float64 for float64 buffers) and rounds once, like the kernel.
    """
    obuf = np.asarray(obuf)
    n_out = out_table.shape[0] if n_out is None else n_out
    dtype = np.dtype(dtype or obuf.dtype)
    acc_t = cv.compute_dtype(dtype)
    acc = np.zeros((n_out, obuf.shape[1] if channels is None else channels), dtype=acc_t)
    if init is not None:
        acc += np.asarray(init, dtype=acc_t)
    for k in range(out_table.shape[1]):  # the kernel's summation order
        ii = np.flatnonzero(out_table[:, k] >= 0)
        acc[ii] += obuf[out_table[ii, k]].astype(acc_t)
    return acc.astype(dtype)


# ------------------------------------------------------------------- the ladder
# Four rungs, as in the gather; every rung is checked against scatter_reference
# (tests/tools/test_ladder.py) and timed by ``python -m numba_sc ladder scatter``. The
# library runs v4 (v3 where a tile is not a whole number of words).

@cuda.jit
def scatter_v1(obuf, out_table, tile, has_init, out):
    """v1, the scatter as the paper describes it: one thread per (channel tile,
    output point) walks the point's row of the dense output table (|Q| x K), sums
    the rows it finds in offset order, in fp32, and writes its tile once.

    ``has_init``: ``out`` already holds the centre product, which the sum starts
    from. (A register accumulator needs its length at compile time, so v1 sums
    one channel of its tile at a time, reading the table row once per channel;
    v3 sums the whole tile together.)
    """
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        for c in range(c0, c0 + tile):
            acc = float32(out[q, c]) if has_init else float32(0.0)
            for k in range(out_table.shape[1]):  # offset order: the same sum, run after run
                row = out_table[q, k]
                if row >= 0:
                    acc += float32(obuf[row, c])
            out[q, c] = acc  # the only write of this value: no atomics


@cuda.jit
def scatter_v2(obuf, out_masks, buffered, out_slots, tile, has_init, out):
    """v2: the per-point lists instead of the dense table (as the gather's v2):
    a thread reads its output's mask and then only the rows that exist."""
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        n = 0
        for w in range(out_masks.shape[0]):
            n += cuda.popc(out_masks[w, q] & buffered[w])
        for c in range(c0, c0 + tile):
            acc = float32(out[q, c]) if has_init else float32(0.0)
            for s in range(n):
                acc += float32(obuf[out_slots[s, q], c])
            out[q, c] = acc


# --------------------------------------------------- the guard of fp16 products
# In fp16 the GEMMs round each per-offset product to fp16 as they write the buffer
# (2 bytes a value instead of 4: the buffer's traffic halves). A product can pass
# fp16's largest value, 65504, where the output does not: through offsets -1 and +1,
# 2 * 40000 and 2 * -40000 sum to 0, but the buffer holds +inf and -inf, whose sum is
# NaN. Such a product is read as inf, and an fp32 sum with an inf or NaN in it is inf
# or NaN itself (fp16 values cannot overflow an fp32 sum). So the scatter sums as
# always and looks at its tile's sums once, at the end; only a tile whose sum is not
# finite is summed again, value by value, each inf or NaN product computed again in
# fp32 from the row the GEMM multiplied. A layer without such products pays one
# comparison per channel of its tile. (A NaN or inf that the inputs themselves carry
# is computed again too, and stays what it was.)
#
# Why not test every value as it is read: that puts the fall-back inside the loop the
# compiler unrolls, and the scatter of MinkUNet42 fp16 on 1M voxels took several times
# as long (benchmarks/results/scatter_guard.json holds the kernels' times).
@cuda.jit(device=True, inline=True)
def is_finite(v):
    """Whether float ``v`` is neither inf nor NaN."""
    return not (math.isinf(v) or math.isnan(v))


@cuda.jit(device=True, inline=True)
def nth_offset(masks, buffered, q, s):
    """The offset of point q's entry ``s``: the ``s``-th set bit (from 0) of its
    ``masks & buffered`` (:class:`numba_sc.gmas.layout.PointLists`)."""
    for w in range(masks.shape[0]):
        bits = masks[w, q] & buffered[w]
        for b in range(MASK_BITS):
            if (bits >> b) & 1:
                if s == 0:
                    return w * MASK_BITS + b
                s -= 1
    return -1


@cuda.jit(device=True, inline=True)
def product_of(rows, r, weight, k, c):
    """``rows[r] @ weight[k][:, c]`` in fp32: one value of a per-offset product."""
    acc = float32(0.0)
    for i in range(rows.shape[1]):
        acc += float32(rows[r, i]) * float32(weight[k, i, c])
    return acc


@cached
def scatter_v3(tile: int, tiles: int, word=None, itemsize: int = 4, windowed: bool = False,
               repair: bool = False, obuf_word="same", obuf_itemsize: int | None = None):
    """v3 (``word=None``) and v4 (:func:`scatter_v4`): the scatter kernel compiled for one tile size and
    one number of tiles per row.

    **v3**: both are compile-time constants: the tile is held in registers
    (``cuda.local.array`` needs a constant length) and every thread divides its
    index by ``tiles``, a multiply and a shift for a constant where a 64-bit
    division by a run-time value is a software routine of dozens of
    instructions.

    ``word=None``: ``obuf`` and ``out`` are float arrays, read and written channel
    by channel, and ``tile`` counts channels; the tile's sums are held together in
    registers, so the point's rows are read once per tile, not once per channel.
    Outputs without pairs keep their centre product untouched (no read, no write).

    **v4** (``word`` given): they are the same bytes seen as ``word``s
    (:mod:`numba_sc.core.words`), ``tile`` counts words, and each word is unpacked
    into its ``itemsize``-byte channels to be added: a fp16 tile of 8 channels is
    then two loads per row instead of eight.

    ``windowed`` compiles in the test of each row against a window of the buffer
    (:mod:`numba_sc.gmas.workspace`); a layer run whole gets the kernel without it.

    ``obuf_word``, ``obuf_itemsize``: the buffer's own word and channel size where they
    differ from the output's (``word``, ``itemsize``, which ``tile`` counts): an fp16
    buffer added into fp32 sums (the windows of an fp16 layer) is read as 8-byte words
    of four channels while the sums are read and written as words of two. Either
    side's channels are unpacked into the same fp32 accumulator.

    ``repair`` compiles in the guard of fp16 products (the comment above :func:`is_finite`
    says why): a tile whose fp32 sums are not all finite is summed again, and each
    product read as inf or NaN is computed again in fp32 from the gathered row it
    came from (``ibuf``) and its offset's weight; the centre product in ``out``
    likewise, from ``features`` and ``weight[centre]`` (``centre < 0``: not a centre
    product, left as it is). Without it those four arguments are never read.
    """
    n_lanes = lanes(word, itemsize)
    lane, packed = lane_codec(word, itemsize)
    channels = tile * n_lanes  # channels per thread: the accumulator's length
    if obuf_word == "same":  # the buffer is the output's dtype: the same words
        obuf_word, obuf_itemsize = word, itemsize
    in_lanes = lanes(obuf_word, obuf_itemsize)
    in_lane, _ = lane_codec(obuf_word, obuf_itemsize)
    # unsigned, as in the gather (numba_sc.gmas.gather.gather_v3)
    per_thread, per_row, n_u = np.uint64(tile), np.uint64(tiles), np.uint64(n_lanes)
    in_per_thread, in_u = np.uint64(channels // in_lanes), np.uint64(in_lanes)  # the buffer's words

    @cuda.jit(device=True, inline=True)
    def repaired_sum(obuf, out_masks, buffered, out_slots, lo, span, has_init, out, ibuf, weight, features,
                     centre, q, n, c0, b0, j):
        """The guard's second pass (``repair``), for channel ``j`` of the tile at word ``c0``
        of output q (word ``b0`` of the buffer's rows): the sum again, value by value, a
        product read as inf or NaN computed again in fp32 (:func:`product_of`), the
        centre's from ``features`` (its input row is q itself), the others from their
        gathered row and their offset (:func:`nth_offset`)."""
        c, m = j // n_u, j % n_u  # j is channel (c0 + c) * lanes + m of the row
        channel = (c0 + c) * n_u + m
        bc, bm = j // in_u, j % in_u  # j's word and lane in the buffer's tile
        acc = float32(0.0)
        if has_init:
            acc = lane(out[q, c0 + c], m)
            if centre >= 0 and not is_finite(acc):
                acc = product_of(features, q, weight, centre, channel)
        for s in range(n):  # the same offset order as the first pass
            row = uint64(out_slots[s, q])
            if windowed:
                if not in_window(row, uint64(lo), uint64(span)):
                    continue
                row -= uint64(lo)
            v = in_lane(obuf[row, b0 + bc], bm)
            if not is_finite(v):
                v = product_of(ibuf, row, weight, nth_offset(out_masks, buffered, q, s), channel)
            acc += v
        return acc

    @cuda.jit
    def scatter_v3_kernel(obuf, out_masks, buffered, out_slots, lo, span, has_init, out,
                          ibuf, weight, features, centre):
        """Output q's rows are ``out_slots[:, q]``, one per set bit of ``out_masks[:, q] &
        buffered``, in offset order (:class:`numba_sc.gmas.layout.PointLists`). Only
        rows ``lo`` .. ``lo + span - 1`` are added, read from ``obuf[row - lo]``: a window
        of the buffer (:mod:`numba_sc.gmas.workspace`; ``lo = 0, span = rows`` is all of
        it); an output with no row in the window keeps ``out`` unread and unwritten."""
        t = uint64(cuda.grid(1))
        if t < uint64(out.shape[0]) * per_row:
            q = t // per_row  # as in the gather: neighbouring threads, neighbouring tiles
            c0 = (t - q * per_row) * per_thread  # first word (or channel) of this thread's tile
            b0 = (t - q * per_row) * in_per_thread  # ... and of its tile of the buffer's rows
            n = 0  # q's entries: its buffered offsets with a pair (shared by all tiles of q)
            for w in range(uint64(out_masks.shape[0])):
                n += cuda.popc(out_masks[w, q] & buffered[w])
            # An output without pairs keeps its centre product untouched: no read,
            # no write (most of a sparse cloud's points), and so does one without a
            # row in the window; without a centre product it gets its zeros.
            hit = n > 0 or not has_init
            if windowed and has_init:  # (compiled in or out: a layer run whole tests no row)
                hit = has_row_in_window(out_slots, uint64(n), q, uint64(lo), uint64(span))
            if hit:
                acc = cuda.local.array(channels, float32)  # fp32 accumulator, fp16 data or not
                if has_init:
                    # ``out`` already holds the centre product: start from it (the
                    # same order of additions as the reference)
                    for c in range(per_thread):
                        x = out[q, c0 + c]
                        for m in range(n_u):
                            acc[c * n_u + m] = lane(x, m)
                else:
                    for c in range(channels):
                        acc[c] = float32(0.0)
                for s in range(uint64(n)):  # offset order: the same sum, run after run
                    row = uint64(out_slots[s, q])
                    if windowed:
                        if not in_window(row, uint64(lo), uint64(span)):
                            continue
                        row -= uint64(lo)
                    for c in range(in_per_thread):
                        x = obuf[row, b0 + c]
                        for m in range(in_u):
                            acc[c * in_u + m] += in_lane(x, m)
                finite = True
                if repair:  # the guard (compiled in for fp16 buffers only): one test a channel
                    for c in range(channels):
                        finite = finite and is_finite(acc[c])
                if finite:
                    for c in range(per_thread):
                        out[q, c0 + c] = packed(acc, c * n_u)  # the tile's only write: no atomics
                else:  # rare: a product past fp16's range (or an input's inf or NaN)
                    fixed = cuda.local.array(channels, float32)  # (its own array: acc stays in registers)
                    for j in range(channels):
                        fixed[j] = repaired_sum(obuf, out_masks, buffered, out_slots, lo, span, has_init, out,
                                                ibuf, weight, features, centre, q, uint64(n), c0, b0, uint64(j))
                    for c in range(per_thread):
                        out[q, c0 + c] = packed(fixed, c * n_u)

    return scatter_v3_kernel


def scatter_v4(tile: int, tiles: int, word=None, itemsize: int = 4, windowed: bool = False,
               repair: bool = False, obuf_word="same", obuf_itemsize: int | None = None):
    """v4, the library's: :func:`scatter_v3` given a word type, so that ``tile`` counts
    words, each unpacked into its ``itemsize``-byte channels (``word=None``, for a
    tile that is not a whole number of words, gives v3)."""
    return scatter_v3(tile, tiles, word, itemsize, windowed, repair, obuf_word, obuf_itemsize)


def scatter_cuda(obuf, out_lists, init=None, n_out=None, channels=None, dtype=None, tile=1, lo=0, rows=None,
                 repair=None):
    """Device version: one launch of :func:`scatter_v4` (v4, or v3 when a tile is not a
    whole number of words).

    ``out_lists``: a plan's :class:`~numba_sc.gmas.layout.PointLists` (``plan.out_lists``),
    or a dense (|Q|, K) output table, which is packed into lists first. When
    ``init`` (|Q|, C_out) is given it is used as the output array itself (summed
    into in place), saving a separate addition. ``lo``, ``rows``: ``obuf`` holds buffer
    rows ``lo`` .. ``lo + len(obuf) - 1`` of the plan's ``rows`` only, a window
    (:mod:`numba_sc.gmas.workspace`); the rows outside it are left for another call.
    ``repair``: ``(ibuf, weight, features, centre)`` for an fp16 buffer, the rows the
    GEMMs multiplied, the layer's weight, its input features and the submanifold
    centre (-1 when ``init`` is not an fp16 centre product, or there is none): a
    product past fp16's range is computed again in fp32 (:func:`product_of`). None: the
    sums as they are.
    """
    xp = device_xp()
    out_lists = as_point_lists(out_lists)
    n_out = len(out_lists) if n_out is None else n_out
    channels = obuf.shape[1] if channels is None else channels
    if init is not None:
        out = to_device(init)
    else:
        out = xp.empty((n_out, channels), dtype=dtype or obuf.dtype)
    obuf = to_device(obuf)
    tiles = channels // tile
    word, tile_words, per_row = row_words(out.itemsize, tile, channels)
    in_word, _, in_per_row = row_words(obuf.itemsize, tile, channels)  # (fp16 products into fp32 sums)
    src, dst = obuf, out  # each side the same bytes as rows of words, where its tile is whole words
    if in_word is not None and n_out:
        src = as_words(obuf, obuf.shape[0], in_per_row, in_word)
    if word is not None and n_out:
        dst = as_words(out, n_out, per_row, word)
    windowed = lo != 0 or (rows is not None and obuf.shape[0] != rows)
    guard = repair is not None and obuf.dtype == np.float16
    # (without the guard the four are never read; not ``dst``: the simulator copies each
    # argument back after the launch, and a second copy of the output would undo the sums)
    ibuf, weight, features, centre = repair if guard else (src, _no_weight(device_id()), src, -1)
    kernel = scatter_v4(tile_words, tiles, word, out.itemsize, windowed, guard, in_word, obuf.itemsize)
    launch(kernel, n_out * tiles, src,
           to_device(out_lists.masks), to_device(out_lists.buffered), to_device(out_lists.slots),
           lo, obuf.shape[0], init is not None, dst, ibuf, weight, features, centre)
    return out


@cached
def _no_weight(device):
    """The weight argument of a kernel compiled without the guard (never read), one per device."""
    return device_xp().zeros((1, 1, 1), np.float32)


def scatter_rung(rung: str, obuf, plan, init, tile):
    """Run one rung of the ladder (``"v1"`` .. ``"v4"``) on a plan's layout: the
    (|Q|, C_out) sums of ``obuf``'s rows plus ``init`` (which is not modified)."""
    obuf = to_device(obuf)
    if rung == "v4":
        return scatter_cuda(obuf, plan.out_lists, to_device(init).copy(), plan.n_out, obuf.shape[1],
                            obuf.dtype, tile)
    out = to_device(init).copy()
    n = out.shape[0] * (out.shape[1] // tile)
    lists = plan.out_lists
    if rung not in ("v1", "v2", "v3"):
        raise ValueError(f"rung must be one of {LADDER.names}, got {rung!r}")
    if n == 0:  # (a launch needs a block)
        return out
    blocks = blocks_for(n, THREADS)
    if rung == "v1":
        scatter_v1[blocks, THREADS](obuf, to_device(plan.out_table), tile, True, out)
    elif rung == "v2":
        scatter_v2[blocks, THREADS](obuf, to_device(lists.masks), to_device(lists.buffered),
                                    to_device(lists.slots), tile, True, out)
    else:
        scatter_v3(tile, out.shape[1] // tile, None, out.itemsize)[blocks, THREADS](
            obuf, to_device(lists.masks), to_device(lists.buffered), to_device(lists.slots), 0, obuf.shape[0],
            True, out, obuf, _no_weight(device_id()), obuf, -1)  # (the guard's: not compiled in)
    return out


def scatter(obuf, out_table, init=None, tile=1, backend=None, n_out=None, channels=None,
            dtype=None):
    """Sum each output's partial results (plus ``init``, if given); returns (|Q|, C_out).

    ``init`` is never modified: the kernel path sums into a copy of it.
    """
    channels = obuf.shape[1] if channels is None else channels
    tile = check_tile(tile, channels, "tile_size", "output channels")
    if resolve_backend(backend) == "reference":
        return scatter_reference(obuf, np.asarray(out_table), init, n_out, channels, dtype)
    if init is not None:
        init = to_device(init).copy()  # scatter_cuda sums into its init in place
    return scatter_cuda(obuf, out_table, init, n_out, channels, dtype, tile)


# -------------------------------------------------------------------- the ladder
def _ladder_work(ctx):
    """One 3x3x3 submanifold layer (its plan, init and tile) and a buffer of partial
    results, one row per buffer row of the plan."""
    layer = ctx.layer()
    return dict(layer, obuf=ctx.normal("obuf", (layer["plan"].rows, ctx.channels)))


def _rung(name, adds):
    return Rung(name, lambda w: scatter_rung(name, w["obuf"], w["plan"], w["init"], w["tile"]), adds)


def _bytes_moved(w):
    """At least: each pair's partial result read once, with one int32 saying which buffer
    row holds it, and each output's init read; each output written once."""
    pairs = int((to_host(w["plan"].out_table) >= 0).sum())  # (|Q|, K) table of buffer rows
    row = w["obuf"].shape[1] * w["obuf"].dtype.itemsize  # one row of channels, in bytes
    return pairs * (row + 4) + 2 * w["init"].nbytes  # init read, and the output (its shape) written


LADDER = Ladder(
    "scatter",
    (_rung("v1", "each thread walks its output's row of the dense output table, a channel at a time"),
     _rung("v2", "+ per-point lists: a mask and only the rows that exist"),
     _rung("v3", "+ sizes compiled in, the tile's sums in registers, unsigned indices"),
     _rung("v4", "+ whole words, unpacked into channels to be added (the library's)")),
    workload=_ladder_work,
    reference=lambda w: scatter_reference(to_host(w["obuf"]), to_host(w["plan"].out_table), to_host(w["init"])),
    bytes_moved=_bytes_moved,
)
