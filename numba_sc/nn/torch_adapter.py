"""numba-sc layers inside PyTorch models: a sparse convolution as a ``torch.autograd.Function``.

Optional: this module needs PyTorch, which the rest of numba-sc never imports.
Features and weights cross between the two libraries without copies: CUDA
tensors as CuPy arrays through DLPack (the same memory), CPU tensors as NumPy
views. PyTorch's autograd then calls :func:`numba_sc.sparse_conv3d_backward`
for the gradients, so a PyTorch model can mix numba-sc convolutions with its own
layers and train them with ``torch.optim``::

    import torch, numba_sc as ns
    from numba_sc.nn.torch_adapter import TorchSubMConv3d

    x = ns.SparseTensor(coords, features)                 # the coordinates (and their maps)
    conv = TorchSubMConv3d(16, 32, kernel_size=3).cuda()  # a torch.nn.Module, weight (K, C_in, C_out), no bias
    f = torch.randn(len(x), 16, device="cuda", requires_grad=True)   # rows in coords' order
    out, y = conv(x, f)                                   # out: torch (|P|, 32), rows in coords' order
    out.square().sum().backward()                         # f.grad, conv.weight.grad

**Row order.** ``features`` follow the coordinates as the caller gave them to
``SparseTensor`` (which sorts its rows and keeps the permutation in ``x.order``),
and so does the output of a layer that keeps the coordinates (a submanifold
layer); a strided or transposed layer's output follows ``y.coords``.

**Maps** are kept on the coordinates, as :mod:`numba_sc.nn` keeps them: every
layer of one kind on the same coordinates reuses the first one's map (and its
plan), and a transposed layer finds the map of the strided layer that made its
input's coordinates.

The three kinds are :class:`TorchSubMConv3d`, :class:`TorchSparseConv3d` and
:class:`TorchSparseInverseConv3d` (their initial weights come from torch's
generator: ``torch.manual_seed`` decides them); :class:`SparseConv` takes the kind
as arguments, and :func:`sparse_conv` is the functional form. float32 and float16,
as the library (``torch.autograd.gradcheck`` runs in float32 with loosened
tolerances: the kernels have no float64).

These take and return a pair (coordinates, torch features), so they do not fit in a
``torch.nn.Sequential``; :mod:`numba_sc.nn.torch_layers` has modules that do (every
layer kind, on one torch-side sparse tensor), and :mod:`numba_sc.nn.torch_models` the
two networks.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..core import conventions as cv
from ..core.tensor import CoordinateMaps, SparseTensor, map_key
from ..conv.layer import sparse_conv3d
from ..conv.gradient import sparse_conv3d_backward

__all__ = ["SparseConv", "TorchSubMConv3d", "TorchSparseConv3d", "TorchSparseInverseConv3d", "conv_sorted",
           "sparse_conv", "to_array", "to_tensor"]


def to_array(t):
    """A torch tensor as the array library's array over the same memory: CuPy for a CUDA
    tensor (DLPack), NumPy for a CPU one."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t)
    return t.numpy()


