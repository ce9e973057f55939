"""The Map step: which input feeds which output through which weight offset.

A sparse convolution computes, for every output coordinate ``q_i``,
``out[i] = sum_k in[q_i + delta_k] @ W[k]`` over the inputs that exist. The
*kernel map* records which exist. Minuet builds it without a hash table, with
sorted arrays and binary search (paper Section 5.1), in four stages, one module
each:

    3. sorting          input keys and output keys sorted by the library; the
                        weight offsets are sorted once per layer       (sorting.py)
    4. query segments   segment k = sorted(Q) + delta_k, made on the fly
                                                                (query_segments.py)
    5. backward search  source-block pivots searched in every segment -> query
                        blocks; blocks larger than C split         (backward_search.py)
    6. forward search   each balanced query block searched in its source block,
                        held in shared memory -> the table          (forward_search.py)

The result, :class:`KernelMap`, is query-major as in Minuet::

    table[k, i] = index into in_coords of the input at out_coords[i] + offsets[k],
                  or -1 when there is none.

Worked example, one axis, a 3-wide kernel, stride 1 (submanifold)::

    in_coords = out_coords = [0, 1, 3]      offsets = [-1, 0, 1]
    table = [[-1,  0, -1],     offset -1: 1-1 = 0 is input 0; 0-1 and 3-1 missing
             [ 0,  1,  2],     offset  0: every point sees itself
             [ 1, -1, -1]]     offset +1: 0+1 = 1 is input 1
    counts = [1, 3, 1]

Everything is on the sorted order. ``in_coords`` is the caller's input sorted
lexicographically, ``in_coords == caller_in_coords[in_order]``: carry features
into map order with ``features[in_order]``. When the caller passes
``out_coords`` they are sorted too (``out_coords == caller_out_coords[out_order]``);
default outputs come out of :func:`numba_sc.output_coordinates` already sorted.
For stride 1 and no given outputs, the one sorted input array is both the source
and the query array (Section 5.1.1, fourth reason): ``Q = P``.

Beyond the paper: a submanifold layer with a symmetric kernel (any odd size)
finds every pair twice, once through ``delta`` and once through ``-delta``, so
only ``ceil(K / 2)`` segments are searched and each hit is written twice
(:func:`searched_segments`; ``symmetric=False`` gives the paper's full search).

Transposed convolution (upsampling): :meth:`KernelMap.transposed` swaps inputs
and outputs of the strided map it inverts. Row ``k'`` of the transposed map
belongs to offset ``-offsets[K-1-k']``, so it holds the pairs of row ``K-1-k'``
of the original; a transposed convolution with weight ``W`` (K, C_in, C_out)
applies ``W[K-1-k']`` to row ``k'``, i.e. the weight of the original offset.

Napkin math of the whole step, 3x3x3 submanifold layer on 94k voxels: sort 94k
keys (~0.75 MB a pass; skipped when the input is already sorted, as it is
between layers), backward search ~10k threads, forward search ~10k thread
blocks reading ~20 MB through shared memory, table 27 x 94k x 4 B = 10 MB written.

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
"""
from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..core import conventions as cv
from ..core.conventions import chunk_size, mask_words
from ..core.device import array_module, device_id, is_cupy, simulating
from ..core.backend import filled, like, read_later, resolve_backend, to_device, to_host
from ..core.pieces import as_array, piece, piece_template
from .backward_search import (DEFAULT_QUERY_BLOCK, DEFAULT_SOURCE_BLOCK, backward_search_cuda, backward_search_reference, check_block_sizes,
                              max_balanced_blocks, num_source_blocks, split_query_blocks_reference)
from . import method as ch
from . import grid_map
from . import hash_map
from .forward_search import forward_search_cuda, forward_search_reference, mirror_reference
from .map_probe import probe_cuda, probe_reference
from ..coords.output_coords import output_coordinates, output_coordinates_reference, start_output_keys
from .sorting import sort_rows_cuda, sort_rows_reference


def _lazy_identity(stored, coords, doc):
    """A property that reads ``self.<stored>`` and, when that is None (the identity),
    makes the identity permutation of ``self.<coords>``' rows once, on the same side."""
    def get(self):
        if getattr(self, stored) is None:
            c = getattr(self, coords)
            setattr(self, stored, array_module(c).arange(c.shape[0], dtype=np.int64))
        return getattr(self, stored)

    def set(self, value):
        setattr(self, stored, value)

    return property(get, set, doc=doc)


