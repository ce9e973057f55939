"""One layer on one dataflow, from its prepared arrays and its map.

Three ways to compute ``out[q] = sum over pairs (k, q, p) of in[p] @ W[k]``
(paper Eq. 2) from the same map, which give the same output up to float rounding:

* ``"gmas"``, Minuet's (paper Figure 6, Section 5.2), :func:`gather_gemm_scatter`:
  the submanifold centre multiplied directly (``F @ W[centre]``), every other
  pair's input row gathered into a buffer (:mod:`numba_sc.gmas.gather`), one
  batched GEMM per group of offsets (:mod:`numba_sc.gmas.gemm_grouping`), the
  products scattered back into the outputs (:mod:`numba_sc.gmas.scatter`);
* ``"fetch"``: fetch-on-demand (:mod:`numba_sc.dataflows.fetch_on_demand`);
* ``"implicit"``: implicit GEMM (:mod:`numba_sc.dataflows.implicit_gemm`).

Worked example, one axis, P = {0, 1, 3}, kernel 3 (offsets -1, 0, 1), stride 1::

    out[0] = in[0] @ W[1] + in[1] @ W[2]          (0-1 = -1 is not in P)
    out[1] = in[0] @ W[0] + in[1] @ W[1]          (1+1 = 2 is not in P)
    out[3] = in[3] @ W[1]
    pairs: offset -1: 1, offset 0: 3 (the centre: direct), offset +1: 1

Bytes moved by gmas per layer, fp32, ``n`` pairs outside the centre: the gather
writes ``4 n C_in``, the GEMMs read it and write ``4 n C_out`` (plus padding),
the scatter reads that back: roughly ``8 n (C_in + C_out)`` bytes, against
``4 (|P| C_in + |Q| C_out)`` for the features themselves. On SemanticKITTI at
0.05 m (94,444 voxels, n = 190k in a 3x3x3 layer) that is four times the
feature traffic: the buffers, not the flops, decide the speed at small channel
counts, which is where the other two dataflows can win (:mod:`numba_sc.conv.choice`).
"""
from __future__ import annotations

import numpy as np

from ..core.backend import resolve_backend, to_device, to_host
from ..core.conventions import compute_dtype
from ..core.device import array_module, device_xp
from ..dataflows.fetch_driver import fetch_on_demand_cuda, fetch_plan
from ..dataflows.fetch_on_demand import fetch_on_demand_reference
from ..dataflows.implicit_driver import implicit_gemm_cuda, implicit_plan
from ..dataflows.implicit_gemm import implicit_gemm_reference
from ..gmas import gemm_grouping as gg
from ..gmas.gather import gather_cuda, gather_reference
from ..gmas.scatter import scatter_cuda, scatter_reference
from ..gmas.workspace import window_rows, windows


