"""The sparse convolution, assembled: SparseTensor, Map step, then GMaS.

A :class:`SparseTensor` is a set of unique integer coordinates, sorted once at
construction, with one feature row per coordinate and a tensor stride (the
spacing of its grid, in finest voxels). :func:`sparse_conv3d` computes (paper
Eq. 2, DESIGN.md "the rule")::

    out[q_i] = sum over offsets k with q_i + delta_k in P of  in[q_i + delta_k] @ W[k]

in two steps (paper Figure 6):

1. **Map** (:mod:`numba_sc.map.kernel_map`): the output coordinates and the kernel
   map ``table[k, i]`` = input at ``out[i] + delta_k``, or -1. Skipped when a
   ``kernel_map`` is passed (layers sharing coordinates share one map).
2. **GMaS**, stages 7-11, one module each:

   ============  ===============================================================
   metadata      pairs per offset, the offset order, the groups, every pair's
                 buffer row; the input and output tables
   gather        input rows -> input buffer (Algorithm 1, tiled)
   gemm_grouping one batched GEMM per group of offsets (sorted by pair count)
   scatter       output buffer -> output rows (tiled, no atomics)
   autotune      tile sizes per layer (Algorithm 2)
   ============  ===============================================================

   plus the submanifold centre, multiplied directly (``F @ W[centre]``) when
   the offset (0, 0, 0) maps every point to itself.

Worked example, one axis, P = {0, 1, 3}, kernel 3 (offsets -1, 0, 1), stride 1::

    out[0] = in[0] @ W[1] + in[1] @ W[2]          (0-1 = -1 is not in P)
    out[1] = in[0] @ W[0] + in[1] @ W[1]          (1+1 = 2 is not in P)
    out[3] = in[3] @ W[1]
    pairs: offset -1: 1, offset 0: 3 (the centre: direct), offset +1: 1

Three kinds of layer:

* stride 1, *submanifold*: outputs on the input coordinates;
* stride s > 1, *downsampling*: outputs at ``floor(P / (s*t)) * (s*t)`` and
  tensor stride ``s*t``;
* ``transposed=True``, *upsampling*: given the map of the strided convolution it
  inverts, it returns features on that convolution's input coordinates (and
  tensor stride), reading each pair backwards: for the strided map's pair
  ``p = q + delta_k``, ``out[p] += in[q] @ W[k]``. ``W[k]`` is indexed like the
  strided layer's weights (``kernel_offsets`` order).

Bytes moved per layer, fp32, ``n`` pairs outside the centre: the gather writes
``4 n C_in``, the GEMMs read it and write ``4 n C_out`` (plus padding), the
scatter reads that back: roughly ``8 n (C_in + C_out)`` bytes, against
``4 (|P| C_in + |Q| C_out)`` for the features themselves. On SemanticKITTI at
0.05 m (94,444 voxels, n = 190k in a 3x3x3 layer) that is four times the
feature traffic: the buffers, not the flops, decide the speed at small channel
counts.
"""
from __future__ import annotations

import numpy as np

from ..dataflows import choice as ch
from . import gemm_grouping as gg
from .autotune import TileChoice, cached, gpu_time_once, heuristic_tile, layer_key, remember, search_tiles
from ..core.device import array_module, device_xp, simulating
from ..core.backend import like, resolve_backend, to_device, to_host
from .gather import check_tile, gather_cuda, gather_reference
from ..map.kernel_map import KernelMap, layer_arguments
from ..map.map_step import build_kernel_map
from .layout import centre_offset, submanifold_centre
from .plan import build_plan
from ..dataflows.fetch_on_demand import fetch_on_demand_cuda, fetch_on_demand_reference, fetch_plan
from ..dataflows.implicit_gemm import implicit_gemm_cuda, implicit_gemm_reference, implicit_plan
from .scatter import scatter_cuda, scatter_reference
from ..core.tensor import SparseTensor, same_coordinates
from ..core import conventions as cv
from ..core.conventions import Array, IntOr3

__all__ = ["SparseTensor", "sparse_conv3d", "autotune", "gmas", "resolve_tiles",
           "choose_dataflow"]


