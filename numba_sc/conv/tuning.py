"""Measured choices for a layer: its tile sizes (:func:`autotune`, paper Algorithm 2)
and its dataflow (:func:`choose_dataflow`), remembered for ``tile_size=None`` and
``dataflow="auto"`` in :data:`numba_sc.core.state.STATE` until
:func:`numba_sc.clear_caches`.

Both time the layer the way a user meets it, on a GPU only: under the simulator
or on the reference backend timing means nothing, and the heuristic or the rule
of thumb answers unless a ``timer(fn) -> seconds`` is given (how the tests drive
the measurement).

Worked example, on a GPU::

    ns.choose_dataflow(x, w, layer="enc1")   # times gmas, fetch, implicit: say implicit wins
    ns.sparse_conv3d(x, w, layer="enc1")     # dataflow="auto" now runs implicit
    ns.clear_caches()                        # forgotten: "auto" is the rule of thumb again
"""
from __future__ import annotations

import numpy as np

from ..core.backend import resolve_backend, to_device
from ..core.device import simulating
from ..core.measure import Choice, measure, wall_timer
from ..gmas.autotune import TileChoice, gpu_time_once, heuristic_tile, keep_tiles, layer_key, search_tiles
from ..gmas.layout import submanifold_centre
from . import choice as ch
from .arguments import check_layer_name
from .choice import pick_dataflow
from .layer import LayerSettings, convolve
from .prepare import prepare_layer


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
    keep_tiles(key, choice)
    return choice


def choose_dataflow(x, weight, kernel_size=3, stride=1, dilation=1, transposed=False,
                    kernel_map=None, layer=None, rounds=5, timer=None, backend=None) -> Choice:
    """Measure the three dataflows on one layer and cache the fastest for ``dataflow="auto"``.

    Takes the arguments of :func:`sparse_conv3d` and times it with each dataflow
    the way a user meets it (:func:`numba_sc.core.measure.wall_timer`: wall clock
    between device-wide synchronizes; ``rounds`` interleaved rounds, medians).
    A layer given ``kernel_map`` reuses its plans after the first call, as the
    layers of a network do; without one every call builds its map and plans.
    The choice is cached under ``layer`` when named, else under the layer's shape
    and the cloud's size class (:func:`numba_sc.conv.choice.dataflow_key`).

    Without a GPU (the simulator, the reference backend) timing means nothing:
    the rule of thumb's answer comes back, and nothing is cached, unless
    ``timer(fn) -> seconds`` is given (how the tests drive the measurement).
    """
    bk = resolve_backend(backend)
    check_layer_name(layer)

    def run(d):
        s = LayerSettings(kernel_size, stride, dilation, transposed, kernel_map, bk, layer=layer, dataflow=d)
        return lambda: convolve(x, weight, s)

    y = run("gmas")()
    w = to_device(weight) if bk == "cuda" else weight
    key = ch.dataflow_key(layer, w.shape[1], w.shape[2], w.shape[0], x.features.dtype, transposed, len(y))
    if timer is None and bk == "cuda" and not simulating():
        timer = wall_timer
    if timer is None:
        km = kernel_map if kernel_map is not None else y.kernel_map
        return Choice(pick_dataflow("auto", layer, x.features, w, km, transposed, False, kernel_map is not None,
                                        submanifold_centre(km)), "rule")
    times = measure({d: run(d) for d in ch.DATAFLOWS}, timer, rounds)
    choice = Choice(min(times, key=times.get), "measured", times)
    ch.remember_dataflow(key, choice)
    return choice

