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
simulator, and compares the answer with the library's reference. 5.2's kernel runs
under the recorder of :mod:`.races`, which shows which thread wrote each output and
how often, and every atomic: the scatter's point is that it needs none.

The slips: an inclusive scan for the exclusive one, a scan run across offsets, the
centre sent to the buffers, a loop over the pairs (5.1); ``has_init`` ignored either
way, atomics, threads numbered output-fastest, the sum kept in ``out`` (5.2); rows
sorted by value, mask bits reversed (5.3); only 8-byte words, the narrowest word
first (5.4).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ...core.state import cached
from . import ExerciseFailed, Slip, exercise, expect_equal, expect_no_race, python_lines, recorded_launch
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
ROWS_RULE = ("pair (k, i) of an offset in the buffers goes to buffer row base[k] + r, where r counts the "
             "pairs of offset k before output i: an exclusive scan of table[k] >= 0, one per offset "
             "(np.cumsum(...) - 1 along each row). out_table[i, k] and in_table[table[k, i], k] hold that "
             "row; an offset with base -1 (the submanifold centre) is not in the buffers, and its entries, "
             "like every entry without a pair, stay -1")
SCAN_RULE = ("buffer rows by a scan: the scan ranks every pair at once in a few array operations; a "
             "Python loop over the pairs runs at least a line a pair")


def _rows_from(table, base, n_in, rank, centre_too=False):
    table, base = np.asarray(table), np.asarray(base)
    K, n_out = table.shape
    in_table = np.full((n_in, K), -1, np.int32)
    out_table = np.full((n_out, K), -1, np.int32)
    kk, ii = np.nonzero((table >= 0) & ((base[:, None] >= 0) | centre_too))
    rows = base[kk] + rank[kk, ii]
    out_table[ii, kk] = rows
    in_table[table[kk, ii], kk] = rows
    return in_table, out_table


def _rows_from_inclusive_scan(table, base, n_in):
    """A plausible slip: the inclusive scan taken as the rank (every row one too far)."""
    return _rows_from(table, base, n_in, np.cumsum(np.asarray(table) >= 0, axis=1))


def _rows_from_one_scan(table, base, n_in):
    """A plausible slip: one scan over all offsets' pairs, not one per offset."""
    hit = np.asarray(table) >= 0
    return _rows_from(table, base, n_in, (np.cumsum(hit.ravel()) - 1).reshape(hit.shape))


def _rows_with_centre(table, base, n_in):
    """A plausible slip: the centre's pairs given rows too (base -1 + rank)."""
    return _rows_from(table, base, n_in, np.cumsum(np.asarray(table) >= 0, axis=1) - 1, centre_too=True)


def _rows_by_loop(table, base, n_in):
    """Right rows, by a Python loop over the pairs: not the scan the exercise is about."""
    table, base = np.asarray(table), np.asarray(base)
    K, n_out = table.shape
    in_table = np.full((n_in, K), -1, np.int32)
    out_table = np.full((n_out, K), -1, np.int32)
    for k in range(K):
        if base[k] < 0:
            continue
        row = base[k]
        for i in range(n_out):
            if table[k, i] >= 0:
                out_table[i, k] = in_table[table[k, i], k] = row
                row += 1
    return in_table, out_table


@exercise("5.1", "buffer rows by a scan", answer="metadata_tables",
          wrong=[Slip(_rows_from_inclusive_scan, says="exclusive scan"),
                 Slip(_rows_from_one_scan, says="one per offset"), Slip(_rows_with_centre, says="base -1"),
                 Slip(_rows_by_loop, says="loop over the pairs")])
