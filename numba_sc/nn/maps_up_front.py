"""A network's maps built up front, all together, before its first layer runs.

A layer of :mod:`numba_sc.nn` builds its map when it first meets a set of
coordinates, in the middle of the forward pass, and every build ends by reading a
small report from the device (the pairs per offset, the error flags; a strided
layer's output count rides in it). A read makes the host wait until the GPU
has run *everything* queued before it, the previous layers' products included, and
then the GPU waits while the host queues the next kernels. On a large scan the
kernels are long and these stalls are noise; on a scan of 20k voxels a layer's
kernels take tens of microseconds and a MinkUNet42 pass holds eight such stalls.

But a map depends on the coordinates alone, never on a feature (Spira, arXiv
2511.20834, builds a network's maps at its start for this reason). So the maps a
network will need can all be built before its first layer:

1. **The plan** (:class:`MapPlan`): which maps the network builds, as a tree of
   coordinate sets: on each set, the submanifold maps (by kernel size and dilation)
   and the strided maps down to coarser sets, each with its own plan. It is recorded
   from the maps the first forward pass left on its input (``x.maps``), once per
   network and input stride; the networks of this package never change it.
2. **Every level's coordinates at once.** A level of total stride ``T`` has the
   coordinates ``floor(P / T) * T`` of the *input* ``P`` (a floor of a floor is the
   floor of the product: ``floor(floor(p / a) / b) = floor(p / (a b))``), so no level
   waits for the one above it. Each is packed, sorted and de-duplicated
   (:func:`numba_sc.coords.output_coords.start_output_coords`), and all their counts
   come back in one read.
3. **Every map at once**: each map's search is queued and its report's copy started
   (:func:`numba_sc.map.driver.start_kernel_map_cuda`); then the host waits, once,
   for the reports.
4. The maps go where the layers look for them (``x.maps`` and the coarser sets'
   :class:`~numba_sc.core.tensor.CoordinateMaps`), so the forward pass builds nothing
   and reads nothing: the host queues layer after layer while the GPU works.

Two reads a pass instead of one or two per map-building layer. The maps are the ones
the layers would have built (the same calls, the same arguments: the tests compare
every table). :class:`numba_sc.nn.Module` runs this for the outermost module of a
call on the kernel backends; ``model.maps_up_front = False`` switches it off (the
layers then build their maps as they meet new coordinates, as before), which is how
the benchmarks compare the two (``benchmarks/bench_net.py --maps-up-front``).
"""
from __future__ import annotations

import numpy as np

from ..coords.output_coords import finish_output_coords, start_output_coords
from ..core.backend import filled, to_device, to_host
from ..core.device import device_xp
from ..core.tensor import CoordinateMaps
from ..map.driver import start_kernel_map_cuda
from ..map.method import auto_map_method


class MapPlan:
    """The maps a network builds on one coordinate set: ``subm`` (keys ``(kernel_size,
    dilation)``) and ``down`` (``(kernel_size, stride, dilation) -> MapPlan`` of the
    coarser set that strided map leads to). Keys are the layers' (:func:`~numba_sc.core.tensor.map_key`)."""

    __slots__ = ("subm", "down")

    def __init__(self, subm=(), down=()):
        self.subm, self.down = tuple(subm), tuple(down)

    @classmethod
    def record(cls, maps: CoordinateMaps) -> "MapPlan":
        """The plan of the maps a forward pass left on ``maps`` (and below it)."""
        return cls(maps.subm.keys(), ((key, cls.record(coarse)) for key, (_, coarse) in maps.down.items()))

    def __len__(self):
        """How many maps the plan builds."""
        return len(self.subm) + sum(1 + len(p) for _, p in self.down)

    def __repr__(self):
        return f"MapPlan(subm={list(self.subm)}, down={dict(self.down)})"


def _levels(plan, stride, path=()):
    """Every coordinate set of the plan below the root, parents first:
    ``(path of down keys, plan, tensor stride)``."""
    for key, sub in plan.down:
        s = tuple(a * b for a, b in zip(stride, key[1]))
        yield path + (key,), sub, s
        yield from _levels(sub, s, path + (key,))