def to_tensor(a):
    """A CuPy or NumPy array as a torch tensor over the same memory."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a))
    return torch.from_dlpack(a)


class _SparseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, x, kwargs, out_holder):
        xs = x.with_features(to_array(features))
        y = sparse_conv3d(xs, to_array(weight), **kwargs)
        transposed = kwargs.get("transposed", False)
        ctx.saved = (xs, to_array(weight), kwargs["kernel_map"] if transposed else y.kernel_map, transposed,
                     kwargs.get("backend"))
        out_holder.append(y)
        return to_tensor(y.features)

    @staticmethod
    def backward(ctx, grad_out):
        xs, w, km, transposed, backend = ctx.saved
        dx, dw = sparse_conv3d_backward(xs, w, to_array(grad_out), km, transposed, backend=backend)
        dx_t = to_tensor(dx) if ctx.needs_input_grad[0] else None
        dw_t = to_tensor(dw) if ctx.needs_input_grad[1] else None
        return dx_t, dw_t, None, None, None


_ADAPTER = SimpleNamespace(name="a numba_sc.nn.torch_adapter layer")  # who made a map, for error messages


def _kept_map(x, kernel_size, stride, dilation, transposed):
    """The map this layer reads, if one was built on ``x``'s coordinates before (and
    where to keep a new one): ``(map or None, remember(y))``."""
    ks, st, dil = (cv.as_int_tuple(v, n) for v, n in ((kernel_size, "kernel_size"), (stride, "stride"),
                                                       (dilation, "dilation")))
    maps = x.maps
    if transposed:
        hit = maps.up.get(map_key(ks, st, dil))
        if hit is None:
            raise ValueError(f"a transposed layer (kernel {ks}, stride {st}) needs the map of the strided "
                             f"layer that made x's coordinates, but x ({len(x)} points) was made by none of "
                             "that shape: run that strided layer first (its output y, then this layer on "
                             "y's coordinates), or pass kernel_map=")
        km, fine, _ = hit
        return km, lambda y: setattr(y, "maps", fine)
    if st == (1, 1, 1):
        key = map_key(ks, dil)
        km = maps.subm.get(key)

        def remember(y):
            maps.subm.setdefault(key, y.kernel_map)
            y.maps = maps
        return km, remember
    key = map_key(ks, st, dil)
    hit = maps.down.get(key)

    def remember_down(y):
        km_, coarse = maps.down.get(key) or (y.kernel_map, CoordinateMaps())
        maps.down[key] = (km_, coarse)
        coarse.up[key] = (km_, maps, _ADAPTER)
        y.maps = coarse
    return (hit[0] if hit else None), remember_down


def _order_tensor(x, device):
    """``x.order`` (the caller's row of each sorted row) as a torch tensor on ``device``,
    or None when ``x`` was made already sorted (a layer's output)."""
    return None if x.order is None else to_tensor(x.order).to(device=device, dtype=torch.int64)


def conv_sorted(x, features, weight, kernel_size=3, stride=1, dilation=1, transposed=False, kernel_map=None,
                backend=None, bias=None):
    """:func:`sparse_conv` on features already in ``x.coords``' (sorted) row order, as
    every layer's output is: ``(out, y)``, ``out`` in ``y.coords``' order. The map is the
    one kept on ``x``'s coordinates (else built and kept there) unless ``kernel_map``
    is given. What :mod:`numba_sc.nn.torch_layers` calls."""
    remember = None
    if kernel_map is None:
        kernel_map, remember = _kept_map(x, kernel_size, stride, dilation, transposed)
    holder = []
    kwargs = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, transposed=transposed,
                  kernel_map=kernel_map, backend=backend)
    out = _SparseConvFunction.apply(features, weight, x, kwargs, holder)
    y = holder[0]
    if remember is not None:
        remember(y)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out, y


def sparse_conv(x, features, weight, kernel_size=3, stride=1, dilation=1, transposed=False, kernel_map=None,
                backend=None, bias=None):
    """:func:`numba_sc.sparse_conv3d` on torch tensors, differentiable in ``features``,
    ``weight`` and ``bias``; returns ``(out, y)``: the output features as a torch tensor
    and the output :class:`~numba_sc.SparseTensor` (its coordinates, stride and map).

    ``x`` gives the coordinates (its own features are not read); ``features``
    (|P|, C_in), in the row order of the coordinates the caller gave ``x``,
    ``weight`` (K, C_in, C_out) and ``bias`` (C_out,) or None are torch tensors on
    one device, of one dtype (float32 or float16). ``kernel_map``: the map to read
    (default: the one kept on ``x``'s coordinates, else a new one, kept there)."""
    if not isinstance(x, SparseTensor):
        raise TypeError(f"x must be a numba_sc.SparseTensor (the coordinates), got {type(x).__name__}")
    for name, t in (("features", features), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if features.device != weight.device:
        raise ValueError(f"features are on {features.device} but weight is on {weight.device}: move both "
                         "to one device")
    if features.ndim != 2 or features.shape[0] != len(x):
        raise ValueError(f"features must have shape ({len(x)}, C_in), one row per coordinate of x, got "
                         f"{tuple(features.shape)}")
    order = _order_tensor(x, features.device)
    sorted_features = features if order is None else features[order]
    out, y = conv_sorted(x, sorted_features, weight, kernel_size, stride, dilation, transposed, kernel_map,
                         backend, bias)
    if order is not None and not transposed and len(y) == len(x) and y.stride == x.stride:
        # the same coordinates as x: back into the caller's row order
        out = torch.empty_like(out).index_copy(0, order, out)
    return out, y


class SparseConv(torch.nn.Module):
    """A sparse convolution as a ``torch.nn.Module``: the weight a ``torch.nn.Parameter``
    of shape (K, C_in, C_out) (numba-sc's layout), drawn from torch's generator as
    :class:`numba_sc.nn.SubMConv3d` draws its own (He normal), and a bias (zeros)
    when ``bias=True``. ``forward(x, features)`` -> ``(out, y)`` as
    :func:`sparse_conv`.

    **Changed (issue #36):** ``bias`` defaults to False, as in every layer of
    :mod:`numba_sc.nn` and :mod:`numba_sc.nn.torch_layers` (a convolution followed by
    BatchNorm has no use for one: BatchNorm's shift replaces it). It defaulted to True
    before: pass ``bias=True`` to keep the old modules (and to load their state dicts,
    which hold a ``bias``; without it ``load_state_dict`` names the unexpected key)."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, dilation=1, transposed=False,
                 bias=False):
        super().__init__()
        in_channels = cv.positive_int(in_channels, "in_channels")
        out_channels = cv.positive_int(out_channels, "out_channels")
        k = int(np.prod(cv.as_int_tuple(kernel_size, "kernel_size")))
        w = torch.randn(k, in_channels, out_channels) * float(np.sqrt(2.0 / (k * in_channels)))
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.kernel_size, self.stride, self.dilation, self.transposed = kernel_size, stride, dilation, transposed

    def forward(self, x, features, kernel_map=None):
        return sparse_conv(x, features, self.weight, self.kernel_size, self.stride, self.dilation,
                           self.transposed, kernel_map, bias=self.bias)


class TorchSubMConv3d(SparseConv):
    """Submanifold convolution (outputs on the input's coordinates), as a torch module."""

    def __init__(self, in_channels, out_channels, kernel_size=3, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, 1, dilation, False, bias)


class TorchSparseConv3d(SparseConv):
    """Strided convolution (outputs at ``floor(P / s) * s``), as a torch module."""

    def __init__(self, in_channels, out_channels, kernel_size=2, stride=2, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, False, bias)


class TorchSparseInverseConv3d(SparseConv):
    """Transposed convolution back onto the coordinates a strided layer of the same
    ``kernel_size`` and ``stride`` started from, as a torch module."""

    def __init__(self, in_channels, out_channels, kernel_size=2, stride=2, dilation=1, bias=False):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, True, bias)
