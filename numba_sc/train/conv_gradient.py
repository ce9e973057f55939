"""The backward pass: where the gradients of a sparse network come from.

Training needs, for every layer, two things from the gradient of the loss with
respect to the layer's output, ``G = dL/dy``: the gradient with respect to its
input, ``dL/dx`` (handed to the layer before), and with respect to its
parameters, ``dL/dW`` (handed to the optimizer).

**A sparse convolution.** The forward pass (paper Eq. 2) is a sum over the
map's pairs ``(k, i, j)``, output ``i`` reading input ``j`` through offset ``k``::

    y[i] = sum over pairs (k, i, j) of  x[j] @ W[k]

Each pair is one small matrix product, so by the product rule each pair sends
a gradient back to both of its factors::

    dL/dx[j]  += G[i] @ W[k].T          the input gradient ("dgrad")
    dL/dW[k]  += x[j].T @ G[i]          the weight gradient ("wgrad", an outer product)

Read the first line as a convolution: it runs over the same pairs with the
roles of ``i`` and ``j`` swapped and the weights transposed. So **the input
gradient of a layer is the layer's transpose**: a submanifold layer's is a
submanifold convolution (its map is symmetric), a strided layer's is a
transposed convolution over the same map, and a transposed layer's is the
strided one. The library runs it with the GMaS machinery of the forward pass:
the forward's plan read backwards (:meth:`numba_sc.gmas.metadata.GmasPlan.transposed`
swaps the two point lists, every pair keeps its buffer row), the weights
transposed, and nothing built.

The second line, summed over the pairs of one offset ``k``, is one matrix
product: stack the inputs ``x[j]`` of offset k's pairs as the rows of ``X_k``
and the output gradients ``G[i]`` of the same pairs, in the same order, as
``G_k``; then ``dL/dW[k] = X_k.T @ G_k``. That is exactly what the forward's
buffers hold: the gather put ``X_k`` in rows ``base[k] ...`` of the input
buffer, and gathering ``G`` through the *output* lists puts ``G_k`` in the same
rows of a second buffer. One grouped, batched GEMM per group of offsets (as
the forward groups them, the padding rows zeroed so they add nothing) gives
every ``dL/dW[k]``. The submanifold centre, multiplied directly in the
forward, is ``x.T @ G`` directly here.

Worked example, one axis, P = Q = {0, 1}, kernel 3 (offsets -1, 0, +1), one
channel, W = [a, b, c]::

    forward   y[0] = x[0] b + x[1] c        y[1] = x[0] a + x[1] b
    pairs     (k=+1: i=0, j=1)  (k=0: 0,0)  (k=-1: i=1, j=0)  (k=0: 1,1)
    dgrad     dx[0] = G[0] b + G[1] a       dx[1] = G[0] c + G[1] b
    wgrad     dW[-1] = x[0] G[1]   dW[0] = x[0] G[0] + x[1] G[1]   dW[+1] = x[1] G[0]

(the dgrad is the same convolution with the kernel mirrored: the transpose).

Bytes, per layer and pass, ``n`` pairs outside the centre: the dgrad moves what a
forward layer moves, ``~8 n (C_in + C_out)``; the wgrad gathers two buffers
(``4 n (C_in + C_out)`` written, the same read by the GEMMs) and writes only
``K C_in C_out`` values. So a training step costs about three forward passes,
as it does for a dense network.

:func:`sparse_conv3d_backward` is the functional form beside
:func:`numba_sc.sparse_conv3d`; :mod:`numba_sc.nn` records each layer's backward
during a forward pass (:class:`numba_sc.nn.Tape`). The other layers' backward
kernels (BatchNorm, ReLU, the residual add, concatenation) are in
:mod:`numba_sc.nn.pointwise`, the loss's in :mod:`numba_sc.train.loss`.
"""
from __future__ import annotations

import numpy as np

from ..gmas import gemm_grouping as gg
from ..gmas.autotune import heuristic_tile
from ..core.device import device_xp
from ..core.backend import like, resolve_backend, to_device, to_host
from ..gmas.conv import check_map_fits, check_weight, launch_rows_for, layer_plan, gmas, resolve_tiles
from ..gmas.gather import gather_cuda
from ..core.tensor import SparseTensor
from ..core.conventions import Array
from ..map.kernel_map import KernelMap

__all__ = ["sparse_conv3d_backward", "sparse_conv3d_backward_reference"]


# ------------------------------------------------------------------ reference
def _pairs(kernel_map, transposed):
    """Every pair of the layer as three int arrays ``(k, out_row, in_row)``: for a
    transposed layer the strided map's pairs with the two sides swapped."""
    table = np.asarray(to_host(kernel_map.table))
    k, i = np.nonzero(table >= 0)
    j = table[k, i]
    return (k, j, i) if transposed else (k, i, j)


def sparse_conv3d_backward_reference(features, weight, grad_out, kernel_map, transposed=False):
    """NumPy reference, in float64, pair by pair as the module docstring writes it:
    ``dx[j] += G[i] @ W[k].T`` and ``dW[k] += outer(x[j], G[i])``. Returns
    ``(grad_features, grad_weight)`` in the features' dtype."""
    x = np.asarray(to_host(features), np.float64)
    w = np.asarray(to_host(weight), np.float64)
    g = np.asarray(to_host(grad_out), np.float64)
    k, i, j = _pairs(kernel_map, transposed)
    dx = np.zeros_like(x)
    np.add.at(dx, j, np.einsum("po,pco->pc", g[i], w[k]))
    dw = np.zeros_like(w)
    np.add.at(dw, k, np.einsum("pc,po->pco", x[j], g[i]))
    dt = np.asarray(to_host(features)).dtype
    return dx.astype(dt), dw.astype(dt)


