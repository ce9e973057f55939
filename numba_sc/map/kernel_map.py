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

The modules around this one: :mod:`numba_sc.map.driver` is the library's fast
path (the kernels of stages 3-6 launched back to back, one device->host read);
:mod:`numba_sc.map.method` decides between the sorted search, a hash table and a
dense grid; :func:`numba_sc.map.map_step.build_kernel_map` is the one entry,
which picks the method and runs this module's reference or the driver. This
module holds what both paths share: the map's type, the layer's arguments and
the checks of the coordinates, and the NumPy reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..core import conventions as cv
from ..core.device import array_module
from ..core.backend import to_host
from ..core.pieces import as_array
from ..core.state import cached
from .backward_search import (DEFAULT_QUERY_BLOCK, DEFAULT_SOURCE_BLOCK, backward_search_reference, check_block_sizes,
                              max_balanced_blocks, num_source_blocks, split_query_blocks_reference)
from . import grid_map
from . import hash_map
from .forward_search import forward_search_reference, mirror_reference
from .map_probe import probe_reference
from ..coords.output_coords import output_coordinates
from .sorting import sort_rows_reference


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
class FoundWithPairs:
    """What the library's forward search finds with the pairs, handed to the metadata
    stage as the kernels take them: on a GPU, pieces of the Map step's one allocation
    (:class:`numba_sc.core.pieces.Piece`), because a CuPy array made of each would cost
    host time on every layer and every launch that reads it. A user reads them as
    arrays through :class:`KernelMap`'s ``chunk_counts``, ``chunk``, ``out_masks``
    and ``in_masks``."""

    chunk: int  # outputs per chunk of chunk_counts
    chunk_counts: object  # int32 (K, ceil(|Q| / chunk)): pairs per offset and chunk of outputs
    out_masks: object = None  # int64 (ceil(K / 32), |Q|), or None (masks not asked for)
    in_masks: object = None  # int64 (ceil(K / 32), |P|), or None


