"""Stage 7, metadata tables: where every pair of the kernel map lives in the buffers.

The GMaS step (paper Section 2.2, Figure 2) multiplies, for every offset k, the
features of all inputs that feed some output through k by ``W[k]``. To do that
with a few big GEMMs, the gather copies those input rows into one *input buffer*
(offset by offset, groups padded to equal height, :mod:`numba_sc.gmas.gemm_grouping`),
the GEMMs write an *output buffer* of the same row layout, and the scatter sums
each output's partial results. All three need to know, for each pair, its
**buffer row**. That is what this stage computes, from the kernel map alone.

The layouts (``order``, ``base[k]``, each pair's buffer row, the dense tables, the
per-point lists the kernels read) and the plan that carries them are defined in
:mod:`numba_sc.gmas.layout`.

The submanifold centre: with stride 1 and ``Q = P``, offset (0, 0, 0) maps every
point to itself, so its "gather" would copy the whole feature matrix in order.
Instead it is multiplied directly, ``out = F @ W[centre]``, and left out of the
buffers. It applies exactly when offset (0, 0, 0) exists and has
``|P| = |Q|`` pairs: then every output's own coordinate is an input, the two
sorted coordinate arrays are equal, and ``table[centre, i] == i``.

Worked example, 3 outputs, K = 2, max_padding 0 (so no grouping)::

    table (K x |Q|)   k=0: [ 1, -1,  0]      counts [2, 3]
                      k=1: [ 0,  1,  2]      order (by count): [0, 1]
    base = [0, 2]     rows of k=0: outputs 0, 2 -> rows 0, 1
                      rows of k=1: outputs 0, 1, 2 -> rows 2, 3, 4
    out_table (|Q| x K) = [[0, 2], [-1, 3], [1, 4]]
    in_table  (|P| x K) = [[1, 2], [0, 3], [-1, 4]]   (input 0 feeds output 2 via k=0)

The same example as lists (masks in binary, offset 0 the lowest bit)::

    out masks [0b11, 0b10, 0b11]   out rows: output 0 [0, 2], output 1 [3], output 2 [1, 4]
    in masks  [0b11, 0b11, 0b10]   in rows:  input 0  [1, 2], input 1  [0, 3], input 2  [4]

How the device finds the ranks. The plain way (:func:`metadata_v1`, v1 of this
stage's ladder, writes the dense tables from it) is a scan of ``table >= 0`` along
each offset's row, but a library scan over all K x |Q| entries is what used to
dominate this stage. Instead the outputs are cut into *chunks* of ``CHUNK``
consecutive outputs (1024 on a GPU: 128 threads x 8 outputs each), and the rank
is split in two parts:

1. ``counts2d`` (K x n_chunks), the pairs of offset k in chunk c. A map from the
   kernel path has them (``KernelMap.chunk_counts``: its forward search counted
   each pair where it found it); for any other map :func:`chunk_counts_kernel`
   counts them, one block per (k, c).
2. :func:`metadata_v2`, one block per (k, c): the pairs of k in the chunks
   before c (a sum over ``counts2d[k, :c]``) plus a scan over the block of the
   threads' own counts give each pair its rank; each thread walks its run of
   8 outputs again and writes each pair's row into its output's list and its
   input's list.

The same example in chunks of 2 outputs: ``counts2d = [[1, 1], [2, 1]]``, so
chunk 1's first pair has rank 1 in k=0 and rank 2 in k=1: output 2 (chunk 1) is
pair number 1 of k=0 (row 0 + 1 = 1) and pair number 2 of k=1 (row 2 + 2 = 4),
as above.

Where in a list a pair goes: its *slot* is the number of set bits below k in
the point's mask (counting only offsets in the buffers). So the lists need the
masks first. A layer's own map has them: ``build_kernel_map(..., masks=True)``,
which :func:`numba_sc.sparse_conv3d` asks for, has the forward search set bit k
of output i and of input j (an atomic OR) for every pair it finds; for any
other map :func:`masks_kernel` reads the table once to set them. Slots from
masks need no atomic counters, so every list comes out in offset order and a
plan is the same run after run.

Layout of this module: the references (:func:`build_plan_reference`, the tables as
defined, and the kernels' parts); v1 :func:`metadata_v1` / :func:`build_tables_v1`
(a library scan over all K x |Q| entries, dense tables); v2 :func:`metadata_v2` /
:func:`metadata_cuda` (chunk counts from the search, a block scan, packed lists),
which :func:`numba_sc.gmas.plan.build_plan` runs; the ladder (``python -m numba_sc
ladder metadata``; what v2 bought on SemanticKITTI: ``numba_sc.tools.lesson.bought
("metadata")``; history: ``docs/performance.md``, "gmas/metadata.py").
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint64

from . import gemm_grouping as gg
from .layout import GmasPlan, PointLists, buffered_bits, lists_from_table, masks_from_hits, offset_layout
from ..core.conventions import ITEMS_PER_THREAD, MASK_BITS, chunk_size, mask_words, metadata_threads
from ..core.device import device_xp
from ..core.backend import filled, to_device, to_device_async, to_host
from ..core.pieces import piece
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.state import cached


# ------------------------------------------------------------------ reference
def build_plan_reference(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                         solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0) -> GmasPlan:
    """NumPy version: the plain per-offset scan, then fancy-indexed writes instead of a kernel."""
    counts, order, groups, base, rows, centre, policy = offset_layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    table = np.asarray(to_host(kernel_map.table))
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    rank = np.cumsum(table >= 0, axis=1) - 1  # pairs of offset k before output i
    kk, ii = np.nonzero((table >= 0) & (base[:, None] >= 0))
    rows_of_pair = (base[kk] + rank[kk, ii]).astype(np.int32)
    out_table = np.full((n_out, K), -1, dtype=np.int32)
    in_table = np.full((n_in, K), -1, dtype=np.int32)
    out_table[ii, kk] = rows_of_pair
    in_table[table[kk, ii], kk] = rows_of_pair
    buffered = np.array(buffered_bits(base), dtype=np.int64)
    ins, outs = lists_from_table(in_table), lists_from_table(out_table)  # with the layer's bits:
    plan = GmasPlan(counts, order, groups, base, rows, centre, PointLists(ins.slots, ins.masks, buffered),
                    PointLists(outs.slots, outs.masks, buffered), policy)
    plan._tables.update(out=out_table, **{"in": in_table})  # the dense views, already made
    return plan


def chunk_counts_reference(table, chunk: int) -> np.ndarray:
    """``counts2d`` int32 (K, n_chunks): pairs of offset k among outputs
    ``c * chunk : (c + 1) * chunk`` (the last chunk may be short)."""
    table = np.asarray(to_host(table))
    K, n_out = table.shape
    n_chunks = -(-n_out // chunk)
    hit = np.zeros((K, n_chunks * chunk), dtype=bool)  # padded with "no pair"
    hit[:, :n_out] = table >= 0
    return hit.reshape(K, n_chunks, chunk).sum(axis=2).astype(np.int32)


def masks_reference(table, n_in):
    """``(out_masks, in_masks)``, int64 (W, |Q|) and (W, |P|): bit ``k % MASK_BITS`` of word
    ``k // MASK_BITS`` of output i set when ``table[k, i] >= 0``, of input j when some
    ``table[k, i] == j`` (what :func:`masks_kernel` and the forward search write)."""
    table = np.asarray(to_host(table))
    K = table.shape[0]
    in_hit = np.zeros((K, n_in), dtype=bool)
    kk, ii = np.nonzero(table >= 0)
    in_hit[kk, table[kk, ii]] = True
    return masks_from_hits(table >= 0), masks_from_hits(in_hit)


def chunk_rank_reference(counts2d) -> np.ndarray:
    """Rank of each chunk's first pair within its offset: ``counts2d[k, :c].sum()``,
    what each block of :func:`metadata_v2` adds up for itself. It equals
    ``rank[k, c * chunk]`` of the plain per-offset scan."""
    counts2d = np.asarray(counts2d, dtype=np.int64)
    return np.cumsum(counts2d, axis=1) - counts2d


# ------------------------------------------------------------------------- v1
@cuda.jit
def metadata_v1(table, rank, base, out_table, in_table):
    """v1: one thread per entry (k, i) of the map; a pair writes its buffer row into
    both dense tables.

    ``rank[k, i]`` is the library's inclusive scan of ``table[k] >= 0`` (so the
    pair's rank is one less), ``base[k]`` the offset's first row (-1: not in the
    buffers). ``out_table`` (|Q|, K) and ``in_table`` (|P|, K) are filled with -1
    beforehand. This is the "plain way" of the module docstring, as the layouts
    define it.
    """
    t = cuda.grid(1)
    K, n_out = table.shape
    if t < K * n_out:
        k = t // n_out
        i = t - k * n_out  # neighbouring threads: neighbouring outputs of one offset
        j = table[k, i]
        if j >= 0 and base[k] >= 0:
            row = base[k] + rank[k, i] - 1
            out_table[i, k] = row
            in_table[j, k] = row


def build_tables_v1(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0):
    """v1 on the device: the layout on the host, a library scan over all K x |Q|
    entries, :func:`metadata_v1`; returns ``(out_table, in_table)``, dense (N, K).

    What v2 (:func:`metadata_cuda`, the library's) changes, and why:

    * **no library scan**: a scan over all K x |Q| entries is most of v1's time.
      v2 cuts the outputs into chunks, takes each chunk's pair
      counts from the forward search (which counted them where it found the
      pairs) and scans only inside a block;
    * **lists, not tables**: v1's tables are mostly -1 on a sparse cloud, and the
      gather and scatter would read every entry (v1 of their ladders does). v2
      writes each point's rows once, packed in offset order behind a bit mask
      (the masks, too, come from the forward search), so they read only the
      pairs;
    * **compiled per K and block size, unsigned indices**: far fewer instructions
      for the same work (:func:`metadata_v2` says why).
    """
    base = offset_layout(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)[3]
    xp = device_xp()
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    rank = xp.cumsum(table >= 0, axis=1, dtype=np.int32)
    out_table = filled((n_out, K), np.int32, -1)
    in_table = filled((n_in, K), np.int32, -1)
    if K * n_out:
        metadata_v1[blocks_for(K * n_out, THREADS), THREADS](table, rank, to_device(base), out_table, in_table)
    return out_table, in_table



# -------------------------------------------------------------------- kernels
# A chunk is CHUNK = threads * ITEMS_PER_THREAD consecutive outputs of one offset;
# thread t of its block owns the ITEMS_PER_THREAD outputs starting at
# chunk start + t * ITEMS_PER_THREAD.
MAX_THREADS = 128  # size of the shared arrays below (a compile-time constant)


def _check_threads(threads: int) -> int:
    # The tree reduction halves the active threads each step, so it needs a power
    # of two; the shared arrays hold MAX_THREADS entries.
    if not (0 < threads <= MAX_THREADS and threads & (threads - 1) == 0):
        raise ValueError(f"threads must be a power of two up to {MAX_THREADS}, got {threads}")
    return threads


@cuda.jit(device=True)
def _thread_range(c, chunk, n_out):
    """Outputs ``lo:hi`` of this thread in chunk ``c`` (empty past the last output).
    (A chunk is always ``blockDim.x * ITEMS_PER_THREAD`` outputs: the constant
    saves every thread a division.)"""
    lo = c * chunk + cuda.threadIdx.x * ITEMS_PER_THREAD
    return lo, min(lo + ITEMS_PER_THREAD, n_out)


@cuda.jit(device=True)
def _hits(table, k, lo, hi):
    """Pairs of offset k among outputs ``lo:hi``."""
    n = 0
    for i in range(lo, hi):
        if table[k, i] >= 0:
            n += 1
    return n


@cuda.jit
def chunk_counts_kernel(table, chunk, counts2d):
    """One block per (offset k, chunk c): ``counts2d[k, c]`` = pairs of k in chunk c.

    Thread t counts its 8 outputs: 32 contiguous bytes of the table, one memory
    sector, so the block reads its 4 KB piece of row k once and in full. Blocks
    are numbered with k varying fastest (block = c * K + k), as in
    :func:`metadata_v2`.
    """
    K = table.shape[0]
    k = cuda.blockIdx.x % K
    c = cuda.blockIdx.x // K
    t = cuda.threadIdx.x
    lo, hi = _thread_range(c, chunk, table.shape[1])
    partial = cuda.shared.array(MAX_THREADS, int32)
    partial[t] = _hits(table, k, lo, hi)
    cuda.syncthreads()  # every thread's count is in before thread 0 adds them up
    if t == 0:
        # A sequential sum: one number per block, read back once.
        total = 0
        for u in range(cuda.blockDim.x):
            total += partial[u]
        counts2d[k, c] = total




AHEAD = 8  # table entries a thread reads before testing the first of them


@cuda.jit
def masks_kernel(table, out_masks, in_masks):
    """One thread per output i: which offsets have a pair at i, and at its inputs.

    ``out_masks[w, i]`` gets bit ``b`` when ``table[32 w + b, i] >= 0``, and the
    input ``j`` of that pair gets the same bit in ``in_masks[w, j]`` (zeroed
    beforehand; an atomic OR, as other threads set other bits of j's word). A
    map from the kernel path comes with its masks (the forward search set the
    bits where it found the pairs); this pass is for maps from elsewhere.
    Neighbouring threads read neighbouring entries of each table row
    (offset-major): one coalesced read of the table. The reads come AHEAD at a
    time, all issued before the first is tested, so that a thread waits for
    memory once per AHEAD offsets instead of once per offset.
    """
    i = cuda.grid(1)
    K = table.shape[0]
    if i < table.shape[1]:
        ahead = cuda.local.array(AHEAD, int32)
        m = 0
        for k0 in range(0, K, AHEAD):
            for u in range(AHEAD):  # a constant-length loop: unrolled, loads in flight together
                ahead[u] = table[k0 + u, i] if k0 + u < K else -1
            for u in range(AHEAD):
                k = k0 + u
                if ahead[u] >= 0:
                    bit = 1 << (k % MASK_BITS)
                    m |= bit
                    cuda.atomic.or_(in_masks, (k // MASK_BITS, ahead[u]), bit)
                if k < K and (k % MASK_BITS == MASK_BITS - 1 or k == K - 1):
                    out_masks[k // MASK_BITS, i] = m  # the word is complete
                    m = 0


@cached
def metadata_v2(K: int, threads: int):
    """The lists kernel compiled for K offsets and blocks of ``threads`` threads.

    One block per (offset k, chunk c): the buffer rows of the pairs of k in chunk
    c, written into the lists of their input and output.

    Blocks are numbered with k varying fastest (block = c * K + k), so the K
    blocks of a chunk run at about the same time and read the same part of the
    table: what one reads, the others find in the L2 cache.

    1. Rank: each thread counts the pairs of k among its run of 8 outputs, and
       turns the counts into the rank of its first pair within offset k (ranks
       rise in output order: the block owns consecutive outputs, each thread a
       contiguous run of them). That rank is the pairs of k in the chunks before
       c (``counts2d[k, :c].sum()``: each thread adds a strided share into
       ``first[0]``) plus the pairs of the threads before this one: an exclusive
       scan of the counts over the block, done as a Hillis-Steele scan in shared
       memory - log2(threads) steps, in step d every thread adds the value d
       places before it.
    2. Row: pair number ``rank`` of offset k gets row ``base[k] + rank``.
    3. Lists: pair (k, i, j) goes to the slot of output i's list and of input j's
       that counts the buffered offsets below k in the point's mask
       (``buffered``: the bits of the offsets in the buffers). Both lists come out
       in offset order, whichever block runs first, with no atomics and no
       counters to zero.

    ``base[k]`` is the same for the whole block, so a block whose offset is not
    in the buffers leaves together, before any barrier.

    Why compiled per (K, threads), with unsigned indices: this kernel is bound by
    its instruction issue, and besides the work it spent instructions on a 64-bit
    division of the block index by a run-time K, another by the run-time block
    size in the share loop, and, on every table, mask and slot access, 64-bit
    index arithmetic including the few instructions Numba adds to wrap a
    negative *signed* index around. With K, the block size and the chunk
    compile-time constants and every index unsigned (NumPy unsigned constants
    keep Numba's arithmetic unsigned: a signed-unsigned mix would be float64),
    each of those is gone. Why a scan, not one thread adding up the block's
    counts one by one: in the serial loop one lane of the warp works while the
    others wait.

    v2 of this stage's ladder (v1: :func:`metadata_v1`). What it bought on the
    SemanticKITTI scan, one 3x3x3 layer: ``python -m numba_sc ladder metadata``,
    recorded in ``benchmarks/results/ladder_all_kitti.json``.
    """
    k_count, items = np.uint64(K), np.uint64(ITEMS_PER_THREAD)
    step, chunk = np.uint64(threads), np.uint64(threads * ITEMS_PER_THREAD)
    bits = np.uint64(MASK_BITS)
    log_threads = threads.bit_length() - 1  # threads is a power of two

    @cuda.jit(device=True)
    def slot(masks, buffered, k, n):
        """Entries of point n before offset k: its buffered offsets below k with a
        pair (popcounts of its mask words), i.e. where pair (k, n) goes in n's list."""
        w = k // bits
        below = (1 << int64(k % bits)) - 1
        s = cuda.popc(masks[w, n] & buffered[w] & below)
        for v in range(w):
            s += cuda.popc(masks[v, n] & buffered[v])
        return uint64(s)

    @cuda.jit
    def metadata_v2_kernel(table, counts2d, base, buffered, out_masks, in_masks, in_slots, out_slots):
        k = uint64(cuda.blockIdx.x) % k_count  # constant divisor: a multiply and a shift
        c = uint64(cuda.blockIdx.x) // k_count
        first_row = base[k]
        if first_row < 0:
            return  # no pairs, or the centre multiplied directly
        t = uint64(cuda.threadIdx.x)
        lo = c * chunk + t * items  # this thread's outputs: lo .. lo + 7, those below n_out
        n_out = uint64(table.shape[1])
        row = table[k]  # offset k's entries, indexed from here on
        n_hits = 0
        for u in range(items):  # a constant trip count: unrolled
            if lo + u < n_out and row[lo + u] >= 0:
                n_hits += 1
        # -- the rank of this thread's first pair
        scan = cuda.shared.array(MAX_THREADS, int32)
        first = cuda.shared.array(1, int32)
        share = 0
        for cc in range(t, c, step):
            share += counts2d[k, cc]
        if cuda.threadIdx.x == 0:
            first[0] = 0
        scan[t] = n_hits
        cuda.syncthreads()  # first[0] is zeroed, every count is in
        if share > 0:
            cuda.atomic.add(first, 0, share)
        for e in range(log_threads):  # inclusive scan: scan[t] = n_hits of threads 0..t
            d = np.uint64(1) << uint64(e)
            v = scan[t - d] if t >= d else 0
            cuda.syncthreads()  # everyone has read before anyone writes
            scan[t] += v
            cuda.syncthreads()  # ... and written before the next step reads
        if log_threads == 0:
            cuda.syncthreads()  # (no step ran: the share's atomic must still land first)
        rank = first[0] + scan[t] - n_hits
        # -- the rows, into both lists
        for u in range(items):  # the same outputs again: likely still cached
            i = lo + u
            if i < n_out:
                j = row[i]
                if j >= 0:
                    r = first_row + rank
                    rank += 1
                    out_slots[slot(out_masks, buffered, k, i), i] = r
                    in_slots[slot(in_masks, buffered, k, uint64(j)), uint64(j)] = r

    return metadata_v2_kernel



def masks_cuda(table, n_in):
    """``(out_masks, in_masks)`` of a map's table (kernel; see :func:`masks_reference`)."""
    table = to_device(table)
    K, n_out = table.shape
    W = mask_words(K)
    out_masks = device_xp().empty((W, n_out), dtype=np.int64)  # every word is written
    in_masks = filled((W, n_in), np.int64, 0)  # bits are ORed in
    if n_out:
        launch(masks_kernel, n_out, table, out_masks, in_masks)
    return out_masks, in_masks



def chunk_counts_cuda(table, threads: int | None = None):
    """``counts2d`` int32 (K, n_chunks): pairs of each offset in each chunk (kernel)."""
    threads = _check_threads(threads or metadata_threads())
    chunk = chunk_size(threads)
    table = to_device(table)
    K, n_out = table.shape
    n_chunks = -(-n_out // chunk)
    counts2d = device_xp().empty((K, n_chunks), dtype=np.int32)  # every entry is written
    launch(chunk_counts_kernel, K * n_chunks, table, chunk, counts2d,
           threads=threads, blocks=K * n_chunks)
    return counts2d


def copy_layout(base):
    """``base`` and :func:`~numba_sc.gmas.layout.buffered_bits` in one int64 array, copied
    to the device at once (one pinned copy), handed out as two pieces:
    ``(base, buffered)`` on the device, what :func:`metadata_v2` reads."""
    K = len(base)
    values = base.tolist()
    bits = buffered_bits(base)
    layout = to_device_async(np.array(values + bits, dtype=np.int64))
    return piece(layout, 0, (K,), np.int64), piece(layout, 8 * K, (len(bits),), np.int64)


def metadata_cuda(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                  solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True,
                  threads: int | None = None, launch_rows=0, device_layout=copy_layout) -> GmasPlan:
    """v2 on the device, the library's: the lists, one kernel and no sync (plus, for a map
    that did not come with them, a pass for the pair counts per chunk and one for the
    masks).

    ``threads``: threads per block, so chunks of ``threads * ITEMS_PER_THREAD``
    outputs (default :func:`metadata_threads`; the tests vary it).
    ``device_layout(base) -> (base, buffered)`` on the device: how the base rows
    get there (default :func:`copy_layout`, a copy each call; the library keeps
    them per device, :func:`numba_sc.gmas.plan.build_plan_cuda`).

    GPU cost for K offsets, |Q| outputs and |P| inputs (int32 table; K = 27,
    |Q| = |P| = 94k makes 4K|Q| = 10 MB):

    * :func:`metadata_v2` reads the map twice (4K|Q| each; the K blocks of a chunk
      run together, so the second read and the other offsets' reads mostly hit the
      L2), ``counts2d`` and, per pair, one mask word of its output and of its input
      (8 B each), and writes 4 bytes per pair into each side's list.
    * (``masks_kernel``, only for a map without masks: reads the map once and
      writes 8 bytes per point and side.)

    About 8K|Q| + 24 bytes a pair: ~25 MB for 94k points, ~230 MB for 1M, against
    ~430 MB when this stage wrote the dense (K, N) tables (and the gather and
    scatter then read all of them: 4K|P| + 4K|Q| more per channel tile). These are
    estimates from bytes moved; the kernel is in fact bound by its instruction
    issue rate (index arithmetic and the block scan), which is why it is compiled
    per K and block size with unsigned indices (:func:`metadata_v2`). The only
    device->host copy is the K pair counts, which the host needs anyway to size the
    buffers and shape the GEMMs; the base rows go the other way through pinned
    memory, without a sync.
    """
    counts, order, groups, base, rows, centre, policy = offset_layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    threads = _check_threads(threads or metadata_threads())
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    chunk = chunk_size(threads)
    found = kernel_map.found  # what the forward search found with the pairs, as the kernels take it
    counts2d = None if found is None or found.chunk != chunk else found.chunk_counts
    out_masks, in_masks = (None, None) if found is None else (found.out_masks, found.in_masks)
    if counts2d is None:
        counts2d = chunk_counts_cuda(table, threads)  # a map from elsewhere: count them here
    if out_masks is None or in_masks is None:
        out_masks, in_masks = masks_cuda(table, n_in)
    d_base, buffered = device_layout(base)
    # Slots past a point's count are never written nor read: no fill. K per point
    # is what a point could need at most; the memory is reserved, not touched.
    # One allocation for both sides, two pieces of it.
    slots = device_xp().empty(K * (n_in + n_out), dtype=np.int32)
    in_slots = piece(slots, 0, (K, n_in), np.int32)
    out_slots = piece(slots, 4 * K * n_in, (K, n_out), np.int32)
    if counts2d.size:
        launch(metadata_v2(K, threads), counts2d.size, table, counts2d, d_base, buffered, out_masks,
               in_masks, in_slots, out_slots, threads=threads, blocks=counts2d.size)
    return GmasPlan(counts, order, groups, base, rows, centre, PointLists(in_slots, in_masks, buffered),
                    PointLists(out_slots, out_masks, buffered), policy)


# -------------------------------------------------------------------- the ladder
def _dense_tables(result):
    """A plan's dense tables (made from its lists), or v1's ``(out_table, in_table)``, as
    one host array."""
    out_table, in_table = (result.out_table, result.in_table) if isinstance(result, GmasPlan) else result
    return np.concatenate([to_host(out_table).ravel(), to_host(in_table).ravel()])


def _bytes_moved(w):
    """At least: the kernel map's (K, |Q|) table read once (int32); written, each buffered
    pair's buffer row twice, once where the gather looks it up (by input) and once where
    the scatter does (by output), an int32 each: the least any layout of the tables holds."""
    plan = build_plan_reference(w["km"])
    buffered = int(plan.counts[plan.base >= 0].sum())  # pairs with a buffer row (not the centre's)
    return w["km"].table.nbytes + buffered * 2 * 4


LADDER = Ladder(
    "metadata",
    (Rung("v1", lambda w: build_tables_v1(w["km"]),
          "dense tables: a library scan over all K x |Q| entries, one thread per entry"),
     Rung("v2", lambda w: metadata_cuda(w["km"]),
          "+ chunks counted by the search, a scan inside each block, per-point lists (the library's)")),
    workload=lambda ctx: {"km": ctx.layer()["km"]},  # one 3x3x3 submanifold layer's map
    reference=lambda w: _dense_tables(build_plan_reference(w["km"])),
    collect=_dense_tables,
    bytes_moved=_bytes_moved,
)
