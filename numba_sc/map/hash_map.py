"""The Map step's first alternative: a GPU hash table on the packed keys.

This is how spconv and TorchSparse build their kernel maps, and what Minuet's
paper argues against (Section 3): put every input key in a hash table, then look
up every query moved by every offset. ``build_kernel_map(..., method="hash")``.

The table: open addressing with linear probing
    Two arrays of ``capacity`` slots, a power of two at least twice the number
    of keys (load factor <= 1/2): ``slot_keys`` (int64, ``EMPTY`` = -1 where no
    key is stored; packed keys are never negative) and ``slot_vals`` (int32, the
    key's row in the sorted input). A key's *home* slot is ``hash(key) &
    (capacity - 1)``; when that slot is taken by another key, the key goes to the
    next slot, and the next, wrapping around, until a free one.

    *Build*: one thread per input key claims a slot with an atomic
    compare-and-swap (``cuda.atomic.cas``): it swaps ``EMPTY`` for its key, and if
    another thread got there first, it moves on to the next slot. Only then does
    it write its index into ``slot_vals``.

    *Lookup*: start at the home slot and walk until the key (found: the index
    beside it) or an empty slot (not there: -1). With load 1/2, a successful
    lookup reads about 1.5 slots on average and a failed one about 2.5 (Knuth's
    estimates for linear probing), if the hash spreads the keys well.

The hash
    Voxel keys are far from random: neighbours differ in their low bits only,
    and an identity hash would put a whole row of voxels into one run of slots.
    The key's two 32-bit halves are folded together and mixed with MurmurHash3's
    32-bit finalizer (multiplies and xor-shifts, every product of two numbers
    below 2^32, so it is the same in NumPy's uint64 and on the GPU).

Worked example, capacity 8, keys ``[5, 9, 12]`` whose home slots happen to be
3, 3 and 0: key 5 takes slot 3, key 9 finds 3 taken and takes 4, key 12 takes
0. Looking up 9 reads slots 3 (5: not it) and 4 (found). Looking up 7, home
slot 4: reads 4 (9), 5 (empty): not there, two probes.

What the paper says, and what to check on today's GPU
    Minuet's argument is that hash lookups are random accesses that miss the
    cache, while sorted queries read sorted keys block by block. On an H100 the
    whole table of a 94k-voxel scan (256k slots, 3 MB) sits in the 50 MB L2
    cache, so the random reads are L2 hits; and the build is one pass with no
    sort, where Minuet's path sorts (when the input is not sorted already) and
    runs two searches. Notebook 10 measures both.

The probing itself is shared with the dense grid: :mod:`numba_sc.map.map_probe`.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from ..core.backend import filled
from ..core.launch import launch

EMPTY = -1  # a free slot (packed keys are >= 0)
MIN_CAPACITY = 64
_M32 = np.uint64(0xFFFFFFFF)
_C1, _C2 = np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)  # MurmurHash3's fmix32 constants
_S16, _S13, _S32 = np.uint64(16), np.uint64(13), np.uint64(32)


def capacity_for(n: int) -> int:
    """Slots for ``n`` keys: the smallest power of two >= 2n (load factor <= 1/2)."""
    return max(MIN_CAPACITY, 1 << int(2 * max(int(n), 1) - 1).bit_length())


# ------------------------------------------------------------------ reference
def hash_reference(keys):
    """The 32-bit hash of int64 keys, vectorized: fold the halves, then fmix32."""
    k = np.asarray(keys, np.int64).astype(np.uint64)
    h = (k ^ (k >> _S32)) & _M32
    h ^= h >> _S16
    h = (h * _C1) & _M32
    h ^= h >> _S13
    h = (h * _C2) & _M32
    h ^= h >> _S16
    return h


def build_reference(keys, capacity=None):
    """Insert ``keys`` (unique int64) into a table: ``(slot_keys, slot_vals, probes)``.

    Vectorized in rounds: in each round every key not yet placed tries its
    current slot; of the keys that try the same free slot the first one (by
    index) wins, the others and those that found the slot taken move one on.
    (On the GPU the winner of a contended slot is whichever thread's CAS lands
    first, so the layout differs from run to run; every lookup's answer does not.)
    """
    keys = np.asarray(keys, np.int64)
    cap = capacity or capacity_for(len(keys))
    mask = np.uint64(cap - 1)
    slot_keys = np.full(cap, EMPTY, np.int64)
    slot_vals = np.full(cap, -1, np.int32)
    todo = np.arange(len(keys))
    slot = (hash_reference(keys) & mask).astype(np.int64)
    probes = 0
    while len(todo):
        probes += len(todo)
        s = slot[todo]
        free = slot_keys[s] == EMPTY
        first = np.zeros(len(todo), bool)
        _, at = np.unique(s[free], return_index=True)  # the first taker of each free slot
        first[np.flatnonzero(free)[at]] = True
        slot_keys[s[first]] = keys[todo[first]]
        slot_vals[s[first]] = todo[first]
        todo = todo[~first]
        slot[todo] = (slot[todo] + 1) & int(mask)
    return slot_keys, slot_vals, probes


def lookup_reference(slot_keys, slot_vals, queries):
    """Look ``queries`` up: ``(index or -1 per query, slots read per query)``, vectorized in rounds."""
    queries = np.asarray(queries, np.int64)
    mask = len(slot_keys) - 1
    found = np.full(len(queries), -1, np.int64)
    probes = np.zeros(len(queries), np.int64)
    todo = np.arange(len(queries))
    slot = (hash_reference(queries) & np.uint64(mask)).astype(np.int64)
    while len(todo):
        probes[todo] += 1
        stored = slot_keys[slot[todo]]
        hit = stored == queries[todo]
        found[todo[hit]] = slot_vals[slot[todo[hit]]]
        todo = todo[~hit & (stored != EMPTY)]  # neither found nor at an empty slot: walk on
        slot[todo] = (slot[todo] + 1) & mask
    return found, probes


# -------------------------------------------------------------------- kernels
@cuda.jit(device=True, inline=True)
def hash_device(key):
    """:func:`hash_reference` of one key (uint64 arithmetic: no product reaches 2^64)."""
    k = uint64(key)
    h = (k ^ (k >> _S32)) & _M32
    h ^= h >> _S16
    h = (h * _C1) & _M32
    h ^= h >> _S13
    h = (h * _C2) & _M32
    h ^= h >> _S16
    return h


@cuda.jit
def insert_kernel(keys, slot_keys, slot_vals):
    """One thread per key: claim a slot with compare-and-swap, walking on past taken ones."""
    j = cuda.grid(1)
    if j < keys.shape[0]:
        key = keys[j]
        mask = uint64(slot_keys.shape[0] - 1)
        s = hash_device(key) & mask
        while True:
            old = cuda.atomic.cas(slot_keys, s, EMPTY, key)  # returns what was there before
            if old == EMPTY:  # the slot was free and is now ours
                slot_vals[s] = j
                return
            if old == key:  # a repeated input row: the Map step reports those elsewhere
                return
            s = (s + uint64(1)) & mask


@cuda.jit(device=True, inline=True)
def lookup_device(slot_keys, slot_vals, key):
    """Walk from the home slot to the key (its index) or to an empty slot (-1)."""
    mask = uint64(slot_keys.shape[0] - 1)
    s = hash_device(key) & mask
    while True:
        stored = slot_keys[s]
        if stored == key:
            return slot_vals[s]
        if stored == EMPTY:
            return -1
        s = (s + uint64(1)) & mask


def build_cuda(keys):
    """The table of the device keys ``keys``: ``(slot_keys, slot_vals)``, queued, not waited for.

    The table is read only by the probe kernel launched after this one on the same
    stream, so the writes to ``slot_vals`` (made after each key's CAS) are all done
    before any lookup reads them.
    """
    cap = capacity_for(keys.shape[0])
    slot_keys = filled(cap, np.int64, EMPTY)
    slot_vals = filled(cap, np.int32, -1)
    launch(insert_kernel, keys.shape[0], keys, slot_keys, slot_vals)
    return slot_keys, slot_vals