def check_metadata_tables(metadata_tables):
    """``metadata_tables(table, base, n_in) -> (in_table, out_table)`` on a submanifold and a
    strided layer of the crop, against the reference plan's tables; the answer may run
    fewer lines of Python than the layer has pairs (:func:`python_lines`)."""
    for stride in (1, 2):
        km, plan = crop_layer(stride)
        table = np.array(km.table)  # copies: an answer may write into its arguments
        got, lines = python_lines(metadata_tables, table, np.array(plan.base), len(km.in_coords))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"metadata_tables returned {type(got).__name__}",
                                 "metadata_tables returns a pair (in_table, out_table)")
        in_table, out_table = got
        what = f"stride-{stride} layer ({len(km.in_coords)} inputs, {len(km.out_coords)} outputs)"
        base = np.asarray(plan.base)

        def where(ik):
            k = ik[1]
            return f"offset {k} ({'not in the buffers' if base[k] < 0 else f'base {base[k]}'})"

        expect_equal(out_table, plan.out_table, f"{what}: out_table[i, k]", rule=ROWS_RULE, where=where)
        expect_equal(in_table, plan.in_table, f"{what}: in_table[j, k]", rule=ROWS_RULE, where=where)
        pairs = int((np.asarray(km.table) >= 0).sum())
        if lines >= pairs:
            raise ExerciseFailed(f"{what}: metadata_tables ran {lines} lines of Python for {pairs} pairs, "
                                 "expected fewer lines than pairs", SCAN_RULE)


# ------------------------------------------- 5.2 the scatter, the gather's mirror
SCATTER_CHANNELS = 4
SCATTER_TILES = (1, 2)  # tile 2: two threads per output, each with its own channels
UNWRITTEN = 1000.0  # out's content when has_init is false: what the memory held before
SCATTER_RULE = ("out[q, c] is (out[q, c] if has_init else 0) plus output q's partial results obuf[row, c] for "
                "the rows in out_table[q], summed in offset order. has_init says whether out holds the centre "
                "product F @ W[centre] already: when true the sum starts from it, when false out holds nothing "
                "yet (on a GPU, whatever the memory held) and the sum starts from 0")
OWNER_RULE = ("one thread per (channel tile, output), numbered like gather_v1's: thread t takes output "
              "q = t // tiles and tile t % tiles (neighbouring threads, neighbouring tiles of one output); it "
              "sums its channels in a register and writes each of them once. The scatter is output-stationary: "
              "no two threads write one output, so it needs no atomics")


@cuda.jit
def _scatter_from_zero(obuf, out_table, tile, has_init, out):
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


@cuda.jit
def _scatter_from_out(obuf, out_table, tile, has_init, out):
    """A plausible slip: the sum starts from ``out`` even when it holds no centre product."""
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        for c in range(c0, c0 + tile):
            acc = float32(out[q, c])  # should start from 0 unless has_init
            for k in range(out_table.shape[1]):
                row = out_table[q, k]
                if row >= 0:
                    acc += float32(obuf[row, c])
            out[q, c] = acc


@cuda.jit
def _scatter_with_atomics(obuf, out_table, tile, has_init, out):
    """A plausible slip: each partial result added with an atomic, as if several threads
    wrote one output."""
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        for c in range(c0, c0 + tile):
            if not has_init:
                out[q, c] = float32(0.0)
            for k in range(out_table.shape[1]):
                row = out_table[q, k]
                if row >= 0:
                    cuda.atomic.add(out, (q, c), float32(obuf[row, c]))


