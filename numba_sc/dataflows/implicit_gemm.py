"""Implicit GEMM: the output-major dataflow, with sorted bitmasks and mask splits.

Minuet's GMaS step is gather -> grouped GEMMs -> scatter: every pair gets a row
in an input buffer (:mod:`numba_sc.gmas.gather`), the GEMMs turn those rows into
partial results in an output buffer, and :mod:`numba_sc.gmas.scatter` sums them into
the outputs. The buffers are the price: for ``n`` pairs in fp32 they are written
once and read once on each side, ``8 n (C_in + C_out)`` bytes that exist only to
be thrown away.

The implicit GEMM (spconv 2's MaskImplicitGemm, and one of TorchSparse++'s
dataflows) has no buffers. Think of the convolution as one dense GEMM of an
``n_out x (K C_in)`` matrix ``A`` by the ``(K C_in) x C_out`` stack of the
weights, where row ``i`` of ``A`` is the concatenation of the K neighbour rows of
output ``i`` (zeros where there is none)::

    out[i] = init[i] + sum over k != skip with table[k, i] >= 0 of features[table[k, i]] @ W[k]

``A`` is never stored. A thread block owns a tile of ``TILE_M`` outputs by
``TILE_N`` output channels; for each offset ``k`` it fetches the tile's
neighbour rows ``features[table[k, rows]]`` straight into shared memory, a chunk
of ``TILE_K`` input channels at a time (zeros for ``-1``, which costs no memory
read), next to the matching ``TILE_K x TILE_N`` piece of ``W[k]``; the threads
multiply the two into registers, and the tile is written once at the end. No
scatter, no atomics: every output value belongs to one thread of one block.

Sorted bitmasks. The block multiplies all ``TILE_M`` rows for an offset as soon
as *one* of them has a pair through it; the others multiply zeros. How much of
that waste a tile carries depends on which outputs share it. Each output's
*bitmask* says which offsets it has a pair through (bit ``k % 32`` of word
``k // 32``, the layout of :mod:`numba_sc.core.conventions`). Sorting the outputs by
their mask, read as a number, puts outputs with equal masks next to each other;
a tile then takes the OR of its rows' masks, the *tile mask*, and the whole
block skips every offset whose bit is clear (one decision per block, so no
divergence). The sort moves the *order of work*, not the data: ``order[j]`` is
the output the ``j``-th row slot computes, and its result is stored straight to
``out[order[j]]``.

Worked example, ``K = 3`` offsets, 4 outputs, ``TILE_M = 2``::

    table = [[ 5, -1,  7, -1],      masks: out0 0b101   out1 0b010
             [-1,  2, -1,  3],             out2 0b101   out3 0b010
             [ 0, -1,  4, -1]]      6 pairs

    natural order [0, 1, 2, 3]: tiles {0, 1} and {2, 3}, both with tile mask 0b111:
        3 offsets x 2 rows each = 12 row products for 6 pairs (half of them zeros)
    sorted order  [1, 3, 0, 2]: tile {1, 3} mask 0b010 (1 offset), tile {0, 2}
        mask 0b101 (2 offsets): 2 + 4 = 6 row products, none wasted

Mask splits (TorchSparse++, Figure 10). A tile's mask is the OR of ``TILE_M``
masks of up to K bits, so it fills up fast. Cut the offsets into ``s``
contiguous ranges and treat each range as its own problem: its own sub-masks,
its own sorted order, its own tile masks, its own launch. Each range's masks are
shorter, so the sort groups them better and fewer zeros are multiplied; the
price is that every split reads and writes the output once more. Split 0 writes
``init + its sum``; each later split adds its sum onto what is there (a plain
read-modify-write: within a launch each output value has one owner, and the
launches of one stream run in order). In fp16 the running sum is kept in a
float32 scratch array between splits, so the result is still rounded once.

The per-map work - masks, a stable sort per split, tile masks - is an
:class:`ImplicitPlan` (:func:`implicit_plan`). It depends on the table, the
splits, the centre that is skipped and ``TILE_M``, and on nothing about the
features, the weights or the channel counts, so every layer that shares a map
shares its plan.

Napkin math, fp32, a layer with ``n`` pairs outside the centre, ``n_out``
outputs, ``r >= 1`` row products computed per real pair (the waste the sorted
masks leave; :func:`plan_work` counts it), ``s`` splits:

* bytes: the neighbour rows are read once per column tile of the output, and
  only where a pair exists (``4 n C_in`` for ``C_out <= TILE_N``); the weights
  once per block; the output is written once (``4 n_out C_out``; ``(2s - 1)``
  times with splits). Gather-GEMM-scatter adds its buffers, ``8 n (C_in +
  C_out)`` bytes. SemanticKITTI at 0.05 m (94,444 voxels, ~190k pairs outside
  the centre in a 3x3x3 layer) at 64 channels: 195 MB of buffers, which take
  ~58 us at the H100's ~3.35 TB/s (typed: napkin math), against ~49 MB of
  neighbour rows (the 24 MB of features fit the 50 MB L2) and a 24 MB output
  here.
* arithmetic: ``2 r n C_in C_out`` flops, 1.56 GFLOP for ``r = 1`` in that
  example. **Numba-CUDA has no wmma/mma intrinsics, so v1-v3 run on the CUDA
  cores (FP32 FMA), for fp16 data too** (fp16 values are widened as they are
  loaded, sums are float32). At perfect efficiency, times ``r``, that is
  ~26 us at the H100 SXM's ~60 TFLOP/s of dense FP32 (typed: napkin math); its
  fp16 tensor cores (~990 TFLOP/s dense) would take ~1.6 us (typed: napkin math).
  So in fp32, where cuBLAS's SGEMM runs on the same CUDA cores, the implicit
  GEMM trades the buffers' traffic for ``r`` times the arithmetic. In fp16,
  gather-GEMM-scatter runs its GEMM on the tensor cores and moves half the
  bytes (``4 n (C_in + C_out)``); v4 puts the implicit GEMM's tile on the
  tensor cores too, through a few lines of CUDA C++ linked into the Python
  kernel (:mod:`numba_sc.dataflows.tensor_cores`), so that what is left is the
  gathers, as in gather-GEMM-scatter without its buffers.
* the register tile: for each input channel a thread reads ``THREAD_M +
  THREAD_N`` values from shared memory and does ``THREAD_M x THREAD_N`` FMAs.
  An SM serves about one warp-wide shared-memory access (a *wavefront*, 128
  bytes) per clock and four warp-wide FMA instructions, so with one load per
  value a 4x4 tile (8 accesses, 16 FMAs) could reach at most half the FMA
  peak. Read as two 16-byte vector loads, the same 8 values cost 3 wavefronts
  (the warp's row values are a broadcast), below the 4 clocks of its FMAs. A
  larger tile (8x8) needs 64 sums in registers: in this kernel it spilled and
  ran slower. What is left is instructions: index arithmetic, each chunk's
  loads and the barriers around them, which the vector loads and the unrolled
  channel steps cut.

The ladder, one idea a rung (all checked against :func:`implicit_gemm_reference`;
``python -m numba_sc ladder implicit_gemm`` times them, recorded in
``benchmarks/results/ladder_implicit_gemm.json``):

    v1  one thread per (output, output channel): every offset, every input
          channel, straight from global memory; the definition, no masks
    v2  + shared-memory tiles: ``TILE_M x TILE_K`` gathered rows and the
          ``TILE_K x TILE_N`` piece of ``W[k]``, reused by the whole block
    v3  + the sorted bitmask order and tile-mask skips (splits are separate
          launches), and a register tile of ``THREAD_M x THREAD_N`` outputs per
          thread read with vector loads (the library's in fp32). What it bought
          beyond the ladder: on the dense cloud (1M random voxels at stride 4),
          fp32 at 32 and 64 channels, the whole layer in less wall-clock time
          than gather-GEMM-scatter's (the ``dense`` rows of
          ``benchmarks/results/alternatives.json``; ``docs/performance.md``,
          "dataflows/implicit_gemm.py")
    v4  + the tile's multiply-accumulate on the tensor cores: each warp calls a
          CUDA C++ ``mma.m16n8k16`` on fp16 shared-memory tiles (``mma.cu``),
          everything else v3's; GPU only (the simulator cannot run linked C++)
          and fp16 only (the library's in fp16 from
          :data:`TENSOR_CORE_MIN_CHANNELS` channels, :func:`library_rung`).
          Measured against v3 per channel count:
          ``benchmarks/results/ladder_implicit_gemm.json`` (64 channels) and
          ``benchmarks/results/implicit_v4_channels.json``

Expect v2 to be *slower* than v1 on a sparse map: a v1 thread skips each
missing neighbour by itself, while a v2 block, which has no masks, multiplies
all K offsets for every tile, most of them zeros (a 3x3x3 layer on a LiDAR scan
has about 3 pairs per output, the centre included, not 27). The masks of v3 are
what turn the tiles into a gain.

The layout of this module: the tiles and their choice (:class:`Tiles`,
:func:`implicit_tiles`), argument checks, the reference
(:func:`implicit_gemm_reference`), the plan (:class:`ImplicitPlan`,
:func:`implicit_plan` and its NumPy reference), the ladder (:func:`implicit_gemm_v1`,
:func:`implicit_gemm_v2`, :func:`implicit_gemm_v3`, and :func:`implicit_gemm_v4`
with its :class:`TensorTiles`) and the launcher (:func:`implicit_gemm_cuda`, which
runs the rung :func:`library_rung` picks; :func:`implicit_gemm_rung` runs any rung).

Measured figures (Nsight Compute, against gather-GEMM-scatter and spconv):
``docs/performance.md``, "dataflows/implicit_gemm.py".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, from_dtype, int32, int64

from ..core.device import device_id, device_xp, simulating
from ..core.backend import to_device, to_host
from ..core.launch import launch
from ..core.rungs import Ladder, Rung
from ..core import conventions as cv
from ..core.conventions import MASK_BITS, mask_words
from .tensor_cores import c_col, c_row, check_gpu, data_pointer, warp_mma
TILE_M_CHOICES = (16, 32, 64, 128)  # outputs per tile (the plan's tile_m)

# Tile sizes. A kernel is compiled per tile shape (shared and register arrays need
# their sizes at compile time); the shape follows the channel counts within these
# bounds. The simulator runs one Python thread per CUDA thread, so it gets small
# tiles: the same code, and tests that cross several tiles on small clouds.
GPU_TILE_M = 64
GPU_TILE_N = (16, 64)  # min, max output channels per tile
GPU_TILE_K = (4, 16)  # min, max input channels per shared-memory chunk
GPU_THREAD = (4, 4)  # outputs per thread (rows, channels): the register tile
SIM_TILE_M = 16
SIM_TILE_N = (4, 16)
SIM_TILE_K = (4, 8)
SIM_THREAD = (4, 4)
# v2's tile: one output per thread
GPU_V2_TILE = (16, 16, 16)  # (TILE_M, TILE_N, TILE_K)
SIM_V2_TILE = (8, 8, 8)


class Tiles(NamedTuple):
    """The shape one v3 kernel is compiled for (besides the plan's ``tile_m``)."""

    tile_n: int  # output channels per block
    tile_k: int  # input channels per shared-memory chunk
    thread_m: int  # rows of a thread's register tile
    thread_n: int  # channels of a thread's register tile
    prefetch: bool = True  # load the next chunk during this chunk's math


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_tile_m() -> int:
    """Outputs per tile of a plan made without ``tile_m``: 64 on a GPU, 16 simulated."""
    return SIM_TILE_M if simulating() else GPU_TILE_M


def implicit_tiles(tile_m: int, c_in: int, c_out: int) -> Tiles:
    """The library's tile shape for ``tile_m`` outputs and these channel counts.

    ``TILE_N`` and ``TILE_K`` are the channel counts rounded up to a power of two
    within the machine's bounds (``C_out = 16`` gets 16-wide tiles, not 64 of
    which 48 are zeros; ``C_in = 3`` gets chunks of 4).
    """
    sim = simulating()
    n_lo, n_hi = SIM_TILE_N if sim else GPU_TILE_N
    k_lo, k_hi = SIM_TILE_K if sim else GPU_TILE_K
    th_m, th_n = SIM_THREAD if sim else GPU_THREAD
    tile_n = min(n_hi, max(n_lo, _pow2_at_least(c_out)))
    tile_k = min(k_hi, max(k_lo, _pow2_at_least(c_in)))
    return Tiles(tile_n, tile_k, min(th_m, tile_m), min(th_n, tile_n))


# ------------------------------------------------------------------ checks
def check_inputs(features, weight, table, init=None, backend="cuda"):
    """Shapes and dtypes only (cheap: nothing is read from the device); float64 features
    on ``backend="reference"`` only.

    Returns ``(K, n_out, C_in, C_out)``.
    """
    cv.check_features(features, backend=backend)
    if not cv.is_array(table):
        raise TypeError(f"table must be a NumPy or CuPy array, got {type(table).__name__}")
    if table.dtype != np.int32:
        raise TypeError(f"table must be int32 (K, n_out), got {table.dtype}; pass km.table or "
                        "table.astype(np.int32)")
    if table.ndim != 2:
        raise ValueError(f"table must have shape (K, n_out) (KernelMap.table), got {tuple(table.shape)}")
    K, n_out = (int(v) for v in table.shape)
    c_in = int(features.shape[1])
    cv.check_weight(weight, K, c_in, features.dtype, f" for a table of {K} offsets and features of {c_in} channels")
    c_out = int(weight.shape[2])
    if c_in == 0 or c_out == 0 or K == 0:
        raise ValueError(f"empty convolution: K={K}, C_in={c_in}, C_out={c_out}; all must be >= 1")
    cv.check_init(init, n_out, c_out, features.dtype)
    return K, n_out, c_in, c_out


def _check_skip(skip, K):
    if isinstance(skip, bool) or not isinstance(skip, (int, np.integer)) or not -1 <= skip < K:
        raise ValueError(f"skip must be an offset index 0..{K - 1}, or -1 for none, got {skip!r}")
    return int(skip)


def _check_rows(table, n_in):
    """Every entry is -1 or a row of the features (a full read: reference only)."""
    t = to_host(table)
    if t.size and (t.max() >= n_in or t.min() < -1):
        raise ValueError(
            f"table holds rows {int(t.min())}..{int(t.max())} but features has {n_in} rows: entries must be "
            "-1 or an input row; pass the features in map order (features[km.in_order]) of this map")


# ------------------------------------------------------------------ reference
def implicit_gemm_reference(features, weight, table, init=None, skip=-1):
    """NumPy: ``out = init + sum over k != skip of features[table[k]] @ W[k]`` on the
    rows with a pair, in float32 (fp16 inputs widened; float64 for float64), rounded once
    to the dtype."""
    K, n_out, _, c_out = check_inputs(features, weight, table, init, backend="reference")
    skip = _check_skip(skip, K)
    features, weight, table = to_host(features), to_host(weight), to_host(table)
    _check_rows(table, features.shape[0])
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


# ------------------------------------------------------------------ the plan
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


def split_bounds(K: int, splits: int) -> tuple:
    """Offsets ``0..K-1`` cut into ``splits`` contiguous ranges of near-equal size."""
    return tuple((s * K // splits, (s + 1) * K // splits) for s in range(splits))


def _split_select(K: int, bounds) -> np.ndarray:
    """int64 (splits, words): the bits of each split's offsets."""
    sel = np.zeros((len(bounds), mask_words(K)), dtype=np.int64)
    for s, (k0, k1) in enumerate(bounds):
        for k in range(k0, k1):
            sel[s, k // MASK_BITS] |= np.int64(1) << (k % MASK_BITS)
    return sel


def _device_select(K, bounds, s):
    """Split ``s``'s offset bits on the current device, copied there once per layer
    shape (a copy to the device costs the host as much as a launch)."""
    return _device_select_on(K, bounds, s, device_id())


@lru_cache(maxsize=64)
def _device_select_on(K, bounds, s, device):
    return to_device(_split_select(K, bounds)[s])


def _split_words(k0: int, k1: int) -> range:
    """The mask words that hold offsets k0..k1-1, least significant first."""
    return range(k0 // MASK_BITS, (k1 - 1) // MASK_BITS + 1)


def _check_plan_args(table, splits, skip, tile_m):
    if not cv.is_array(table) or table.dtype != np.int32 or table.ndim != 2:
        got = f"{getattr(table, 'dtype', type(table).__name__)} {tuple(getattr(table, 'shape', ()))}"
        raise TypeError(f"table must be an int32 array of shape (K, n_out) (KernelMap.table), got {got}")
    K = int(table.shape[0])
    if K == 0:
        raise ValueError("table has no offsets (K = 0)")
    if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or not 1 <= splits <= K:
        raise ValueError(f"splits must be an int from 1 to K = {K}, got {splits!r}")
    tile_m = default_tile_m() if tile_m is None else tile_m
    if tile_m not in TILE_M_CHOICES:
        raise ValueError(f"tile_m must be one of {TILE_M_CHOICES} (or None for {default_tile_m()}), "
                         f"got {tile_m!r}")
    return K, int(splits), _check_skip(skip, K), int(tile_m)


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
    K, splits, skip, tile_m = _check_plan_args(table, splits, skip, tile_m)
    table = to_host(table)
    n_out = table.shape[1]
    masks = output_masks_reference(table, skip)
    bounds = split_bounds(K, splits)
    select = _split_select(K, bounds)
    n_tiles = -(-n_out // tile_m)
    order = np.empty((splits, n_out), dtype=np.int32)
    tiles = np.zeros((splits, mask_words(K), n_tiles), dtype=np.int64)
    for s, (k0, k1) in enumerate(bounds):
        keys = masks & select[s][:, None]
        # np.lexsort sorts by its last key first: the most significant word
        order[s] = np.lexsort(keys[list(_split_words(k0, k1))])
        padded = np.zeros((keys.shape[0], n_tiles * tile_m), dtype=np.int64)
        padded[:, :n_out] = keys[:, order[s]]
        tiles[s] = np.bitwise_or.reduce(padded.reshape(keys.shape[0], n_tiles, tile_m), axis=2)
    return ImplicitPlan(order, tiles, bounds, skip, tile_m, K, n_out)


@cuda.jit
def output_masks_kernel(table, skip, masks):
    """One thread per output: its mask words (neighbouring threads read neighbouring
    entries of each table row)."""
    i = cuda.grid(1)
    if i < table.shape[1]:
        K = table.shape[0]
        for w in range(masks.shape[0]):
            word = int64(0)
            for b in range(MASK_BITS):
                k = w * MASK_BITS + b
                if k < K and k != skip and table[k, i] >= 0:
                    word |= int64(1) << b
            masks[w, i] = word


@cuda.jit
def tile_masks_kernel(masks, order, select, tile_m, tile_masks):
    """One thread per (mask word, tile): the OR of the word over the tile's rows in
    sorted order, restricted to the split's offsets."""
    t = cuda.grid(1)
    n_tiles = tile_masks.shape[1]
    if t < tile_masks.shape[0] * n_tiles:
        w = t // n_tiles
        tile = t - w * n_tiles
        first = tile * tile_m
        last = min(first + tile_m, order.shape[0])
        acc = int64(0)
        for j in range(first, last):
            acc |= masks[w, order[j]]
        tile_masks[w, tile] = acc & select[w]


def implicit_plan(table, splits=1, skip=-1, tile_m=None) -> ImplicitPlan:
    """The device plan: masks by :func:`output_masks_kernel`, a stable library sort
    per split (least significant word first, so the words sort lexicographically),
    tile masks by :func:`tile_masks_kernel`. Arrays on the device side; equal to
    :func:`implicit_plan_reference` (a stable sort has one answer)."""
    K, splits, skip, tile_m = _check_plan_args(table, splits, skip, tile_m)
    xp = device_xp()
    table = to_device(table)
    n_out = int(table.shape[1])
    W = mask_words(K)
    bounds = split_bounds(K, splits)
    n_tiles = -(-n_out // tile_m)
    masks = xp.empty((W, n_out), dtype=np.int64)
    order = xp.empty((splits, n_out), dtype=np.int32)
    tiles = xp.empty((splits, W, n_tiles), dtype=np.int64)  # tile_masks_kernel writes every entry
    launch(output_masks_kernel, n_out, table, skip, masks)
    for s, (k0, k1) in enumerate(bounds):
        d_select = _device_select(K, tuple(bounds), s)
        perm = None
        for w in _split_words(k0, k1):  # an LSD sort on words: each pass stable
            key = masks[w] & d_select[w]
            if perm is not None:
                key = key[perm]
            step = xp.argsort(key, kind="stable") if xp is np else xp.argsort(key)
            perm = step if perm is None else perm[step]
        order[s] = perm
        launch(tile_masks_kernel, W * n_tiles, masks, order[s], d_select, tile_m, tiles[s])
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


@cache
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


@cache
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


class TensorTiles(NamedTuple):
    """The shape one v4 kernel is compiled for (besides the plan's ``tile_m``)."""

    tile_n: int  # output channels per block: 16, 32 or 64
    tile_k: int  # input channels per shared-memory chunk: 16 or 32 (one or two mma steps)
    a_vec: int  # fp16 values per global load of a neighbour row: 1, 2 or 4 (divides C_in)
    b_vec: int  # fp16 values per global load of a weight row: 1, 2 or 4 (divides C_out)


_WORDS = {1: np.uint16, 2: np.uint32, 4: np.uint64}  # fp16 values per load -> the word moved


def _vec(channels: int) -> int:
    """The widest load (4, 2 or 1 fp16 values) that divides ``channels``."""
    return 4 if channels % 4 == 0 else 2 if channels % 2 == 0 else 1


def tensor_tiles(c_in: int, c_out: int) -> TensorTiles:
    """v4's tile shape for these channel counts: ``tile_n`` as v3's (a power of two,
    16 to 64), chunks of 16 input channels up to ``C_in = 16``, else 32."""
    return TensorTiles(min(64, max(16, _pow2_at_least(c_out))), 16 if c_in <= 16 else 32, _vec(c_in), _vec(c_out))


def v4_shape(tile_m: int, tile_n: int) -> tuple:
    """``(warps_m, warps_n, mi, ni)``: v4's block of ``tile_m x tile_n`` outputs as a grid
    of warps (at most four), each owning ``16 mi`` rows by ``8 ni`` columns, a grid of
    ``mi x ni`` mma tiles. ``tile_m = 64``: 2 x 2 warps of 32 x 32 for 64 columns, 4 x 1
    warps of 16 x 32 (or 16 x 16) for 32 (or 16)."""
    warps_n = max(1, tile_n // 32)
    warps_m = max(1, min(tile_m // 16, 4 // warps_n))
    return warps_m, warps_n, tile_m // warps_m // 16, tile_n // warps_n // 8


@cache
def implicit_gemm_v4(tile_m: int, tile_n: int, tile_k: int, a_vec: int, b_vec: int):
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
    """
    warps_m, warps_n, mi, ni = v4_shape(tile_m, tile_n)
    threads = 32 * warps_m * warps_n
    wm, wn = 16 * mi, 8 * ni  # the warp tile
    word_a, word_b = from_dtype(_WORDS[a_vec]), from_dtype(_WORDS[b_vec])
    kw_a, kw_b = tile_k // a_vec, tile_n // b_vec  # words of a chunk's row, of a weight row
    a_pitch, b_pitch = tile_k + 8, tile_n + 8  # fp16 values a shared row (+8: see the docstring)
    a_pitch_w, b_pitch_w = a_pitch // a_vec, b_pitch // b_vec
    a_shared, b_shared = tile_m * a_pitch_w, tile_k * b_pitch_w  # words of the shared tiles
    n_acc = 4 * mi * ni  # a lane's results
    if tile_k % 16 or (tile_m * kw_a) % threads:
        raise ValueError(f"v4 tile ({tile_m}, {tile_n}, {tile_k}) with loads of {a_vec} values is not supported: "
                         f"tile_k must be a multiple of 16 and the {threads} threads must split the row tile evenly")
    a_loads = tile_m * kw_a // threads  # words of the row tile each thread loads per chunk
    b_size = tile_k * kw_b
    b_loads = -(-b_size // threads)
    k_steps = tile_k // 16  # mma steps a chunk
    mma = warp_mma(mi, ni)  # the C++ (GPU only)

    @cuda.jit(device=True, inline=True)
    def load_rows(fw, srcs, c0w, tid, a_reg):
        """This thread's words of the chunk's row tile: word ``e = tid + threads * r`` is
        row slot ``e // kw_a``, word ``e % kw_a`` (neighbouring threads, neighbouring words)."""
        c_in_w = fw.shape[1]
        for r in range(a_loads):
            w = (tid + threads * r) % kw_a
            v = word_a(0)  # (all bits zero: fp16 +0.0)
            if srcs[r] >= 0 and c0w + w < c_in_w:
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

    @cuda.jit
    def implicit(fw, ww, table, order, tile_masks, k0, k1, base, has_base, out):
        """``fw``: the features as words (n_in, C_in / a_vec); ``ww``: the weights as
        words (K, C_in, C_out / b_vec); the rest as in v3."""
        tid = cuda.threadIdx.x
        n_out, c_out, c_in_w = out.shape[0], out.shape[1], fw.shape[1]
        tiles_n = (c_out + tile_n - 1) // tile_n
        tm = cuda.blockIdx.x // tiles_n
        m0 = tm * tile_m
        n0 = (cuda.blockIdx.x - tm * tiles_n) * tile_n
        a_s = cuda.shared.array(a_shared, word_a, alignment=16)  # [row slot][channel], fp16 bits
        b_s = cuda.shared.array(b_shared, word_b, alignment=16)  # [channel][output channel]
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
                if c0w == 0:
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
                    load_rows(fw, srcs, c0w + kw_a, tid, a_reg)
                    load_weights(ww, k, (c0w + kw_a) * a_vec, n0 // b_vec, tid, b_reg)
                mma(data_pointer(acc), data_pointer(a_s), data_pointer(b_s), int32(a_pitch), int32(b_pitch),
                    int32(row0), int32(col0), int32(k_steps))
                cuda.syncthreads()
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

    return implicit


def _check_plan(plan, K, n_out):
    if not isinstance(plan, ImplicitPlan):
        raise TypeError(f"plan must be an ImplicitPlan (implicit_plan(table)), got {type(plan).__name__}")
    if (plan.kernel_volume, plan.n_out) != (K, n_out):
        raise ValueError(f"plan was made for a table of shape ({plan.kernel_volume}, {plan.n_out}), this "
                         f"table is ({K}, {n_out}): build it with implicit_plan(table) for this map")


# v4 runs where it was measured faster than v3: fp16 layers with at least this many
# channels in and out. Measured on the ladder's SemanticKITTI layer, C -> C, at
# 4, 8, 16, 24, 32, 64, 96 and 128 channels: benchmarks/results/implicit_v4_channels.json
# (v4 behind v3 at 4 channels, ahead from 8 on).
TENSOR_CORE_MIN_CHANNELS = 8


@cache
@cache
def tensor_cores_here() -> bool:
    """Whether this process's kernels can run v4: a GPU (not the simulator) of compute
    capability 8.0 or later (the first with ``mma.m16n8k16`` in fp16), unless
    ``NUMBA_SC_TENSOR_CORES=0`` turns the rung off (to compare with v3, or to rule it
    out while debugging). Asked once per process: every layer call would otherwise pay
    a driver query (one process drives one GPU, as ``numba_sc.train.parallel`` does)."""
    if os.environ.get("NUMBA_SC_TENSOR_CORES", "1") == "0":
        return False
    return not simulating() and tuple(cuda.get_current_device().compute_capability) >= (8, 0)


def library_rung(dtype, c_in: int, c_out: int) -> str:
    """The rung :func:`implicit_gemm_cuda` runs: ``"v4"`` (tensor cores) for fp16 on a
    GPU that has them, with at least :data:`TENSOR_CORE_MIN_CHANNELS` channels in
    and out; ``"v3"`` for fp32, narrower layers and under the simulator, which
    cannot run v4's linked C++."""
    if np.dtype(dtype) != np.float16 or min(c_in, c_out) < TENSOR_CORE_MIN_CHANNELS:
        return "v3"
    return "v4" if tensor_cores_here() else "v3"


def _run_splits(kernel, f, w, t, plan, init, c_out, out_dtype, threads, blocks):
    """One launch of ``kernel`` per mask split of ``plan`` (v3 and v4 alike); the output
    is ``(n_out, c_out)`` of ``out_dtype``, on the device side."""
    xp = device_xp()
    n_out = plan.n_out
    out = xp.empty((n_out, c_out), dtype=out_dtype)
    if n_out == 0:
        return out
    base = to_device(init)
    # Between splits the running sum stays in float32 (fp16: one rounding at the end).
    running = out if (out.dtype == np.float32 or plan.splits == 1) else xp.empty((n_out, c_out), np.float32)
    order, tile_masks = to_device(plan.order), to_device(plan.tile_masks)
    for s, (k0, k1) in enumerate(plan.bounds):
        last = s == plan.splits - 1
        src = running if s > 0 else (base if base is not None else out)
        dst = out if last else running
        launch(kernel, 1, f, w, t, order[s], tile_masks[s], k0, k1, src, s > 0 or base is not None, dst,
               threads=threads, blocks=blocks)
    return out


def _implicit_v3(f, w, t, plan, init, tiles: Tiles | None = None):
    """v3 on device arrays (checked by the caller)."""
    c_in, c_out = int(f.shape[1]), int(w.shape[2])
    tiles = tiles or implicit_tiles(plan.tile_m, c_in, c_out)
    threads = (plan.tile_m // tiles.thread_m) * (tiles.tile_n // tiles.thread_n)
    blocks = plan.n_tiles * _cdiv(c_out, tiles.tile_n)
    return _run_splits(implicit_gemm_v3(plan.tile_m, *tiles), f, w, t, plan, init, c_out, f.dtype, threads,
                       blocks)


def _implicit_v4(f, w, t, plan, init, tiles: TensorTiles | None = None):
    """v4 on device arrays (checked by the caller): GPU and fp16 only."""
    check_gpu("implicit_gemm v4")
    if f.dtype != np.float16:
        raise TypeError(f"implicit_gemm v4 multiplies fp16 on tensor cores; features are {f.dtype}: "
                        "pass float16 features and weights, or run v3 (implicit_gemm_cuda picks it for fp32)")
    c_in, c_out = int(f.shape[1]), int(w.shape[2])
    tiles = tiles or tensor_tiles(c_in, c_out)
    warps_m, warps_n, _, _ = v4_shape(plan.tile_m, tiles.tile_n)
    blocks = plan.n_tiles * _cdiv(c_out, tiles.tile_n)
    # the loads move whole words of a_vec (b_vec) fp16 values: the same memory, viewed
    fw = f.view(_WORDS[tiles.a_vec])
    ww = w.view(_WORDS[tiles.b_vec])
    return _run_splits(implicit_gemm_v4(plan.tile_m, *tiles), fw, ww, t, plan, init, c_out, f.dtype,
                       32 * warps_m * warps_n, blocks)


def implicit_gemm_cuda(features, weight, table, plan, init=None, *, tiles: Tiles | TensorTiles | None = None):
    """Device version, the library's: one launch per mask split of ``plan`` of
    :func:`implicit_gemm_v4` (tensor cores) or :func:`implicit_gemm_v3`, as
    :func:`library_rung` picks. Returns the (n_out, C_out) output, of the
    features' dtype and on the device side; ``init`` is read, never modified.

    ``tiles`` overrides the tile shape (for tuning): a :class:`Tiles` runs v3 with
    it, a :class:`TensorTiles` v4.
    """
    K, n_out, c_in, c_out = check_inputs(features, weight, table, init)
    _check_plan(plan, K, n_out)
    f, w, t = to_device(features), to_device(weight), to_device(table)
    if isinstance(tiles, TensorTiles) or (tiles is None and library_rung(f.dtype, c_in, c_out) == "v4"):
        return _implicit_v4(f, w, t, plan, init, tiles)
    if tiles is not None and not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a Tiles (v3), a TensorTiles (v4) or None, got {type(tiles).__name__}")
    return _implicit_v3(f, w, t, plan, init, tiles)


def implicit_gemm_rung(rung: str, features, weight, table, plan, init=None):
    """Run one rung of the ladder (``"v1"`` .. ``"v4"``); returns the (n_out, C_out)
    output on the device side. v1 and v2 read only the plan's ``skip``. v4 runs on
    a GPU only, and for fp32 data it is v3 (the library keeps fp32 there)."""
    names = tuple(r.name for r in LADDER.declared)
    if rung not in names:
        raise ValueError(f"rung must be one of {names}, got {rung!r}")
    K, n_out, _, c_out = check_inputs(features, weight, table, init)
    _check_plan(plan, K, n_out)
    f, w, t = to_device(features), to_device(weight), to_device(table)
    if rung == "v4":
        check_gpu("implicit_gemm v4")
        return (_implicit_v4 if f.dtype == np.float16 else _implicit_v3)(f, w, t, plan, init)
    if rung == "v3":
        return _implicit_v3(f, w, t, plan, init)
    out = device_xp().empty((n_out, c_out), dtype=f.dtype)
    if n_out == 0:
        return out
    base = to_device(init) if init is not None else out
    if rung == "v1":
        launch(implicit_gemm_v1, n_out * c_out, f, w, t, plan.skip, base, init is not None, out)
    else:
        tm, tn, tk = SIM_V2_TILE if simulating() else GPU_V2_TILE
        blocks = _cdiv(n_out, tm) * _cdiv(c_out, tn)
        launch(implicit_gemm_v2(tm, tn, tk), 1, f, w, t, plan.skip, base, init is not None, out,
               threads=tm * tn, blocks=blocks)
    return out


# -------------------------------------------------------------------- the ladder
# A whole 3x3x3 submanifold layer outside the centre, added onto ``init`` (the
# centre product): float sums in another order than the reference's, so a tolerance.
def _ladder_work(ctx):
    layer = ctx.layer()
    plan = ctx.memo("implicit_plan", lambda: implicit_plan(layer["km"].table, skip=layer["centre"]))
    return dict(layer, implicit_plan=plan)


def _rung(name, adds, gpu_only=False):
    return Rung(name, lambda w: implicit_gemm_rung(name, w["features"], w["weight"], w["km"].table,
                                                   w["implicit_plan"], w["init"]), adds, gpu_only)


LADDER = Ladder(
    "implicit_gemm",
    (_rung("v1", "one thread per (output, output channel) over every offset and input channel"),
     _rung("v2", "+ shared-memory tiles of the gathered rows and of W[k]"),
     _rung("v3", "+ outputs sorted by offset mask, tiles skip absent offsets, a register tile (the library's "
                 "in fp32)"),
     _rung("v4", "+ the tile's multiply-accumulate on tensor cores (mma in linked CUDA C++; fp16 only, "
                 "fp32 runs v3; the library's in fp16)", gpu_only=True)),
    workload=_ladder_work,
    reference=lambda w: implicit_gemm_reference(to_host(w["features"]), to_host(w["weight"]),
                                                to_host(w["km"].table), to_host(w["init"]), w["centre"]),
    tolerance={"float32": 1e-5, "float16": 2e-3},
)