@dataclass
class KernelMap:
    """The kernel map of one layer and the layer facts the GMaS step needs.

    Arrays are of the kind the caller passed (NumPy or CuPy), except ``offsets``,
    which describe the layer, not the data, and stay on the host.
    """

    in_coords: object  # int32 (|P|, 3|4), sorted: the search's source order
    out_coords: object  # int32 (|Q|, 3|4), sorted: the search's query order
    _in_order: object  # int64 (|P|,), or None for the identity (see the in_order property)
    offsets: np.ndarray  # int32 (K, 3), sorted lexicographically (host)
    table: object  # int32 (K, |Q|): index into in_coords of out_coords[i] + offsets[k], or -1
    counts: object  # int64 (K,): pairs per offset, (table >= 0).sum(1)
    stats: dict = field(default_factory=dict)  # teaching numbers; see build_kernel_map
    kernel_size: tuple = (3, 3, 3)
    stride: tuple = (1, 1, 1)
    dilation: tuple = (1, 1, 1)
    tensor_stride: tuple = (1, 1, 1)  # of the input tensor
    out_tensor_stride: tuple = (1, 1, 1)  # of the output tensor
    _out_order: object = None  # int64 (|Q|,), or None for the identity (see out_order)
    is_transposed: bool = False  # True for the map made by transposed()
    counts_host: np.ndarray = field(default=None, repr=False)  # host copy of counts, once read
    # Device int32 (K, ceil(|Q| / chunk)): pairs per offset and chunk of outputs, counted
    # by the forward search for the metadata stage (None when not known: reference maps,
    # transposed maps). The chunk is numba_sc.gmas.metadata.chunk_size() of the machine. On a
    # GPU it is a numba_sc.core.pieces.Piece (a kernel argument; .get() reads it).
    chunk_counts: object = field(default=None, repr=False)
    chunk: int = field(default=None, repr=False)  # outputs per chunk of chunk_counts
    # Device int64 (ceil(K / 32), |Q|) and (ceil(K / 32), |P|): bit k % 32 of
    # out_masks[k // 32, i] is set when output i has a pair through offset k, of
    # in_masks[k // 32, j] when input j has one; set by the forward search for the
    # metadata stage (None when not known, as for chunk_counts). Pieces on a GPU.
    out_masks: object = field(default=None, repr=False)
    in_masks: object = field(default=None, repr=False)
    # Remembered by the GMaS step, not part of the map's value: the submanifold centre
    # (numba_sc.gmas.metadata.submanifold_centre) and, for a map passed to a layer again,
    # its latest plan with the policy it was built for (numba_sc.conv.prepare.layer_plan).
    known_centre: int = field(default=None, repr=False, compare=False)
    kept_plan: tuple = field(default=None, repr=False, compare=False)
    # The other dataflows' plans (numba_sc.conv.dataflow.dataflow_plan), kept like kept_plan: keyed by
    # (dataflow, transposed, skipped offset); and the transposed layer's table in weight order.
    kept_plans: dict = field(default_factory=dict, repr=False, compare=False)

    # The orders are the identity whenever the coordinates came in sorted, which is
    # always the case inside a network (every stage hands out sorted coordinates).
    # The kernel path then stores None and makes the arange only if someone reads
    # it: a library arange costs a launch and its host time, every layer
    # (docs/performance.md, "Orders that are the identity").
    in_order = _lazy_identity("_in_order", "in_coords",
                              "int64 (|P|,): ``in_coords == caller_in_coords[in_order]``.")
    out_order = _lazy_identity("_out_order", "out_coords",
                               "int64 (|Q|,): ``out_coords == caller_out_coords[out_order]``.")

    def host_counts(self) -> np.ndarray:
        """``counts`` on the host (int64), read from the device at most once.

        The kernel path reads them together with its error flags in the Map
        step's one final device->host copy, so for its maps this costs nothing.
        """
        if self.counts_host is None:
            self.counts_host = np.asarray(to_host(self.counts), dtype=np.int64)
        return self.counts_host

    def pairs(self, k):
        """(input indices, output indices) of the pairs of offset ``k``, both into the sorted arrays."""
        xp = array_module(self.table)
        out_idx = xp.flatnonzero(self.table[k] >= 0)
        return self.table[k][out_idx].astype(np.int64), out_idx

    def transposed(self) -> "KernelMap":
        """The map of the transposed convolution: inputs and outputs swapped.

        With ``T = m.transposed()`` and K offsets:

        * ``T.in_coords = m.out_coords``, ``T.out_coords = m.in_coords``, and so
          ``T.in_order = m.out_order``, ``T.out_order = m.in_order``;
        * ``T.offsets = -m.offsets[::-1]`` (still sorted lexicographically);
        * ``T.table[K-1-k, j] = i`` exactly when ``m.table[k, i] = j``, and
          ``T.counts = m.counts[::-1]``;
        * ``T.tensor_stride`` / ``T.out_tensor_stride`` are swapped; ``kernel_size``,
          ``stride`` and ``dilation`` stay those of the strided layer it inverts;
        * ``T.transposed()`` gives ``m`` back.

        So ``T`` obeys the usual rule (output ``p`` reads input ``p + T.offsets[k']``)
        and a transposed convolution with weight ``W`` uses ``W[K-1-k']`` for row ``k'``.
        Built with one scatter, on the device when the table is there; no sync.
        """
        xp = array_module(self.table)
        K, Q = self.table.shape
        P = self.in_coords.shape[0]
        t = xp.full(K * P + 1, -1, dtype=np.int32)  # one extra slot that catches all misses
        row = (K - 1 - xp.arange(K, dtype=np.int64))[:, None] * P
        dest = xp.where(self.table >= 0, row + self.table, K * P)
        src = xp.broadcast_to(xp.arange(Q, dtype=np.int32)[None, :], (K, Q))
        # Hits of one row go to distinct inputs (distinct outputs moved by the same
        # offset), so only the catch-all slot is written more than once.
        t[dest.ravel()] = src.ravel()
        counts = self.counts[::-1].copy()
        return KernelMap(
            self.out_coords, self.in_coords, self._out_order,
            np.ascontiguousarray(-self.offsets[::-1]), t[:-1].reshape(K, P), counts,
            {"transposed_from": dict(self.stats)}, self.kernel_size, self.stride, self.dilation,
            self.out_tensor_stride, self.tensor_stride, self._in_order, not self.is_transposed,
            None if self.counts_host is None else self.counts_host[::-1].copy())


