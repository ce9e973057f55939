"""Exercises of notebook 03, why Minuet sorts its queries.

3.1 makes the query segments of a layer the way Minuet does (sort the outputs once,
the offsets once, add), from outputs and offsets handed over in no particular order;
3.2 searches them: a kernel with one thread per query that makes its query on the fly
and binary-searches the sorted source array, the simplest sorted-array Map step (the
double-traversed search of notebook 04 improves on it). Both run on the voxels of a
crop of a real scan, against the library's references.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...core.conventions import kernel_offsets, key_delta, pack_keys
from ...core.launch import THREADS, blocks_for, simulator_pace
from ...map.kernel_map import build_kernel_map_reference
from ...map.query_segments import query_segments_reference
from . import ExerciseFailed, exercise, expect_equal
from .inputs import crop_voxels


# -- 3.1 ------------------------------------------------------------------------------

def _segments_unsorted_outputs(out_coords, offsets):
    """Wrong: sorts the offsets but takes the outputs in the order given."""
    return np.sort(key_delta(offsets))[:, None] + pack_keys(out_coords)[None, :]


@exercise("3.1", "segmented query sorting", answer="query_segments", wrong=_segments_unsorted_outputs)
def check_query_segments(query_segments):
    """``query_segments(out_coords, offsets)`` -> int64 (K^3, |Q|), given a crop's voxels and
    a 3x3x3 kernel's offsets both shuffled: segment k must be the sorted output keys plus
    the k-th smallest key delta (:func:`numba_sc.map.query_segments.query_segments_reference`)."""
    coords = crop_voxels(200, seed=6)
    offsets = kernel_offsets(3)
    expected = query_segments_reference(pack_keys(coords), key_delta(offsets))
    rng = np.random.default_rng(6)
    got = np.asarray(query_segments(coords[rng.permutation(len(coords))], offsets[rng.permutation(len(offsets))]))
    if got.dtype != np.int64:
        raise ExerciseFailed(f"the segments have dtype {got.dtype}; keys are int64")
    expect_equal(got, expected, "segments[k, i] (sorted output i's key plus the k-th smallest key delta)")


# -- 3.2 ------------------------------------------------------------------------------

@cuda.jit
def _search_missing_last(src, qkeys, deltas, table):
    """Wrong: ``hi = n - 1`` with an exclusive upper end never looks at the last key."""
    t = cuda.grid(1)
    nq = qkeys.shape[0]
    if t < deltas.shape[0] * nq:
        k = t // nq
        i = t - k * nq
        q = qkeys[i] + deltas[k]
        lo, hi = 0, src.shape[0] - 1
        table[k, i] = -1
        while lo < hi:
            mid = (lo + hi) // 2
            if src[mid] == q:
                table[k, i] = mid
                break
            if src[mid] < q:
                lo = mid + 1
            else:
                hi = mid


@exercise("3.2", "one binary search per query, made on the fly", answer="search_kernel",
          wrong=_search_missing_last)
def check_search_kernel(search_kernel):
    """``search_kernel[grid, block](src, qkeys, deltas, table)``, one thread per query
    ``t = k * |Q| + i``, on a crop's submanifold 3x3x3 layer (``src`` and ``qkeys``: the
    same sorted keys): the table against the Map step's reference."""
    coords = crop_voxels(150, seed=7)
    offsets = kernel_offsets(3)
    keys = pack_keys(coords, reach_lo=offsets.min(axis=0), reach_hi=offsets.max(axis=0))
    deltas = key_delta(offsets)
    table = np.full((len(offsets), len(keys)), -2, np.int32)  # -2: a query no thread answered
    with simulator_pace():
        search_kernel[blocks_for(table.size), THREADS](keys, keys, deltas, table)
    expected = build_kernel_map_reference(coords, 3).table
    expect_equal(table, expected, "table[k, i] (the row of the input at output i + offset k, or -1)")
