"""Stage 4, sorted query segments: the queries of the Map step, never materialized.

To build a kernel map we must ask, for every output ``q_i`` and every weight
offset ``delta_k``, whether ``q_i + delta_k`` is an input coordinate. That is
``K * |Q|`` queries (27 x 94,000 = 2.5 million for a 3x3x3 layer on one
SemanticKITTI scan). Minuet (paper Section 5.1.1, Figure 8 bottom) never sorts
or stores that array. It sorts ``Q`` once (``|Q|`` keys) and the offsets once
per layer (``K`` offsets), and then *segment* ``k`` is simply::

    segment_k = sorted(Q) + delta_k          (sorted, because adding a constant
                                              keeps the order)

With packed keys (:mod:`numba_sc.core.conventions`) the addition is one integer add,
``key(q + delta) == key(q) + key_delta(delta)``, valid because the packing checked
that no query leaves its field. So the query ``(k, i)`` is computed on the fly,
where it is needed, by :func:`query_key` - one load of ``qkeys[i]`` (shared by
the K segments, so it stays in cache) and one add.

Worked example (one axis shown, as plain integers instead of packed keys)::

    sorted Q  = [0, 3, 4, 9]          deltas = [-1, 0, 1]   (sorted offsets)
    segment 0 = [-1, 2, 3, 8]
    segment 1 = [ 0, 3, 4, 9]
    segment 2 = [ 1, 4, 5, 10]

Every segment is sorted; together they are *not* (segment 0 ends at 8, segment 1
starts at 0). That is the price of segmented sorting: the search stages treat
each segment as its own sorted array.

Napkin math, 3x3x3 layer, |Q| = 100k: materializing and sorting all queries would
write 27 x 100k x 8 B = 21.6 MB and sort it (several passes); the segments cost
800 kB of sorted keys plus 27 x 8 B of deltas, read many times from cache.
"""
from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit(device=True, inline=True)
def query_key(qkeys, deltas, k, i):
    """Key of query ``i`` of segment ``k``: ``key(out_coords[i] + offsets[k])``.

    ``qkeys`` are the sorted output keys (int64), ``deltas`` the key deltas of
    the sorted offsets (int64). Used by both the backward and forward search.
    """
    return qkeys[i] + deltas[k]


def query_key_reference(qkeys, deltas, k, i):
    """NumPy twin of :func:`query_key`; ``k`` and ``i`` may be index arrays."""
    return qkeys[i] + deltas[k]


def query_segments_reference(qkeys, deltas) -> np.ndarray:
    """All segments materialized, int64 (K, |Q|): for teaching and tests only.

    The search stages never call this; it is what they *would* search if the
    segments were stored.
    """
    return np.asarray(deltas, np.int64)[:, None] + np.asarray(qkeys, np.int64)[None, :]