# -------------------------------------------------------------- shared steps
def layer_arguments(kernel_size, stride, dilation, tensor_stride):
    """The layer's arguments as 3-tuples, with its sorted offsets (read-only, shared
    by every map of the layer) and key deltas.

    Remembered per argument tuple when the arguments are plain ints or tuples of
    ints (as they are in a network): every call of a layer asks the same, and the
    four checks are a noticeable share of the Map step's host time (measured:
    ``docs/performance.md``, "Caches: work done once per layer, not per call";
    the Map step's time: ``benchmarks/README.md``, "The Map step"). Anything else
    (NumPy numbers, arrays, bools, floats) is checked afresh every call.
    """
    args = (kernel_size, stride, dilation, tensor_stride)
    if all(type(a) is int or (type(a) is tuple and all(type(v) is int for v in a)) for a in args):
        return _plain_layer(*args)
    return _parse_layer(*args)


def _parse_layer(kernel_size, stride, dilation, tensor_stride):
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    st = cv.as_int_tuple(stride, "stride")
    dil = cv.as_int_tuple(dilation, "dilation")
    ts = cv.as_int_tuple(tensor_stride, "tensor_stride")
    return (ks, st, dil, ts, *_sorted_offsets(ks, dil, ts))


_plain_layer = lru_cache(maxsize=256)(_parse_layer)  # (a bad argument raises, and nothing is cached)


@lru_cache(maxsize=64)
def _sorted_offsets(ks, dil, ts):
    """Offsets and their key deltas, made and sorted once per layer configuration
    (paper Section 5.1.1, first reason), then reused by every call."""
    offsets = cv.kernel_offsets(ks, dil, ts)  # lexicographically sorted by construction
    deltas = np.ascontiguousarray(cv.key_delta(offsets), dtype=np.int64)
    assert np.all(np.diff(deltas) > 0), "kernel_offsets must list offsets in sorted order"
    offsets.setflags(write=False)  # shared by all calls: nobody may change them
    deltas.setflags(write=False)
    return offsets, deltas


def _device_deltas(ks, dil, ts, h=None):
    """The first ``h`` (default: all) key deltas on the current device, copied there
    once per layer configuration."""
    return _device_deltas_on(ks, dil, ts, device_id(), h)


@lru_cache(maxsize=64)
def _device_deltas_on(ks, dil, ts, device, h):
    return to_device(np.array(_sorted_offsets(ks, dil, ts)[1][:h]))


def _check_columns(in_coords, out_coords):
    """Inputs and outputs must be arrays that agree on the batch column (shapes only: no
    device read)."""
    for name, c in (("in_coords", in_coords), ("out_coords", out_coords)):
        if c is not None and not (hasattr(c, "shape") and hasattr(c, "dtype")):
            raise TypeError(f"{name} must be a NumPy or CuPy integer array (N, 3) or (N, 4), got "
                            f"{type(c).__name__}; e.g. np.asarray(coords, dtype=np.int32)")
    a, b = getattr(in_coords, "shape", ()), getattr(out_coords, "shape", ())
    if out_coords is not None and len(a) == 2 and len(b) == 2 and a[1] != b[1]:
        raise ValueError(
            f"out_coords has {b[1]} columns but in_coords has {a[1]}; both must be (N, 3), "
            "or both (N, 4) with the batch index in column 0")


def _duplicate_error(name, n):
    return ValueError(
        f"{name} holds {n} repeated coordinate(s); a kernel map needs unique coordinates. "
        "De-duplicate first, e.g. with numba_sc.voxelize or np.unique(coords, axis=0)")


def _unsorted_error(name):
    return ValueError(
        f"{name} was passed with assume_sorted=True but is not sorted and unique (lexicographic "
        "on (batch, x, y, z)); pass assume_sorted=False and the Map step sorts it")


