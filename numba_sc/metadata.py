"""Stage 7, metadata tables: where every pair of the kernel map lives in the buffers.

The GMaS step (paper Section 2.2, Figure 2) multiplies, for every offset k, the
features of all inputs that feed some output through k by ``W[k]``. To do that
with a few big GEMMs, the gather copies those input rows into one *input buffer*
(offset by offset, groups padded to equal height, :mod:`numba_sc.gemm_grouping`),
the GEMMs write an *output buffer* of the same row layout, and the scatter sums
each output's partial results. All three need to know, for each pair, its
**buffer row**. That is what this stage computes, from the kernel map alone.

The layouts (defined here, used by gather, GEMM and scatter):

``order``
    The offsets in buffer order: by non-decreasing pair count (Minuet) or the
    map's order; offsets without pairs and the submanifold centre are left out.
``base[k]``
    First buffer row of offset k (``-1`` when k is not in the buffer). Inside a
    group of ``G`` offsets padded to ``R`` rows, member m starts at
    ``group.start + m * R``; its rows past ``counts[k]`` are padding.
buffer row of pair (k, i)
    ``base[k] + rank``, where ``rank`` counts the pairs of offset k whose output
    index is below i (so each offset's rows follow the output order: the GEMM
    reads and the scatter writes are as sequential as they can be).
input table ``in_table`` (|P| x K), int32
    ``in_table[j, k]`` = buffer row that input j is copied to for offset k, or -1.
output table ``out_table`` (|Q| x K), int32
    ``out_table[i, k]`` = buffer row holding output i's partial result through
    offset k, or -1.
memory layout of both tables
    Offset-major: the device keeps ``(K, N)`` C-contiguous arrays and the plan
    shows them as their transposes, ``(N, K)`` views (Fortran order). Every
    kernel that touches them works on one offset at a time for neighbouring
    points: :func:`tables_kernel` writes offset k's entries of consecutive
    outputs, and the warps of the gather and scatter read entry k of
    consecutive points. Offset-major, those are neighbouring addresses. In the
    row-major (N, K) layout each 4-byte access fell in a sector of its own: on the
    H100 the tables kernel took 604 us for 1M points that way
    (``benchmarks/probe_timeline.py``).

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

How the device finds the ranks. The plain way is a scan of ``table >= 0`` along
each offset's row, but a library scan over all K x |Q| entries is what used to
dominate this stage (CuPy on an H100: 107 us for 27 x 94k, 854 us for 27 x 1M,
``benchmarks/results/probe_host_costs_h100_2026-11-22.json``). Instead the outputs are cut
into *chunks* of ``CHUNK`` consecutive outputs (1024 on a GPU: 128 threads x 8
outputs each), and the rank is split in two parts:

1. :func:`chunk_counts_kernel`, one block per (offset k, chunk c), counts the
   pairs of k in chunk c: ``counts2d`` (K x n_chunks). A map from the kernel
   path already has them (``KernelMap.chunk_counts``): its forward search
   counted each pair where it found it, so this pass over the map is skipped.
2. :func:`tables_kernel`, one block per (k, c): the block first adds up
   ``counts2d[k, :c]``, the pairs of offset k in the chunks before c, which is
   the rank of chunk (k, c)'s first pair (at most |Q| / 1024 numbers, shared
   among the block's threads). Then each thread counts its run of 8 outputs,
   the block scans those counts, and each thread walks its run again, giving
   its pairs consecutive ranks from there and writing both tables. (A library
   scan of ``counts2d`` would do step 2's sum once for all blocks, but it costs
   three launches and ~60 us of host time; the sums cost the GPU next to nothing.)

The same example in chunks of 2 outputs: ``counts2d = [[1, 1], [2, 1]]``, so
chunk 1's first pair has rank 1 in k=0 and rank 2 in k=1: output 2 (chunk 1) is
pair number 1 of k=0 (row 0 + 1 = 1) and pair number 2 of k=1 (row 2 + 2 = 4),
as above.

GPU cost for K offsets, |Q| outputs and |P| inputs (int32 everywhere; K = 27,
|Q| = |P| = 94k makes 4K|Q| = 10 MB):

* ``chunk_counts_kernel`` reads the map once (4K|Q|) and writes 4 bytes per
  chunk (4K|Q| / 1024, 10 KB).
* the fill of ``in_table`` writes 4K|P|.
* ``tables_kernel`` reads the map again (4K|Q|; a 10 MB map may still be in the
  50 MB L2) and the chunk counts, writes ``out_table`` (4K|Q|) and 4 bytes of
  ``in_table`` per buffered pair.

About 8K|Q| read and 8K|Q| + 4 bytes a pair written: ~40 MB, ~15 us at the
H100's ~3 TB/s for 94k points, ~430 MB (~150 us) for 1M, against 107 / 854 us
for the old 2-D scan alone; the old path also wrote ``table >= 0`` and the
K x |Q| rank to memory and read them back (~10K|Q| more bytes). These are
estimates from bytes moved. The only device->host copy is the K pair counts,
which the host needs anyway to size the buffers and shape the GEMMs; the base
rows go the other way through pinned memory, without a sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda, int32

from . import gemm_grouping as gg
from .backend import device_xp, filled, launch, resolve_backend, simulating, to_device, to_device_async, to_host


@dataclass
class GmasPlan:
    """Everything the gather, GEMMs and scatter need for one layer."""

    counts: np.ndarray  # host int64 (K,): pairs per offset
    order: np.ndarray  # host int64: offsets in buffer order (no empty ones, no centre)
    groups: list  # list of gemm_grouping.Group, laid out back to back
    base: np.ndarray  # host int64 (K,): first buffer row of each offset, or -1
    rows: int  # buffer rows, padding included
    centre: int  # offset multiplied directly (submanifold), or -1
    in_table: object  # int32 (|P|, K) buffer rows or -1 (host or device)
    out_table: object  # int32 (|Q|, K) buffer rows or -1 (host or device)
    policy: tuple = (gg.DEFAULT_MAX_PADDING, gg.DEFAULT_SOLO_ROWS)  # (max_padding, solo_rows)
    _report: dict = field(default=None, repr=False)

    @property
    def launches(self) -> int:
        return len(self.groups)

    @property
    def report(self) -> dict:
        """:func:`numba_sc.gemm_grouping.padding_report` of this layer (sorted vs map
        order). Made on first use: it groups the offsets twice more, ~0.2 ms of
        Python that a layer in a network does not need."""
        if self._report is None:
            self._report = gg.padding_report(self.counts, self.centre, *self.policy)
        return self._report


def _host_counts(kernel_map) -> np.ndarray:
    """The map's pair counts on the host: a :class:`numba_sc.KernelMap` from the kernel
    path already holds them (read with its report); anything else is read here."""
    if hasattr(kernel_map, "host_counts"):
        return kernel_map.host_counts()
    return np.asarray(to_host(kernel_map.counts), dtype=np.int64)


def submanifold_centre(kernel_map, counts=None) -> int:
    """Index of the offset (0, 0, 0) when it maps every point to itself, else -1.

    ``counts``: the map's pair counts already on the host (saves a device read).
    """
    offsets = to_host(kernel_map.offsets)
    hits = np.flatnonzero((offsets == 0).all(axis=1))
    if len(hits) == 0:
        return -1
    c = int(hits[0])
    n_in, n_out = len(kernel_map.in_coords), len(kernel_map.out_coords)
    counts = _host_counts(kernel_map) if counts is None else counts
    return c if (n_in == n_out == int(counts[c])) else -1


def grouping_report(kernel_map, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True) -> dict:
    """Padding overhead and GEMM launches of a layer, offsets sorted vs map order.

    See :func:`numba_sc.gemm_grouping.padding_report`; the submanifold centre (when
    multiplied directly) is in neither count.
    """
    centre = submanifold_centre(kernel_map) if direct_centre else -1
    return gg.padding_report(_host_counts(kernel_map), centre, max_padding, solo_rows)


def _layout(kernel_map, sort, max_padding, solo_rows, direct_centre):
    """Host part: counts -> order, groups, base rows."""
    counts = _host_counts(kernel_map)  # read with the Map step's report: no device read here
    centre = submanifold_centre(kernel_map, counts) if direct_centre else -1
    order = gg.offset_order(counts, sort, centre)
    groups = gg.make_groups(counts, order, max_padding, solo_rows)
    base = np.full(len(counts), -1, dtype=np.int64)
    for g in groups:
        for m, k in enumerate(g.members):
            base[k] = g.start + m * g.rows
    rows = sum(g.padded_rows for g in groups)
    return counts, order, groups, base, rows, centre, (max_padding, solo_rows)


# ------------------------------------------------------------------ reference
def build_plan_reference(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                         solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True) -> GmasPlan:
    """NumPy version: the plain per-offset scan, then fancy-indexed writes instead of a kernel."""
    counts, order, groups, base, rows, centre, policy = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre)
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
    return GmasPlan(counts, order, groups, base, rows, centre, in_table, out_table, policy)


def chunk_counts_reference(table, chunk: int) -> np.ndarray:
    """``counts2d`` int32 (K, n_chunks): pairs of offset k among outputs
    ``c * chunk : (c + 1) * chunk`` (the last chunk may be short)."""
    table = np.asarray(to_host(table))
    K, n_out = table.shape
    n_chunks = -(-n_out // chunk)
    hit = np.zeros((K, n_chunks * chunk), dtype=bool)  # padded with "no pair"
    hit[:, :n_out] = table >= 0
    return hit.reshape(K, n_chunks, chunk).sum(axis=2).astype(np.int32)


def chunk_rank_reference(counts2d) -> np.ndarray:
    """Rank of each chunk's first pair within its offset: ``counts2d[k, :c].sum()``,
    what each block of :func:`tables_kernel` adds up for itself. It equals
    ``rank[k, c * chunk]`` of the plain per-offset scan."""
    counts2d = np.asarray(counts2d, dtype=np.int64)
    return np.cumsum(counts2d, axis=1) - counts2d


# -------------------------------------------------------------------- kernels
# A chunk is CHUNK = threads * ITEMS_PER_THREAD consecutive outputs of one offset;
# thread t of its block owns the ITEMS_PER_THREAD outputs starting at
# chunk start + t * ITEMS_PER_THREAD.
METADATA_THREADS = 128  # threads per block on the GPU: CHUNK = 1024 outputs
# Under the simulator every CUDA thread is a Python thread: 16 threads (CHUNK = 128)
# keep the tests fast and put chunk boundaries inside clouds of a few hundred points.
SIMULATOR_THREADS = 16
# Tried on the H100: 32 outputs per thread (fewer blocks, so fewer of the one-thread
# scans) made the tables kernel 2.3x slower on 1M points (330 -> 753 us): a warp's
# runs then lie 128 bytes apart and every load instruction touches 32 cache lines.
ITEMS_PER_THREAD = 8
MAX_THREADS = 128  # size of the shared arrays below (a compile-time constant)


def metadata_threads() -> int:
    """Threads per block of both kernels: 128 on the GPU, 16 simulated."""
    return SIMULATOR_THREADS if simulating() else METADATA_THREADS


def chunk_size(threads: int | None = None) -> int:
    """Outputs per chunk for blocks of ``threads`` threads (default: this machine's)."""
    return (threads or metadata_threads()) * ITEMS_PER_THREAD


def _check_threads(threads: int) -> int:
    # The tree reduction halves the active threads each step, so it needs a power
    # of two; the shared arrays hold MAX_THREADS entries.
    if not (0 < threads <= MAX_THREADS and threads & (threads - 1) == 0):
        raise ValueError(f"threads must be a power of two up to {MAX_THREADS}, got {threads}")
    return threads


@cuda.jit(device=True)
def _thread_range(c, chunk, n_out):
    """Outputs ``lo:hi`` of this thread in chunk ``c`` (empty past the last output)."""
    per = chunk // cuda.blockDim.x
    lo = c * chunk + cuda.threadIdx.x * per
    return lo, min(lo + per, n_out)


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
    :func:`tables_kernel`.
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
        # A sequential sum, not a tree: see the scan in tables_kernel for why.
        total = 0
        for u in range(cuda.blockDim.x):
            total += partial[u]
        counts2d[k, c] = total


@cuda.jit
def tables_kernel(table, counts2d, base, chunk, in_table, out_table):
    """One block per (offset k, chunk c): the buffer row of every pair of k in chunk c.

    ``in_table`` and ``out_table`` are offset-major, (K, |P|) and (K, |Q|).

    The rank of the chunk's first pair within offset k is the number of pairs of
    k in chunks 0..c-1: ``counts2d[k, :c].sum()``, summed here by the block (each
    thread a strided share, thread 0 adds the shares).

    Why each thread owns a *contiguous* run of outputs: ranks follow the output
    order, so when thread t's outputs all come after thread t - 1's, a thread's
    first rank is the chunk's first rank plus the pairs of the threads before it,
    one exclusive scan over the block. (With the usual strided ownership, output
    t + s * threads, the ranks of the threads would interleave.)
    """
    K = table.shape[0]
    k = cuda.blockIdx.x % K
    c = cuda.blockIdx.x // K
    t = cuda.threadIdx.x
    lo, hi = _thread_range(c, chunk, table.shape[1])
    first_row = base[k]
    if first_row < 0:
        # Offset k is not in the buffers (no pairs, or the centre multiplied
        # directly). base[k] is the same for the whole block, so the whole block
        # leaves here together and nobody waits at a barrier below for it.
        for i in range(lo, hi):
            out_table[k, i] = -1  # every entry is written: out_table needs no fill
        return
    before = cuda.shared.array(MAX_THREADS, int32)  # shares of counts2d[k, :c]
    scan = cuda.shared.array(MAX_THREADS, int32)
    share = 0
    for cc in range(t, c, cuda.blockDim.x):
        share += counts2d[k, cc]
    before[t] = share
    scan[t] = _hits(table, k, lo, hi)
    cuda.syncthreads()  # every thread's numbers are in before thread 0 adds them up
    if t == 0:
        # Sequential sums by thread 0. Why not a parallel (Hillis-Steele) scan: it
        # takes log2(threads) steps of two barriers each (14 at 128 threads)
        # against 128 additions here, and either is small next to the block's
        # own memory reads (a thread's first load waits about half a
        # microsecond). Under the simulator, where every CUDA thread is a Python
        # thread, each barrier costs milliseconds per block.
        first = 0
        for u in range(cuda.blockDim.x):
            first += before[u]
        running = first
        for u in range(cuda.blockDim.x):
            n = scan[u]
            scan[u] = running
            running += n
    cuda.syncthreads()  # the scan is written before anyone reads its entry
    rank = scan[t]  # pairs of offset k before this thread's first output
    for i in range(lo, hi):  # the same outputs again, read a moment ago: likely still cached
        j = table[k, i]
        if j >= 0:
            row = first_row + rank
            out_table[k, i] = row
            in_table[k, j] = row  # j is distinct per i for a fixed k: no write race
            rank += 1
        else:
            out_table[k, i] = -1


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


def build_plan_cuda(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True,
                    threads: int | None = None) -> GmasPlan:
    """Device version: count per chunk, one fill, the tables (two kernels, no sync).

    ``threads``: threads per block, so chunks of ``threads * ITEMS_PER_THREAD``
    outputs (default :func:`metadata_threads`; the tests vary it).
    """
    counts, order, groups, base, rows, centre, policy = _layout(
        kernel_map, sort, max_padding, solo_rows, direct_centre)
    threads = _check_threads(threads or metadata_threads())
    table = to_device(kernel_map.table)
    K, n_out = table.shape
    n_in = len(kernel_map.in_coords)
    chunk = chunk_size(threads)
    counts2d = getattr(kernel_map, "chunk_counts", None)  # counted by the forward search
    if counts2d is None or getattr(kernel_map, "chunk", None) != chunk:
        counts2d = chunk_counts_cuda(table, threads)  # a map from elsewhere: count them here
    in_table = filled((K, n_in), np.int32, -1)  # offset-major; entries without a pair stay -1
    out_table = device_xp().empty((K, n_out), dtype=np.int32)  # the kernel writes every entry
    n_blocks = counts2d.size
    launch(tables_kernel, n_blocks, table, counts2d, to_device_async(base.astype(np.int32)),
           chunk, in_table, out_table, threads=threads, blocks=n_blocks)
    # (N, K) views of the offset-major arrays: the shape the plan documents.
    return GmasPlan(counts, order, groups, base, rows, centre, in_table.T, out_table.T, policy)


def build_plan(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
               solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, backend=None) -> GmasPlan:
    """Metadata of one layer from its kernel map (see the module docstring).

    ``sort=False`` keeps the map's offset order (to measure what sorting buys);
    ``direct_centre=False`` sends the submanifold centre through the buffers too.
    """
    if resolve_backend(backend) == "reference":
        return build_plan_reference(kernel_map, sort, max_padding, solo_rows, direct_centre)
    return build_plan_cuda(kernel_map, sort, max_padding, solo_rows, direct_centre)