# ------------------------------------------------------------- argument checks
def check_weight(weight, K, c_in, dtype, kernel_size, layer=None):
    """The layer's weight (:func:`numba_sc.core.conventions.check_weight`), the message
    naming the kernel size and the layer."""
    ks = tuple(kernel_size)
    cv.check_weight(weight, K, c_in, dtype, f" for kernel_size {ks} (K = {K} offsets, in kernel_offsets order) "
                    f"and {c_in} input channels", _where(layer))


def check_layer_name(layer):
    """``layer`` names a layer in the caches (tiles, dataflow choices): None or a hashable
    value, usually a string."""
    try:
        hash(layer)
    except TypeError:
        raise TypeError(f"layer must be a name for the layer, e.g. a string such as 'enc1' (or None), "
                        f"got {layer!r}") from None


def _where(layer):
    """The prefix of an error message about the layer named ``layer`` (if any)."""
    return "" if layer is None else f"layer {layer!r}: "


def check_map_fits(x, kernel_map, transposed, layer=None):
    """``kernel_map`` must have been built on ``x``'s coordinates (on its output side for a
    transposed layer): same count, same tensor stride, same coordinates. The last
    costs nothing for the arrays layers hand on (the map holds the very array),
    and one comparison (a device read) for a map given to a tensor made anew."""
    if transposed:
        coords, ts, side = kernel_map.out_coords, tuple(kernel_map.out_tensor_stride), "output"
    else:
        coords, ts, side = kernel_map.in_coords, tuple(kernel_map.tensor_stride), "input"
    hint = ("For transposed=True pass the map of the strided layer whose output x is "
            "(y.kernel_map)." if transposed else
            "Pass the map of a layer whose input coordinates are x's.")
    where = _where(layer)
    if len(x) != len(coords):
        raise ValueError(
            f"{where}kernel_map does not fit x: its {side} side has {len(coords)} coordinates, x has "
            f"{len(x)}. " + hint)
    if tuple(x.stride) != ts:
        raise ValueError(
            f"{where}kernel_map was built for tensor stride {ts} on its {side} side, but x has stride "
            f"{tuple(x.stride)}")
    if not same_coordinates(coords, x.coords):
        raise ValueError(
            f"{where}kernel_map was built on other coordinates than x's: both have {len(x)} points, "
            f"but not the same ones, so its pairs would read the wrong rows. " + hint)


def resolve_tiles(tile_size, c_in, c_out, n_in, n_out, dtype, K, transposed, layer=None):
    """``tile_size`` argument -> (gather tile, scatter tile).

    ``None``: the autotuner's cached choice for this layer, else the heuristic;
    an int: the same tile for both (it must divide C_in and C_out); a pair:
    (gather tile dividing C_in, scatter tile dividing C_out).
    """
    if tile_size is None:
        choice = cached(layer_key(layer, c_in, c_out, K, dtype, transposed))
        if choice is not None and c_in % choice.gather == 0 and c_out % choice.scatter == 0:
            return choice.gather, choice.scatter
        item = np.dtype(dtype).itemsize
        return heuristic_tile(c_in, n_in, item), heuristic_tile(c_out, n_out, item)
    if isinstance(tile_size, (tuple, list)):
        if len(tile_size) != 2:
            raise ValueError(f"tile_size must be an int or a pair (gather, scatter), got {tile_size!r}")
        return (check_tile(tile_size[0], c_in, "tile_size[0] (gather)", "input channels"),
                check_tile(tile_size[1], c_out, "tile_size[1] (scatter)", "output channels"))
    t = check_tile(tile_size, c_in, "tile_size", "input channels")
    if c_out % t:
        raise ValueError(
            f"tile_size={t} divides the input channels ({c_in}) but not the output channels "
            f"({c_out}); pass a pair tile_size=(gather_tile, scatter_tile)")
    return t, t


# ------------------------------------------------------------------ assembly
def prepare_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend,
                   sort=True, max_padding=gg.DEFAULT_MAX_PADDING, solo_rows=gg.DEFAULT_SOLO_ROWS,
                   launch_rows=None):
    """Checks, the Map step (unless a map is given) and the metadata.

    Returns ``(features, weight, km, plan)`` on the backend's side, where ``km`` is
    the map the layer reads (for a transposed layer: the strided map it reads
    backwards) and ``weight`` is indexed like ``km.offsets``; ``plan.n_out`` is
    the number of output rows.
    """
    f, w, km = _map_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend)
    lr = launch_rows_for(launch_rows, w)
    if transposed:
        return f, w, km, layer_plan(km, sort, max_padding, solo_rows, launch_rows, lr, backend).transposed()
    return f, w, km, build_plan(km, sort, max_padding, solo_rows, backend=backend, launch_rows=lr)


