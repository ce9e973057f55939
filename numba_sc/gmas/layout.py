"""The buffer layout of the GMaS step: the plan stage 7 hands to stages 8-10.

The metadata stage (:mod:`numba_sc.gmas.metadata`) gives every pair of the
kernel map a row of the GEMMs' buffers; the gather (:mod:`numba_sc.gmas.gather`)
copies inputs to those rows, the grouped GEMMs (:mod:`numba_sc.gmas.gemm_grouping`)
multiply them, the scatter (:mod:`numba_sc.gmas.scatter`) sums them into the
outputs. This module holds what they share, so that each imports it and none
imports another's driver: the plan (:class:`GmasPlan`), the per-point lists the
kernels read (:class:`PointLists`) and the host part that lays the offsets out.

The layouts (paper Section 2.2, Figure 2):

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

The submanifold centre (:func:`submanifold_centre`): with stride 1 and ``Q = P``,
offset (0, 0, 0) maps every point to itself; it is multiplied directly and left
out of the buffers (:mod:`numba_sc.gmas.metadata` says when it applies).

Worked example (the one of :mod:`numba_sc.gmas.metadata`): 3 outputs, K = 2,
counts ``[2, 3]``, no grouping: ``order = [0, 1]``, ``base = [0, 2]``, 5 rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import gemm_grouping as gg
from ..core.backend import to_device, to_host
from ..core.conventions import MASK_BITS, mask_words
from ..core.device import device_xp
from ..core.pieces import as_array
from ..core.state import cached


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



def buffered_bits(base) -> list:
    """ceil(K / MASK_BITS) ints: bit k % 32 of word k // 32 set when offset k is in the
    buffers (``base[k] >= 0``). A Python loop over K numbers: less host time than
    the NumPy calls it would take."""
    bits = [0] * mask_words(len(base))
    for k in np.flatnonzero(np.asarray(base) >= 0).tolist():
        bits[k // MASK_BITS] |= 1 << (k % MASK_BITS)
    return bits


# ------------------------------------------------ the host part of a plan
def submanifold_centre(kernel_map, counts=None) -> int:
    """Index of the offset (0, 0, 0) when it maps every point to itself, else -1.

    ``counts``: the map's pair counts already on the host (saves a device read).
    Remembered on the map (a layer asks twice: to queue the centre product, and
    for the buffer layout).
    """
    if kernel_map.known_centre is not None:
        return kernel_map.known_centre
    c = centre_offset(kernel_map)
    if c >= 0:
        n_in, n_out = len(kernel_map.in_coords), len(kernel_map.out_coords)
        counts = kernel_map.host_counts() if counts is None else counts
        if not n_in == n_out == int(counts[c]):
            c = -1
    kernel_map.known_centre = c
    return c


def centre_offset(kernel_map) -> int:
    """Index of the offset (0, 0, 0) among the map's offsets, or -1; needs no counts."""
    offsets = np.asarray(to_host(kernel_map.offsets))
    return _zero_offset(offsets.shape, offsets.dtype.str, offsets.tobytes())


@cached(maxsize=256)
def _zero_offset(shape, dtype: str, raw: bytes) -> int:
    """Index of the row (0, 0, 0) of the offsets of ``shape`` and ``dtype`` whose bytes
    are ``raw``, or -1; remembered per content (a layer asks the same every call,
    and the NumPy test costs several times the host time of the cache's look-up)."""
    rows = np.flatnonzero((np.frombuffer(raw, dtype=dtype).reshape(shape) == 0).all(axis=1))
    return int(rows[0]) if len(rows) else -1



def offset_layout(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows=0):
    """The host part of a plan: counts -> order, groups, base rows; returns
    ``(counts, order, groups, base, rows, centre, policy)``, as :class:`GmasPlan` holds them.

    Plain Python on lists of K ints: every layer runs it between the Map step's
    read and its next launch, while the GPU waits, and on K = 27 numbers a list
    beats NumPy calls.
    """
    counts = kernel_map.host_counts()  # read with the Map step's report: no device read here
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
