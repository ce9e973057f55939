"""The implicit GEMM's shapes: tile sizes per machine and channel count, the checks of
its arguments, and the launcher of one kernel per mask split.

Kept below the lesson (:mod:`numba_sc.dataflows.implicit_gemm`), which compiles its
kernels for these tiles, and its driver (:mod:`numba_sc.dataflows.implicit_driver`).
A kernel is compiled per tile shape (shared and register arrays need their sizes
at compile time); the shape follows the channel counts: ``C_out = 16`` gets 16-wide
tiles, not 64 of which 48 are zeros, ``C_in = 3`` chunks of 4.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import from_dtype, types

from ..core import conventions as cv
from ..core.backend import to_device, to_host
from ..core.device import device_xp, simulating
from ..core.launch import launch

TILE_M_CHOICES = (16, 32, 64, 128)  # outputs per tile (the plan's tile_m)

# Tile sizes, within these bounds. The simulator runs one Python thread per CUDA thread, so it gets small
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(x: int) -> int:
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
    tile_n = min(n_hi, max(n_lo, pow2_at_least(c_out)))
    tile_k = min(k_hi, max(k_lo, pow2_at_least(c_in)))
    return Tiles(tile_n, tile_k, min(th_m, tile_m), min(th_n, tile_n))



class TensorTiles(NamedTuple):
    """The shape one v4 kernel is compiled for (besides the plan's ``tile_m``)."""

    tile_n: int  # output channels per block: 16, 32 or 64
    tile_k: int  # input channels per shared-memory chunk: 16 or 32 (one or two mma steps)
    a_vec: int  # fp16 values per global load of a neighbour row: 1, 2 or 4 (divides C_in)
    b_vec: int  # fp16 values per global load of a weight row: 1, 2 or 4 (divides C_out)


WORDS = {1: np.uint16, 2: np.uint32, 4: np.uint64}  # fp16 values per load -> the word moved


def vec(channels: int) -> int:
    """The widest load (4, 2 or 1 fp16 values) that divides ``channels``."""
    return 4 if channels % 4 == 0 else 2 if channels % 2 == 0 else 1


def tensor_tiles(c_in: int, c_out: int) -> TensorTiles:
    """v4's tile shape for these channel counts: ``tile_n`` as v3's (a power of two,
    16 to 64), chunks of 16 input channels up to ``C_in = 16``, else 32."""
    return TensorTiles(min(64, max(16, pow2_at_least(c_out))), 16 if c_in <= 16 else 32, vec(c_in), vec(c_out))


def v4_shape(tile_m: int, tile_n: int) -> tuple:
    """``(warps_m, warps_n, mi, ni)``: v4's block of ``tile_m x tile_n`` outputs as a grid
    of warps (at most four), each owning ``16 mi`` rows by ``8 ni`` columns, a grid of
    ``mi x ni`` mma tiles. ``tile_m = 64``: 2 x 2 warps of 32 x 32 for 64 columns, 4 x 1
    warps of 16 x 32 (or 16 x 16) for 32 (or 16)."""
    warps_n = max(1, tile_n // 32)
    warps_m = max(1, min(tile_m // 16, 4 // warps_n))
    return warps_m, warps_n, tile_m // warps_m // 16, tile_n // warps_n // 8


def tensor_core_signature(tiles: TensorTiles) -> tuple:
    """The argument types of a v4 or v5 kernel with these tiles, to compile it without
    launching it (``numba.cuda.compile_ptx``, or LTO-IR to link with ``mma.cu``): the
    features and weights as words (:data:`WORDS`), the table, one split's order and
    tile masks, its offsets ``k0, k1``, ``base``, ``has_base`` and the fp16 output."""
    def array(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    return (array(from_dtype(WORDS[tiles.a_vec]), 2), array(from_dtype(WORDS[tiles.b_vec]), 3),
            array(types.int32, 2), array(types.int32, 1), array(types.uint32, 2), types.int64, types.int64,
            array(types.float16, 2), types.boolean, array(types.float16, 2))


def v5_tiles(c_in: int, c_out: int) -> TensorTiles:
    """v5's tile shape: v4's, with blocks up to 128 output channels wide."""
    return TensorTiles(min(128, max(16, pow2_at_least(c_out))), 16 if c_in <= 16 else 32, vec(c_in), vec(c_out))


def v5_shape(tile_m: int, tile_n: int) -> tuple:
    """``(warps_m, warps_n, mi, ni)``: v5's block of ``tile_m x tile_n`` outputs as warps
    of 32 x 32 (``mi = 2``, ``ni = 4``), or of the block's own height or width where it is
    smaller (16 rows, 16 columns). ``64 x 128``: 2 x 4 warps; ``64 x 64``: 2 x 2."""
    mi, ni = min(2, tile_m // 16), min(4, tile_n // 8)
    return tile_m // (16 * mi), tile_n // (8 * ni), mi, ni



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


def check_skip(skip, K):
    if isinstance(skip, bool) or not isinstance(skip, (int, np.integer)) or not -1 <= skip < K:
        raise ValueError(f"skip must be an offset index 0..{K - 1}, or -1 for none, got {skip!r}")
    return int(skip)


def check_rows(table, n_in):
    """Every entry is -1 or a row of the features (a full read: reference only)."""
    t = to_host(table)
    if t.size and (t.max() >= n_in or t.min() < -1):
        raise ValueError(
            f"table holds rows {int(t.min())}..{int(t.max())} but features has {n_in} rows: entries must be "
            "-1 or an input row; pass the features in map order (features[km.in_order]) of this map")



def check_plan_args(table, splits, skip, tile_m):
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
    return K, int(splits), check_skip(skip, K), int(tile_m)



# ------------------------------------------------------------------ the launches
def run_splits(kernel, f, w, t, plan, init, c_out, out_dtype, threads, blocks):
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
