"""Stage 3, sorting: the Map step's keys and coordinate rows, sorted and checked.

Minuet sorts coordinates as 64-bit keys with a library radix sort (paper Section
5.1.1, "existing GPU radix sorting libraries"); sorting is not the lesson, so we
call ``argsort`` of CuPy (on the GPU) or NumPy (reference and simulator). The
de-duplication that voxelization and output coordinates run after their sort
(sorted keys -> unique keys, order, run starts, inverse) lives below every
stage, in :mod:`numba_sc.core.unique`.

The Map step (stages 4-6) needs less: the source keys and the query keys sorted,
the coordinate rows in the same order, and a check that the caller gave no
coordinate twice (:func:`sort_rows_reference` / :func:`sort_rows_cuda`), because a
kernel map from a cloud with repeated voxels is not well defined. On the device
that is the library's argsort and one :func:`permute_kernel`; and it runs only
when the pack kernel found the keys out of order (see
:mod:`numba_sc.map.kernel_map`). The weight offsets need no sort at run time:
:func:`numba_sc.core.conventions.kernel_offsets` lists them in lexicographic order,
and so their key deltas are sorted too (paper Section 5.1.1, first reason).

Worked example, keys ``[7, 3, 5]`` with coordinate rows ``a, b, c``::

    order   = argsort(keys)   = [1, 2, 0]
    skeys   = keys[order]     = [3, 5, 7]      rows  = [b, c, a]
    repeats = 0                (keys [7, 3, 7] would give 1: the input is refused)
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..core.device import device_xp
from ..core.launch import launch
from ..core.unique import sort_keys_reference


# ------------------------------------------------------------------ reference
def count_duplicates_reference(skeys: np.ndarray) -> int:
    """How many sorted keys equal their left neighbour (0 for unique keys)."""
    return int(np.count_nonzero(skeys[1:] == skeys[:-1]))


def sort_rows_reference(keys, coords):
    """Sorted keys, the order, the coordinate rows in that order, and the number of
    repeated keys: the NumPy twin of :func:`sort_rows_cuda`."""
    skeys, order = sort_keys_reference(keys)
    return skeys, order.astype(np.int64), coords[order].astype(np.int32), count_duplicates_reference(skeys)


# -------------------------------------------------------------------- kernels
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
