"""Stage 7, metadata tables: where every pair of the kernel map lives in the buffers.

The GMaS step (paper Section 2.2, Figure 2) multiplies, for every offset k, the
features of all inputs that feed some output through k by ``W[k]``. To do that
with a few big GEMMs, the gather copies those input rows into one *input buffer*
(offset by offset, groups padded to equal height, :mod:`numba_sc.gmas.gemm_grouping`),
the GEMMs write an *output buffer* of the same row layout, and the scatter sums
each output's partial results. All three need to know, for each pair, its
**buffer row**. That is what this stage computes, from the kernel map alone.

The layouts (defined here, used by gather, GEMM and scatter):

``order``
    The offsets in buffer order: by non-decreasing pair count (Minuet) or the
    map's order; offsets without pairs and the submanifold centre are left out.
``base[k]``
    First buffer row of offset k (``-1`` when k is not in the buffer). Inside a
    group of ``G`` offsets padded to ``R`` rows, member m starts at
    ``group.start + m * R``; its rows past ``counts[k]`` are padding.
buffer row of pair (k, i)
    ``base[k] + rank``, where ``rank`` counts the pairs of offset k whose output
    index is below i (so each offset's rows follow the output order: the GEMM
    reads and the scatter writes are as sequential as they can be).
input table ``in_table`` (|P| x K), int32
    ``in_table[j, k]`` = buffer row that input j is copied to for offset k, or -1.
output table ``out_table`` (|Q| x K), int32
    ``out_table[i, k]`` = buffer row holding output i's partial result through
    offset k, or -1.
the lists the kernels read (:class:`PointLists`)
    The two tables are how the layout is *defined* (and what the reference and
    the notebooks show), but on a sparse cloud most of their entries are -1:
    27 x 1M entries for ~0.4M pairs on 1M random voxels in 400^3. So the device
    keeps them compressed, PCEngine's way (its coded CSR; Minuet, Section 7,
    names it as combining with its own ideas): per point, a bit mask of the
    offsets it has a pair at, and its rows, one per set bit, in offset order.
    The gather and scatter threads then visit a point's real pairs only.
    ``plan.in_table`` and ``plan.out_table`` unpack the lists on demand.

The submanifold centre: with stride 1 and ``Q = P``, offset (0, 0, 0) maps every
point to itself, so its "gather" would copy the whole feature matrix in order.
Instead it is multiplied directly, ``out = F @ W[centre]``, and left out of the
buffers. It applies exactly when offset (0, 0, 0) exists and has
``|P| = |Q|`` pairs: then every output's own coordinate is an input, the two
sorted coordinate arrays are equal, and ``table[centre, i] == i``.

Worked example, 3 outputs, K = 2, max_padding 0 (so no grouping)::

    table (K x |Q|)   k=0: [ 1, -1,  0]      counts [2, 3]
                      k=1: [ 0,  1,  2]      order (by count): [0, 1]
    base = [0, 2]     rows of k=0: outputs 0, 2 -> rows 0, 1
                      rows of k=1: outputs 0, 1, 2 -> rows 2, 3, 4
    out_table (|Q| x K) = [[0, 2], [-1, 3], [1, 4]]
    in_table  (|P| x K) = [[1, 2], [0, 3], [-1, 4]]   (input 0 feeds output 2 via k=0)

The same example as lists (masks in binary, offset 0 the lowest bit)::

    out masks [0b11, 0b10, 0b11]   out rows: output 0 [0, 2], output 1 [3], output 2 [1, 4]
    in masks  [0b11, 0b11, 0b10]   in rows:  input 0  [1, 2], input 1  [0, 3], input 2  [4]

How the device finds the ranks. The plain way (:func:`metadata_v1`, v1 of this
stage's ladder, writes the dense tables from it) is a scan of ``table >= 0`` along
each offset's row, but a library scan over all K x |Q| entries is what used to
dominate this stage. Instead the outputs are cut
into *chunks* of ``CHUNK`` consecutive outputs (1024 on a GPU: 128 threads x 8
outputs each), and the rank is split in two parts:

1. ``counts2d`` (K x n_chunks), the pairs of offset k in chunk c. A map from the
   kernel path has them (``KernelMap.chunk_counts``: its forward search counted
   each pair where it found it); for any other map :func:`chunk_counts_kernel`
   counts them, one block per (k, c).
2. :func:`metadata_v2`, one block per (k, c): the pairs of k in the chunks
   before c (a sum over ``counts2d[k, :c]``) plus a scan over the block of the
   threads' own counts give each pair its rank; each thread walks its run of
   8 outputs again and writes each pair's row into its output's list and its
   input's list.

The same example in chunks of 2 outputs: ``counts2d = [[1, 1], [2, 1]]``, so
chunk 1's first pair has rank 1 in k=0 and rank 2 in k=1: output 2 (chunk 1) is
pair number 1 of k=0 (row 0 + 1 = 1) and pair number 2 of k=1 (row 2 + 2 = 4),
as above.

Where in a list a pair goes: its *slot* is the number of set bits below k in
the point's mask (counting only offsets in the buffers). So the lists need the
masks first. A layer's own map has them: ``build_kernel_map(..., masks=True)``,
which :func:`numba_sc.sparse_conv3d` asks for, has the forward search set bit k
of output i and of input j (an atomic OR) for every pair it finds; for any
other map :func:`masks_kernel` reads the table once to set them. Slots from
masks need no atomic counters, so every list comes out in offset order and a
plan is the same run after run.

GPU cost for K offsets, |Q| outputs and |P| inputs (int32 table; K = 27,
|Q| = |P| = 94k makes 4K|Q| = 10 MB):

* :func:`metadata_v2` reads the map twice (4K|Q| each; the K blocks of a chunk
  run together, so the second read and the other offsets' reads mostly hit the
  L2), ``counts2d`` and, per pair, one mask word of its output and of its input
  (8 B each), and writes 4 bytes per pair into each side's list.
* (``masks_kernel``, only for a map without masks: reads the map once and
  writes 8 bytes per point and side.)

About 8K|Q| + 24 bytes a pair: ~25 MB for 94k points, ~230 MB for 1M, against
~430 MB when this stage wrote the dense (K, N) tables (and the gather and
scatter then read all of them: 4K|P| + 4K|Q| more per channel tile). These are
estimates from bytes moved; the kernel is in fact bound by its instruction
issue rate (index arithmetic and the block scan), which is why it is compiled
per K and block size with unsigned indices (:func:`metadata_v2`). The only
device->host copy is the K pair counts, which the host needs anyway to size the
buffers and shape the GEMMs; the base rows go the other way through pinned
memory, without a sync.

Layout of this module:

* the plan: :class:`PointLists`, :class:`GmasPlan`, and the host part
  (``_layout``: counts -> order, groups, base rows; the submanifold centre);
* reference: :func:`build_plan_reference` (NumPy, the tables as defined above);
* the ladder (``python -m numba_sc ladder metadata``):

  - v1 :func:`metadata_v1` / :func:`build_tables_v1`: a library scan over all
    K x |Q| entries, then dense tables;
  - v2 :func:`metadata_v2` / :func:`build_plan_cuda`: chunk counts from the
    forward search, a block scan, packed lists; compiled per K and block size.
    What it bought on the SemanticKITTI scan, one 3x3x3 layer, is recorded in
    ``benchmarks/results/ladder_all_kitti.json``
    (``numba_sc.tools.lesson.bought("metadata")``);

* the launcher: :func:`build_plan` (the reference or the device version, by backend).

Measured figures and their history: ``docs/performance.md``, "gmas/metadata.py".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from numba import cuda, int32, int64, uint64

from . import gemm_grouping as gg
from ..core.conventions import ITEMS_PER_THREAD, MASK_BITS, chunk_size, mask_words, metadata_threads
from ..core.device import device_xp, simulating
from ..core.backend import filled, resolve_backend, to_device, to_device_async, to_host
from ..core.pieces import as_array, piece
from ..core.launch import launch
from ..core.rungs import Ladder, Rung


@dataclass
class PointLists:
    """Every point's buffer rows, packed: ``rows[n, :count[n]]`` (the rest unspecified).

    The compact form of an input or output table (PCEngine's idea of keeping the
    kernel map as compressed rows; Minuet names it as one that combines with its
    own, Section 7). A thread of the gather or scatter visits only the pairs its
    point really has, instead of all K entries of a dense table row, most of
    them -1 on a sparse cloud (2 in 3 points of 1M random voxels in 400^3 have no
    pair outside the centre).

    Three arrays:

    ``masks`` int64 (W, N), W = ceil(K / MASK_BITS)
        bit ``k % 32`` of ``masks[k // 32, n]`` set when point n has a pair
        through offset k (set by the forward search where it found the pair);
    ``buffered`` int64 (W,)
        the same bits for the offsets that are in the buffers (not the centre
        multiplied directly, not the offsets without pairs). A point's entries
        are its pairs at offsets with both bits set, **in offset order**: the
        scatter sums in that order (the same result run after run), and the
        threads of a warp, walking their points' offsets in step, write (gather)
        or read (scatter) the rows of one offset at the same time - for
        neighbouring points, neighbouring rows;
    ``slots`` int32 (K, N)
        ``slots[s, n]`` = point n's entry s, for s below its count (the rest is
        never written). Slot-major because the threads of a warp work on
        neighbouring points and read entry s of each at about the same time:
        neighbouring addresses. In the (N, K) layout they lay K * 4 bytes apart,
        a memory sector each.
    """

    slots: object
    masks: object
    buffered: object

    @property
    def rows(self):
        """int32 (N, K) view: ``rows[n, :count[n]]`` are point n's buffer rows."""
        return as_array(self.slots).T

    @property
    def count(self):
        """int32 (N,): entries of each point (the set bits of ``masks & buffered``;
        computed on demand, for reading: the kernels use the bits)."""
        m = as_array(self.masks) & as_array(self.buffered).reshape(-1, 1)
        xp = np if isinstance(m, np.ndarray) else device_xp()
        bits = (m[:, :, None] >> xp.arange(MASK_BITS, dtype=np.int64)) & 1
        return bits.sum(axis=(0, 2)).astype(np.int32)

    def __len__(self):
        return int(self.masks.shape[1])  # (a piece has a shape too)