# ---------------------------------------------------------------- the kernels
def _forward_plan(kernel_map, weight, transposed, backend):
    """The plan the forward call used: kept on the map (built once, here if not yet)."""
    plan = layer_plan(kernel_map, True, gg.DEFAULT_MAX_PADDING, gg.DEFAULT_SOLO_ROWS, None,
                       launch_rows_for(None, weight), backend)
    return plan.transposed() if transposed else plan


def weight_grad_cuda(features, grad_out, plan, K, input_buffer=None):
    """``dL/dW`` (K, C_in, C_out) from the forward plan: both sides gathered into the
    forward's buffer rows (padding zeroed), one batched GEMM ``X_k.T @ G_k`` per
    group, the centre directly. Offsets without pairs get zeros."""
    xp = device_xp()
    f, g = to_device(features), to_device(grad_out)
    c_in, c_out = f.shape[1], g.shape[1]
    dw = xp.zeros((K, c_in, c_out), dtype=f.dtype)
    if plan.centre >= 0:  # the centre's pairs are (i, i): all the points, in place
        gg.transposed_products_cuda(f, g, 0, f.shape[0], 1, dw, plan.centre)
    if plan.rows:
        item = f.dtype.itemsize
        xbuf = input_buffer
        if xbuf is None:
            xbuf = gather_cuda(f, plan.in_lists, plan.rows, heuristic_tile(c_in, f.shape[0], item), zero_padding=True)
        gbuf = gather_cuda(g, plan.out_lists, plan.rows, heuristic_tile(c_out, g.shape[0], item), zero_padding=True)
        # the groups' products stacked in buffer order, then put at their offsets at once
        stack = xp.empty((len(plan.order), c_in, c_out), dtype=f.dtype)
        pos = 0
        for grp in plan.groups:
            gg.transposed_products_cuda(xbuf, gbuf, grp.start, grp.rows, len(grp.members), stack, pos)
            pos += len(grp.members)
        dw[gg.device_order(plan.groups, xp)] = stack
    return dw


def sparse_conv3d_backward(x: SparseTensor, weight: Array, grad_out: Array, kernel_map: KernelMap,
                           transposed: bool = False, backend: str | None = None,
                           input_buffer: Array | None = None) -> tuple[Array, Array]:
    """Gradients of a sparse convolution: ``(grad_features, grad_weight)``.

    Parameters
    ----------
    x : SparseTensor
        The layer's input (as given to :func:`numba_sc.sparse_conv3d`).
    weight : (K, C_in, C_out)
        The layer's weight.
    grad_out : (|Q|, C_out)
        ``dL/dy``, one row per output row of the forward call, in its order.
    kernel_map : KernelMap
        The map the forward call used: ``y.kernel_map`` of its output for a
        submanifold or strided layer; for ``transposed=True``, the strided map it
        was given (``kernel_map=`` of the transposed call).
    backend : None | "cuda" | "reference"
    input_buffer : optional
        The input buffer the forward call gathered, its padding rows zeroed
        (:mod:`numba_sc.nn` keeps it during a :class:`~numba_sc.nn.Tape`): the weight
        gradient then reads it instead of gathering the inputs again.

    Returns ``grad_features`` (|P|, C_in) in ``x``'s row order, and ``grad_weight``
    (K, C_in, C_out) indexed like ``weight``, both of the features' dtype and array
    kind. The input gradient runs the forward's GMaS step on the transposed plan
    and weights (nothing is built; the plan the forward kept on the map is reused).
    """
    if not isinstance(x, SparseTensor):
        raise TypeError(f"x must be a numba_sc.SparseTensor (the layer's input), got {type(x).__name__}")
    check_map_fits(x, kernel_map, transposed)
    check_weight(weight, len(kernel_map.offsets), x.channels, x.features.dtype, kernel_map.kernel_size)
    n_out = len(kernel_map.in_coords if transposed else kernel_map.out_coords)
    c_out = weight.shape[2]
    if not hasattr(grad_out, "shape") or tuple(grad_out.shape) != (n_out, c_out):
        got = tuple(grad_out.shape) if hasattr(grad_out, "shape") else type(grad_out).__name__
        raise ValueError(f"grad_out must have shape (outputs, C_out) = ({n_out}, {c_out}), one row "
                         f"per row of the forward call's output, got {got}")
    if np.dtype(grad_out.dtype) != np.dtype(x.features.dtype):
        raise TypeError(f"grad_out is {grad_out.dtype} but the features are {x.features.dtype}; "
                        f"use grad_out.astype(np.{np.dtype(x.features.dtype).name})")
    bk = resolve_backend(backend)
    if bk == "reference":
        dx, dw = sparse_conv3d_backward_reference(x.features, weight, grad_out, kernel_map, transposed)
        return like(dx, x.features), like(dw, weight)
    f, w, g = to_device(x.features), to_device(weight), to_device(grad_out)
    plan = _forward_plan(kernel_map, w, transposed, bk)
    back = plan.transposed()  # the same pairs, read from the outputs to the inputs
    wt = device_xp().ascontiguousarray(w.transpose(0, 2, 1))  # W[k].T, (K, C_out, C_in)
    tiles = resolve_tiles(None, c_out, w.shape[1], g.shape[0], f.shape[0], f.dtype, w.shape[0],
                          not transposed)
    dx = gmas(g, wt, back, tiles, bk)
    if input_buffer is not None and tuple(input_buffer.shape) != (plan.rows, f.shape[1]):
        raise ValueError(f"input_buffer must be the forward's (rows, C_in) = ({plan.rows}, {f.shape[1]}) "
                         f"buffer, got {tuple(input_buffer.shape)}")
    dw = weight_grad_cuda(f, g, plan, w.shape[0], input_buffer)
    return like(dx, x.features), like(dw, weight)