def layer_plan(km, sort, max_padding, solo_rows, launch_rows, priced_rows, backend):
    """The metadata of a map under this policy, built once and kept on the map.

    A plan depends on the map and the grouping policy only (not on features,
    weights or channels), so layers that share a map (``kernel_map=``) share its
    plan, as spconv's layers that share an ``indice_key`` share their pairs: the
    second and later ones skip the metadata kernels (their GPU time on
    SemanticKITTI: ``python -m numba_sc ladder metadata``, recorded in
    ``benchmarks/results/ladder_all_kitti.json``). The transposed layer that
    inverts a strided layer reads that layer's plan backwards
    (:meth:`numba_sc.gmas.layout.GmasPlan.transposed`), so it builds nothing at
    all.

    ``launch_rows`` is the argument: None (price a launch by the channels,
    ``priced_rows``) accepts a kept plan priced by another layer's channels,
    since the pricing only decides how offsets are grouped into GEMMs, never
    the result. Memory (the slots, 4 K (|P| + |Q|) bytes) is held as long as
    the map is.
    """
    key = (sort, max_padding, solo_rows, launch_rows, backend)
    kept = getattr(km, "kept_plan", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    plan = build_plan(km, sort, max_padding, solo_rows, backend=backend, launch_rows=priced_rows)
    try:
        km.kept_plan = (key, plan)
    except AttributeError:  # a map-like object that takes no new attribute: no reuse
        pass
    return plan


def launch_rows_for(launch_rows, w):
    """The ``launch_rows`` argument: None prices a GEMM launch by the layer's channels."""
    if launch_rows is None:
        return gg.launch_rows(w.shape[1], w.shape[2], w.itemsize)
    if not isinstance(launch_rows, (int, np.integer)) or isinstance(launch_rows, bool) or launch_rows < 0:
        raise ValueError(f"launch_rows must be None or an int >= 0 (0: the plain padding policy), "
                         f"got {launch_rows!r}")
    return int(launch_rows)


def _map_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend,
               while_reading=None, layer=None):
    """:func:`prepare_layer` up to the metadata: ``(features, weight, km)``.

    ``km`` is the map the layer reads: its own or the one given; for a
    transposed layer, the strided map it inverts (read backwards by the plan;
    ``weight`` stays indexed like that map's offsets).

    ``while_reading(m, features, weight)``: see ``build_kernel_map``'s
    ``while_reading``; called only when this layer builds its own map (and only
    on the kernel path), after the weight has been checked.
    """
    if not isinstance(x, SparseTensor):
        raise TypeError(f"{_where(layer)}x must be a numba_sc.SparseTensor, got {type(x).__name__}")
    move = to_host if backend == "reference" else to_device
    if transposed:
        if kernel_map is None:
            raise ValueError(
                f"{_where(layer)}transposed=True needs kernel_map=: the map of the strided layer it "
                "inverts, e.g. y = sparse_conv3d(x, w, stride=2); "
                "sparse_conv3d(y, w2, transposed=True, kernel_map=y.kernel_map)")
        check_map_fits(x, kernel_map, True, layer)
        km = kernel_map
    elif kernel_map is None:
        # The weight is checked before the Map step, so that work queued during
        # the step's read (while_reading) only ever sees a weight of the right shape.
        ks, *_, offsets, _ = layer_arguments(kernel_size, stride, dilation, x.stride)
        check_weight(weight, len(offsets), x.channels, x.features.dtype, ks, layer)
        f, w = move(x.features), move(weight)
        hook = None if while_reading is None else (lambda m: while_reading(m, f, w))
        # x.coords are sorted and unique, so km.in_coords == x.coords and
        # km.in_order is the identity: x.features are already in the map's order.
        km = build_kernel_map(x.coords, kernel_size, stride, dilation, tensor_stride=x.stride,
                              backend=backend, assume_sorted=True, masks=True, while_reading=hook)
        return f, w, km
    else:
        check_map_fits(x, kernel_map, False, layer)
        km = kernel_map
    check_weight(weight, len(km.offsets), x.channels, x.features.dtype, km.kernel_size, layer)
    return move(x.features), move(weight), km


