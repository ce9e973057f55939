"""Sorted keys -> unique keys: the de-duplication voxelization, output coordinates
and the Map step share.

Minuet sorts coordinates as 64-bit keys with a library radix sort (paper Section
5.1.1, "existing GPU radix sorting libraries"); sorting is not the lesson, so we
call ``argsort`` of CuPy (on the GPU) or NumPy (reference and simulator). What
*is* ours is the step after it: turning a sorted key array with repeats into
unique keys, in three passes.

Worked example, keys ``[7, 3, 7, 5, 3]``::

    order   = argsort(keys)        = [1, 4, 3, 0, 2]
    sorted  = keys[order]          = [3, 3, 5, 7, 7]
    head    = first of its run?    = [1, 0, 1, 1, 0]      (kernel: mark_heads)
    run     = cumsum(head) - 1     = [0, 0, 1, 2, 2]      (library scan)
    unique  = sorted where head    = [3, 5, 7]            (kernel: compact)
    starts  = position of each head, then N = [0, 2, 3, 5]
    inverse[order[i]] = run[i]     = [2, 0, 2, 1, 0]      (each input's unique index)

Bytes moved on the GPU, N keys: sort ~ a few passes of 8N; mark_heads reads 16N
and writes 4N; compact reads ~28N and writes ~24N. All linear, all coalesced
except the scattered ``inverse`` write.

A strided layer needs the unique keys alone (:func:`sort_unique_keys_cuda`). On a
small cloud (the 20k voxels of an indoor crop) each pass above is a launch
whose host cost outweighs its GPU time, so up to :data:`ONE_BLOCK_MAX` keys one
thread block does mark, scan and compact in one kernel
(:func:`unique_one_block`): each thread counts the heads of its share of the
keys, a shared-memory scan places the shares, and each thread writes its heads.

Unique keys go back to coordinates with :func:`unpack_kernel` (one thread per
key; :func:`numba_sc.core.conventions.unpack_keys` is its NumPy twin), or, in
:func:`sort_unique_keys_cuda`, where each is written (:func:`unpack_row`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, int64

from . import conventions as cv
from .conventions import SIMULATOR_THREADS
from .device import device_xp, simulating
from .launch import launch
from .state import cached


@dataclass
class SortedUnique:
    """Result of :func:`sort_unique_reference` / :func:`sort_unique_cuda` (arrays on the
    side that computed them)."""

    keys: object  # int64 (M,): unique keys, ascending
    order: object  # int64 (N,): argsort of the input keys (stable)
    starts: object  # int64 (M + 1,): run m is sorted positions starts[m]:starts[m+1]
    inverse: object  # int64 (N,): unique index of each input key


# ------------------------------------------------------------------ reference
def sort_keys_reference(keys: np.ndarray):
    """Library sort (NumPy, stable): returns (sorted keys, order)."""
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def sort_unique_reference(keys: np.ndarray) -> SortedUnique:
    """NumPy version of the three passes in the module docstring."""
    skeys, order = sort_keys_reference(keys)
    head = np.empty(len(skeys), dtype=bool)
    head[:1] = True
    head[1:] = skeys[1:] != skeys[:-1]
    run = np.cumsum(head) - 1
    starts = np.append(np.flatnonzero(head), len(skeys)).astype(np.int64)
    inverse = np.empty(len(keys), dtype=np.int64)
    inverse[order] = run
    return SortedUnique(skeys[head], order.astype(np.int64), starts, inverse)


# -------------------------------------------------------------------- kernels
@cuda.jit
def mark_heads_kernel(skeys, head):
    """head[i] = 1 if sorted key i starts a new run (differs from its left neighbour)."""
    i = cuda.grid(1)
    if i < skeys.shape[0]:
        head[i] = 1 if (i == 0 or skeys[i] != skeys[i - 1]) else 0


@cuda.jit
def compact_kernel(skeys, order, head, run, ukeys, starts, inverse):
    """One thread per sorted position: record its run, and the run's key if it leads it."""
    i = cuda.grid(1)
    n = skeys.shape[0]
    if i < n:
        r = run[i]
        inverse[order[i]] = r  # scattered write: input order is arbitrary
        if head[i]:
            ukeys[r] = skeys[i]
            starts[r] = i
        if i == n - 1:
            starts[r + 1] = n  # sentinel: end of the last run


@cuda.jit(device=True, inline=True)
def unpack_row(key, r, s, coords):
    """Key ``key`` into row ``r`` of the (M, 3|4) ``coords``: (batch,) x, y, z
    (``s`` = 1 with the batch column)."""
    if s == 1:
        coords[r, 0] = key >> cv.SHIFT_B
    coords[r, s] = cv.unpack_field_device(key, cv.SHIFT_X)
    coords[r, s + 1] = cv.unpack_field_device(key, cv.SHIFT_Y)
    coords[r, s + 2] = cv.unpack_field_device(key, cv.SHIFT_Z)


@cuda.jit
def unpack_kernel(ukeys, s, coords):
    """One thread per voxel: its key back to (batch,) x, y, z int32 columns (one row of
    ``coords`` per key; ``ukeys`` may hold more)."""
    m = cuda.grid(1)
    if m < coords.shape[0]:
        unpack_row(ukeys[m], m, s, coords)


@cuda.jit(device=True, inline=True)
def put_unique(key, r, ukeys, s, coords):
    """Unique key number ``r``: into ``ukeys[r]``, and unpacked into row ``r`` of the
    (M, 3|4) ``coords`` (the caller's coordinates need no separate unpack pass)."""
    ukeys[r] = key
    unpack_row(key, r, s, coords)


