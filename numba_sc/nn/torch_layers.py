"""Every layer kind of :mod:`numba_sc.nn` as a ``torch.nn.Module``, on one torch-side sparse tensor.

Optional: this module needs PyTorch (``pip install -e ".[torch]"``); ``import numba_sc``
never imports it.

:mod:`numba_sc.nn.torch_adapter` puts one convolution into PyTorch's autograd, but it
takes and returns a pair (coordinates, features). A network needs one value that flows
from layer to layer, so that ``torch.nn.Sequential`` can chain them. That value is a
:class:`TorchSparseTensor`: the numba-sc :class:`~numba_sc.SparseTensor` that holds the
coordinates (sorted, with their stride and the maps built on them) beside a torch
``features`` tensor, one row per coordinate, in the coordinates' sorted order::

    import torch, numba_sc as ns
    from numba_sc.nn import torch_layers as tl

    x = tl.TorchSparseTensor.from_coords(coords, features)   # torch or NumPy coords; torch features
    net = torch.nn.Sequential(tl.SubMConv3d(4, 16), tl.BatchNorm(16), tl.ReLU(),
                              tl.SparseConv3d(16, 32, kernel_size=2, stride=2))
    y = net(x)                          # a TorchSparseTensor at stride 2
    y.features.sum().backward()         # gradients of every weight, as in any torch model

============================  ====================================================
:class:`SubMConv3d`           submanifold convolution (outputs on the input's coordinates)
:class:`SparseConv3d`         strided convolution (outputs at ``floor(P / s) * s``)
:class:`SparseInverseConv3d`  transposed convolution, back onto the coordinates the
                              strided layer of the same shape started from
:class:`BatchNorm`            ``torch.nn.BatchNorm1d`` on the features
:class:`ReLU`                 ``max(0, x)`` on the features
:class:`Linear`               one matrix for every point's features (a 1x1x1 layer)
:class:`Identity`             the input as it is (a shortcut with nothing to change)
:class:`Add`, :class:`Cat`    residual add, concatenation (two tensors on one coordinate set)
============================  ====================================================

**The same parameters as numba-sc's layers**, with the same names and shapes: a
convolution's ``weight`` is ``(K, C_in, C_out)`` (K in :func:`numba_sc.kernel_offsets`
order), a :class:`Linear`'s ``(C_in, C_out)`` (the transpose of ``torch.nn.Linear``'s),
BatchNorm's are PyTorch's. So a numba-sc network's ``state_dict()`` loads into its torch
twin (:mod:`numba_sc.nn.torch_models`) as it is. No layer has a bias unless
``bias=True``, as in :mod:`numba_sc.nn`.

**Maps** are kept on the coordinates as in :mod:`numba_sc.nn`: the layers of one kind on
one coordinate set share the first one's map, and a transposed layer reads the map of
the strided layer that made its input's coordinates (no ``indice_key`` to name).

**Precision.** float32 or float16 (the kernels have both). Under ``torch.autocast`` with
``dtype=torch.float16`` the convolutions compute in float16, as ``torch.nn.Conv3d``
does; ``torch.bfloat16`` is refused with the fix (the kernels have no bfloat16 path).
BatchNorm follows PyTorch's autocast rules.

**Devices.** CUDA tensors share memory with CuPy arrays (DLPack); CPU tensors with NumPy
arrays, on which the kernels run under Numba's CUDA simulator (slow: for tests on a few
hundred points) or, with ``backend="reference"``, the NumPy references.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core import conventions as cv
from ..core.backend import to_host
from ..core.tensor import SparseTensor, as_array, same_coordinates
from .torch_adapter import conv_sorted, to_array, to_tensor

__all__ = ["Add", "BatchNorm", "Cat", "Identity", "Linear", "ReLU", "SparseConv3d", "SparseInverseConv3d",
           "SubMConv3d", "TorchSparseTensor", "compute_dtype", "numpy_state"]


class TorchSparseTensor:
    """Coordinates (a numba-sc :class:`~numba_sc.SparseTensor`: sorted, with their stride
    and maps) and a torch ``features`` tensor (|P|, C), row i for ``sparse.coords[i]``.

    Made with :meth:`from_coords` from coordinates in any order; every layer returns one
    whose rows follow its coordinates' sorted order. :meth:`input_order` gives the rows
    back in the order the coordinates were first given.
    """

    __slots__ = ("sparse", "features", "_order")

    def __init__(self, sparse: SparseTensor, features: torch.Tensor, order=None):
        if not isinstance(sparse, SparseTensor):
            raise TypeError(f"sparse must be a numba_sc.SparseTensor (the coordinates), got "
                            f"{type(sparse).__name__}; from coordinates use TorchSparseTensor.from_coords")
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}")
        if features.ndim != 2 or features.shape[0] != len(sparse):
            raise ValueError(f"features must have shape ({len(sparse)}, C), one row per coordinate, got "
                             f"{tuple(features.shape)}")
        self.sparse, self.features, self._order = sparse, features, order

    @classmethod
    def from_coords(cls, coords, features: torch.Tensor, stride=1):
        """A tensor from ``coords`` (N, 3) or (N, 4) (NumPy, CuPy or torch; unique, any
        order) and torch ``features`` (N, C), row i for ``coords[i]``. The rows are
        sorted as numba-sc sorts them (a differentiable gather of ``features``)."""
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}; for NumPy "
                            "features use numba_sc.SparseTensor")
        if features.dtype not in (torch.float32, torch.float16):
            raise TypeError(f"features must be float32 or float16 (numba-sc's kernels have no {features.dtype} "
                            "path): convert with features.float()")
        sparse = SparseTensor(as_array(coords, "coords"), to_array(features), stride)
        order = to_tensor(sparse.order).to(device=features.device, dtype=torch.int64)
        # the SparseTensor holds a sorted copy of the values; the torch graph its own gather
        return cls(SparseTensor.from_layer(sparse.coords, sparse.features, sparse.stride, None), features[order],
                   order)

    def with_features(self, features: torch.Tensor) -> "TorchSparseTensor":
        """The same coordinates (and maps) with other features."""
        return TorchSparseTensor(self.sparse, features, self._order)

    def input_order(self) -> torch.Tensor:
        """The features in the row order of the coordinates given to :meth:`from_coords`
        (for a tensor on those coordinates; a strided layer's output has no such order)."""
        if self._order is None:
            raise ValueError("this tensor's coordinates were made by a layer, not given by the caller: its "
                             "rows have no other order than .coords'")
        return torch.empty_like(self.features).index_copy(0, self._order, self.features)

    @property
    def coords(self):
        return self.sparse.coords

    @property
    def stride(self):
        return self.sparse.stride

    def __len__(self):
        return len(self.sparse)

    def to_numba_sc(self) -> SparseTensor:
        """A numba-sc :class:`~numba_sc.SparseTensor` of these coordinates (and maps) with
        the features' values (the same memory, detached from the graph)."""
        return self.sparse.with_features(to_array(self.features))

    def __repr__(self):
        return (f"TorchSparseTensor({len(self)} points, {self.features.shape[1]} channels, "
                f"{self.features.dtype}, stride {self.stride})")


def _check(layer, x, channels=None):
    if not isinstance(x, TorchSparseTensor):
        raise TypeError(f"{type(layer).__name__} takes a numba_sc.nn.torch_layers.TorchSparseTensor, got "
                        f"{type(x).__name__}; make one with TorchSparseTensor.from_coords(coords, features)")
    if channels is not None and x.features.shape[1] != channels:
        raise ValueError(f"{type(layer).__name__} ({layer.extra_repr()}) expects {channels} input channels, "
                         f"but x has {x.features.shape[1]}")


def compute_dtype(features: torch.Tensor) -> torch.dtype:
    """The dtype a convolution computes in: ``torch.autocast``'s, when it is on for the
    features' device, else the features' own. float32 or float16; bfloat16 refused
    with the fix (the kernels have no bfloat16 path)."""
    device_type = features.device.type
    dtype = features.dtype
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        where = f"torch.autocast({device_type!r}) asks for {dtype}"
    else:
        where = f"the features are {dtype}"
    if dtype == torch.bfloat16:
        raise TypeError(f"{where}, but numba-sc's kernels have no bfloat16 path: use "
                        f"torch.autocast({device_type!r}, dtype=torch.float16), or float32")
    if dtype not in (torch.float32, torch.float16):
        raise TypeError(f"{where}; numba-sc's convolutions compute in float32 or float16: convert the "
                        "features (.float() or .half())")
    return dtype


class _Conv(torch.nn.Module):
    """What the three convolutions share: ``weight`` (K, C_in, C_out), drawn He normal from
    torch's generator (``torch.manual_seed`` decides it), and a ``bias`` (zeros) only when
    ``bias=True``."""

    transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride, dilation, bias):
        super().__init__()
        self.in_channels = cv.positive_int(in_channels, "in_channels")
        self.out_channels = cv.positive_int(out_channels, "out_channels")
        self.kernel_size = cv.as_int_tuple(kernel_size, "kernel_size")
        self.stride = cv.as_int_tuple(stride, "stride")
        self.dilation = cv.as_int_tuple(dilation, "dilation")
        k = math.prod(self.kernel_size)
        w = torch.randn(k, self.in_channels, self.out_channels) * math.sqrt(2.0 / (k * self.in_channels))
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(torch.zeros(self.out_channels)) if bias else None

    @property
    def pointwise(self) -> bool:
        """A 1x1x1 kernel of stride 1: a matrix product on every point, no map."""
        return self.kernel_size == (1, 1, 1) and self.stride == (1, 1, 1) and not self.transposed

    def forward(self, x: TorchSparseTensor, backend=None) -> TorchSparseTensor:
        _check(self, x, self.in_channels)
        dtype = compute_dtype(x.features)
        f, w = x.features.to(dtype), self.weight.to(dtype)  # (casts the graph sees: fp32 gradients)
        if self.pointwise:
            out = f @ w[0]
            if self.bias is not None:
                out = out + self.bias.to(dtype)
            return x.with_features(out)
        with torch.autocast(f.device.type, enabled=False):  # (the kernels read the dtype given them)
            out, y = conv_sorted(x.sparse, f, w, self.kernel_size, self.stride, self.dilation, self.transposed,
                                 backend=backend, bias=self.bias)
        return TorchSparseTensor(y, out, x._order if len(y) == len(x) and y.stride == x.stride else None)

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
        if self.stride != (1, 1, 1):
            s += f", stride={self.stride}"
        if self.dilation != (1, 1, 1):
            s += f", dilation={self.dilation}"
        return s + (", bias=True" if self.bias is not None else "")


