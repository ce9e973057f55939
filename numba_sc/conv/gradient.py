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
the forward's plan read backwards (:meth:`numba_sc.gmas.layout.GmasPlan.transposed`
swaps the two point lists, every pair keeps its buffer row), the weights
transposed, and nothing built.

The second line, summed over the pairs of one offset ``k``, is one matrix
product: stack the inputs ``x[j]`` of offset k's pairs as the rows of ``X_k``
and the output gradients ``G[i]`` of the same pairs, in the same order, as
``G_k``; then ``dL/dW[k] = X_k.T @ G_k``. Two buffers of the training step
already hold exactly these: the forward's gather put ``X_k`` in rows
``base[k] ...`` of its input buffer, and the dgrad (the forward's plan read
backwards) gathers ``G`` through the *output* lists into the same rows, so
its input buffer holds ``G_k`` there. The wgrad keeps both (during a
:class:`numba_sc.nn.Tape`, it gathers nothing) and runs one batched GEMM per
group of offsets, as the forward groups them, which gives every ``dL/dW[k]``.
The submanifold centre, multiplied directly in the forward, is ``x.T @ G``
directly here.

What is zeroed, and why. A group pads its shorter offsets with rows up to its
tallest, and a padding row enters the product as ``x_pad.T @ g_pad``. Both
buffers have theirs zeroed: zeros on one side are not enough, because a buffer
comes from the memory pool holding whatever was there (a -1 index, read as
fp32 or fp16, is NaN) and ``0 * NaN`` is NaN. The gradient itself is never
zeroed: each GEMM overwrites its own matrices of a products array (cuBLAS with
beta = 0 reads nothing there), and one kernel puts the products at their
offsets and writes the zeros of the offsets without pairs.

Worked example, one axis, P = Q = {0, 1}, kernel 3 (offsets -1, 0, +1), one
channel, W = [a, b, c]::

    forward   y[0] = x[0] b + x[1] c        y[1] = x[0] a + x[1] b
    pairs     (k=+1: i=0, j=1)  (k=0: 0,0)  (k=-1: i=1, j=0)  (k=0: 1,1)
    dgrad     dx[0] = G[0] b + G[1] a       dx[1] = G[0] c + G[1] b
    wgrad     dW[-1] = x[0] G[1]   dW[0] = x[0] G[0] + x[1] G[1]   dW[+1] = x[1] G[0]

(the dgrad is the same convolution with the kernel mirrored: the transpose).

Bytes, per layer and pass, ``n`` pairs outside the centre (fp32, padding aside):
the dgrad moves what a forward layer moves, ``~8 n (C_in + C_out)``, and zeroes
its buffer first; the wgrad reads the two buffers (``4 n (C_in + C_out)``,
by its GEMMs) and writes ``K C_in C_out`` values twice (the products, then their
places). The G buffer is the dgrad's own; the input's is gathered again
(``~8 n C_in`` more) unless the forward's was kept (:class:`numba_sc.nn.Tape`'s
``keep_buffers``, none by default: kept, they hold many times the activations).
So a training step costs about three forward passes, as it does for a dense
network.

:func:`sparse_conv3d_backward` is the functional form beside
:func:`numba_sc.sparse_conv3d`; :mod:`numba_sc.nn` records each layer's backward
during a forward pass (:class:`numba_sc.nn.Tape`). The other layers' backward
kernels (BatchNorm, ReLU, the residual add, concatenation) are in
:mod:`numba_sc.nn.pointwise`, the loss's in :mod:`numba_sc.train.loss`.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..core import conventions as cv
from ..core.backend import like, resolve_backend, to_device, to_host
from ..core.conventions import Array
from ..core.device import device_xp, simulating
from ..core.launch import launch
from ..core.state import remember
from ..core.tensor import SparseTensor
from ..core.words import as_words, word_view
from ..gmas import gemm_grouping as gg
from ..gmas.autotune import heuristic_tile
from ..gmas.gather import gather_cuda
from ..gmas.workspace import window_rows, windows
from ..map.kernel_map import KernelMap
from .arguments import check_map_fits, check_weight, launch_rows_for, resolve_tiles
from .dataflow import gather_gemm_scatter
from .prepare import layer_plan

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
    """NumPy reference, in float64, as the module docstring writes it, one offset at a
    time: with offset k's pairs ``(i, j)`` stacked, ``dW[k] = x[j].T @ G[i]`` (the sum
    of the pairs' outer products) and ``dx[j] += G[i] @ W[k].T``. Within one offset
    every input appears at most once (``p = q + delta_k`` pairs each output with one
    input and back), so the ``+=`` through the index array adds each row once.
    Returns ``(grad_features, grad_weight)`` in the features' dtype."""
    x = np.asarray(to_host(features), np.float64)
    w = np.asarray(to_host(weight), np.float64)
    g = np.asarray(to_host(grad_out), np.float64)
    k, i, j = _pairs(kernel_map, transposed)
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for kk in np.unique(k):
        pairs = k == kk
        ik, jk = i[pairs], j[pairs]
        dw[kk] = x[jk].T @ g[ik]
        dx[jk] += g[ik] @ w[kk].T
    dt = np.asarray(to_host(features)).dtype
    return dx.astype(dt), dw.astype(dt)