def masks_from_hits(hit):
    """bool (K, N) -> int64 (ceil(K / MASK_BITS), N): bit ``k % 32`` of word ``k // 32``
    of column n set where ``hit[k, n]``."""
    xp = np if isinstance(hit, np.ndarray) else device_xp()
    K, n = hit.shape
    W = mask_words(K)
    padded = xp.zeros((W * MASK_BITS, n), dtype=np.int64)
    padded[:K] = hit
    return (padded.reshape(W, MASK_BITS, n) << xp.arange(MASK_BITS, dtype=np.int64)[:, None]).sum(axis=1)


def lists_from_table(table) -> PointLists:
    """A dense (N, K) table of rows or -1 -> :class:`PointLists` in offset order
    (either array kind): every offset counts as buffered."""
    xp = device_xp() if not isinstance(table, np.ndarray) else np
    table = xp.asarray(table)
    K = table.shape[1]
    k = xp.arange(K, dtype=np.int32)
    # valid entries first, each group in offset order: sort by (missing, k)
    key = xp.where(table >= 0, k[None, :], K + k[None, :])
    rows = xp.take_along_axis(table, xp.argsort(key, axis=1), axis=1)
    masks = masks_from_hits((table >= 0).T)
    buffered = masks_from_hits(xp.ones((K, 1), dtype=bool))[:, 0]
    return PointLists(xp.ascontiguousarray(rows.T.astype(np.int32)), masks, buffered)


