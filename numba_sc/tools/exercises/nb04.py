"""Exercises of notebook 04, the double-traversed binary search (stages 5 and 6).

4.1  the backward search's cut: each pivot's *upper* bound in a query segment;
4.2  balancing: a query block cut into pieces of at most C queries, evenly;
4.3  the forward search as a kernel, branch-free (the idea of ``forward_search_v2``).

Every checker works on a crop of the SemanticKITTI scan (170 points, about a hundred
voxels: the simulator runs each CUDA thread as a Python thread) with the small blocks
the notebook's ladder check uses (B = 32), so that the crop crosses several source
blocks and its last one is short, as on the whole scan.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ...core.state import cached
from . import ExerciseFailed, exercise, expect_equal
from .inputs import centre_crop

EXERCISE_B = 32  # the source block of the exercises (4.3's kernel sizes its shared array by it)
EXERCISE_C = 48  # the largest balanced block of 4.3's launch (a few dozen thread blocks)


@cached
def kitti_crop(n_points: int = 170) -> np.ndarray:
    """The voxel coordinates (0.05 m, sorted) of the ``n_points`` points of the scan nearest
    its centre: a patch of ground (170 points give 105 voxels: four source blocks of
    B = 32, the last one of 9 keys)."""
    return centre_crop(n_points)


@cached
def crop_keys():
    """The crop's packed keys (sorted: source array and queries of a submanifold layer)
    and the key deltas of a 3x3x3 kernel, the centre's (0) among them."""
    from ...core import conventions as cv

    offsets = cv.kernel_offsets(3)
    keys = cv.pack_keys(kitti_crop(), tuple(offsets.min(axis=0)), tuple(offsets.max(axis=0)))
    return keys, np.asarray(cv.key_delta(offsets), np.int64)