def searched_segments(offsets, submanifold, symmetric=True) -> int:
    """How many query segments the searches visit: ``h = ceil(K / 2)`` or all K.

    A submanifold layer (stride 1, the inputs are the queries) whose offsets come
    in pairs, ``offsets[K-1-k] == -offsets[k]`` (every odd kernel, with any
    dilation), finds each pair twice: ``q_i + delta_k = p_j`` exactly when
    ``q_j + delta_{K-1-k} = p_i``. Searching the first h segments and writing each
    hit twice (:func:`numba_sc.map.forward_search.mirror_reference`) halves both
    searches. This is not in the Minuet paper (spconv does the same for its
    hash table); ``symmetric=False`` runs the paper's algorithm over all K.
    """
    K = len(offsets)
    if symmetric and submanifold and np.array_equal(offsets[::-1], -offsets):
        return (K + 1) // 2
    return K


def _reaches(offsets, submanifold):
    """(source reach, query reach): queries ``q + delta`` must stay packable, so query
    keys are packed with the kernel's reach; the source only with its own range. For
    a submanifold layer one array is both, so it gets the reach."""
    reach = (tuple(int(v) for v in offsets.min(axis=0)), tuple(int(v) for v in offsets.max(axis=0)))
    return (reach if submanifold else ((0, 0, 0), (0, 0, 0))), reach


# ------------------------------------------------------------------ reference
def _sorted_reference(coords, reach, name, assume_sorted):
    """Stage 3 on the host: pack (validating shape, dtype, range), sort, check unique."""
    keys = cv.pack_keys_reference(coords, reach[0], reach[1], name=name)
    skeys, order, scoords, dups = sort_rows_reference(keys, coords)
    if dups:
        raise _duplicate_error(name, dups)
    if assume_sorted and np.any(order != np.arange(len(order))):
        raise _unsorted_error(name)
    return skeys, order, scoords


def build_kernel_map_reference(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1,
                               out_coords=None, source_block=DEFAULT_SOURCE_BLOCK, query_block=DEFAULT_QUERY_BLOCK,
                               assume_sorted=False, symmetric=True, masks=False, method="sorted") -> KernelMap:
    """The Map step in vectorized NumPy, with the comparisons of both searches (or the
    probes of the hash table, the reads of the grid) counted."""
    B, C = check_block_sizes(source_block, query_block)
    method = check_method(method)
    ks, st, dil, ts, offsets, deltas = layer_arguments(kernel_size, stride, dilation, tensor_stride)
    in_coords, out_coords = to_host(in_coords), to_host(out_coords)
    _check_columns(in_coords, out_coords)
    submanifold = out_coords is None and st == (1, 1, 1)
    source_reach, query_reach = _reaches(offsets, submanifold)
    skeys, in_order, in_sorted = _sorted_reference(in_coords, source_reach, "in_coords", assume_sorted)
    if submanifold:  # one sorted array is both the source and the query array
        qkeys, out_sorted, out_order = skeys, in_sorted, np.arange(len(skeys), dtype=np.int64)
    elif out_coords is None:  # strided layer, default outputs: already sorted and unique
        out_sorted = output_coordinates(in_sorted, st, ts, backend="reference")
        qkeys = cv.pack_keys(out_sorted, *query_reach, name="output coordinates")
        out_order = np.arange(len(qkeys), dtype=np.int64)
    else:
        qkeys, out_order, out_sorted = _sorted_reference(out_coords, query_reach, "out_coords", False)

    K, P, Q = len(offsets), len(skeys), len(qkeys)
    h = searched_segments(offsets, submanifold, symmetric)  # segments searched: K or ceil(K/2)
    if method != "sorted":
        return _lookup_reference(method, in_sorted, out_sorted, skeys, qkeys, in_order, out_order,
                                 offsets, deltas, h, ks, st, dil, ts)
    bounds, back_cmp = backward_search_reference(skeys, qkeys, deltas[:h], B)  # stage 5
    rows = split_query_blocks_reference(bounds, C)
    half, fwd_cmp = forward_search_reference(skeys, qkeys, deltas[:h], bounds, B)  # stage 6
    table = mirror_reference(half, K)  # the rows not searched, read off their mirrors
    counts = (table >= 0).sum(axis=1).astype(np.int64)

    sizes = np.diff(bounds, axis=1)
    queries = K * Q
    stats = {
        "backend": "reference", "method": "sorted", "source_block": B, "query_block": C,
        "n_in": P, "n_out": Q, "n_offsets": K, "queries": queries,
        "segments_searched": h, "queries_searched": h * Q,
        "pairs": int(counts.sum()), "hit_rate": float(counts.sum()) / queries,
        "source_blocks": num_source_blocks(P, B),
        "query_blocks_before_balancing": h * num_source_blocks(P, B),
        "nonempty_query_blocks": int(np.count_nonzero(sizes)),
        "query_blocks_after_balancing": len(rows),
        "largest_query_block_before": int(sizes.max()),
        "largest_query_block_after": int((rows[:, 3] - rows[:, 2]).max()) if len(rows) else 0,
        "forward_grid_upper_bound": max_balanced_blocks(h, P, Q, B, C),
        "backward_comparisons": int(back_cmp), "forward_comparisons": int(fwd_cmp),
        "comparisons_per_query": (back_cmp + fwd_cmp) / queries,
        # what searching every query in the whole source array would cost
        "plain_binary_search_comparisons": queries * math.ceil(math.log2(P + 1)),
    }
    return _finish(in_sorted, out_sorted, in_order, offsets, table, counts, stats,
                   ks, st, dil, ts, out_order)


