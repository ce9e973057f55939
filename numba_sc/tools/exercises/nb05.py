"""Exercises of notebook 05 (gather, GEMM, scatter): one idea of each of its ladders.

* 5.1 buffer rows by a scan: the metadata tables of a layer, the way ``metadata_v1``
  builds them (a scan of ``table >= 0`` ranks every pair within its offset);
* 5.2 the scatter as the gather's mirror: a ``@cuda.jit`` kernel with ``scatter_v1``'s
  arguments, one thread per (channel tile, output point), no atomics;
* 5.3 per-point lists: the compressed tables that rung v2 of the gather and of the
  scatter read (a bit mask of offsets, the rows in offset order);
* 5.4 channels as words: which tiles rung v4 moves as 8- or 4-byte words.

Every checker builds its inputs from a crop of the SemanticKITTI scan (a couple of
hundred points; the synthetic street of :mod:`numba_sc.tools.synthetic` when the
scans are not there), so that a check takes well under a second under the
simulator, and compares the answer with the library's reference.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ...core.state import cached
from . import ExerciseFailed, exercise, expect_equal
from .inputs import centre_crop

CROP_POINTS = 200  # about 130 voxels at 5 cm: a few hundred threads a launch under the simulator


# ------------------------------------------------------------------ the inputs
@cached
def crop_coords(n_points: int = CROP_POINTS):
    """Voxel coordinates (5 cm) of the ``n_points`` points around the middle of the
    SemanticKITTI scan ($NUMBA_SC_DATA, else ``shared/data`` beside the checkout),
    or of the synthetic street when the scan is not there."""
    return centre_crop(n_points)


@cached
def crop_layer(stride: int = 1):
    """A 3x3x3 layer of ``stride`` on the crop: ``(kernel map, GMaS plan)``, both built by
    the NumPy references (stride 1: a submanifold layer, whose centre skips the
    buffers; stride 2: fewer outputs than inputs, every offset in the buffers)."""
    from ...gmas.plan import build_plan
    from ...map.map_step import build_kernel_map

    km = build_kernel_map(crop_coords(), kernel_size=3, stride=stride, backend="reference")
    return km, build_plan(km, backend="reference")


# ---------------------------------------------------- 5.1 buffer rows by a scan
def _rows_from_inclusive_scan(table, base, n_in):
    """A plausible slip: the inclusive scan taken as the rank (every row one too far)."""
    table, base = np.asarray(table), np.asarray(base)
    K, n_out = table.shape
    rank = np.cumsum(table >= 0, axis=1)  # forgot the -1: the first pair gets rank 1
    in_table = np.full((n_in, K), -1, np.int32)
    out_table = np.full((n_out, K), -1, np.int32)
    kk, ii = np.nonzero((table >= 0) & (base[:, None] >= 0))
    rows = base[kk] + rank[kk, ii]
    out_table[ii, kk] = rows
    in_table[table[kk, ii], kk] = rows
    return in_table, out_table


@exercise("5.1", "buffer rows by a scan", answer="metadata_tables", wrong=_rows_from_inclusive_scan)
def check_metadata_tables(metadata_tables):
    """``metadata_tables(table, base, n_in) -> (in_table, out_table)`` on a submanifold and a
    strided layer of the crop, against the reference plan's tables."""
    for stride in (1, 2):
        km, plan = crop_layer(stride)
        table = np.array(km.table)  # copies: an answer may write into its arguments
        got = metadata_tables(table, np.array(plan.base), len(km.in_coords))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed("metadata_tables must return a pair (in_table, out_table)")
        in_table, out_table = got
        what = f"stride-{stride} layer ({len(km.in_coords)} inputs, {len(km.out_coords)} outputs)"
        expect_equal(out_table, plan.out_table, f"{what}: out_table[i, k]")
        expect_equal(in_table, plan.in_table, f"{what}: in_table[j, k]")


# ------------------------------------------- 5.2 the scatter, the gather's mirror
@cuda.jit
def _scatter_without_centre(obuf, out_table, tile, has_init, out):
    """A plausible slip: the sum starts from zero, so the centre product in ``out`` is lost."""
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        for c in range(c0, c0 + tile):
            acc = float32(0.0)  # should start from out[q, c] when has_init
            for k in range(out_table.shape[1]):
                row = out_table[q, k]
                if row >= 0:
                    acc += float32(obuf[row, c])
            out[q, c] = acc


