"""The Map step's second alternative: a dense location table over the bounding box.

The embedded-CUDA paper (``sparse-conv-cuda-embedded.txt``) drops the hashing
altogether: allocate one int32 per voxel of the cloud's bounding box, write
each input's index at its voxel (-1 elsewhere), and a lookup becomes one array
read. ``build_kernel_map(..., method="grid")``.

The grid
    ``lo`` is the smallest (x, y, z) of the inputs and ``dims = hi - lo + 1``
    the box's size; with batches, one box per batch index, stacked. The cell of
    ``(b, x, y, z)`` is::

        ((b * X + (x - x0)) * Y + (y - y0)) * Z + (z - z0)

    A query outside the box (a neighbour beyond the cloud's edge) is a miss
    without a read.

The price is memory, and the time to clear it: one int32 per cell of the box,
all set to -1 before the inputs are written. A ScanNet room at 2 cm is about
400 x 400 x 150 = 24M cells (96 MB); a SemanticKITTI scan at 5 cm spans about
3200 x 3200 x 120 = 1.2e9 cells (5 GB) for 94k voxels, which is why the paper
meant it for small, bounded scenes. Grids of more than :data:`MAX_CELLS` cells
are refused with an error that says so.

The box needs one read from the device (its size decides the allocation),
which the sorted and hashed maps do not: a sync in the middle of the step.

Worked example, one axis, inputs ``[3, 4, 7]``: ``lo = 3``, ``dims = 5``, grid
``[0, 1, -1, -1, 2]``; looking up 6 reads cell 3 (-1: no input), 8 is outside
the box (a miss without a read).

The probing itself is shared with the hash table: :mod:`numba_sc.map.map_probe`.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ..core import conventions as cv
from ..core.device import device_xp
from ..core.backend import filled, to_host
from ..core.launch import launch

MAX_CELLS = 1 << 28  # 1 GiB of int32: beyond that, use method="sorted" or "hash"
BOX_WORDS = 8  # box: [x0, y0, z0, X, Y, Z, batches, cells]


def _box_from_extremes(lo, hi, batches, n):
    """(int64 box array, cells) from per-axis extremes; refuses boxes over MAX_CELLS."""
    dims = [int(h) - int(l) + 1 for l, h in zip(lo, hi)]
    cells = int(batches) * dims[0] * dims[1] * dims[2]
    if cells > MAX_CELLS:
        raise ValueError(
            f"method='grid' needs a location table of {cells:,} cells (bounding box "
            f"{dims[0]} x {dims[1]} x {dims[2]} voxels x {batches} batch(es)) for {n:,} inputs, over the "
            f"limit of {MAX_CELLS:,} (numba_sc.map.grid_map.MAX_CELLS); use method='sorted' or method='hash'")
    return np.array([*[int(v) for v in lo], *dims, int(batches), cells], np.int64), cells


# ------------------------------------------------------------------ reference
def grid_box_reference(coords):
    """The box of (N, 3|4) coordinates: ``(box, cells)`` (see BOX_WORDS)."""
    c = np.asarray(coords)
    s = c.shape[1] - 3
    if len(c) == 0:
        return _box_from_extremes((0, 0, 0), (0, 0, 0), 1, 0)
    batches = int(c[:, 0].max()) + 1 if s else 1
    return _box_from_extremes(c[:, s:].min(axis=0), c[:, s:].max(axis=0), batches, len(c))


def cells_reference(keys, box):
    """Cell of each packed key, or -1 outside the box (vectorized :func:`cell_device`)."""
    keys = np.asarray(keys, np.int64)
    b = keys >> cv.SHIFT_B
    xyz = [((keys >> sh) & cv.FIELD_MASK) - cv.COORD_BIAS - box[a]
           for a, sh in enumerate((cv.SHIFT_X, cv.SHIFT_Y, cv.SHIFT_Z))]
    inside = (b < box[6])
    for a in range(3):
        inside &= (xyz[a] >= 0) & (xyz[a] < box[3 + a])
    cell = ((b * box[3] + xyz[0]) * box[4] + xyz[1]) * box[5] + xyz[2]
    return np.where(inside, cell, -1)


def build_reference(keys, box):
    """The grid of sorted input keys: int32 (cells,), index at each input's cell, -1 elsewhere."""
    grid = np.full(int(box[7]), -1, np.int32)
    grid[cells_reference(keys, box)] = np.arange(len(keys), dtype=np.int32)
    return grid