# ---------------------------------------------------------------- the kernels
def _forward_plan(kernel_map, weight, transposed, backend):
    """The plan the forward call used: kept on the map (built once, here if not yet)."""
    plan = layer_plan(kernel_map, True, gg.DEFAULT_MAX_PADDING, gg.DEFAULT_SOLO_ROWS, None,
                       launch_rows_for(None, weight), backend)
    return plan.transposed() if transposed else plan


def weight_grad_cuda(features, grad_out, plan, K, input_buffer=None, grad_buffer=None):
    """``dL/dW`` (K, C_in, C_out) from the forward plan: one strided batched GEMM
    ``X_k.T @ G_k`` per group over the buffers' rows, the centre's ``x.T @ G`` directly.

    ``input_buffer``: the forward's input buffer (the inputs gathered through
    ``plan.in_lists``); ``grad_buffer``: ``grad_out`` gathered through
    ``plan.out_lists``, which is the input gradient's own gather
    (:func:`sparse_conv3d_backward` hands it over). Either is gathered here when
    not given. Both must have their padding rows zeroed: a padding row enters a
    product as ``x_pad.T @ g_pad``, and zeros on one side only are not enough,
    because memory fresh from the pool holds any bits and ``0 * NaN`` (or
    ``0 * inf``) is NaN.

    Nothing is zeroed here and nothing is copied twice: every GEMM writes its own
    slots of ``products`` (cuBLAS with beta = 0 never reads them), in buffer order
    with the centre last, and :func:`place_products_cuda` puts each slot at its
    offset, writing zeros for the offsets without pairs.
    """
    xp = device_xp()
    f, g = to_device(features), to_device(grad_out)
    c_in, c_out = f.shape[1], g.shape[1]
    n_buffered = len(plan.order)
    # No memset: each slot is written by exactly one GEMM (beta = 0, so it is never read).
    products = xp.empty((n_buffered + (plan.centre >= 0), c_in, c_out), dtype=f.dtype)
    if plan.rows:
        item = f.dtype.itemsize
        tx, tg = heuristic_tile(c_in, f.shape[0], item), heuristic_tile(c_out, g.shape[0], item)
        # A buffer not handed over is gathered here, window by window when the two
        # would pass the workspace (numba_sc.gmas.workspace); a split offset's pieces
        # add into its product.
        gathered = (c_in if input_buffer is None else 0) + (c_out if grad_buffer is None else 0)
        for w in windows(plan.groups, plan.rows, window_rows(gathered * item) if gathered else 0):
            # Padding rows zeroed in both buffers (above: why one side is not enough):
            # the callers' come so, and the ones gathered here are made so.
            xbuf = input_buffer[w.lo:w.hi] if input_buffer is not None else \
                gather_cuda(f, plan.in_lists, plan.rows, tx, zero_padding=True, window=(w.lo, w.hi))
            gbuf = grad_buffer[w.lo:w.hi] if grad_buffer is not None else \
                gather_cuda(g, plan.out_lists, plan.rows, tg, zero_padding=True, window=(w.lo, w.hi))
            for p in w.gemms:
                gg.transposed_products_cuda(xbuf, gbuf, p.group.start, p.group.rows, len(p.group.members),
                                            products, p.slot, p.accumulate)
            del xbuf, gbuf
    if plan.centre >= 0:  # the centre's pairs are (i, i): all the points, in place
        gg.transposed_products_cuda(f, g, 0, f.shape[0], 1, products, n_buffered)
    return place_products_cuda(products, product_slots(plan, K, xp), K)