class SubMConv3d(_Conv):
    """Submanifold convolution: the outputs are the input's coordinates (a 1x1x1 kernel
    is a matrix product on every point)."""

    def __init__(self, in_channels, out_channels, kernel_size=3, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, 1, dilation, bias)


class SparseConv3d(_Conv):
    """Strided convolution: outputs at ``floor(P / s) * s`` (with stride 1, the input's
    coordinates, as :class:`SubMConv3d`)."""

    def __init__(self, in_channels, out_channels, kernel_size=2, stride=2, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias)


class SparseInverseConv3d(_Conv):
    """Transposed convolution: back onto the coordinates that the strided layer of this
    ``kernel_size``, ``stride`` and ``dilation`` started from, reading that layer's map
    backwards (``W`` indexed like the strided layer's weight)."""

    transposed = True

    def __init__(self, in_channels, out_channels, kernel_size=2, stride=2, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias)


class BatchNorm(torch.nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` on the features (the coordinates kept): the same
    parameters, statistics and training behaviour as :class:`numba_sc.nn.BatchNorm`."""

    def forward(self, x: TorchSparseTensor) -> TorchSparseTensor:
        _check(self, x, self.num_features)
        return x.with_features(super().forward(x.features))


class ReLU(torch.nn.Module):
    """``max(x, 0)`` on the features."""

    def forward(self, x: TorchSparseTensor) -> TorchSparseTensor:
        _check(self, x)
        return x.with_features(torch.relu(x.features))


class Identity(torch.nn.Module):
    def forward(self, x: TorchSparseTensor) -> TorchSparseTensor:
        return x


class Linear(torch.nn.Module):
    """``features @ weight + bias`` on every point; ``weight`` (C_in, C_out) as
    :class:`numba_sc.nn.Linear` holds it (the transpose of ``torch.nn.Linear``'s)."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.in_features = cv.positive_int(in_features, "in_features")
        self.out_features = cv.positive_int(out_features, "out_features")
        w = torch.randn(self.in_features, self.out_features) * math.sqrt(2.0 / self.in_features)
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: TorchSparseTensor) -> TorchSparseTensor:
        _check(self, x, self.in_features)
        out = x.features @ self.weight.to(x.features.dtype)  # (under autocast, autocast casts the product)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return x.with_features(out)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


def _same_coords(who, a, b):
    for t in (a, b):
        if not isinstance(t, TorchSparseTensor):
            raise TypeError(f"{who} takes two TorchSparseTensors, got {type(t).__name__}")
    if a.stride != b.stride or not same_coordinates(a.coords, b.coords):
        raise ValueError(f"{who}: the two tensors are not on the same coordinates ({len(a)} points at stride "
                         f"{a.stride} and {len(b)} at stride {b.stride}); a residual add or a concatenation "
                         "needs the same points in the same order (e.g. a U-Net skip and the transposed "
                         "layer that came back to its level)")


class Add(torch.nn.Module):
    """``a + b`` for two tensors on the same coordinates (a residual connection), then
    ReLU when ``relu=True``; the result keeps ``a``'s coordinates and maps."""

    def __init__(self, relu=False):
        super().__init__()
        self.relu = bool(relu)

    def forward(self, a: TorchSparseTensor, b: TorchSparseTensor) -> TorchSparseTensor:
        _same_coords("Add", a, b)
        out = a.features + b.features
        return a.with_features(torch.relu(out) if self.relu else out)


class Cat(torch.nn.Module):
    """``[a | b]`` along the channels for two tensors on the same coordinates (a U-Net skip)."""

    def forward(self, a: TorchSparseTensor, b: TorchSparseTensor) -> TorchSparseTensor:
        _same_coords("Cat", a, b)
        return a.with_features(torch.cat([a.features, b.features], dim=1))


def numpy_state(state: dict) -> dict:
    """A state dict's values as torch tensors, from NumPy or CuPy arrays (what a
    :mod:`numba_sc.nn` model's ``state_dict()`` holds), for a torch model's
    ``load_state_dict``; torch tensors pass as they are."""
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(to_host(v))) for k, v in state.items()}
