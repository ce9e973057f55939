"""Stage 3, sorting: packed keys sorted by the library, then de-duplicated.

Minuet sorts coordinates as 64-bit keys with a library radix sort (paper Section
5.1.1, "existing GPU radix sorting libraries"); sorting is not the lesson, so we
call ``argsort`` of CuPy (on the GPU) or NumPy (reference and simulator). What
*is* ours is the step after it, used by voxelization and by output coordinates:
turning a sorted key array with repeats into unique keys, in three passes.

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

The Map step (stages 4-6) needs less: the source keys and the query keys sorted,
the coordinate rows in the same order, and a check that the caller gave no
coordinate twice (:func:`sort_rows_reference` / :func:`sort_rows_cuda`), because a
kernel map from a cloud with repeated voxels is not well defined. On the device
that is the library's argsort and one :func:`permute_kernel`; and it runs only
when the pack kernel found the keys out of order (see
:mod:`numba_sc.map.kernel_map`). The weight offsets need no sort at run time:
:func:`numba_sc.core.conventions.kernel_offsets` lists them in lexicographic order,
and so their key deltas are sorted too (paper Section 5.1.1, first reason).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..core.device import device_xp
from ..core.launch import launch


@dataclass
class SortedUnique:
    """Result of :func:`sort_unique` (arrays on the side that computed them)."""

    keys: object  # int64 (M,): unique keys, ascending
    order: object  # int64 (N,): argsort of the input keys (stable)
    starts: object  # int64 (M + 1,): run m is sorted positions starts[m]:starts[m+1]
    inverse: object  # int64 (N,): unique index of each input key


# ------------------------------------------------------------------ reference
def sort_keys_reference(keys: np.ndarray):
    """Library sort (NumPy, stable): returns (sorted keys, order)."""
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def count_duplicates_reference(skeys: np.ndarray) -> int:
    """How many sorted keys equal their left neighbour (0 for unique keys)."""
    return int(np.count_nonzero(skeys[1:] == skeys[:-1]))


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


@cuda.jit
def permute_kernel(keys, order, coords, skeys, scoords, dups):
    """One thread per sorted position i: move key and coordinate row ``order[i]`` to i.

    Also counts, into ``dups[0]``, the positions whose key equals the previous
    one (a repeated coordinate), so the caller can refuse the input later
    without a separate reduction. The atomic is only reached on bad input.
    One kernel instead of three library gathers (``keys[order]``,
    ``coords[order]``, the comparison): each of those is a launch of its own,
    with the host time a library call costs (``take_94k_host`` in
    ``benchmarks/results/archive/probe_host_costs_h100_2026-11-22.json``).
    """
    i = cuda.grid(1)
    if i < order.shape[0]:
        src = order[i]
        key = keys[src]
        skeys[i] = key
        for c in range(coords.shape[1]):
            scoords[i, c] = coords[src, c]
        if i > 0 and keys[order[i - 1]] == key:
            cuda.atomic.add(dups, 0, 1)


@cuda.jit
def compact_keys_kernel(skeys, head, run, ukeys, report, slot):
    """One thread per sorted position: a run's first key goes to ``ukeys[run - 1]``
    (``run`` is the inclusive scan of ``head``); the last thread writes the number
    of unique keys into ``report[slot]``."""
    i = cuda.grid(1)
    n = skeys.shape[0]
    if i < n:
        if head[i]:
            ukeys[run[i] - 1] = skeys[i]
        if i == n - 1:
            report[slot] = run[i]


def sort_rows_reference(keys, coords):
    """Sorted keys, the order, the coordinate rows in that order, and the number of
    repeated keys: the NumPy twin of :func:`sort_rows_cuda`."""
    skeys, order = sort_keys_reference(keys)
    return skeys, order.astype(np.int64), coords[order].astype(np.int32), count_duplicates_reference(skeys)


def sort_rows_cuda(keys, coords, dups):
    """Library argsort, then :func:`permute_kernel`; adds the repeats to ``dups[0]``
    on the device (nothing is read back here)."""
    xp = device_xp()
    n = keys.shape[0]
    order = xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)
    order = order.astype(np.int64, copy=False)
    skeys = xp.empty(n, dtype=np.int64)
    scoords = xp.empty((n, coords.shape[1]), dtype=np.int32)
    launch(permute_kernel, n, keys, order, coords, skeys, scoords, dups)
    return skeys, order, scoords


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


def sort_unique_keys_cuda(keys, report, slot, out=None):
    """The unique keys alone, ascending, for a caller that needs neither the order nor
    the inverse (the output coordinates of a strided layer): the library sort of the
    keys themselves, :func:`mark_heads_kernel`, a library scan, :func:`compact_keys_kernel`.

    Returns an array of ``len(keys)`` whose first M entries are the unique keys;
    M is written into ``report[slot]`` on the device, for the caller to read with
    whatever else it reads (no device->host copy here). The NumPy twin is
    ``sort_unique_reference(keys).keys``. ``out``: where to write them (made here
    when None; any int64 array of ``len(keys)``).
    """
    xp = device_xp()
    n = keys.shape[0]
    skeys = xp.sort(keys)
    head = xp.empty(n, dtype=np.int32)
    launch(mark_heads_kernel, n, skeys, head)
    run = xp.cumsum(head)
    ukeys = xp.empty(n, dtype=np.int64) if out is None else out  # the first M entries are written
    launch(compact_keys_kernel, n, skeys, head, run, ukeys, report, slot)
    return ukeys
