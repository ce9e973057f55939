"""``numba_sc.trace``: one convolution with every intermediate array kept and named.

A normal :func:`numba_sc.sparse_conv3d` call keeps only its output. ``trace``
runs the same stages on the same backend and returns every intermediate, named
as in the paper, as host NumPy arrays, so that a student can look at each one
and a kernel developer can compare their engine's intermediates with ours one by
one (``Trace.compare``).

Names, in pipeline order (Map step, then GMaS):

=============================  ====================================================
``P``                          input coordinates, sorted (the source array's coordinates)
``Q``                          output coordinates, sorted
``offsets``                    weight offsets Delta, sorted (K, 3)
``source_keys``                packed, sorted input keys: the source array (Section 5.1)
``query_keys``                 packed, sorted output keys; segment k is ``query_keys + key_deltas[k]``
``key_deltas``                 the key difference of each offset (K,)
``pivots``                     last key of each source block of size B (Figure 11, step 1)
``borders``                    (K, blocks + 1) query-block borders per segment, from the backward search
``balanced_blocks``            (n, 4) rows (k, source block, query start, query end) after splitting at C
``kernel_map``                 (K, |Q|) table: input index at ``Q[i] + offsets[k]``, or -1
``pair_counts``                pairs per offset (K,)
``offset_order``               offsets in buffer order (sorted by pair count; no centre, no empty)
``gemm_groups``                (G, 3) rows (first buffer row, members, padded rows per member)
``input_metadata_table``       (|P|, K) buffer row each input is copied to, or -1 (the IMT)
``output_metadata_table``      (|Q|, K) buffer row of each output's partial result, or -1 (the OMT)
``input_buffer``               gathered input rows (padding rows left as zeros here for display)
``output_buffer``              GEMM results, one row per pair (padding rows zero)
``centre_product``             ``F @ W[centre]`` for a submanifold layer (else absent)
``output_features``            the scattered sum: the layer's output
=============================  ====================================================
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..gmas import gemm_grouping as gg
from ..core.device import device_xp
from ..core.backend import resolve_backend, to_host
from ..map.backward_search import (DEFAULT_QUERY_BLOCK, DEFAULT_SOURCE_BLOCK, backward_search_cuda, backward_search_reference,
                              max_balanced_blocks, split_query_blocks_reference)
from ..conv.prepare import SparseTensor, prepare_layer
from ..gmas.gather import gather_cuda, gather_reference
from ..gmas.scatter import scatter_cuda, scatter_reference


class Trace(dict):
    """Name -> NumPy array, in pipeline order, plus the layer's settings."""

    def describe(self) -> str:
        """A table of every intermediate: name, shape, dtype and a few values."""
        lines = []
        width = max(map(len, self))
        for name, a in self.items():
            flat = np.asarray(a).reshape(-1)
            head = np.array2string(flat[:4], precision=3, separator=", ")
            lines.append(f"{name.ljust(width)}  {str(np.shape(a)):>16s}  {str(np.asarray(a).dtype):8s}  {head}")
        return "\n".join(lines)

    def compare(self, other: dict, rtol: float = 1e-5) -> list:
        """Compare with another engine's intermediates (a dict of the same names).

        Returns ``(name, ok, detail)`` for each name present in both: integer
        arrays must match exactly, float arrays to ``rtol`` of their largest value.
        The detail of a mismatch gives the first differing index and both values.
        """
        results = []
        for name, mine in self.items():
            if name not in other:
                continue
            a, b = np.asarray(mine), np.asarray(to_host(other[name]))
            if a.shape != b.shape:
                results.append((name, False, f"shape {b.shape}, expected {a.shape}"))
                continue
            if np.issubdtype(a.dtype, np.floating):
                bad = ~np.isclose(b, a, rtol=0, atol=rtol * (np.abs(a).max() + 1e-30))
            else:
                bad = a != b
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                results.append((name, False, f"{int(bad.sum())} differ; first at {idx}: "
                                             f"{b[idx]!r}, expected {a[idx]!r}"))
            else:
                results.append((name, True, "equal"))
        return results


