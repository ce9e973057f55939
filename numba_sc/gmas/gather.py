"""Stage 8, tiled gather (paper Algorithm 1): input features -> the input buffer.

Every input point feeds up to K outputs, each through a different offset, and
each of those pairs has its own row in the input buffer (the input table of
:mod:`numba_sc.gmas.metadata`). The gather copies the point's features into all of
those rows, ready for the grouped GEMMs.

Minuet's kernel gives one thread to each (channel tile, input point): the thread
loads ``T`` consecutive channels of the point into registers *once*, then walks
the point's entries and writes the tile to every buffer row it finds.
The tile size trades two costs (Section 5.2.1):

* every thread reads its point's metadata, so it is read ``C_in / T`` times per
  point: a larger T reads it less often;
* there are ``|P| * C_in / T`` threads: a smaller T gives more parallelism,
  which a big GPU needs when the cloud is small.

Hence the autotuner (:mod:`numba_sc.gmas.autotune`) tries every divisor of C_in.

Which entries: Algorithm 1 walks all K offsets of a dense table row, most of
them empty on a sparse cloud. Here the metadata are compressed per point
(:class:`numba_sc.gmas.layout.PointLists`, PCEngine's idea, which the Minuet paper
names as orthogonal to its own): a bit mask of the point's offsets with a pair,
whose set bits give the length of its list, and the list of rows. The thread
reads the mask word, and then only the rows that exist.

Worked example, ``C_in = 4``, ``T = 2``, input 0 with rows ``[1, 6]`` (offsets 0
and 2; mask ``0b101``)::

    thread (point 0, tile 0): v = F[0, 0:2]; buf[1, 0:2] = v; buf[6, 0:2] = v
    thread (point 0, tile 1): v = F[0, 2:4]; buf[1, 2:4] = v; buf[6, 2:4] = v

Napkin math, fp32: the features of points with pairs are read once
(``4|P|C_in`` at most), the mask ``C_in/T`` times (``8|P| * C_in/T``, cache
hits after the first of the tile threads, which are neighbours in a warp), the
rows once per tile (``4 * pairs * C_in/T``), and every pair's row of the buffer
is written once (``4 * pairs * C_in``). A SemanticKITTI scan at 0.05 m (94,444
voxels) has 190k pairs outside the centre in a 3x3x3 layer, so at 64 channels
the gather reads 24 MB of features and ~1 MB of metadata and writes 49 MB of
buffer (the dense table it replaced was 10 MB, read once per point and tile).
A point with no pair outside the centre has its features never read.

Padding rows of the buffer are not written: their GEMM results land in padding
rows of the output buffer, which the scatter never reads.

A gather only moves bytes, so the kernel does not need to know what a channel
is: when a tile's bytes are a whole number of 8-byte (or 4-byte) words, the
features and the buffer are handed to it as arrays of integer words and each
thread moves ``T * itemsize / 8`` words instead of T channels (a fp16 tile of 8
channels is two 64-bit loads and two stores per row instead of eight of each).
The threads, and what each one covers, stay the same; only the instruction
count changes (:mod:`numba_sc.core.words`).

The ladder, one idea a rung. ``python -m numba_sc ladder gather`` checks and
times them; what each bought on SemanticKITTI at 0.05 m (94,444 voxels, a 3x3x3
layer), 64 channels, the library's tile, is recorded in
``benchmarks/results/ladder_all_kitti.json``
(``numba_sc.tools.lesson.bought("gather")`` prints it, with the device and date):

    v1  Algorithm 1: each thread walks its point's row of the dense input table
          (:func:`gather_v1`)
    v2  + the per-point lists: a mask and the rows that exist, not K entries
          (:func:`gather_v2`)
    v3  + the tile size and tiles per row compiled in, the tile in registers,
          unsigned index arithmetic (:func:`gather_v3`)
    v4  + whole 8- or 4-byte words instead of channels (:func:`gather_v4`:
          v3 given a word type; the library's)

On this sparse scan the lists save little (v2). In fp32 the compiled sizes and
the tile in registers are the rung that pays most (v3); in fp16 they save
little, because a thread still moves 16 channels one by one, until v4 moves
them as words. The launchers: :func:`gather_cuda` (the library's),
:func:`gather_rung` (any rung), :func:`gather` (reference or device). Fuller
figures: ``docs/performance.md``, "gmas/gather.py".
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, from_dtype, uint64

from ..core.device import device_xp, simulating
from ..core.backend import resolve_backend, to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.state import cached
from .layout import as_point_lists
from ..core.words import as_words, row_words


def check_tile(tile, channels, name="tile_size", what="channels"):
    """Raise a clear error unless ``tile`` is a positive divisor of ``channels``."""
    if not isinstance(tile, (int, np.integer)) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"{name} must be a positive int dividing the {what} ({channels}), got {tile!r}")
    if channels % tile:
        divs = divisors(channels)
        raise ValueError(
            f"{name}={tile} does not divide the {what} ({channels}); a tile covers whole "
            f"channels, so pick one of {divs} (or leave tile_size=None to autotune/heuristic)")
    return int(tile)


def divisors(n: int) -> list:
    """All divisors of n, ascending: the tile sizes Algorithm 2 tries."""
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ reference
def gather_reference(features, in_table, rows, tile=None):
    """NumPy version: for every valid (input, offset) entry, copy the row.

    ``tile`` changes nothing here (NumPy copies whole rows); it is accepted so
    that the two versions take the same arguments.
    """
    features = np.asarray(features)
    buf = np.zeros((rows, features.shape[1]), dtype=features.dtype)
    jj, kk = np.nonzero(in_table >= 0)
    buf[in_table[jj, kk]] = features[jj]
    return buf


# ------------------------------------------------------------------- the ladder
# Four rungs, each adding one thing to the one before; every rung is checked
# against gather_reference (tests/tools/test_ladder.py) and timed by
# ``python -m numba_sc ladder gather``. The library runs v4 (v3 where a tile
# is not a whole number of words).

@cuda.jit
def gather_v1(features, in_table, tile, buf):
    """v1, Algorithm 1 as the paper writes it: one thread per (channel tile, input
    point) walks the point's row of the dense input table (|P| x K) and copies
    its tile to every buffer row it finds there.

    (The paper loads the tile into registers once; a register array needs its
    length at compile time, so v1 reads its tile again for every row it writes,
    from the L1 cache after the first. v3 holds it in registers.)
    """
    t = cuda.grid(1)
    tiles = features.shape[1] // tile
    if t < features.shape[0] * tiles:
        p = t // tiles  # neighbouring threads: neighbouring tiles of one point
        c0 = (t - p * tiles) * tile
        for k in range(in_table.shape[1]):  # every offset (Algorithm 1, line 3)
            row = in_table[p, k]
            if row >= 0:  # p feeds some output through offset k: its buffer row
                for c in range(tile):
                    buf[row, c0 + c] = features[p, c0 + c]


@cuda.jit
def gather_v2(features, in_masks, buffered, in_slots, tile, buf):
    """v2: the per-point lists instead of the dense table.

    On a sparse cloud most entries of the table are -1 (27 x 1M entries for
    ~0.4M pairs on 1M random voxels), and v1's threads read all of them. Here a
    point's offsets with a pair are the set bits of its mask word(s), and its
    rows are listed in ``in_slots[:, p]`` (:class:`numba_sc.gmas.layout.PointLists`,
    PCEngine's compression, which Minuet names as combining with its own
    ideas): a thread reads one mask and then only the rows that exist.
    """
    t = cuda.grid(1)
    tiles = features.shape[1] // tile
    if t < features.shape[0] * tiles:
        p = t // tiles
        c0 = (t - p * tiles) * tile
        n = 0  # p's entries: its buffered offsets with a pair
        for w in range(in_masks.shape[0]):
            n += cuda.popc(in_masks[w, p] & buffered[w])
        for s in range(n):  # offset order
            row = in_slots[s, p]
            for c in range(tile):
                buf[row, c0 + c] = features[p, c0 + c]


@cuda.jit(device=True, inline=True)
def in_window(row, lo, span):
    """Whether buffer row ``row`` lies in the window ``lo .. lo + span - 1``
    (:mod:`numba_sc.gmas.workspace`), all three unsigned."""
    return row >= lo and row < lo + span


@cuda.jit(device=True, inline=True)
def has_row_in_window(slots, n, p, lo, span):
    """Whether any of point p's ``n`` rows (``slots[:n, p]``) lies in the window: the
    gather reads p's features, and the scatter touches output p, only if one does."""
    for s in range(n):
        if in_window(uint64(slots[s, p]), lo, span):
            return True
    return False