@dataclass
class KernelMap:
    """The kernel map of one layer and the layer facts the GMaS step needs.

    Arrays are of the kind the caller passed (NumPy or CuPy), except ``offsets``,
    which describe the layer, not the data, and stay on the host. Every field
    below is a NumPy or CuPy array (or a plain value), never a
    :class:`numba_sc.core.pieces.Piece`: later stages read them with plain
    attribute access.
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

    # Found by the library's forward search with the pairs (numba_sc.map.driver), for
    # the metadata stage of the layer (numba_sc.gmas.metadata.metadata_cuda), which
    # otherwise counts them from the table; None when not known (reference maps,
    # transposed maps, maps from elsewhere). Read them as arrays through the
    # properties chunk_counts, chunk, out_masks and in_masks below.
    found: "FoundWithPairs" = field(default=None, repr=False, compare=False)

    # Remembered by the later stages, not part of the map's value (not compared):
    #
    # The submanifold centre offset, or -1 when there is none (set by
    # numba_sc.gmas.layout.submanifold_centre the first time it is asked).
    known_centre: int = field(default=None, repr=False, compare=False)
    # For a map passed to a layer again: its latest GMaS plan with the policy it was
    # built for, (key, plan) (numba_sc.conv.prepare.layer_plan).
    kept_plan: tuple = field(default=None, repr=False, compare=False)
    # The other dataflows' plans (numba_sc.conv.dataflow.dataflow_plan), kept like kept_plan, keyed by
    # (dataflow, transposed, skipped offset); and under "transposed table" the
    # transposed layer's table in weight order.
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

    @property
    def chunk_counts(self):
        """int32 (K, ceil(|Q| / chunk)) on the device: pairs per offset and chunk of
        outputs, counted by the forward search (None when not known: ``found``)."""
        return None if self.found is None else as_array(self.found.chunk_counts)

    @property
    def chunk(self):
        """Outputs per chunk of :attr:`chunk_counts`
        (:func:`numba_sc.core.conventions.chunk_size` of the machine), or None."""
        return None if self.found is None else self.found.chunk

    @property
    def out_masks(self):
        """int64 (ceil(K / 32), |Q|) on the device: bit ``k % 32`` of ``[k // 32, i]`` set
        when output i has a pair through offset k (``build_kernel_map(masks=True)``), or None."""
        return None if self.found is None or self.found.out_masks is None else as_array(self.found.out_masks)

    @property
    def in_masks(self):
        """int64 (ceil(K / 32), |P|): the same for the inputs, or None."""
        return None if self.found is None or self.found.in_masks is None else as_array(self.found.in_masks)

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
            stats={"transposed_from": dict(self.stats)}, kernel_size=self.kernel_size, stride=self.stride,
            dilation=self.dilation, tensor_stride=self.out_tensor_stride, out_tensor_stride=self.tensor_stride,
            _out_order=self._in_order, is_transposed=not self.is_transposed,
            counts_host=None if self.counts_host is None else self.counts_host[::-1].copy())



# ------------------------------------------------------- the layer's arguments
class Layer(NamedTuple):
    """A layer's arguments as the Map step uses them (:func:`layer_arguments`)."""

    kernel_size: tuple  # 3 ints
    stride: tuple
    dilation: tuple
    tensor_stride: tuple  # of the input tensor
    offsets: np.ndarray  # int32 (K, 3), sorted lexicographically, read-only
    deltas: np.ndarray  # int64 (K,): the offsets' key deltas, increasing, read-only


def layer_arguments(kernel_size, stride, dilation, tensor_stride) -> Layer:
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
    return Layer(ks, st, dil, ts, *sorted_offsets(ks, dil, ts))


_plain_layer = cached(_parse_layer, maxsize=256)  # (a bad argument raises, and nothing is cached)


@cached(maxsize=64)
def sorted_offsets(ks, dil, ts):
    """``(offsets, deltas)``: the offsets and their key deltas, made and sorted once
    per layer configuration (paper Section 5.1.1, first reason), then reused by
    every call."""
    offsets = cv.kernel_offsets(ks, dil, ts)  # lexicographically sorted by construction
    deltas = np.ascontiguousarray(cv.key_delta(offsets), dtype=np.int64)
    assert np.all(np.diff(deltas) > 0), "kernel_offsets must list offsets in sorted order"
    offsets.setflags(write=False)  # shared by all calls: nobody may change them
    deltas.setflags(write=False)
    return offsets, deltas


MAP_METHODS = ("sorted", "hash", "grid")  # how the pairs are found (numba_sc.map.method chooses)


def check_method(method):
    """The ``method`` argument of the Map step: one of :data:`MAP_METHODS`."""
    if method not in MAP_METHODS:
        raise ValueError(f"method must be one of {MAP_METHODS} (Minuet's sorted search, a hash table, a dense "
                         f"grid), got {method!r}")
    return method


def check_columns(in_coords, out_coords):
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


def duplicate_error(name, n):
    return ValueError(
        f"{name} holds {n} repeated coordinate(s); a kernel map needs unique coordinates. "
        "De-duplicate first, e.g. with numba_sc.voxelize or np.unique(coords, axis=0)")


def unsorted_error(name):
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




class Reaches(NamedTuple):
    """How far the packed keys of each side must reach: ``(lowest, highest)`` offsets."""

    source: tuple  # ((3 ints), (3 ints)): the inputs'
    query: tuple  # the queries' (outputs'): the kernel's reach


def reaches(offsets, submanifold) -> Reaches:
    """Queries ``q + delta`` must stay packable, so query keys are packed with the
    kernel's reach; the source only with its own range. For a submanifold layer one
    array is both, so it gets the reach."""
    reach = (tuple(int(v) for v in offsets.min(axis=0)), tuple(int(v) for v in offsets.max(axis=0)))
    return Reaches(reach if submanifold else ((0, 0, 0), (0, 0, 0)), reach)


def assemble_map(in_sorted, out_sorted, in_order, offsets, table, counts, stats, layer, out_order) -> KernelMap:
    """The :class:`KernelMap` of ``layer`` (a :class:`Layer`) from the step's arrays."""
    ks, st, dil, ts = layer.kernel_size, layer.stride, layer.dilation, layer.tensor_stride
    return KernelMap(in_sorted, out_sorted, in_order, offsets, table, counts, stats, ks, st, dil, ts,
                     tuple(a * b for a, b in zip(ts, st)), out_order)


# ------------------------------------------------------------------ reference
def _sorted_reference(coords, reach, name, assume_sorted):
    """Stage 3 on the host: pack (validating shape, dtype, range), sort, check unique."""
    keys = cv.pack_keys_reference(coords, reach[0], reach[1], name=name)
    skeys, order, scoords, dups = sort_rows_reference(keys, coords)
    if dups:
        raise duplicate_error(name, dups)
    if assume_sorted and np.any(order != np.arange(len(order))):
        raise unsorted_error(name)
    return skeys, order, scoords


def build_kernel_map_reference(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1,
                               out_coords=None, source_block=DEFAULT_SOURCE_BLOCK, query_block=DEFAULT_QUERY_BLOCK,
                               assume_sorted=False, symmetric=True, masks=False, method="sorted") -> KernelMap:
    """The Map step in vectorized NumPy, with the comparisons of both searches (or the
    probes of the hash table, the reads of the grid) counted."""
    B, C = check_block_sizes(source_block, query_block)
    method = check_method(method)
    layer = layer_arguments(kernel_size, stride, dilation, tensor_stride)
    st, ts, offsets, deltas = layer.stride, layer.tensor_stride, layer.offsets, layer.deltas
    in_coords, out_coords = to_host(in_coords), to_host(out_coords)
    check_columns(in_coords, out_coords)
    submanifold = out_coords is None and st == (1, 1, 1)
    source_reach, query_reach = reaches(offsets, submanifold)
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
                                 offsets, deltas, h, layer)
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
    return assemble_map(in_sorted, out_sorted, in_order, offsets, table, counts, stats, layer, out_order)


def _lookup_reference(method, in_sorted, out_sorted, skeys, qkeys, in_order, out_order, offsets, deltas, h,
                      layer):
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
    return assemble_map(in_sorted, out_sorted, in_order, offsets, table, counts, stats, layer, out_order)
