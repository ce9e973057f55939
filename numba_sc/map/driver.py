"""The Map step's fast path: the library's kernels of stages 3-6, launched back to back.

:mod:`numba_sc.map.kernel_map` explains the step (and holds its NumPy reference);
the stage modules hold each kernel and its ladder. This module is what the
library runs: it lays out the step's small arrays, launches the top rung of
every stage, and checks what they report.

Host work matters as much as the GPU's (every launch costs host time, and a
device->host read also waits for the GPU; ``docs/performance.md``): the kernel path is the
pack kernel, the backward kernel (which also writes the balanced rows), one
fill and the forward kernel, for all K segments at once. It reads from the
device once, at the end: a small *report* with the pack kernel's flags (out of
range? out of order?), the number of balanced blocks and the pairs per offset.
The search trusts the order and the report confirms it; input that turns out
unsorted is then sorted and searched again (see :func:`build_kernel_map_cuda`).
A strided layer makes its output coordinates in the same step, and their count
rides in the report too: every size before it is taken from the input, since a
stride never makes more outputs than inputs (:func:`_start_counted`).

Worked example, a 3x3x3 submanifold layer on sorted coordinates (what a network
hands on)::

    pending = start_kernel_map_cuda(coords, 3, assume_sorted=True)
        # queued: pack -> backward search -> fill -> forward search -> report copy
    m = pending.result()
        # waits for the report (flags, balanced rows, pairs per offset), checks it
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, NamedTuple

import numpy as np

from ..core import conventions as cv
from ..core.conventions import chunk_size, mask_words
from ..core.device import device_id, simulating
from ..core.backend import filled, read_later, to_device, to_host
from ..core.pieces import as_array, piece, piece_template
from ..core.state import cached
from .backward_search import (DEFAULT_QUERY_BLOCK, DEFAULT_SOURCE_BLOCK, backward_search_cuda, check_block_sizes,
                              max_balanced_blocks, num_source_blocks)
from . import grid_map
from . import hash_map
from .forward_search import forward_search_cuda
from .kernel_map import (FoundWithPairs, KernelMap, Layer, assemble_map, check_columns, check_method, duplicate_error,
                         layer_arguments, reaches, searched_segments, sorted_offsets, unsorted_error)
from .map_probe import probe_cuda
from ..coords.output_coords import output_coordinates, output_coordinates_reference, start_output_keys
from .sorting import sort_rows_cuda


# The kernel path's device->host traffic is one small int64 array, the *report*,
# read once when the map is done:
REPORT_IN = 0  # report[0:3]: in_coords flags: out of range, unsorted, repeated rows
REPORT_OUT = 3  # report[3:6]: the same for the query (output) coordinates
REPORT_ROWS = 6  # report[6]: balanced query blocks
REPORT_NOUT = 7  # report[7]: the outputs a strided layer counted on the device (else 0)
REPORT_COUNTS = 8  # report[8:]: pairs per offset


class SearchPlan(NamedTuple):
    """What a layer configuration decides once (:func:`_search_plan`)."""

    h: int  # segments searched: K, or ceil(K / 2) for a symmetric submanifold kernel
    source_reach: tuple  # ((3 ints), (3 ints)): how far the input keys reach
    query_reach: tuple  # ... and the query keys (the kernel's reach)


@cached(maxsize=64)
def _search_plan(ks, dil, ts, submanifold, symmetric) -> SearchPlan:
    """What a layer configuration decides once: segments searched and reaches.

    Cached because every call of a layer asks the same questions, and on a small
    cloud the host's few microseconds per question add up (the whole Map step of
    a 94k-voxel scan: ``benchmarks/README.md``, "The Map step").
    """
    offsets, _ = sorted_offsets(ks, dil, ts)
    return SearchPlan(searched_segments(offsets, submanifold, symmetric), *reaches(offsets, submanifold))


def _device_deltas(ks, dil, ts, h=None):
    """The first ``h`` (default: all) key deltas on the current device, copied there
    once per layer configuration."""
    return _device_deltas_on(ks, dil, ts, device_id(), h)


@cached(maxsize=64)
def _device_deltas_on(ks, dil, ts, device, h):
    return to_device(np.array(sorted_offsets(ks, dil, ts)[1][:h]))


class _Work:
    """Everything small the kernel path needs, cut from one zeroed device allocation.

    One allocation and one memset instead of a dozen arrays: each allocation,
    fill or slice costs a few microseconds of host time on the GPU machine, and a
    dozen of them are a visible share of a Map step on a scan (measured:
    ``docs/performance.md``, "Memory without host round trips"). Layout, in int64
    words::

        report        REPORT_COUNTS + K     flags, row count, output count, pairs per offset
        chunk_counts  K * n_chunks int32     pairs per offset and chunk of outputs
        keys          |P| (+ |Q|)            packed input (and output) keys
        bounds        h * (nblocks + 1)      query block borders
        rows          upper * 4 int32        balanced query blocks
        out_masks     W * |Q|                which offsets have a pair at each output
        in_masks      W * |P|                ... and at each input (W = mask_words(K),
                                             0 unless the caller asked for masks)

    ``report`` is a CuPy (or NumPy) array, since the map hands out a view of it
    (``counts``); the rest are :class:`numba_sc.core.pieces.Piece` s, kernel arguments only
    (the map's chunk counts and masks are handed out as arrays, :func:`_finish_cuda`).
    The chunk counts and masks come twice, as the map's 2-D pieces and as the flat
    ones the forward search writes (its row length may be known on the device
    only). For a strided layer whose outputs are counted on the device, ``Q`` here
    is their upper bound ``P``; :meth:`counted_views` cuts the map's pieces once
    the count is read.
    """

    def __init__(self, K, h, P, Q, B, C, chunk, two_sides, masks):
        self.K, self.chunk = K, chunk
        words, self.upper, self.n_chunks, parts = _work_layout(K, h, P, Q, B, C, chunk, two_sides, masks)
        self.report = buf = filled(words, np.int64, 0)
        self._parts = parts
        for name, offset, shape, dtype, template in parts:
            if shape is None:
                setattr(self, name, None)
            elif template is not None:  # on a GPU: the layout's pieces, moved into this allocation
                setattr(self, name, template.rebased(buf))
            else:  # under the simulator: NumPy views
                setattr(self, name, piece(buf, offset, shape, dtype))
        if not two_sides:
            self.keys_out = self.keys_in  # submanifold: one array is both

    def repeats(self, slot):
        """The repeated-rows slot of side ``slot`` (REPORT_IN / REPORT_OUT), which the
        sort path counts into; made only there (a piece costs host time)."""
        return piece(self.report, 8 * (slot + 2), (1,), np.int64)

    def counted_views(self, Q):
        """The map's chunk counts and output masks for ``Q`` outputs, as the forward
        search wrote them flat: (K, ceil(Q / chunk)) and (W, Q) pieces."""
        at = {name: offset for name, offset, *_ in self._parts}
        cc = piece(self.report, at["chunk_counts"], (self.K, -(-Q // self.chunk)), np.dtype(np.int32))
        om = None if self.out_masks is None else piece(self.report, at["out_masks"],
                                                       (self.out_masks.shape[0], Q), np.dtype(np.int64))
        return cc, om

    def counts_array(self):
        """The pairs per offset as a real array (a view of the report): the map's ``counts``."""
        return self.report[REPORT_COUNTS:REPORT_COUNTS + self.K]


@cached(maxsize=64)
def _work_layout(K, h, P, Q, B, C, chunk, two_sides, masks):
    """Where :class:`_Work`'s pieces lie: ``(int64 words, upper bound of balanced
    blocks, chunks, ((name, byte offset, shape or None, dtype), ...))``, worked
    out once per layer and cloud size (a layer in a network sees the same sizes
    call after call)."""
    n_chunks = -(-Q // chunk)
    upper = max_balanced_blocks(h, P, Q, B, C)
    nb = num_source_blocks(P, B)
    R = REPORT_COUNTS + K
    W = mask_words(K) if masks else 0
    words = [R, -(-K * n_chunks // 2), P, Q if two_sides else 0, h * (nb + 1), 2 * max(upper, 1), W * Q, W * P]
    starts = [8 * w for w in accumulate(words, initial=0)]  # byte offsets
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    on_gpu = not simulating()

    def part(name, offset, shape, dtype):
        # On a GPU, also the piece itself at no allocation yet: _Work moves it into its own.
        return name, offset, shape, dtype, (piece_template(offset, shape, dtype) if on_gpu and shape else None)

    parts = (
        part("report_read", 0, (R,), i64),  # what to_host reads: the report alone
        part("flags_in", 8 * REPORT_IN, (3,), i64),
        part("flags_out", 8 * REPORT_OUT, (3,) if two_sides else None, i64),
        part("n_rows", 8 * REPORT_ROWS, (1,), i64),
        part("n_out", 8 * REPORT_NOUT, (1,), i64),
        part("counts", 8 * REPORT_COUNTS, (K,), i64),
        part("chunk_counts", starts[1], (K, n_chunks), i32),  # the map's; the forward search's flat:
        part("chunk_flat", starts[1], (K * n_chunks,), i32),
        part("keys_in", starts[2], (P,), i64),
        part("keys_out", starts[3], (Q,) if two_sides else None, i64),
        part("bounds", starts[4], (h, nb + 1), i64),
        part("rows", starts[5], (max(upper, 1), 4), i32),
        part("out_masks", starts[6], (W, Q) if masks else None, i64),
        part("in_masks", starts[7], (W, P) if masks else None, i64),
        part("out_masks_flat", starts[6], (W * Q,) if masks else None, i64),
        part("in_masks_flat", starts[7], (W * P,) if masks else None, i64),
    )
    return starts[-1] // 8, upper, n_chunks, parts



def _search_cuda(skeys, qkeys, d_deltas, K, B, C, work, n_out=None):
    """Stages 5 and 6 on sorted keys: backward search and forward search, launched
    and not waited for. Returns ``(table, grid launched)``; the report is read
    afterwards (``to_host(work.report_read)``). ``n_out``: the device count of the
    queries when ``qkeys`` is only their upper bound; the table then comes back
    flat (see :func:`~numba_sc.map.forward_search.forward_search_cuda`)."""
    # On a GPU launch the upper bound of balanced blocks and let surplus blocks
    # exit (no sync, see forward_search.py). Under the simulator the count is a
    # NumPy value, free to read, and every launched block costs a crowd of threads.
    backward_search_cuda(skeys, qkeys, d_deltas, B, C, work.upper, work.n_rows, work.bounds, work.rows,
                         n_out)  # stage 5
    grid = min(int(work.n_rows[0]), work.upper) if simulating() else work.upper
    table, _, _ = forward_search_cuda(skeys, qkeys, d_deltas, work.rows, work.n_rows, B, C, grid, work.counts,
                                      n_offsets=K, chunk=work.chunk, chunk_counts=work.chunk_flat,
                                      out_masks=work.out_masks_flat, in_masks=work.in_masks_flat,
                                      n_out=n_out)  # stage 6
    return table, grid


def _lookup_cuda(method, skeys, qkeys, in_sorted, d_deltas, K, work):
    """Stages 5 and 6 replaced by a structure and one probe per (query, offset): the
    hash table or the dense grid (:mod:`numba_sc.map.map_probe`); returns the table."""
    if method == "hash":
        a, b = hash_map.build_cuda(skeys)
        lookup = hash_map.lookup_device
    else:
        a, b = grid_map.build_cuda(skeys, in_sorted)
        lookup = grid_map.lookup_device
    table = filled((K, qkeys.shape[0]), np.int32, -1)
    probe_cuda(lookup, a, b, qkeys, d_deltas, table, work.counts, work.chunk, work.chunk_counts,
               work.out_masks, work.in_masks)
    return table, a



class Side(NamedTuple):
    """One packed array of the step, as the report describes it."""

    slot: int  # REPORT_IN or REPORT_OUT: where its flags lie in the report
    coords: object  # the coordinates as passed (named in an error)
    reach: tuple  # ((3 ints), (3 ints)): the reach its keys were packed with
    name: str  # what an error calls it
    assume_sorted: bool  # the caller vouched for its order: unsorted is an error


def _check_report(report, sides):
    """Raise the first error the report records. ``sides``: a :class:`Side` for each
    packed array. Range errors of every side come first: no sort can fix them (and
    an out-of-range row also looks unsorted)."""
    for s in sides:
        if report[s.slot + cv.FLAG_RANGE]:
            cv.raise_range_error(s.coords, s.reach[0], s.reach[1], s.name)
    for s in sides:
        if s.assume_sorted and report[s.slot + cv.FLAG_UNSORTED]:
            raise unsorted_error(s.name)
        if report[s.slot + 2]:
            raise duplicate_error(s.name, int(report[s.slot + 2]))



class Sizes(NamedTuple):
    """The sizes a map's work was laid out for (:class:`_Work`)."""

    K: int  # offsets
    h: int  # segments searched
    P: int  # inputs
    Q: int  # outputs (for outputs counted on the device: their upper bound, P)
    B: int  # source block
    C: int  # largest balanced query block
    masks: bool  # whether the offsets' masks are recorded


@dataclass
class Counted:
    """What :func:`_start_counted` hands on to :func:`_counted_result`: a strided
    layer's map whose outputs were counted on the device, before the count is read."""

    out_all: object  # the outputs' rows; the first |Q| (the count in the report) are the outputs
    table: object  # int32, K * |P| long: the first K * |Q| are the table
    in_sorted: object  # the inputs
    layer: Layer
    query_reach: tuple  # the reach the outputs' keys were packed with


@dataclass
class PendingMap:
    """A kernel map whose work is queued and whose report is on its way to the host
    (:func:`start_kernel_map_cuda`). ``.map`` has its device arrays (coordinates,
    table, counts on the device); :meth:`result` waits for the report, raises the
    errors it records (or sorts and searches again), and fills the host counts and
    the stats."""

    map: KernelMap | None  # None while a strided layer's outputs are counted (counted)
    read: Callable | None  # waits for the report's copy and returns it; None: the caller reads
    work: "_Work"  # the step's small arrays, the report among them
    found: object  # what the stats report: the forward grid ("sorted"), the hash or grid structure
    sides: list  # a Side for each packed array
    submanifold: bool
    method: str  # "sorted" | "hash" | "grid"
    d_deltas: object  # the searched segments' key deltas on the device
    sizes: Sizes
    counted: Counted | None = None  # a strided layer's outputs counted on the device

    @property
    def report(self):
        """The report on the device (int64: flags, balanced rows, pairs per offset)."""
        return self.work.report[:REPORT_COUNTS + self.sizes.K]

    def result(self, report=None) -> KernelMap:
        """The finished map; ``report``: this map's report, read to the host by the
        caller (needed when it was started with ``read=False``)."""
        m, work, found, sides, method = self.map, self.work, self.found, self.sides, self.method
        K, h, P, Q, B, C, masks = self.sizes
        submanifold = self.submanifold
        rep = self.read() if report is None else np.asarray(report)
        if self.counted is not None:  # a strided layer's outputs, counted on the device: now |Q| is known
            m, out_sorted = _counted_result(self.counted, work, rep)
            Q = out_sorted.shape[0]
            sides = sides + [Side(REPORT_OUT, out_sorted, self.counted.query_reach, "output coordinates", True)]
        _check_report(rep, sides)  # out of range; or unsorted, where the caller vouched for the order
        unsorted_in = bool(rep[REPORT_IN + cv.FLAG_UNSORTED])
        unsorted_out = not submanifold and bool(rep[REPORT_OUT + cv.FLAG_UNSORTED])
        if unsorted_in or unsorted_out:  # stage 3 after all: sort, then search again
            in_sorted, out_sorted, in_order, out_order = m.in_coords, m.out_coords, None, None
            old, work = work, _Work(K, h, P, Q, B, C, chunk_size(), not submanifold, masks)
            skeys, qkeys = as_array(old.keys_in), as_array(old.keys_out)[:Q]  # counted: |P| long, |Q| used
            if unsorted_in:
                skeys, in_order, in_sorted = sort_rows_cuda(skeys, in_sorted, work.repeats(REPORT_IN))
            if submanifold:
                qkeys, out_sorted = skeys, in_sorted
            elif unsorted_out:
                qkeys, out_order, out_sorted = sort_rows_cuda(qkeys, out_sorted, work.repeats(REPORT_OUT))
            table, found = _find_pairs(method, skeys, qkeys, in_sorted, self.d_deltas, K, B, C, work)
            layer = Layer(m.kernel_size, m.stride, m.dilation, m.tensor_stride, m.offsets, None)
            m = _finish_cuda(in_sorted, out_sorted, in_order, m.offsets, table, work, layer, out_order)
            rep = to_host(work.report_read)
            _check_report(rep, [s._replace(assume_sorted=False) for s in sides])  # repeated rows
        m.counts_host = rep[REPORT_COUNTS:].copy()
        pairs = sum(m.counts_host.tolist())  # K numbers: a list beats a NumPy reduction
        nb = num_source_blocks(P, B)
        m.stats = {
            "backend": "cuda", "method": method,
            "n_in": P, "n_out": Q, "n_offsets": K, "queries": K * Q,
            "segments_searched": h, "queries_searched": h * Q,
            "pairs": pairs, "hit_rate": pairs / (K * Q),
            "sorted_on_device": unsorted_in or unsorted_out,
        }
        if method == "sorted":
            m.stats.update({
                "source_block": B, "query_block": C, "source_blocks": nb,
                "query_blocks_before_balancing": h * nb,
                "query_blocks_after_balancing": int(rep[REPORT_ROWS]),
                "forward_grid_upper_bound": work.upper, "forward_grid_launched": found})
        elif method == "hash":
            m.stats.update({"capacity": int(found.shape[0]), "load_factor": P / int(found.shape[0])})
        else:
            m.stats.update({"cells": int(found.shape[0])})
        return m


def build_kernel_map_cuda(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1,
                          out_coords=None, source_block=DEFAULT_SOURCE_BLOCK, query_block=DEFAULT_QUERY_BLOCK,
                          assume_sorted=False, symmetric=True, masks=False, while_reading=None,
                          method="sorted") -> KernelMap:
    """The Map step with the kernels; arrays stay on the device, no Python loop over K.

    Optimistic about the order: coordinates are packed and searched as if they
    were sorted and unique - what every stage of this package hands out - and
    the pack kernel's flags come back with the one final report. Only when a
    flag says otherwise does the library sort run (:func:`numba_sc.map.sorting.sort_rows_cuda`), followed
    by a second search; the first one was wasted, which costs unsorted input one
    extra search but saves sorted input a device->host read in the middle of
    the step (a sync that leaves the GPU idle while the host catches up).

    Two halves (:func:`start_kernel_map_cuda` queues the work and the report's copy,
    :meth:`PendingMap.result` waits for the report), so that a caller with several
    maps to build can queue them all before it waits once
    (:mod:`numba_sc.nn.maps_up_front`).
    """
    pending = start_kernel_map_cuda(in_coords, kernel_size, stride, dilation, tensor_stride, out_coords,
                                    source_block, query_block, assume_sorted, symmetric, masks, method)
    # The read waits for the forward search (its GPU time on a 94k-voxel scan:
    # `python -m numba_sc ladder forward_search`): the caller may queue meanwhile the
    # work that needs no report (after the copy, so that the read does not wait for it).
    if while_reading is not None and assume_sorted and pending.map is not None:
        while_reading(pending.map)
    return pending.result()


def start_kernel_map_cuda(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1, out_coords=None,
                          source_block=DEFAULT_SOURCE_BLOCK, query_block=DEFAULT_QUERY_BLOCK, assume_sorted=False,
                          symmetric=True, masks=False, method="sorted", read=True) -> "PendingMap":
    """The first half of :func:`build_kernel_map_cuda`: pack, search, and start copying
    the report to the host; nothing is waited for. ``.map`` of the result holds the
    device arrays already; :meth:`PendingMap.result` finishes the map.

    ``read=False`` starts no copy (a thread has one asynchronous read in flight at a
    time, :meth:`numba_sc.core.pieces.Piece.get_async`): a caller with many maps reads
    their ``.report`` s together and hands each its own to :meth:`PendingMap.result`.

    A strided layer with default outputs (and the sorted search) counts its outputs
    on the device: every size is taken from the input (there are at most |P|
    outputs), the outputs' keys go straight to the search, and the count comes back
    with the report, so the step reads once, not twice (:func:`_start_counted`);
    ``.map`` is then None until :meth:`PendingMap.result`."""
    B, C = check_block_sizes(source_block, query_block)
    method = check_method(method)
    layer = layer_arguments(kernel_size, stride, dilation, tensor_stride)
    ks, st, dil, ts, offsets = layer.kernel_size, layer.stride, layer.dilation, layer.tensor_stride, layer.offsets
    in_coords, out_coords = to_device(in_coords), to_device(out_coords)
    check_columns(in_coords, out_coords)
    K = len(offsets)
    submanifold = out_coords is None and st == (1, 1, 1)
    h, source_reach, query_reach = _search_plan(ks, dil, ts, submanifold, symmetric)
    in_sorted = to_device(cv.validate_coords(in_coords, "in_coords", check_range=False))  # shape, dtype
    sides = [Side(REPORT_IN, in_coords, source_reach, "in_coords", assume_sorted)]
    out_sorted = in_sorted  # submanifold: one sorted array is both the source and the queries
    if not submanifold and out_coords is None and method == "sorted":
        return _start_counted(in_sorted, layer, h, source_reach, query_reach, sides, B, C, masks, read)
    if not submanifold:
        if out_coords is None:  # strided layer, default outputs: sorted and unique already
            out_coords = output_coordinates(in_sorted, st, ts, backend="cuda")
            name, sorted_outputs = "output coordinates", True
        else:
            name, sorted_outputs = "out_coords", False
        out_sorted = to_device(cv.validate_coords(out_coords, name, check_range=False))
        sides.append(Side(REPORT_OUT, out_coords, query_reach, name, sorted_outputs))
    d_deltas = _device_deltas(ks, dil, ts, h)  # int64, already on the device
    P, Q = int(in_sorted.shape[0]), int(out_sorted.shape[0])

    # Stage 3, optimistic: pack (the kernel flags range and order) and search.
    work = _Work(K, h, P, Q, B, C, chunk_size(), not submanifold, masks)
    skeys = qkeys = work.keys_in
    cv.launch_pack(in_sorted, *source_reach, skeys, work.flags_in)
    if not submanifold:
        qkeys = work.keys_out
        cv.launch_pack(out_sorted, *query_reach, qkeys, work.flags_out)
    table, found = _find_pairs(method, skeys, qkeys, in_sorted, d_deltas, K, B, C, work)
    # The host makes the map while the GPU searches: everything that needs no report.
    m = _finish_cuda(in_sorted, out_sorted, None, offsets, table, work, layer, None)
    return PendingMap(m, read_later(work.report_read) if read else None, work, found, sides, submanifold, method,
                      d_deltas, Sizes(K, h, P, Q, B, C, masks))


def _start_counted(in_sorted, layer, h, source_reach, query_reach, sides, B, C, masks, read):
    """A strided layer's Map step with its outputs counted on the device: one read.

    The output keys are made as :func:`numba_sc.output_coordinates` makes them (pack
    the snapped coordinates, sort, de-duplicate), with the kernel's reach checked in
    the same pack, into the search's query keys; the count goes into the report.
    Every size is the upper bound |P| (a stride never makes more outputs than
    inputs), and the searches read the count on the device.
    """
    ks, st, dil, ts, offsets = layer.kernel_size, layer.stride, layer.dilation, layer.tensor_stride, layer.offsets
    K, P = len(offsets), int(in_sorted.shape[0])
    work = _Work(K, h, P, P, B, C, chunk_size(), True, masks)
    out_all = start_output_keys(in_sorted, st, ts, work.flags_out, work.report_read, REPORT_NOUT, query_reach,
                                work.keys_out)  # the first |Q| rows are the outputs
    cv.launch_pack(in_sorted, *source_reach, work.keys_in, work.flags_in)
    d_deltas = _device_deltas(ks, dil, ts, h)
    table, found = _search_cuda(work.keys_in, work.keys_out, d_deltas, K, B, C, work, n_out=work.n_out)
    counted = Counted(out_all, table, in_sorted, layer, query_reach)
    return PendingMap(None, read_later(work.report_read) if read else None, work, found, sides, False, "sorted",
                      d_deltas, Sizes(K, h, P, P, B, C, masks), counted)


def _counted_result(counted, work, rep):
    """The map of :func:`_start_counted` once its report is read: the outputs, table,
    chunk counts and masks viewed at their real size; and the error if the pack
    flagged an output (slow path: the outputs made again on the host to name it). An
    input out of range is left to :func:`_check_report`, which names the input."""
    layer = counted.layer
    offsets = layer.offsets
    if rep[REPORT_OUT + cv.FLAG_RANGE] and not rep[REPORT_IN + cv.FLAG_RANGE]:
        # raises if a snapped coordinate can't pack
        out = output_coordinates_reference(to_host(counted.in_sorted), layer.stride, layer.tensor_stride)
        cv.raise_range_error(out, *counted.query_reach, "output coordinates")
        raise AssertionError("the strided pack flagged an output the host check accepts")
    Q, K = int(rep[REPORT_NOUT]), len(offsets)
    out_sorted = counted.out_all[:Q]
    m = assemble_map(counted.in_sorted, out_sorted, None, offsets, counted.table[:K * Q].reshape(K, Q),
                     work.counts_array(), {}, layer, None)
    chunk_counts, out_masks = work.counted_views(Q)
    # Handed on as the kernels take them (pieces on a GPU); the map's properties read them as arrays.
    m.found = FoundWithPairs(work.chunk, chunk_counts, out_masks, work.in_masks)
    return m, out_sorted


def _find_pairs(method, skeys, qkeys, in_sorted, d_deltas, K, B, C, work):
    """Stages 5-6 by ``method``: ``(table, what the stats report)``: the forward
    search's grid for "sorted", the hash table's slot keys or the grid for the others."""
    if method == "sorted":
        return _search_cuda(skeys, qkeys, d_deltas, K, B, C, work)
    return _lookup_cuda(method, skeys, qkeys, in_sorted, d_deltas, K, work)


def _finish_cuda(in_sorted, out_sorted, in_order, offsets, table, work, layer, out_order):
    """The kernel path's map, with the device arrays of ``work`` it hands on (stats
    and host counts come after the report is read). The chunk counts and masks go
    to the metadata stage as pieces of ``work`` on a GPU (:class:`FoundWithPairs`: a
    CuPy array of each would cost host time at every layer and launch that reads it);
    the map's properties hand them to a user as CuPy arrays."""
    m = assemble_map(in_sorted, out_sorted, in_order, offsets, table, work.counts_array(), {}, layer, out_order)
    m.found = FoundWithPairs(work.chunk, work.chunk_counts, work.out_masks, work.in_masks)
    return m