def as_point_lists(lists_or_table) -> PointLists:
    """A plan's :class:`PointLists` as they are; a dense (N, K) table of rows or -1
    (host or device) packed into lists on the device (:func:`lists_from_table`)."""
    if isinstance(lists_or_table, PointLists):
        return lists_or_table
    return lists_from_table(to_device(lists_or_table))


def table_from_lists(lists: PointLists, row_offset, K: int):
    """The dense (N, K) table again: ``table[n, row_offset[r]] = r`` for each row r of
    point n, -1 elsewhere. ``row_offset`` (rows,) is the offset of each buffer row."""
    count, rows = lists.count, lists.rows
    xp = np if isinstance(count, np.ndarray) else device_xp()
    n_pts = int(count.shape[0])
    table = xp.full((n_pts, K), -1, dtype=np.int32)
    if n_pts and K:
        n, s = xp.nonzero(xp.arange(K)[None, :] < count[:, None])
        r = rows[n, s]
        table[n, xp.asarray(row_offset)[r]] = r
    return table


@dataclass
class GmasPlan:
    """Everything the gather, GEMMs and scatter need for one layer."""

    counts: np.ndarray  # host int64 (K,): pairs per offset
    order: np.ndarray  # host int64: offsets in buffer order (no empty ones, no centre)
    groups: list  # list of gemm_grouping.Group, laid out back to back
    base: np.ndarray  # host int64 (K,): first buffer row of each offset, or -1
    rows: int  # buffer rows, padding included
    centre: int  # offset multiplied directly (submanifold), or -1
    in_lists: PointLists  # each input's buffer rows (host or device)
    out_lists: PointLists  # each output's buffer rows, in offset order (host or device)
    policy: tuple = (gg.DEFAULT_MAX_PADDING, gg.DEFAULT_SOLO_ROWS, 0)  # (max_padding, solo_rows, launch_rows)
    _report: dict = field(default=None, repr=False)
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def launches(self) -> int:
        return len(self.groups)

    @property
    def n_in(self) -> int:
        return len(self.in_lists)

    @property
    def n_out(self) -> int:
        return len(self.out_lists)

    @property
    def row_offset(self) -> np.ndarray:
        """Host int64 (rows,): the offset each buffer row belongs to, -1 for padding."""
        ro = np.full(self.rows, -1, dtype=np.int64)
        for k in self.order:  # offset k's pairs fill rows base[k] .. base[k] + counts[k] - 1
            ro[self.base[k]:self.base[k] + self.counts[k]] = k
        return ro

    def _table(self, side):
        if side not in self._tables:
            lists = self.in_lists if side == "in" else self.out_lists
            self._tables[side] = table_from_lists(lists, self.row_offset, len(self.counts))
        return self._tables[side]

    @property
    def in_table(self):
        """Input table (|P|, K): ``in_table[j, k]`` = the buffer row input j is copied
        to for offset k, or -1. The dense view of ``in_lists``, made on first use."""
        return self._table("in")

    @property
    def out_table(self):
        """Output table (|Q|, K): ``out_table[i, k]`` = the buffer row of output i's
        partial result through offset k, or -1. The dense view of ``out_lists``."""
        return self._table("out")

    def transposed(self) -> "GmasPlan":
        """The plan of the transposed convolution that reads this plan's map backwards.

        A pair (input p, output q, offset k) of the map is, for the transposed
        layer, a pair from q to p through the same weight ``W[k]``. It keeps its
        buffer row: the gather copies q's features to the rows of q's list (the
        output lists here), the same grouped GEMMs multiply them by the same
        ``W[k]``, and the scatter sums the rows of p's list (the input lists here)
        into p. So nothing is built: the two lists change roles. A submanifold
        centre stays the centre (it maps every point to itself either way).
        """
        return GmasPlan(self.counts, self.order, self.groups, self.base, self.rows, self.centre,
                        self.out_lists, self.in_lists, self.policy, self._report,
                        {{"in": "out", "out": "in"}[s]: t for s, t in self._tables.items()})

    @property
    def report(self) -> dict:
        """:func:`numba_sc.gmas.gemm_grouping.padding_report` of this layer (sorted vs map
        order). Made on first use: it groups the offsets twice more, Python work
        on the host that a layer in a network does not need."""
        if self._report is None:
            self._report = gg.padding_report(self.counts, self.centre, *self.policy)
        return self._report


