"""The Map step by lookup: one probe per (query, offset), for the hash table and the grid.

Minuet's Map step (stages 5 and 6) *searches*: the queries of a segment are
sorted, so the backward search cuts them into blocks that each look in one
small piece of the sorted inputs. The two alternatives beside it *look up*:
they first build a structure over the input keys in which one key can be found
in O(1), then ask it once for every query and offset:

=================  ========================================  ======================
method             the structure                             one lookup
=================  ========================================  ======================
``"hash"``         an open-addressing hash table             a few slot reads
                   (:mod:`numba_sc.map.hash_map`)                 (linear probing)
``"grid"``         a dense array over the bounding box       one array read
                   (:mod:`numba_sc.map.grid_map`)
=================  ========================================  ======================

Both then run the same kernel, :func:`probe_kernel`, which differs from the
forward search only in how it finds a key: one thread per (offset k, query i)
computes ``key(q_i) + key_delta(d_k)`` (the same packed-key arithmetic as the
query segments, :mod:`numba_sc.core.conventions`) and asks the structure. What it
records on a hit is exactly what the forward search records, so the metadata
stage cannot tell the maps apart:

* ``table[k, i] = j``, and for a symmetric submanifold layer the mirrored pair
  ``table[K-1-k, j] = i`` (only the first ``ceil(K / 2)`` offsets are probed,
  see :func:`numba_sc.map.kernel_map.searched_segments`);
* the pairs per offset (one shared-memory counter per block, one global atomic
  per block: a block's threads share one offset);
* the pairs per offset and chunk of outputs, and every point's bit mask of
  offsets, for the metadata stage (see ``conventions``).

Worked example, one axis, ``P = Q = [0, 1, 3]``, offsets ``[-1, 0, 1]``: the
threads of offset -1 look up 0-1, 1-1, 3-1 = -1, 0, 2 and find only 0 (input
0): ``table[0] = [-1, 0, -1]``; the mirror writes ``table[2, 0] = 1``. The
threads of offset 0 find every point itself. Offset +1 is not probed.

Napkin math, 3x3x3 submanifold layer, SemanticKITTI at 0.05 m (94,444
voxels): 14 x 94k = 1.3M lookups. A hash table at load 1/2 has 256k slots of
12 bytes (3 MB: it lives in the H100's 50 MB L2); a lookup reads about 1.5
slots on average (hits) and a bit more for misses, scattered: ~2M random 8-byte
reads served from L2. The sorted search reads the same keys as coalesced
blocks through shared memory; the grid reads one int32 per lookup, but its
array spans the whole bounding box, and filling it with -1 costs a memset of 4
bytes per cell: 24M cells (96 MB to clear) for a ScanNet room at 2 cm, 1e9
cells (4 GB) for a SemanticKITTI scan at 5 cm, where the grid does not fit.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from ..core.device import simulating
from ..core.launch import launch
from ..core.conventions import MASK_BITS
from ..core.pieces import placeholder
from ..core.state import cached
from .forward_search import mirror_reference

# Threads per block of the probe kernel. A block probes consecutive queries of one
# offset, so that its pairs fall into one chunk of the metadata stage's outputs (the
# chunk, 1024 on a GPU, 128 under the simulator, is a multiple of the block).
PROBE_THREADS = 256
SIMULATOR_PROBE_THREADS = 32


def probe_threads() -> int:
    """Threads per probe block on this machine (fewer under the simulator, where each
    thread is a Python thread)."""
    return SIMULATOR_PROBE_THREADS if simulating() else PROBE_THREADS


@cached
def probe_kernel(lookup, with_masks: bool, threads: int):
    """The probe kernel for a structure whose ``lookup(a, b, key)`` device function
    returns the input index of ``key`` or -1 (``a`` and ``b`` are the structure's
    two arrays). Compiled once per structure, mask setting and block size.

    Launch with ``blocks_per_row * h`` blocks of ``threads`` threads; block ``b``
    probes offset ``b // blocks_per_row`` for ``threads`` consecutive queries.
    """
    bits = np.int64(MASK_BITS)

    @cuda.jit(device=True, inline=True)
    def set_bit(masks, k, i):
        # Other threads may set other bits of the same word at the same time.
        cuda.atomic.or_(masks, (k // bits, i), np.int64(1) << int64(k % bits))

    @cuda.jit
    def probe(a, b, qkeys, deltas, blocks_per_row, table, counts, chunk_shift, chunk_counts,
              out_masks, in_masks):
        k = cuda.blockIdx.x // blocks_per_row
        i0 = (cuda.blockIdx.x - k * blocks_per_row) * threads
        i = i0 + cuda.threadIdx.x
        mirror = table.shape[0] - 1 - k
        mirrored = mirror >= deltas.shape[0]  # row `mirror` is not probed: write its pairs here
        hits = cuda.shared.array(1, int32)
        if cuda.threadIdx.x == 0:
            hits[0] = 0
        cuda.syncthreads()
        if i < qkeys.shape[0]:
            j = lookup(a, b, qkeys[i] + deltas[k])  # the one line that differs from a search
            if j >= 0:
                table[k, i] = j
                cuda.atomic.add(hits, 0, 1)
                if with_masks:
                    set_bit(out_masks, k, i)
                    set_bit(in_masks, k, j)
                if mirrored:
                    table[mirror, j] = i
                    # j is anywhere in the cloud: its chunk is counted one pair at a time
                    cuda.atomic.add(chunk_counts, (mirror, j >> chunk_shift), 1)
                    if with_masks:
                        set_bit(out_masks, mirror, j)
                        set_bit(in_masks, mirror, i)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0 and hits[0] > 0:  # the block's pairs: one chunk, one offset
            cuda.atomic.add(counts, k, hits[0])
            cuda.atomic.add(chunk_counts, (k, i0 >> chunk_shift), hits[0])
            if mirrored:
                cuda.atomic.add(counts, mirror, hits[0])

    return probe


def probe_cuda(lookup, a, b, qkeys, deltas, table, counts, chunk, chunk_counts, out_masks=None,
               in_masks=None):
    """Launch :func:`probe_kernel` over the first ``len(deltas)`` offsets; nothing is read back.

    ``table`` (K, |Q|) int32 filled with -1, ``counts`` (K,) and ``chunk_counts``
    (K, ceil(|Q| / chunk)) zeros, as for :func:`numba_sc.map.forward_search.forward_search_cuda`.
    """
    threads = probe_threads()
    shift = int(chunk).bit_length() - 1
    if chunk != 1 << shift or chunk % threads:
        raise ValueError(f"chunk must be a power of two and a multiple of {threads}, got {chunk}")
    with_masks = out_masks is not None
    if not with_masks:
        out_masks = in_masks = placeholder()
    h, Q = int(deltas.shape[0]), int(qkeys.shape[0])
    per_row = max(1, -(-Q // threads))
    launch(probe_kernel(lookup, with_masks, threads), per_row * h, a, b, qkeys, deltas, per_row, table,
           counts, shift, chunk_counts, out_masks, in_masks, threads=threads, blocks=per_row * h)


def probe_reference(lookup_reference, qkeys, deltas, K):
    """The probe step in NumPy: ``(table (K, |Q|), probes)`` where ``lookup_reference(keys)``
    returns ``(indices or -1, probes per key)``. Probes the first ``len(deltas)``
    offsets and mirrors the rest (:func:`numba_sc.map.forward_search.mirror_reference`)."""
    h, Q = len(deltas), len(qkeys)
    queries = (qkeys[None, :] + np.asarray(deltas, np.int64)[:, None]).ravel()
    found, probes = lookup_reference(queries)
    return mirror_reference(found.reshape(h, Q).astype(np.int32), K), int(np.sum(probes))