@cached
def gather_v3(tile: int, tiles: int, word=None, windowed: bool = False):
    """v3 (``word=None``) and v4 (:func:`gather_v4`): the gather kernel compiled for one tile size, one
    number of tiles per row (channels / tile) and one kind of element.

    **v3** makes the three compile-time constants:

    * the tile lives in registers (``cuda.local.array`` needs a constant length);
    * every thread divides its index by ``tiles``: a 64-bit division by a
      run-time value is a software routine of dozens of instructions, by a
      constant a multiply and a shift;
    * ``word=None`` for float features (held as fp32, which holds fp16 exactly).

    Unsigned index arithmetic then saves the wraparound test of every signed
    index.

    ``windowed`` compiles in the test of each row against a window of the buffer
    (:mod:`numba_sc.gmas.workspace`: a layer whose buffers would pass the bound runs
    in windows); a layer run whole gets the kernel without it.

    **v4** (``word`` a signed NumPy integer type) moves bytes, not channels: the
    features and the buffer are handed over as word views
    (:func:`numba_sc.core.words.word_view`) and ``tile`` counts 8- or 4-byte words, so a
    fp16 tile of 8 channels is two loads and two stores per row instead of eight
    of each.
    """
    held = float32 if word is None else from_dtype(np.dtype(word))
    # Unsigned constants keep the index arithmetic unsigned (see
    # numba_sc.gmas.metadata.metadata_v2: a signed index costs a wraparound test per access)
    per_thread, per_row = np.uint64(tile), np.uint64(tiles)

    @cuda.jit
    def gather_v3_kernel(features, in_masks, buffered, in_slots, lo, span, buf):
        """Input p's rows are ``in_slots[:, p]``, one per set bit of ``in_masks[:, p] &
        buffered``, in offset order (:class:`numba_sc.gmas.layout.PointLists`).
        Only rows ``lo`` .. ``lo + span - 1`` are written, to ``buf[row - lo]``: a window
        of the buffer (:mod:`numba_sc.gmas.workspace`; ``lo = 0, span = rows`` is all of it)."""
        t = uint64(cuda.grid(1))
        if t < uint64(features.shape[0]) * per_row:
            p = t // per_row  # neighbouring threads take neighbouring tiles of one point:
            c0 = (t - p * per_row) * per_thread  # their loads and stores are contiguous
            n = 0  # p's entries: its buffered offsets with a pair (the same for all tiles of p)
            for w in range(uint64(in_masks.shape[0])):
                n += cuda.popc(in_masks[w, p] & buffered[w])
            hit = n > 0
            if windowed:  # (compiled in or out: a layer run whole tests no row)
                hit = has_row_in_window(in_slots, uint64(n), p, uint64(lo), uint64(span))
            if hit:
                # A point with no pair outside the centre (about 2 in 3 of 1M random
                # voxels in 400^3), or none in the window, has its features never read.
                v = cuda.local.array(tile, held)  # fp32 holds fp16 exactly; words are words
                for c in range(per_thread):
                    v[c] = features[p, c0 + c]
                # Only the offsets that have a pair (Algorithm 1, line 4), in offset
                # order: the threads of a warp, on neighbouring points, mostly reach
                # the same offset at the same step and write neighbouring rows (an
                # offset's rows follow the points' order). In a run-dependent order
                # the same gather ran markedly slower on SemanticKITTI (measured on
                # the H100 when this order was chosen).
                for s in range(uint64(n)):
                    row = uint64(in_slots[s, p])
                    if windowed:
                        if not in_window(row, uint64(lo), uint64(span)):
                            continue
                        row -= uint64(lo)
                    for c in range(per_thread):
                        buf[row, c0 + c] = v[c]

    return gather_v3_kernel