def gmas(features, weight, plan, tiles=(1, 1), backend=None, init=None, keep_buffer=None,
         products=None):
    """The GMaS step on prepared arrays: centre product, gather, grouped GEMMs, scatter.

    ``features`` (|P|, C_in) in the map's input order, ``weight`` (K, C_in, C_out)
    indexed like the map's offsets, ``plan`` from :func:`numba_sc.gmas.plan.build_plan`.
    ``init``: the centre product ``features @ weight[plan.centre]`` when it is
    already computed (or queued: :func:`sparse_conv3d` queues it during the Map
    step's read, or before the metadata for a given map), else None. Returns
    (|Q|, C_out) features on the backend's side.

    ``products``: the dtype of the GEMMs' output buffer; default
    :func:`numba_sc.gmas.gemm_grouping.product_dtype` (float32 for fp16 features, so
    that a partial product beyond fp16's range cannot make the sum inf or NaN).
    ``np.float16`` gives the fp16 buffer of earlier versions, for timing the two.
    """
    bk = resolve_backend(backend)
    n_out = plan.n_out
    c_out = weight.shape[2]
    obuf_t = gg.product_dtype(features.dtype) if products is None else np.dtype(products)
    if bk == "reference":
        init = gg.matmul(features, weight[plan.centre]) if plan.centre >= 0 else None
        ibuf = gather_reference(features, plan.in_table, plan.rows)
        obuf = np.zeros((plan.rows, c_out), dtype=obuf_t)
        gg.grouped_gemm_reference(ibuf, weight, plan.groups, obuf)
        return scatter_reference(obuf, plan.out_table, init, n_out, c_out, features.dtype)
    xp = device_xp()
    features, weight = to_device(features), to_device(weight)  # no-ops when already there
    if init is None and plan.centre >= 0:
        init = gg.centre_product_cuda(features, weight, plan.centre)
    ibuf = gather_cuda(features, plan.in_lists, plan.rows, tiles[0], zero_padding=keep_buffer is not None)
    if keep_buffer is not None:  # training: the weight gradient reads this buffer again
        keep_buffer.append(ibuf)
    obuf = xp.empty((plan.rows, c_out), dtype=obuf_t)  # padding rows: never read
    gg.grouped_gemm_cuda(ibuf, weight, plan.groups, obuf)
    return scatter_cuda(obuf, plan.out_lists, init, n_out, c_out, features.dtype, tiles[1])


# ------------------------------------------------------ the other dataflows
def _weight_order_table(km, transposed):
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


def _dataflow_plan(km, flow, transposed, skip, table, counts):
    """The fetch or implicit plan of a map (pairs grouped by offset / outputs sorted by
    mask), built once per map and kept on it, like the gmas plan (:func:`layer_plan`):
    the layers that share a map share its plans, whichever dataflow each runs."""
    key = (flow, transposed, skip)
    plan = km.kept_plans.get(key)
    if plan is None:
        plan = fetch_plan(table, counts, skip) if flow == "fetch" else implicit_plan(table, skip=skip)
        km.kept_plans[key] = plan
    return plan


def _other_dataflow(flow, f, w, km, transposed, init, centre, bk):
    """A layer by fetch-on-demand or implicit GEMM: ``(|Q|, C_out)`` on the backend's side.
    ``init`` is the submanifold centre product (offset ``centre``), or None."""
    table, counts = _weight_order_table(km, transposed)
    if bk == "reference":
        if centre >= 0:
            init = gg.matmul(f, w[centre])
        run = fetch_on_demand_reference if flow == "fetch" else implicit_gemm_reference
        return run(f, w, to_host(table), init, centre)
    plan = _dataflow_plan(km, flow, transposed, centre, table, counts)
    if flow == "fetch":
        return fetch_on_demand_cuda(f, w, plan, table.shape[1], init)
    return implicit_gemm_cuda(f, w, table, plan, init)