def _host_counts(kernel_map) -> np.ndarray:
    """The map's pair counts on the host: a :class:`numba_sc.KernelMap` from the kernel
    path already holds them (read with its report); anything else is read here."""
    if hasattr(kernel_map, "host_counts"):
        return kernel_map.host_counts()
    return np.asarray(to_host(kernel_map.counts), dtype=np.int64)


def submanifold_centre(kernel_map, counts=None) -> int:
    """Index of the offset (0, 0, 0) when it maps every point to itself, else -1.

    ``counts``: the map's pair counts already on the host (saves a device read).
    Remembered on the map (a layer asks twice: to queue the centre product, and
    for the buffer layout).
    """
    known = getattr(kernel_map, "known_centre", None)
    if known is not None:
        return known
    c = centre_offset(kernel_map)
    if c >= 0:
        n_in, n_out = len(kernel_map.in_coords), len(kernel_map.out_coords)
        counts = _host_counts(kernel_map) if counts is None else counts
        if not n_in == n_out == int(counts[c]):
            c = -1
    try:
        kernel_map.known_centre = c
    except AttributeError:  # a map-like object that takes no new attribute: ask again next time
        pass
    return c


def centre_offset(kernel_map) -> int:
    """Index of the offset (0, 0, 0) among the map's offsets, or -1; needs no counts."""
    offsets = np.asarray(to_host(kernel_map.offsets))
    return _zero_offset(offsets.shape, offsets.dtype.str, offsets.tobytes())


@lru_cache(maxsize=256)
def _zero_offset(shape, dtype: str, raw: bytes) -> int:
    """Index of the row (0, 0, 0) of the offsets of ``shape`` and ``dtype`` whose bytes
    are ``raw``, or -1; remembered per content (a layer asks the same every call,
    and the NumPy test costs several times the host time of the cache's look-up)."""
    rows = np.flatnonzero((np.frombuffer(raw, dtype=dtype).reshape(shape) == 0).all(axis=1))
    return int(rows[0]) if len(rows) else -1


def grouping_report(kernel_map, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0) -> dict:
    """Padding overhead and GEMM launches of a layer, offsets sorted vs map order.

    See :func:`numba_sc.gmas.gemm_grouping.padding_report`; the submanifold centre (when
    multiplied directly) is in neither count.
    """
    centre = submanifold_centre(kernel_map) if direct_centre else -1
    return gg.padding_report(_host_counts(kernel_map), centre, max_padding, solo_rows, launch_rows)


def _layout(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows=0):
    """Host part: counts -> order, groups, base rows.

    Plain Python on lists of K ints: every layer runs it between the Map step's
    read and its next launch, while the GPU waits, and on K = 27 numbers a list
    beats NumPy calls.
    """
    counts = _host_counts(kernel_map)  # read with the Map step's report: no device read here
    centre = submanifold_centre(kernel_map, counts) if direct_centre else -1
    c = counts.tolist()
    order = gg.offset_order_list(c, sort, centre)
    groups = gg.make_groups(c, order, max_padding, solo_rows, launch_rows)
    base = [-1] * len(c)
    for g in groups:
        row = g.start
        for k in g.members:
            base[k] = row
            row += g.rows
    last = groups[-1] if groups else None
    rows = last.start + last.padded_rows if last else 0  # groups lie back to back
    return (counts, np.array(order, dtype=np.int64), groups, np.array(base, dtype=np.int64), rows,
            centre, (max_padding, solo_rows, launch_rows))


def _device_layout(base):
    """``base`` and :func:`buffered_bits` in one int64 array, copied to the device
    at once (one pinned copy), handed out as two pieces.

    On a GPU the pair is kept per distinct ``base`` (K numbers; kernels only read
    it): the layers of a network that share a kernel map share it too, and a
    pinned copy costs far more host time than a dictionary look-up (measured:
    ``docs/performance.md``, "Caches: work done once per layer, not per call").
    """
    K = len(base)
    values = base.tolist()
    key = None if simulating() else (tuple(values), device_xp().cuda.runtime.getDevice())
    hit = _LAYOUTS.get(key)
    if hit is None:
        bits = buffered_bits(base)
        layout = to_device_async(np.array(values + bits, dtype=np.int64))
        hit = piece(layout, 0, (K,), np.int64), piece(layout, 8 * K, (len(bits),), np.int64)
        if key is not None:
            if len(_LAYOUTS) > 256:
                _LAYOUTS.clear()
            _LAYOUTS[key] = hit
    return hit


