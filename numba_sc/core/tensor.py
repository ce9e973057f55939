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

c0 holds c1 (through ``down``), and c1 points back at c0 (through ``up``). That back
link is weak (:class:`Parents`): were it strong, the two would form a reference
cycle, and Python frees a cycle only when its cyclic collector happens to run, so
every map of both sets (their tables and plans, device memory) would outlive the
tensors that used them, into the next forward pass.
"""
from __future__ import annotations

import numpy as np

from . import conventions as cv
import importlib.util
import weakref

from .device import array_module, device_id, is_cupy, require_device
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

    Keys are tuples of 3 ints each (:func:`map_key`). ``up`` holds its coordinate
    sets weakly (:class:`Parents`).
    """

    __slots__ = ("subm", "down", "up", "__weakref__")

    def __init__(self):
        self.subm, self.down, self.up = {}, {}, Parents()

    def __repr__(self):
        return (f"CoordinateMaps(subm={sorted(self.subm)}, down={sorted(self.down)}, "
                f"up={sorted(self.up)})")


class Parents(dict):
    """:attr:`CoordinateMaps.up`: ``key -> (KernelMap, CoordinateMaps, layer)``, the
    coordinate set held by a weak reference (the module docstring says why: it holds
    this one strongly, through its ``down``).

    Read like a dict of those triples. While a network runs, the finer set is alive
    (its tensors are: the skip connections, the input), so the transposed layer
    finds it with its maps. If every tensor on it is gone, the entry hands out a
    fresh, empty set for those coordinates instead (and keeps it, weakly, for the
    next reader): the maps on it are built again when a layer asks for them.
    """

    def __setitem__(self, key, value):
        km, maps, layer = value
        super().__setitem__(key, (km, weakref.ref(maps), layer))

    def __getitem__(self, key):
        km, ref, layer = super().__getitem__(key)
        maps = ref()
        if maps is None:  # gone with its tensors: a fresh set on the same coordinates
            maps = CoordinateMaps()
            super().__setitem__(key, (km, weakref.ref(maps), layer))
        return km, maps, layer

    def get(self, key, default=None):
        return self[key] if key in self else default

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]

    def setdefault(self, key, default):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items():
            self[k] = v


def as_array(a, name: str):
    """``a`` as the array library's array: NumPy and CuPy arrays as they are, and any
    other array that speaks DLPack (a PyTorch tensor, a JAX array) over the same memory:
    NumPy for one in host memory, CuPy for one on a CUDA device.

    Told apart by the protocol, not by importing the other library (numba-sc never
    imports PyTorch): ``__dlpack_device__()`` says where the memory is. A PyTorch
    tensor that requires gradients is detached first (DLPack refuses to export it;
    the sparse tensor only reads its values).
    """
    if isinstance(a, np.ndarray) or is_cupy(a) or not hasattr(a, "__dlpack_device__"):
        return a  # (anything else is left for the shape and dtype checks to name)
    if getattr(a, "requires_grad", False) and hasattr(a, "detach"):
        a = a.detach()
    kind, _ = a.__dlpack_device__()
    if int(kind) == 1:  # kDLCPU
        try:
            return np.from_dlpack(a)
        except (RuntimeError, BufferError, TypeError) as e:  # a dtype NumPy lacks: bfloat16, say
            raise TypeError(f"{name} has dtype {getattr(a, 'dtype', '?')}, which NumPy cannot read ({e}); "
                            "numba-sc takes integer coordinates and float32 or float16 features "
                            f"(convert with {name}.float() or {name}.half())") from None
    if int(kind) in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        if importlib.util.find_spec("cupy") is None:
            raise TypeError(f"{name} is a CUDA {type(a).__name__}, which numba-sc reads through CuPy, and "
                            "CuPy is not installed: pip install -e '.[cuda12]' (or '.[cuda13]'), or move "
                            f"it to the CPU first ({name}.cpu())")
        import cupy  # (only here: the host path needs no CuPy)

        return cupy.from_dlpack(a)
    raise TypeError(f"{name} is a {type(a).__name__} on DLPack device type {kind}, neither the CPU nor a "
                    f"CUDA GPU: move it to one of them first")