def _pick_dataflow(dataflow, layer, f, w, km, transposed, training, map_given, centre, backend=None):
    """The ``dataflow`` argument -> "gmas" | "fetch" | "implicit" (see :mod:`numba_sc.dataflows.choice`).
    ``centre``: the map's submanifold centre (-1 for a strided map, read backwards or not).
    ``backend``: the layer's; None asks for the rule's answer whatever runs it."""
    ch.check_dataflow(dataflow)
    if training:  # the backward pass reads the gmas buffers
        if dataflow not in ("gmas", "auto"):
            raise ValueError(f"{_where(layer)}dataflow={dataflow!r} has no backward pass here: training "
                             "runs dataflow='gmas' (or 'auto', which picks it when training)")
        return "gmas"
    if dataflow != "auto":
        return dataflow
    if backend == "reference":
        # The reference answers the same whatever ran before: no rule that turns on
        # whether the map was given (a network's second call on a tensor reuses the maps
        # of its first) may pick another summation order there. Timing means nothing in
        # NumPy, so "auto" is the paper's dataflow; a named one runs as named (above).
        return "gmas"
    c_in, c_out = w.shape[1], w.shape[2]
    if not ch.measured_dataflows() and (c_in > ch.MID_CHANNELS or c_out > ch.MID_CHANNELS):
        return "gmas"  # the rule's answer for wide layers, without counting anything (every layer asks)
    n_out = km.in_coords.shape[0] if transposed else km.out_coords.shape[0]
    counts = km.host_counts().tolist()
    pairs = sum(counts) - (counts[centre] if centre >= 0 else 0)
    per_output = pairs / max(n_out, 1)
    key = ch.dataflow_key(layer, c_in, c_out, w.shape[0], f.dtype, transposed, n_out)
    return ch.dataflow_for(key, c_in, c_out, f.dtype, n_out, map_given, per_output)


def sparse_conv3d(x: SparseTensor, weight: Array, kernel_size: IntOr3 = 3, stride: IntOr3 = 1,
                  dilation: IntOr3 = 1, transposed: bool = False, kernel_map: KernelMap | None = None,
                  backend: str | None = None, tile_size: int | tuple[int, int] | None = None,
                  layer: str | None = None, sort_offsets: bool = True,
                  max_padding: float = gg.DEFAULT_MAX_PADDING, solo_rows: int = gg.DEFAULT_SOLO_ROWS,
                  launch_rows: int | None = None, dataflow: str = "auto") -> SparseTensor:
    """3D sparse convolution of ``x`` (a :class:`SparseTensor`) with ``weight``.

    Parameters
    ----------
    weight : (K, C_in, C_out), the dtype of ``x.features``
        One matrix per kernel offset, in :func:`numba_sc.kernel_offsets` order.
    kernel_size, stride, dilation : int or 3 ints
        Used to build the map; ignored when ``kernel_map`` is given (the map's own
        win). Even and anisotropic kernels are allowed.
    transposed : bool
        Upsampling: ``kernel_map`` must be the map of the strided layer this one
        inverts (``y.kernel_map`` of that layer's output ``y``, which is ``x``).
        Nothing is built: the strided layer's metadata are read backwards.
    kernel_map : KernelMap, optional
        Reuse a map (no second Map step): for a forward layer, it must have been
        built on ``x``'s coordinates. A map passed in also keeps the metadata built
        from it, so the next layer given it skips that too; so does a strided
        layer's own map, for the transposed layer that will invert it.
    backend : None | "cuda" | "reference"
        float64 features and weight (the oracle's) run on ``"reference"`` only.
    tile_size : None | int | (int, int)
        Gather and scatter tile sizes (channels per thread). None: the autotuned
        choice for this ``layer`` (see :func:`numba_sc.autotune`), else a heuristic.
    layer : hashable, optional
        Names the layer, for the autotuning cache and in error messages.
    sort_offsets, max_padding, solo_rows, launch_rows
        The GEMM grouping policy (:mod:`numba_sc.gmas.gemm_grouping`). ``launch_rows``:
        the padding rows one GEMM launch is worth; None prices it by the
        channels (:func:`numba_sc.gmas.gemm_grouping.launch_rows`), 0 groups by
        ``max_padding`` alone, as in the paper.
    dataflow : "auto" | "gmas" | "fetch" | "implicit"
        How the features move through the GEMMs. ``"gmas"``: Minuet's gather,
        grouped GEMMs, scatter (the stages above). ``"fetch"``: fetch-on-demand,
        input rows read straight into each offset's product, results added with
        atomics (:mod:`numba_sc.dataflows.fetch_on_demand`). ``"implicit"``: implicit GEMM,
        each output tile summing over the offsets its rows have
        (:mod:`numba_sc.dataflows.implicit_gemm`). ``"auto"``: the dataflow measured fastest
        for this layer by :func:`numba_sc.choose_dataflow`, else the rule of thumb
        of :mod:`numba_sc.dataflows.choice` (on the reference backend, always
        ``"gmas"``, so that a result never depends on what ran before). All give the
        same output up to float rounding.

    Returns a :class:`SparseTensor` on the output coordinates with the output
    tensor stride, its ``kernel_map`` set to the map used (for a transposed
    layer, the strided map's :meth:`~numba_sc.KernelMap.transposed`, made when
    first read).
    """
    return convolve(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend,
                 tile_size, layer, sort_offsets, max_padding, solo_rows, launch_rows, dataflow=dataflow)