def _lookup_reference(method, in_sorted, out_sorted, skeys, qkeys, in_order, out_order, offsets, deltas, h,
                      ks, st, dil, ts):
    """The hash-table or dense-grid Map step in NumPy, with its probes (slot reads) counted."""
    K, P, Q = len(offsets), len(skeys), len(qkeys)
    if method == "hash":
        slot_keys, slot_vals, build_probes = hash_map.build_reference(skeys)
        table, probes = probe_reference(lambda q: hash_map.lookup_reference(slot_keys, slot_vals, q),
                                        qkeys, deltas[:h], K)
        extra = {"capacity": len(slot_keys), "load_factor": P / len(slot_keys), "build_probes": build_probes,
                 "structure_bytes": 12 * len(slot_keys)}
    else:
        box, cells = grid_map.grid_box_reference(in_sorted)
        grid = grid_map.build_reference(skeys, box)
        table, probes = probe_reference(lambda q: grid_map.lookup_reference(grid, box, q), qkeys, deltas[:h], K)
        extra = {"cells": cells, "box": tuple(int(v) for v in box[3:7]), "structure_bytes": 4 * cells}
    counts = (table >= 0).sum(axis=1).astype(np.int64)
    stats = {"backend": "reference", "method": method, "n_in": P, "n_out": Q, "n_offsets": K, "queries": K * Q,
             "segments_searched": h, "queries_searched": h * Q, "pairs": int(counts.sum()),
             "hit_rate": float(counts.sum()) / max(K * Q, 1), "lookups": h * Q, "probes": probes,
             "probes_per_lookup": probes / max(h * Q, 1), **extra}
    return _finish(in_sorted, out_sorted, in_order, offsets, table, counts, stats, ks, st, dil, ts, out_order)


METHODS = ("sorted", "hash", "grid")