def build_maps(plan: MapPlan, x) -> None:
    """Build every map of ``plan`` on ``x``'s coordinates and put them in ``x.maps``
    (kernel backends: the GPU, or the simulator). See the module docstring."""
    root_stride = tuple(x.stride)
    coords = {(): to_device(x.coords)}
    levels = list(_levels(plan, root_stride))
    # 2. every level's coordinates from the input, counted into one report
    if levels:
        report = filled(2 * len(levels), np.int64, 0)
        pending = [start_output_coords(coords[()], tuple(s // r for s, r in zip(ts, root_stride)), root_stride,
                                       report=report[2 * i:2 * i + 2])
                   for i, (_, _, ts) in enumerate(levels)]
        counts = to_host(report)  # read 1
        for i, ((path, _, _), p) in enumerate(zip(levels, pending)):
            coords[path] = finish_output_coords(p, counts[2 * i:2 * i + 2])
    # 3. every map queued, then their reports read together
    nodes = [((), plan, root_stride)] + levels
    def start(c, ks, st, dil, ts, out=None):  # as a layer builds its map (conv.prepare), the read left for later
        return start_kernel_map_cuda(c, ks, st, dil, ts, out_coords=out, assume_sorted=True, masks=True,
                                     method=auto_map_method(c.shape[0], ks, st, dil, ts), read=False)

    queued = []  # (path, key, child path or None, pending map)
    for path, node, ts in nodes:
        c = coords[path]
        for ks, dil in node.subm:
            queued.append((path, (ks, dil), None, start(c, ks, 1, dil, ts)))
        for key, _ in node.down:
            ks, st, dil = key
            queued.append((path, key, path + (key,), start(c, ks, st, dil, ts, coords[path + (key,)])))
    reports = [p.report for *_, p in queued]
    host = to_host(device_xp().concatenate(reports)) if reports else None  # read 2
    # 4. into the coordinate sets, where the layers look
    sets, start = {(): x.maps}, 0
    for (path, key, child, p), r in zip(queued, reports):
        km = p.result(host[start:start + r.shape[0]])
        start += r.shape[0]
        if child is None:
            sets[path].subm[key] = km
        else:
            coarse = sets.setdefault(child, CoordinateMaps())
            sets[path].down[key] = (km, coarse)
            coarse.up[key] = (km, sets[path], None)  # the strided layer names itself when it runs


def plan_key(x):
    """Plans are kept per input stride and coordinate columns (a batch column or not)."""
    return tuple(x.stride), int(x.coords.shape[1])


def before_forward(model, x, backend) -> None:
    """Called by :meth:`numba_sc.nn.Module.__call__` for the outermost module: build the
    maps up front when the model has a plan for inputs like ``x`` and ``x`` has none yet."""
    if backend != "cuda" or not getattr(model, "maps_up_front", False):
        return
    plan = model.__dict__.get("_map_plans", {}).get(plan_key(x))
    maps = x.maps
    if plan is not None and saves_reads(plan) and not (maps.subm or maps.down):
        build_maps(plan, x)


def saves_reads(plan: MapPlan) -> bool:
    """Whether building ``plan`` up front reads the device fewer times than its layers
    would: up front, two reads in all (one when every map is on the input's own
    coordinates); built by the layers, one read a map (a strided layer counts its
    outputs on the device, :mod:`numba_sc.map.kernel_map`). So a lone layer, or a
    submanifold and a strided layer, gain nothing by it."""
    return len(plan) > (2 if plan.down else 1)


def after_forward(model, x, backend) -> None:
    """Record the plan of the first forward pass on inputs like ``x``."""
    if backend != "cuda" or not getattr(model, "maps_up_front", False):
        return
    plans = model.__dict__.setdefault("_map_plans", {})
    if plan_key(x) not in plans:
        plans[plan_key(x)] = MapPlan.record(x.maps)