def gather_v4(tile: int, tiles: int, word=None, windowed: bool = False):
    """v4, the library's: :func:`gather_v3` given a word type, so that ``tile`` counts
    8- or 4-byte words (``word=None``, for a tile that is not a whole number of
    words, gives v3)."""
    return gather_v3(tile, tiles, word, windowed)


def gather_cuda(features, in_lists, rows, tile, zero_padding=False, window=None):
    """Device version, the library's: one launch of :func:`gather_v4` (v4, or v3
    when a tile is not a whole number of words) for all offsets.

    ``in_lists``: a plan's :class:`~numba_sc.gmas.layout.PointLists` (``plan.in_lists``),
    or a dense (|P|, K) input table, which is packed into lists first.
    ``zero_padding``: zero the padding rows (the weight gradient multiplies two
    buffers' padding rows together, where garbage could be NaN).
    ``window``: ``(lo, hi)``, gather only buffer rows ``lo .. hi - 1`` into a buffer
    of ``hi - lo`` rows (:mod:`numba_sc.gmas.workspace`); None: all ``rows``.
    """
    xp = device_xp()
    f = to_device(features)
    in_lists = as_point_lists(in_lists)
    full = rows
    lo, hi = (0, rows) if window is None else window
    rows = hi - lo
    # Padding rows stay unwritten on the GPU (saves a memset of the whole buffer).
    # Under the simulator they are zeroed, only so that NumPy never sees garbage
    # that could trip an overflow warning in the fp16 GEMM.
    buf = (xp.zeros if simulating() or zero_padding else xp.empty)((rows, f.shape[1]), dtype=f.dtype)
    if rows:
        src, dst = f, buf
        word, tile_words, per_row = row_words(f.itemsize, tile, f.shape[1])
        if word is not None:  # the same bytes, as rows of words
            src, dst = as_words(f, f.shape[0], per_row, word), as_words(buf, rows, per_row, word)
        tiles = f.shape[1] // tile
        launch(gather_v4(tile_words, tiles, word, (lo, hi) != (0, full)), f.shape[0] * tiles, src,
               to_device(in_lists.masks), to_device(in_lists.buffered), to_device(in_lists.slots), lo, rows, dst)
    return buf


