"""Exercises of notebook 08, networks: the maps a network builds, and weights in spconv's layout.

* 8.1 how many Map steps a chain of layers builds, from the rule :mod:`numba_sc.nn`
  keys its maps by (a submanifold map per kernel on each coordinate set; a strided map
  per kernel and stride from a coordinate set; a transposed layer builds nothing and
  returns to the finer set, *with its maps*). The checker runs each chain as a network
  and counts the maps it left on the coordinates. The wrong answer forgets the last
  point: it makes the decoder build again what the encoder built;
* 8.2 a spconv weight ``(C_out, kx, ky, kz, C_in)`` as this library's ``(K, C_in, C_out)``:
  the kernel positions are enumerated the same way (x slowest), so it is a transpose and
  a reshape. The wrong answer reshapes without the transpose: the right shape, the
  wrong numbers (it reads C_out's axis as if it were the offsets'). The other slip
  enumerates the kernel positions z slowest.

8.1's other slip builds a map at every layer, as if nothing were ever found again.
"""
from __future__ import annotations

import numpy as np

from . import ExerciseFailed, Slip, exercise, expect_equal
from .inputs import crop_voxels


# -- 8.1 ------------------------------------------------------------------------------

# Chains of layers: ("subm", kernel), ("down", kernel, stride), ("up", kernel, stride).
CHAINS = [
    [("subm", 3), ("subm", 3), ("subm", 3)],
    [("subm", 3), ("subm", 5), ("subm", 3)],
    [("subm", 3), ("down", 2, 2), ("subm", 3), ("up", 2, 2), ("subm", 3)],
    [("down", 2, 2), ("subm", 3), ("down", 2, 2), ("subm", 3), ("up", 2, 2), ("subm", 3), ("up", 2, 2),
     ("subm", 3)],
    [("subm", 3), ("down", 2, 2), ("up", 2, 2), ("down", 2, 2), ("subm", 3)],
]


def _maps_built_forgetful(layers):
    """Wrong: after a transposed layer, counts the finer coordinates as a new set."""
    built, level = 0, {"subm": set(), "down": {}}
    for kind, *args in layers:
        if kind == "subm":
            built += args[0] not in level["subm"]
            level["subm"].add(args[0])
        elif kind == "down":
            key = tuple(args)
            built += key not in level["down"]
            level = level["down"].setdefault(key, {"subm": set(), "down": {}})
        else:
            level = {"subm": set(), "down": {}}
    return built


def _maps_built_every_layer(layers):
    """Wrong: every layer but a transposed one builds a map, as if none were kept."""
    return sum(kind != "up" for kind, *_ in layers)


MAPS_RULE = ("a submanifold layer builds a map unless its kernel's map is on the coordinate set already; a "
             "strided layer builds one unless the same downsampling (kernel and stride) already ran from this "
             "set; a transposed layer builds nothing and returns to the set its strided layer started from, "
             "with that set's maps")


def _network(chain, channels=2):
    from ... import nn

    layers = []
    for kind, *args in chain:
        if kind == "subm":
            layers.append(nn.SubMConv3d(channels, channels, args[0]))
        elif kind == "down":
            layers.append(nn.SparseConv3d(channels, channels, args[0], stride=args[1]))
        elif kind == "up":
            layers.append(nn.SparseInverseConv3d(channels, channels, args[0], stride=args[1]))
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
    return nn.Sequential(*layers)


def _maps_on(maps):
    """Maps kept on a coordinate set and on every coarser set made from it."""
    return len(maps.subm) + sum(1 + _maps_on(coarse) for _, coarse in maps.down.values())


@exercise("8.1", "how many maps a network builds", answer="maps_built",
          wrong=[Slip(_maps_built_forgetful, says="with that set's maps"),
                 Slip(_maps_built_every_layer, says="unless")])
def check_maps_built(maps_built):
    """``maps_built(chain)`` for a few chains of layers, against the maps each chain left
    on a crop's coordinates when run as a network (reference backend)."""
    import numba_sc as ns

    coords = crop_voxels(250, seed=8)
    rng = np.random.default_rng(82)
    for chain in CHAINS:
        x = ns.SparseTensor(coords, rng.normal(size=(len(coords), 2)).astype(np.float32))
        _network(chain)(x, backend="reference")
        expected = _maps_on(x.maps)
        got = maps_built(list(chain))
        if not isinstance(got, (int, np.integer)):
            raise ExerciseFailed(f"maps_built returned a {type(got).__name__}", "maps_built returns an int")
        expect_equal(int(got), expected, f"the Map steps of the chain {chain}", rule=MAPS_RULE)


# -- 8.2 ------------------------------------------------------------------------------

def _from_spconv_reshaped(w):
    """Wrong: a reshape alone keeps C_out as the slowest axis of memory."""
    w = np.asarray(w)
    return w.reshape(-1, w.shape[4], w.shape[0])


def _from_spconv_z_slowest(w):
    """Wrong: the kernel positions enumerated z slowest (kz, ky, kx), not x slowest."""
    w = np.asarray(w)
    return np.ascontiguousarray(np.transpose(w, (3, 2, 1, 4, 0)).reshape(-1, w.shape[4], w.shape[0]))


SPCONV_RULE = ("W[k, c_in, c_out] = w[c_out, kx, ky, kz, c_in], with k enumerating (kx, ky, kz) x slowest as "
               "kernel_offsets does: move C_out last (a transpose), then merge the three kernel axes (a "
               "reshape). A reshape alone regroups memory in order, and reads C_out's axis as the offsets'")


@exercise("8.2", "a spconv weight in this library's layout", answer="from_spconv",
          wrong=[Slip(_from_spconv_reshaped, says="reshape alone"), Slip(_from_spconv_z_slowest, says="x slowest")])
def check_from_spconv(from_spconv):
    """``from_spconv(w)`` on random spconv weights of several kernel shapes, against
    :func:`numba_sc.spconv_format.conv_weight_from_spconv`."""
    from ...nn.spconv_format import conv_weight_from_spconv

    rng = np.random.default_rng(81)
    for kernel, c_in, c_out in [((3, 3, 3), 3, 4), ((2, 2, 2), 4, 4), ((1, 3, 1), 2, 5), ((3, 1, 2), 5, 3)]:
        w = rng.normal(size=(c_out, *kernel, c_in)).astype(np.float32)
        got = np.asarray(from_spconv(w.copy()))
        expect_equal(got, conv_weight_from_spconv(w),
                     f"a {'x'.join(map(str, kernel))} kernel, {c_in} -> {c_out} channels: W[k, c_in, c_out]",
                     rule=SPCONV_RULE)
