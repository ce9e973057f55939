"""The sparse convolution, assembled: SparseTensor, Map step, then one dataflow.

A :class:`SparseTensor` is a set of unique integer coordinates, sorted once at
construction, with one feature row per coordinate and a tensor stride (the
spacing of its grid, in finest voxels). :func:`sparse_conv3d` computes (paper
Eq. 2, DESIGN.md "the rule")::

    out[q_i] = sum over offsets k with q_i + delta_k in P of  in[q_i + delta_k] @ W[k]

in two steps (paper Figure 6):

1. **Map** (:mod:`numba_sc.map.kernel_map`): the output coordinates and the kernel
   map ``table[k, i]`` = input at ``out[i] + delta_k``, or -1. Skipped when a
   ``kernel_map`` is passed (layers sharing coordinates share one map).
2. **GMaS** (:func:`numba_sc.conv.dataflow.gather_gemm_scatter`), stages 7-11, one
   module each:

   =============  ===============================================================
   metadata       pairs per offset, the offset order, the groups, every pair's
                  buffer row; the input and output tables
   gather         input rows -> input buffer (Algorithm 1, tiled)
   gemm_grouping  one batched GEMM per group of offsets (sorted by pair count)
   scatter        output buffer -> output rows (tiled, no atomics)
   autotune       tile sizes per layer (Algorithm 2)
   =============  ===============================================================

   plus the submanifold centre, multiplied directly (``F @ W[centre]``) when
   the offset (0, 0, 0) maps every point to itself; or another dataflow
   (fetch-on-demand, implicit GEMM; :mod:`numba_sc.conv.dataflow`), as
   ``dataflow=`` asks or :mod:`numba_sc.conv.choice` decides.

Worked example (the pairs of one axis): :mod:`numba_sc.conv.dataflow`.

Three kinds of layer:

* stride 1, *submanifold*: outputs on the input coordinates;
* stride s > 1, *downsampling*: outputs at ``floor(P / (s*t)) * (s*t)`` and
  tensor stride ``s*t``;
* ``transposed=True``, *upsampling*: given the map of the strided convolution it
  inverts, it returns features on that convolution's input coordinates (and
  tensor stride), reading each pair backwards: for the strided map's pair
  ``p = q + delta_k``, ``out[p] += in[q] @ W[k]``. ``W[k]`` is indexed like the
  strided layer's weights (``kernel_offsets`` order).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import conventions as cv
from ..core.backend import like, resolve_backend
from ..core.conventions import Array, IntOr3
from ..core.tensor import SparseTensor, as_array
from ..gmas import gemm_grouping as gg
from ..gmas.layout import centre_offset, submanifold_centre
from ..map.kernel_map import KernelMap
from .arguments import check_layer_name, launch_rows_for, resolve_tiles
from .choice import pick_dataflow
from .dataflow import fetch_or_implicit, gather_gemm_scatter
from .prepare import gmas_plan, map_layer


@dataclass(slots=True)  # (not frozen: a frozen init costs every layer call a microsecond more)
class LayerSettings:
    """The settings of one layer call: :func:`sparse_conv3d`'s arguments after ``x`` and
    ``weight`` (see its docstring), with its defaults."""

    kernel_size: IntOr3 = 3
    stride: IntOr3 = 1
    dilation: IntOr3 = 1
    transposed: bool = False
    kernel_map: KernelMap | None = None
    backend: str | None = None
    tile_size: int | tuple[int, int] | None = None
    layer: str | None = None
    sort_offsets: bool = True
    max_padding: float = gg.DEFAULT_MAX_PADDING
    solo_rows: int = gg.DEFAULT_SOLO_ROWS
    launch_rows: int | None = None
    dataflow: str = "auto"


def sparse_conv3d(x: SparseTensor, weight: Array, kernel_size: IntOr3 = 3, stride: IntOr3 = 1,
                  dilation: IntOr3 = 1, transposed: bool = False, kernel_map: KernelMap | None = None,
                  backend: str | None = None, tile_size: int | tuple[int, int] | None = None,
                  layer: str | None = None, sort_offsets: bool = True,
                  max_padding: float = gg.DEFAULT_MAX_PADDING, solo_rows: int = gg.DEFAULT_SOLO_ROWS,
                  launch_rows: int | None = None, dataflow: str = "auto") -> SparseTensor:
    """3D sparse convolution of ``x`` (a :class:`SparseTensor`) with ``weight``.

    Parameters
    ----------
    weight : (K, C_in, C_out), the dtype of ``x.features`` (a NumPy or CuPy array, or a PyTorch
        tensor or other DLPack array, read over the same memory)
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
        of :mod:`numba_sc.conv.choice` (on the reference backend, always
        ``"gmas"``, so that a result never depends on what ran before). All give the
        same output up to float rounding.

    Returns a :class:`SparseTensor` on the output coordinates with the output
    tensor stride, its ``kernel_map`` set to the map used (for a transposed
    layer, the strided map's :meth:`~numba_sc.KernelMap.transposed`, made when
    first read).
    """
    weight = as_array(weight, "weight")  # (a PyTorch tensor, or any DLPack array, over the same memory)
    return convolve(x, weight, LayerSettings(kernel_size, stride, dilation, transposed, kernel_map, backend,
                                             tile_size, layer, sort_offsets, max_padding, solo_rows,
                                             launch_rows, dataflow))


def convolve(x, weight, settings: LayerSettings | None = None, *, keep_plan=False, keep_buffer=None, **kw):
    """:func:`sparse_conv3d` with its settings as a :class:`LayerSettings` (or as its
    keywords, ``kw``), and two more, for :mod:`numba_sc.nn`: ``keep_plan``, keep the plan
    on a map the layer builds itself (nn keeps every map it builds, for the layers
    after it); ``keep_buffer``, a list that receives the gathered input buffer, for
    the weight gradient (training runs dataflow "gmas")."""
    s = LayerSettings(**kw) if settings is None else settings
    kernel_map = s.kernel_map
    bk = resolve_backend(s.backend)
    check_layer_name(s.layer)
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

    f, w, km = map_layer(x, weight, s.kernel_size, s.stride, s.dilation, s.transposed, kernel_map, bk,
                         queue_centre if bk == "cuda" else None, s.layer)
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
    flow = pick_dataflow(s.dataflow, s.layer, f, w, km, s.transposed, keep_buffer is not None,
                         kernel_map is not None, centre, bk)
    if flow != "gmas":
        out = fetch_or_implicit(flow, f, w, km, s.transposed, init, centre, bk)
        return result(x, km, out, s.transposed, strided)
    lr = launch_rows_for(s.launch_rows, w)
    # a map reused (so may its plan be), or kept for later layers: a strided
    # map's plan is read backwards by the transposed layer that inverts it
    keep = kernel_map is not None or keep_plan or (strided and not s.transposed)
    plan = gmas_plan(km, keep, s.transposed, s.sort_offsets, s.max_padding, s.solo_rows, s.launch_rows, lr, bk)
    tiles = resolve_tiles(s.tile_size, w.shape[1], w.shape[2], f.shape[0], plan.n_out, f.dtype,
                          w.shape[0], s.transposed, s.layer)
    out = gather_gemm_scatter(f, w, plan, tiles, bk, init, keep_buffer if bk == "cuda" else None,
                              kernel_map=km, transposed=s.transposed)
    return result(x, km, out, s.transposed, strided)


def result(x, km, out, transposed, strided):
    """The layer's output tensor on the map's output side (see :func:`sparse_conv3d`)."""
    if transposed:
        return SparseTensor.from_layer(like(km.in_coords, x.coords), like(out, x.features),
                                       km.tensor_stride, km.transposed)
    return SparseTensor.from_layer(like(km.out_coords, x.coords), like(out, x.features),
                                   km.out_tensor_stride, km, None if strided else x.maps)
