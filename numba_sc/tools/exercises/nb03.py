"""Exercises of notebook 03, why Minuet sorts its queries.

3.1 makes the query segments of a layer the way Minuet does (sort the outputs once,
the offsets once, add), from outputs and offsets handed over in no particular order;
3.2 searches them: a kernel with one thread per query that makes its query on the fly
and binary-searches the sorted source array, the simplest sorted-array Map step (the
double-traversed search of notebook 04 improves on it). Both run on the voxels of a
crop of a real scan, against the library's references; 3.2's kernel runs under the
recorder of :mod:`.races`, which tells which thread wrote each entry of the table, so
that the numbering the exercise asks for (neighbouring threads, neighbouring sorted
queries of one segment) is checked, not only the table.

The slips: the outputs or the offsets taken in the order given (3.1), keys in int32,
a binary search whose upper end leaves out the last key, and threads numbered
offset-fastest, so that a warp takes one query's 27 offsets instead of 32 neighbouring
queries (3.2).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...core.conventions import kernel_offsets, key_delta, pack_keys
from ...core.launch import THREADS, blocks_for
from ...map.kernel_map import build_kernel_map_reference
from ...map.query_segments import query_segments_reference
from . import ExerciseFailed, Slip, exercise, expect_equal, expect_no_race, recorded_launch
from .inputs import crop_voxels


# -- 3.1 ------------------------------------------------------------------------------

SEGMENTS_RULE = ("segment k is the sorted output keys plus the k-th smallest key delta: sort the |Q| "
                 "outputs once and the K^3 key deltas once (the orders you are handed are no order at all), "
                 "then add; adding a constant keeps a sorted row sorted. Keys are int64")


def _segments_unsorted_outputs(out_coords, offsets):
    """Wrong: sorts the offsets but takes the outputs in the order given."""
    return np.sort(key_delta(offsets))[:, None] + pack_keys(out_coords)[None, :]


def _segments_unsorted_offsets(out_coords, offsets):
    """Wrong: sorts the outputs but takes the offsets in the order given."""
    return key_delta(offsets)[:, None] + np.sort(pack_keys(out_coords))[None, :]


def _segments_int32(out_coords, offsets):
    """Wrong: the keys cut to int32 (a packed key needs 64 bits)."""
    return (np.sort(key_delta(offsets))[:, None] + np.sort(pack_keys(out_coords))[None, :]).astype(np.int32)


@exercise("3.1", "segmented query sorting", answer="query_segments",
          wrong=[Slip(_segments_unsorted_outputs, says="sorted output keys"),
                 Slip(_segments_unsorted_offsets, says="k-th smallest key delta"),
                 Slip(_segments_int32, says="int64")])
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
        raise ExerciseFailed(f"the segments have dtype {got.dtype}, expected int64", SEGMENTS_RULE)
    expect_equal(got, expected, "segments[k, i]", rule=SEGMENTS_RULE)


# -- 3.2 ------------------------------------------------------------------------------

SEARCH_RULE = ("table[k, i] is the position in src of the key qkeys[i] + deltas[k], or -1 when src does "
               "not hold it. A binary search over the half-open range [lo, hi) starts with hi = len(src), "
               "or the last key is never looked at")
NUMBERING_RULE = ("one thread per query, numbered t = k * |Q| + i (query i fastest): the 32 threads of a warp "
                  "then take 32 consecutive sorted queries of one segment, whose binary searches walk almost "
                  "the same path through src, the locality that sorting the queries buys. Thread t writes "
                  "table[k, i], and no other thread does")


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


@cuda.jit
def _search_offset_fastest(src, qkeys, deltas, table):
    """Wrong: t = i * K^3 + k, so a warp takes one query's offsets, whose keys lie far
    apart in src: the right table, without the locality the exercise is about."""
    t = cuda.grid(1)
    nk = deltas.shape[0]
    if t < nk * qkeys.shape[0]:
        i = t // nk
        k = t - i * nk
        q = qkeys[i] + deltas[k]
        lo, hi = 0, src.shape[0]
        while lo < hi:
            mid = (lo + hi) // 2
            if src[mid] < q:
                lo = mid + 1
            else:
                hi = mid
        table[k, i] = lo if lo < src.shape[0] and src[lo] == q else -1


@exercise("3.2", "one binary search per query, made on the fly", answer="search_kernel",
          wrong=[Slip(_search_missing_last, says="last key"), Slip(_search_offset_fastest, says="consecutive")])
def check_search_kernel(search_kernel):
    """``search_kernel[grid, block](src, qkeys, deltas, table)``, one thread per query
    ``t = k * |Q| + i``, on a crop's submanifold 3x3x3 layer (``src`` and ``qkeys``: the
    same sorted keys): the table against the Map step's reference, and, from the record
    of who wrote what, that thread t wrote table[k, i]."""
    coords = crop_voxels(150, seed=7)
    offsets = kernel_offsets(3)
    keys = pack_keys(coords, reach_lo=offsets.min(axis=0), reach_hi=offsets.max(axis=0))
    deltas = key_delta(offsets)
    table = np.full((len(offsets), len(keys)), -2, np.int32)  # -2: a query no thread answered
    rec = recorded_launch(search_kernel, "search_kernel", blocks_for(table.size), THREADS,
                          {"src": keys, "qkeys": keys, "deltas": deltas, "table": table}, watch=("table",))
    expect_no_race(rec, NUMBERING_RULE)
    expected = build_kernel_map_reference(coords, 3).table
    expect_equal(table, expected, "table[k, i]", rule=SEARCH_RULE,
                 where=lambda ki: f"the query of output {ki[1]} through offset {tuple(offsets[ki[0]].tolist())}")
    nq = len(keys)
    for (k, i), who in sorted(rec.writers("table").items()):
        if set(who) != {k * nq + i}:
            by = ", ".join(map(str, sorted(set(who))))
            raise ExerciseFailed(f"table[k={k}, i={i}] was written by thread {by}, expected by thread k * |Q| + i = "
                                 f"{k * nq + i} (|Q| = {nq})", NUMBERING_RULE)
