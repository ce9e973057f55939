"""Fetch-on-demand's shapes: the plan's type (the pair list and its block table, built
on the host from the counts), the checks of its arguments, and v2's tile sizes.

Kept below the lesson (:mod:`numba_sc.dataflows.fetch_on_demand`), whose rungs take
a :class:`FetchPlan`, and its driver (:mod:`numba_sc.dataflows.fetch_driver`), which
builds one on the device.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np

from ..core.backend import to_device, to_host
from ..core.device import device_xp, simulating

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

    Arrays, all int32: device arrays from
    :func:`numba_sc.dataflows.fetch_driver.fetch_plan` (CuPy on a GPU,
    NumPy under the simulator), NumPy from
    :func:`numba_sc.dataflows.fetch_on_demand.fetch_plan_reference` (the
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

    def device(self) -> FetchPlan:
        """The same plan with its arrays on the device side."""
        return FetchPlan(*(to_device(a) for a in (self.in_rows, self.out_rows, self.block_offset,
                                                  self.block_start, self.block_stop)),
                         self.starts, self.n_out, self.tile_p, self.skip)


def check_table(table, counts_host, skip, tile_p):
    """Cheap checks of a plan's inputs; returns (counts int64 host, skip, tile_p)."""
    K = check_table_layout(table, skip)
    counts = np.asarray(to_host(counts_host)).reshape(-1) if counts_host is not None else None
    if counts is None or counts.shape[0] != K:
        got = None if counts is None else counts.shape[0]
        raise ValueError(f"counts_host must hold one pair count per offset ({K}, the table's rows), got "
                         f"{got}; pass KernelMap.host_counts()")
    tile_p = default_tile_p() if tile_p is None else tile_p
    if not isinstance(tile_p, (int, np.integer)) or isinstance(tile_p, bool) or tile_p < 1:
        raise ValueError(f"tile_p must be a positive int (pairs per thread block), got {tile_p!r}")
    return counts.astype(np.int64), int(skip), int(tile_p)


def check_table_layout(table, skip):
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



# ------------------------------------------------------------------ v2's tiles
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


def accumulator(init, n_out, c_out):
    """The float32 device array the atomics add into: a copy of ``init`` (never the
    caller's array itself) or zeros."""
    xp = device_xp()
    if init is None:
        return xp.zeros((n_out, c_out), dtype=np.float32)
    return xp.array(to_device(init), dtype=np.float32, copy=True)