# --------------------------------------------------------------------- 4.1
def _lower_bounds(skeys, qkeys, deltas, B):
    """A plausible slip: the paper's lower bound of each pivot (the first query >= it),
    with the library's pivot, the *last* key of a block."""
    nb = -(-len(skeys) // B)
    pivots = skeys[np.minimum(np.arange(1, nb + 1) * B, len(skeys)) - 1]
    bounds = np.zeros((len(deltas), nb + 1), np.int64)
    for k, d in enumerate(deltas):
        bounds[k, 1:] = np.searchsorted(qkeys + d, pivots, side="left")
    return bounds


@exercise("4.1", "the backward search's cut", answer="query_block_bounds", wrong=_lower_bounds)
def check_bounds(query_block_bounds):
    """``query_block_bounds(skeys, qkeys, deltas, B)`` against the stage's reference, on the
    crop's 27 segments with B = 32 and B = 64."""
    from ...map.backward_search import backward_search_reference

    keys, deltas = crop_keys()
    for B in (EXERCISE_B, 2 * EXERCISE_B):
        want, _ = backward_search_reference(keys, keys, deltas, B)
        got = query_block_bounds(keys.copy(), keys.copy(), deltas.copy(), B)
        expect_equal(got, want, f"bounds[k, j] with B = {B} (k: segment, j: source block)")


# --------------------------------------------------------------------- 4.2
def _floor_pieces(bounds, C):
    """A plausible slip: ``size // C`` pieces, so a block smaller than C gets none and a
    larger one loses its remainder."""
    rows = []
    for k in range(bounds.shape[0]):
        for j in range(bounds.shape[1] - 1):
            start, size = int(bounds[k, j]), int(bounds[k, j + 1] - bounds[k, j])
            n = size // C
            rows += [(k, j, start + p * size // n, start + (p + 1) * size // n) for p in range(n)]
    return np.array(rows, np.int64).reshape(-1, 4)


@exercise("4.2", "balanced query blocks", answer="balance", wrong=_floor_pieces)
def check_balance(balance):
    """``balance(bounds, C)``: rows ``(k, j, start, end)``, in any order. Every query block
    (k, j) of n queries must become exactly ceil(n / C) rows that tile it, none longer
    than C and none longer than another of the same block by more than one query."""
    from ...map.backward_search import backward_search_reference

    keys, deltas = crop_keys()
    bounds, _ = backward_search_reference(keys, keys, deltas, EXERCISE_B)
    for C in (5, 8, 64):
        rows = np.asarray(balance(bounds.copy(), C), np.int64)
        if rows.ndim != 2 or rows.shape[1] != 4:
            raise ExerciseFailed(f"C = {C}: balance should return rows (k, j, start, end), shape (n, 4); "
                                 f"got shape {rows.shape}")
        rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
        nb = bounds.shape[1] - 1
        for k in range(bounds.shape[0]):
            for j in range(nb):
                start, end = int(bounds[k, j]), int(bounds[k, j + 1])
                mine = rows[(rows[:, 0] == k) & (rows[:, 1] == j)]
                what = f"C = {C}, query block (k={k}, j={j}) = positions {start}:{end}"
                if len(mine) != -(-(end - start) // C):
                    raise ExerciseFailed(f"{what}: {len(mine)} rows, expected ceil({end - start} / {C}) = "
                                         f"{-(-(end - start) // C)}")
                if not len(mine):
                    continue
                edges = np.concatenate([mine[:, 2], mine[-1:, 3]])
                if edges[0] != start or edges[-1] != end or np.any(mine[1:, 2] != mine[:-1, 3]):
                    raise ExerciseFailed(f"{what}: its rows {mine[:, 2:].tolist()} do not tile it exactly")
                sizes = mine[:, 3] - mine[:, 2]
                if sizes.max() > C or sizes.max() - sizes.min() > 1:
                    raise ExerciseFailed(f"{what}: piece sizes {sizes.tolist()}: each must be at most C and "
                                         "within one query of the others")


# --------------------------------------------------------------------- 4.3
# The wrong answer: the branch-free search over a short block padded with 0, a key
# *smaller* than every query, where it needs one larger than every query.
@cuda.jit
def _padded_with_zero(skeys, qkeys, deltas, rows, table):
    r = cuda.blockIdx.x
    k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
    first = j * EXERCISE_B
    n = min(EXERCISE_B, skeys.shape[0] - first)
    source = cuda.shared.array(EXERCISE_B, int64)
    for t in range(cuda.threadIdx.x, EXERCISE_B, cuda.blockDim.x):
        source[t] = skeys[first + t] if t < n else 0
    cuda.syncthreads()
    for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
        q = qkeys[i] + deltas[k]
        lo = 0
        half = EXERCISE_B // 2
        while half > 0:
            if source[lo + half - 1] < q:
                lo += half
            half //= 2
        if lo < n and source[lo] == q:
            table[k, i] = first + lo


@cached
def forward_work():
    """The forward search ladder's workload on the crop (keys, deltas, the balanced rows of
    all 27 segments, made by the backward search's kernel) and its reference table."""
    from ..ladder import Context
    from ...map import forward_search as fs

    ctx = Context(kitti_crop(), search_blocks=(EXERCISE_B, EXERCISE_C))
    if not 0 < len(ctx.coords) % EXERCISE_B < EXERCISE_B // 2:  # the crop is chosen so that it is
        raise AssertionError("the crop should end in a source block shorter than B / 2, whose search "
                             "reads the padding: the case 4.3's padding is for")
    work = fs.LADDER.workload(ctx)
    return work, fs.LADDER.reference(work)


@exercise("4.3", "a branch-free forward search", answer="forward_search_kernel", wrong=_padded_with_zero)
def check_forward(forward_search_kernel):
    """Launch the answer as the forward search's ladder launches its rungs: one thread
    block per balanced row (B = 32), and compare its table with the reference kernel
    map. The simulator runs each CUDA thread as a Python thread, so the check searches
    the first 14 segments of the 3x3x3 layer (those the library searches), not all 27."""
    from ...core.backend import filled, to_host
    from ...core.launch import simulator_pace

    work, reference = forward_work()
    segs = work["half"]
    h = segs["deltas"].shape[0]
    table = filled(work["table_shape"], np.int32, -1)
    with simulator_pace():
        forward_search_kernel[segs["grid"], work["threads"]](work["keys"], work["keys"], segs["deltas"],
                                                             segs["rows"], table)
    expect_equal(to_host(table)[:h], reference[:h], "table[k, i] (segment k, query i; -1: no input there)")
