"""Fetch-on-demand: gather, matrix product and scatter fused into one kernel.

Minuet's GMaS step moves every pair's data through two global buffers (gather,
grouped GEMMs, scatter). The *fetch-on-demand* dataflow (MinkowskiEngine's, made a
single launch by PCEngine's segmented fusion, one of TorchSparse++'s dataflows)
keeps none: a thread block takes a tile of pairs of *one* offset ``k``, reads their
input rows straight into shared memory (the "fetch") next to a tile of ``W[k]``,
multiplies on chip, and adds each product row into its output row with atomics
(up to K - 1 other pairs, in other blocks, add into the same row)::

    out[i] = init[i] + sum over k != skip with table[k, i] >= 0 of features[table[k, i]] @ W[k]

``skip`` is the offset the caller did as one dense product (the submanifold
centre, ``init = features @ W[centre]``), or -1.

**The pair list.** All offsets run in one launch: the pairs listed offset by
offset, and a block table built on the host from the per-offset counts telling
each block its offset and its pairs (:class:`~numba_sc.dataflows.fetch_shapes.FetchPlan`,
:func:`fetch_plan_reference`; built on the device by
:func:`numba_sc.dataflows.fetch_driver.fetch_plan`). It depends on the map alone, so
layers that share a map share it.

Worked example: three points at x = 0, 1, 3, offsets -1, 0, +1, one channel::

    table = [[-1,  0, -1],     counts = [1, 3, 1], skip = 1 (the centre)
             [ 0,  1,  2],
             [ 1, -1, -1]]
    pairs: offset 0, input 0 -> output 1; offset 2, input 1 -> output 0
    in_rows = [0, 1], out_rows = [1, 0]; block 0 -> offset 0, block 1 -> offset 2

With ``f = [1, 2, 3]``, ``W = [10, 100, 1000]``, ``init = f * 100``: block 0 adds
``1 * 10`` to output 1, block 1 adds ``2 * 1000`` to output 0:
``out = [2100, 210, 300]``.

**Napkin math**, ``n`` pairs outside the centre, fp32: no ``8 n (C_in + C_out)``
bytes of buffers, the same ``2 n C_in C_out`` flops, but ``n C_out`` atomic adds
(read-modify-writes in L2) where the scatter writes each output once, and a tile
of ``W[k]`` read per block. SemanticKITTI at 0.05 m, 64 channels: 195 MB of
buffers (~65 us at ~3 TB/s, typed: napkin math) against 12.2M atomics into a 24 MB
output. Measured, the atomics dominate: ``dataflow="auto"`` never picks it
(``docs/performance.md``, "dataflows/fetch_on_demand.py"). Numba has no mma
intrinsics: the products run on the CUDA cores in fp32 whatever the dtype.

**fp16 and determinism.** Sums are fp32 atomics (Numba's ``cuda.atomic.add`` takes
no float16): fp16 outputs are summed in a float32 array and cast once at the end.
The order of the atomics is the hardware's, so the last bits differ run to run;
tests compare with a tolerance.

The ladder, one idea a rung (``python -m numba_sc ladder fetch_on_demand``):

    v1  one thread per (pair, output channel): a dot product over C_in read
          from global memory, one atomic add (the definition)
    v2  + shared-memory tiles of the fetched rows and of W[k], a register
          micro-tile of RP pairs x RN channels per thread (the library's)
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ..core import conventions as cv
from ..core.backend import to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung, layer_bytes_moved, layer_flops
from ..core.state import cached
from .fetch_shapes import FetchPlan, FetchTiles, accumulator, block_table, check_table, check_table_layout, v2_tiles


# ------------------------------------------------------------------ reference
def fetch_on_demand_reference(features, weight, table, init=None, skip=-1):
    """NumPy: per offset, one matrix product of its pairs' rows, added into the
    outputs with ``np.add.at`` (which handles an output hit twice); sums in
    float32 (float64 for float64), rounded once to the features' dtype. Returns (n_out, C_out)."""
    check_table_layout(table, skip)
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


def fetch_plan_reference(table, counts_host, skip=-1, tile_p=None) -> FetchPlan:
    """NumPy: the pairs by ``np.nonzero`` of ``table >= 0`` (row-major order lists
    them offset by offset, outputs ascending), the skipped offset's row left out.

    Also checks ``counts_host`` against the table (the device version trusts it).
    """
    counts, skip, tile_p = check_table(table, counts_host, skip, tile_p)
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


@cached
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


# ------------------------------------------------------------ running each rung
# A whole 3x3x3 submanifold layer outside the centre, added onto ``init`` (the
# centre product): float sums in another order than the reference's, so a tolerance.
# v1 is launched the way Numba teaches; v2, the library's, through numba_sc.core.launch.
def _plan_arrays(plan):
    return tuple(to_device(a) for a in (plan.in_rows, plan.out_rows, plan.block_offset, plan.block_start,
                                        plan.block_stop))


def run_v1(f, wt, plan: FetchPlan, init=None, tiles=None):
    """v1 on device arrays (checked by the caller); ``tiles`` is v2's and ignored.
    Returns the (n_out, C_out) output of the features' dtype."""
    c_in, c_out = f.shape[1], wt.shape[2]
    out = accumulator(init, plan.n_out, c_out)
    if plan.n_pairs and c_in and c_out and plan.n_out:
        n = plan.n_blocks * plan.tile_p * c_out
        fetch_on_demand_v1[blocks_for(n, THREADS), THREADS](f, wt, *_plan_arrays(plan), plan.tile_p, out)
    # float16: the one extra pass from the float32 sums (see the module docstring)
    return out if f.dtype == np.float32 else out.astype(f.dtype)


def run_v2(f, wt, plan: FetchPlan, init=None, tiles: FetchTiles = None):
    """v2 on device arrays (checked by the caller), with ``tiles`` (default :func:`v2_tiles`)."""
    c_in, c_out = f.shape[1], wt.shape[2]
    out = accumulator(init, plan.n_out, c_out)
    if plan.n_pairs and c_in and c_out and plan.n_out:
        tiles = tiles or v2_tiles(c_in, c_out)
        threads = (tiles.p // tiles.rp) * (tiles.n // tiles.rn)
        blocks = plan.n_blocks * -(-c_out // tiles.n)  # (plan block, channel tile) pairs
        launch(fetch_on_demand_v2(tiles), 1, f, wt, *_plan_arrays(plan), out, threads=threads, blocks=blocks)
    return out if f.dtype == np.float32 else out.astype(f.dtype)


RUNS = {"v1": run_v1, "v2": run_v2}


def _ladder_work(ctx):
    layer = ctx.layer()
    km = layer["km"]
    plan = ctx.memo("fetch_plan", lambda: fetch_plan_reference(km.table, km.host_counts(), skip=layer["centre"]).device())
    return dict(layer, fetch_plan=plan)


def _rung(name, adds):
    return Rung(name, lambda w: RUNS[name](to_device(w["features"]), to_device(w["weight"]), w["fetch_plan"], w["init"]),
                adds)


LADDER = Ladder(
    "fetch_on_demand",
    (_rung("v1", "one thread per (pair, output channel): global reads, one atomic add each"),
     _rung("v2", "+ the fetched rows and W[k] in shared memory, a register tile per thread (the library's)")),
    workload=_ladder_work,
    reference=lambda w: fetch_on_demand_reference(to_host(w["features"]), to_host(w["weight"]),
                                                  to_host(w["km"].table), to_host(w["init"]), w["centre"]),
    tolerance={"float32": 1e-5, "float16": 2e-3},
    bytes_moved=layer_bytes_moved,
    flops=layer_flops,
)
