"""What a layer reads before its dataflow runs: its arrays on the backend's side, its
kernel map (the Map step, unless one is given) and the GMaS plan of that map.

A plan depends on the map and the grouping policy only (not on features,
weights or channels), so it is built once and kept on the map
(:func:`layer_plan`): layers that share a map share its plan, as spconv's layers
that share an ``indice_key`` share their pairs, and the transposed layer that
inverts a strided layer reads that layer's plan backwards
(:meth:`numba_sc.gmas.layout.GmasPlan.transposed`), building nothing.

Worked example: MinkUNet42 meets 5 coordinate sets; its 5 submanifold maps and 4
strided ones are each built once (Map step and metadata), and its 4 transposed
layers build nothing (``tests/nn/test_models.py``).
"""
from __future__ import annotations

from ..core.backend import to_device, to_host
from ..core.tensor import SparseTensor
from ..gmas import gemm_grouping as gg
from ..gmas.plan import build_plan
from ..map.kernel_map import layer_arguments
from ..map.map_step import build_kernel_map
from .arguments import check_map_fits, check_weight, launch_rows_for, where


def prepare_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend,
                  sort=True, max_padding=gg.DEFAULT_MAX_PADDING, solo_rows=gg.DEFAULT_SOLO_ROWS,
                  launch_rows=None):
    """Checks, the Map step (unless a map is given) and the metadata.

    Returns ``(features, weight, km, plan)`` on the backend's side, where ``km`` is
    the map the layer reads (for a transposed layer: the strided map it reads
    backwards) and ``weight`` is indexed like ``km.offsets``; ``plan.n_out`` is
    the number of output rows.
    """
    f, w, km = map_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend)
    lr = launch_rows_for(launch_rows, w)
    if transposed:
        return f, w, km, layer_plan(km, sort, max_padding, solo_rows, launch_rows, lr, backend).transposed()
    return f, w, km, build_plan(km, sort, max_padding, solo_rows, backend=backend, launch_rows=lr)


def gmas_plan(km, keep, transposed, sort, max_padding, solo_rows, launch_rows, priced_rows, backend):
    """The GMaS plan a layer runs: kept on the map (:func:`layer_plan`) when ``keep``
    (a map reused, or kept for later layers), else built for this call only; read
    backwards for a transposed layer."""
    if keep:
        plan = layer_plan(km, sort, max_padding, solo_rows, launch_rows, priced_rows, backend)
    else:
        plan = build_plan(km, sort, max_padding, solo_rows, backend=backend, launch_rows=priced_rows)
    return plan.transposed() if transposed else plan


def layer_plan(km, sort, max_padding, solo_rows, launch_rows, priced_rows, backend):
    """The metadata of a map under this policy, built once and kept on the map.

    The second and later layers given the map skip the metadata kernels (their
    GPU time on SemanticKITTI: ``python -m numba_sc ladder metadata``, recorded in
    ``benchmarks/results/ladder_all_kitti.json``).

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


def map_layer(x, weight, kernel_size, stride, dilation, transposed, kernel_map, backend,
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
        raise TypeError(f"{where(layer)}x must be a numba_sc.SparseTensor, got {type(x).__name__}")
    move = to_host if backend == "reference" else to_device
    if transposed:
        if kernel_map is None:
            raise ValueError(
                f"{where(layer)}transposed=True needs kernel_map=: the map of the strided layer it "
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