def convolve(x, weight, kernel_size=3, stride=1, dilation=1, transposed=False, kernel_map=None,
          backend=None, tile_size=None, layer=None, sort_offsets=True,
          max_padding=gg.DEFAULT_MAX_PADDING, solo_rows=gg.DEFAULT_SOLO_ROWS, launch_rows=None,
          keep_plan=False, keep_buffer=None, dataflow="auto"):
    """:func:`sparse_conv3d`, and ``keep_plan``: keep the plan on a map the layer builds
    itself (:mod:`numba_sc.nn` keeps every map it builds, for the layers after it)."""
    bk = resolve_backend(backend)
    check_layer_name(layer)
    if isinstance(x, SparseTensor):  # (anything else is refused below, by name)
        cv.check_backend_dtype(x.features.dtype, bk, "x's features")
    queued = []  # (centre, product) when queued during the Map step's read

    def queue_centre(m, f, w):
        # The submanifold centre product needs the map's coordinates but neither
        # its counts nor the metadata. Queued while the Map step's report is on
        # its way to the host, it runs on the GPU right after the search, and
        # the host spends the time it would have waited for the search issuing
        # it. (A submanifold map is one whose outputs are its inputs; its centre
        # is checked against the counts below, after the read.)
        c = centre_offset(m) if m.out_coords is m.in_coords else -1
        if c >= 0:
            queued.append((c, gg.centre_product_cuda(f, w, c)))

    f, w, km = _map_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, bk,
                          queue_centre if bk == "cuda" else None, layer)
    init = None
    centre = submanifold_centre(km)  # (-1 for a strided map, read backwards or not)
    if bk == "cuda":
        if queued and queued[0][0] == centre:
            init = queued[0][1]
        elif centre >= 0:
            # A given map: queued now, before the metadata, which keeps the GPU busy
            # while the host works out the buffer layout in Python.
            init = gg.centre_product_cuda(f, w, centre)
    strided = tuple(km.stride) != (1, 1, 1)
    flow = _pick_dataflow(dataflow, layer, f, w, km, transposed, keep_buffer is not None, kernel_map is not None,
                          centre, bk)
    if flow != "gmas":
        out = _other_dataflow(flow, f, w, km, transposed, init, centre, bk)
        return _result(x, km, out, transposed, strided)
    lr = launch_rows_for(launch_rows, w)
    if kernel_map is not None or keep_plan or (strided and not transposed):
        # a map reused (so may its plan be), or kept for later layers: a strided
        # map's plan is read backwards by the transposed layer that inverts it
        plan = layer_plan(km, sort_offsets, max_padding, solo_rows, launch_rows, lr, bk)
    else:
        plan = build_plan(km, sort_offsets, max_padding, solo_rows, backend=bk, launch_rows=lr)
    if transposed:
        plan = plan.transposed()
    n_out = plan.n_out
    tiles = resolve_tiles(tile_size, w.shape[1], w.shape[2], f.shape[0], n_out, f.dtype,
                          w.shape[0], transposed, layer)
    out = gmas(f, w, plan, tiles, bk, init, keep_buffer if bk == "cuda" else None)
    return _result(x, km, out, transposed, strided)


def _result(x, km, out, transposed, strided):
    """The layer's output tensor on the map's output side (see :func:`sparse_conv3d`)."""
    if transposed:
        return SparseTensor.from_layer(like(km.in_coords, x.coords), like(out, x.features),
                                     km.tensor_stride, km.transposed)
    return SparseTensor.from_layer(like(km.out_coords, x.coords), like(out, x.features),
                                 km.out_tensor_stride, km, None if strided else x.maps)