def check_method(method):
    """The ``method`` argument of the Map step: one of :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (Minuet's sorted search, a hash table, a dense "
                         f"grid), got {method!r}")
    return method


# -------------------------------------------------------------------- kernels
# The kernel path's device->host traffic is one small int64 array, the *report*,
# read once when the map is done:
REPORT_IN = 0  # report[0:3]: in_coords flags: out of range, unsorted, repeated rows
REPORT_OUT = 3  # report[3:6]: the same for the query (output) coordinates
REPORT_ROWS = 6  # report[6]: balanced query blocks
REPORT_NOUT = 7  # report[7]: the outputs a strided layer counted on the device (else 0)
REPORT_COUNTS = 8  # report[8:]: pairs per offset


@lru_cache(maxsize=64)
def _search_plan(ks, dil, ts, submanifold, symmetric):
    """What a layer configuration decides once: segments searched, reaches, device deltas.

    Cached because every call of a layer asks the same questions, and on a small
    cloud the host's few microseconds per question add up (the whole Map step of
    a 94k-voxel scan: ``benchmarks/README.md``, "The Map step").
    """
    offsets, _ = _sorted_offsets(ks, dil, ts)
    h = searched_segments(offsets, submanifold, symmetric)
    return h, _reaches(offsets, submanifold)


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
    (``counts``); the rest are :class:`numba_sc.core.pieces.Piece` s, kernel arguments only.
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


@lru_cache(maxsize=64)
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


def _check_report(report, sides):
    """Raise the first error the report records. ``sides``: (slot, coords, reach,
    name, assume_sorted) for each packed array. Range errors of every side come
    first: no sort can fix them (and an out-of-range row also looks unsorted)."""
    for slot, coords, reach, name, _ in sides:
        if report[slot + cv.FLAG_RANGE]:
            cv.raise_range_error(coords, reach[0], reach[1], name)
    for slot, coords, reach, name, assume_sorted in sides:
        if assume_sorted and report[slot + cv.FLAG_UNSORTED]:
            raise _unsorted_error(name)
        if report[slot + 2]:
            raise _duplicate_error(name, int(report[slot + 2]))


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
    ks, st, dil, ts, offsets, _ = layer_arguments(kernel_size, stride, dilation, tensor_stride)
    in_coords, out_coords = to_device(in_coords), to_device(out_coords)
    _check_columns(in_coords, out_coords)
    K = len(offsets)
    submanifold = out_coords is None and st == (1, 1, 1)
    h, (source_reach, query_reach) = _search_plan(ks, dil, ts, submanifold, symmetric)
    in_sorted = to_device(cv.validate_coords(in_coords, "in_coords", check_range=False))  # shape, dtype
    sides = [(REPORT_IN, in_coords, source_reach, "in_coords", assume_sorted)]
    out_sorted = in_sorted  # submanifold: one sorted array is both the source and the queries
    if not submanifold and out_coords is None and method == "sorted":
        return _start_counted(in_sorted, ks, st, dil, ts, offsets, h, source_reach, query_reach, sides, B, C, masks,
                              read)
    if not submanifold:
        if out_coords is None:  # strided layer, default outputs: sorted and unique already
            out_coords = output_coordinates(in_sorted, st, ts, backend="cuda")
            name, sorted_outputs = "output coordinates", True
        else:
            name, sorted_outputs = "out_coords", False
        out_sorted = to_device(cv.validate_coords(out_coords, name, check_range=False))
        sides.append((REPORT_OUT, out_coords, query_reach, name, sorted_outputs))
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
    m = _finish_cuda(in_sorted, out_sorted, None, offsets, table, work, ks, st, dil, ts, None)
    return PendingMap(m, read_later(work.report_read) if read else None, work, found, sides, submanifold, method,
                      d_deltas, (K, h, P, Q, B, C, masks))


def _start_counted(in_sorted, ks, st, dil, ts, offsets, h, source_reach, query_reach, sides, B, C, masks, read):
    """A strided layer's Map step with its outputs counted on the device: one read.

    The output keys are made as :func:`numba_sc.output_coordinates` makes them (pack
    the snapped coordinates, sort, de-duplicate), with the kernel's reach checked in
    the same pack, into the search's query keys; the count goes into the report.
    Every size is the upper bound |P| (a stride never makes more outputs than
    inputs), and the searches read the count on the device.
    """
    K, P = len(offsets), int(in_sorted.shape[0])
    work = _Work(K, h, P, P, B, C, chunk_size(), True, masks)
    out_all = start_output_keys(in_sorted, st, ts, work.flags_out, work.report_read, REPORT_NOUT, query_reach,
                                work.keys_out)  # the first |Q| rows are the outputs
    cv.launch_pack(in_sorted, *source_reach, work.keys_in, work.flags_in)
    d_deltas = _device_deltas(ks, dil, ts, h)
    table, found = _search_cuda(work.keys_in, work.keys_out, d_deltas, K, B, C, work, n_out=work.n_out)
    counted = (out_all, table, in_sorted, offsets, ks, st, dil, ts, query_reach)
    return PendingMap(None, read_later(work.report_read) if read else None, work, found, sides, False, "sorted",
                      d_deltas, (K, h, P, P, B, C, masks), counted)


def _counted_result(counted, work, rep):
    """The map of :func:`_start_counted` once its report is read: the outputs, table,
    chunk counts and masks viewed at their real size; and the error if the pack
    flagged an output (slow path: the outputs made again on the host to name it). An
    input out of range is left to :func:`_check_report`, which names the input."""
    out_all, table, in_sorted, offsets, ks, st, dil, ts, query_reach = counted
    if rep[REPORT_OUT + cv.FLAG_RANGE] and not rep[REPORT_IN + cv.FLAG_RANGE]:
        out = output_coordinates_reference(to_host(in_sorted), st, ts)  # raises if a snapped coordinate can't pack
        cv.raise_range_error(out, *query_reach, "output coordinates")
        raise AssertionError("the strided pack flagged an output the host check accepts")
    Q, K = int(rep[REPORT_NOUT]), len(offsets)
    out_sorted = out_all[:Q]
    m = _finish(in_sorted, out_sorted, None, offsets, table[:K * Q].reshape(K, Q), work.counts_array(), {},
                ks, st, dil, ts, None)
    m.chunk, (m.chunk_counts, m.out_masks) = work.chunk, work.counted_views(Q)
    m.in_masks = work.in_masks
    return m, out_sorted


class PendingMap:
    """A kernel map whose work is queued and whose report is on its way to the host
    (:func:`start_kernel_map_cuda`). ``.map`` has its device arrays (coordinates,
    table, counts on the device); :meth:`result` waits for the report, raises the
    errors it records (or sorts and searches again), and fills the host counts and
    the stats."""

    def __init__(self, m, finish_read, work, found, sides, submanifold, method, d_deltas, sizes, counted=None):
        self.map, self._read, self._work, self._found = m, finish_read, work, found
        self._sides, self._submanifold, self._method = sides, submanifold, method
        self._d_deltas, self._sizes, self._counted = d_deltas, sizes, counted

    @property
    def report(self):
        """The report on the device (int64: flags, balanced rows, pairs per offset)."""
        return self._work.report[:REPORT_COUNTS + self._sizes[0]]

    def result(self, report=None) -> KernelMap:
        """The finished map; ``report``: this map's report, read to the host by the
        caller (needed when it was started with ``read=False``)."""
        m, work, found, sides, method = self.map, self._work, self._found, self._sides, self._method
        K, h, P, Q, B, C, masks = self._sizes
        submanifold = self._submanifold
        rep = self._read() if report is None else np.asarray(report)
        if self._counted is not None:  # a strided layer's outputs, counted on the device: now |Q| is known
            m, out_sorted = _counted_result(self._counted, work, rep)
            Q = out_sorted.shape[0]
            sides = sides + [(REPORT_OUT, out_sorted, self._counted[-1], "output coordinates", True)]
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
            table, found = _find_pairs(method, skeys, qkeys, in_sorted, self._d_deltas, K, B, C, work)
            m = _finish_cuda(in_sorted, out_sorted, in_order, m.offsets, table, work, m.kernel_size, m.stride,
                             m.dilation, m.tensor_stride, out_order)
            rep = to_host(work.report_read)
            _check_report(rep, [(slot, c, r, n, False) for slot, c, r, n, _ in sides])  # repeated rows
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


def _find_pairs(method, skeys, qkeys, in_sorted, d_deltas, K, B, C, work):
    """Stages 5-6 by ``method``: ``(table, what the stats report)``: the forward
    search's grid for "sorted", the hash table's slot keys or the grid for the others."""
    if method == "sorted":
        return _search_cuda(skeys, qkeys, d_deltas, K, B, C, work)
    return _lookup_cuda(method, skeys, qkeys, in_sorted, d_deltas, K, work)


def _finish(in_sorted, out_sorted, in_order, offsets, table, counts, stats, ks, st, dil, ts, out_order):
    return KernelMap(in_sorted, out_sorted, in_order, offsets, table, counts, stats, ks, st, dil, ts,
                     tuple(a * b for a, b in zip(ts, st)), out_order)


def _finish_cuda(in_sorted, out_sorted, in_order, offsets, table, work, ks, st, dil, ts, out_order):
    """The kernel path's map, with the device arrays of ``work`` it hands on (stats
    and host counts come after the report is read)."""
    m = _finish(in_sorted, out_sorted, in_order, offsets, table, work.counts_array(), {}, ks, st, dil, ts, out_order)
    m.chunk_counts, m.chunk = work.chunk_counts, work.chunk
    m.out_masks, m.in_masks = work.out_masks, work.in_masks
    return m


# ----------------------------------------------------------------------- API
def build_kernel_map(in_coords: cv.Array, kernel_size: cv.IntOr3 = 3, stride: cv.IntOr3 = 1,
                     dilation: cv.IntOr3 = 1, tensor_stride: cv.IntOr3 = 1, out_coords: cv.Array | None = None,
                     backend: str | None = None, source_block: int = DEFAULT_SOURCE_BLOCK,
                     query_block: int = DEFAULT_QUERY_BLOCK, assume_sorted: bool = False, symmetric: bool = True,
                     masks: bool = False, while_reading=None, method: str = "auto") -> KernelMap:
    """Build the kernel map of a sparse convolution (Minuet's Map step, or an alternative).

    Parameters
    ----------
    in_coords : int array (N, 3) or (N, 4)
        Unique input voxel coordinates (batch index in column 0 for (N, 4)); any
        order. Clouds of different batch indices never share a pair.
    kernel_size, stride, dilation : int or 3 ints
        The layer. Offsets are :func:`numba_sc.kernel_offsets`
        ``(kernel_size, dilation, tensor_stride)``.
    tensor_stride : int or 3 ints
        Stride of the input tensor; the output's is ``tensor_stride * stride``.
    out_coords : int array (M, 3|4), optional
        Output coordinates. Default: ``output_coordinates(in_coords, stride,
        tensor_stride)``, which is the input itself for stride 1.
    backend : None | "cuda" | "reference"
    source_block : int
        B, keys per source block: a power of two in 32..4096 (default 512, the fastest in our sweep).
    query_block : int
        C, the largest balanced query block (default 1024).
    assume_sorted : bool
        The caller vouches that ``in_coords`` are sorted and unique (a
        :class:`numba_sc.SparseTensor`'s coordinates are): input that is not
        raises a ValueError instead of being sorted. Either way sorted input
        costs no sort, and unsorted input without the promise costs one sort
        and a second search (the first, optimistic one finds out).
    symmetric : bool
        For a submanifold layer whose offsets come in ± pairs (any odd kernel),
        search only the first ``ceil(K / 2)`` segments and write each pair found
        twice, once for ``delta`` and once, mirrored, for ``-delta``
        (:func:`searched_segments`). The table is the same; the searches do half
        the work. ``False`` searches all K segments, as in the paper.
    masks : bool
        Also record, for every output and every input, which offsets have a pair
        there (``.out_masks``, ``.in_masks``: bits set by the forward search where
        it finds the pairs), for the metadata stage of a layer
        (:mod:`numba_sc.gmas.metadata`), which otherwise reads the whole table once
        more to find them. :func:`numba_sc.sparse_conv3d` asks for them; the Map
        step alone does not need them (on 1M random voxels they cost ~10 % of
        the step). Kernel path only: the reference ignores it.
    method : "sorted" | "hash" | "grid" | "auto"
        How the pairs are found; every method gives the same map.
        ``"sorted"``: Minuet's sorted queries and double-traversed binary search.
        ``"hash"``: an open-addressing hash table of the input keys and one lookup
        per query and offset, as spconv and TorchSparse do (:mod:`numba_sc.map.hash_map`).
        ``"grid"``: a dense location table over the inputs' bounding box, one read
        per lookup (:mod:`numba_sc.map.grid_map`; refused when the box is too large).
        ``"auto"`` (the default): the method :func:`choose_map_method` measured
        fastest for clouds of this size, else the rule of thumb of
        :mod:`numba_sc.map.method`.
        ``source_block`` and ``query_block`` matter to "sorted" only.
    while_reading : callable, optional
        Kernel path with ``assume_sorted=True`` only (ignored otherwise): called
        with the map once its arrays are queued and the copy of its report to
        the host has started, before the host waits for that copy. Work queued
        there runs on the GPU right after the search, while the host is still
        reading the report: :func:`numba_sc.sparse_conv3d` queues the submanifold
        centre product there, which needs the map's coordinates but not its
        counts. The map's counts, stats and error checks are not ready at that
        point (an error is raised after the call).

    Returns
    -------
    KernelMap
        ``table[k, i]`` is the index into ``.in_coords`` of the input at
        ``.out_coords[i] + .offsets[k]``, or -1. ``.stats`` holds teaching numbers:
        sizes, pairs and ``hit_rate``, query blocks before and after balancing and,
        from the reference only, the comparisons of the backward and forward
        searches (``backward_comparisons``, ``forward_comparisons``,
        ``comparisons_per_query``, and ``plain_binary_search_comparisons`` for
        contrast). On the kernel path, numbers that live on the device are 0-d
        arrays; ``float()`` / ``int()`` reads them.
    """
    _check_columns(in_coords, out_coords)
    if method == "auto":
        method = auto_map_method(in_coords.shape[0], kernel_size, stride, dilation, tensor_stride)
    kw = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, tensor_stride=tensor_stride,
              out_coords=out_coords, source_block=source_block, query_block=query_block,
              assume_sorted=assume_sorted, symmetric=symmetric, masks=masks, method=method)
    if resolve_backend(backend) == "reference":
        m = build_kernel_map_reference(in_coords, **kw)
    else:
        m = build_kernel_map_cuda(in_coords, while_reading=while_reading, **kw)
    if is_cupy(in_coords) and not simulating():
        return m  # every array is on the device already: nothing to convert
    for name in ("in_coords", "out_coords", "_in_order", "table", "counts", "_out_order"):
        setattr(m, name, like(getattr(m, name), in_coords))
    m.stats = {key: like(v, in_coords) if hasattr(v, "shape") else v for key, v in m.stats.items()}
    return m


def auto_map_method(n, kernel_size=3, stride=1, dilation=1, tensor_stride=1) -> str:
    """What ``method="auto"`` runs for ``n`` inputs and this layer: the method
    :func:`choose_map_method` measured for clouds of this size, else the rule of thumb."""
    return ch.map_method_for(n, lambda: len(layer_arguments(kernel_size, stride, dilation, tensor_stride)[4]))


def choose_map_method(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1, rounds=5,
                      timer=None) -> ch.Choice:
    """Measure the Map methods on ``in_coords`` (sorted and unique, as a layer gets them)
    and cache the fastest for ``method="auto"`` on clouds of this size class.

    Each method is timed as :func:`build_kernel_map` with ``assume_sorted=True``
    (how a layer calls it), wall clock between device-wide synchronizes,
    ``rounds`` interleaved rounds. The grid is left out when the cloud's box
    does not fit. Without a GPU the rule of thumb answers and nothing is
    cached, unless ``timer(fn) -> seconds`` is given.
    """
    K = len(layer_arguments(kernel_size, stride, dilation, tensor_stride)[4])
    n = in_coords.shape[0]
    if timer is None and not simulating() and resolve_backend(None) == "cuda":
        timer = ch.wall_timer
    if timer is None:
        return ch.Choice(ch.rule_map_method(n, K), "rule")
    coords = to_device(in_coords)

    def run(m):
        return lambda: build_kernel_map(coords, kernel_size, stride, dilation, tensor_stride,
                                        assume_sorted=True, method=m)

    candidates = {}
    for m in ch.MAP_METHODS:
        try:
            run(m)()
        except ValueError:  # the grid of a cloud whose box does not fit
            continue
        candidates[m] = run(m)
    times = ch.measure(candidates, timer, rounds)
    choice = ch.Choice(min(times, key=times.get), "measured", times)
    ch.remember_map_method(n, K, choice)
    return choice

