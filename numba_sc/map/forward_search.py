"""Stage 6, forward binary search: each query looked up in its source block only.

After the backward search (stage 5) every query of segment ``k`` knows the one
source block ``j`` that can hold it, and the balanced query blocks say which
CUDA thread block handles it (paper Section 5.1.2, Figure 11 steps 4-5). A thread
block, given its balanced block ``(k, j, query start, query end)``,

1. loads the B keys of source block ``j`` into shared memory, every thread a
   strided share (coalesced global reads), then waits at ``syncthreads``;
2. lets each thread take queries ``start + threadIdx, start + threadIdx +
   blockDim, ...`` of its query block, build each key on the fly (stage 4) and
   binary-search it in shared memory: about ``log2 B`` steps instead of
   ``log2 |P|``, and every step an on-chip read;
3. writes ``table[k, i] = j * B + position`` on a hit. The table starts as -1, so
   misses write nothing; the hits are counted on the way, per offset (the GEMM
   sizes) and per offset and chunk of outputs (the metadata stage's ranks).
   For a symmetric submanifold kernel only half the segments are searched and
   each hit is also written at its mirror (:func:`mirror_reference`).

Worked example (continuing stage 5: source ``[1, 4 | 6, 7 | 9]``, B = 2, one
segment ``[0, 2, 3, 4, 5, 8, 12]``)::

    block (0, 0, 0, 4): shared = [1, 4]; queries 0, 2, 3, 4 -> only 4 is there,
                        at position 1: table[0, 3] = 0 * 2 + 1 = 1
    block (0, 1, 4, 5): shared = [6, 7]; query 5 -> miss
    block (0, 2, 5, 6): shared = [9];    query 8 -> miss
    table[0] = [-1, -1, -1, 1, -1, -1, -1]

Launch without a device->host sync: the number of balanced blocks lives on the
device. Rather than reading it (a sync that stalls the host until the GPU has
caught up, and loses the overlap of host and GPU work), the launcher starts the known upper
bound ``K * nblocks + ceil(K * |Q| / C)`` of thread blocks and each block first
compares its index with the device count: surplus blocks return at once, which
costs the GPU a few nanoseconds each.

The ladder, one idea a rung (``python -m numba_sc ladder forward_search``, on
SemanticKITTI at 0.05 m, 3x3x3, B = 512, C = 1024; each rung timed with what the
metadata stage then needs of the map: the pairs per offset, per offset and chunk
of outputs and every point's mask of offsets, found by array-library passes over
the table after v1-v3, with the pairs by v4; what each bought:
``numba_sc.tools.lesson.bought("forward_search")``; older and fuller figures:
``docs/performance.md``, "map/forward_search.py")::

    v1  the paper's kernel: shared-memory block, a lo/hi binary search per query
          (:func:`forward_search_v1`)
    v2  + branch-free search: exactly log2(B) halvings over a padded block
    v3  + a symmetric kernel searched halfway, each hit written twice
    v4  + the counts and masks the metadata needs, found where the pairs are;
          sizes compiled in, unsigned indices (the library's, launched by
          :func:`forward_search_cuda`)

v2 and v3 make the search itself cheaper, a saving the passes after it mostly
hide on this scan; v4, which makes the passes unnecessary, is the rung that
shortens the stage.

Bytes, 3x3x3 layer, |P| = |Q| = 94k, B = 256, C = 512: the blocks load about
K * |P| * 8 B = 20 MB of source keys into shared memory (each source block once
per segment, plus once more per extra split), read 2.5 M query keys (mostly from
cache: 27 segments share the same 750 kB of Q keys) and write the 10 MB table.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint64

from ..core.device import array_module, simulating
from ..core.backend import filled, to_host
from ..core.launch import launch
from ..core.pieces import Piece, placeholder
from ..core.rungs import Ladder, Rung
from ..core.conventions import MASK_BITS, SIMULATOR_THREADS, chunk_size
from ..core.state import cached
from .backward_search import search_workload
from .query_segments import query_key, query_key_reference

FORWARD_THREADS = 128  # threads per block on the GPU (the paper's setting)


# ------------------------------------------------------------------ reference
def forward_search_reference(skeys, qkeys, deltas, bounds, B):
    """The kernel map ``table`` int32 (K, |Q|) and the comparisons made.

    Vectorized over every query that lies in some query block. Each query does a
    lower-bound binary search in its own source block ``j * B : j * B + B``, as
    the kernel does in shared memory (the split into balanced blocks changes who
    does the work, not the result). Each step of each query is one comparison,
    counted; the final equality check is not counted as a step. (The kernel finds
    the same position in exactly log2(B) branch-free steps over a padded block;
    the count here is the plain search's, the number the paper's analysis uses.)
    """
    skeys, qkeys, deltas, bounds = (np.asarray(a, np.int64) for a in (skeys, qkeys, deltas, bounds))
    P, Q, K = len(skeys), len(qkeys), len(deltas)
    nb = bounds.shape[1] - 1
    table = np.full((K, Q), -1, np.int32)
    sizes = np.diff(bounds, axis=1).ravel()  # block (k, j) at k * nb + j
    owner = np.repeat(np.arange(K * nb), sizes)  # the query block of each covered query
    # query position i: block start + rank within the block
    i = bounds[:, :-1].ravel()[owner] + np.arange(len(owner)) - (np.cumsum(sizes) - sizes)[owner]
    k, j = owner // nb, owner % nb
    q = query_key_reference(qkeys, deltas, k, i)
    lo = j * B  # the search range is source block j only
    hi = np.minimum(lo + B, P)
    comparisons = 0
    while True:
        act = np.flatnonzero(lo < hi)
        if act.size == 0:
            break
        comparisons += act.size
        mid = (lo[act] + hi[act]) >> 1
        right = skeys[mid] < q[act]  # lower bound: first source key >= query
        lo[act] = np.where(right, mid + 1, lo[act])
        hi[act] = np.where(right, hi[act], mid)
    # lo < P always: a covered query is <= its block's last key (the pivot)
    hit = skeys[np.minimum(lo, P - 1)] == q
    table[k[hit], i[hit]] = lo[hit]
    return table, comparisons


def mirror_reference(half, K):
    """The full (K, |Q|) table of a submanifold map from its searched rows ``half``.

    When the offsets come in pairs, ``offsets[K-1-k] == -offsets[k]``, and the
    queries are the inputs themselves (stride 1), every pair is found twice:
    ``q_i + delta_k = p_j`` means ``q_j + delta_{K-1-k} = p_i``. So only the first
    ``h = ceil(K / 2)`` segments are searched (the centre included, for odd K) and
    row ``K-1-k`` is row ``k`` read backwards: ``table[K-1-k, table[k, i]] = i``.
    The kernel writes both entries on each hit; this is its NumPy twin.
    """
    h, Q = half.shape
    table = np.full((K, Q), -1, np.int32)
    table[:h] = half
    for k in range(K - h):  # rows K-1, K-2, ..., h mirror rows 0, 1, ..., K-1-h
        i = np.flatnonzero(half[k] >= 0)
        table[K - 1 - k, half[k, i]] = i
    return table


# ------------------------------------------------------------------- the ladder
# Shared arrays need a size known when the kernel is compiled: every rung is built
# once per source block size B.
@cached
def forward_search_v1(B: int):
    """v1, the paper's forward search (Section 5.1.2, Figure 11 steps 4-5): one thread
    block per balanced query block ``rows[blockIdx] = (k, j, start, end)``; the block
    loads source block j into shared memory, then each thread binary-searches its
    queries there and writes ``table[k, i]`` on a hit. Launch exactly one block per
    row (the host reads how many there are)."""

    @cuda.jit
    def forward_search(skeys, qkeys, deltas, rows, table):
        r = cuda.blockIdx.x
        k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
        first = j * B  # global index of the source block's first key
        n = min(B, skeys.shape[0] - first)  # the last block may be short
        source = cuda.shared.array(B, int64)
        for t in range(cuda.threadIdx.x, n, cuda.blockDim.x):  # coalesced: neighbours load neighbours
            source[t] = skeys[first + t]
        cuda.syncthreads()  # the whole block is loaded before anyone searches
        for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
            q = query_key(qkeys, deltas, k, i)  # segment k made on the fly (stage 4)
            lo, hi = 0, n  # lower bound: the first key >= q, in shared memory
            while lo < hi:
                mid = (lo + hi) // 2
                if source[mid] < q:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < n and source[lo] == q:
                table[k, i] = first + lo

    return forward_search


@cached
def forward_search_v2(B: int):
    """v2: the same search without a data-dependent loop. B is a power of two, so a
    block padded to B keys (with a key larger than any query) is searched in exactly
    log2(B) halvings: every thread of a warp runs the same steps in lockstep, and
    the loop, with a compile-time trip count, is unrolled. (The ``while`` version
    keeps the SMs busy with index arithmetic: it is issue-bound.)"""
    steps = B.bit_length() - 1
    pad = np.int64(np.iinfo(np.int64).max)

    @cuda.jit
    def forward_search(skeys, qkeys, deltas, rows, table):
        r = cuda.blockIdx.x
        k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
        first = j * B
        n = min(B, skeys.shape[0] - first)
        source = cuda.shared.array(B, int64)
        for t in range(cuda.threadIdx.x, B, cuda.blockDim.x):
            source[t] = skeys[first + t] if t < n else pad  # a short block, padded
        cuda.syncthreads()
        for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
            q = query_key(qkeys, deltas, k, i)
            lo = 0  # keys < q found so far: if the next half's last key is < q, so is the half
            for e in range(steps):
                half = B >> (e + 1)
                if source[lo + half - 1] < q:
                    lo += half
            if lo < n and source[lo] == q:
                table[k, i] = first + lo

    return forward_search


@cached
def forward_search_v3(B: int):
    """v3: a symmetric submanifold kernel searched halfway. When the offsets come in
    pairs (``offsets[K-1-k] == -offsets[k]``) and the queries are the inputs, each
    pair is found twice: ``q_i + delta_k = p_j`` exactly when ``q_j + delta_{K-1-k}
    = p_i``. So only the first ``h = ceil(K / 2)`` segments are searched (``deltas``
    holds those) and every hit is also written at its mirror,
    ``table[K-1-k, j] = i`` (:func:`mirror_reference`): half the searches for the
    same table. (Not in the Minuet paper; spconv does the same for its hash table.)"""
    steps = B.bit_length() - 1
    pad = np.int64(np.iinfo(np.int64).max)

    @cuda.jit
    def forward_search(skeys, qkeys, deltas, rows, table):
        r = cuda.blockIdx.x
        k, j, q0, q1 = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
        mirror = table.shape[0] - 1 - k
        mirrored = mirror >= deltas.shape[0]  # that row is not searched: this block writes it
        first = j * B
        n = min(B, skeys.shape[0] - first)
        source = cuda.shared.array(B, int64)
        for t in range(cuda.threadIdx.x, B, cuda.blockDim.x):
            source[t] = skeys[first + t] if t < n else pad
        cuda.syncthreads()
        for i in range(q0 + cuda.threadIdx.x, q1, cuda.blockDim.x):
            q = query_key(qkeys, deltas, k, i)
            lo = 0
            for e in range(steps):
                half = B >> (e + 1)
                if source[lo + half - 1] < q:
                    lo += half
            if lo < n and source[lo] == q:
                table[k, i] = first + lo
                if mirrored:
                    table[mirror, first + lo] = i

    return forward_search


# ----------------------------------------------------- v4, the library's kernel
# It adds to v3 what the next stages need, counted where the pairs are found
# (pairs per offset, per offset and chunk of outputs, and each point's mask of
# offsets: passes over the table the metadata stage no longer makes), and the
# sizes compiled in with unsigned index arithmetic (what each bought when it came
# in: docs/performance.md, "map/forward_search.py").
#
# Pairs per (offset, chunk) are tallied in shared memory first: a global atomic per
# pair, all of a block's pairs on one or two addresses, made the forward search
# about twice as slow on the H100 (1M points). A block's queries span at
# most C + chunk outputs and its mirrored pairs at most B + chunk, so a few slots
# per table row hold nearly all of them; the rare pair past them goes straight to
# global memory.
TALLY = 4  # shared-memory slots per table row (the searched row and its mirror)
TALLY_SLOTS = 2 * TALLY  # a named constant: shared array sizes must be compile-time constants


@cached
def forward_search_v4(B: int, with_masks: bool = False, threads: int = FORWARD_THREADS):
    """The forward-search kernel for source blocks of ``B`` keys (compiled once per B),
    setting the mask bits of every pair it finds when ``with_masks`` (a constant of
    the compiled code: without masks the lines that set them are not compiled in),
    for thread blocks of ``threads`` threads: the strided loops below step by that
    constant, so their trip counts cost a multiply and a shift instead of a
    division by ``blockDim.x`` (tens of instructions per loop and thread). Launch
    it with exactly ``threads`` threads per block.

    The indices are unsigned (NumPy unsigned constants keep Numba's arithmetic
    unsigned; a signed-unsigned mix would be float64): on a signed index Numba
    adds the few instructions that wrap a negative index around, on every table,
    shared-memory and mask access, and this kernel is bound by its instruction
    issue.
    """
    steps = B.bit_length() - 1  # log2(B): the search below takes exactly this many steps
    pad = np.int64(np.iinfo(np.int64).max)  # fills a short last block: larger than any query
    size, step = np.uint64(B), np.uint64(threads)
    zero, one, bits = np.uint64(0), np.uint64(1), np.uint64(MASK_BITS)
    n_tally, n_slots = np.uint64(TALLY), np.uint64(TALLY_SLOTS)

    @cuda.jit(device=True, inline=True)
    def count_pair(tally, slot0, chunk_counts, n_chunks, row, c, c0):
        """One pair of table row ``row`` in chunk ``c``: into ``tally[slot0 + c - c0]``
        when that is one of the block's TALLY slots from chunk ``c0``, else global
        (``chunk_counts`` is (K, n_chunks), stored flat)."""
        if c - c0 < n_tally:
            cuda.atomic.add(tally, slot0 + c - c0, 1)
        else:
            cuda.atomic.add(chunk_counts, row * n_chunks + c, 1)

    @cuda.jit(device=True, inline=True)
    def set_bit(masks, width, k, i):
        """Bit k of point i's mask: ``masks[k // MASK_BITS, i] |= 1 << (k % MASK_BITS)``
        (``masks`` is (words, width), stored flat). Other blocks may set other bits
        of the same word (other offsets of point i) at the same time, hence the
        atomic OR."""
        cuda.atomic.or_(masks, (k // bits) * width + i, np.int64(1) << int64(k % bits))

    @cuda.jit
    def forward_search(skeys, qkeys, deltas, rows, n_rows, n_known, n_out, table, counts, chunk_shift,
                       chunk_counts, out_masks, in_masks):
        """One thread block per balanced query block ``rows[blockIdx]``; also counts
        the pairs per offset, and per offset and chunk of ``2**chunk_shift`` outputs
        for the metadata stage (``chunk_counts[k, i >> chunk_shift]``: a shift, where a
        64-bit division by a run-time chunk is a software routine of dozens of
        instructions, run for every pair), and for each pair (k, i, j)
        sets bit k of output i's mask and of input j's (``out_masks``, ``in_masks``,
        see :mod:`numba_sc.gmas.metadata`).

        ``table`` (K, |Q|), ``chunk_counts`` (K, chunks), ``out_masks`` (words, |Q|)
        and ``in_masks`` (words, |P|) are stored flat and indexed by hand, because
        their width |Q| may be known on the device only: ``n_known`` when the host
        knows it, else ``n_out[0]``, the outputs a strided layer counts on the device
        in the same Map step (the host learns the count with the report, after the
        search: one read, not two)."""
        if cuda.blockIdx.x >= n_rows[0]:
            return  # surplus block of the upper-bound launch; the whole block leaves together
        r = uint64(cuda.blockIdx.x)
        k = uint64(rows[r, 0])
        j = uint64(rows[r, 1])
        q0 = uint64(rows[r, 2])
        q1 = uint64(rows[r, 3])
        shift = uint64(chunk_shift)
        width = uint64(n_known) if n_known >= 0 else uint64(n_out[0])  # |Q|: the rows of table, out_masks
        n_chunks = (width + (one << shift) - one) >> shift  # ... and of chunk_counts
        n_in = uint64(skeys.shape[0])  # |P|: the row length of in_masks
        first = j * size  # global sorted index of the source block's first key
        # Only segments 0..h-1 are searched (h = deltas.shape[0]); with a symmetric
        # submanifold kernel the rows h..K-1 of the table are the mirrors of rows
        # K-1-h..0 (see mirror_reference). Without one, h = K and nothing is mirrored.
        mirror = uint64(counts.shape[0]) - one - k
        mirrored = mirror >= uint64(deltas.shape[0])  # row `mirror` is not searched: write its pairs
        n = min(size, n_in - first)  # the last source block may be short
        source = cuda.shared.array(B, int64)  # B is a compile-time constant here
        hits = cuda.shared.array(1, int32)
        tally = cuda.shared.array(TALLY_SLOTS, int32)  # per chunk: row k's, then the mirror's
        c_main = q0 >> shift  # the first chunk of this block's outputs in row k
        c_mirror = first >> shift  # ... and of its mirrored pairs' outputs in row `mirror`
        t0 = uint64(cuda.threadIdx.x)
        if cuda.threadIdx.x == 0:
            hits[0] = 0
        for u in range(t0, n_slots, step):
            tally[u] = 0
        for t in range(t0, size, step):
            # neighbouring threads, neighbouring keys: coalesced; a short last block is
            # padded so that every search below can run over exactly B keys
            source[t] = skeys[first + t] if t < n else pad
        cuda.syncthreads()  # the whole block must be loaded before anyone searches
        mine = 0
        for i in range(q0 + t0, q1, step):
            q = query_key(qkeys, deltas, k, i)
            # Lower bound (first key >= q) in shared memory, written without a data-
            # dependent loop: B is a power of two, so log2(B) halvings always suffice,
            # and every thread of a warp runs the same steps in lockstep (the loop has
            # a compile-time trip count and is unrolled). ``lo`` counts the keys < q
            # found so far: at each step, if the last key of the next ``half`` is < q,
            # that whole half is < q too. Same answer as the lo/hi loop of the
            # reference; on the H100 the loop version kept the SMs busy with index
            # arithmetic (Nsight Compute on 1M points: docs/performance.md,
            # "map/forward_search.py").
            lo = uint64(0)
            for e in range(steps):
                half = size >> uint64(e + 1)
                if source[lo + half - one] < q:
                    lo += half
            # lo < n always holds (the query is <= the block's pivot, source[n - 1]);
            # the test only guards against a corrupted rows array
            if lo < n and source[lo] == q:
                table[k * width + i] = first + lo
                count_pair(tally, zero, chunk_counts, n_chunks, k, i >> shift, c_main)
                if with_masks:
                    set_bit(out_masks, width, k, i)
                    set_bit(in_masks, n_in, k, first + lo)
                if mirrored:  # submanifold: |Q| = |P|
                    table[mirror * width + first + lo] = i
                    count_pair(tally, n_tally, chunk_counts, n_chunks, mirror, (first + lo) >> shift, c_mirror)
                    if with_masks:
                        set_bit(out_masks, width, mirror, first + lo)
                        set_bit(in_masks, n_in, mirror, i)
                mine += 1
        # Pairs per offset, counted where they are found: one shared-memory atomic
        # per thread, one global atomic per block, instead of a reduction over the
        # whole K x |Q| table afterwards.
        if mine > 0:
            cuda.atomic.add(hits, 0, mine)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0 and hits[0] > 0:
            cuda.atomic.add(counts, k, hits[0])
            if mirrored:
                cuda.atomic.add(counts, mirror, hits[0])
        for u in range(t0, n_slots, step):  # the tallies, once a block
            if tally[u] > 0:
                if u < n_tally:
                    cuda.atomic.add(chunk_counts, k * n_chunks + c_main + u, tally[u])
                else:
                    cuda.atomic.add(chunk_counts, mirror * n_chunks + c_mirror + u - n_tally, tally[u])

    return forward_search


# Under the simulator fewer threads per block (conventions.SIMULATOR_THREADS) make the
# tests much faster and make each thread walk the strided loops several times, which
# is the harder case for correctness.
def forward_threads(C: int) -> int:
    """Threads per block: 128 on the GPU (16 simulated), never more than C queries."""
    return max(1, min(SIMULATOR_THREADS if simulating() else FORWARD_THREADS, int(C)))


def forward_search_cuda(skeys, qkeys, deltas, rows, n_rows, B, C, grid, counts=None, n_offsets=None,
                        chunk=None, chunk_counts=None, out_masks=None, in_masks=None, n_out=None):
    """Launch the forward search over ``grid`` thread blocks; returns ``(table, counts, chunk_counts)``.

    ``n_offsets``: rows of the table, K. Default: one per delta. When it is larger
    than ``len(deltas)`` only the first segments are searched and the others are
    written as their mirrors (symmetric submanifold layers, :func:`mirror_reference`).

    ``grid`` is the number of balanced rows when it is known on the host (the
    simulator, where reading it is free) or the upper bound from
    :func:`numba_sc.map.backward_search.max_balanced_blocks` (the GPU, see the module
    docstring). ``counts`` (int64 (K,) zeros on the device, made here when not
    given) receives the pairs per offset; the table is int32 (K, |Q|).

    ``chunk``: outputs per metadata chunk (default
    :func:`numba_sc.gmas.metadata.chunk_size`). ``chunk_counts`` int32 (K, ceil(|Q| / chunk)):
    the pairs of offset k among outputs ``c * chunk .. (c + 1) * chunk - 1``, what
    :func:`numba_sc.gmas.metadata.chunk_counts_kernel` would count by reading the
    whole table again. Counting where the pairs are found saves that pass.
    ``chunk_counts``, when given, must be zeros of that size, flat (made here otherwise).
    ``out_masks``, ``in_masks``: int64 zeros of ceil(K / MASK_BITS) * |Q| and
    ceil(K / MASK_BITS) * |P| words, flat, or None (no masks: the Map step alone
    does not need them). Bit ``k % MASK_BITS`` of ``out_masks[k // MASK_BITS, i]``
    is set when output i has a pair through offset k, and of
    ``in_masks[k // MASK_BITS, j]`` when input j has one (the metadata stage's
    :func:`~numba_sc.gmas.metadata.masks_kernel` would find them by reading the
    whole table again).

    ``n_out``: None when |Q| = ``len(qkeys)``; else a 1-element device array that
    holds |Q| (a strided layer's outputs, counted on the device), ``qkeys`` being
    an upper bound of that length. The table and chunk counts then come back flat,
    sized for the upper bound: their first ``K * |Q|`` (``K * chunks``) entries are
    the (K, |Q|) arrays, for the caller to view once it has read |Q|.
    """
    K = deltas.shape[0] if n_offsets is None else int(n_offsets)
    Q = int(qkeys.shape[0])  # |Q|, or its upper bound
    table = filled(K * Q, np.int32, -1)  # misses stay -1: only hits are written
    if counts is None:
        counts = filled(K, np.int64, 0)
    if chunk is None:
        chunk = chunk_size()
    shift = int(chunk).bit_length() - 1
    if chunk != 1 << shift:
        raise ValueError(f"chunk must be a power of two (threads x items per thread), got {chunk}")
    if chunk_counts is None:
        chunk_counts = filled(K * -(-Q // chunk), np.int32, 0)
    with_masks = out_masks is not None
    if not with_masks:  # the kernel takes them but never touches them
        out_masks = in_masks = placeholder((1,))
    known = n_out is None
    if grid > 0:
        threads = forward_threads(C)
        launch(forward_search_v4(int(B), with_masks, threads), int(grid), skeys, qkeys, deltas, rows, n_rows,
               Q if known else -1, placeholder((1,)) if known else n_out, table, counts, shift, chunk_counts, out_masks, in_masks,
               threads=threads, blocks=int(grid))
    if known:
        table = table.reshape(K, Q)
        if chunk_counts.ndim == 1 and type(chunk_counts) is not Piece:  # made here: a real array
            chunk_counts = chunk_counts.reshape(K, -1)
    return table, counts, chunk_counts


# -------------------------------------------------------------------- the ladder
def _ladder_work(ctx):
    """The backward search's keys, deltas and balanced blocks
    (:func:`numba_sc.map.backward_search.search_workload`), and the threads per block."""
    work = search_workload(ctx)
    return dict(work, threads=forward_threads(work["C"]))


def _run_rung(rung, w):
    """One rung and what the metadata stage then needs of the map; returns the (K, |Q|)
    table (the mirrored rows filled in for v3 and v4).

    The library's v4 finds, with each pair, what the metadata stage needs of it:
    the pairs per offset, per offset and chunk of outputs, and each point's mask
    of offsets. For v1-v3 those are then found from the table by the array
    library (:func:`table_passes`), so that every rung is timed for the same result.
    """
    B, C = w["B"], w["C"]
    K, P = w["table_shape"]
    if rung == "v4":  # the library's: the upper-bound grid, counts, chunk counts and masks
        half = w["half"]
        masks = [filled(-(-K // MASK_BITS) * P, np.int64, 0) for _ in range(2)]  # flat (words, |P|)
        table, _, _ = forward_search_cuda(w["keys"], w["keys"], half["deltas"], half["rows"], half["n_rows"], B, C,
                                          half["upper"], n_offsets=K, out_masks=masks[0], in_masks=masks[1])
        return table
    kernel, part = {"v1": (forward_search_v1, "full"), "v2": (forward_search_v2, "full"),
                    "v3": (forward_search_v3, "half")}[rung]
    seg = w[part]
    table = filled((K, P), np.int32, -1)
    if seg["grid"]:
        kernel(B)[seg["grid"], w["threads"]](w["keys"], w["keys"], seg["deltas"], seg["rows"], table)
    table_passes(table, P, chunk_size())
    return table


def table_passes(table, n_in, chunk):
    """What v4 finds with the pairs, found from a (K, |Q|) table afterwards by the array
    library: ``(pairs per offset, pairs per offset and chunk of outputs, out_masks,
    in_masks)`` (the masks as :func:`forward_search_cuda` describes them, (words, |Q|)
    and (words, ``n_in``)), on the side that holds ``table``. The bits of a word are
    distinct, so a sum is their OR."""
    xp = array_module(table)
    K, Q = table.shape
    hit = table >= 0
    counts = hit.sum(axis=1)
    n_chunks = -(-Q // chunk)
    padded = xp.zeros((K, n_chunks * chunk), dtype=np.int32)
    padded[:, :Q] = hit
    chunk_counts = padded.reshape(K, n_chunks, chunk).sum(axis=2, dtype=np.int32)
    found_in = xp.zeros(K * n_in, dtype=bool)  # (k, j): input j has a pair through offset k
    found_in[(table + (xp.arange(K, dtype=np.int64) * n_in)[:, None])[hit]] = True
    words = -(-K // MASK_BITS)
    shifts = (xp.arange(K, dtype=np.int64) % MASK_BITS)[:, None]

    def masks(found):
        bits = xp.zeros((words * MASK_BITS, found.shape[1]), dtype=np.int64)
        bits[:K] = found.astype(np.int64) << shifts
        return bits.reshape(words, MASK_BITS, -1).sum(axis=1)

    return counts, chunk_counts, masks(hit), masks(found_in.reshape(K, n_in))


def _ladder_reference(w):
    """The same layer's table by brute force: every input key moved by every delta,
    looked up in the sorted keys with NumPy's ``searchsorted``."""
    keys = to_host(w["keys"])
    deltas = to_host(w["full"]["deltas"])
    K, P = w["table_shape"]
    table = np.full((K, P), -1, np.int32)
    for k in range(K):
        q = keys + deltas[k]
        at = np.minimum(np.searchsorted(keys, q), P - 1)
        found = keys[at] == q
        table[k, found] = at[found]
    return table


def _bytes_moved(w):
    """At least: the keys read once (sources and queries are the same sorted keys here),
    with the deltas and the balanced rows of the half that v3 and v4 search; written, the
    (K, |Q|) table, every entry once (int32)."""
    half = w["half"]
    K, Q = w["table_shape"]
    rows = half["grid"] * 4 * 4  # 4 int32 a balanced row
    return w["keys"].nbytes + half["deltas"].nbytes + rows + K * Q * 4


LADDER = Ladder(
    "forward_search",
    (Rung("v1", lambda w: _run_rung("v1", w),
          "the paper's forward search: shared-memory source block, a lo/hi binary search"),
     Rung("v2", lambda w: _run_rung("v2", w), "+ branch-free: exactly log2(B) halvings over a padded block"),
     Rung("v3", lambda w: _run_rung("v3", w), "+ a symmetric kernel searched halfway, each hit written twice"),
     Rung("v4", lambda w: _run_rung("v4", w),
          "+ counts, chunk counts, masks found with the pairs (v1-v3: passes after); constants, unsigned")),
    workload=_ladder_work,
    reference=_ladder_reference,
    bytes_moved=_bytes_moved,
)
