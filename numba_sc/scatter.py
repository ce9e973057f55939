"""Stage 10, tiled scatter: partial results in the output buffer -> output features.

After the GEMMs, output i has one partial result per offset it received a pair
through, each in its own row of the output buffer (the output table of
:mod:`numba_sc.metadata`). The scatter sums them::

    out[i] = init[i] + sum over k with out_table[i, k] >= 0 of obuf[out_table[i, k]]

where ``init`` is the submanifold centre's product ``F @ W[centre]`` (or zero).

One thread per (channel tile, output point), mirroring the gather: the thread
owns its tile of its output, accumulates its partial results in registers and
writes the tile once. No other thread touches that tile, so there are no atomics
and the sum is taken in a fixed order (offset order: the order of the output's
list, :class:`numba_sc.metadata.PointLists`): the result is deterministic, run
after run. Sums are accumulated in fp32 also for fp16 data.

Worked example, ``C_out = 2``, ``T = 1``, output 3 with rows ``[4, 9]`` (its
table row ``[4, -1, 9]``)::

    thread (output 3, tile 0): acc = init[3, 0] + obuf[4, 0] + obuf[9, 0]; out[3, 0] = acc
    thread (output 3, tile 1): acc = init[3, 1] + obuf[4, 1] + obuf[9, 1]; out[3, 1] = acc

Napkin math, fp32: every pair's row is read once (``4 * pairs * C_out``), the
output's mask word and rows ``C_out/T`` times (``8|Q| + 4 * pairs`` each, mostly
cache hits), the output written once (``4|Q|C_out`` at most, plus the same read
when a centre product is added; an output without pairs is not touched).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, float32

from .backend import device_xp, launch, resolve_backend, to_device
from .gather import check_tile
from .metadata import as_point_lists


# ------------------------------------------------------------------ reference
def scatter_reference(obuf, out_table, init=None, n_out=None, channels=None, dtype=None):
    """NumPy version: add each valid (output, offset) entry's row, offset by offset.

    Sums in fp32 (float64 for float64 buffers) and rounds once, like the kernel.
    """
    obuf = np.asarray(obuf)
    n_out = out_table.shape[0] if n_out is None else n_out
    dtype = np.dtype(dtype or obuf.dtype)
    acc_t = np.float64 if dtype == np.float64 else np.float32
    acc = np.zeros((n_out, obuf.shape[1] if channels is None else channels), dtype=acc_t)
    if init is not None:
        acc += np.asarray(init, dtype=acc_t)
    for k in range(out_table.shape[1]):  # the kernel's summation order
        ii = np.flatnonzero(out_table[:, k] >= 0)
        acc[ii] += obuf[out_table[ii, k]].astype(acc_t)
    return acc.astype(dtype)


# -------------------------------------------------------------------- kernels
@lru_cache(maxsize=None)
def scatter_kernel(tile: int, tiles=None):
    """The scatter kernel compiled for one tile size (constant: the tile is in registers)
    and, when given, one number of tiles per row (constant: the division of every
    thread's index by it is a multiply and a shift, see
    :func:`numba_sc.gather.gather_kernel`)."""
    fixed = -1 if tiles is None else int(tiles)

    @cuda.jit
    def scatter(obuf, out_masks, buffered, out_slots, has_init, out):
        """Output q's rows are ``out_slots[:, q]``, one per set bit of ``out_masks[:, q] &
        buffered``, in offset order (:class:`numba_sc.metadata.PointLists`)."""
        t = cuda.grid(1)
        tiles = fixed if fixed > 0 else out.shape[1] // tile
        if t < out.shape[0] * tiles:
            q = t // tiles  # as in the gather: neighbouring threads, neighbouring tiles
            c0 = (t - q * tiles) * tile
            n = 0  # q's entries: its buffered offsets with a pair (shared by all tiles of q)
            for w in range(out_masks.shape[0]):
                n += cuda.popc(out_masks[w, q] & buffered[w])
            # An output without pairs keeps its centre product untouched: no read,
            # no write (most of a sparse cloud's points); without a centre
            # product it gets its zeros.
            if n > 0 or not has_init:
                acc = cuda.local.array(tile, float32)  # fp32 accumulator, fp16 data or not
                for c in range(tile):
                    # ``out`` already holds the centre product: start from it (the
                    # same order of additions as the reference)
                    acc[c] = out[q, c0 + c] if has_init else float32(0.0)
                for s in range(n):  # offset order: the same sum, run after run
                    row = out_slots[s, q]
                    for c in range(tile):
                        acc[c] += obuf[row, c0 + c]
                for c in range(tile):
                    out[q, c0 + c] = acc[c]  # the only write of this tile: no atomics

    return scatter


def scatter_cuda(obuf, out_lists, init=None, n_out=None, channels=None, dtype=None, tile=1):
    """Device version: one launch of :func:`scatter_kernel`.

    ``out_lists``: a plan's :class:`~numba_sc.metadata.PointLists` (``plan.out_lists``),
    or a dense (|Q|, K) output table, which is packed into lists first. When
    ``init`` (|Q|, C_out) is given it is used as the output array itself (summed
    into in place), saving a separate addition.
    """
    xp = device_xp()
    out_lists = as_point_lists(out_lists)
    n_out = len(out_lists) if n_out is None else n_out
    channels = obuf.shape[1] if channels is None else channels
    if init is not None:
        out = to_device(init)
    else:
        out = xp.empty((n_out, channels), dtype=dtype or obuf.dtype)
    tiles = channels // tile
    launch(scatter_kernel(tile, tiles), n_out * tiles, to_device(obuf), to_device(out_lists.masks),
           to_device(out_lists.buffered), to_device(out_lists.slots), init is not None, out)
    return out


def scatter(obuf, out_table, init=None, tile=1, backend=None, n_out=None, channels=None,
            dtype=None):
    """Sum each output's partial results (plus ``init``, if given); returns (|Q|, C_out).

    ``init`` is never modified: the kernel path sums into a copy of it.
    """
    channels = obuf.shape[1] if channels is None else channels
    tile = check_tile(tile, channels, "tile_size", "output channels")
    if resolve_backend(backend) == "reference":
        return scatter_reference(obuf, np.asarray(out_table), init, n_out, channels, dtype)
    if init is not None:
        init = to_device(init).copy()  # scatter_cuda sums into its init in place
    return scatter_cuda(obuf, out_table, init, n_out, channels, dtype, tile)