def lookup_reference(grid, box, queries):
    """``(index or -1, reads)`` per query key: one read inside the box, none outside."""
    cell = cells_reference(queries, box)
    inside = cell >= 0
    found = np.full(len(cell), -1, np.int64)
    found[inside] = grid[cell[inside]]
    return found, inside.astype(np.int64)


# -------------------------------------------------------------------- kernels
@cuda.jit(device=True, inline=True)
def cell_device(box, key):
    """The cell of a packed key in the box, or -1 when it lies outside."""
    b = key >> cv.SHIFT_B
    x = cv.unpack_field_device(key, cv.SHIFT_X) - box[0]
    y = cv.unpack_field_device(key, cv.SHIFT_Y) - box[1]
    z = cv.unpack_field_device(key, cv.SHIFT_Z) - box[2]
    if b >= box[6] or x < 0 or x >= box[3] or y < 0 or y >= box[4] or z < 0 or z >= box[5]:
        return int64(-1)
    return ((b * box[3] + x) * box[4] + y) * box[5] + z


@cuda.jit(device=True, inline=True)
def lookup_device(grid, box, key):
    """One read: the index stored at the key's cell, or -1 (also outside the box)."""
    c = cell_device(box, key)
    return grid[c] if c >= 0 else -1


@cuda.jit
def extremes_kernel(coords, s, ext):
    """``ext`` = [-x0, -y0, -z0, x1, y1, z1, max batch] by atomics (min as max of the
    negation, so one zeroed-then-lowered array serves both). ``ext`` starts at
    the smallest int64 so any coordinate raises it."""
    i = cuda.grid(1)
    if i < coords.shape[0]:
        for a in range(3):
            v = int64(coords[i, s + a])
            cuda.atomic.max(ext, a, -v)
            cuda.atomic.max(ext, 3 + a, v)
        if s == 1:
            cuda.atomic.max(ext, 6, int64(coords[i, 0]))


@cuda.jit
def fill_kernel(keys, box, grid):
    """One thread per input: its index at its cell."""
    j = cuda.grid(1)
    if j < keys.shape[0]:
        c = cell_device(box, keys[j])
        if c >= 0:  # always, unless the row was out of range (reported by the pack kernel)
            grid[c] = j


def box_cuda(coords):
    """The box of device coordinates, by one kernel and one read: ``(box on the host, cells)``."""
    ext = device_xp().full(7, np.iinfo(np.int64).min, np.int64)
    s = coords.shape[1] - 3
    launch(extremes_kernel, coords.shape[0], coords, s, ext)
    e = to_host(ext)  # the sync this method cannot avoid: the box decides the allocation
    if coords.shape[0] == 0:
        return _box_from_extremes((0, 0, 0), (0, 0, 0), 1, 0)
    batches = int(e[6]) + 1 if s else 1
    if not 0 < batches <= cv.BATCH_MAX + 1:
        cv.raise_range_error(coords, (0, 0, 0), (0, 0, 0), "in_coords")
    cv.check_packable(-e[:3], e[3:6], name="in_coords")  # a range error first, not a size error
    return _box_from_extremes(-e[:3], e[3:6], batches, int(coords.shape[0]))


def build_cuda(keys, coords):
    """``(grid, box)`` on the device for sorted input keys and their coordinates."""
    box, cells = box_cuda(coords)
    grid = filled(max(cells, 1), np.int32, -1)
    d_box = device_xp().asarray(box)
    launch(fill_kernel, keys.shape[0], keys, d_box, grid)
    return grid, d_box