def autotune(x, weight, kernel_size=3, stride=1, dilation=1, transposed=False,
             kernel_map=None, samples=None, rounds=5, timer=None, layer=None,
             backend=None) -> TileChoice:
    """Choose and cache the gather and scatter tile sizes of one layer (Algorithm 2).

    Takes the arguments of :func:`numba_sc.sparse_conv3d`; ``samples`` are more
    sparse tensors to tune on (default: ``[x]``; with ``kernel_map`` given, only
    ``x``). ``layer`` names the layer in the cache; later calls of
    ``sparse_conv3d(..., layer=same name)`` (or, without names, with the same
    channels, kernel volume, dtype and direction) use the choice.

    On a GPU the search times every divisor with CUDA events (``rounds``
    interleaved rounds, median; :func:`search_tiles`). Under the simulator or the
    reference backend timing is meaningless and :func:`heuristic_tile` decides,
    unless ``timer(fn) -> seconds`` (the time of one call) is given.
    """
    bk = resolve_backend(backend)
    check_layer_name(layer)
    tensors = [x] + list(samples or []) if kernel_map is None else [x]
    prepared = [prepare_layer(s, weight, kernel_size, stride, dilation, transposed,
                               kernel_map, bk) for s in tensors]
    feats, w, km, plan = prepared[0]
    c_in, c_out = w.shape[1], w.shape[2]
    key = layer_key(layer, c_in, c_out, w.shape[0], feats.dtype, transposed)
    warmup = timer is None
    if timer is None and bk == "cuda" and not simulating():
        timer = gpu_time_once
    if timer is None or bk == "reference":
        n_in, n_out = feats.shape[0], plan.n_out
        item = np.dtype(feats.dtype).itemsize
        choice = TileChoice(heuristic_tile(c_in, n_in, item), heuristic_tile(c_out, n_out, item),
                            "heuristic")
    else:
        g, s, timings = search_tiles([(f, p) for f, _, _, p in prepared], c_out, timer, rounds,
                                     warmup)
        choice = TileChoice(g, s, "autotuned", timings)
    remember(key, choice)
    return choice


def choose_dataflow(x, weight, kernel_size=3, stride=1, dilation=1, transposed=False,
                    kernel_map=None, layer=None, rounds=5, timer=None, backend=None) -> ch.Choice:
    """Measure the three dataflows on one layer and cache the fastest for ``dataflow="auto"``.

    Takes the arguments of :func:`sparse_conv3d` and times it with each dataflow
    the way a user meets it (:func:`numba_sc.dataflows.choice.wall_timer`: wall clock
    between device-wide synchronizes; ``rounds`` interleaved rounds, medians).
    A layer given ``kernel_map`` reuses its plans after the first call, as the
    layers of a network do; without one every call builds its map and plans.
    The choice is cached under ``layer`` when named, else under the layer's shape
    and the cloud's size class (:func:`numba_sc.dataflows.choice.dataflow_key`).

    Without a GPU (the simulator, the reference backend) timing means nothing:
    the rule of thumb's answer comes back, and nothing is cached, unless
    ``timer(fn) -> seconds`` is given (how the tests drive the measurement).
    """
    bk = resolve_backend(backend)
    check_layer_name(layer)

    def run(d):
        return lambda: convolve(x, weight, kernel_size, stride, dilation, transposed, kernel_map, bk,
                             layer=layer, dataflow=d)

    y = run("gmas")()
    w = to_device(weight) if bk == "cuda" else weight
    key = ch.dataflow_key(layer, w.shape[1], w.shape[2], w.shape[0], x.features.dtype, transposed, len(y))
    if timer is None and bk == "cuda" and not simulating():
        timer = ch.wall_timer
    if timer is None:
        km = kernel_map if kernel_map is not None else y.kernel_map
        return ch.Choice(_pick_dataflow("auto", layer, x.features, w, km, transposed, False, kernel_map is not None,
                                        submanifold_centre(km)), "rule")
    times = ch.measure({d: run(d) for d in ch.DATAFLOWS}, timer, rounds)
    choice = ch.Choice(min(times, key=times.get), "measured", times)
    ch.remember_dataflow(key, choice)
    return choice

