"""The layer's argument checks: its weight, its name, a map given to it, its tile sizes.

Every entry of the layer (:func:`numba_sc.sparse_conv3d`, :func:`numba_sc.autotune`,
:func:`numba_sc.choose_dataflow`, :func:`numba_sc.sparse_conv3d_backward`) checks its
arguments here, before any device work, so that a wrong shape is reported by
name (the layer's, when it has one) and not as an index error inside a kernel.

Worked example: a 3x3x3 layer of 4 input channels wants a weight (27, 4, C_out);
given (9, 4, 16) it says ``weight must have shape (27, 4, C_out) for kernel_size
(3, 3, 3) (K = 27 offsets, in kernel_offsets order) and 4 input channels``.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.tensor import same_coordinates
from ..gmas import gemm_grouping as gg
from ..gmas.autotune import heuristic_tile, layer_key, tuned_tiles
from ..gmas.gather import check_tile


def check_weight(weight, K, c_in, dtype, kernel_size, layer=None):
    """The layer's weight (:func:`numba_sc.core.conventions.check_weight`), the message
    naming the kernel size and the layer."""
    ks = tuple(kernel_size)
    cv.check_weight(weight, K, c_in, dtype, f" for kernel_size {ks} (K = {K} offsets, in kernel_offsets order) "
                    f"and {c_in} input channels", where(layer))


def check_layer_name(layer):
    """``layer`` names a layer in the caches (tiles, dataflow choices): None or a hashable
    value, usually a string."""
    try:
        hash(layer)
    except TypeError:
        raise TypeError(f"layer must be a name for the layer, e.g. a string such as 'enc1' (or None), "
                        f"got {layer!r}") from None


def where(layer):
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
    at = where(layer)
    if len(x) != len(coords):
        raise ValueError(
            f"{at}kernel_map does not fit x: its {side} side has {len(coords)} coordinates, x has "
            f"{len(x)}. " + hint)
    if tuple(x.stride) != ts:
        raise ValueError(
            f"{at}kernel_map was built for tensor stride {ts} on its {side} side, but x has stride "
            f"{tuple(x.stride)}")
    if not same_coordinates(coords, x.coords):
        raise ValueError(
            f"{at}kernel_map was built on other coordinates than x's: both have {len(x)} points, "
            f"but not the same ones, so its pairs would read the wrong rows. " + hint)


def resolve_tiles(tile_size, c_in, c_out, n_in, n_out, dtype, K, transposed, layer=None):
    """``tile_size`` argument -> (gather tile, scatter tile).

    ``None``: the autotuner's cached choice for this layer, else the heuristic;
    an int: the same tile for both (it must divide C_in and C_out); a pair:
    (gather tile dividing C_in, scatter tile dividing C_out).
    """
    if tile_size is None:
        choice = tuned_tiles(layer_key(layer, c_in, c_out, K, dtype, transposed))
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


def launch_rows_for(launch_rows, w):
    """The ``launch_rows`` argument: None prices a GEMM launch by the layer's channels."""
    if launch_rows is None:
        return gg.launch_rows(w.shape[1], w.shape[2], w.itemsize)
    if not isinstance(launch_rows, (int, np.integer)) or isinstance(launch_rows, bool) or launch_rows < 0:
        raise ValueError(f"launch_rows must be None or an int >= 0 (0: the plain padding policy), "
                         f"got {launch_rows!r}")
    return int(launch_rows)
