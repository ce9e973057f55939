"""Stage 5, backward binary search: cut every query segment into query blocks.

The source array (sorted input keys, ``|P|`` of them) is cut into *source
blocks* of ``B`` keys (the last one may be shorter). The last key of each block is
its *pivot*. Instead of searching each query in the whole source array, Minuet
turns the search around (paper Section 5.1.2, Figure 11 steps 1-2): each pivot is
searched in each sorted query segment. Because both are sorted, the queries of
segment ``k`` that can only match inside source block ``j`` are one contiguous
run, the *query block* ``(k, j)``::

    query block (k, j) = queries of segment k with key in (pivot[j-1], pivot[j]]
                       = positions bounds[k, j] : bounds[k, j + 1]

where ``bounds[k, j + 1]`` is the *upper bound* of ``pivot[j]`` in segment ``k``
(the first query greater than the pivot) and ``bounds[k, 0] = 0``. Queries after
``bounds[k, nblocks]`` are greater than every input and cannot match.

Worked example, plain integers for keys and B = 2 to keep it small
(:func:`numba_sc.build_kernel_map` asks for 32..4096)::

    source  = [1, 4 | 6, 7 | 9]        pivots = [4, 7, 9]
    segment = [0, 2, 3, 4, 5, 8, 12]   (one segment, K = 1)
    upper bound of 4 -> 4, of 7 -> 5, of 9 -> 6:  bounds = [0, 4, 5, 6]
    query blocks: [0, 2, 3, 4] -> source block 0, [5] -> block 1, [8] -> block 2;
    12 is in no block (larger than every source key).

Query blocks can be very unequal (data dependent). Step 3 of Figure 11 balances
them: a block of ``n`` queries becomes ``ceil(n / C)`` *balanced* blocks of
(almost) equal size, none larger than ``C``; empty blocks vanish. Each balanced
block is a row ``(k, j, query start, query end)``, and the forward search runs
one CUDA thread block per row. The backward kernel writes the rows itself, each
thread those of its own query block, at places reserved with atomic adds (see
:func:`backward_search_v2`). In the example with C = 2 the first block (4
queries) gives two rows ``(0, 0, 0, 2)`` and ``(0, 0, 2, 4)``.

Costs (paper Section 5.1.3): ``K * ceil(|P|/B)`` searches of about
``log2 |Q|`` steps each - for 94k voxels, 27 offsets and B = 256: 9,963 threads
x 17 steps, a few hundred kB of key reads that mostly hit cache, because neighbouring threads search
neighbouring pivots in the same segment. The bounds are ``8 K (|P|/B + 1)``
bytes, the rows 16 bytes each, and one global atomic per thread block of 256.

The ladder (``python -m numba_sc ladder backward_search``; what each rung bought
on SemanticKITTI: ``numba_sc.tools.lesson.bought("backward_search")``)::

    v1  Figure 11 steps 1-3 as listed (:func:`backward_search_v1`): search every
          pivot, scan the blocks' row counts, read the total, cut the blocks
    v2  one kernel, no device read (:func:`backward_search_v2`, the library's,
          launched by :func:`backward_search_cuda`): each block's start from its
          left neighbour through shared memory, rows placed by atomic reservations
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ..core import conventions as cv
from ..core.device import device_xp
from ..core.backend import to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.pieces import placeholder
from ..core.rungs import Ladder, Rung
from .query_segments import query_key, query_key_reference

# Defaults of B and C, picked by the B x C sweep on an H100 (benchmarks/bench_map.py,
# results in benchmarks/results/archive/map_sweep_*.json; paper Figure 18): over SemanticKITTI
# and 1M random voxels, B = 512 with C = 1024 was fastest in total (the paper used 256
# and 512 on its GPUs).
DEFAULT_SOURCE_BLOCK = 512
DEFAULT_QUERY_BLOCK = 1024
MIN_SOURCE_BLOCK = 32
MAX_SOURCE_BLOCK = 4096  # 4096 int64 keys = 32 kB of shared memory (48 kB is the default cap)


# ------------------------------------------------------------------ reference
def backward_search_reference(skeys, qkeys, deltas, B):
    """Bounds of all query blocks, int64 (K, nblocks + 1), and the comparisons made.

    Vectorized over all (segment, source block) lanes, the same lanes as the
    kernel's threads; each loop iteration is one binary-search step of every lane
    still searching, and every step is one key comparison, counted.
    """
    skeys, qkeys, deltas = (np.asarray(a, np.int64) for a in (skeys, qkeys, deltas))
    P, Q, K = len(skeys), len(qkeys), len(deltas)
    nb = num_source_blocks(P, B)
    pivots = skeys[np.minimum((np.arange(nb) + 1) * B, P) - 1]  # last key of each block
    lane_k = np.repeat(np.arange(K), nb)  # lane t = (k, j) with t = k * nb + j
    lane_pivot = np.tile(pivots, K)
    lo = np.zeros(K * nb, np.int64)
    hi = np.full(K * nb, Q, np.int64)
    comparisons = 0
    while True:
        act = np.flatnonzero(lo < hi)
        if act.size == 0:
            break
        comparisons += act.size
        mid = (lo[act] + hi[act]) >> 1
        # upper bound: a query <= the pivot still belongs to this block or an earlier one
        right = query_key_reference(qkeys, deltas, lane_k[act], mid) <= lane_pivot[act]
        lo[act] = np.where(right, mid + 1, lo[act])
        hi[act] = np.where(right, hi[act], mid)
    bounds = np.zeros((K, nb + 1), np.int64)
    bounds[:, 1:] = lo.reshape(K, nb)
    return bounds, comparisons


def split_query_blocks_reference(bounds, C):
    """Balanced query blocks, int32 (n, 4) rows ``(k, j, query start, query end)``.

    Block (k, j) of x queries becomes ceil(x / C) rows of sizes differing by at most
    one; rows are ordered by (k, j) then position, exactly as the kernel writes them.
    """
    bounds = np.asarray(bounds, np.int64)
    K, nb = bounds.shape[0], bounds.shape[1] - 1
    starts = bounds[:, :-1].ravel()
    sizes = np.diff(bounds, axis=1).ravel()
    pieces = -(-sizes // C)  # ceil(size / C); 0 for an empty block
    first = np.cumsum(pieces) - pieces  # exclusive scan: where each block's rows begin
    owner = np.repeat(np.arange(K * nb), pieces)  # the (k, j) lane each row comes from
    p = np.arange(len(owner)) - first[owner]  # the row's number within its block
    n, size, start = pieces[owner], sizes[owner], starts[owner]
    rows = np.stack([owner // nb, owner % nb, start + p * size // n, start + (p + 1) * size // n], axis=1)
    return rows.astype(np.int32).reshape(-1, 4)


# ------------------------------------------------------------------- the ladder
# Two rungs: v1 does Figure 11's steps 1-3 as the paper lists them (search every
# pivot, then cut the blocks, placed by a scan of their row counts); v2, the
# library's, does all three in one kernel. Both are checked against the
# reference (tests/tools/test_ladder.py) and timed by ``python -m numba_sc ladder backward_search``.

@cuda.jit(device=True, inline=True)
def upper_bound_in_segment(qkeys, deltas, k, pivot, hi):
    """First position in ``0..hi`` of segment k whose query key is greater than ``pivot``."""
    lo = 0
    while lo < hi:
        mid = (lo + hi) >> 1
        if query_key(qkeys, deltas, k, mid) <= pivot:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit
def pivot_bounds_v1(skeys, qkeys, deltas, B, bounds):
    """v1, steps 1-2: one thread per (segment k, source block j) searches pivot j (the
    block's last key) in segment k: the end of query block (k, j)."""
    t = cuda.grid(1)
    nb = bounds.shape[1] - 1
    if t < deltas.shape[0] * nb:
        k = t // nb
        j = t - k * nb
        pivot = skeys[min((j + 1) * B, skeys.shape[0]) - 1]
        bounds[k, j + 1] = upper_bound_in_segment(qkeys, deltas, k, pivot, qkeys.shape[0])
        if j == 0:
            bounds[k, 0] = 0


@cuda.jit
def split_rows_v1(bounds, C, first, rows):
    """v1, step 3: one thread per query block (k, j) writes its ``ceil(size / C)``
    balanced rows from row ``first[k * nblocks + j]`` on (an exclusive scan of the
    blocks' row counts), so the rows come out in (k, j) order."""
    t = cuda.grid(1)
    nb = bounds.shape[1] - 1
    if t < bounds.shape[0] * nb:
        k = t // nb
        j = t - k * nb
        start = bounds[k, j]
        size = bounds[k, j + 1] - start
        n = (size + C - 1) // C
        for p in range(n):
            r = first[t] + p
            rows[r, 0] = k
            rows[r, 1] = j
            rows[r, 2] = start + p * size // n
            rows[r, 3] = start + (p + 1) * size // n


def backward_search_v1(skeys, qkeys, deltas, B, C):
    """v1's launcher: the pivots' kernel, the blocks' row counts and their exclusive scan
    (the array library), one device read of the total, the split kernel. Returns
    ``(bounds, rows, n_rows)`` like :func:`backward_search_cuda` (rows in (k, j) order).

    v2 (:func:`backward_search_v2`) folds it into one kernel: each block's start
    is its left neighbour's end (passed through shared memory, so each pivot is
    searched once, not twice), and the rows are placed by atomic reservations
    instead of a scan: one launch instead of two and the library calls, and no
    device read."""
    xp = device_xp()
    K = deltas.shape[0]
    nb = num_source_blocks(skeys.shape[0], B)
    bounds = xp.empty((K, nb + 1), dtype=np.int64)
    pivot_bounds_v1[blocks_for(K * nb), THREADS](skeys, qkeys, deltas, B, bounds)
    pieces = (xp.diff(bounds, axis=1).ravel() + C - 1) // C
    first = xp.cumsum(pieces) - pieces
    total = int(to_host(pieces.sum()))
    rows = xp.empty((max(total, 1), 4), dtype=np.int32)
    split_rows_v1[blocks_for(K * nb), THREADS](bounds, C, first, rows)
    return bounds, rows, xp.asarray(np.array([total], dtype=np.int64))


BACKWARD_THREADS = 256  # threads per block of the backward kernel (the shared arrays' size)


@cuda.jit
def backward_search_v2(skeys, qkeys, deltas, B, C, bounds, rows, n_rows, n_known, n_out):
    """v2, the library's: one thread per (segment k, source block j): query block (k, j),
    cut into balanced rows, all in one kernel.

    Thread t handles k = t // nblocks, j = t - k * nblocks, so a warp searches
    neighbouring pivots in one segment and walks nearly the same path through it:
    the sorted-query cache locality of Section 5.1, applied to the pivots.

    The block's end is the upper bound of pivot j. Its start is the end of block
    j - 1, which the thread to the left has just found: it is passed through
    shared memory, and only the first thread of each thread block searches it
    again. Knowing both ends, the thread cuts its query block into
    ``n = ceil(size / C)`` balanced rows (Figure 11, step 3) at once.

    Where do the rows go? Each thread block reserves room for all of its threads'
    rows with one atomic add on the global count ``n_rows[0]``, and each thread
    takes its share of that room with an atomic add in shared memory. So the rows
    come out in no fixed order (the reference lists them sorted), which changes
    nothing: every row writes its own queries' entries of the table. The
    alternative, a library scan of the piece counts and one more kernel to write
    the rows, costs two more launches.

    The segments hold ``n_known`` queries, or ``n_out[0]`` when that is -1: a
    strided layer's outputs are counted on the device in the same Map step, and
    ``qkeys`` is then an upper bound of that length whose tail is never read.
    """
    t = cuda.grid(1)
    tid = cuda.threadIdx.x
    nb = bounds.shape[1] - 1
    ends = cuda.shared.array(BACKWARD_THREADS, int64)  # each thread's block end, for its right neighbour
    block_rows = cuda.shared.array(1, int64)  # rows of this thread block, then its base
    if tid == 0:
        block_rows[0] = 0
    n = mine = k = j = start = size = end = 0
    n_query = n_known if n_known >= 0 else n_out[0]
    active = t < deltas.shape[0] * nb
    if active:
        k = t // nb
        j = t - k * nb
        pivot = skeys[min((j + 1) * B, skeys.shape[0]) - 1]  # last key of source block j
        end = upper_bound_in_segment(qkeys, deltas, k, pivot, n_query)
        bounds[k, j + 1] = end
        if j == 0:
            bounds[k, 0] = 0  # every segment's first block starts at its first query
    ends[tid] = end
    cuda.syncthreads()  # every end of this thread block is known
    if active:
        if j == 0:
            start = 0
        elif tid > 0:
            start = ends[tid - 1]  # the left neighbour: same segment, block j - 1
        else:  # the left neighbour belongs to the previous thread block: search again
            start = upper_bound_in_segment(qkeys, deltas, k, skeys[j * B - 1], end)
        size = end - start
        n = (size + C - 1) // C
        if n > 0:
            mine = cuda.atomic.add(block_rows, 0, n)  # this thread's offset in the block's room
    cuda.syncthreads()
    if tid == 0:
        block_rows[0] = cuda.atomic.add(n_rows, 0, block_rows[0])  # the block's room
    cuda.syncthreads()
    for p in range(n):
        r = block_rows[0] + mine + p
        if r >= rows.shape[0]:
            break  # only keys that are not sorted (a flagged, doomed search) get here
        rows[r, 0] = k
        rows[r, 1] = j
        rows[r, 2] = start + p * size // n
        rows[r, 3] = start + (p + 1) * size // n


def backward_search_cuda(skeys, qkeys, deltas, B, C, max_rows, n_rows=None, bounds=None, rows=None, n_out=None):
    """Device ``(bounds, rows, n_rows)`` from one launch for all K segments.

    ``bounds`` int64 (K, nblocks + 1); ``rows`` int32 (max_rows, 4), of which the
    first ``n_rows[0]`` are written, in no particular order; ``n_rows`` a 1-element
    int64 device array (given, zeroed, or made here), never read on the host here.
    ``max_rows``: :func:`max_balanced_blocks`. ``bounds`` and ``rows`` are made
    here unless given (the Map step cuts them from one allocation). ``n_out``: None
    when every query key is a query, else a 1-element device array holding how many
    of ``qkeys`` are (see the kernel).
    """
    xp = device_xp()
    K = deltas.shape[0]
    nb = num_source_blocks(skeys.shape[0], B)
    if bounds is None:
        bounds = xp.empty((K, nb + 1), dtype=np.int64)  # the kernel writes every entry
    if rows is None:
        rows = xp.empty((max(int(max_rows), 1), 4), dtype=np.int32)
    if n_rows is None:
        n_rows = xp.zeros(1, dtype=np.int64)
    # The kernel's shared array holds one end per thread: launch exactly that many
    # threads per block (under the simulator too, where fewer would be faster).
    known = -1 if n_out is not None else int(qkeys.shape[0])
    launch(backward_search_v2, K * nb, skeys, qkeys, deltas, B, C, bounds, rows, n_rows, known,
           placeholder((1,)) if n_out is None else n_out, threads=BACKWARD_THREADS)
    return bounds, rows, n_rows


# -------------------------------------------------------------------- the ladder
def search_workload(ctx) -> dict:
    """What the searches of a 3x3x3 submanifold layer on ``ctx.coords`` read, made by the
    Map step's own kernels (and shared by the forward search's ladder): the packed
    keys, the key deltas, and the balanced query blocks of the backward search, once
    over all K segments (``full``) and once over the first ceil(K / 2) (``half``: a
    symmetric kernel searched halfway), with blocks of ``ctx.search_blocks = (B, C)``."""
    def build():
        B, C = ctx.search_blocks
        offsets = cv.kernel_offsets(3)  # sorted, and so are their key deltas
        deltas = cv.key_delta(offsets)
        K, P = len(offsets), len(ctx.coords)
        reach = tuple(int(v) for v in offsets.min(axis=0)), tuple(int(v) for v in offsets.max(axis=0))
        keys = to_device(cv.pack_keys(np.asarray(ctx.coords), *reach))  # sorted: coords are
        work = {"B": B, "C": C, "K": K, "keys": keys, "table_shape": (K, P)}
        for h, name in ((K, "full"), ((K + 1) // 2, "half")):
            d = to_device(np.array(deltas[:h], dtype=np.int64))
            upper = max_balanced_blocks(h, P, P, B, C)
            _, rows, n_rows = backward_search_cuda(keys, keys, d, B, C, upper)
            work[name] = {"deltas": d, "rows": rows, "n_rows": n_rows, "upper": upper,
                          "grid": int(to_host(n_rows)[0])}  # forward v1-v3 launch exactly one block a row
        return work

    return ctx.memo(("search", tuple(ctx.search_blocks)), build)


def _bounds_and_rows(result):
    """The bounds, then the rows in (k, j, start) order (v2 writes them in any order)."""
    bounds, rows, n_rows = (to_host(a) for a in result)
    rows = rows[:int(n_rows[0])]
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    return np.concatenate([bounds.ravel(), rows.ravel()])


def _ladder_reference(w):
    keys = to_host(w["keys"])
    bounds, _ = backward_search_reference(keys, keys, to_host(w["full"]["deltas"]), w["B"])
    return np.concatenate([bounds.ravel(), split_query_blocks_reference(bounds, w["C"]).ravel()])


def _bytes_moved(w):
    """At least: the keys read once (the pivots are among them, and a cache would keep
    what the binary searches probe twice) and the K deltas; written, the bounds (int64,
    K x (source blocks + 1)) and the balanced rows (4 int32 each)."""
    keys, full = w["keys"], w["full"]
    bounds = full["deltas"].shape[0] * (num_source_blocks(keys.shape[0], w["B"]) + 1) * 8
    return keys.nbytes + full["deltas"].nbytes + bounds + full["grid"] * 4 * 4  # grid: the rows found


LADDER = Ladder(
    "backward_search",
    (Rung("v1", lambda w: backward_search_v1(w["keys"], w["keys"], w["full"]["deltas"], w["B"], w["C"]),
          "Figure 11 steps 1-3 as listed: search every pivot; scan the row counts; cut the blocks"),
     Rung("v2", lambda w: backward_search_cuda(w["keys"], w["keys"], w["full"]["deltas"], w["B"], w["C"],
                                               w["full"]["upper"]),
          "+ one kernel: the neighbour's end shared, rows placed by atomics, no read (the library's)")),
    workload=search_workload,
    reference=_ladder_reference,
    collect=_bounds_and_rows,
    bytes_moved=_bytes_moved,
)


# ------------------------------------------------- block sizes and row bounds
def check_block_sizes(source_block, query_block):
    """Validate B and C; return them as ints. Errors name the argument and the fix."""
    if isinstance(source_block, bool) or not isinstance(source_block, (int, np.integer)):
        raise TypeError(f"source_block (B) must be an int, got {source_block!r}")
    b = int(source_block)
    if b < MIN_SOURCE_BLOCK or b > MAX_SOURCE_BLOCK or b & (b - 1):
        raise ValueError(
            f"source_block (B) must be a power of two in {MIN_SOURCE_BLOCK}..{MAX_SOURCE_BLOCK} "
            f"(a source block lives in shared memory, 8 bytes a key), got {source_block!r}; "
            "the paper's default is 256")
    if isinstance(query_block, bool) or not isinstance(query_block, (int, np.integer)):
        raise TypeError(f"query_block (C) must be an int, got {query_block!r}")
    c = int(query_block)
    if c <= 0:
        raise ValueError(
            f"query_block (C) must be a positive int (the largest balanced query block), got "
            f"{query_block!r}; the paper's default is 512")
    return b, c


def num_source_blocks(n_source: int, B: int) -> int:
    return (int(n_source) + B - 1) // B


def max_balanced_blocks(K: int, n_source: int, n_query: int, B: int, C: int) -> int:
    """An upper bound on the number of balanced query blocks, known without the data.

    Block (k, j) with x queries gives ceil(x / C) <= x / C + 1 rows; summed over the
    K * nblocks blocks, whose sizes add up to at most K * |Q|, that is at most
    ``K * nblocks + K * |Q| / C`` (paper Section 5.1.3, footnote 1).
    """
    return K * num_source_blocks(n_source, B) + (K * int(n_query) + C - 1) // C
