"""SparseTensor: sorted unique coordinates, one feature row each, and the maps built on them.

A sparse tensor is the value that flows between layers. Its coordinates are
sorted once, when it is made (lexicographically on (batch, x, y, z): the order
every stage expects), and every layer hands on sorted coordinates, so nothing is
sorted again inside a network.

Coordinates and their maps
--------------------------
A kernel map depends on the coordinates and on the layer's kernel size, stride
and dilation (and the tensor stride, a property of the coordinates), never on
the features. A network runs many layers on the same coordinates: the
submanifold layers of one level all share one map, the transposed layer that
comes back up reads the strided layer's map backwards, and the decoder's
submanifold layers find the encoder's maps of the same level. So every tensor
carries a :class:`CoordinateMaps`, one object per *coordinate set*, shared by
all the tensors on those coordinates (a layer that keeps the coordinates hands
its input's on to its output), in which :mod:`numba_sc.nn` keeps the maps it
builds. A user never names a map: the keys are what determines the map.

Worked example, a two-level U-Net (``c`` a coordinate set, ``m`` a map)::

    x0 on c0          stem: subm map m0 built, kept in c0.subm[(3, 1)]
    x1 = down(x0)     strided map m1 built: c0.down[(2, 2, 1)] = (m1, c1),
                      and c1.up[(2, 2, 1)] = (m1, c0): c1 knows where it came from
    x1' = subm(x1)    map built on c1, kept in c1.subm
    y0 = up(x1')      c1.up[(2, 2, 1)] gives m1: read backwards, output on c0,
                      with c0's maps: the next subm layer reuses m0
"""
from __future__ import annotations

import numpy as np

from . import conventions as cv
from .device import array_module, require_device
from .backend import like, to_device, to_host



class CoordinateMaps:
    """The kernel maps built on one set of coordinates, shared by every tensor on it.

    ``subm``
        ``(kernel_size, dilation) -> KernelMap`` with these coordinates on both sides.
    ``down``
        ``(kernel_size, stride, dilation) -> (KernelMap, CoordinateMaps)``: a strided
        map from these coordinates, and the coordinate set of its outputs.
    ``up``
        ``(kernel_size, stride, dilation) -> (KernelMap, CoordinateMaps, layer name)``:
        the strided map whose *outputs* are these coordinates, the coordinate set of
        its inputs, and the name of the layer that built it. A transposed layer
        finds here the map it reads backwards.

    Keys are tuples of 3 ints each (:func:`map_key`).
    """

    __slots__ = ("subm", "down", "up")

    def __init__(self):
        self.subm, self.down, self.up = {}, {}, {}

    def __repr__(self):
        return (f"CoordinateMaps(subm={sorted(self.subm)}, down={sorted(self.down)}, "
                f"up={sorted(self.up)})")


def map_key(*args):
    """Normalize layer arguments (ints or 3-tuples) into the key of a map: 3-tuples."""
    return tuple(cv.as_int_tuple(a, "key") for a in args)


