"""Implicit GEMM: the output-major dataflow, with sorted bitmasks and mask splits.

Gather-GEMM-scatter (:mod:`numba_sc.gmas`) moves every pair's rows through two
buffers, ``8 n (C_in + C_out)`` bytes for ``n`` pairs in fp32 that exist only to
be thrown away. The implicit GEMM (spconv 2's MaskImplicitGemm, one of
TorchSparse++'s dataflows) has none: the layer is one dense GEMM of an
``n_out x (K C_in)`` matrix ``A`` (row ``i``: output ``i``'s K neighbour rows,
zeros where there is none) by the stacked weights, and ``A`` is never stored::

    out[i] = init[i] + sum over k != skip with table[k, i] >= 0 of features[table[k, i]] @ W[k]

A block owns ``TILE_M`` outputs x ``TILE_N`` channels; per offset it fetches the
tile's neighbour rows straight into shared memory, ``TILE_K`` input channels at
a time, next to the matching piece of ``W[k]``, multiplies into registers, and
writes each output once: no scatter, no atomics.

**Sorted bitmasks.** A block multiplies all its rows for an offset as soon as one
of them has a pair through it. Each output's *bitmask* says which offsets it has
(bit ``k % 32`` of word ``k // 32``, :mod:`numba_sc.core.conventions`); sorting the
outputs by mask puts equal masks in one tile, whose OR (the *tile mask*) lets
the whole block skip every absent offset. The sort moves the order of work, not
the data: row slot ``j`` computes output ``order[j]``.

Worked example, ``K = 3`` offsets, 4 outputs, ``TILE_M = 2``::

    table = [[ 5, -1,  7, -1],      masks: out0 0b101   out1 0b010
             [-1,  2, -1,  3],             out2 0b101   out3 0b010
             [ 0, -1,  4, -1]]      6 pairs

    natural order [0, 1, 2, 3]: both tiles have mask 0b111: 12 row products for 6 pairs
    sorted order  [1, 3, 0, 2]: tile masks 0b010 and 0b101: 2 + 4 = 6, none wasted

**Mask splits** (TorchSparse++, Figure 10): cut the offsets into ``s`` ranges, each
with its own masks, order, tile masks and launch. Shorter masks sort better; each
later split adds onto the output (in fp16 through a float32 scratch array, so the
result is rounded once). The per-map work is an :class:`ImplicitPlan`, shared by
every layer of a map (its device builder: :mod:`numba_sc.dataflows.implicit_driver`).

Napkin math, fp32, ``n`` pairs, ``r >= 1`` row products per pair (:func:`plan_work`):
the rows are read once per column tile where a pair exists (``4 n C_in``), the
output written once; ``2 r n C_in C_out`` flops on the CUDA cores (Numba has no
mma intrinsics: v1-v3 widen fp16 to fp32), against cuBLAS on the tensor cores for
gather-GEMM-scatter in fp16, hence v4, whose tile product is CUDA C++ linked in
(:mod:`numba_sc.dataflows.tensor_cores`). SemanticKITTI at 0.05 m, 64 channels:
195 MB of gmas buffers, ~58 us at 3.35 TB/s (typed: napkin math), and 1.56 GFLOP,
~26 us at 60 TFLOP/s FP32 (typed: napkin math). Measured figures: ``docs/performance.md``,
"dataflows/implicit_gemm.py".

The ladder, one idea a rung (``python -m numba_sc ladder implicit_gemm``, recorded in
``benchmarks/results/ladder_implicit_gemm.json``):

    v1  one thread per (output, output channel): every offset, every input
          channel, straight from global memory; the definition, no masks
    v2  + shared-memory tiles of the gathered rows and of ``W[k]``, reused by
          the block (slower than v1 on a sparse map: no masks, so every tile
          multiplies all K offsets, most of them zeros)
    v3  + the sorted bitmask order and tile-mask skips, and a register tile read
          with vector loads (the library's in fp32; on the dense cloud it beats
          gather-GEMM-scatter at 32 and 64 channels, ``alternatives.json``)
    v4  + the tile's multiply-accumulate on the tensor cores (``mma.m16n8k16`` in
          ``mma.cu``; under the simulator a Python stand-in computes each lane's
          share, :func:`numba_sc.dataflows.tensor_cores.emulated_warp_mma`); fp16
          only, the library's in fp16 from ``TENSOR_CORE_MIN_CHANNELS`` channels
          (``implicit_v4_channels.json``)
    v5  + the shared tiles double-buffered (one barrier a step), the next step's
          loads in flight across offsets too, blocks up to 128 channels wide;
          fp16 only. Checked (the simulator runs it on the mma's stand-in) and
          timed: slower than v4 on an H100 at every width timed, so not the
          library's (``implicit_v5_kitti.json``, ``implicit_v5_dense.json``; the
          README's ladder section quotes them). The second stage and the
          run-ahead state cost registers, and v4 is already register-bound
          (``ncu_implicit_v4_v5.json``): a rung that shows a textbook
          optimization failing where occupancy, not latency, is the limit

The tile choices and argument checks are in :mod:`numba_sc.dataflows.implicit_shapes`;
the device plan and the library's launcher in :mod:`numba_sc.dataflows.implicit_driver`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, from_dtype, int32

from ..core import conventions as cv
from ..core.backend import to_device, to_host
from ..core.conventions import MASK_BITS, mask_words
from ..core.device import device_xp, simulating
from ..core.launch import THREADS, blocks_for
from ..core.rungs import Ladder, Rung, layer_bytes_moved, layer_flops
from ..core.state import cached
from .implicit_shapes import (GPU_V2_TILE, SIM_V2_TILE, WORDS, TensorTiles, Tiles, cdiv, check_inputs,
                              check_plan_args, check_rows, check_skip, implicit_tiles, run_splits, tensor_tiles,
                              v4_shape, v5_shape, v5_tiles)
from .tensor_cores import c_col, c_row, data_pointer, kernel_options, warp_mma


# ------------------------------------------------------------------ reference
def implicit_gemm_reference(features, weight, table, init=None, skip=-1):
    """NumPy: ``out = init + sum over k != skip of features[table[k]] @ W[k]`` on the
    rows with a pair, in float32 (fp16 inputs widened; float64 for float64), rounded once
    to the dtype."""
    K, n_out, _, c_out = check_inputs(features, weight, table, init, backend="reference")
    skip = check_skip(skip, K)
    features, weight, table = to_host(features), to_host(weight), to_host(table)
    check_rows(table, features.shape[0])
    ct = cv.compute_dtype(features.dtype)
    acc = np.zeros((n_out, c_out), dtype=ct)
    if init is not None:
        acc += to_host(init).astype(ct)
    for k in range(K):
        if k == skip:
            continue
        ii = np.flatnonzero(table[k] >= 0)
        acc[ii] += features[table[k, ii]].astype(ct) @ weight[k].astype(ct)
    return acc.astype(features.dtype)



# ------------------------------------------------------------------- the ladder
@cuda.jit
def implicit_gemm_v1(features, weight, table, skip, base, has_base, out):
    """v1, the definition: one thread per (output i, output channel n) walks every
    offset and every input channel, reading features, table and weights from global
    memory; a float32 sum, started from ``base[i, n]`` when ``has_base``, stored once.

    Every thread of a row reads the same neighbour rows again (C_out times), and
    every thread of a channel the same weight column: the reuse that v2's tiles
    exploit is all left to the caches.
    """
    t = cuda.grid(1)
    c_out = out.shape[1]
    if t < out.shape[0] * c_out:
        i = t // c_out
        n = t - i * c_out
        acc = float32(0.0)
        for k in range(table.shape[0]):
            if k != skip:
                row = table[k, i]
                if row >= 0:
                    for c in range(features.shape[1]):
                        acc += float32(features[row, c]) * float32(weight[k, c, n])
        if has_base:
            acc += float32(base[i, n])
        out[i, n] = acc  # (rounds to float16 for half-precision outputs)



@cached
def implicit_gemm_v2(tile_m: int, tile_n: int, tile_k: int):
    """v2: :func:`implicit_gemm_v1`'s sums, computed by tiles in shared memory.

    A block of ``tile_m x tile_n`` threads owns that tile of the output (outputs in
    their natural order, one value per thread). For every offset and every chunk of
    ``tile_k`` input channels, the block first loads the ``tile_m`` neighbour rows
    (zeros for ``-1`` or past the channels) and the ``tile_k x tile_n`` piece of
    ``W[k]`` into shared memory, every element once, with neighbouring threads on
    neighbouring channels; then each thread takes ``tile_k`` products from there.
    A global element now feeds ``tile_n`` (rows) or ``tile_m`` (weights) products
    instead of one. Every offset is visited by every tile: no masks yet.
    """
    threads = tile_m * tile_n
    a_size, b_size = tile_m * tile_k, tile_k * tile_n
    a_pitch = tile_k + 1  # a padded row: the threads of a column read different banks

    @cuda.jit
    def implicit_v2(features, weight, table, skip, base, has_base, out):
        tid = cuda.threadIdx.x
        n_out, c_out, c_in = out.shape[0], out.shape[1], features.shape[1]
        tiles_n = (c_out + tile_n - 1) // tile_n
        tm = cuda.blockIdx.x // tiles_n
        m0 = tm * tile_m
        n0 = (cuda.blockIdx.x - tm * tiles_n) * tile_n
        a_s = cuda.shared.array((tile_m, a_pitch), float32)
        b_s = cuda.shared.array((tile_k, tile_n), float32)
        my_m = tid // tile_n
        my_n = tid - my_m * tile_n
        acc = float32(0.0)
        for k in range(table.shape[0]):
            if k == skip:
                continue
            for c0 in range(0, c_in, tile_k):
                for e in range(tid, a_size, threads):
                    m = e // tile_k
                    kk = e - m * tile_k
                    v = float32(0.0)
                    if m0 + m < n_out and c0 + kk < c_in:
                        row = table[k, m0 + m]
                        if row >= 0:
                            v = float32(features[row, c0 + kk])
                    a_s[m, kk] = v
                for e in range(tid, b_size, threads):
                    kk = e // tile_n
                    n = e - kk * tile_n
                    v = float32(0.0)
                    if c0 + kk < c_in and n0 + n < c_out:
                        v = float32(weight[k, c0 + kk, n0 + n])
                    b_s[kk, n] = v
                cuda.syncthreads()
                for kk in range(tile_k):
                    acc += a_s[my_m, kk] * b_s[kk, my_n]
                cuda.syncthreads()
        i, n = m0 + my_m, n0 + my_n
        if i < n_out and n < c_out:
            if has_base:
                acc += float32(base[i, n])
            out[i, n] = acc

    return implicit_v2



# ------------------------------------------------ v3's plan: outputs sorted by mask
@dataclass
class ImplicitPlan:
    """The per-map preparation of the implicit GEMM: one sorted order and one set of
    tile masks per mask split. Arrays live on the side the table was on (NumPy for
    :func:`implicit_plan_reference`, the device side for :func:`implicit_plan`).
    """

    order: object  # int32 (splits, n_out): order[s, j] = the output row slot j computes in split s
    tile_masks: object  # int64 (splits, words, n_tiles): OR of the masks of a tile's rows, per split
    bounds: tuple  # ((k0, k1), ...): split s covers offsets k0 <= k < k1 (host ints)
    skip: int  # the offset left out (done by the caller as a dense GEMM), or -1
    tile_m: int  # outputs per tile: the kernel's TILE_M must be the same
    kernel_volume: int  # K, the table's rows
    n_out: int  # the table's columns

    @property
    def splits(self) -> int:
        return len(self.bounds)

    @property
    def words(self) -> int:
        return mask_words(self.kernel_volume)

    @property
    def n_tiles(self) -> int:
        return -(-self.n_out // self.tile_m)

    def host(self) -> ImplicitPlan:
        """The same plan with NumPy arrays."""
        return ImplicitPlan(to_host(self.order), to_host(self.tile_masks), self.bounds, self.skip,
                            self.tile_m, self.kernel_volume, self.n_out)

    def device(self) -> ImplicitPlan:
        """The same plan with device arrays."""
        return ImplicitPlan(to_device(self.order), to_device(self.tile_masks), self.bounds, self.skip,
                            self.tile_m, self.kernel_volume, self.n_out)


def split_bounds(K: int, splits: int) -> tuple:
    """Offsets ``0..K-1`` cut into ``splits`` contiguous ranges of near-equal size."""
    return tuple((s * K // splits, (s + 1) * K // splits) for s in range(splits))



def split_select(K: int, bounds) -> np.ndarray:
    """int64 (splits, words): the bits of each split's offsets."""
    sel = np.zeros((len(bounds), mask_words(K)), dtype=np.int64)
    for s, (k0, k1) in enumerate(bounds):
        for k in range(k0, k1):
            sel[s, k // MASK_BITS] |= np.int64(1) << (k % MASK_BITS)
    return sel



def split_words(k0: int, k1: int) -> range:
    """The mask words that hold offsets k0..k1-1, least significant first."""
    return range(k0 // MASK_BITS, (k1 - 1) // MASK_BITS + 1)



def output_masks_reference(table, skip=-1) -> np.ndarray:
    """NumPy: int64 (words, n_out); bit ``k % 32`` of word ``k // 32`` is set when
    output i has a pair through offset k (``k != skip``)."""
    table = to_host(table)
    K, n_out = table.shape
    masks = np.zeros((mask_words(K), n_out), dtype=np.int64)
    for k in range(K):
        if k != skip:
            masks[k // MASK_BITS] |= (table[k] >= 0).astype(np.int64) << (k % MASK_BITS)
    return masks


def implicit_plan_reference(table, splits=1, skip=-1, tile_m=None) -> ImplicitPlan:
    """NumPy version of :func:`implicit_plan` (host arrays): a lexicographic sort of
    each split's mask words, then an OR per tile."""
    K, splits, skip, tile_m = check_plan_args(table, splits, skip, tile_m)
    table = to_host(table)
    n_out = table.shape[1]
    masks = output_masks_reference(table, skip)
    bounds = split_bounds(K, splits)
    select = split_select(K, bounds)
    n_tiles = -(-n_out // tile_m)
    order = np.empty((splits, n_out), dtype=np.int32)
    tiles = np.zeros((splits, mask_words(K), n_tiles), dtype=np.int64)
    for s, (k0, k1) in enumerate(bounds):
        keys = masks & select[s][:, None]
        # np.lexsort sorts by its last key first: the most significant word
        order[s] = np.lexsort(keys[list(split_words(k0, k1))])
        padded = np.zeros((keys.shape[0], n_tiles * tile_m), dtype=np.int64)
        padded[:, :n_out] = keys[:, order[s]]
        tiles[s] = np.bitwise_or.reduce(padded.reshape(keys.shape[0], n_tiles, tile_m), axis=2)
    return ImplicitPlan(order, tiles, bounds, skip, tile_m, K, n_out)


def plan_work(plan: ImplicitPlan, table) -> dict:
    """Teaching numbers (host): ``pairs`` (outside the skipped offset), ``products``
    (row products the kernel computes: ``tile_m`` per set bit of a tile mask) and
    ``waste = products / pairs``, the ``r`` of the module's napkin math."""
    tiles = to_host(plan.tile_masks)
    table = to_host(table)
    bits = int(np.unpackbits(np.ascontiguousarray(tiles).view(np.uint8)).sum())  # set bits of all tile masks
    pairs = int((table >= 0).sum()) - (int((table[plan.skip] >= 0).sum()) if plan.skip >= 0 else 0)
    products = bits * plan.tile_m
    return {"pairs": pairs, "products": products, "waste": products / max(pairs, 1)}



def check_plan(plan, K, n_out):
    if not isinstance(plan, ImplicitPlan):
        raise TypeError(f"plan must be an ImplicitPlan (implicit_plan(table)), got {type(plan).__name__}")
    if (plan.kernel_volume, plan.n_out) != (K, n_out):
        raise ValueError(f"plan was made for a table of shape ({plan.kernel_volume}, {plan.n_out}), this "
                         f"table is ({K}, {n_out}): build it with implicit_plan(table) for this map")



@cached
def implicit_gemm_v3(tile_m: int, tile_n: int, tile_k: int, thread_m: int, thread_n: int,
                     prefetch: bool = True):
    """v3, the library's: v2's shared-memory tiles, plus

    * **the plan's order and tile masks**: row slot ``j`` of the tile computes output
      ``order[j]``; offsets ``k0 <= k < k1`` (one mask split) are visited only when
      their bit is set in the tile's mask (``tile_masks[k // 32, tile]``), a test
      every thread of the block makes alike, so the block skips together. The
      skipped centre has no bit in any mask. The launcher runs one launch per split.
    * **a register tile**: each of the ``(tile_m / thread_m) x (tile_n / thread_n)``
      threads sums ``thread_m x thread_n`` outputs, so a value read from shared
      memory feeds ``thread_n`` (a row value) or ``thread_m`` (a weight) FMAs, not
      one (see the module's napkin math). A thread owns neighbouring rows and
      neighbouring channels, and the row tile is stored transposed, so for each
      input channel its ``thread_m`` row values and ``thread_n`` weights are two
      runs of neighbours in shared memory, 16-byte aligned: the compiler reads
      each run with one vector load (``ld.shared.v4``), and the threads of a warp
      read one or two row runs (a broadcast) and neighbouring weight runs.
    * **a short inner loop**: the chunk's channels are taken four at a time, a
      step the compiler unrolls completely, with every shared-memory offset a
      constant folded into the load; the indices are unsigned, so Numba adds no
      negative-index test to the loads.
    * **neighbour rows looked up once per offset**: a thread loads the same
      ``tile_m * tile_k / threads`` elements of the row tile in every chunk, so it
      reads their table entries once per offset into registers, not once per chunk.
    * **prefetch** (``prefetch=True``): the global loads of the next chunk are
      issued into registers before the math of this one, so their latency hides
      behind it; they go to shared memory after the next barrier.
    """
    TY, TX = tile_m // thread_m, tile_n // thread_n
    threads = TX * TY
    if tile_m % thread_m or tile_n % thread_n or (tile_m * tile_k) % threads:
        raise ValueError(f"tile shape {(tile_m, tile_n, tile_k)} with a {thread_m}x{thread_n} register tile "
                         f"is not supported: the {threads} threads must split the {tile_m}x{tile_k} row tile "
                         "evenly")
    a_loads = tile_m * tile_k // threads  # elements of the row tile each thread loads per chunk
    b_size = tile_k * tile_n
    b_loads = -(-b_size // threads)  # elements of the weight tile each thread loads per chunk
    # The row tile is held transposed, [channel of the chunk][row slot], so that a
    # thread's thread_m rows are neighbours: with 16-byte aligned rows the compiler
    # can read them with one vector load (likewise its thread_n weight columns).
    a_pitch = tile_m + 4  # (+4: 16-byte rows, and a chunk's stores spread over banks)
    a_size = tile_k * a_pitch
    align = None if simulating() else 16  # (the simulator takes no alignment)
    u = np.uint64
    TILE_N, THREAD_M, THREAD_N = u(tile_n), u(thread_m), u(thread_n)
    A_PITCH = u(a_pitch)
    STEP = u(min(4, tile_k))  # channels per unrolled step of the inner loop
    K_STEPS = u(tile_k // min(4, tile_k))

    @cuda.jit(device=True, inline=True)
    def load_rows(features, srcs, c0, tid, a_reg):
        """This thread's elements of the chunk's row tile, widened to float32: element
        ``e = tid + threads * r`` is row slot ``e // tile_k``, channel ``e % tile_k``
        (neighbouring threads read neighbouring channels of a row)."""
        c_in = features.shape[1]
        for r in range(a_loads):
            kk = (tid + threads * r) % tile_k
            v = float32(0.0)
            if srcs[r] >= 0 and c0 + kk < c_in:  # -1 (no pair) is a zero, not a read
                v = float32(features[srcs[r], c0 + kk])
            a_reg[r] = v

    @cuda.jit(device=True, inline=True)
    def load_weights(weight, k, c0, n0, tid, b_reg):
        """This thread's elements of the chunk's ``tile_k x tile_n`` piece of W[k]."""
        c_in, c_out = weight.shape[1], weight.shape[2]
        for r in range(b_loads):
            e = tid + threads * r
            kk = e // tile_n
            n = e - kk * tile_n
            v = float32(0.0)
            if e < b_size and c0 + kk < c_in and n0 + n < c_out:
                v = float32(weight[k, c0 + kk, n0 + n])
            b_reg[r] = v

    @cuda.jit
    def implicit(features, weight, table, order, tile_masks, k0, k1, base, has_base, out):
        """One block per (tile of ``tile_m`` row slots, tile of ``tile_n`` channels);
        ``order``/``tile_masks`` are one split's (``plan.order[s]``, ``plan.tile_masks[s]``)."""
        tid = cuda.threadIdx.x
        n_out, c_out, c_in = out.shape[0], out.shape[1], features.shape[1]
        tiles_n = (c_out + tile_n - 1) // tile_n
        tm = cuda.blockIdx.x // tiles_n  # blocks of one row tile are neighbours: its rows
        m0 = tm * tile_m  # stay in L2 for the next column tile
        n0 = (cuda.blockIdx.x - tm * tiles_n) * tile_n
        a_s = cuda.shared.array(a_size, float32, alignment=align)  # [channel of the chunk][row slot]
        b_s = cuda.shared.array(b_size, float32, alignment=align)  # [channel of the chunk][output channel]
        acc = cuda.local.array((thread_m, thread_n), float32)
        a_frag = cuda.local.array(thread_m, float32)
        b_frag = cuda.local.array(thread_n, float32)
        a_reg = cuda.local.array(a_loads, float32)  # this thread's share of a chunk, in flight
        b_reg = cuda.local.array(b_loads, float32)
        outs = cuda.local.array(a_loads, int32)  # the outputs whose rows this thread loads
        srcs = cuda.local.array(a_loads, int32)  # ... and their neighbours through offset k
        tx = tid % TX
        ty = tid // TX
        a_first = u(ty) * THREAD_M  # this thread's first row slot
        b_first = u(tx) * THREAD_N  # ... and first output channel of the tile
        for i in range(THREAD_M):
            for j in range(THREAD_N):
                acc[i, j] = float32(0.0)
        for r in range(a_loads):
            slot = m0 + (tid + threads * r) // tile_k
            outs[r] = order[slot] if slot < n_out else -1
        for k in range(k0, k1):
            if ((tile_masks[k // MASK_BITS, tm] >> (k % MASK_BITS)) & 1) == 0:
                continue  # no row of this tile has a pair through k: the whole block skips it
            for r in range(a_loads):
                o = outs[r]
                srcs[r] = table[k, o] if o >= 0 else -1
            for c0 in range(0, c_in, tile_k):
                if c0 == 0 or not prefetch:
                    load_rows(features, srcs, c0, tid, a_reg)
                    load_weights(weight, k, c0, n0, tid, b_reg)
                for r in range(a_loads):
                    e = tid + threads * r
                    m = e // tile_k
                    a_s[(e - m * tile_k) * a_pitch + m] = a_reg[r]
                for r in range(b_loads):
                    e = tid + threads * r
                    if e < b_size:
                        b_s[e] = b_reg[r]
                cuda.syncthreads()
                if prefetch and c0 + tile_k < c_in:  # the next chunk's loads, in flight during the math
                    load_rows(features, srcs, c0 + tile_k, tid, a_reg)
                    load_weights(weight, k, c0 + tile_k, n0, tid, b_reg)
                for kq in range(K_STEPS):  # the chunk's channels, STEP at a time
                    a_at = kq * (STEP * A_PITCH) + a_first
                    b_at = kq * (STEP * TILE_N) + b_first
                    for q in range(STEP):  # short and constant: unrolled, its offsets folded
                        for i in range(THREAD_M):
                            a_frag[i] = a_s[a_at + q * A_PITCH + i]
                        for j in range(THREAD_N):
                            b_frag[j] = b_s[b_at + q * TILE_N + j]
                        for i in range(THREAD_M):
                            for j in range(THREAD_N):
                                acc[i, j] += a_frag[i] * b_frag[j]
                cuda.syncthreads()
        for i in range(thread_m):
            slot = m0 + ty * thread_m + i
            if slot < n_out:
                o = order[slot]
                for j in range(thread_n):
                    n = n0 + tx * thread_n + j
                    if n < c_out:
                        v = acc[i, j]
                        if has_base:
                            v += float32(base[o, n])
                        out[o, n] = v  # the value's only store in this launch: no atomics

    return implicit



def _word_loads(threads, kw_a, kw_b, a_size, b_size, word_a, word_b):
    """The global loads of v4 and v5, as device functions ``(load_rows, load_weights)``:
    the words a thread moves into registers for one chunk, ``a_size`` words of the row
    tile (``kw_a`` a row slot) and ``b_size`` of the weight tile (``kw_b`` a row), word
    ``e = tid + threads * r`` for its ``r``-th load (neighbouring threads, neighbouring
    words). Words past the tile, the channels or the pairs are zeros (all bits zero:
    fp16 +0.0)."""
    a_loads, b_loads = -(-a_size // threads), -(-b_size // threads)
    ragged = a_size % threads != 0  # (a constant: where the threads split the row tile evenly, no test)

    @cuda.jit(device=True, inline=True)
    def load_rows(fw, srcs, c0w, tid, a_reg):
        """This thread's words of the chunk's row tile: word ``e`` is row slot ``e // kw_a``,
        word ``e % kw_a``; ``srcs[r]`` is that slot's neighbour row (-1: none)."""
        c_in_w = fw.shape[1]
        for r in range(a_loads):
            e = tid + threads * r
            w = e % kw_a
            v = word_a(0)
            if (not ragged or e < a_size) and srcs[r] >= 0 and c0w + w < c_in_w:
                v = fw[srcs[r], c0w + w]
            a_reg[r] = v

    @cuda.jit(device=True, inline=True)
    def load_weights(ww, k, c0, n0w, tid, b_reg):
        """This thread's words of the chunk's ``tile_k x tile_n`` piece of W[k]."""
        c_in, c_out_w = ww.shape[1], ww.shape[2]
        for r in range(b_loads):
            e = tid + threads * r
            kk = e // kw_b
            w = e - kk * kw_b
            v = word_b(0)
            if e < b_size and c0 + kk < c_in and n0w + w < c_out_w:
                v = ww[k, c0 + kk, n0w + w]
            b_reg[r] = v

    return load_rows, load_weights


def store_warp_tile(mi: int, ni: int):
    """The epilogue of v4 and v5, a device function: each lane's results of its warp's
    ``mi x ni`` mma tiles (placed by ``c_row``/``c_col``) into the outputs the plan's
    order names, plus ``base`` when ``has_base``, rounded once to the output's dtype."""

    @cuda.jit(device=True, inline=True)
    def store(acc, order, base, has_base, out, m0, n0, row0, col0, lane):
        n_out, c_out = out.shape[0], out.shape[1]
        for i in range(mi):
            for j in range(ni):
                for r in range(4):
                    slot = m0 + row0 + i * 16 + c_row(lane, r)
                    n = n0 + col0 + j * 8 + c_col(lane, r)
                    if slot < n_out and n < c_out:
                        o = order[slot]
                        v = acc[(i * ni + j) * 4 + r]
                        if has_base:
                            v += float32(base[o, n])
                        out[o, n] = v  # rounded once, to the output's dtype

    return store


def check_prefetch(prefetch):
    """v4's ``prefetch``: True (rows and weights), ``"rows"`` or False."""
    if not (prefetch is True or prefetch is False or prefetch == "rows"):
        raise TypeError(f"prefetch must be True, False or 'rows', got {prefetch!r}")


@cached
def implicit_gemm_v4(tile_m: int, tile_n: int, tile_k: int, a_vec: int, b_vec: int,
                     max_registers: int | None = None, prefetch: bool | str = True):
    """v4: v3's kernel with the tile's multiply-accumulate on the tensor cores (fp16).

    Everything around the arithmetic is v3's: a block per (tile of ``tile_m`` row
    slots in the plan's order, tile of ``tile_n`` channels), the tile mask
    skipping offsets no row of the tile has a pair through, the neighbour rows
    looked up once per offset, chunks of ``tile_k`` input channels in shared
    memory, the next chunk's global loads in flight during this one's math, one
    store per output. What changed:

    * **the math**: each warp owns ``16 mi x 8 ni`` outputs of the tile
      (:func:`v4_shape`) and, per chunk, calls the C++ function
      :func:`numba_sc.dataflows.tensor_cores.warp_mma`: ``ldmatrix`` fragments of
      the shared tiles and ``mma.m16n8k16`` with fp32 accumulators. The
      accumulators are a local array of ``4 mi ni`` floats per lane, laid out as
      the mma's C fragment; the epilogue places them with ``c_row``/``c_col``.
    * **the shared tiles stay fp16**, row-major: rows of the chunk (``[row
      slot][channel]``, the mma's A) and ``W[k]``'s piece (``[channel][output
      channel]``, its B, read transposed by ``ldmatrix.trans``), each row padded
      by 8 values (16 bytes), so that the 8 row addresses of an ``ldmatrix``
      fall in different banks.
    * **the loads move words, not values**: the Python code never looks inside
      an fp16 value (the tensor cores read them), so the features and weights are
      viewed as 2-, 4- or 8-byte words (``a_vec``, ``b_vec`` fp16 values: the
      widest that divides the channel count) and copied as such, up to four
      values a load where v3 loads one.

    Sums are float32, rounded once to fp16 at the store, as in v3 (only their
    order differs). fp16 only: fp32 data has no fp16 tensor-core path that keeps
    v3's rounding, so the library keeps fp32 on v3.

    ``max_registers`` caps the registers a thread (the compiler spills what does
    not fit; None, the library's: the compiler's choice). Registers decide how many
    blocks an SM holds, and this kernel is register-bound: see
    :func:`numba_sc.dataflows.tensor_cores.kernel_options` and
    ``benchmarks/probes/kernel_resources.py``, which reads a rung's registers,
    spills and shared memory without a GPU. ``prefetch=False`` (the library's is
    True) loads each chunk after the previous chunk's math instead of during it: the
    next chunk's words and their addresses no longer stay in registers across the
    ``mma``, so a thread needs fewer (``kernel_resources.json``) and an SM holds more
    blocks, at the price of waiting for every chunk's loads. ``prefetch="rows"``
    keeps only the gathered rows in flight (the loads whose addresses the map
    decides) and loads the weights, the same for every block and so likely in L2,
    when they are needed. Same sums in the same order: the output is the same bit
    for bit whatever the choice.
    """
    check_prefetch(prefetch)
    early_rows, early_weights = prefetch is not False, prefetch is True
    warps_m, warps_n, mi, ni = v4_shape(tile_m, tile_n)
    threads = 32 * warps_m * warps_n
    wm, wn = 16 * mi, 8 * ni  # the warp tile
    word_a, word_b = from_dtype(WORDS[a_vec]), from_dtype(WORDS[b_vec])
    kw_a, kw_b = tile_k // a_vec, tile_n // b_vec  # words of a chunk's row, of a weight row
    a_pitch, b_pitch = tile_k + 8, tile_n + 8  # fp16 values a shared row (+8: see the docstring)
    a_pitch_w, b_pitch_w = a_pitch // a_vec, b_pitch // b_vec
    a_shared, b_shared = tile_m * a_pitch_w, tile_k * b_pitch_w  # words of the shared tiles
    n_acc = 4 * mi * ni  # a lane's results
    if tile_k % 16 or (tile_m * kw_a) % threads:
        raise ValueError(f"v4 tile ({tile_m}, {tile_n}, {tile_k}) with loads of {a_vec} values is not supported: "
                         f"tile_k must be a multiple of 16 and the {threads} threads must split the row tile evenly")
    a_size, b_size = tile_m * kw_a, tile_k * kw_b  # words of a chunk of each tile
    a_loads = a_size // threads  # words of the row tile each thread loads per chunk
    b_loads = -(-b_size // threads)
    k_steps = tile_k // 16  # mma steps a chunk
    mma = warp_mma(mi, ni)  # the C++ (under the simulator, its Python stand-in)
    load_rows, load_weights = _word_loads(threads, kw_a, kw_b, a_size, b_size, word_a, word_b)
    store = store_warp_tile(mi, ni)
    align = None if simulating() else 16  # (ldmatrix's rows; the simulator takes no alignment)

    @cuda.jit(**kernel_options(max_registers))
    def implicit(fw, ww, table, order, tile_masks, k0, k1, base, has_base, out):
        """``fw``: the features as words (n_in, C_in / a_vec); ``ww``: the weights as
        words (K, C_in, C_out / b_vec); the rest as in v3."""
        tid = cuda.threadIdx.x
        n_out, c_out, c_in_w = out.shape[0], out.shape[1], fw.shape[1]
        tiles_n = (c_out + tile_n - 1) // tile_n
        tm = cuda.blockIdx.x // tiles_n
        m0 = tm * tile_m
        n0 = (cuda.blockIdx.x - tm * tiles_n) * tile_n
        a_s = cuda.shared.array(a_shared, word_a, alignment=align)  # [row slot][channel], fp16 bits
        b_s = cuda.shared.array(b_shared, word_b, alignment=align)  # [channel][output channel]
        acc = cuda.local.array(n_acc, float32)  # this lane's C fragments, (i, j, r)
        a_reg = cuda.local.array(a_loads, word_a)
        b_reg = cuda.local.array(b_loads, word_b)
        outs = cuda.local.array(a_loads, int32)
        srcs = cuda.local.array(a_loads, int32)
        warp, lane = tid // 32, tid % 32
        row0 = (warp // warps_n) * wm  # the warp's tile, within the block's
        col0 = (warp % warps_n) * wn
        for q in range(n_acc):
            acc[q] = float32(0.0)
        for r in range(a_loads):
            slot = m0 + (tid + threads * r) // kw_a
            outs[r] = order[slot] if slot < n_out else -1
        for k in range(k0, k1):
            if ((tile_masks[k // MASK_BITS, tm] >> (k % MASK_BITS)) & 1) == 0:
                continue  # no row of this tile has a pair through k
            for r in range(a_loads):
                o = outs[r]
                srcs[r] = table[k, o] if o >= 0 else -1
            for c0w in range(0, c_in_w, kw_a):
                if c0w == 0 or not early_weights:  # (weights early: rows early too)
                    if c0w == 0 or not early_rows:
                        load_rows(fw, srcs, c0w, tid, a_reg)
                    load_weights(ww, k, c0w * a_vec, n0 // b_vec, tid, b_reg)
                for r in range(a_loads):
                    e = tid + threads * r
                    m = e // kw_a
                    a_s[m * a_pitch_w + (e - m * kw_a)] = a_reg[r]
                for r in range(b_loads):
                    e = tid + threads * r
                    if e < b_size:
                        kk = e // kw_b
                        b_s[kk * b_pitch_w + (e - kk * kw_b)] = b_reg[r]
                cuda.syncthreads()
                if c0w + kw_a < c_in_w:  # the next chunk's loads, in flight during the math
                    if early_rows:
                        load_rows(fw, srcs, c0w + kw_a, tid, a_reg)
                    if early_weights:
                        load_weights(ww, k, (c0w + kw_a) * a_vec, n0 // b_vec, tid, b_reg)
                mma(data_pointer(acc), data_pointer(a_s), data_pointer(b_s), int32(a_pitch), int32(b_pitch),
                    int32(row0), int32(col0), int32(k_steps))
                cuda.syncthreads()
        store(acc, order, base, has_base, out, m0, n0, row0, col0, lane)

    return implicit


@cached
def implicit_gemm_v5(tile_m: int, tile_n: int, tile_k: int, a_vec: int, b_vec: int,
                     max_registers: int | None = None):
    """v5: v4 with its shared tiles double-buffered and its loads running ahead across offsets.

    v4 loads a chunk, stores it to shared memory, waits at a barrier, multiplies, and
    waits at a second barrier before the next chunk may overwrite the tiles. Its next
    chunk's loads run during the math only within one offset: the first chunk of each
    offset is loaded after the previous offset's last barrier, its latency (a table
    lookup, then a gathered row) in full view. At 32 or 64 input channels a chunk of
    32 is one or two steps an offset, so most steps wait. v5 changes the loop, not the math:

    * **one sequence of steps** ``(offset, chunk)`` over the offsets whose bit is set in
      the tile's mask: during step ``s``'s math the loads of step ``s + 1`` are in
      flight, whether it is the same offset's next chunk or the next live offset's
      first (its neighbour rows looked up first: step ``s``'s rows are already in
      shared memory, so the lookups may overwrite them);
    * **two copies of each shared tile** (stages): step ``s`` fills copy ``s % 2``
      while a slow warp may still be multiplying copy ``(s - 1) % 2``, so one barrier a
      step suffices: after it, every warp has finished step ``s - 1``'s math, whose
      copy step ``s + 1`` will refill;
    * **wider blocks** (:func:`numba_sc.dataflows.implicit_shapes.v5_shape`): up to 128
      output channels a block in warps of 32 x 32, so a gathered row feeds twice
      v4's 64 columns where the layer is that wide.

    Everything else (the plan's order, the tile masks, the word loads, ``mma.cu``, the
    epilogue, one rounding to fp16) is v4's. Shared memory: two stages of
    ``tile_m x (tile_k + 8)`` and ``tile_k x (tile_n + 8)`` fp16 values, at 64 x 128 x 32
    ``2 x 2 x (64 x 40 + 32 x 136)`` bytes, under the 48 KB a kernel may declare
    statically (``tests/dataflows/test_gpu_compile.py`` reads the sizes from the PTX).

    Measured, it loses to v4 (the module docstring says where): the extra stage and the
    run-ahead bookkeeping raise the registers a thread, so fewer blocks fit an SM, and
    the loop issues more instructions than v4's; the latency it hides was not the limit.
    """
    warps_m, warps_n, mi, ni = v5_shape(tile_m, tile_n)
    threads = 32 * warps_m * warps_n
    wm, wn = 16 * mi, 8 * ni  # the warp tile
    word_a, word_b = from_dtype(WORDS[a_vec]), from_dtype(WORDS[b_vec])
    kw_a, kw_b = tile_k // a_vec, tile_n // b_vec  # words of a chunk's row, of a weight row
    a_pitch, b_pitch = tile_k + 8, tile_n + 8  # fp16 values a shared row (+8: see v4)
    a_pitch_w, b_pitch_w = a_pitch // a_vec, b_pitch // b_vec
    a_stage, b_stage = tile_m * a_pitch_w, tile_k * b_pitch_w  # words of one copy of each tile
    a_both, b_both = 2 * a_stage, 2 * b_stage  # (a shared array's size must be a constant, not an expression)
    if tile_k % 16:
        raise ValueError(f"v5 tile ({tile_m}, {tile_n}, {tile_k}): tile_k must be a multiple of 16 (the mma's k)")
    n_acc = 4 * mi * ni  # a lane's results
    a_size, b_size = tile_m * kw_a, tile_k * kw_b  # words of a chunk of each tile
    a_loads, b_loads = -(-a_size // threads), -(-b_size // threads)
    k_steps = tile_k // 16  # mma steps a chunk
    mma = warp_mma(mi, ni)  # the C++ (under the simulator, its Python stand-in)
    load_rows, load_weights = _word_loads(threads, kw_a, kw_b, a_size, b_size, word_a, word_b)
    store = store_warp_tile(mi, ni)
    align = None if simulating() else 16  # (ldmatrix's rows; the simulator takes no alignment)

    @cuda.jit(device=True, inline=True)
    def next_live(tile_masks, tm, k, k1):
        """The first offset from ``k`` on (below ``k1``) whose bit is set in tile ``tm``'s
        mask; ``k1`` when there is none. Every thread of the block gets the same answer."""
        while k < k1 and ((tile_masks[k // MASK_BITS, tm] >> (k % MASK_BITS)) & 1) == 0:
            k += 1
        return k

    @cuda.jit(device=True, inline=True)
    def look_up(table, outs, k, srcs):
        """The neighbour rows, through offset ``k``, of the outputs whose words this thread loads."""
        for r in range(a_loads):
            o = outs[r]
            srcs[r] = table[k, o] if o >= 0 else -1

    @cuda.jit(**kernel_options(max_registers))
    def implicit(fw, ww, table, order, tile_masks, k0, k1, base, has_base, out):
        """The arguments as v4's."""
        tid = cuda.threadIdx.x
        n_out, c_out, c_in_w = out.shape[0], out.shape[1], fw.shape[1]
        tiles_n = (c_out + tile_n - 1) // tile_n
        tm = cuda.blockIdx.x // tiles_n
        m0 = tm * tile_m
        n0 = (cuda.blockIdx.x - tm * tiles_n) * tile_n
        n0w = n0 // b_vec
        a_s = cuda.shared.array(a_both, word_a, alignment=align)  # [stage][row slot][channel]
        b_s = cuda.shared.array(b_both, word_b, alignment=align)  # [stage][channel][output channel]
        acc = cuda.local.array(n_acc, float32)
        a_reg = cuda.local.array(a_loads, word_a)
        b_reg = cuda.local.array(b_loads, word_b)
        outs = cuda.local.array(a_loads, int32)
        srcs = cuda.local.array(a_loads, int32)
        warp, lane = tid // 32, tid % 32
        row0 = (warp // warps_n) * wm
        col0 = (warp % warps_n) * wn
        for q in range(n_acc):
            acc[q] = float32(0.0)
        for r in range(a_loads):
            slot = m0 + (tid + threads * r) // kw_a
            outs[r] = order[slot] if slot < n_out and tid + threads * r < a_size else -1
        k = next_live(tile_masks, tm, k0, k1)  # the first step: (k, chunk 0)
        c0w = 0
        if k < k1:
            look_up(table, outs, k, srcs)
            load_rows(fw, srcs, 0, tid, a_reg)
            load_weights(ww, k, 0, n0w, tid, b_reg)
        stage = 0
        while k < k1:
            for r in range(a_loads):  # this step's words into this stage's copies
                e = tid + threads * r
                if e < a_size:
                    m = e // kw_a
                    a_s[stage * a_stage + m * a_pitch_w + (e - m * kw_a)] = a_reg[r]
            for r in range(b_loads):
                e = tid + threads * r
                if e < b_size:
                    kk = e // kw_b
                    b_s[stage * b_stage + kk * b_pitch_w + (e - kk * kw_b)] = b_reg[r]
            cuda.syncthreads()  # the copies are full, and every warp is past the last step's math
            nk = k  # the next step: this offset's next chunk, or the next live offset's first
            nc = c0w + kw_a
            if nc >= c_in_w:
                nk = next_live(tile_masks, tm, k + 1, k1)
                nc = 0
                if nk < k1:
                    look_up(table, outs, nk, srcs)
            if nk < k1:  # its loads, in flight during this step's math
                load_rows(fw, srcs, nc, tid, a_reg)
                load_weights(ww, nk, nc * a_vec, n0w, tid, b_reg)
            mma(data_pointer(acc), data_pointer(a_s[stage * a_stage:]), data_pointer(b_s[stage * b_stage:]),
                int32(a_pitch), int32(b_pitch), int32(row0), int32(col0), int32(k_steps))
            k = nk
            c0w = nc
            stage = 1 - stage
        store(acc, order, base, has_base, out, m0, n0, row0, col0, lane)

    return implicit



# ------------------------------------------------------------ running each rung
# A whole 3x3x3 submanifold layer outside the centre, added onto ``init`` (the
# centre product): float sums in another order than the reference's, so a tolerance.
# v1 and v2 are launched the way Numba teaches; v3 and v4, the library's, through
# run_splits (numba_sc.core.launch.launch, one launch per mask split).
def run_v1(f, w, t, plan, init):
    """v1 on device arrays (checked by the caller): one launch, a thread per output value."""
    n_out, c_out = plan.n_out, int(w.shape[2])
    out = device_xp().empty((n_out, c_out), dtype=f.dtype)
    if n_out:
        base = to_device(init) if init is not None else out
        implicit_gemm_v1[blocks_for(n_out * c_out, THREADS), THREADS](f, w, t, plan.skip, base, init is not None,
                                                                        out)
    return out


def run_v2(f, w, t, plan, init):
    """v2 on device arrays (checked by the caller): a block per tile of outputs and channels."""
    n_out, c_out = plan.n_out, int(w.shape[2])
    out = device_xp().empty((n_out, c_out), dtype=f.dtype)
    if n_out:
        base = to_device(init) if init is not None else out
        tm, tn, tk = SIM_V2_TILE if simulating() else GPU_V2_TILE
        blocks = cdiv(n_out, tm) * cdiv(c_out, tn)
        implicit_gemm_v2(tm, tn, tk)[blocks, tm * tn](f, w, t, plan.skip, base, init is not None, out)
    return out


def run_v3(f, w, t, plan, init, tiles: Tiles | None = None):
    """v3 on device arrays (checked by the caller)."""
    c_in, c_out = int(f.shape[1]), int(w.shape[2])
    tiles = tiles or implicit_tiles(plan.tile_m, c_in, c_out)
    threads = (plan.tile_m // tiles.thread_m) * (tiles.tile_n // tiles.thread_n)
    blocks = plan.n_tiles * cdiv(c_out, tiles.tile_n)
    return run_splits(implicit_gemm_v3(plan.tile_m, *tiles), f, w, t, plan, init, c_out, f.dtype, threads,
                       blocks)


def run_v4(f, w, t, plan, init, tiles: TensorTiles | None = None, max_registers: int | None = None,
           prefetch: bool | str = True):
    """v4 on device arrays (checked by the caller): fp16 only (``max_registers``,
    ``prefetch``: see v4)."""
    check_prefetch(prefetch)  # (here too: the cached factory would take 0 for False)
    if f.dtype != np.float16:
        raise TypeError(f"implicit_gemm v4 multiplies fp16 on tensor cores; features are {f.dtype}: "
                        "pass float16 features and weights, or run v3 (implicit_gemm_cuda picks it for fp32)")
    c_in, c_out = int(f.shape[1]), int(w.shape[2])
    tiles = tiles or tensor_tiles(c_in, c_out)
    warps_m, warps_n, _, _ = v4_shape(plan.tile_m, tiles.tile_n)
    blocks = plan.n_tiles * cdiv(c_out, tiles.tile_n)
    # the loads move whole words of a_vec (b_vec) fp16 values: the same memory, viewed
    fw = f.view(WORDS[tiles.a_vec])
    ww = w.view(WORDS[tiles.b_vec])
    return run_splits(implicit_gemm_v4(plan.tile_m, *tiles, max_registers, prefetch), fw, ww, t, plan, init, c_out,
                      f.dtype, 32 * warps_m * warps_n, blocks)


def run_v5(f, w, t, plan, init, tiles: TensorTiles | None = None, max_registers: int | None = None):
    """v5 on device arrays (checked by the caller): fp16 only (``max_registers``: see v4)."""
    if f.dtype != np.float16:
        raise TypeError(f"implicit_gemm v5 multiplies fp16 on tensor cores; features are {f.dtype}: "
                        "pass float16 features and weights, or run v3 (implicit_gemm_cuda picks it for fp32)")
    c_in, c_out = int(f.shape[1]), int(w.shape[2])
    tiles = tiles or v5_tiles(c_in, c_out)
    warps_m, warps_n, _, _ = v5_shape(plan.tile_m, tiles.tile_n)
    blocks = plan.n_tiles * cdiv(c_out, tiles.tile_n)
    return run_splits(implicit_gemm_v5(plan.tile_m, *tiles, max_registers), f.view(WORDS[tiles.a_vec]),
                      w.view(WORDS[tiles.b_vec]), t, plan, init, c_out, f.dtype, 32 * warps_m * warps_n, blocks)


def _ladder_work(ctx):
    layer = ctx.layer()
    plan = ctx.memo("implicit_plan", lambda: implicit_plan_reference(layer["km"].table, skip=layer["centre"]).device())
    return dict(layer, implicit_plan=plan)


RUNS = {"v1": run_v1, "v2": run_v2, "v3": run_v3,
        "v4": lambda f, w, t, plan, init: (run_v4 if f.dtype == np.float16 else run_v3)(f, w, t, plan, init),
        "v5": lambda f, w, t, plan, init: (run_v5 if f.dtype == np.float16 else run_v3)(f, w, t, plan, init)}


def _rung(name, adds):
    return Rung(name, lambda w: RUNS[name](w["features"], w["weight"], w["km"].table, w["implicit_plan"], w["init"]),
                adds)


LADDER = Ladder(
    "implicit_gemm",
    (_rung("v1", "one thread per (output, output channel) over every offset and input channel"),
     _rung("v2", "+ shared-memory tiles of the gathered rows and of W[k]"),
     _rung("v3", "+ outputs sorted by offset mask, tiles skip absent offsets, a register tile (the library's "
                 "in fp32)"),
     _rung("v4", "+ the tile's multiply-accumulate on tensor cores (mma in linked CUDA C++, a Python stand-in "
                 "under the simulator; fp16 only, fp32 runs v3; the library's in fp16)"),
     _rung("v5", "+ double-buffered shared tiles, the next step's loads in flight across offsets, blocks up to "
                 "128 channels wide (fp16 only, fp32 runs v3; slower than v4: more registers, fewer blocks an SM)")),
    workload=_ladder_work,
    reference=lambda w: implicit_gemm_reference(to_host(w["features"]), to_host(w["weight"]),
                                                to_host(w["km"].table), to_host(w["init"]), w["centre"]),
    tolerance={"float32": 1e-5, "float16": 2e-3},
    bytes_moved=layer_bytes_moved,
    flops=layer_flops,
)