SCATTER_CHANNELS = 4
SCATTER_TILES = (1, 2)  # tile 2: two threads per output, each with its own channels


@exercise("5.2", "the scatter, the gather's mirror", answer="scatter_kernel", wrong=_scatter_without_centre)
def check_scatter_kernel(scatter_kernel):
    """``scatter_kernel(obuf, out_table, tile, has_init, out)``, launched as the ladder
    launches ``scatter_v1`` (one thread per (tile, output), ``out`` holding the centre
    product), against the scatter ladder's reference on the crop."""
    from ...core.backend import to_device, to_host
    from ...core.launch import THREADS, blocks_for, simulator_pace
    from ...gmas.scatter import LADDER

    if not hasattr(scatter_kernel, "__getitem__"):
        raise ExerciseFailed("scatter_kernel must be a @cuda.jit kernel, launched as kernel[blocks, threads]")
    km, plan = crop_layer(1)
    rng = np.random.default_rng(5)
    work = {"plan": plan,
            "obuf": rng.standard_normal((plan.rows, SCATTER_CHANNELS)).astype(np.float32),
            "init": rng.standard_normal((len(km.out_coords), SCATTER_CHANNELS)).astype(np.float32)}
    want = LADDER.reference(work)
    for tile in SCATTER_TILES:
        out = to_device(work["init"]).copy()  # the centre product, summed onto in place
        with simulator_pace():
            scatter_kernel[blocks_for(len(km.out_coords) * (SCATTER_CHANNELS // tile)), THREADS](
                to_device(work["obuf"]), to_device(plan.out_table), tile, True, out)
        # fp32 sums in offset order are exact to the bit; a float64 accumulator is allowed
        expect_equal(to_host(out), want, f"tile {tile}: out[q, c]", atol=1e-4)


# --------------------------------------------------------- 5.3 per-point lists
def _lists_sorted_by_row(table):
    """A plausible slip: each point's rows sorted by value, not listed in offset order."""
    table = np.asarray(table)
    K = table.shape[1]
    masks = ((table >= 0).astype(np.int64) << np.arange(K, dtype=np.int64)).sum(axis=1)
    rows = np.sort(np.where(table >= 0, table, np.iinfo(np.int32).max), axis=1)
    return masks, np.where(rows == np.iinfo(np.int32).max, -1, rows).astype(np.int32)


@exercise("5.3", "per-point lists", answer="point_lists", wrong=_lists_sorted_by_row)
def check_point_lists(point_lists):
    """``point_lists(table) -> (masks, rows)`` on the crop's input and output tables, against
    :func:`numba_sc.gmas.layout.lists_from_table` (what rung v2 reads)."""
    from ...gmas.layout import lists_from_table

    _, plan = crop_layer(1)
    for name, table in (("in_table", plan.in_table), ("out_table", plan.out_table)):
        got = point_lists(np.array(table))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed("point_lists must return a pair (masks, rows)")
        lists = lists_from_table(np.asarray(table))
        expect_equal(np.asarray(got[0]).astype(np.int64), lists.masks[0], f"{name}: masks[n]")
        expect_equal(got[1], lists.rows, f"{name}: rows[n, s]")


# -------------------------------------------------------- 5.4 channels as words
def _eight_byte_words_only(itemsize, tile):
    """A plausible slip: only 8-byte words tried, so a fp16 tile of 2 channels (4 bytes)
    and an odd fp32 tile are moved channel by channel."""
    if tile * itemsize % 8 == 0:
        return np.int64, tile * itemsize // 8
    return None, tile


@exercise("5.4", "channels as words", answer="word_view", wrong=_eight_byte_words_only)
def check_word_view(word_view):
    """``word_view(itemsize, tile) -> (word, tile in words)`` for fp16 and fp32 tiles of 1 to
    64 channels, against :func:`numba_sc.core.words.word_view` (what rung v4 launches with)."""
    from ...core.words import word_view as library

    for itemsize in (2, 4):
        for tile in range(1, 65):
            got, want = word_view(itemsize, tile), library(itemsize, tile)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ExerciseFailed("word_view must return a pair (word, tile_in_words)")
            same_word = (got[0] is None) == (want[0] is None) and (
                want[0] is None or np.dtype(got[0]) == np.dtype(want[0]))
            if not same_word or got[1] != want[1]:
                name = "fp16" if itemsize == 2 else "fp32"
                raise ExerciseFailed(f"a {name} tile of {tile} channels: got {got}, expected {want}")