def device_kind(device, name: str = "device"):
    """A device as this library names them: ``"cuda"``, ``"cpu"`` or None (no move).

    Accepts what PyTorch accepts: ``"cuda"``, ``"cpu"``, ``"cuda:N"`` and a
    ``torch.device`` (told apart by its ``type`` and ``index``, without importing
    PyTorch). numba-sc runs on the current CUDA device: ``"cuda:N"`` for another
    GPU is refused with the fix (select it first), rather than quietly running on
    the current one.
    """
    if device is None:
        return None
    if not isinstance(device, str) and type(device).__module__.split(".")[0] == "torch" \
            and hasattr(device, "type") and hasattr(device, "index"):
        device = device.type if device.index is None else f"{device.type}:{device.index}"
    if not isinstance(device, str):
        raise TypeError(f"{name} must be 'cuda' or 'cpu' (or 'cuda:N', a torch.device), got "
                        f"{type(device).__name__}")
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind == "cuda" and (not index or index.isdigit()):
        try:
            current = device_id() if index else None
        except ImportError:  # no CuPy: the move itself says what to install (require_device)
            current = None
        if current is not None and int(index) != current:
            raise ValueError(f"{name} is {device!r}, but numba-sc runs on the current CUDA device "
                             f"({current}): select that GPU first (cupy.cuda.Device({int(index)}).use(), "
                             f"or torch.cuda.set_device({int(index)})), then pass 'cuda'")
        return "cuda"
    raise ValueError(f"{name} must be 'cuda' or 'cpu' (or 'cuda:N', a torch.device), got {device!r}")


def is_device(a) -> bool:
    """True for what names a device rather than a dtype: ``"cuda"``, ``"cuda:N"``, ``"cpu"``
    or a ``torch.device`` (a string such as ``"float16"`` names a dtype)."""
    if isinstance(a, str):
        return a.partition(":")[0] in ("cuda", "cpu")
    return type(a).__module__.split(".")[0] == "torch" and hasattr(a, "index") and hasattr(a, "type")


def numpy_dtype(dtype):
    """A dtype as NumPy names it; a PyTorch one (``torch.float16``) by its name, without
    importing PyTorch. None stays None; anything else is NumPy's to judge."""
    if dtype is not None and type(dtype).__module__.split(".")[0] == "torch" and str(dtype).startswith("torch."):
        name = str(dtype)[len("torch."):]
        try:
            return np.dtype(name)
        except TypeError:
            raise TypeError(f"dtype {dtype} has no NumPy counterpart; numba-sc computes in float32 or "
                            "float16 (torch.float32, torch.float16)") from None
    return dtype


def map_key(*args):
    """Normalize layer arguments (ints or 3-tuples) into the key of a map: 3-tuples."""
    return tuple(cv.as_int_tuple(a, "key") for a in args)


class SparseTensor:
    """Unique integer coordinates (sorted) with one feature row each.

    Parameters
    ----------
    coords : int array (N, 3) or (N, 4)
        NumPy, CuPy, or any DLPack array (a PyTorch tensor: :func:`as_array`).
        Voxel coordinates as :func:`numba_sc.voxelize` returns them, optionally
        with the batch index in column 0. They need not be sorted; they must be
        unique.
    features : float32 or float16 array (N, C)
        NumPy, CuPy or DLPack, as ``coords``. Row i belongs to ``coords[i]``. float64 is the oracle's dtype: it runs on
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
        coords, features = as_array(coords, "coords"), as_array(features, "features")
        # Range: checked by pack_keys below (in a kernel for device arrays).
        coords = cv.validate_coords(coords, "coords", check_range=False)
        if not hasattr(features, "shape") or not hasattr(features, "dtype"):
            raise TypeError(f"features must be a NumPy or CuPy array (or a PyTorch tensor), got "
                            f"{type(features).__name__}")
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
        """The same tensor on ``device`` (``"cuda"``, ``"cuda:N"`` of the current device or a
        ``torch.device``: CuPy arrays on the GPU, or NumPy under the simulator; ``"cpu"``:
        NumPy; :func:`device_kind`) and/or with features of ``dtype``
        (float32 or float16; float64, the oracle's, stays on the CPU side: it runs on
        ``backend="reference"`` only), given by name or by position as in PyTorch:
        ``x.to("cuda")``, ``x.to(np.float16)``. Returns ``self`` when nothing
        changes. A tensor that moves leaves its maps behind (they live on the
        other side): layers build them again on first use."""
        for a in args:
            if isinstance(a, str) or is_device(a):  # (any string: "tpu" is refused as a device)
                device = a
            else:
                dtype = a
        device = device_kind(device)
        dtype = numpy_dtype(dtype)
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