_LAYOUTS = {}  # (base values, device) -> (base, buffered bits) on that device


# ------------------------------------------------------------------ reference
def build_plan_reference(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                         solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0) -> GmasPlan:
    """NumPy version: the plain per-offset scan, then fancy-indexed writes instead of a kernel."""
    counts, order, groups, base, rows, centre, policy = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    table = np.asarray(to_host(kernel_map.table))
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    rank = np.cumsum(table >= 0, axis=1) - 1  # pairs of offset k before output i
    kk, ii = np.nonzero((table >= 0) & (base[:, None] >= 0))
    rows_of_pair = (base[kk] + rank[kk, ii]).astype(np.int32)
    out_table = np.full((n_out, K), -1, dtype=np.int32)
    in_table = np.full((n_in, K), -1, dtype=np.int32)
    out_table[ii, kk] = rows_of_pair
    in_table[table[kk, ii], kk] = rows_of_pair
    buffered = np.array(buffered_bits(base), dtype=np.int64)
    plan = GmasPlan(counts, order, groups, base, rows, centre, _ref_lists(in_table, buffered),
                    _ref_lists(out_table, buffered), policy)
    plan._tables.update(out=out_table, **{"in": in_table})  # the dense views, already made
    return plan


def _ref_lists(dense, buffered):
    """The reference's lists of a dense (N, K) table, with the layer's buffered bits."""
    lists = lists_from_table(dense)
    return PointLists(lists.slots, lists.masks, buffered)


