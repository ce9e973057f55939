"""Stage 8, tiled gather (paper Algorithm 1): input features -> the input buffer.

Every input point feeds up to K outputs, each through a different offset, and
each of those pairs has its own row in the input buffer (the input table of
:mod:`numba_sc.metadata`). The gather copies the point's features into all of
those rows, ready for the grouped GEMMs.

Minuet's kernel gives one thread to each (channel tile, input point): the thread
loads ``T`` consecutive channels of the point into registers *once*, then walks
the point's K table entries and writes the tile to every buffer row it finds.
The tile size trades two costs (Section 5.2.1):

* every thread reads the K table entries of its point, so the table is read
  ``C_in / T`` times per point: a larger T reads it less often;
* there are ``|P| * C_in / T`` threads: a smaller T gives more parallelism,
  which a big GPU needs when the cloud is small.

Hence the autotuner (:mod:`numba_sc.autotune`) tries every divisor of C_in.

Worked example, ``C_in = 4``, ``T = 2``, input 0 with table row ``[1, -1, 6]``::

    thread (point 0, tile 0): v = F[0, 0:2]; buf[1, 0:2] = v; buf[6, 0:2] = v
    thread (point 0, tile 1): v = F[0, 2:4]; buf[1, 2:4] = v; buf[6, 2:4] = v

Napkin math, fp32: the features are read once (``4|P|C_in`` bytes), the table
``C_in/T`` times (``4|P|K * C_in/T``), and every pair's row is written once
(``4 * pairs * C_in``). A SemanticKITTI scan at 0.05 m (94,444 voxels) has
190k pairs outside the centre in a 3x3x3 layer, so at 64 channels the gather
reads 24 MB of features and 10 MB of table (with T = 8, each entry is requested
by the 8 tile threads of its point, in the warps of one block: one DRAM read,
7 cache hits) and writes 49 MB of buffer. A point with no pair outside the centre
has its features never read.

Padding rows of the buffer are not written: their GEMM results land in padding
rows of the output buffer, which the scatter never reads.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, float32

from .backend import device_xp, launch, resolve_backend, simulating, to_device


def check_tile(tile, channels, name="tile_size", what="channels"):
    """Raise a clear error unless ``tile`` is a positive divisor of ``channels``."""
    if not isinstance(tile, (int, np.integer)) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"{name} must be a positive int dividing the {what} ({channels}), got {tile!r}")
    if channels % tile:
        divs = divisors(channels)
        raise ValueError(
            f"{name}={tile} does not divide the {what} ({channels}); a tile covers whole "
            f"channels, so pick one of {divs} (or leave tile_size=None to autotune/heuristic)")
    return int(tile)


def divisors(n: int) -> list:
    """All divisors of n, ascending: the tile sizes Algorithm 2 tries."""
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ reference
def gather_reference(features, in_table, rows, tile=None):
    """NumPy version: for every valid (input, offset) entry, copy the row.

    ``tile`` changes nothing here (NumPy copies whole rows); it is accepted so
    that the two versions take the same arguments.
    """
    features = np.asarray(features)
    buf = np.zeros((rows, features.shape[1]), dtype=features.dtype)
    jj, kk = np.nonzero(in_table >= 0)
    buf[in_table[jj, kk]] = features[jj]
    return buf


# -------------------------------------------------------------------- kernels
WARP = 32  # points per slab: one warp's worth


def slab_threads(n_points: int, tiles: int) -> int:
    """Threads to launch for :func:`point_and_tile`: whole slabs of 32 points."""
    return -(-int(n_points) // WARP) * WARP * tiles


@cuda.jit(device=True, inline=True)
def point_and_tile(t, tiles):
    """Thread ``t`` -> (point, first channel of its tile index), in slabs of 32 points.

    A slab is 32 consecutive points times ``tiles`` tiles; inside it the point
    varies fastest, so the 32 lanes of a warp hold the same tile of 32
    neighbouring points. Then each read of table entry k by a warp is 128
    contiguous bytes of the offset-major table (tile-fastest, a warp of 8
    tiles x 4 points read 16 bytes per k: half of every sector wasted, measured
    1.5x slower on 1M points). The tiles of one point sit in other warps of the
    same block, so its feature row, read piecewise, still comes from L1.
    The point may be past the last one in the final slab: the caller checks.
    """
    per_slab = WARP * tiles
    slab = t // per_slab
    r = t - slab * per_slab
    return slab * WARP + r % WARP, r // WARP


@lru_cache(maxsize=None)
def gather_kernel(tile: int):
    """The gather kernel compiled for one tile size (a compile-time constant, so the
    tile lives in registers: ``cuda.local.array`` needs a constant length)."""

    @cuda.jit
    def gather(features, in_table, buf):
        """``in_table`` is offset-major here, (K, |P|): entry k of neighbouring
        points are neighbouring addresses (see :mod:`numba_sc.metadata`)."""
        p, j = point_and_tile(cuda.grid(1), features.shape[1] // tile)
        if p < features.shape[0]:
            c0 = j * tile  # this thread's channels: c0 .. c0 + tile - 1
            v = cuda.local.array(tile, float32)  # fp32 holds fp16 exactly: no rounding
            loaded = False
            for k in range(in_table.shape[0]):
                row = in_table[k, p]  # the same entry for all tiles of p (Algorithm 1, line 5)
                if row >= 0:
                    if not loaded:
                        # Load the tile only for a point that feeds some pair: in a
                        # sparse cloud most points have none outside the centre
                        # (about 2 in 3 of 1M random voxels in 400^3).
                        for c in range(tile):
                            v[c] = features[p, c0 + c]
                        loaded = True
                    for c in range(tile):
                        buf[row, c0 + c] = v[c]

    return gather


def gather_cuda(features, in_table, rows, tile):
    """Device version: one launch of :func:`gather_kernel` for all offsets."""
    xp = device_xp()
    f = to_device(features)
    # Padding rows stay unwritten on the GPU (saves a memset of the whole buffer).
    # Under the simulator they are zeroed, only so that NumPy never sees garbage
    # that could trip an overflow warning in the fp16 GEMM.
    buf = (xp.zeros if simulating() else xp.empty)((rows, f.shape[1]), dtype=f.dtype)
    if rows:
        # in_table is (|P|, K); the kernel wants its offset-major transpose. For a
        # plan's table (an (N, K) view of a (K, N) array) .T is that array itself.
        launch(gather_kernel(tile), slab_threads(f.shape[0], f.shape[1] // tile), f,
               to_device(xp.asarray(in_table).T), buf)
    return buf


def gather(features, in_table, rows, tile=1, backend=None):
    """Copy each input's features to its buffer rows; returns the (rows, C_in) buffer."""
    tile = check_tile(tile, features.shape[1], "tile_size", "input channels")
    if resolve_backend(backend) == "reference":
        return gather_reference(features, np.asarray(in_table), rows, tile)
    return gather_cuda(features, in_table, rows, tile)
