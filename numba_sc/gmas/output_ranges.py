"""A layer too big for the workspace, cut by its outputs: each range of outputs a layer of its own.

:mod:`numba_sc.gmas.workspace` cuts a layer's buffer rows into windows. The rows
lie offset by offset, so every window holds a few offsets' pairs of *every*
output: each window's scatter reads and writes nearly all the outputs again,
and between windows the outputs hold running sums (kept in fp32 for an fp16
layer, then copied back to fp16). On MinkUNet42's dense levels at 1M voxels
that is most of the scatter's time (``benchmarks/results/windows_fp16.json``).

This module cuts the other way. Take the outputs ``q0 .. q1 - 1`` with *all*
their pairs. Coordinates are sorted (x, then y, then z), so the inputs those
outputs read lie close together too, inside one range ``p0 .. p1 - 1`` (about the
outputs' own x-slabs and one slab either side). That piece is itself a kernel map:
``table[:, q0:q1] - p0``. It gets its own plan (:func:`range_plan`), and the layer's
whole path (gather, GEMMs, scatter) runs on it, writing rows ``q0 .. q1 - 1`` of
the output once, in the output's own dtype. No running sums, no second read of
an output.

Worked example: 10 chunks with 3, 3, 4, 2, 2, 3, 3, 4, 1, 1 pairs outside the
centre (26 in all), and a target of 8 pairs a range. :func:`cut_points` cuts where
the running count passes 8, 16 and 24: chunks 0-1 (6 pairs), 2-4 (8), 5-7 (10),
8-9 (2). A range may pass the target by one chunk's pairs, so
:func:`output_ranges` aims that much lower, and lower again by the GEMM groups'
padding (at most ``max_padding`` of the real rows). If the outputs of chunks 0-1
read inputs 0 to 20, the first range is the map ``table[:, 0:2 * chunk] - 0`` over
inputs 0-20.

The cuts fall between the metadata's chunks of outputs
(:func:`numba_sc.core.conventions.chunk_size`, 1,024 on a GPU), whose pairs per
offset the forward search has already counted (``km.chunk_counts``): with each
chunk's first and last input, that is all the host needs to cut, in one device
read. What it costs: that read (a sync) once per map and direction (the ranges
are host numbers, kept on the map), and each time a layer runs, a plan per range
(the metadata kernels again, on a table of ``K x (q1 - q0)``), dropped once the
range is summed: kept, the ranges' lists would hold as much memory again as the
whole layer's.

When the cut pays (:func:`ranges_pay`): the windows' extra cost is their re-reads
of the outputs' running sums, and while those sums fit about in the L2 cache the
re-reads are cheap; the ranges' extra cost, a plan per range, stays. Measured layer
by layer on both networks (``benchmarks/results/ranges_vs_windows.json``, each row's
``sums_MB`` beside the card's ``l2_MB``), the windows were faster where the sums
were about the L2's size, the ranges where they were several times it; twice the
L2 lies between.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import GmasPlan
from .metadata import chunk_counts_cuda
from .plan import build_plan_cuda
from ..core.backend import to_device, to_host
from ..core.conventions import chunk_size
from ..core.device import device_xp, l2_cache_bytes
from ..map.kernel_map import KernelMap

MAX_RANGES = 64  # a bound on the plans a layer makes per call (each costs launches and host time); past it, windows
# Bytes of a layer's fp32 running sums (outputs x C_out x 4) below which it keeps the windows
# (see ranges_pay). None: twice the device's L2 cache; the tests set 0 (every layer by ranges).
MIN_SUMS_BYTES = None
# Threads of the blocks that count a chunk's pairs; a chunk is 8 outputs a thread. None: the
# metadata's (so the forward search's counts serve); the tests set fewer, for small clouds.
CHUNK_THREADS = None


@dataclass(frozen=True)
class OutputRange:
    """Outputs ``q0 .. q1 - 1``, the inputs ``p0 .. p1 - 1`` they read, and the pairs
    of each offset among them (host int64, K; the centre's not counted)."""

    q0: int
    q1: int
    p0: int
    p1: int
    counts: np.ndarray


def ranges_pay(n_out: int, c_out: int) -> bool:
    """Whether a layer of ``n_out`` outputs and ``c_out`` channels, past the workspace,
    should run by ranges of outputs rather than by windows of rows: when its running
    sums (fp32, ``n_out x c_out x 4`` bytes, what every window reads and writes again)
    pass :data:`MIN_SUMS_BYTES`, by default twice the L2 cache (the module docstring
    says what was measured)."""
    floor = 2 * l2_cache_bytes() if MIN_SUMS_BYTES is None else MIN_SUMS_BYTES
    return n_out * c_out * 4 > floor


def cut_points(pairs_per_chunk, target: int) -> list:
    """Where to cut a layer's chunks of outputs into ranges of about ``target`` pairs
    (host ints): the chunks at which the running count of pairs first passes 1, 2,
    3, ... times ``target`` (never before the first chunk). A range then holds at
    most ``target`` pairs plus one chunk's."""
    running = np.cumsum(pairs_per_chunk, dtype=np.int64)
    total = int(running[-1]) if len(running) else 0
    marks = np.arange(1, -(-total // target), dtype=np.int64) * target
    cuts = np.searchsorted(running, marks, side="right")
    # (a cut at 0 would make an empty range: the first chunk alone passes the mark)
    return sorted(set(np.clip(cuts, 1, len(running) - 1).tolist())) if len(running) > 1 else []


def chunk_summary(table, counts2d, threads=None):
    """Per chunk of outputs (:func:`numba_sc.core.conventions.chunk_size` of ``threads``):
    the pairs of each offset (``counts2d``, K x chunks, counted here when None) and the
    first and last input any of its pairs reads, read to the host together:
    ``(counts, first, last)``, NumPy. One device read."""
    xp = device_xp()
    K, n_out = table.shape
    chunk = chunk_size(threads)
    if counts2d is None:
        counts2d = chunk_counts_cuda(table, threads)
    n_chunks = counts2d.shape[1]
    big = np.iinfo(np.int32).max
    first = xp.full(n_chunks * chunk, big, dtype=np.int32)  # (the last chunk padded)
    last = xp.full(n_chunks * chunk, -1, dtype=np.int32)
    first[:n_out] = xp.where(table >= 0, table, np.int32(big)).min(axis=0)
    last[:n_out] = table.max(axis=0)
    both = xp.concatenate([counts2d.astype(np.int32).ravel(), first.reshape(n_chunks, chunk).min(axis=1),
                           last.reshape(n_chunks, chunk).max(axis=1)])
    host = to_host(both).astype(np.int64)
    return host[:K * n_chunks].reshape(K, n_chunks), host[K * n_chunks:-n_chunks], host[-n_chunks:]


def output_ranges(table, centre, limit, policy, known=None):
    """The ranges of outputs whose plans (:func:`range_plan`) each fit ``limit`` buffer
    rows, or None when one range would do, a chunk alone could pass the bound, or the
    cut would make more than :data:`MAX_RANGES`.

    ``table``: the layer's (K, |Q|) table in weight order (row k pairs outputs with
    the inputs they read through ``weight[k]``); ``centre``: the offset multiplied
    directly (left out of the ranges: its product is made whole), or -1; ``policy``:
    the whole plan's ``(max_padding, solo_rows, launch_rows)``; ``known``: the
    table's ``(chunk, pairs per offset and chunk)`` when counted already
    (``km.chunk``, ``km.chunk_counts``), or None. Host numbers only: a layer keeps
    them on its map, and makes each range's plan when it runs (a plan's lists take
    as much memory as the whole layer's, so they are not kept).
    """
    table = to_device(table)  # (a map built from NumPy coordinates keeps its table on the host)
    K, n_out = table.shape
    chunk = chunk_size(CHUNK_THREADS)
    # Room for the groups' padding and for the one chunk that passes the mark.
    target = int(limit / (1 + policy[0])) - chunk * (K - 1)
    if target < 1:
        return None
    counts2d = known[1] if known is not None and known[0] == chunk else None
    counts, first, last = chunk_summary(table, counts2d, CHUNK_THREADS)
    if centre >= 0:  # every output has its centre pair, multiplied directly
        counts[centre] = 0
    cuts = cut_points(counts.sum(axis=0), target)
    if len(cuts) == 0 or len(cuts) + 1 > MAX_RANGES:
        return None
    out = []
    for c0, c1 in zip([0] + cuts, cuts + [counts.shape[1]]):
        per_offset = counts[:, c0:c1].sum(axis=1)
        if not per_offset.any():  # nothing but centre pairs: the centre product is theirs
            continue
        out.append(OutputRange(c0 * chunk, min(c1 * chunk, n_out), int(first[c0:c1].min()),
                               int(last[c0:c1].max()) + 1, per_offset))
    return out


def range_plan(table, r: OutputRange, in_coords, out_coords, offsets, centre, limit, policy) -> GmasPlan:
    """The plan of range ``r`` of the layer whose (K, |Q|) table in weight order is
    ``table``: the map ``table[:, q0:q1] - p0`` (the centre's row left out) over inputs
    ``p0 .. p1 - 1``, laid out by ``policy``; at most ``limit`` rows (where the padding
    ``launch_rows`` allows passes it, the plain padding policy, which the target of
    :func:`output_ranges` leaves room for)."""
    xp = device_xp()
    part = to_device(table)[:, r.q0:r.q1] - np.int32(r.p0)  # (a copy) inputs numbered from the range's first
    xp.maximum(part, -1, out=part)  # no pair: -1 again
    if centre >= 0:
        part[centre] = -1
    piece = KernelMap(in_coords[r.p0:r.p1], out_coords[r.q0:r.q1], None, offsets, part, r.counts,
                      counts_host=r.counts, known_centre=-1)
    plan = build_plan_cuda(piece, True, policy[0], policy[1], False, launch_rows=policy[2])
    if plan.rows > limit:
        plan = build_plan_cuda(piece, True, policy[0], policy[1], False, launch_rows=0)
    return plan