class SparseTensor:
    """Unique integer coordinates (sorted) with one feature row each.

    Parameters
    ----------
    coords : int array (N, 3) or (N, 4)
        Voxel coordinates as :func:`numba_sc.voxelize` returns them, optionally
        with the batch index in column 0. They need not be sorted; they must be
        unique.
    features : float32 or float16 array (N, C)
        Row i belongs to ``coords[i]``. float64 is the oracle's dtype: it runs on
        ``backend="reference"`` only (:mod:`numba_sc.tools.oracle`).
    stride : int or 3 ints
        Tensor stride: the grid spacing of the coordinates, in finest voxels
        (1 for a voxelized cloud, 2 after one stride-2 layer, ...).

    Construction sorts the rows once, lexicographically on (batch, x, y, z) (the
    order every stage expects), by packed key: ``.coords = coords[.order]`` and
    ``.features = features[.order]``.

    ``.kernel_map`` is the map of the layer that produced this tensor (None for a
    tensor built by hand): pass it to a later layer on the same coordinates, or
    to the transposed layer. ``.maps`` (:class:`CoordinateMaps`) holds the maps
    that :mod:`numba_sc.nn` layers built on these coordinates.
    """

    def __init__(self, coords: cv.Array, features: cv.Array, stride: cv.IntOr3 = 1):
        # Range: checked by pack_keys below (in a kernel for device arrays).
        coords = cv.validate_coords(coords, "coords", check_range=False)
        if not hasattr(features, "shape") or not hasattr(features, "dtype"):
            raise TypeError(f"features must be a NumPy or CuPy array, got {type(features).__name__}")
        if features.ndim != 2:
            raise ValueError(
                f"features must have shape (N, C), got {tuple(features.shape)}; for one "
                "channel use features.reshape(-1, 1)")
        if features.shape[0] != coords.shape[0]:
            raise ValueError(
                f"features has {features.shape[0]} rows but coords has {coords.shape[0]}: "
                "there must be one feature row per coordinate")
        cv.check_features(features)
        stride = cv.as_int_tuple(stride, "stride")
        coords = like(coords, features)  # one array kind: the features' (the big array)
        xp = array_module(coords)
        if stride != (1, 1, 1):
            # A tensor of stride s lives on the grid of multiples of s (in finest voxels);
            # a coordinate off that grid would find no neighbour where the maps look.
            off = (coords[:, coords.shape[1] - 3:] % xp.asarray(stride, dtype=coords.dtype) != 0).any(axis=1)
            if bool(to_host(off.any())):
                c = to_host(coords[int(to_host(xp.flatnonzero(off))[0])]).tolist()
                raise ValueError(
                    f"coords must be multiples of the tensor stride {stride} (in finest voxels), but "
                    f"{c} is not; pass the coordinates a strided layer made, or stride=1 for a "
                    "voxelized cloud")
        keys = cv.pack_keys(coords)
        order = xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)
        skeys = keys[order]
        dup = skeys[1:] == skeys[:-1]
        fxp = array_module(features)
        # one device->host read of two flags: a repeated coordinate, a value that is not finite
        repeated, not_finite = (bool(v) for v in to_host(xp.stack(
            [dup.any(), like(~fxp.isfinite(features).all(), dup)])))
        if repeated:
            i = int(to_host(xp.flatnonzero(dup))[0])
            c = to_host(coords[order[i]]).tolist()
            raise ValueError(
                f"coords must be unique, but {c} appears more than once "
                f"({int(to_host(dup.sum()))} repeats in all); merge duplicates first, e.g. "
                "numba_sc.voxelize(points, voxel_size, features, reduce='mean')")
        if not_finite:
            r = int(to_host(fxp.flatnonzero(~fxp.isfinite(features).all(axis=1)))[0])
            raise ValueError(
                f"features hold NaN or infinite values (first in row {r}, the point "
                f"{to_host(coords[r]).tolist()}); every layer would spread them to the point's "
                "neighbours: clean or drop those points before making the tensor")
        self.coords = coords[order]
        self.features = features[order]
        self.order = order
        self.stride = stride
        self._kernel_map = None
        self._maps = None

    @classmethod
    def from_layer(cls, coords, features, stride, kernel_map, maps=None):
        """A tensor from already sorted, unique coordinates (a layer's output): no
        validation, no sort. ``kernel_map`` may be a callable that makes the map on
        first use (a transposed layer's map, which it does not need itself);
        ``maps``: the coordinate set's :class:`CoordinateMaps`, when the output
        keeps the input's coordinates (None: a new, empty one on first use)."""
        t = cls.__new__(cls)
        t.coords, t.features, t.stride = coords, features, tuple(stride)
        t._kernel_map, t._maps = kernel_map, maps
        t.order = None
        return t

    def with_features(self, features):
        """The same coordinates (and maps) with other features: what a layer that keeps
        the coordinates returns (BatchNorm, ReLU, a residual add, a concatenation)."""
        return SparseTensor.from_layer(self.coords, features, self.stride, self._kernel_map, self.maps)

    def without_maps(self):
        """The same coordinates and features with no maps: what a new cloud is (layers
        build their maps again). For timing a network as it meets a new scan."""
        return SparseTensor.from_layer(self.coords, self.features, self.stride, None)

    def to(self, *args, dtype=None, device=None):
        """The same tensor on ``device`` (``"cuda"``: CuPy arrays on the GPU, or NumPy
        under the simulator; ``"cpu"``: NumPy) and/or with features of ``dtype``
        (float32 or float16; float64, the oracle's, stays on the CPU side: it runs on
        ``backend="reference"`` only), given by name or by position as in PyTorch:
        ``x.to("cuda")``, ``x.to(np.float16)``. Returns ``self`` when nothing
        changes. A tensor that moves leaves its maps behind (they live on the
        other side): layers build them again on first use."""
        for a in args:
            if isinstance(a, str):
                device = a
            else:
                dtype = a
        if device not in (None, "cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if dtype is not None and np.dtype(dtype) not in cv.REFERENCE_DTYPES:
            raise TypeError(f"dtype must be float32 or float16 (or float64 for backend='reference'), "
                            f"got {dtype!r}")
        coords, features = self.coords, self.features
        if device == "cuda":
            cv.check_backend_dtype(features.dtype if dtype is None else dtype, "cuda", "x's features")
            require_device("SparseTensor.to('cuda')")
            coords, features = to_device(coords), to_device(features)
        elif device == "cpu":
            coords, features = to_host(coords), to_host(features)
        if dtype is not None:
            features = features.astype(dtype, copy=False)
        if coords is self.coords and features is self.features:
            return self
        same_side = coords is self.coords
        return SparseTensor.from_layer(coords, features, self.stride, self._kernel_map if same_side else None,
                                       self.maps if same_side else None)

    def cuda(self):
        """:meth:`to` ``("cuda")``."""
        return self.to(device="cuda")

    def cpu(self):
        """:meth:`to` ``("cpu")``: NumPy arrays."""
        return self.to(device="cpu")

    @property
    def kernel_map(self):
        m = self._kernel_map
        if callable(m):  # made on first use
            m = self._kernel_map = m()
        return m

    @kernel_map.setter
    def kernel_map(self, m):
        self._kernel_map = m

    @property
    def maps(self) -> CoordinateMaps:
        if self._maps is None:
            self._maps = CoordinateMaps()
        return self._maps

    @maps.setter
    def maps(self, value):
        self._maps = value

    def __len__(self):
        return int(self.coords.shape[0])

    @property
    def channels(self) -> int:
        return int(self.features.shape[1])

    def __repr__(self):
        return (f"SparseTensor({len(self)} points, {self.channels} channels, "
                f"{np.dtype(self.features.dtype).name}, stride {self.stride})")


def same_coordinates(a, b) -> bool:
    """True when two coordinate arrays hold the same rows, in the same order.

    The same array object (what every layer hands on) answers at once, with no
    device read; other arrays are compared element by element (one read on a
    GPU), which happens only when a map built on one array is given to a tensor
    made from another one.
    """
    if a is b:
        return True
    if tuple(a.shape) != tuple(b.shape):
        return False
    xp = array_module(a)
    return bool(xp.array_equal(a, like(b, a)))
