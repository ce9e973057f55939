"""Exercises of notebook 04, the double-traversed binary search (stages 5 and 6).

4.1  the backward search's cut: each pivot's *upper* bound in a query segment;
4.2  balancing: a query block cut into pieces of at most C queries, evenly;
4.3  the forward search as a kernel, branch-free (the idea of ``forward_search_v2``).

Every checker works on a crop of the SemanticKITTI scan (170 points, about a hundred
voxels: the simulator runs each CUDA thread as a Python thread) with the small blocks
the notebook's ladder check uses (B = 32), so that the crop crosses several source
blocks and its last one is short, as on the whole scan. 4.3's kernel runs under the
recorder of :mod:`.races`, which sees each thread's reads of the shared block: a
branch-free search reads it the same number of times for every query.

The slips: the lower bound where the upper one is meant, and the number of source
blocks rounded down (4.1); ``size // C`` pieces, and pieces of C with a short
remainder (4.2); padding smaller than the queries, a search whose steps depend on the
data, and no barrier between loading the block and searching it (4.3).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ...core.state import cached
from . import ExerciseFailed, Slip, exercise, expect_equal, expect_no_race, recorded_launch
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
BOUNDS_RULE = ("bounds[k, j + 1] is where query block (k, j) ends in segment k: the first position whose "
               "query is greater than pivot j, the last key of source block j (the upper bound: a query "
               "equal to a pivot belongs to that pivot's block). There are ceil(len(skeys) / B) source "
               "blocks, the last one maybe short, and bounds[k, 0] = 0")


def _pivots(skeys, B, nb):
    return skeys[np.minimum(np.arange(1, nb + 1) * B, len(skeys)) - 1]


def _lower_bounds(skeys, qkeys, deltas, B):
    """A plausible slip: the paper's lower bound of each pivot (the first query >= it),
    with the library's pivot, the *last* key of a block."""
    nb = -(-len(skeys) // B)
    bounds = np.zeros((len(deltas), nb + 1), np.int64)
    for k, d in enumerate(deltas):
        bounds[k, 1:] = np.searchsorted(qkeys + d, _pivots(skeys, B, nb), side="left")
    return bounds


def _whole_blocks_only(skeys, qkeys, deltas, B):
    """A plausible slip: ``len(skeys) // B`` source blocks, so a short last block has no
    query block and its queries are never searched."""
    nb = len(skeys) // B
    bounds = np.zeros((len(deltas), nb + 1), np.int64)
    for k, d in enumerate(deltas):
        bounds[k, 1:] = np.searchsorted(qkeys + d, _pivots(skeys, B, nb), side="right")
    return bounds


@exercise("4.1", "the backward search's cut", answer="query_block_bounds",
          wrong=[Slip(_lower_bounds, says="equal to a pivot"), Slip(_whole_blocks_only, says="ceil")])
def check_bounds(query_block_bounds):
    """``query_block_bounds(skeys, qkeys, deltas, B)`` against the stage's reference, on the
    crop's 27 segments with B = 32 and B = 64."""
    from ...map.backward_search import backward_search_reference

    keys, deltas = crop_keys()
    for B in (EXERCISE_B, 2 * EXERCISE_B):
        want, _ = backward_search_reference(keys, keys, deltas, B)
        got = query_block_bounds(keys.copy(), keys.copy(), deltas.copy(), B)

        def where(kj, B=B):
            k, j = kj
            if j == 0:
                return "the start of the segment"
            pivot = keys[min(j * B, len(keys)) - 1]
            equal = int(np.sum(keys + deltas[k] == pivot))
            return f"after source block {j - 1}, pivot {pivot}" + (", which a query equals" if equal else "")

        expect_equal(got, want, f"B = {B}: bounds[k, j]", rule=BOUNDS_RULE, where=where)


# --------------------------------------------------------------------- 4.2
BALANCE_RULE = ("a query block of n queries becomes ceil(n / C) rows (k, j, start, end) that tile it "
                "exactly, none longer than C, and the rows of one block within one query of each other in "
                "length: as few thread blocks as C allows, each with about the same work")


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


def _pieces_of_c(bounds, C):
    """A plausible slip: pieces of exactly C and whatever remains, so the last thread block
    of a query block may have one query while the others have C."""
    rows = [(k, j, s, min(s + C, int(bounds[k, j + 1])))
            for k in range(bounds.shape[0]) for j in range(bounds.shape[1] - 1)
            for s in range(int(bounds[k, j]), int(bounds[k, j + 1]), C)]
    return np.array(rows, np.int64).reshape(-1, 4)


@exercise("4.2", "balanced query blocks", answer="balance",
          wrong=[Slip(_floor_pieces, says="ceil"), Slip(_pieces_of_c, says="within one query")])
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
            raise ExerciseFailed(f"C = {C}: balance returned shape {rows.shape}, expected (n, 4)", BALANCE_RULE)
        rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
        nb = bounds.shape[1] - 1
        for k in range(bounds.shape[0]):
            for j in range(nb):
                start, end = int(bounds[k, j]), int(bounds[k, j + 1])
                mine = rows[(rows[:, 0] == k) & (rows[:, 1] == j)]
                what = f"C = {C}, query block (k={k}, j={j}) = positions {start}:{end}"
                if len(mine) != -(-(end - start) // C):
                    raise ExerciseFailed(f"{what}: {len(mine)} rows, expected ceil({end - start} / {C}) = "
                                         f"{-(-(end - start) // C)}", BALANCE_RULE)
                if not len(mine):
                    continue
                edges = np.concatenate([mine[:, 2], mine[-1:, 3]])
                if edges[0] != start or edges[-1] != end or np.any(mine[1:, 2] != mine[:-1, 3]):
                    raise ExerciseFailed(f"{what}: its rows {mine[:, 2:].tolist()} do not tile it exactly",
                                         BALANCE_RULE)
                sizes = mine[:, 3] - mine[:, 2]
                if sizes.max() > C or sizes.max() - sizes.min() > 1:
                    raise ExerciseFailed(f"{what}: piece sizes {sizes.tolist()}, expected each at most {C} and "
                                         "all within one query of each other", BALANCE_RULE)


# --------------------------------------------------------------------- 4.3
STEPS = EXERCISE_B.bit_length() - 1  # log2 B halvings
SEARCH_RULE = ("table[k, i] is the row of skeys equal to qkeys[i] + deltas[k], found in source block j of the "
               "query's row, or stays -1. A short block is padded to B keys with a key larger than every "
               "query (never \"< q\"): padded with a small key, the first halvings jump into the padding and "
               "the block's real keys are never reached")
BRANCH_FREE_RULE = (f"branch-free: every query takes exactly log2 B = {STEPS} halving steps over the block "
                    f"padded to B = {EXERCISE_B} keys, one read of the block each, whatever its key and however "
                    "short the block (then at most one read to test the key it landed on). The steps do not "
                    "depend on the data, so the threads of a warp run them in lockstep; a while loop that "
                    "stops when lo meets hi takes a different number of steps for different queries")
BARRIER_RULE = ("the threads of a block load the source block into shared memory together, each a few keys; "
                "cuda.syncthreads() must stand between the loading and the searching, or a thread searches "
                "keys that another thread has not stored yet")


# The slips. Padded with 0, a key *smaller* than every query, where it needs one larger.
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


# v1's search: right, but its number of steps depends on the query and the block's length.
@cuda.jit
def _search_until_lo_meets_hi(skeys, qkeys, deltas, rows, table):
    r = cuda.blockIdx.x
    k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
    first = j * EXERCISE_B
    n = min(EXERCISE_B, skeys.shape[0] - first)
    source = cuda.shared.array(EXERCISE_B, int64)
    for t in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        source[t] = skeys[first + t]
    cuda.syncthreads()
    for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
        q = qkeys[i] + deltas[k]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if source[mid] < q:
                lo = mid + 1
            else:
                hi = mid
        if lo < n and source[lo] == q:
            table[k, i] = first + lo


# The right search without the barrier: a thread may search before the block is loaded.
@cuda.jit
def _no_barrier(skeys, qkeys, deltas, rows, table):
    r = cuda.blockIdx.x
    k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
    first = j * EXERCISE_B
    n = min(EXERCISE_B, skeys.shape[0] - first)
    source = cuda.shared.array(EXERCISE_B, int64)
    for t in range(cuda.threadIdx.x, EXERCISE_B, cuda.blockDim.x):
        source[t] = skeys[first + t] if t < n else 0x7FFFFFFFFFFFFFFF
    for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
        q = qkeys[i] + deltas[k]
        lo = 0
        for e in range(STEPS):
            half = EXERCISE_B >> (e + 1)
            if source[lo + half - 1] < q:
                lo += half
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


def _reads_per_query(rec, rows):
    """[(k, i, reads of the shared block, block, thread)] for every query (segment k, query
    i) a thread searched, in the order of k and i: a thread's reads of ``qkeys`` start its
    queries, and the shared reads that follow, up to its next query, are that query's.
    Thread block r searches row ``rows[r]``, whose first entry is k."""
    found, current = [], {}
    for a in rec.accesses():
        me = (a.block, a.thread)
        if a.array == "qkeys" and a.kind == "load":
            current[me] = [int(rows[a.block[0], 0]), a.element[0], 0, a.block, a.thread]
            found.append(current[me])
        elif a.array.startswith("shared array") and a.kind == "load" and me in current:
            current[me][2] += 1
    return sorted(tuple(q) for q in found)


@exercise("4.3", "a branch-free forward search", answer="forward_search_kernel",
          wrong=[Slip(_padded_with_zero, says="larger than every query"),
                 Slip(_search_until_lo_meets_hi, says="halving steps"),
                 Slip(_no_barrier, says="cuda.syncthreads()")])
def check_forward(forward_search_kernel):
    """Launch the answer as the forward search's ladder launches its rungs: one thread
    block per balanced row (B = 32), under the recorder of :mod:`.races`. No two threads
    may race (the shared block is loaded before it is searched), the table must equal
    the reference kernel map, and every query must read the shared block log2 B times
    (once more at most, to test the key it landed on). The simulator runs each CUDA
    thread as a Python thread, so the check searches the first 14 segments of the
    3x3x3 layer (those the library searches), not all 27."""
    from ...core.backend import to_host

    work, reference = forward_work()
    segs = work["half"]
    h = segs["deltas"].shape[0]
    keys = to_host(work["keys"])
    table = np.full(work["table_shape"], -1, np.int32)
    rec = recorded_launch(forward_search_kernel, "forward_search_kernel", segs["grid"], work["threads"],
                          {"skeys": keys, "qkeys": keys, "deltas": to_host(segs["deltas"]),
                           "rows": to_host(segs["rows"]), "table": table}, watch=("qkeys", "table"))
    expect_no_race(rec, BARRIER_RULE)
    n_blocks = -(-len(keys) // EXERCISE_B)

    def where(ki):
        j = min(int(np.searchsorted(keys, keys[ki[1]] + to_host(segs["deltas"])[ki[0]])) // EXERCISE_B, n_blocks - 1)
        short = len(keys) - j * EXERCISE_B
        return f"a query of source block {j}" + (f", the short last block of {short} keys" if short < EXERCISE_B
                                                 else "")

    expect_equal(table[:h], reference[:h], "table[k, i]", rule=SEARCH_RULE, where=where)
    for k, i, reads, block, thread in _reads_per_query(rec, to_host(segs["rows"])):
        if not STEPS <= reads <= STEPS + 1:
            raise ExerciseFailed(f"the query of segment k = {k}, position i = {i} (searched by "
                                 f"{rec.who(block, thread)}) read the shared block {reads} times, expected "
                                 f"{STEPS} (one per halving) or {STEPS + 1}", BRANCH_FREE_RULE)