def product_slots(plan, K, xp):
    """(K,) int64 array of ``xp``: ``slots[k]`` is the slot of offset k's product in
    :func:`weight_grad_cuda`'s ``products`` (the buffer's offsets in buffer order, then
    the centre), -1 for an offset without pairs. Copied to the device once per
    grouping, like :func:`numba_sc.gmas.gemm_grouping.device_order`."""
    members = tuple(grp.members for grp in plan.groups)
    key = (members, plan.centre, K, -1 if simulating() else xp.cuda.runtime.getDevice())
    slots = _SLOTS.get(key)
    if slots is None:
        if len(_SLOTS) > 256:
            _SLOTS.clear()
        host = np.full(K, -1, dtype=np.int64)
        buffered = [k for m in members for k in m]
        host[buffered] = np.arange(len(buffered))
        if plan.centre >= 0:
            host[plan.centre] = len(buffered)
        slots = _SLOTS[key] = xp.asarray(host)
    return slots


_SLOTS = remember({})  # grouping -> the device's slots array


@cuda.jit
def place_products_kernel(products, slots, dw):
    """``dw[k] = products[slots[k]]``, or zero bits where ``slots[k] < 0``. The matrices
    come as rows of integer words (their bytes; all-zero bits are +0.0), one thread
    per word of ``dw``, in memory order: neighbouring threads copy neighbouring
    words of one matrix."""
    t = cuda.grid(1)
    per = dw.shape[1]
    if t < dw.shape[0] * per:
        k = t // per
        w = t - k * per
        s = slots[k]
        if s >= 0:
            dw[k, w] = products[s, w]
        else:  # an offset without pairs: its gradient is zero
            dw[k, w] = 0


def place_products_cuda(products, slots, K):
    """The (K, C_in, C_out) weight gradient from the (S, C_in, C_out) ``products``
    and :func:`product_slots`: one launch of :func:`place_products_kernel`, which
    writes every value of the result once (so it is allocated without a memset).

    The kernel only moves bytes: each matrix is handed over as one row of 8- or
    4-byte words (:func:`numba_sc.core.words.word_view`), or of 2-byte words for a
    fp16 matrix of an odd number of values, so one compiled kernel serves fp16
    and fp32 and a zero needs no conversion."""
    xp = device_xp()
    n, c_in, c_out = products.shape
    dw = xp.empty((K, c_in, c_out), dtype=products.dtype)  # no memset: the kernel writes every value
    word, per = word_view(products.itemsize, c_in * c_out)
    if word is None:  # (per is then the values themselves: 2-byte fp16 bits)
        word = np.int16
    launch(place_products_kernel, K * per, as_words(products, n, per, word), slots, as_words(dw, K, per, word))
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
    and weights (nothing is built; the plan the forward kept on the map is reused);
    the buffer its gather fills is the weight gradient's ``G_k`` rows, kept for it.
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
    cv.check_backend_dtype(x.features.dtype, bk, "x's features")
    if bk == "reference":
        dx, dw = sparse_conv3d_backward_reference(x.features, weight, grad_out, kernel_map, transposed)
        return like(dx, x.features), like(dw, weight)
    f, w, g = to_device(x.features), to_device(weight), to_device(grad_out)
    plan = _forward_plan(kernel_map, w, transposed, bk)
    if input_buffer is not None and tuple(input_buffer.shape) != (plan.rows, f.shape[1]):
        raise ValueError(f"input_buffer must be the forward's (rows, C_in) = ({plan.rows}, {f.shape[1]}) "
                         f"buffer, got {tuple(input_buffer.shape)}")
    back = plan.transposed()  # the same pairs, read from the outputs to the inputs
    wt = device_xp().ascontiguousarray(w.transpose(0, 2, 1))  # W[k].T, (K, C_out, C_in)
    tiles = resolve_tiles(None, c_out, w.shape[1], g.shape[0], f.shape[0], f.dtype, w.shape[0],
                          not transposed)
    # The input gradient gathers G through the output lists into the forward's buffer
    # rows: exactly the G_k the weight gradient multiplies, so it keeps that buffer
    # (padding rows zeroed) instead of the weight gradient gathering G again.
    kept = []
    dx = gather_gemm_scatter(g, wt, back, tiles, bk, keep_buffer=kept, kernel_map=kernel_map,
                             transposed=not transposed)
    dw = weight_grad_cuda(f, g, plan, w.shape[0], input_buffer, kept[0] if kept else None)
    return like(dx, x.features), like(dw, weight)
