"""Fetch-on-demand: gather, matrix product and scatter fused into one kernel.

The library's GMaS step (stages 8-10) moves every pair's data through two
buffers in global memory: the gather copies each pair's input row into the
input buffer, the grouped GEMMs read that buffer and write one partial result
per pair into the output buffer, and the scatter sums those rows into the
outputs. The *fetch-on-demand* dataflow (MinkowskiEngine's, made a single
launch by PCEngine's segmented fusion, and one of the dataflows TorchSparse++
tunes between) keeps no buffer at all:

* a thread block takes a tile of pairs of *one* offset ``k``;
* it reads those pairs' input rows straight from the feature array into
  shared memory (the "fetch"), next to a tile of ``W[k]``;
* it multiplies the two tiles on chip;
* it adds each product row into its output row with atomic adds (there may be
  up to K - 1 other pairs, in other blocks, adding into the same row).

The rule it computes, for a kernel map table ``table`` (K, n_out) int32, where
``table[k, i]`` is the input row feeding output ``i`` through ``W[k]`` or -1::

    out[i] = init[i] + sum over k != skip with table[k, i] >= 0 of features[table[k, i]] @ W[k]

``skip`` is the offset the caller has already done as one dense product (the
submanifold centre: every point is its own pair, so ``init = features @
W[centre]`` needs no indices), or -1 for none; ``init`` is zero when not given.

The metadata: a pair list
-------------------------
All offsets run in ONE launch. The pairs are listed offset by offset (input row
and output row of each pair), and a small block table built on the host from
the per-offset pair counts tells each thread block which offset it serves and
where its pairs start and stop in the list (:class:`FetchPlan`,
:func:`fetch_plan`). A block never straddles two offsets, so it needs one tile
of one weight matrix at a time. The plan depends on the map alone, not on the
features, the weights or the channel counts, so every layer that shares a map
shares its plan.

Worked example: the one-axis map of :mod:`numba_sc.map.kernel_map`, three points at
x = 0, 1, 3, offsets -1, 0, +1, one channel in and out::

    table = [[-1,  0, -1],     counts = [1, 3, 1], skip = 1 (the centre)
             [ 0,  1,  2],
             [ 1, -1, -1]]

    pair list (offset 0, then offset 2; the centre is skipped):
        pair 0: offset 0, input 0 -> output 1
        pair 1: offset 2, input 1 -> output 0
    in_rows = [0, 1], out_rows = [1, 0]
    block table (tile_p = 64): block 0 -> offset 0, pairs [0, 1)
                               block 1 -> offset 2, pairs [1, 2)

With features ``f = [1, 2, 3]`` and ``W = [10, 100, 1000]`` (one 1x1 matrix per
offset), the caller's dense centre product is ``init = f * 100 = [100, 200,
300]``. Block 0 fetches ``f[0] = 1``, multiplies by ``W[0] = 10`` and adds 10
to output 1; block 1 fetches ``f[1] = 2``, multiplies by ``W[2] = 1000`` and
adds 2000 to output 0::

    out = [100 + 2000, 200 + 10, 300] = [2100, 210, 300]

(By the definition: the point at x = 0 sees x = 1 through +1, 2 * 1000; the
point at x = 1 sees x = 0 through -1, 1 * 10; the point at x = 3 has no
neighbour.)

Napkin math: what is saved, what is paid
----------------------------------------
For ``n`` pairs outside the centre, fp32: gather-GEMM-scatter writes the input
buffer (``4 n C_in`` bytes), the GEMMs read it back, write the output buffer
(``4 n C_out``) and the scatter reads that back: ``8 n (C_in + C_out)`` bytes of
buffer traffic that fetch-on-demand never makes. Both do the same
``2 n C_in C_out`` flops. The gather reads each input point's row once and
copies it to all its pairs; fetch-on-demand reads it once per pair instead
(``4 n C_in``, mostly L2 hits: a point is fetched by up to K - 1 pairs).

What fetch-on-demand pays instead:

* ``n * C_out`` atomic adds (each a read-modify-write of 4 bytes, carried out
  in the L2 cache), where the scatter writes each output value once;
* each block reads its tile of ``W[k]``: over all channel tiles ``4 C_in
  C_out`` bytes per block of 64 pairs, as many bytes per pair as the fetched
  row itself when ``C_out = 64`` (L2 hits: K small matrices);
* above 128 output channels the rows are fetched once per channel tile;
* for fp16, one more pass over the output (below).

SemanticKITTI at 0.05 m (94,444 voxels; ~190k pairs outside the centre in a
3x3x3 layer), 64 channels in and out, fp32: the two buffers would be 2 x 48.6
MB, written once and read once, 195 MB in all, which at the H100's bandwidth is
about 65 us at ~3 TB/s (typed: napkin math); fetch-on-demand issues 12.2M
atomic adds into a 24 MB output (which fits the H100's 50 MB L2) instead.
Which costs less depends on the channels and the cloud, which is why PCEngine
and TorchSparse++ pick per layer group (PCEngine: fetch-on-demand for small
channel counts, gather-GEMM-scatter for large ones). Measured here, the atomics and their waits dominate: as a whole
layer it beat gather-GEMM-scatter only at the smallest channel counts on small
clouds given their map, where the implicit GEMM was faster still, so
``dataflow="auto"`` never picks it (figures: ``docs/performance.md``,
"dataflows/fetch_on_demand.py").

Numba exposes no tensor-core (``mma``) intrinsics, so the products here run on
the CUDA cores as fp32 fused multiply-adds, whatever the feature dtype; the
library's grouped GEMMs call cuBLAS, which does use tensor cores. The
comparison is therefore not only of dataflows but of arithmetic units.

Accumulation, fp16 and determinism
----------------------------------
Products are summed in fp32 with ``cuda.atomic.add`` on float32:

* **float32** features: the atomics add straight into the output, which starts
  as a copy of ``init`` (or zeros);
* **float16** features: the atomics add into a float32 array of the output's
  shape, and one extra pass casts it to float16 at the end. Adding in half
  precision would round after every one of an output's up to K - 1 adds
  (11 significant bits), and Numba's ``cuda.atomic.add`` takes no float16
  array at all (numba-cuda 0.30: float32, float64 and integers); the price is
  one float32 array of ``4 n_out C_out`` bytes, written by the atomics and read
  once more by the cast, and the cast's launch.

Floating-point addition is not associative, and the order in which the atomic
adds of different blocks reach an output is decided by the hardware, run by
run: the fp32 sums can differ in their last bits from one run to the next.
Gather-GEMM-scatter sums each output in a fixed order (the scatter's offset
order) and is bit-for-bit repeatable. The tests therefore compare with a
tolerance, never bit for bit.

Using it (features in the map's order, ``features[km.in_order]`` for the caller's)::

    km = build_kernel_map(coords, 3)
    centre = submanifold_centre(km)                               # -1 when none
    plan = fetch_plan(km.table, km.host_counts(), skip=centre)   # once per map
    init = features @ weight[centre] if centre >= 0 else None     # a dense GEMM
    out = fetch_on_demand_cuda(features, weight, plan, km.table.shape[1], init)

The ladder, one idea a rung (reading order; the library runs the last):

    v1  one thread per (pair, output channel): a dot product over C_in read
          from global memory, one atomic add (the definition)
    v2  + shared-memory tiles of the fetched rows and of W[k], a register
          micro-tile of RP pairs x RN channels per thread (the library's)

The layout of this module: argument checks, the reference
(:func:`fetch_on_demand_reference`), the plan (:class:`FetchPlan`,
:func:`fetch_plan`), the ladder (:func:`fetch_on_demand_v1`, :func:`fetch_on_demand_v2` with
its tiles :func:`v2_tiles`) and the launchers (:func:`fetch_on_demand_cuda`;
:func:`fetch_on_demand_rung` runs any rung).
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from functools import cache  # (lru_cache without a bound)

import numpy as np
from numba import cuda, float32, int32

from ..core.device import device_xp, simulating
from ..core.backend import filled, to_device, to_host
from ..core.launch import launch
from ..core.rungs import Ladder, Rung
from ..core import conventions as cv

# Pairs per block of the plan: what one thread block of v2 covers (one kernel
# tile of TILE_P pairs on the GPU). Under the simulator every CUDA thread is a
# Python thread, so the simulated tiles are small; a plan block then holds two
# kernel tiles, which exercises v2's loop over the tiles of its block.
PLAN_TILE_P = 64
SIMULATOR_PLAN_TILE_P = 16


def default_tile_p() -> int:
    """Pairs per plan block on this machine: 64 on the GPU, 16 simulated."""
    return SIMULATOR_PLAN_TILE_P if simulating() else PLAN_TILE_P


# ------------------------------------------------------------------ the plan
@dataclass
class FetchPlan:
    """The pair list of a kernel map, grouped by offset, and its block table.

    Arrays, all int32: device arrays from :func:`fetch_plan` (CuPy on a GPU,
    NumPy under the simulator), NumPy from :func:`fetch_plan_reference` (the
    launchers copy them to the device):

    ``in_rows``, ``out_rows`` (n_pairs,)
        input row and output row of each pair; offset k's pairs are
        ``starts[k]:starts[k + 1]``, in increasing output order.
    ``block_offset``, ``block_start``, ``block_stop`` (n_blocks,)
        thread block b serves offset ``block_offset[b]``, pairs
        ``block_start[b]:block_stop[b]`` (at most ``tile_p`` of them).

    Host facts: ``starts`` int64 (K + 1,), ``n_out``, ``tile_p`` and ``skip``
    (the offset left out, or -1).
    """

    in_rows: object
    out_rows: object
    block_offset: object
    block_start: object
    block_stop: object
    starts: np.ndarray
    n_out: int
    tile_p: int
    skip: int

    @property
    def K(self) -> int:
        return len(self.starts) - 1

    @property
    def n_pairs(self) -> int:
        return int(self.starts[-1])

    @property
    def n_blocks(self) -> int:
        return int(self.block_offset.shape[0])


def _check_table(table, counts_host, skip, tile_p):
    """Cheap checks of a plan's inputs; returns (counts int64 host, skip, tile_p)."""
    K = _check_table_layout(table, skip)
    counts = np.asarray(to_host(counts_host)).reshape(-1) if counts_host is not None else None
    if counts is None or counts.shape[0] != K:
        got = None if counts is None else counts.shape[0]
        raise ValueError(f"counts_host must hold one pair count per offset ({K}, the table's rows), got "
                         f"{got}; pass KernelMap.host_counts()")
    tile_p = default_tile_p() if tile_p is None else tile_p
    if not isinstance(tile_p, (int, np.integer)) or isinstance(tile_p, bool) or tile_p < 1:
        raise ValueError(f"tile_p must be a positive int (pairs per thread block), got {tile_p!r}")
    return counts.astype(np.int64), int(skip), int(tile_p)