def gather_gemm_scatter(features, weight, plan, tiles=(1, 1), backend=None, init=None, keep_buffer=None,
                        products=None):
    """The GMaS dataflow on prepared arrays: centre product, gather, grouped GEMMs, scatter.

    ``features`` (|P|, C_in) in the map's input order, ``weight`` (K, C_in, C_out)
    indexed like the map's offsets, ``plan`` from :func:`numba_sc.gmas.plan.build_plan`.
    ``init``: the centre product ``features @ weight[plan.centre]`` when it is
    already computed (or queued: :func:`numba_sc.sparse_conv3d` queues it during the
    Map step's read, or before the metadata for a given map), else None. Returns
    (|Q|, C_out) features on the backend's side.

    ``keep_buffer``: a list that receives the input buffer (its padding rows
    zeroed), for the weight gradient to read again (:mod:`numba_sc.conv.gradient`);
    it receives nothing when the buffers pass the workspace
    (:mod:`numba_sc.gmas.workspace`): the layer then runs window by window, and
    the weight gradient gathers its windows again.
    ``products``: the dtype of the GEMMs' output buffer; default
    :func:`numba_sc.gmas.gemm_grouping.product_dtype` (the features' own: in fp16 a
    product past fp16's range is computed again in fp32 by the scatter, so it cannot
    make the sum inf or NaN). ``np.float32`` keeps fp16 layers' products in float32
    (twice the buffer's bytes), for timing the two. A layer run in windows keeps its
    running sums, and its centre product, in fp32.
    """
    bk = resolve_backend(backend)
    n_out = plan.n_out
    c_out = weight.shape[2]
    obuf_t = gg.product_dtype(features.dtype) if products is None else np.dtype(products)
    if bk == "reference":  # products exact in compute_dtype, then as the kernels leave them
        acc_t = compute_dtype(features.dtype)
        init = None
        if plan.centre >= 0:
            init = np.matmul(features.astype(acc_t), weight[plan.centre].astype(acc_t))
            init = gg.repaired_products(init, features.dtype)  # cuBLAS writes it in the features' dtype
        ibuf = gather_reference(features, plan.in_table, plan.rows)
        obuf = gg.grouped_gemm_reference(ibuf, weight, plan.groups, np.zeros((plan.rows, c_out), dtype=acc_t))
        obuf = gg.repaired_products(obuf, obuf_t)
        return scatter_reference(obuf, plan.out_table, init, n_out, c_out, features.dtype)
    xp = device_xp()
    features, weight = to_device(features), to_device(weight)  # no-ops when already there
    limit = window_rows(features.shape[1] * features.itemsize + c_out * obuf_t.itemsize)
    if 0 < limit < plan.rows:  # the buffers would pass the workspace: window by window (gmas.workspace)
        # The running sums stay in fp32 between windows (fp16 features too): rounded to
        # fp16 after each window they would lose bits, and could overflow where the
        # layer's output does not. So does the centre product they start from (cuBLAS
        # writes it in fp32 from the fp16 operands). The products stay fp16: the scatter
        # reads their words into the fp32 sums, and its guard mends any past fp16's range.
        sums_t = compute_dtype(features.dtype)
        if plan.centre >= 0 and (init is None or sums_t != features.dtype):  # in fp16, the centre
            # product (again) in fp32: one rounded to fp16 may have overflowed where the output does not
            init = gg.centre_product_cuda(features, weight, plan.centre, sums_t)
        out = None if init is None else init.astype(sums_t, copy=False)
        for w in windows(plan.groups, plan.rows, limit):
            ibuf = gather_cuda(features, plan.in_lists, plan.rows, tiles[0], window=(w.lo, w.hi))
            obuf = xp.empty((w.hi - w.lo, c_out), dtype=obuf_t)
            gg.grouped_gemm_cuda(ibuf, weight, w.groups, obuf)
            out = scatter_cuda(obuf, plan.out_lists, out, n_out, c_out, sums_t, tiles[1], lo=w.lo,
                               rows=plan.rows, repair=(ibuf, weight, features, -1))  # (``out``: fp32)
            del ibuf, obuf  # back to the pool before the next window takes its buffers
        return out.astype(features.dtype, copy=False)
    if init is None and plan.centre >= 0:
        init = gg.centre_product_cuda(features, weight, plan.centre)
    ibuf = gather_cuda(features, plan.in_lists, plan.rows, tiles[0], zero_padding=keep_buffer is not None)
    if keep_buffer is not None:  # training: the weight gradient reads this buffer again
        keep_buffer.append(ibuf)
    obuf = xp.empty((plan.rows, c_out), dtype=obuf_t)  # padding rows: never read
    gg.grouped_gemm_cuda(ibuf, weight, plan.groups, obuf)
    return scatter_cuda(obuf, plan.out_lists, init, n_out, c_out, features.dtype, tiles[1],
                        repair=(ibuf, weight, features, plan.centre))


def weight_order_table(km, transposed):
    """The table the fetch-on-demand and implicit-GEMM dataflows read: (K, n_out),
    row k pairing outputs with inputs through ``weight[k]``, and its pairs per row.

    A forward layer reads its map's table as it is. A transposed layer reads its
    strided map backwards: its output j receives input i through ``W[k]`` exactly
    when ``km.table[k, i] = j``, which is row k of the transposed map's table read
    in reverse row order (:meth:`KernelMap.transposed` lists row ``K-1-k`` first);
    made once and kept on the map."""
    if not transposed:
        return km.table, km.host_counts()
    t = km.kept_plans.get("transposed table")
    if t is None:
        xp = array_module(km.table)
        t = km.kept_plans["transposed table"] = xp.ascontiguousarray(km.transposed().table[::-1])
    return t, km.host_counts()


def dataflow_plan(km, flow, transposed, skip, table, counts):
    """The fetch or implicit plan of a map (pairs grouped by offset / outputs sorted by
    mask), built once per map and kept on it, like the gmas plan
    (:func:`numba_sc.conv.prepare.layer_plan`): the layers that share a map share its
    plans, whichever dataflow each runs."""
    key = (flow, transposed, skip)
    plan = km.kept_plans.get(key)
    if plan is None:
        plan = fetch_plan(table, counts, skip) if flow == "fetch" else implicit_plan(table, skip=skip)
        km.kept_plans[key] = plan
    return plan


def fetch_or_implicit(flow, f, w, km, transposed, init, centre, bk):
    """A layer by fetch-on-demand or implicit GEMM: ``(|Q|, C_out)`` on the backend's side.
    ``init`` is the submanifold centre product (offset ``centre``), or None."""
    table, counts = weight_order_table(km, transposed)
    if bk == "reference":
        if centre >= 0:
            init = gg.matmul(f, w[centre])
        run = fetch_on_demand_reference if flow == "fetch" else implicit_gemm_reference
        return run(f, w, to_host(table), init, centre)
    plan = dataflow_plan(km, flow, transposed, centre, table, counts)
    if flow == "fetch":
        return fetch_on_demand_cuda(f, w, plan, table.shape[1], init)
    return implicit_gemm_cuda(f, w, table, plan, init)
