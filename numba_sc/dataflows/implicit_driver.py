"""The implicit GEMM as the library runs it: the plan built on the device, the rung
each layer runs, and its launcher.

The lesson, :mod:`numba_sc.dataflows.implicit_gemm`, teaches the dataflow and its
rungs with NumPy references (its :func:`~numba_sc.dataflows.implicit_gemm.implicit_plan_reference`
among them); this module holds what the library adds around them: :func:`implicit_plan`
(the same plan from two kernels and a library sort, no device-to-host read),
:func:`library_rung` (v4 on tensor cores for fp16 where it was measured faster, else
v3) and :func:`implicit_gemm_cuda`; :func:`implicit_gemm_rung` runs any rung.

Worked example: a 3x3x3 layer, 4 -> 16 fp32, given its map: ``implicit_plan(km.table,
skip=centre)`` once per map (kept on it by :mod:`numba_sc.conv.dataflow`), then one
launch of v3 per call, ``implicit_gemm_cuda(f, w, km.table, plan, init)``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ..core.backend import to_device
from ..core.conventions import MASK_BITS, mask_words
from ..core.device import device_id, device_xp, simulating
from ..core.launch import launch
from ..core.state import STATE, cached
from .implicit_gemm import (LADDER, RUNS, ImplicitPlan, check_plan, run_v3, run_v4, split_bounds, split_select,
                            split_words)
from .implicit_shapes import TensorTiles, Tiles, check_inputs, check_plan_args


# ------------------------------------------------------------------ the plan
def _device_select(K, bounds, s):
    """Split ``s``'s offset bits on the current device, copied there once per layer
    shape (a copy to the device costs the host as much as a launch)."""
    return _device_select_on(K, bounds, s, device_id())


@cached(maxsize=64)
def _device_select_on(K, bounds, s, device):
    return to_device(split_select(K, bounds)[s])



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
    K, splits, skip, tile_m = check_plan_args(table, splits, skip, tile_m)
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
        for w in split_words(k0, k1):  # an LSD sort on words: each pass stable
            key = masks[w] & d_select[w]
            if perm is not None:
                key = key[perm]
            step = xp.argsort(key, kind="stable") if xp is np else xp.argsort(key)
            perm = step if perm is None else perm[step]
        order[s] = perm
        launch(tile_masks_kernel, W * n_tiles, masks, order[s], d_select, tile_m, tiles[s])
    return ImplicitPlan(order, tiles, bounds, skip, tile_m, K, n_out)



# ------------------------------------------------------------ the library's rung
# v4 runs where it was measured faster than v3: fp16 layers with at least this many
# channels in and out. Measured on the ladder's SemanticKITTI layer, C -> C, at
# 4, 8, 16, 24, 32, 64, 96 and 128 channels: benchmarks/results/implicit_v4_channels.json
# (v4 behind v3 at 4 channels, ahead from 8 on).
TENSOR_CORE_MIN_CHANNELS = 8


@cached
def tensor_cores_here() -> bool:
    """Whether this process's kernels can run v4: a GPU of compute capability 8.0 or
    later (the first with ``mma.m16n8k16`` in fp16), or the simulator (which runs the
    mma's Python stand-in, so that it steps through what a GPU runs), unless
    ``NUMBA_SC_TENSOR_CORES=0`` turns the rung off (to compare with v3, or to rule it
    out while debugging). Asked once per process: every layer call would otherwise pay
    a driver query (one process drives one GPU, as ``numba_sc.train.parallel`` does)."""
    if not STATE.switch("tensor_cores"):
        return False
    return simulating() or tuple(cuda.get_current_device().compute_capability) >= (8, 0)


def library_rung(dtype, c_in: int, c_out: int) -> str:
    """The rung :func:`implicit_gemm_cuda` runs: ``"v4"`` (tensor cores) for fp16 on a
    GPU that has them, with at least :data:`TENSOR_CORE_MIN_CHANNELS` channels in
    and out (on a GPU that has them, or under the simulator); ``"v3"`` for fp32 and
    narrower layers."""
    if np.dtype(dtype) != np.float16 or min(c_in, c_out) < TENSOR_CORE_MIN_CHANNELS:
        return "v3"
    return "v4" if tensor_cores_here() else "v3"


def implicit_gemm_cuda(features, weight, table, plan, init=None, *, tiles: Tiles | TensorTiles | None = None):
    """Device version, the library's: one launch per mask split of ``plan`` of
    :func:`implicit_gemm_v4` (tensor cores) or :func:`implicit_gemm_v3`, as
    :func:`library_rung` picks. Returns the (n_out, C_out) output, of the
    features' dtype and on the device side; ``init`` is read, never modified.

    ``tiles`` overrides the tile shape (for tuning): a :class:`Tiles` runs v3 with
    it, a :class:`TensorTiles` v4.
    """
    K, n_out, c_in, c_out = check_inputs(features, weight, table, init)
    check_plan(plan, K, n_out)
    f, w, t = to_device(features), to_device(weight), to_device(table)
    if isinstance(tiles, TensorTiles) or (tiles is None and library_rung(f.dtype, c_in, c_out) == "v4"):
        return run_v4(f, w, t, plan, init, tiles)
    if tiles is not None and not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a Tiles (v3), a TensorTiles (v4) or None, got {type(tiles).__name__}")
    return run_v3(f, w, t, plan, init, tiles)


def implicit_gemm_rung(rung: str, features, weight, table, plan, init=None):
    """Run one rung of the ladder (``"v1"`` .. ``"v4"``); returns the (n_out, C_out)
    output on the device side. v1 and v2 read only the plan's ``skip``. v4 runs its
    tile products on the tensor cores of a GPU, under the simulator on their Python
    stand-in (:func:`numba_sc.dataflows.tensor_cores.emulated_warp_mma`); for fp32
    data it is v3 (the library keeps fp32 there)."""
    names = tuple(r.name for r in LADDER.declared)
    if rung not in names:
        raise ValueError(f"rung must be one of {names}, got {rung!r}")
    K, n_out, _, c_out = check_inputs(features, weight, table, init)
    check_plan(plan, K, n_out)
    f, w, t = to_device(features), to_device(weight), to_device(table)
    return RUNS[rung](f, w, t, plan, init)
