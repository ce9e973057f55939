"""numba-sc layers inside PyTorch models: a sparse convolution as a ``torch.autograd.Function``.

Optional: this module needs PyTorch, which the rest of numba-sc never imports.
Features and weights cross between the two libraries without copies: CUDA
tensors as CuPy arrays through DLPack (the same memory), CPU tensors as NumPy
views. PyTorch's autograd then calls :func:`numba_sc.sparse_conv3d_backward`
for the gradients, so a PyTorch model can mix numba-sc convolutions with its own
layers and train them with ``torch.optim``::

    import torch, numba_sc as ns
    from numba_sc.nn.torch_adapter import SparseConv

    x = ns.SparseTensor(coords, features)                 # the coordinates (and their maps)
    conv = SparseConv(16, 32, kernel_size=3).cuda()       # a torch.nn.Module, weight (K, C_in, C_out)
    f = torch.randn(len(x), 16, device="cuda", requires_grad=True)
    out, y = conv(x, f)                                   # out: torch (|Q|, 32); y: its SparseTensor
    out.square().sum().backward()                         # f.grad, conv.weight.grad

The functional form is :func:`sparse_conv`. Supported: submanifold, strided and
transposed layers, float32 and float16 (as the library; ``torch.autograd.gradcheck``
runs in float32 with loosened tolerances, the kernels have no float64).
"""
from __future__ import annotations

import numpy as np
import torch

from ..train.conv_gradient import sparse_conv3d_backward
from ..gmas.conv import sparse_conv3d
from ..core.tensor import SparseTensor

__all__ = ["SparseConv", "sparse_conv", "to_array", "to_tensor"]


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


def sparse_conv(x, features, weight, kernel_size=3, stride=1, dilation=1, transposed=False, kernel_map=None,
                backend=None):
    """:func:`numba_sc.sparse_conv3d` on torch tensors, differentiable in ``features``
    and ``weight``; returns ``(out, y)``: the output features as a torch tensor and
    the output :class:`~numba_sc.SparseTensor` (its coordinates, stride and map).

    ``x`` gives the coordinates (its own features are not read); ``features``
    (|P|, C_in) and ``weight`` (K, C_in, C_out) are torch tensors on one device, of
    one dtype (float32 or float16)."""
    if not isinstance(x, SparseTensor):
        raise TypeError(f"x must be a numba_sc.SparseTensor (the coordinates), got {type(x).__name__}")
    for name, t in (("features", features), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if features.device != weight.device:
        raise ValueError(f"features are on {features.device} but weight is on {weight.device}: move both "
                         "to one device")
    holder = []
    kwargs = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, transposed=transposed,
                  kernel_map=kernel_map, backend=backend)
    out = _SparseConvFunction.apply(features, weight, x, kwargs, holder)
    return out, holder[0]


class SparseConv(torch.nn.Module):
    """A sparse convolution as a ``torch.nn.Module``: the weight a ``torch.nn.Parameter``
    of shape (K, C_in, C_out) (numba-sc's layout), initialized as
    :class:`numba_sc.nn.SubMConv3d` initializes its own. ``forward(x, features)`` ->
    ``(out, y)`` as :func:`sparse_conv`."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, dilation=1, transposed=False,
                 seed=0):
        super().__init__()
        from ..core.conventions import as_int_tuple

        k = int(np.prod(as_int_tuple(kernel_size, "kernel_size")))
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((k, in_channels, out_channels)) * np.sqrt(2.0 / (k * in_channels))
        self.weight = torch.nn.Parameter(torch.from_numpy(w.astype(np.float32)))
        self.kernel_size, self.stride, self.dilation, self.transposed = kernel_size, stride, dilation, transposed

    def forward(self, x, features, kernel_map=None):
        return sparse_conv(x, features, self.weight, self.kernel_size, self.stride, self.dilation,
                           self.transposed, kernel_map)