@cuda.jit
def _scatter_output_fastest(obuf, out_table, tile, has_init, out):
    """A plausible slip: threads numbered output-fastest (t = tile index * |Q| + q), so
    neighbouring threads take the same tile of neighbouring outputs."""
    t = cuda.grid(1)
    n_out = out.shape[0]
    if t < n_out * (out.shape[1] // tile):
        c0 = (t // n_out) * tile
        q = t - (t // n_out) * n_out
        for c in range(c0, c0 + tile):
            acc = float32(out[q, c]) if has_init else float32(0.0)
            for k in range(out_table.shape[1]):
                row = out_table[q, k]
                if row >= 0:
                    acc += float32(obuf[row, c])
            out[q, c] = acc


@cuda.jit
def _scatter_summing_in_out(obuf, out_table, tile, has_init, out):
    """A plausible slip: the sum kept in ``out`` itself, a global write per partial result."""
    t = cuda.grid(1)
    tiles = out.shape[1] // tile
    if t < out.shape[0] * tiles:
        q = t // tiles
        c0 = (t - q * tiles) * tile
        for c in range(c0, c0 + tile):
            if not has_init:
                out[q, c] = float32(0.0)
            for k in range(out_table.shape[1]):
                row = out_table[q, k]
                if row >= 0:
                    out[q, c] = float32(out[q, c]) + float32(obuf[row, c])


@exercise("5.2", "the scatter, the gather's mirror", answer="scatter_kernel",
          wrong=[Slip(_scatter_from_zero, says="has_init"), Slip(_scatter_from_out, says="has_init"),
                 Slip(_scatter_with_atomics, says="no atomics"), Slip(_scatter_output_fastest, says="gather_v1"),
                 Slip(_scatter_summing_in_out, says="writes each of them once")])
def check_scatter_kernel(scatter_kernel):
    """``scatter_kernel(obuf, out_table, tile, has_init, out)``, launched as the ladder
    launches ``scatter_v1`` (one thread per (tile, output)) under the recorder of
    :mod:`.races`, with tiles of 1 and 2 channels and ``has_init`` both ways (true:
    ``out`` holds a centre product; false: ``out`` holds 1000.0 everywhere, stale
    memory). No atomics, each ``out[q, c]`` written once by thread ``q * tiles + c //
    tile``, and the sums equal the scatter's reference."""
    from ...core.launch import THREADS, blocks_for
    from ...gmas.scatter import scatter_reference

    km, plan = crop_layer(1)
    rng = np.random.default_rng(5)
    obuf = rng.standard_normal((plan.rows, SCATTER_CHANNELS)).astype(np.float32)
    init = rng.standard_normal((len(km.out_coords), SCATTER_CHANNELS)).astype(np.float32)
    out_table = np.asarray(plan.out_table)
    for has_init in (True, False):
        want = scatter_reference(obuf, out_table, init if has_init else None)
        for tile in SCATTER_TILES:
            case = f"tile {tile}, has_init={has_init}"
            tiles = SCATTER_CHANNELS // tile
            out = init.copy() if has_init else np.full_like(init, UNWRITTEN)
            rec = recorded_launch(scatter_kernel, "scatter_kernel", blocks_for(len(out) * tiles), THREADS,
                                  {"obuf": obuf, "out_table": out_table, "tile": tile, "has_init": has_init,
                                   "out": out}, watch=("out",))
            atomics = rec.atomics("out")
            if atomics:
                a = min(atomics, key=lambda a: (a.element, rec.thread_id(a.block, a.thread)))
                raise ExerciseFailed(f"{case}: {len(atomics)} atomic operations on out, the first an {a.kind} of "
                                     f"out{list(a.element)} by {rec.who(a.block, a.thread)}; expected none",
                                     OWNER_RULE)
            expect_no_race(rec, OWNER_RULE)
            # fp32 sums in offset order are exact to the bit; a float64 accumulator is allowed
            expect_equal(out, want, f"{case}: out[q, c]", rule=SCATTER_RULE, atol=1e-4,
                         where=lambda qc: f"{int((out_table[qc[0]] >= 0).sum())} partial result(s)")
            writers = rec.writers("out")
            for q, c in np.ndindex(out.shape):
                who = writers.get((q, c), [])
                if who != [q * tiles + c // tile]:
                    raise ExerciseFailed(f"{case}: out[{q}, {c}] was written {_times(who)}; expected once, by "
                                         f"thread q * tiles + c // tile = {q * tiles + c // tile}", OWNER_RULE)


def _times(who):
    """How often and by whom an element was written: ``"twice, by thread 0 each time"``."""
    if not who:
        return "by no thread"
    often = {1: "once", 2: "twice"}.get(len(who), f"{len(who)} times")
    threads = sorted(set(who))
    by = f"thread {threads[0]}" if len(threads) == 1 else f"threads {threads}"
    return f"{often}, by {by}" + (" each time" if len(who) > 1 and len(threads) == 1 else "")


# --------------------------------------------------------- 5.3 per-point lists
LISTS_RULE = ("masks[n] has bit k set when table[n, k] >= 0; rows[n, :count] lists point n's rows in offset "
              "order (k increasing), then -1: the order the scatter sums in, which makes its result the same "
              "run after run")


def _lists_sorted_by_row(table):
    """A plausible slip: each point's rows sorted by value, not listed in offset order."""
    table = np.asarray(table)
    K = table.shape[1]
    masks = ((table >= 0).astype(np.int64) << np.arange(K, dtype=np.int64)).sum(axis=1)
    rows = np.sort(np.where(table >= 0, table, np.iinfo(np.int32).max), axis=1)
    return masks, np.where(rows == np.iinfo(np.int32).max, -1, rows).astype(np.int32)


def _lists_bits_reversed(table):
    """A plausible slip: offset k at bit K - 1 - k (the mask written as one reads it)."""
    table = np.asarray(table)
    K = table.shape[1]
    masks = ((table >= 0).astype(np.int64) << np.arange(K - 1, -1, -1, dtype=np.int64)).sum(axis=1)
    order = np.argsort(table < 0, axis=1, kind="stable")
    return masks, np.take_along_axis(table, order, axis=1).astype(np.int32)


@exercise("5.3", "per-point lists", answer="point_lists",
          wrong=[Slip(_lists_sorted_by_row, says="offset order"), Slip(_lists_bits_reversed, says="bit k")])
def check_point_lists(point_lists):
    """``point_lists(table) -> (masks, rows)`` on the crop's input and output tables, against
    :func:`numba_sc.gmas.layout.lists_from_table` (what rung v2 reads)."""
    from ...gmas.layout import lists_from_table

    _, plan = crop_layer(1)
    for name, table in (("in_table", plan.in_table), ("out_table", plan.out_table)):
        table = np.asarray(table)
        got = point_lists(np.array(table))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"point_lists returned {type(got).__name__}",
                                 "point_lists returns a pair (masks, rows)")
        lists = lists_from_table(table)
        expect_equal(np.asarray(got[0]).astype(np.int64), lists.masks[0], f"{name}: masks[n]", rule=LISTS_RULE,
                     where=lambda n: f"offsets with a pair: {np.flatnonzero(table[n[0]] >= 0).tolist()}")
        expect_equal(got[1], lists.rows, f"{name}: rows[n, s]", rule=LISTS_RULE,
                     where=lambda ns: f"point {ns[0]}'s pairs, offset: row, "
                                      + ", ".join(f"{k}: {table[ns[0], k]}" for k in np.flatnonzero(table[ns[0]] >= 0)))


# -------------------------------------------------------- 5.4 channels as words
WORDS_RULE = ("the widest signed word that the tile's tile * itemsize bytes are a whole number of: np.int64 "
              "(8 bytes), else np.int32 (4 bytes), with the tile's length in those words; (None, tile) when "
              "neither divides (the tile then moves channel by channel). The widest first: fewest loads")


def _eight_byte_words_only(itemsize, tile):
    """A plausible slip: only 8-byte words tried, so a fp16 tile of 2 channels (4 bytes)
    and an odd fp32 tile are moved channel by channel."""
    if tile * itemsize % 8 == 0:
        return np.int64, tile * itemsize // 8
    return None, tile


def _narrowest_first(itemsize, tile):
    """A plausible slip: 4-byte words tried first, twice the loads of 8-byte ones."""
    for word in (np.int32, np.int64):
        if tile * itemsize % np.dtype(word).itemsize == 0:
            return word, tile * itemsize // np.dtype(word).itemsize
    return None, tile


@exercise("5.4", "channels as words", answer="word_view",
          wrong=[Slip(_eight_byte_words_only, says="np.int32 (4 bytes)"), Slip(_narrowest_first, says="widest")])
def check_word_view(word_view):
    """``word_view(itemsize, tile) -> (word, tile in words)`` for fp16 and fp32 tiles of 1 to
    64 channels, against :func:`numba_sc.core.words.word_view` (what rung v4 launches with)."""
    from ...core.words import word_view as library

    def show(pair):
        word, n = pair
        return f"({'None' if word is None else np.dtype(word).name}, {n})"

    for itemsize in (2, 4):
        for tile in range(1, 65):
            got, want = word_view(itemsize, tile), library(itemsize, tile)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ExerciseFailed(f"word_view({itemsize}, {tile}) returned {got!r}",
                                     "word_view returns a pair (word, tile_in_words)")
            same_word = (got[0] is None) == (want[0] is None) and (
                want[0] is None or np.dtype(got[0]) == np.dtype(want[0]))
            if not same_word or got[1] != want[1]:
                name = "fp16" if itemsize == 2 else "fp32"
                raise ExerciseFailed(f"a {name} tile of {tile} channels ({tile * itemsize} bytes): got {show(got)}, "
                                     f"expected {show(want)}", WORDS_RULE)
