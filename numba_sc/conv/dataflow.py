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
from ..gmas.output_ranges import output_ranges, range_plan, ranges_pay
from ..gmas.scatter import scatter_cuda, scatter_reference
from ..gmas.workspace import window_rows, windows


def gather_gemm_scatter(features, weight, plan, tiles=(1, 1), backend=None, init=None, keep_buffer=None,
                        products=None, kernel_map=None, transposed=False):
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
    ``kernel_map``, ``transposed``: the map the plan was built from and whether the
    layer reads it backwards. A layer past the workspace then runs by ranges of its
    outputs (:mod:`numba_sc.gmas.output_ranges`), each written once, instead of by
    windows of buffer rows, when that pays (:func:`numba_sc.gmas.output_ranges.ranges_pay`);
    otherwise by windows.
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
    if 0 < limit < plan.rows and kernel_map is not None and ranges_pay(n_out, c_out):
        # past the workspace, and the outputs' sums too big to re-read cheaply: by ranges of outputs
        ranges, table = layer_ranges(kernel_map, transposed, plan, limit)
        if ranges is not None:
            return by_output_ranges(features, weight, plan, ranges, tiles, init, obuf_t, kernel_map, transposed,
                                    table, limit)
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
    return _whole(features, weight, plan, tiles, init, obuf_t, keep_buffer, features, plan.centre)


def _whole(features, weight, plan, tiles, init, obuf_t, keep_buffer, centre_rows, centre):
    """Gather, GEMMs and scatter of a plan in one go, summed into ``init`` (in place) when
    given. ``centre_rows``, ``centre``: the features and offset of the centre product
    that ``init`` holds (-1: none), for the fp16 guard to make it again in fp32."""
    ibuf = gather_cuda(features, plan.in_lists, plan.rows, tiles[0], zero_padding=keep_buffer is not None)
    if keep_buffer is not None:  # training: the weight gradient reads this buffer again
        keep_buffer.append(ibuf)
    obuf = device_xp().empty((plan.rows, weight.shape[2]), dtype=obuf_t)  # padding rows: never read
    gg.grouped_gemm_cuda(ibuf, weight, plan.groups, obuf)
    return scatter_cuda(obuf, plan.out_lists, init, plan.n_out, weight.shape[2], features.dtype, tiles[1],
                        repair=(ibuf, weight, centre_rows, centre))


def layer_ranges(km, transposed, plan, limit):
    """:func:`numba_sc.gmas.output_ranges.output_ranges` of the layer that runs ``plan``
    (None: by windows), made once per map, direction and workspace and kept on the map
    (host numbers: the layers that share a map share them; only the latest workspace's
    are kept), and the table in weight order they cut (None with no ranges)."""
    key = (limit, plan.centre, plan.policy)
    kept = km.kept_plans.get(("output ranges", transposed))
    if kept is not None and kept[0] == key and kept[1] is None:
        return None, None
    # on the device once for all the ranges (a map built from NumPy coordinates keeps it
    # on the host); a transposed layer's made for this call (the ranges need it only now)
    table = to_device(weight_order_table(km, transposed, keep=False)[0])
    if kept is not None and kept[0] == key:
        return kept[1], table
    known = None if transposed else (km.chunk, km.chunk_counts)  # (what the search counted, by output)
    ranges = output_ranges(table, plan.centre, limit, plan.policy, known)
    km.kept_plans[("output ranges", transposed)] = (key, ranges)
    return ranges, table


def by_output_ranges(features, weight, plan, ranges, tiles, init, obuf_t, km, transposed, table, limit):
    """The layer range by range of its outputs (:mod:`numba_sc.gmas.output_ranges`): each
    range's gather, GEMMs and scatter on its own plan, made here and dropped after it, summed
    into its rows of the output, which start from the centre product (or zeros). Each output
    is written once, in the features' dtype, as when the layer runs whole."""
    if plan.centre >= 0:
        out = gg.centre_product_cuda(features, weight, plan.centre) if init is None else init
    else:
        out = device_xp().zeros((plan.n_out, weight.shape[2]), dtype=features.dtype)
    ins, outs = (km.out_coords, km.in_coords) if transposed else (km.in_coords, km.out_coords)
    for r in ranges:
        part = range_plan(table, r, ins, outs, km.offsets, plan.centre, limit, plan.policy)
        rows = out[r.q0:r.q1]  # (a view: the scatter sums into it in place)
        inputs = features[r.p0:r.p1]
        centre_rows = features[r.q0:r.q1] if plan.centre >= 0 else inputs  # (submanifold: inputs are outputs)
        _whole(inputs, weight, part, tiles, rows, obuf_t, None, centre_rows, plan.centre)
    return out


def weight_order_table(km, transposed, keep=True):
    """The table the fetch-on-demand and implicit-GEMM dataflows read: (K, n_out),
    row k pairing outputs with inputs through ``weight[k]``, and its pairs per row.

    A forward layer reads its map's table as it is. A transposed layer reads its
    strided map backwards: its output j receives input i through ``W[k]`` exactly
    when ``km.table[k, i] = j``, which is row k of the transposed map's table read
    in reverse row order (:meth:`KernelMap.transposed` lists row ``K-1-k`` first);
    made once and kept on the map (``keep=False``: taken from the map when kept
    there, else made for this call only, K x |P| less for as long as the map lives)."""
    if not transposed:
        return km.table, km.host_counts()
    t = km.kept_plans.get("transposed table")
    if t is None:
        xp = array_module(km.table)
        t = xp.ascontiguousarray(km.transposed().table[::-1])
        if keep:
            km.kept_plans["transposed table"] = t
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
