"""Stage 7, metadata tables: where every pair of the kernel map lives in the buffers.

The GMaS step (paper Section 2.2, Figure 2) multiplies, for every offset k, the
features of all inputs that feed some output through k by ``W[k]``. To do that
with a few big GEMMs, the gather copies those input rows into one *input buffer*
(offset by offset, groups padded to equal height, :mod:`numba_sc.gemm_grouping`),
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
    Row-major by input so that a gather thread reads its K entries contiguously.
output table ``out_table`` (|Q| x K), int32
    ``out_table[i, k]`` = buffer row holding output i's partial result through
    offset k, or -1.

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

GPU cost for K offsets and |Q| outputs: one library scan over the K x |Q| map
(reads 4K|Q|, writes 4K|Q|), one fill of the input table (4K|P|), one kernel
(one thread per output) reading the map and the scan and writing both tables
(~16K|Q| bytes). The only device->host copy is the K pair counts, which the host
needs anyway to size the buffers and shape the GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from . import gemm_grouping as gg
from .backend import device_xp, launch, resolve_backend, to_device, to_host


@dataclass
class GmasPlan:
    """Everything the gather, GEMMs and scatter need for one layer."""

    counts: np.ndarray  # host int64 (K,): pairs per offset
    order: np.ndarray  # host int64: offsets in buffer order (no empty ones, no centre)
    groups: list  # list of gemm_grouping.Group, laid out back to back
    base: np.ndarray  # host int64 (K,): first buffer row of each offset, or -1
    rows: int  # buffer rows, padding included
    centre: int  # offset multiplied directly (submanifold), or -1
    in_table: object  # int32 (|P|, K) buffer rows or -1 (host or device)
    out_table: object  # int32 (|Q|, K) buffer rows or -1 (host or device)
    report: dict = field(default_factory=dict)  # gemm_grouping.padding_report

    @property
    def launches(self) -> int:
        return len(self.groups)


def submanifold_centre(kernel_map, counts=None) -> int:
    """Index of the offset (0, 0, 0) when it maps every point to itself, else -1.

    ``counts``: the map's pair counts already on the host (saves a device read).
    """
    offsets = to_host(kernel_map.offsets)
    hits = np.flatnonzero((offsets == 0).all(axis=1))
    if len(hits) == 0:
        return -1
    c = int(hits[0])
    n_in, n_out = len(kernel_map.in_coords), len(kernel_map.out_coords)
    counts = to_host(kernel_map.counts) if counts is None else counts
    return c if (n_in == n_out == int(counts[c])) else -1


def grouping_report(kernel_map, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True) -> dict:
    """Padding overhead and GEMM launches of a layer, offsets sorted vs map order.

    See :func:`numba_sc.gemm_grouping.padding_report`; the submanifold centre (when
    multiplied directly) is in neither count.
    """
    centre = submanifold_centre(kernel_map) if direct_centre else -1
    return gg.padding_report(to_host(kernel_map.counts), centre, max_padding, solo_rows)


def _layout(kernel_map, sort, max_padding, solo_rows, direct_centre):
    """Host part: counts -> order, groups, base rows."""
    counts = np.asarray(to_host(kernel_map.counts), dtype=np.int64)  # the one device read
    centre = submanifold_centre(kernel_map, counts) if direct_centre else -1
    order = gg.offset_order(counts, sort, centre)
    groups = gg.make_groups(counts, order, max_padding, solo_rows)
    base = np.full(len(counts), -1, dtype=np.int64)
    for g in groups:
        for m, k in enumerate(g.members):
            base[k] = g.start + m * g.rows
    rows = sum(g.padded_rows for g in groups)
    report = gg.padding_report(counts, centre, max_padding, solo_rows)
    return counts, order, groups, base, rows, centre, report


# ------------------------------------------------------------------ reference
def build_plan_reference(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                         solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True) -> GmasPlan:
    """NumPy version: the same scan, then fancy-indexed writes instead of a kernel."""
    counts, order, groups, base, rows, centre, report = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre)
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
    return GmasPlan(counts, order, groups, base, rows, centre, in_table, out_table, report)


# -------------------------------------------------------------------- kernels
@cuda.jit
def tables_kernel(table, rank, base, in_table, out_table):
    """One thread per output i: for each offset, its pair's buffer row in both tables.

    ``rank`` is the inclusive scan of ``table >= 0`` along the outputs, so the
    pair (k, i) is the ``rank[k, i] - 1``-th of offset k.
    """
    i = cuda.grid(1)
    if i < table.shape[1]:
        for k in range(table.shape[0]):
            j = table[k, i]  # neighbouring threads read neighbouring entries: coalesced
            b = base[k]
            if j >= 0 and b >= 0:
                row = b + rank[k, i] - 1
                out_table[i, k] = row
                in_table[j, k] = row  # j is distinct per i for a fixed k: no write race
            else:
                out_table[i, k] = -1  # every entry is written: no fill needed for this table


def build_plan_cuda(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True) -> GmasPlan:
    """Device version: one library scan, one fill, one kernel."""
    counts, order, groups, base, rows, centre, report = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre)
    xp = device_xp()
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    rank = xp.cumsum(table >= 0, axis=1, dtype=np.int32)
    in_table = xp.full((n_in, K), -1, dtype=np.int32)
    out_table = xp.empty((n_out, K), dtype=np.int32)
    launch(tables_kernel, n_out, table, rank, to_device(base.astype(np.int32)), in_table, out_table)
    return GmasPlan(counts, order, groups, base, rows, centre, in_table, out_table, report)


def build_plan(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
               solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, backend=None) -> GmasPlan:
    """Metadata of one layer from its kernel map (see the module docstring).

    ``sort=False`` keeps the map's offset order (to measure what sorting buys);
    ``direct_centre=False`` sends the submanifold centre through the buffers too.
    """
    if resolve_backend(backend) == "reference":
        return build_plan_reference(kernel_map, sort, max_padding, solo_rows, direct_centre)
    return build_plan_cuda(kernel_map, sort, max_padding, solo_rows, direct_centre)