def trace(coords, features, weight, kernel_size=3, stride=1, dilation=1, backend=None,
          source_block=DEFAULT_SOURCE_BLOCK, query_block=DEFAULT_QUERY_BLOCK, tile_size=(1, 1)) -> Trace:
    """Run one sparse convolution and return all its intermediates (see the module table).

    ``coords`` (N, 3|4) int, ``features`` (N, C_in) float32/16, ``weight``
    (K, C_in, C_out). The output equals ``sparse_conv3d(SparseTensor(coords,
    features), weight, ...)`` on the same backend.
    """
    bk = resolve_backend(backend)
    x = SparseTensor(coords, features)
    from ..map.map_step import build_kernel_map

    km = build_kernel_map(x.coords, kernel_size, stride, dilation, tensor_stride=x.stride,
                          backend=bk, source_block=source_block, query_block=query_block, masks=True)
    f, w, km, plan = prepare_layer(x, weight, kernel_size, stride, dilation, False, km, bk)
    t = Trace()
    t["P"], t["Q"], t["offsets"] = to_host(km.in_coords), to_host(km.out_coords), np.asarray(km.offsets)

    # --- Map step, stage by stage on the same backend (stages 3-6).
    reach = (km.offsets.min(axis=0), km.offsets.max(axis=0))
    skeys = cv.pack_keys(t["P"])
    qkeys = cv.pack_keys(t["Q"], *reach)
    deltas = cv.key_delta(km.offsets)
    B, C = source_block, query_block
    t["source_keys"], t["query_keys"], t["key_deltas"] = skeys, qkeys, deltas
    t["pivots"] = skeys[np.minimum(np.arange(B - 1, len(skeys) + B - 1, B), len(skeys) - 1)]
    if bk == "reference":
        bounds, _ = backward_search_reference(skeys, qkeys, deltas, B)
        rows = split_query_blocks_reference(bounds, C)
    else:
        xp = device_xp()
        d_s, d_q, d_d = xp.asarray(skeys), xp.asarray(qkeys), xp.asarray(deltas)
        upper = max_balanced_blocks(len(deltas), len(skeys), len(qkeys), B, C)
        bounds, rows, n_rows = backward_search_cuda(d_s, d_q, d_d, B, C, upper)
        rows = to_host(rows)[: int(to_host(n_rows)[0])]
        rows = rows[np.lexsort(rows.T[::-1])]  # the kernel writes them in no fixed order
    t["borders"], t["balanced_blocks"] = to_host(bounds), to_host(rows)
    t["kernel_map"], t["pair_counts"] = to_host(km.table), to_host(km.counts)

    # --- GMaS step (stages 7-10).
    t["offset_order"] = np.asarray(plan.order)
    t["gemm_groups"] = np.array([(g.start, len(g.members), g.rows) for g in plan.groups],
                                dtype=np.int64).reshape(-1, 3)
    t["input_metadata_table"] = to_host(plan.in_table)
    t["output_metadata_table"] = to_host(plan.out_table)
    c_out, n_out = w.shape[2], plan.n_out
    init = gg.matmul(f, w[plan.centre]) if plan.centre >= 0 else None
    if bk == "reference":
        ibuf = gather_reference(f, plan.in_table, plan.rows)
        obuf = np.zeros((plan.rows, c_out), dtype=gg.product_dtype(f.dtype))
        gg.grouped_gemm_reference(ibuf, w, plan.groups, obuf)
        out = scatter_reference(obuf, plan.out_table, init, n_out, c_out, f.dtype)
    else:
        xp = device_xp()
        ibuf = gather_cuda(f, plan.in_lists, plan.rows, tile_size[0])
        obuf = xp.zeros((plan.rows, c_out), dtype=gg.product_dtype(f.dtype))
        gg.grouped_gemm_cuda(ibuf, w, plan.groups, obuf)
        out = scatter_cuda(obuf, plan.out_lists, None if init is None else init.copy(),
                           n_out, c_out, f.dtype, tile_size[1])
    # Padding rows are never written by the gather (the GEMM reads them as they
    # are); zero them for display so that two traces compare equal.
    ibuf = to_host(ibuf).copy()
    real = np.zeros(plan.rows, bool)
    real[t["input_metadata_table"][t["input_metadata_table"] >= 0]] = True
    ibuf[~real] = 0
    obuf = to_host(obuf).copy()
    obuf[~real] = 0
    t["input_buffer"], t["output_buffer"] = ibuf, obuf
    if init is not None:
        t["centre_product"] = to_host(init)
    t["output_features"] = to_host(out)
    return t