def chunk_counts_reference(table, chunk: int) -> np.ndarray:
    """``counts2d`` int32 (K, n_chunks): pairs of offset k among outputs
    ``c * chunk : (c + 1) * chunk`` (the last chunk may be short)."""
    table = np.asarray(to_host(table))
    K, n_out = table.shape
    n_chunks = -(-n_out // chunk)
    hit = np.zeros((K, n_chunks * chunk), dtype=bool)  # padded with "no pair"
    hit[:, :n_out] = table >= 0
    return hit.reshape(K, n_chunks, chunk).sum(axis=2).astype(np.int32)


def masks_reference(table, n_in):
    """``(out_masks, in_masks)``, int64 (W, |Q|) and (W, |P|): bit ``k % MASK_BITS`` of
    word ``k // MASK_BITS`` of output i set when ``table[k, i] >= 0``, of input j
    when some ``table[k, i] == j`` (what :func:`masks_kernel` and the forward
    search write)."""
    table = np.asarray(to_host(table))
    K = table.shape[0]
    in_hit = np.zeros((K, n_in), dtype=bool)
    kk, ii = np.nonzero(table >= 0)
    in_hit[kk, table[kk, ii]] = True
    return masks_from_hits(table >= 0), masks_from_hits(in_hit)


def chunk_rank_reference(counts2d) -> np.ndarray:
    """Rank of each chunk's first pair within its offset: ``counts2d[k, :c].sum()``,
    what each block of :func:`metadata_v2` adds up for itself. It equals
    ``rank[k, c * chunk]`` of the plain per-offset scan."""
    counts2d = np.asarray(counts2d, dtype=np.int64)
    return np.cumsum(counts2d, axis=1) - counts2d


# ------------------------------------------------------------------------- v1
@cuda.jit
def metadata_v1(table, rank, base, out_table, in_table):
    """v1: one thread per entry (k, i) of the map; a pair writes its buffer row into
    both dense tables.

    ``rank[k, i]`` is the library's inclusive scan of ``table[k] >= 0`` (so the
    pair's rank is one less), ``base[k]`` the offset's first row (-1: not in the
    buffers). ``out_table`` (|Q|, K) and ``in_table`` (|P|, K) are filled with -1
    beforehand. This is the "plain way" of the module docstring, as the layouts
    define it.
    """
    t = cuda.grid(1)
    K, n_out = table.shape
    if t < K * n_out:
        k = t // n_out
        i = t - k * n_out  # neighbouring threads: neighbouring outputs of one offset
        j = table[k, i]
        if j >= 0 and base[k] >= 0:
            row = base[k] + rank[k, i] - 1
            out_table[i, k] = row
            in_table[j, k] = row


def build_tables_v1(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0):
    """v1 on the device: the layout on the host, a library scan over all K x |Q|
    entries, :func:`metadata_v1`; returns ``(out_table, in_table)``, dense (N, K).

    What v2 (the library's :func:`build_plan_cuda`) changes, and why:

    * **no library scan**: a scan over all K x |Q| entries is most of v1's time.
      v2 cuts the outputs into chunks, takes each chunk's pair
      counts from the forward search (which counted them where it found the
      pairs) and scans only inside a block;
    * **lists, not tables**: v1's tables are mostly -1 on a sparse cloud, and the
      gather and scatter would read every entry (v1 of their ladders does). v2
      writes each point's rows once, packed in offset order behind a bit mask
      (the masks, too, come from the forward search), so they read only the
      pairs;
    * **compiled per K and block size, unsigned indices**: far fewer instructions
      for the same work (:func:`metadata_v2` says why).
    """
    base = _layout(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)[3]
    xp = device_xp()
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    rank = xp.cumsum(table >= 0, axis=1, dtype=np.int32)
    out_table = filled((n_out, K), np.int32, -1)
    in_table = filled((n_in, K), np.int32, -1)
    if K * n_out:
        launch(metadata_v1, K * n_out, table, rank, to_device(base), out_table, in_table)
    return out_table, in_table


# -------------------------------------------------------------------- kernels
# A chunk is CHUNK = threads * ITEMS_PER_THREAD consecutive outputs of one offset;
# thread t of its block owns the ITEMS_PER_THREAD outputs starting at
# chunk start + t * ITEMS_PER_THREAD.
MAX_THREADS = 128  # size of the shared arrays below (a compile-time constant)


def _check_threads(threads: int) -> int:
    # The tree reduction halves the active threads each step, so it needs a power
    # of two; the shared arrays hold MAX_THREADS entries.
    if not (0 < threads <= MAX_THREADS and threads & (threads - 1) == 0):
        raise ValueError(f"threads must be a power of two up to {MAX_THREADS}, got {threads}")
    return threads


@cuda.jit(device=True)
def _thread_range(c, chunk, n_out):
    """Outputs ``lo:hi`` of this thread in chunk ``c`` (empty past the last output).
    (A chunk is always ``blockDim.x * ITEMS_PER_THREAD`` outputs: the constant
    saves every thread a division.)"""
    lo = c * chunk + cuda.threadIdx.x * ITEMS_PER_THREAD
    return lo, min(lo + ITEMS_PER_THREAD, n_out)


@cuda.jit(device=True)
def _hits(table, k, lo, hi):
    """Pairs of offset k among outputs ``lo:hi``."""
    n = 0
    for i in range(lo, hi):
        if table[k, i] >= 0:
            n += 1
    return n


@cuda.jit
def chunk_counts_kernel(table, chunk, counts2d):
    """One block per (offset k, chunk c): ``counts2d[k, c]`` = pairs of k in chunk c.

    Thread t counts its 8 outputs: 32 contiguous bytes of the table, one memory
    sector, so the block reads its 4 KB piece of row k once and in full. Blocks
    are numbered with k varying fastest (block = c * K + k), as in
    :func:`metadata_v2`.
    """
    K = table.shape[0]
    k = cuda.blockIdx.x % K
    c = cuda.blockIdx.x // K
    t = cuda.threadIdx.x
    lo, hi = _thread_range(c, chunk, table.shape[1])
    partial = cuda.shared.array(MAX_THREADS, int32)
    partial[t] = _hits(table, k, lo, hi)
    cuda.syncthreads()  # every thread's count is in before thread 0 adds them up
    if t == 0:
        # A sequential sum: one number per block, read back once.
        total = 0
        for u in range(cuda.blockDim.x):
            total += partial[u]
        counts2d[k, c] = total




AHEAD = 8  # table entries a thread reads before testing the first of them


@cuda.jit
def masks_kernel(table, out_masks, in_masks):
    """One thread per output i: which offsets have a pair at i, and at its inputs.

    ``out_masks[w, i]`` gets bit ``b`` when ``table[32 w + b, i] >= 0``, and the
    input ``j`` of that pair gets the same bit in ``in_masks[w, j]`` (zeroed
    beforehand; an atomic OR, as other threads set other bits of j's word). A
    map from the kernel path comes with its masks (the forward search set the
    bits where it found the pairs); this pass is for maps from elsewhere.
    Neighbouring threads read neighbouring entries of each table row
    (offset-major): one coalesced read of the table. The reads come AHEAD at a
    time, all issued before the first is tested, so that a thread waits for
    memory once per AHEAD offsets instead of once per offset.
    """
    i = cuda.grid(1)
    K = table.shape[0]
    if i < table.shape[1]:
        ahead = cuda.local.array(AHEAD, int32)
        m = 0
        for k0 in range(0, K, AHEAD):
            for u in range(AHEAD):  # a constant-length loop: unrolled, loads in flight together
                ahead[u] = table[k0 + u, i] if k0 + u < K else -1
            for u in range(AHEAD):
                k = k0 + u
                if ahead[u] >= 0:
                    bit = 1 << (k % MASK_BITS)
                    m |= bit
                    cuda.atomic.or_(in_masks, (k // MASK_BITS, ahead[u]), bit)
                if k < K and (k % MASK_BITS == MASK_BITS - 1 or k == K - 1):
                    out_masks[k // MASK_BITS, i] = m  # the word is complete
                    m = 0


@lru_cache(maxsize=None)
def metadata_v2(K: int, threads: int):
    """The lists kernel compiled for K offsets and blocks of ``threads`` threads.

    One block per (offset k, chunk c): the buffer rows of the pairs of k in chunk
    c, written into the lists of their input and output.

    Blocks are numbered with k varying fastest (block = c * K + k), so the K
    blocks of a chunk run at about the same time and read the same part of the
    table: what one reads, the others find in the L2 cache.

    1. Rank: each thread counts the pairs of k among its run of 8 outputs, and
       turns the counts into the rank of its first pair within offset k (ranks
       rise in output order: the block owns consecutive outputs, each thread a
       contiguous run of them). That rank is the pairs of k in the chunks before
       c (``counts2d[k, :c].sum()``: each thread adds a strided share into
       ``first[0]``) plus the pairs of the threads before this one: an exclusive
       scan of the counts over the block, done as a Hillis-Steele scan in shared
       memory - log2(threads) steps, in step d every thread adds the value d
       places before it.
    2. Row: pair number ``rank`` of offset k gets row ``base[k] + rank``.
    3. Lists: pair (k, i, j) goes to the slot of output i's list and of input j's
       that counts the buffered offsets below k in the point's mask
       (``buffered``: the bits of the offsets in the buffers). Both lists come out
       in offset order, whichever block runs first, with no atomics and no
       counters to zero.

    ``base[k]`` is the same for the whole block, so a block whose offset is not
    in the buffers leaves together, before any barrier.

    Why compiled per (K, threads), with unsigned indices: this kernel is bound by
    its instruction issue, and besides the work it spent instructions on a 64-bit
    division of the block index by a run-time K, another by the run-time block
    size in the share loop, and, on every table, mask and slot access, 64-bit
    index arithmetic including the few instructions Numba adds to wrap a
    negative *signed* index around. With K, the block size and the chunk
    compile-time constants and every index unsigned (NumPy unsigned constants
    keep Numba's arithmetic unsigned: a signed-unsigned mix would be float64),
    each of those is gone. Why a scan, not one thread adding up the block's
    counts one by one: in the serial loop one lane of the warp works while the
    others wait.

    v2 of this stage's ladder (v1: :func:`metadata_v1`). What it bought on the
    SemanticKITTI scan, one 3x3x3 layer: ``python -m numba_sc ladder metadata``,
    recorded in ``benchmarks/results/ladder_all_kitti.json``.
    """
    k_count, items = np.uint64(K), np.uint64(ITEMS_PER_THREAD)
    step, chunk = np.uint64(threads), np.uint64(threads * ITEMS_PER_THREAD)
    bits = np.uint64(MASK_BITS)
    log_threads = threads.bit_length() - 1  # threads is a power of two

    @cuda.jit(device=True)
    def slot(masks, buffered, k, n):
        """Entries of point n before offset k: its buffered offsets below k with a
        pair (popcounts of its mask words), i.e. where pair (k, n) goes in n's list."""
        w = k // bits
        below = (1 << int64(k % bits)) - 1
        s = cuda.popc(masks[w, n] & buffered[w] & below)
        for v in range(w):
            s += cuda.popc(masks[v, n] & buffered[v])
        return uint64(s)

    @cuda.jit
    def lists(table, counts2d, base, buffered, out_masks, in_masks, in_slots, out_slots):
        k = uint64(cuda.blockIdx.x) % k_count  # constant divisor: a multiply and a shift
        c = uint64(cuda.blockIdx.x) // k_count
        first_row = base[k]
        if first_row < 0:
            return  # no pairs, or the centre multiplied directly
        t = uint64(cuda.threadIdx.x)
        lo = c * chunk + t * items  # this thread's outputs: lo .. lo + 7, those below n_out
        n_out = uint64(table.shape[1])
        row = table[k]  # offset k's entries, indexed from here on
        n_hits = 0
        for u in range(items):  # a constant trip count: unrolled
            if lo + u < n_out and row[lo + u] >= 0:
                n_hits += 1
        # -- the rank of this thread's first pair
        scan = cuda.shared.array(MAX_THREADS, int32)
        first = cuda.shared.array(1, int32)
        share = 0
        for cc in range(t, c, step):
            share += counts2d[k, cc]
        if cuda.threadIdx.x == 0:
            first[0] = 0
        scan[t] = n_hits
        cuda.syncthreads()  # first[0] is zeroed, every count is in
        if share > 0:
            cuda.atomic.add(first, 0, share)
        for e in range(log_threads):  # inclusive scan: scan[t] = n_hits of threads 0..t
            d = np.uint64(1) << uint64(e)
            v = scan[t - d] if t >= d else 0
            cuda.syncthreads()  # everyone has read before anyone writes
            scan[t] += v
            cuda.syncthreads()  # ... and written before the next step reads
        if log_threads == 0:
            cuda.syncthreads()  # (no step ran: the share's atomic must still land first)
        rank = first[0] + scan[t] - n_hits
        # -- the rows, into both lists
        for u in range(items):  # the same outputs again: likely still cached
            i = lo + u
            if i < n_out:
                j = row[i]
                if j >= 0:
                    r = first_row + rank
                    rank += 1
                    out_slots[slot(out_masks, buffered, k, i), i] = r
                    in_slots[slot(in_masks, buffered, k, uint64(j)), uint64(j)] = r

    return lists


def masks_cuda(table, n_in):
    """``(out_masks, in_masks)`` of a map's table (kernel; see :func:`masks_reference`)."""
    table = to_device(table)
    K, n_out = table.shape
    W = mask_words(K)
    out_masks = device_xp().empty((W, n_out), dtype=np.int64)  # every word is written
    in_masks = filled((W, n_in), np.int64, 0)  # bits are ORed in
    if n_out:
        launch(masks_kernel, n_out, table, out_masks, in_masks)
    return out_masks, in_masks


def buffered_bits(base) -> list:
    """ceil(K / MASK_BITS) ints: bit k % 32 of word k // 32 set when offset k is in the
    buffers (``base[k] >= 0``). A Python loop over K numbers: less host time than
    the NumPy calls it would take."""
    bits = [0] * mask_words(len(base))
    for k in np.flatnonzero(np.asarray(base) >= 0).tolist():
        bits[k // MASK_BITS] |= 1 << (k % MASK_BITS)
    return bits


def chunk_counts_cuda(table, threads: int | None = None):
    """``counts2d`` int32 (K, n_chunks): pairs of each offset in each chunk (kernel)."""
    threads = _check_threads(threads or metadata_threads())
    chunk = chunk_size(threads)
    table = to_device(table)
    K, n_out = table.shape
    n_chunks = -(-n_out // chunk)
    counts2d = device_xp().empty((K, n_chunks), dtype=np.int32)  # every entry is written
    launch(chunk_counts_kernel, K * n_chunks, table, chunk, counts2d,
           threads=threads, blocks=K * n_chunks)
    return counts2d


def build_plan_cuda(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True,
                    threads: int | None = None, launch_rows=0) -> GmasPlan:
    """Device version: the lists, one kernel and no sync (plus, for a map that did not
    come with them, a pass for the pair counts per chunk and one for the masks).

    ``threads``: threads per block, so chunks of ``threads * ITEMS_PER_THREAD``
    outputs (default :func:`metadata_threads`; the tests vary it).
    """
    counts, order, groups, base, rows, centre, policy = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    threads = _check_threads(threads or metadata_threads())
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    chunk = chunk_size(threads)
    counts2d = getattr(kernel_map, "chunk_counts", None)  # counted by the forward search
    out_masks = getattr(kernel_map, "out_masks", None)  # ... and so were these
    in_masks = getattr(kernel_map, "in_masks", None)
    if counts2d is None or getattr(kernel_map, "chunk", None) != chunk:
        counts2d = chunk_counts_cuda(table, threads)  # a map from elsewhere: count them here
    if out_masks is None or in_masks is None:
        out_masks, in_masks = masks_cuda(table, n_in)
    d_base, buffered = _device_layout(base)
    # Slots past a point's count are never written nor read: no fill. K per point
    # is what a point could need at most; the memory is reserved, not touched.
    # One allocation for both sides, two pieces of it.
    slots = device_xp().empty(K * (n_in + n_out), dtype=np.int32)
    in_slots = piece(slots, 0, (K, n_in), np.int32)
    out_slots = piece(slots, 4 * K * n_in, (K, n_out), np.int32)
    if counts2d.size:
        launch(metadata_v2(K, threads), counts2d.size, table, counts2d, d_base, buffered, out_masks,
               in_masks, in_slots, out_slots, threads=threads, blocks=counts2d.size)
    return GmasPlan(counts, order, groups, base, rows, centre, PointLists(in_slots, in_masks, buffered),
                    PointLists(out_slots, out_masks, buffered), policy)


def build_plan(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
               solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, backend=None,
               launch_rows=0) -> GmasPlan:
    """Metadata of one layer from its kernel map (see the module docstring).

    ``sort=False`` keeps the map's offset order (to measure what sorting buys);
    ``direct_centre=False`` sends the submanifold centre through the buffers too;
    ``launch_rows``: padding rows a GEMM launch is worth
    (:func:`numba_sc.gmas.gemm_grouping.launch_rows`; 0: the plain padding policy).
    """
    if resolve_backend(backend) == "reference":
        return build_plan_reference(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    return build_plan_cuda(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows=launch_rows)


# -------------------------------------------------------------------- the ladder
def _dense_tables(result):
    """A plan's dense tables (made from its lists), or v1's ``(out_table, in_table)``, as
    one host array."""
    out_table, in_table = (result.out_table, result.in_table) if isinstance(result, GmasPlan) else result
    return np.concatenate([to_host(out_table).ravel(), to_host(in_table).ravel()])


LADDER = Ladder(
    "metadata",
    (Rung("v1", lambda w: build_tables_v1(w["km"]),
          "dense tables: a library scan over all K x |Q| entries, one thread per entry"),
     Rung("v2", lambda w: build_plan_cuda(w["km"]),
          "+ chunks counted by the search, a scan inside each block, per-point lists (the library's)")),
    workload=lambda ctx: {"km": ctx.layer()["km"]},  # one 3x3x3 submanifold layer's map
    reference=lambda w: _dense_tables(build_plan_reference(w["km"])),
    collect=_dense_tables,
)