@cuda.jit
def compact_keys_kernel(skeys, head, run, ukeys, report, slot, s, coords):
    """One thread per sorted position: a run's first key goes to ``ukeys[run - 1]``
    and row ``run - 1`` of ``coords`` (``run`` is the inclusive scan of ``head``); the
    last thread writes the number of unique keys into ``report[slot]``."""
    i = cuda.grid(1)
    n = skeys.shape[0]
    if i < n:
        if head[i]:
            put_unique(skeys[i], run[i] - 1, ukeys, s, coords)
        if i == n - 1:
            report[slot] = run[i]


ONE_BLOCK_MAX = 1 << 16  # keys up to which one thread block de-duplicates them


@cached
def unique_one_block(threads):
    """The kernel that de-duplicates up to :data:`ONE_BLOCK_MAX` sorted keys in one
    thread block of ``threads`` threads (a compile-time constant: it sizes the
    shared array). Launch one block of exactly that many threads."""

    @cuda.jit
    def unique_one_block_kernel(skeys, ukeys, report, slot, s, coords):
        """Mark, scan and compact in one launch, for a small cloud.

        Thread t takes a contiguous share of the sorted keys and counts the heads
        in it (keys that differ from their left neighbour); a scan of those counts
        across the block, in shared memory, gives each thread where its first
        unique key goes; then each thread walks its share again and writes its
        heads in order. On 20k keys each thread reads about 20 keys twice: a few
        microseconds of GPU time, where the three-pass path
        (:func:`mark_heads_kernel`, the library scan, :func:`compact_keys_kernel`)
        costs the host four or more launches.
        """
        t = cuda.threadIdx.x
        n = skeys.shape[0]
        share = (n + threads - 1) // threads
        lo = min(t * share, n)
        hi = min(lo + share, n)
        mine = 0
        for i in range(lo, hi):
            if i == 0 or skeys[i] != skeys[i - 1]:
                mine += 1
        total = cuda.shared.array(threads, int64)
        total[t] = mine
        cuda.syncthreads()
        step = 1
        while step < threads:  # inclusive scan of the counts (Hillis-Steele: log2(threads) steps)
            left = total[t - step] if t >= step else 0
            cuda.syncthreads()  # every read of this step before any write
            total[t] += left
            cuda.syncthreads()
            step *= 2
        r = total[t] - mine  # heads before this thread's share
        for i in range(lo, hi):
            if i == 0 or skeys[i] != skeys[i - 1]:
                put_unique(skeys[i], r, ukeys, s, coords)
                r += 1
        if t == threads - 1:
            report[slot] = total[t]

    return unique_one_block_kernel


# ------------------------------------------------------------ device versions
def sort_unique_cuda(keys) -> SortedUnique:
    """Device version: library sort + scan, our mark and compact kernels."""
    xp = device_xp()
    n = keys.shape[0]
    order = xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)
    skeys = keys[order]
    head = xp.empty(n, dtype=np.int32)
    launch(mark_heads_kernel, n, skeys, head)
    run = xp.cumsum(head, dtype=np.int64) - 1
    m = int(run[-1]) + 1  # one device->host read: the output size
    ukeys = xp.empty(m, dtype=np.int64)
    starts = xp.empty(m + 1, dtype=np.int64)
    inverse = xp.empty(n, dtype=np.int64)
    launch(compact_kernel, n, skeys, order.astype(np.int64), head, run, ukeys, starts, inverse)
    return SortedUnique(ukeys, order.astype(np.int64), starts, inverse)


def sort_unique_keys_cuda(keys, report, slot, s, out=None):
    """The unique keys alone, ascending, and their coordinates, for a caller that needs
    neither the order nor the inverse (the output coordinates of a strided layer):
    the library sort of the keys themselves (in place: ``keys`` is the caller's
    scratch), then mark, scan and compact: :func:`unique_one_block` for up to
    :data:`ONE_BLOCK_MAX` keys, else :func:`mark_heads_kernel`, a library scan and
    :func:`compact_keys_kernel`.

    Returns ``(ukeys, coords)``: an int64 array of ``len(keys)`` whose first M
    entries are the unique keys, and an int32 (``len(keys)``, 3 + s) array whose first
    M rows are their coordinates (s = 1: with the batch column). M is written into
    ``report[slot]`` on the device, for the caller to read with whatever else it
    reads (no device->host copy here). The NumPy twin is
    ``sort_unique_reference(keys).keys``. ``out``: where to write the keys (made
    here when None; any int64 array of ``len(keys)``).
    """
    xp = device_xp()
    n = keys.shape[0]
    keys.sort()
    ukeys = xp.empty(n, dtype=np.int64) if out is None else out  # the first M entries are written
    coords = xp.empty((n, 3 + s), dtype=np.int32)
    if n <= ONE_BLOCK_MAX:
        threads = SIMULATOR_THREADS if simulating() else 1024
        launch(unique_one_block(threads), threads, keys, ukeys, report, slot, s, coords, threads=threads, blocks=1)
    else:
        head = xp.empty(n, dtype=np.int32)
        launch(mark_heads_kernel, n, keys, head)
        run = xp.cumsum(head)
        launch(compact_keys_kernel, n, keys, head, run, ukeys, report, slot, s, coords)
    return ukeys, coords