def _check_table_layout(table, skip):
    """The table is int32 (K, n_out) and ``skip`` one of its offsets or -1; returns K."""
    if not hasattr(table, "shape") or not hasattr(table, "dtype"):
        raise TypeError(f"table must be a NumPy or CuPy array, got {type(table).__name__}")
    if table.ndim != 2:
        raise ValueError(f"table must have shape (K, n_out), one row per offset (KernelMap.table), "
                         f"got {tuple(table.shape)}")
    if table.dtype != np.int32:
        raise TypeError(f"table must be int32 (KernelMap.table), got {table.dtype}; "
                        "convert it with table.astype(np.int32)")
    K = table.shape[0]
    if not isinstance(skip, (int, np.integer)) or isinstance(skip, bool) or not -1 <= skip < K:
        raise ValueError(f"skip must be -1 (none) or an offset index in 0..{K - 1}, got {skip!r}")
    return K


def block_table(counts, skip, tile_p):
    """Host: the pair list's offset starts and the block table, from the counts alone.

    Returns ``starts`` int64 (K + 1,) and ``block_offset``, ``block_start``,
    ``block_stop`` int32 (n_blocks,): offset k gets ``ceil(counts[k] / tile_p)``
    blocks (none for ``skip`` and for offsets without pairs), the last one
    short when ``tile_p`` does not divide its count.
    """
    c = np.asarray(counts, dtype=np.int64).copy()
    if skip >= 0:
        c[skip] = 0  # the skipped offset takes no room in the list
    starts = np.zeros(len(c) + 1, dtype=np.int64)
    np.cumsum(c, out=starts[1:])
    if starts[-1] >= 2**31:
        raise ValueError(f"{starts[-1]} pairs do not fit int32 pair indices; split the cloud")
    per_offset = -(-c // tile_p)
    block_offset = np.repeat(np.arange(len(c), dtype=np.int64), per_offset)
    first_block = np.repeat(np.cumsum(per_offset) - per_offset, per_offset)
    within = np.arange(len(block_offset), dtype=np.int64) - first_block  # block's rank in its offset
    block_start = starts[block_offset] + within * tile_p
    block_stop = np.minimum(block_start + tile_p, starts[block_offset + 1])
    return starts, block_offset.astype(np.int32), block_start.astype(np.int32), block_stop.astype(np.int32)


def fetch_plan_reference(table, counts_host, skip=-1, tile_p=None) -> FetchPlan:
    """NumPy: the pairs by ``np.nonzero`` of ``table >= 0`` (row-major order lists
    them offset by offset, outputs ascending), the skipped offset's row left out.

    Also checks ``counts_host`` against the table (the device version trusts it).
    """
    counts, skip, tile_p = _check_table(table, counts_host, skip, tile_p)
    table = np.asarray(to_host(table))
    found = (table >= 0).sum(axis=1)
    if not np.array_equal(found, counts):
        bad = int(np.flatnonzero(found != counts)[0])
        raise ValueError(f"counts_host[{bad}] = {counts[bad]} but the table has {found[bad]} pairs "
                         "through that offset; pass the map's own counts (KernelMap.host_counts())")
    valid = table >= 0
    if skip >= 0:
        valid[skip] = False
    kk, ii = np.nonzero(valid)
    starts, b_off, b_start, b_stop = block_table(counts, skip, tile_p)
    return FetchPlan(table[kk, ii].astype(np.int32), ii.astype(np.int32), b_off, b_start, b_stop,
                     starts, table.shape[1], tile_p, skip)


@cuda.jit
def plan_kernel(table, rank, starts, in_rows, out_rows):
    """One thread per output i, walking the K offsets: the pair (k, i) goes to
    position ``starts[k] + rank[k, i] - 1`` of the list, where ``rank[k, i]``
    counts the pairs of offset k among outputs 0..i (a library scan along the
    table's rows). Neighbouring threads read neighbouring entries of each table
    row and write neighbouring entries of the list.

    Nothing is written for the skipped offset (its range ``starts[k]:starts[k+1]``
    is empty) nor past the end of an offset's range (counts smaller than the
    table's: such pairs are lost, never written out of bounds)."""
    i = cuda.grid(1)
    if i < table.shape[1]:
        for k in range(table.shape[0]):
            row = table[k, i]
            if row >= 0:
                pos = starts[k] + rank[k, i] - 1
                if pos < starts[k + 1]:
                    in_rows[pos] = row
                    out_rows[pos] = i


def fetch_plan(table, counts_host, skip=-1, tile_p=None) -> FetchPlan:
    """Device version of :func:`fetch_plan_reference`: the pair list from one
    library scan of ``table >= 0`` along each row and one launch of
    :func:`plan_kernel`; the block table on the host from ``counts_host``
    (:func:`block_table`).

    No device-to-host read (``counts_host`` says how long the list is, where
    ``xp.nonzero`` would read its length back). The counts are trusted, not
    checked against the table: pass the map's own (``KernelMap.host_counts()``).
    List entries the table does not fill (counts larger than the table's) stay
    -1, and the kernels skip them.
    """
    counts, skip, tile_p = _check_table(table, counts_host, skip, tile_p)
    xp = device_xp()
    t = to_device(table)
    starts, b_off, b_start, b_stop = block_table(counts, skip, tile_p)
    n = int(starts[-1])
    in_rows, out_rows = filled((n,), np.int32, -1), filled((n,), np.int32, -1)
    if n:
        rank = xp.cumsum(t >= 0, axis=1, dtype=np.int32)
        launch(plan_kernel, t.shape[1], t, rank, to_device(starts), in_rows, out_rows)
    return FetchPlan(in_rows, out_rows, to_device(b_off), to_device(b_start), to_device(b_stop), starts,
                     t.shape[1], tile_p, skip)


# ------------------------------------------------------------------ checks
# ------------------------------------------------------------------ reference
def fetch_on_demand_reference(features, weight, table, init=None, skip=-1):
    """NumPy: per offset, one matrix product of its pairs' rows, added into the
    outputs with ``np.add.at`` (which handles an output hit twice); sums in
    float32 (float64 for float64), rounded once to the features' dtype. Returns (n_out, C_out)."""
    _check_table_layout(table, skip)
    table = np.asarray(to_host(table))
    features, weight = np.asarray(to_host(features)), np.asarray(to_host(weight))
    cv.check_features(features)
    cv.check_weight(weight, table.shape[0], features.shape[1], features.dtype, ": one (C_in, C_out) matrix per offset of the map")
    n_out, c_out = table.shape[1], weight.shape[2]
    cv.check_init(init, n_out, c_out)
    ct = cv.compute_dtype(features.dtype)
    acc = np.zeros((n_out, c_out), ct) if init is None else np.array(to_host(init), ct)
    fc = features.astype(ct)
    for k in range(table.shape[0]):
        if k == skip:
            continue
        ii = np.flatnonzero(table[k] >= 0)
        if len(ii):
            np.add.at(acc, ii, fc[table[k, ii]] @ weight[k].astype(ct))
    return acc.astype(features.dtype)


# ------------------------------------------------------------------- the ladder
@cuda.jit
def fetch_on_demand_v1(features, weight, in_rows, out_rows, block_offset, block_start, block_stop, tile_p, out):
    """v1, the definition: one thread per (pair, output channel).

    Thread t takes slot ``j`` of plan block ``b`` and channel ``n``; the block
    table gives the pair (``block_start[b] + j``, if below ``block_stop[b]``) and
    its offset k. The thread reads the pair's input row and column n of
    ``W[k]`` from global memory, one element of each per step of a dot product
    over C_in, and adds the result into ``out[output row, n]`` with one atomic
    add. Neighbouring threads take neighbouring channels of one pair: they read
    the same input element (a broadcast), neighbouring weights, and add into
    neighbouring outputs.

    Every element of W[k] is read once per pair and every input element once per
    output channel (from the caches, but each read an instruction): C_in * C_out
    loads of each kind per pair for 2 C_in C_out flops. v2 loads each once per tile.
    """
    t = cuda.grid(1)
    c_out = out.shape[1]
    per_block = tile_p * c_out
    if t < block_offset.shape[0] * per_block:
        b = t // per_block
        r = t - b * per_block
        j = r // c_out
        n = r - j * c_out
        pair = block_start[b] + j
        if pair < block_stop[b]:
            row = in_rows[pair]
            if row >= 0:  # (-1: a list entry the table did not fill)
                k = block_offset[b]
                acc = float32(0.0)
                for c in range(features.shape[1]):
                    acc += float32(features[row, c]) * float32(weight[k, c, n])
                cuda.atomic.add(out, (out_rows[pair], n), acc)


FetchTiles = namedtuple("FetchTiles", "p n k rp rn")
FetchTiles.__doc__ = """v2's compile-time tile sizes: a block computes ``p`` pairs x ``n``
output channels, walking C_in ``k`` channels at a time; each thread owns ``rp``
pairs x ``rn`` channels of the block's tile (``(p / rp) * (n / rn)`` threads)."""


def v2_tiles(c_in: int, c_out: int, simulated=None) -> FetchTiles:
    """The tiles v2 runs with for these channel counts (``simulated=None``: this
    machine's choice; True / False force the simulator's or the GPU's tiles).

    On the GPU a block always covers 64 pairs (the plan's block), and 128 or
    256 threads; the channel tile grows with C_out so that a small C_out does
    not leave most of the block idle, and the micro-tile with it, so that the
    FMAs per shared-memory load grow where there are enough channels::

        C_out <= 8:    64 x 8,   4 x 1 a thread, 128 threads
        C_out <= 16:   64 x 16,  4 x 2 a thread, 128 threads
        C_out <= 32:   64 x 32,  4 x 2 a thread, 256 threads
        C_out <= 64:   64 x 64,  4 x 4 a thread, 256 threads
        larger:        64 x 128, 4 x 8 a thread, 256 threads (C_out > 128: several)

    The depth ``k`` is the smallest of 4, 8, 16, 32 that covers C_in (32 for
    more): a depth larger than C_in would multiply zeros. Simulated: 8 x 8 tiles
    of 4 x 2 a thread (8 Python threads a block) and a depth of at most 8, so
    that small test channel counts still take several steps of every loop. (The
    simulator starts a Python thread for every CUDA thread and makes them all
    meet at every barrier, so fewer threads with more work each keep the tests
    fast.)
    """
    simulated = simulating() if simulated is None else simulated
    depth = next((d for d in (4, 8, 16) if c_in <= d), 32)
    if simulated:
        return FetchTiles(8, 8, min(depth, 8), 4, 2)
    if c_out <= 8:
        return FetchTiles(64, 8, depth, 4, 1)
    if c_out <= 16:
        return FetchTiles(64, 16, depth, 4, 2)
    if c_out <= 32:
        return FetchTiles(64, 32, depth, 4, 2)
    if c_out <= 64:
        return FetchTiles(64, 64, depth, 4, 4)
    return FetchTiles(64, 128, depth, 4, 8)


@cache
def fetch_on_demand_v2(tiles: FetchTiles):
    """v2, the library's: v1's arithmetic done by tiles in shared memory, with a
    register micro-tile per thread. Compiled once per :class:`FetchTiles` (the shared
    arrays and the register arrays need their sizes at compile time).

    Grid: one block per (plan block, tile of ``tiles.n`` output channels),
    neighbouring blocks on the same pairs, so the second fetch of a row is an
    L2 hit. A block walks its plan block's pairs ``tiles.p`` at a time, and for
    each such tile of pairs walks C_in ``tiles.k`` channels at a time:

    1. the threads fetch the tile's input rows (``p x k`` elements: neighbouring
       threads read neighbouring channels of a row) and the tile of ``W[k]``
       (``k x n``) into shared memory, widened to fp32; zeros where a pair,
       an input channel or an output channel is past the end, so C_in and C_out
       need not be multiples of a tile (C_in = 3, C_out = 1 work);
    2. after a barrier, each thread multiplies: per step of the depth it loads
       ``rp`` values of the rows and ``rn`` of the weights from shared memory
       into registers and does ``rp * rn`` FMAs into its micro-tile. Thread
       (ty, tx) owns pairs ``ty + r * (p / rp)`` and channels ``tx + s * (n / rn)``:
       the threads of a warp read one weight row in neighbouring words (no bank
       conflicts) and share row values (broadcasts); the rows' tile has one
       word of padding per row so that two pairs read in one warp fall in
       different banks;
    3. after the depth, each thread adds its micro-tile into the outputs with
       ``rp * rn`` atomic adds, neighbouring threads into neighbouring channels
       of one output row.

    Against v1: each element of the fetched rows is loaded from global memory
    once per block instead of once per output channel, each weight once per
    block instead of once per pair, and shared-memory loads fall from 2 per
    FMA to ``(rp + rn) / (rp * rn)`` per FMA (1/2 for 4 x 4).
    """
    TP, TN, TK, RP, RN = tiles
    TY, TX = TP // RP, TN // RN  # threads along the pairs, along the channels
    THREADS = TY * TX
    PAD = TK + 1  # one word of padding per row of the rows' tile (see above)

    @cuda.jit
    def fetch_v2(features, weight, in_rows, out_rows, block_offset, block_start, block_stop, out):
        rows = cuda.shared.array((TP, PAD), float32)  # the fetched input rows, fp32
        w = cuda.shared.array((TK, TN), float32)  # the tile of W[k], fp32
        src = cuda.shared.array(TP, int32)  # the tile's input rows (-1: no pair)
        dst = cuda.shared.array(TP, int32)  # the tile's output rows
        acc = cuda.local.array((RP, RN), float32)  # this thread's micro-tile
        dst_rows = cuda.local.array(RP, int32)  # the output rows of its pairs
        a = cuda.local.array(RP, float32)
        bw = cuda.local.array(RN, float32)

        c_in = features.shape[1]
        c_out = out.shape[1]
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid - ty * TX
        n_tiles = (c_out + TN - 1) // TN
        b = cuda.blockIdx.x // n_tiles
        n0 = (cuda.blockIdx.x - b * n_tiles) * TN
        k = block_offset[b]
        stop = block_stop[b]
        for p0 in range(block_start[b], stop, TP):  # every thread of the block: same trips
            for j in range(tid, TP, THREADS):
                src[j] = -1
                dst[j] = -1
                if p0 + j < stop:
                    src[j] = in_rows[p0 + j]
                    dst[j] = out_rows[p0 + j]
            cuda.syncthreads()
            for r in range(RP):
                dst_rows[r] = dst[ty + r * TY]  # (read now: no barrier needed after the adds)
                for s in range(RN):
                    acc[r, s] = float32(0.0)

            for c0 in range(0, c_in, TK):
                for e in range(tid, TP * TK, THREADS):  # fetch: rows' tile
                    j = e // TK
                    c = e - j * TK
                    v = float32(0.0)
                    row = src[j]
                    if row >= 0 and c0 + c < c_in:
                        v = float32(features[row, c0 + c])
                    rows[j, c] = v
                for e in range(tid, TK * TN, THREADS):  # W[k]'s tile
                    c = e // TN
                    n = e - c * TN
                    v = float32(0.0)
                    if c0 + c < c_in and n0 + n < c_out:
                        v = float32(weight[k, c0 + c, n0 + n])
                    w[c, n] = v
                cuda.syncthreads()
                for kk in range(TK):  # multiply: rp x rn FMAs per rp + rn loads
                    for r in range(RP):
                        a[r] = rows[ty + r * TY, kk]
                    for s in range(RN):
                        bw[s] = w[kk, tx + s * TX]
                    for r in range(RP):
                        for s in range(RN):
                            acc[r, s] += a[r] * bw[s]
                cuda.syncthreads()  # before the next depth step overwrites the tiles

            for r in range(RP):  # scatter: atomic adds into the output rows
                if dst_rows[r] >= 0:
                    for s in range(RN):
                        n = n0 + tx + s * TX
                        if n < c_out:
                            cuda.atomic.add(out, (dst_rows[r], n), acc[r, s])
            # No barrier here: the next tile's writes to src and dst come after every
            # thread has passed the last barrier of the depth loop, after which no
            # thread reads them (C_in >= 1: the launcher runs nothing for C_in = 0).

    return fetch_v2


# ------------------------------------------------------------------ launchers
def _accumulator(init, n_out, c_out):
    """The float32 device array the atomics add into: a copy of ``init`` (never the
    caller's array itself) or zeros."""
    xp = device_xp()
    if init is None:
        return xp.zeros((n_out, c_out), dtype=np.float32)
    return xp.array(to_device(init), dtype=np.float32, copy=True)


def fetch_on_demand_rung(rung: str, features, weight, plan: FetchPlan, n_out: int, init=None,
                         tiles: FetchTiles = None):
    """Run one rung of the ladder (``"v1"``, ``"v2"``) on a plan; returns the
    (n_out, C_out) output as a device array of the features' dtype.

    ``tiles``: v2's tile sizes (default :func:`v2_tiles` for these channels);
    e.g. ``v2_tiles(c_in, c_out, simulated=False)`` runs the GPU's tiles under the
    simulator. The plan may come from :func:`fetch_plan` or :func:`fetch_plan_reference`;
    its ``tile_p`` should be a multiple of ``tiles.p`` (the default 64 is, on the
    GPU), else the last kernel tile of every plan block leaves threads idle.
    """
    if rung not in LADDER.names:
        raise ValueError(f"rung must be one of {LADDER.names}, got {rung!r}")
    if not isinstance(plan, FetchPlan):
        raise TypeError(f"plan must be a FetchPlan (from fetch_plan), got {type(plan).__name__}")
    cv.check_features(features, backend="cuda")
    cv.check_weight(weight, plan.K, features.shape[1], features.dtype, ": one (C_in, C_out) matrix per offset of the map")
    if int(n_out) != plan.n_out:
        raise ValueError(f"n_out = {n_out} but the plan's table has {plan.n_out} outputs (columns)")
    c_in, c_out = features.shape[1], weight.shape[2]
    cv.check_init(init, plan.n_out, c_out)
    f, wt = to_device(features), to_device(weight)
    out = _accumulator(init, plan.n_out, c_out)
    if plan.n_pairs and c_in and c_out and plan.n_out:
        arrays = tuple(to_device(a) for a in (plan.in_rows, plan.out_rows, plan.block_offset,
                                              plan.block_start, plan.block_stop))
        if rung == "v1":
            launch(fetch_on_demand_v1, plan.n_blocks * plan.tile_p * c_out, f, wt, *arrays, plan.tile_p, out)
        else:
            tiles = tiles or v2_tiles(c_in, c_out)
            threads = (tiles.p // tiles.rp) * (tiles.n // tiles.rn)
            blocks = plan.n_blocks * -(-c_out // tiles.n)  # (plan block, channel tile) pairs
            launch(fetch_on_demand_v2(tiles), 1, f, wt, *arrays, out, threads=threads, blocks=blocks)
    # float16: the one extra pass from the float32 sums (see the module docstring)
    return out if f.dtype == np.float32 else out.astype(f.dtype)


def fetch_on_demand_cuda(features, weight, plan: FetchPlan, n_out: int, init=None):
    """The library's fetch-on-demand convolution: one launch of v2 for all offsets
    (plus the float16 cast). ``features`` (n_in, C_in) and ``weight`` (K, C_in,
    C_out), float32 or float16 alike; ``init`` (n_out, C_out) or None, not
    modified. Returns a device array (n_out, C_out) of the features' dtype: CuPy
    on a GPU, NumPy under the simulator. Sums run in fp32 through atomics, so
    the last bits may differ from run to run (module docstring)."""
    return fetch_on_demand_rung("v2", features, weight, plan, n_out, init)


__all__ = ["FetchPlan", "FetchTiles", "LADDER", "block_table", "default_tile_p", "fetch_on_demand_cuda",
           "fetch_on_demand_reference", "fetch_on_demand_rung", "fetch_on_demand_v1", "fetch_on_demand_v2",
           "fetch_plan", "fetch_plan_reference", "plan_kernel", "v2_tiles"]


# -------------------------------------------------------------------- the ladder
# A whole 3x3x3 submanifold layer outside the centre, added onto ``init`` (the
# centre product): float sums in another order than the reference's, so a tolerance.
def _ladder_work(ctx):
    layer = ctx.layer()
    km = layer["km"]
    plan = ctx.memo("fetch_plan", lambda: fetch_plan(km.table, km.host_counts(), skip=layer["centre"]))
    return dict(layer, fetch_plan=plan)


def _rung(name, adds):
    return Rung(name, lambda w: fetch_on_demand_rung(name, w["features"], w["weight"], w["fetch_plan"],
                                                     w["features"].shape[0], w["init"]), adds)


LADDER = Ladder(
    "fetch_on_demand",
    (_rung("v1", "one thread per (pair, output channel): global reads, one atomic add each"),
     _rung("v2", "+ the fetched rows and W[k] in shared memory, a register tile per thread (the library's)")),
    workload=_ladder_work,
    reference=lambda w: fetch_on_demand_reference(to_host(w["features"]), to_host(w["weight"]),
                                                  to_host(w["km"].table), to_host(w["init"]), w["centre"]),
    tolerance={"float32": 1e-5, "float16": 2e-3},
)