def gather_rung(rung: str, features, plan, tile):
    """Run one rung of the ladder (``"v1"`` .. ``"v4"``) on a plan's layout; returns the
    (rows, C_in) buffer (padding rows unwritten). v1 reads the dense input table,
    the others the plan's point lists; v4 is :func:`gather_cuda`."""
    xp = device_xp()
    f = to_device(features)
    if rung == "v4":
        return gather_cuda(f, plan.in_lists, plan.rows, tile)
    buf = (xp.zeros if simulating() else xp.empty)((plan.rows, f.shape[1]), dtype=f.dtype)
    n = f.shape[0] * (f.shape[1] // tile)
    lists = plan.in_lists
    if rung not in ("v1", "v2", "v3"):
        raise ValueError(f"rung must be one of {LADDER.names}, got {rung!r}")
    if n == 0:  # (a launch needs a block)
        return buf
    blocks = blocks_for(n, THREADS)
    if rung == "v1":
        gather_v1[blocks, THREADS](f, to_device(plan.in_table), tile, buf)
    elif rung == "v2":
        gather_v2[blocks, THREADS](f, to_device(lists.masks), to_device(lists.buffered), to_device(lists.slots),
                                   tile, buf)
    else:
        gather_v3(tile, f.shape[1] // tile)[blocks, THREADS](f, to_device(lists.masks), to_device(lists.buffered),
                                                             to_device(lists.slots), 0, plan.rows, buf)
    return buf


def gather(features, in_table, rows, tile=1, backend=None):
    """Copy each input's features to its buffer rows; returns the (rows, C_in) buffer."""
    tile = check_tile(tile, features.shape[1], "tile_size", "input channels")
    if resolve_backend(backend) == "reference":
        return gather_reference(features, np.asarray(in_table), rows, tile)
    return gather_cuda(features, in_table, rows, tile)


# -------------------------------------------------------------------- the ladder
def _written_rows(w):
    """The buffer rows the plan's input table points at (a gather writes those and no padding)."""
    t = to_host(w["plan"].in_table)
    return np.unique(t[t >= 0])


def _rung(name, adds):
    return Rung(name, lambda w: gather_rung(name, w["features"], w["plan"], w["tile"]), adds)


def _bytes_moved(w):
    """At least: each input that feeds a buffer row read once, one int32 a pair saying
    which row it goes to, and each pair's row written once."""
    pairs = to_host(w["plan"].in_table) >= 0  # (|P|, K): input p feeds a row through offset k
    row = w["features"].shape[1] * w["features"].dtype.itemsize  # one row of features, in bytes
    return int(pairs.any(axis=1).sum()) * row + int(pairs.sum()) * (4 + row)


LADDER = Ladder(
    "gather",
    (_rung("v1", "Algorithm 1: each thread walks its point's row of the dense input table"),
     _rung("v2", "+ per-point lists: a mask and only the rows that exist"),
     _rung("v3", "+ sizes compiled in, the tile in registers, unsigned indices"),
     _rung("v4", "+ whole 8/4-byte words instead of channels (the library's)")),
    workload=lambda ctx: ctx.layer(),  # one 3x3x3 submanifold layer: its plan, features and tile
    reference=lambda w: gather_reference(to_host(w["features"]), to_host(w["plan"].in_table), w["plan"].rows),
    written=_written_rows,
    bytes_moved=_bytes_moved,
)
