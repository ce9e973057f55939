"""The Map step's one entry: :func:`build_kernel_map` picks the method and the backend.

The step itself is explained in :mod:`numba_sc.map.kernel_map` (with its NumPy
reference); the library's fast path is :mod:`numba_sc.map.driver`; which method
``method="auto"`` runs is :mod:`numba_sc.map.method`'s to say. This module only
puts them together, and hands the map back in the kind of arrays the caller
passed::

    build_kernel_map(coords, 3)                       # method "auto", backend "cuda" (on a GPU)
      -> auto_map_method(len(coords), 3)              # "sorted", unless measured otherwise
      -> build_kernel_map_cuda(coords, 3, method="sorted")    # numba_sc.map.driver
    build_kernel_map(coords, 3, backend="reference")
      -> build_kernel_map_reference(coords, 3, method="sorted")  # numba_sc.map.kernel_map
"""
from __future__ import annotations

from ..core import conventions as cv
from ..core.backend import like, resolve_backend
from ..core.device import is_cupy, simulating
from .backward_search import DEFAULT_QUERY_BLOCK, DEFAULT_SOURCE_BLOCK
from .driver import build_kernel_map_cuda
from .kernel_map import KernelMap, build_kernel_map_reference, check_columns
from .method import auto_map_method


def build_kernel_map(in_coords: cv.Array, kernel_size: cv.IntOr3 = 3, stride: cv.IntOr3 = 1,
                     dilation: cv.IntOr3 = 1, tensor_stride: cv.IntOr3 = 1, out_coords: cv.Array | None = None,
                     backend: str | None = None, source_block: int = DEFAULT_SOURCE_BLOCK,
                     query_block: int = DEFAULT_QUERY_BLOCK, assume_sorted: bool = False, symmetric: bool = True,
                     masks: bool = False, while_reading=None, method: str = "auto") -> KernelMap:
    """Build the kernel map of a sparse convolution (Minuet's Map step, or an alternative).

    Parameters
    ----------
    in_coords : int array (N, 3) or (N, 4)
        Unique input voxel coordinates (batch index in column 0 for (N, 4)); any
        order. Clouds of different batch indices never share a pair.
    kernel_size, stride, dilation : int or 3 ints
        The layer. Offsets are :func:`numba_sc.kernel_offsets`
        ``(kernel_size, dilation, tensor_stride)``.
    tensor_stride : int or 3 ints
        Stride of the input tensor; the output's is ``tensor_stride * stride``.
    out_coords : int array (M, 3|4), optional
        Output coordinates. Default: ``output_coordinates(in_coords, stride,
        tensor_stride)``, which is the input itself for stride 1.
    backend : None | "cuda" | "reference"
    source_block : int
        B, keys per source block: a power of two in 32..4096 (default 512, the fastest in our sweep).
    query_block : int
        C, the largest balanced query block (default 1024).
    assume_sorted : bool
        The caller vouches that ``in_coords`` are sorted and unique (a
        :class:`numba_sc.SparseTensor`'s coordinates are): input that is not
        raises a ValueError instead of being sorted. Either way sorted input
        costs no sort, and unsorted input without the promise costs one sort
        and a second search (the first, optimistic one finds out).
    symmetric : bool
        For a submanifold layer whose offsets come in ± pairs (any odd kernel),
        search only the first ``ceil(K / 2)`` segments and write each pair found
        twice, once for ``delta`` and once, mirrored, for ``-delta``
        (:func:`numba_sc.map.kernel_map.searched_segments`). The table is the same; the searches do half
        the work. ``False`` searches all K segments, as in the paper.
    masks : bool
        Also record, for every output and every input, which offsets have a pair
        there (``.out_masks``, ``.in_masks``: bits set by the forward search where
        it finds the pairs), for the metadata stage of a layer
        (:mod:`numba_sc.gmas.metadata`), which otherwise reads the whole table once
        more to find them. :func:`numba_sc.sparse_conv3d` asks for them; the Map
        step alone does not need them (on 1M random voxels they cost ~10 % of
        the step). Kernel path only: the reference ignores it.
    method : "sorted" | "hash" | "grid" | "auto"
        How the pairs are found; every method gives the same map.
        ``"sorted"``: Minuet's sorted queries and double-traversed binary search.
        ``"hash"``: an open-addressing hash table of the input keys and one lookup
        per query and offset, as spconv and TorchSparse do (:mod:`numba_sc.map.hash_map`).
        ``"grid"``: a dense location table over the inputs' bounding box, one read
        per lookup (:mod:`numba_sc.map.grid_map`; refused when the box is too large).
        ``"auto"`` (the default): the method :func:`numba_sc.choose_map_method`
        measured fastest for clouds of this size, else the rule of thumb of
        :mod:`numba_sc.map.method`.
        ``source_block`` and ``query_block`` matter to "sorted" only.
    while_reading : callable, optional
        Kernel path with ``assume_sorted=True`` only (ignored otherwise): called
        with the map once its arrays are queued and the copy of its report to
        the host has started, before the host waits for that copy. Work queued
        there runs on the GPU right after the search, while the host is still
        reading the report: :func:`numba_sc.sparse_conv3d` queues the submanifold
        centre product there, which needs the map's coordinates but not its
        counts. The map's counts, stats and error checks are not ready at that
        point (an error is raised after the call).

    Returns
    -------
    KernelMap
        ``table[k, i]`` is the index into ``.in_coords`` of the input at
        ``.out_coords[i] + .offsets[k]``, or -1. ``.stats`` holds teaching numbers:
        sizes, pairs and ``hit_rate``, query blocks before and after balancing and,
        from the reference only, the comparisons of the backward and forward
        searches (``backward_comparisons``, ``forward_comparisons``,
        ``comparisons_per_query``, and ``plain_binary_search_comparisons`` for
        contrast). On the kernel path, numbers that live on the device are 0-d
        arrays; ``float()`` / ``int()`` reads them.
    """
    check_columns(in_coords, out_coords)
    if method == "auto":
        method = auto_map_method(in_coords.shape[0], kernel_size, stride, dilation, tensor_stride)
    kw = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, tensor_stride=tensor_stride,
              out_coords=out_coords, source_block=source_block, query_block=query_block,
              assume_sorted=assume_sorted, symmetric=symmetric, masks=masks, method=method)
    if resolve_backend(backend) == "reference":
        m = build_kernel_map_reference(in_coords, **kw)
    else:
        m = build_kernel_map_cuda(in_coords, while_reading=while_reading, **kw)
    if is_cupy(in_coords) and not simulating():
        return m  # every array is on the device already: nothing to convert
    for name in ("in_coords", "out_coords", "_in_order", "table", "counts", "_out_order"):
        setattr(m, name, like(getattr(m, name), in_coords))
    m.stats = {key: like(v, in_coords) if hasattr(v, "shape") else v for key, v in m.stats.items()}
    return m

