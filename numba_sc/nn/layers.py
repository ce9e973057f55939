"""Layers that hold their weights, and networks made of them.

:func:`numba_sc.sparse_conv3d` is one convolution, given its weight and, to reuse
one, a kernel map. A network is dozens of them, with BatchNorm and ReLU between,
residual adds and U-Net skips, and maps that repeat wherever the coordinates
do. This module packages that the way a user of spconv or TorchSparse expects:

============================  ===================================================
:class:`SubMConv3d`           submanifold convolution: outputs on the input's coordinates
:class:`SparseConv3d`         strided convolution: outputs on ``floor(P / s) * s``
:class:`SparseInverseConv3d`  transposed convolution: inverts a strided one, back
                              onto the coordinates that one started from
:class:`BatchNorm`            per-channel normalization (running statistics at
                              inference; batch statistics when ``training``)
:class:`ReLU`                 and :class:`Linear`, :class:`Identity`, :class:`Sequential`
:func:`add`, :func:`cat`      residual add, concatenation (tensors on one coordinate set)
============================  ===================================================

**Maps without keys.** A kernel map depends on the coordinates and on the
layer's kernel size, stride and dilation, nothing else. Every tensor carries
the maps built on its coordinates (:class:`numba_sc.core.tensor.CoordinateMaps`, one
per coordinate set, shared by all tensors on it), so a layer looks its map up
there and builds it only the first time::

    x0 --stem (subm 3)--> x0'          builds the stride-1 subm map, keeps it on x0's set
    x0' --down (k2 s2)--> x1           builds the strided map; x1's set remembers it
    x1 --subm 3 (x2)--> x1''           builds the stride-2 subm map once, reuses it
    x1'' --up (inverts down)--> y0     no map built: the strided map, read backwards;
                                       y0 is on x0's coordinate set again, so ...
    cat(y0, x0') --subm 3--> ...       ... the decoder reuses the stem's map

spconv asks the user for an ``indice_key`` per map; TorchSparse keys its maps
by tensor stride. Here the key is what determines the map, and the user never
sees it. The metadata built from a map (its *plan*: buffer rows, GEMM groups)
is kept on the map too, so a layer that reuses a map skips the metadata
kernels, and the transposed layer reads the strided layer's plan backwards: it
builds nothing at all.

**Parameters** are NumPy arrays (CuPy after :meth:`Module.cuda`), named as in
PyTorch (``stem.0.weight``, ``stem.1.running_mean``, ...). A convolution's
weight has this library's layout ``(K, C_in, C_out)``, K in
:func:`numba_sc.kernel_offsets` order; :mod:`numba_sc.nn.spconv_format` converts
from and to spconv's ``(C_out, kx, ky, kz, C_in)``. ``model.to(np.float16)``
makes the convolution and linear weights half precision (BatchNorm keeps its
statistics in float32, which half-precision features are normalized in).
``model.to(np.float64)`` (or ``model.double()``) makes every parameter float64,
BatchNorm's included: the float64 oracle, which runs on ``backend="reference"``
only and computes in float64 throughout (:mod:`numba_sc.tools.oracle`).

**Backends.** ``model(x)`` runs the CUDA kernels (on a GPU, or under the
simulator); ``model(x, backend="reference")`` runs every layer's NumPy
reference, for checking.
"""
from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager

import numpy as np

from ..core import conventions as cv
from ..gmas import gemm_grouping as gg
from . import pointwise as pw
from . import maps_up_front
from .tape import add_param_grad, current_tape
from ..core.device import array_module, require_device
from ..core.backend import like, resolve_backend, to_device, to_host
from ..conv.gradient import sparse_conv3d_backward
from ..conv.layer import convolve
from ..core.tensor import (CoordinateMaps, SparseTensor, device_kind, is_device, map_key, numpy_dtype,
                           same_coordinates)

_BACKEND = contextvars.ContextVar("numba_sc_nn_backend", default=None)
_RUNNING = contextvars.ContextVar("numba_sc_nn_running", default=False)  # inside a module's call
_PATHS = contextvars.ContextVar("numba_sc_nn_paths", default=None)  # id(module) -> its path in the called network
_OBSERVERS = []  # callables (module, x, y, kwargs) told of every layer call (benchmarks, tests)


def current_backend() -> str:
    """The backend of the network call in progress (``model(x, backend=...)``)."""
    return resolve_backend(_BACKEND.get())


@contextmanager
def observe(fn):
    """Within the block, ``fn(module, x, y, kwargs)`` is called after every layer's
    call (for per-layer timing or tracing; ``kwargs``: the call's keyword arguments,
    e.g. a BatchNorm's ``residual`` and ``relu``); outside it, layers pay nothing."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


def _number(v, name, what, ok):
    """A float hyperparameter, checked by ``ok``; ``what`` says what is expected."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v) \
            or not ok(float(v)):
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return float(v)


def _checked_value(key, new, old, module):
    """A checkpoint's value for the parameter ``key`` (currently ``old``), checked: an
    array of numbers of the right shape, finite, a variance not negative, an integer
    parameter given whole numbers. Returns it as ``old``'s dtype, on the host."""
    try:
        value = np.asarray(to_host(new) if hasattr(new, "shape") else new)
    except Exception as e:  # a ragged list, an object that is no array
        raise TypeError(f"{key}: the checkpoint's value is not an array of numbers ({e})") from None
    if not (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)
            or value.dtype == np.bool_):
        raise TypeError(f"{key}: the checkpoint holds {value.dtype} values; a parameter must be numbers "
                        f"(this one is {np.dtype(old.dtype).name})")
    if tuple(value.shape) != tuple(old.shape):
        raise ValueError(
            f"{key}: the checkpoint has shape {tuple(value.shape)} but layer {module.name!r} "
            f"({module!r}) expects {tuple(old.shape)}"
            + ("; a spconv checkpoint? convert it with numba_sc.nn.spconv_format."
               "state_dict_from_spconv(model, state)" if value.ndim == 5 else ""))
    if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
        raise ValueError(f"{key}: the checkpoint holds NaN or infinite values")
    if np.issubdtype(np.dtype(old.dtype), np.integer) and np.issubdtype(value.dtype, np.inexact):
        if not np.array_equal(value, np.round(value)):
            raise ValueError(f"{key}: an integer parameter ({np.dtype(old.dtype).name}), but the checkpoint "
                             f"holds fractions, e.g. {value.ravel()[0]!r}")
    if key.endswith("running_var") and (value < 0).any():
        raise ValueError(f"{key}: a variance cannot be negative, the checkpoint holds {value.min()!r}; "
                         "the checkpoint is damaged or the keys are shifted")
    return value.astype(old.dtype)


# ------------------------------------------------------------------ Module
class Module:
    """A layer, or a network of layers: parameters, and child modules.

    Children are the attributes that hold a :class:`Module` (in the order they
    were set), parameters the names a class lists in ``_params``, each with its
    role: ``"model"`` follows :meth:`to` (convolution and linear weights),
    ``"float32"`` is float32 in a float32 or float16 model and float64 in a float64
    one (BatchNorm's parameters and statistics, biases: what the references compute
    in, :func:`numba_sc.core.conventions.compute_dtype`), ``"int64"`` keeps its dtype.
    """

    _params: dict = {}  # name -> "model" | "float32" | "int64"
    maps_up_front = True  # build every map before the first layer (numba_sc.nn.maps_up_front)

    def __init__(self):
        self.training = False
        self._name = None
        self._path = None  # dotted path in the network it was last named in ("" for the root)

    # -- structure
    def children(self):
        """(attribute name, module) for each direct child, in the order they were set."""
        return [(k, v) for k, v in vars(self).items() if isinstance(v, Module)]

    def named_modules(self, prefix=""):
        """Every module of the tree, depth first, with its dotted path (``""`` for the root)."""
        yield prefix, self
        for name, child in self.children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self, kind=None):
        return [m for _, m in self.named_modules() if kind is None or isinstance(m, kind)]

    def named_parameters(self):
        for path, m in self.named_modules():
            for p in m._params:
                yield (f"{path}.{p}" if path else p), getattr(m, p)

    def trainable_parameters(self):
        """``(name, array)`` of what training updates: every parameter but BatchNorm's
        running statistics (buffers, updated by the forward pass itself). Hand
        these to an optimizer (:mod:`numba_sc.train.optim`) after moving the model."""
        return [(k, v) for k, v in self.named_parameters()
                if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]

    @property
    def name(self) -> str:
        """The layer's path in the network it was called from (its class name if alone)."""
        return self._name or type(self).__name__

    def _assign_names(self):
        for path, m in self.named_modules():
            m._name = path or type(self).__name__
            m._path = path

    def grad_names(self) -> dict:
        """``{parameter: its gradient's name}``, the keys of its gradients in
        :meth:`numba_sc.nn.Tape.backward`'s result: the names :meth:`named_parameters` of
        the network being called gives them (``"stem.0.weight"``; ``"weight"`` for a layer
        run on its own), which is what an optimizer built on that network holds. Not the
        layer's own path: a layer may sit in several networks (``Sequential(a, b)`` and
        ``Sequential(b, a)``) and keeps the names of the one that named it first. Taken
        when the layer records its backward step, which runs later, maybe after another
        network has been called."""
        paths = _PATHS.get()
        path = paths.get(id(self), self._path) if paths is not None else self._path
        return {p: f"{path}.{p}" if path else p for p in self._params}

    # -- parameters
    def state_dict(self) -> dict:
        """name -> a NumPy copy of every parameter (PyTorch's names)."""
        return {k: np.array(to_host(v)) for k, v in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True):
        """Set the parameters from ``state`` (name -> NumPy or CuPy array), each checked
        against the layer's shape and converted to the layer's dtype and side
        (host or device). ``strict``: every name must match, none may be left over."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict name -> array (what model.state_dict() returns), got "
                            f"{type(state).__name__}")
        self._assign_names()
        expected = dict(self.named_parameters())
        missing = [k for k in expected if k not in state]
        extra = [k for k in state if k not in expected]
        if strict and (missing or extra):
            whole = isinstance(state.get("model"), dict) and not set(state) & set(expected)
            raise KeyError(
                f"the checkpoint does not match {type(self).__name__}: missing {missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''}, unexpected {extra[:6]}"
                f"{' ...' if len(extra) > 6 else ''}"
                + ("; this is a whole training checkpoint: pass its model's state, checkpoint['model']"
                   if whole else ""))
        owners = {}
        for path, m in self.named_modules():
            for p in m._params:
                owners[f"{path}.{p}" if path else p] = (m, p)
        checked = {}
        for k, (m, p) in owners.items():  # every value checked before any parameter changes
            if k in state:
                checked[k] = _checked_value(k, state[k], getattr(m, p), m)
        for k, value in checked.items():
            m, p = owners[k]
            old = getattr(m, p)
            # In place: the parameter keeps its identity, so an optimizer built
            # before the load goes on updating the arrays the model reads.
            old[...] = like(value, old)
        return self

    def to(self, *args, dtype=None, device=None):
        """Convolution and linear weights to ``dtype`` (the ``"float32"`` parameters to
        float64 for ``np.float64``, back to float32 otherwise); every parameter to ``device``
        (``"cuda"``, ``"cuda:N"`` of the current device, a ``torch.device``: CuPy arrays on
        the GPU, or NumPy under the simulator; ``"cpu"``: NumPy;
        :func:`numba_sc.core.tensor.device_kind`). As in PyTorch, either may be given by position:
        ``model.to("cuda")``, ``model.to(np.float16)``, ``model.to("cuda", np.float16)``.
        Returns the module.

        A parameter that changes dtype or side is a new array; an optimizer built
        before follows it by name at its next step (:mod:`numba_sc.train.optim`)."""
        for a in args:
            if is_device(a):  # a string or a torch.device
                if device is not None:
                    raise ValueError(f"two devices given: {device!r} and {a!r}")
                device = a
            else:
                if dtype is not None:
                    raise ValueError(f"two dtypes given: {dtype!r} and {a!r}")
                dtype = a
        device = device_kind(device)  # 'cuda', 'cuda:0', a torch.device ... -> 'cuda' | 'cpu' | None
        dtype = numpy_dtype(dtype)
        if dtype is not None:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise TypeError(f"to() takes a device ('cuda' or 'cpu') or a dtype (np.float32, "
                                f"np.float16, or np.float64 for backend='reference'), got {dtype!r}") from None
            if dt not in cv.REFERENCE_DTYPES:
                raise TypeError(f"dtype must be float32 or float16 (or float64 for backend='reference'), "
                                f"got {dt}")
        if device == "cuda":
            weights = [getattr(m, p) for _, m in self.named_modules() for p, r in m._params.items() if r == "model"]
            if weights:  # a float64 model is the oracle's: it stays on the reference backend
                cv.check_backend_dtype(dt if dtype is not None else weights[0].dtype, "cuda", "the model's weights")
            require_device("model.cuda()")
        for _, m in self.named_modules():
            for p, role in m._params.items():
                v = getattr(m, p)
                if dtype is not None and role == "model":
                    v = v.astype(dtype, copy=False)  # (the same array when nothing changes)
                elif dtype is not None and role == "float32":
                    v = v.astype(cv.compute_dtype(dtype), copy=False)
                if device == "cuda":
                    v = to_device(v)
                elif device == "cpu":
                    v = to_host(v)
                setattr(m, p, v)
        return self

    def cuda(self):
        return self.to(device="cuda")

    def cpu(self):
        return self.to(device="cpu")

    def half(self):
        return self.to(np.float16)

    def float(self):
        return self.to(np.float32)

    def double(self):
        """Every parameter float64: the oracle's model, for ``backend="reference"``."""
        return self.to(np.float64)

    def train(self, mode: bool = True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    # -- calling
    def __call__(self, x, *args, backend=None, **kwargs):
        if self._name is None:
            self._assign_names()
        if not isinstance(x, SparseTensor):
            raise TypeError(f"layer {self.name!r} ({type(self).__name__}): x must be a numba_sc.SparseTensor "
                            f"(coordinates and features), got {type(x).__name__}; make one with "
                            "numba_sc.SparseTensor(coords, features)")
        outermost = not _RUNNING.get()  # the network's own call, not one of its layers'
        if outermost:  # float64 refused before any map is built
            cv.check_backend_dtype(x.features.dtype, resolve_backend(backend if backend is not None else
                                                                     _BACKEND.get()), "x's features")
        token = _BACKEND.set(backend) if backend is not None else None
        running = _RUNNING.set(True) if outermost else None
        # On a tape, each layer's gradients are named by its path in this network (a walk
        # over the modules, no arrays: cheap), whatever other networks hold the layer.
        paths = (_PATHS.set({id(m): p for p, m in self.named_modules()})
                 if outermost and current_tape() is not None else None)
        try:
            if outermost:  # every map the network will need, built before its first layer
                maps_up_front.before_forward(self, x, current_backend())
            y = self.forward(x, *args, **kwargs)
            if outermost:
                maps_up_front.after_forward(self, x, current_backend())
        finally:
            if running is not None:
                _RUNNING.reset(running)
            if paths is not None:
                _PATHS.reset(paths)
            if token is not None:
                _BACKEND.reset(token)
        for fn in _OBSERVERS:
            fn(self, x, y, kwargs)
        return y

    def forward(self, x):
        raise NotImplementedError

    def __repr__(self):
        """``Kind(arguments)``, with the children indented below, as PyTorch prints modules."""
        head = f"{type(self).__name__}({self.extra_repr()}"
        kids = [f"({name}): " + repr(child).replace("\n", "\n  ") for name, child in self.children()]
        return head + ")" if not kids else head + "\n  " + "\n  ".join(kids) + "\n)"

    def extra_repr(self):
        return ""


def _check_input(layer, x, in_channels):
    if not isinstance(x, SparseTensor):
        raise TypeError(f"layer {layer.name!r} ({layer!r}): x must be a numba_sc.SparseTensor, "
                        f"got {type(x).__name__}")
    if x.channels != in_channels:
        raise ValueError(
            f"layer {layer.name!r} ({layer!r}) expects {in_channels} input channels, but x has "
            f"{x.channels}")


def _check_dtype(layer, x, weight):
    if np.dtype(weight.dtype) != np.dtype(x.features.dtype):
        raise TypeError(
            f"layer {layer.name!r}: its weight is {np.dtype(weight.dtype).name} but x's features "
            f"are {np.dtype(x.features.dtype).name}: convert the model (model.to(np."
            f"{np.dtype(x.features.dtype).name})) or the features")


def _init_weight(rng, shape, fan_in):
    """He initialization, normal with std sqrt(2 / fan_in), float32."""
    rng = np.random.default_rng() if rng is None else rng
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)


# ------------------------------------------------------------ convolutions
class ConvLayer(Module):
    """What the three convolutions share: weight (K, C_in, C_out), optional bias."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, dilation, bias, rng):
        super().__init__()
        self.in_channels = cv.positive_int(in_channels, "in_channels")
        self.out_channels = cv.positive_int(out_channels, "out_channels")
        self.kernel_size = cv.as_int_tuple(kernel_size, "kernel_size")
        self.stride = cv.as_int_tuple(stride, "stride")
        self.dilation = cv.as_int_tuple(dilation, "dilation")
        # the keys of this layer's map in a coordinate set's CoordinateMaps
        self._subm_key = map_key(self.kernel_size, self.dilation)
        self._down_key = map_key(self.kernel_size, self.stride, self.dilation)
        K = int(np.prod(self.kernel_size))
        self.weight = _init_weight(rng, (K, self.in_channels, self.out_channels), K * self.in_channels)
        self._params = {"weight": "model"}
        if bias:
            self.bias = np.zeros(self.out_channels, np.float32)
            self._params = {"weight": "model", "bias": "float32"}

    @property
    def pointwise(self) -> bool:
        """A 1x1x1 kernel of stride 1: a matrix product on every point, no map at all."""
        return self.kernel_size == (1, 1, 1) and self.stride == (1, 1, 1)

    def _finish(self, y, bk):
        if "bias" in self._params:
            return y.with_features(like(pw.bias_add(y.features, self.bias, backend=bk), y.features))
        return y

    def _conv(self, x, **kw):
        """The layer's convolution: ``(y, kept)``, where ``kept`` is, on an open tape,
        the input buffer the forward gathered (padding rows zeroed), for the weight
        gradient to read instead of gathering the inputs again (else None)."""
        _check_input(self, x, self.in_channels)
        _check_dtype(self, x, self.weight)
        tape = current_tape()
        kept = [] if tape is not None else None
        y = convolve(x, self.weight, backend=current_backend(), layer=self.name, keep_plan=True,
                  keep_buffer=kept, **kw)
        buf = (kept or [None])[0]
        if buf is not None and not tape.keep_buffer(buf.nbytes):
            buf = None  # past the tape's share of the workspace: the backward gathers it again
        return y, buf

    def _pointwise(self, x, bk):
        """A 1x1x1 layer of stride 1: ``x.features @ W[0]``, the coordinates kept."""
        _check_input(self, x, self.in_channels)
        _check_dtype(self, x, self.weight)
        y = self._finish(pointwise_product(x, self.weight[0], bk), bk)
        tape = current_tape()
        if tape is not None:
            names = self.grad_names()
            tape.record(y.features, [x.features],
                        lambda g, P: _product_backward(self, x, self.weight[0], g, P, bk, names))
        return y

    def _record(self, x, y, km, transposed, bk, kept):
        """On an open tape: this layer's backward step (:mod:`numba_sc.conv.gradient`);
        ``kept``: the forward's input buffer (:meth:`_conv`)."""
        tape = current_tape()
        if tape is not None:
            names = self.grad_names()
            tape.record(y.features, [x.features],
                        lambda g, P: self._backward(x, km, transposed, g, P, bk, names, kept))
        return y

    def _backward(self, x, km, transposed, g, params, bk, names, input_buffer=None):
        _bias_grad(self, g, params, names)
        dx, dw = sparse_conv3d_backward(x, self.weight, g, km, transposed, backend=bk, input_buffer=input_buffer)
        add_param_grad(params, names["weight"], dw, self.weight)
        return [dx]

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={_short(self.kernel_size)}"
        if self.stride != (1, 1, 1):
            s += f", stride={_short(self.stride)}"
        if self.dilation != (1, 1, 1):
            s += f", dilation={_short(self.dilation)}"
        return s + (", bias=True" if "bias" in self._params else "")


def _short(t):
    return t[0] if len(set(t)) == 1 else t


def pointwise_backward(features, matrix, g, backend):
    """Gradients of ``y = features @ matrix``: ``(g @ matrix.T, features.T @ g)``."""
    if backend == "reference":
        f, m, g = to_host(features), to_host(matrix), to_host(g)
        ct = cv.compute_dtype(f.dtype)
        return gg.matmul(g, np.ascontiguousarray(m.T)), (f.T.astype(ct) @ g.astype(ct)).astype(f.dtype)
    f, m, g = to_device(features), to_device(matrix), to_device(g)
    xp = array_module(f)
    dm = xp.empty((1,) + tuple(m.shape), dtype=f.dtype)  # features.T @ g read in place, as the weight gradient's
    return gg.matmul_cuda(g, xp.ascontiguousarray(m.T)), gg.transposed_products_cuda(f, g, 0, f.shape[0], 1, dm)[0]


def _bias_grad(layer, g, params, names):
    """A layer's bias gradient (when it has a bias): the column sums of ``g``."""
    if "bias" in layer._params:
        add_param_grad(params, names["bias"], pw.column_sums(g), layer.bias)


def _product_backward(layer, x, matrix, g, params, bk, names):
    """Backward step of a layer that multiplies every point by ``matrix`` (a 1x1x1
    convolution's ``weight[0]``, a Linear's ``weight``), then adds its bias; ``names``:
    the layer's :meth:`Module.grad_names` when it recorded the step."""
    _bias_grad(layer, g, params, names)
    dx, dm = pointwise_backward(x.features, matrix, g, bk)
    add_param_grad(params, names["weight"], dm.reshape(layer.weight.shape), layer.weight)
    return [dx]


def pointwise_product(x, matrix, backend):
    """``x.features @ matrix`` (C_in, C_out) on every point: the same coordinates."""
    f = x.features
    if backend == "reference":
        out = gg.matmul(to_host(f), to_host(matrix))
    else:
        out = gg.matmul_cuda(to_device(f), to_device(matrix))
    return x.with_features(like(out, f))


class SubMConv3d(ConvLayer):
    """Submanifold convolution: the outputs are the input's coordinates.

    ``out[q] = sum_k in[q + delta_k] @ W[k]`` over the offsets whose neighbour
    exists. The map is built the first time a layer of this kernel size and
    dilation meets the coordinates, and kept on them for every later layer. A
    1x1x1 kernel is a matrix product on every point (no map).
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, dilation=1, bias=False, rng=None):
        super().__init__(in_channels, out_channels, kernel_size, 1, dilation, bias, rng)

    def forward(self, x):
        bk = current_backend()
        if self.pointwise:
            return self._pointwise(x, bk)
        key = self._subm_key
        km = x.maps.subm.get(key)
        y, kept = self._conv(x, kernel_size=self.kernel_size, dilation=self.dilation, kernel_map=km)
        if km is None:
            x.maps.subm[key] = km = y.kernel_map
        y.maps = x.maps  # same coordinates: same maps
        return self._record(x, self._finish(y, bk), km, False, bk, kept)


class SparseConv3d(ConvLayer):
    """Strided convolution: outputs at ``floor(P / (s t)) * (s t)`` (tensor stride ``s t``).

    The coordinates of the output are new; they remember the map that made them
    (``y.maps.up``), so that a :class:`SparseInverseConv3d` can come back. With
    stride 1 the outputs are the input's coordinates, as in
    :class:`SubMConv3d` (the Minkowski convention; this library has no
    convolution that grows the coordinate set).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=False,
                 rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias, rng)

    def forward(self, x):
        if self.stride == (1, 1, 1):
            return SubMConv3d.forward(self, x)  # (a 1x1x1 kernel included)
        bk = current_backend()
        key = self._down_key
        hit = x.maps.down.get(key)
        if hit is not None:  # the same downsampling ran on these coordinates before
            km, coarse = hit
            y, kept = self._conv(x, kernel_map=km)
            # This layer is now the one that made the coarse coordinates: a transposed
            # layer that inverts it (another model on the same tensor, say) finds it.
            coarse.up[key] = (km, x.maps, self)
        else:
            y, kept = self._conv(x, kernel_size=self.kernel_size, stride=self.stride, dilation=self.dilation)
            km, coarse = y.kernel_map, CoordinateMaps()
            x.maps.down[key] = (km, coarse)
            coarse.up[key] = (km, x.maps, self)
        y.maps = coarse
        return self._record(x, self._finish(y, bk), km, False, bk, kept)


class SparseInverseConv3d(ConvLayer):
    """Transposed convolution: back onto the coordinates a strided layer started from.

    It reads the strided layer's map backwards: for each of that map's pairs
    ``p = q + delta_k``, ``out[p] += in[q] @ W[k]`` (``W`` indexed like the strided
    layer's weight). Which strided layer: ``inverts=`` that layer, or its name in
    the network (``"stage4.0.0"``, as spconv's ``indice_key`` names it), or, without
    it, the one of this ``kernel_size``, ``stride`` and ``dilation`` that made the
    input's coordinates (as TorchSparse finds it). Either way nothing is built: no
    map, no sort, no metadata.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=None, dilation=1,
                 inverts=None, bias=False, rng=None):
        if isinstance(inverts, SparseConv3d):
            kernel_size, stride, dilation = inverts.kernel_size, inverts.stride, inverts.dilation
        elif inverts is not None and not isinstance(inverts, str):
            raise TypeError(f"inverts must be the SparseConv3d layer to invert, or its name, got "
                            f"{type(inverts).__name__}")
        if stride is None:
            raise ValueError("SparseInverseConv3d needs stride= (the strided layer's) or inverts= "
                             "(the strided layer itself)")
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias, rng)
        self.inverts = inverts

    def children(self):  # the inverted layer belongs to the network elsewhere, not here
        return [(k, v) for k, v in super().children() if k != "inverts"]

    def forward(self, x):
        bk = current_backend()
        _check_input(self, x, self.in_channels)
        _check_dtype(self, x, self.weight)
        hit = x.maps.up.get(self._down_key)
        wanted = self.inverts
        if hit is None or (wanted is not None and hit[2] is not wanted and hit[2].name != wanted):
            what = (repr(wanted) if isinstance(wanted, str) else f"{wanted.name!r}" if wanted is not None
                    else f"a strided layer of kernel {_short(self.kernel_size)}, stride {_short(self.stride)}")
            made = [f"{m.name!r} (kernel {_short(m.kernel_size)}, stride {_short(m.stride)})"
                    for _, _, m in x.maps.up.values()]
            raise ValueError(
                f"layer {self.name!r} ({self!r}) inverts {what}, but x ({len(x)} points, stride "
                f"{x.stride}) was not made by it: x's coordinates came from "
                f"{', '.join(made) if made else 'no strided layer'}. Run the strided layer first, "
                "in the same forward pass, and give this layer a tensor on its output coordinates")
        km, fine, _ = hit
        y, kept = self._conv(x, transposed=True, kernel_map=km)
        y.maps = fine  # back on the strided layer's input coordinates, with their maps
        return self._record(x, self._finish(y, bk), km, True, bk, kept)


# ------------------------------------------------------------- the rest
class BatchNorm(Module):
    """Per-channel normalization: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    At inference (the default, ``model.eval()``) with the running statistics; in
    training mode (``model.train()``) with the batch's own, updating the running
    ones as PyTorch does: ``running = (1 - momentum) * running + momentum * batch``
    (the variance unbiased). Followed by a :class:`ReLU` in a :class:`Sequential`,
    the two run as one kernel.

    **Synced over several GPUs** (``comm``, set by
    :func:`numba_sc.train.parallel.sync_batchnorm`): in data-parallel training each
    GPU holds a share of the batch's rows, and the statistics must be those of
    the whole batch, or N GPUs would train another network than one GPU does.
    The forward then sums its column sums (and its row count) over the ranks
    before dividing, twice (the mean, then the squared deviations from it: the
    two passes of the one-GPU path), and the backward sums the two per-channel
    reductions of the gradient the same way (:meth:`_synced_backward`).
    """

    _params = {"weight": "float32", "bias": "float32", "running_mean": "float32",
               "running_var": "float32", "num_batches_tracked": "int64"}

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.num_features = c = cv.positive_int(num_features, "num_features")
        self.eps = _number(eps, "eps", "a small positive number such as 1e-5", lambda v: v > 0)
        self.momentum = _number(momentum, "momentum", "a number in [0, 1] such as 0.1", lambda v: 0 <= v <= 1)
        self.weight = np.ones(c, np.float32)
        self.bias = np.zeros(c, np.float32)
        self.running_mean = np.zeros(c, np.float32)
        self.running_var = np.ones(c, np.float32)
        self.num_batches_tracked = np.zeros((), np.int64)
        self.comm = None  # a communicator (all_reduce, rank, size): batch statistics over every rank

    def forward(self, x, residual=None, relu=False):
        """``residual`` (a tensor on x's coordinates) is added after normalizing, and
        ``relu`` clamps the sum: the end of a residual block in one kernel."""
        _check_input(self, x, self.num_features)
        bk = current_backend()
        if residual is not None:
            _check_same_coords(self, x, residual)
        mean, var = self.running_mean, self.running_var
        if self.training:
            mean, var = self._batch_statistics(x.features, bk)
        f = pw.batch_norm(x.features, self.weight, self.bias, mean, var, self.eps,
                          None if residual is None else residual.features, relu, backend=bk)
        y = x.with_features(like(f, x.features))
        tape = current_tape()
        if tape is not None:
            training, names = self.training, self.grad_names()
            tape.record(y.features, [x.features, None if residual is None else residual.features],
                        lambda g, P: self._backward(x, y, g, mean, var, relu, training, P, bk, names))
        return y

    def _backward(self, x, y, g, mean, var, relu, training, params, bk, names):
        if training and self.comm is not None:
            dx, dweight, dbias, dres = self._synced_backward(g, x.features, y.features, mean, var, relu, bk)
        else:
            dx, dweight, dbias, dres = pw.batch_norm_backward(g, x.features, y.features, self.weight, mean, var,
                                                              self.eps, relu, training, backend=bk)
        add_param_grad(params, names["weight"], dweight, self.weight)
        add_param_grad(params, names["bias"], dbias, self.bias)
        return [dx, dres]

    def _synced_backward(self, g, x, y, mean, var, relu, bk):
        """:func:`numba_sc.nn.pointwise.batch_norm_backward` over every rank's rows.

        ``dL/dx = weight * inv_std * (g' - a - xhat * b)`` with ``a = sum(g') / n`` and
        ``b = sum(g' * xhat) / n`` per channel, the sums and ``n`` over the *whole*
        batch: each rank's column sums (and row count) are summed over the ranks in
        one all-reduce, then every rank finishes its own rows. The parameter
        gradients returned are this rank's own sums: the gradient all-reduce of the
        training step adds the ranks' shares up, as it does for every parameter.
        On the device these are the library's two steps with the all-reduce between
        them: :func:`~numba_sc.nn.pointwise.batch_norm_backward_sums` (whose array
        already holds the row count) and
        :func:`~numba_sc.nn.pointwise.batch_norm_backward_input`."""
        if bk != "reference":  # the one-GPU path's two steps, the all-reduce between them
            sums = pw.batch_norm_backward_sums(g, x, y, mean, var, self.eps, relu)
            own = sums.copy()  # this rank's dbias and dweight: the all-reduce works in place
            self.comm.all_reduce(sums)  # the whole batch's sums, and its row count
            dx, dres = pw.batch_norm_backward_input(g, x, y, self.weight, mean, var, self.eps, relu, sums)
            c = self.num_features
            return dx, own[c:2 * c], own[:c], dres
        g, x, y = to_host(g), to_host(x), to_host(y)
        ct = cv.compute_dtype(x.dtype)  # float32 (float64 for the oracle's float64)
        mean, var = np.asarray(mean, ct), np.asarray(var, ct)
        inv_std = (1.0 / np.sqrt(var + ct.type(self.eps))).astype(ct)
        gm = pw.relu_backward_reference(g, y) if relu else g  # the gradient past the ReLU
        gf = gm.astype(ct, copy=False)
        xhat = (x.astype(ct, copy=False) - mean) * inv_std
        dbias, dweight = pw.column_sums(gf), pw.column_sums(gf * xhat)
        c = dbias.shape[0]
        sums = np.concatenate([dbias, dweight, np.full(1, x.shape[0], ct)])
        self.comm.all_reduce(sums)  # in place: the whole batch's sums, and its row count
        a, b = sums[:c] / sums[2 * c], sums[c:2 * c] / sums[2 * c]
        dx = ((to_host(self.weight).astype(ct) * inv_std) * (gf - a - xhat * b)).astype(g.dtype)
        return dx, dweight, dbias, gm

    def _batch_statistics(self, features, bk):
        f = to_host(features) if bk == "reference" else to_device(features)
        if self.comm is None and bk != "reference" and f.shape[0] > 0:
            # sums, running averages and all on the device, in six launches
            mean, var, rm, rv = pw.batch_statistics_update(f, self.running_mean, self.running_var, self.momentum)
            self.running_mean, self.running_var = like(rm, self.running_mean), like(rv, self.running_var)
            self.num_batches_tracked += 1  # in place: it stays a 0-d array (a load writes into it)
            return mean, var
        if self.comm is None:
            mean, var = pw.batch_statistics(f)
            n = f.shape[0]
            unbiased = var * (n / max(n - 1, 1))
        else:
            mean, var, n = self._synced_statistics(f)
            unbiased = var * (n / array_module(n).maximum(n - 1, 1))  # (n stays on the device: no read)
        m = self.momentum
        self.running_mean = like((1 - m) * like(self.running_mean, mean) + m * mean, self.running_mean)
        self.running_var = like((1 - m) * like(self.running_var, var) + m * unbiased, self.running_var)
        self.num_batches_tracked += 1  # in place, on its own side: a 0-d array still, and no device read
        return mean, var

    def _synced_statistics(self, f):
        """:func:`numba_sc.nn.pointwise.batch_statistics` over every rank's rows: the
        column sums and the row count summed over the ranks (one all-reduce), then the
        sums of squared deviations from that mean (a second one). Returns ``(mean,
        var, n)``, ``n`` the batch's row count as a float32 array of the features' side
        (exact up to 2**24 rows)."""
        xp = array_module(f)
        ct = cv.compute_dtype(f.dtype)  # float32 (float64 for the oracle's float64)
        xf = f.astype(ct, copy=False)
        c = xf.shape[1]
        sums = xp.concatenate([pw.column_sums(xf), xp.full(1, xf.shape[0], ct)])
        self.comm.all_reduce(sums)
        n = sums[c]
        mean = sums[:c] / n
        squares = pw.column_sums((xf - mean) ** 2)
        self.comm.all_reduce(squares)
        return mean, squares / n, n

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps:g}"


class ReLU(Module):
    """``max(x, 0)`` on the features."""

    def forward(self, x):
        bk = current_backend()
        y = x.with_features(like(pw.relu(x.features, backend=bk), x.features))
        tape = current_tape()
        if tape is not None:
            tape.record(y.features, [x.features], lambda g, P: [pw.relu_backward(g, y.features, backend=bk)])
        return y


class Identity(Module):
    def forward(self, x):
        return x


class Linear(Module):
    """``x @ weight + bias`` on every point's features: weight (C_in, C_out), as the
    library's convolutions hold theirs (PyTorch's nn.Linear holds the transpose;
    :mod:`numba_sc.nn.spconv_format` converts)."""

    def __init__(self, in_features, out_features, bias=True, rng=None):
        super().__init__()
        self.in_features = cv.positive_int(in_features, "in_features")
        self.out_features = cv.positive_int(out_features, "out_features")
        self.weight = _init_weight(rng, (self.in_features, self.out_features), self.in_features)
        self._params = {"weight": "model"}
        if bias:
            self.bias = np.zeros(self.out_features, np.float32)
            self._params = {"weight": "model", "bias": "float32"}

    def forward(self, x):
        _check_input(self, x, self.in_features)
        _check_dtype(self, x, self.weight)
        bk = current_backend()
        y = pointwise_product(x, self.weight, bk)
        if "bias" in self._params:
            y = y.with_features(like(pw.bias_add(y.features, self.bias, backend=bk), y.features))
        tape = current_tape()
        if tape is not None:
            names = self.grad_names()
            tape.record(y.features, [x.features], lambda g, P: _product_backward(self, x, self.weight, g, P, bk, names))
        return y

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={'bias' in self._params}"


class Sequential(Module):
    """Layers called one after the other. A :class:`BatchNorm` (at inference or not)
    followed by a :class:`ReLU` runs as one kernel launch."""

    def __init__(self, *layers):
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential takes modules, got {type(layer).__name__} at position {i}")
            setattr(self, str(i), layer)
        self._n = len(layers)

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [getattr(self, str(j)) for j in range(self._n)[i]]
        if i < 0:
            i += self._n
        return getattr(self, str(i))

    def __iter__(self):
        return iter(self[:])

    def forward(self, x, stop=None):
        """Run the layers (the first ``stop`` of them, when given)."""
        layers = self[:stop]
        i = 0
        while i < len(layers):
            layer = layers[i]
            if isinstance(layer, BatchNorm) and i + 1 < len(layers) and isinstance(layers[i + 1], ReLU):
                x = layer(x, relu=True)  # BatchNorm + ReLU, one launch
                i += 2
            else:
                x = layer(x)
                i += 1
        return x



# ----------------------------------------------------- two tensors, one set
def _check_same_coords(who, a, b):
    name = who.name if isinstance(who, Module) else who
    if not isinstance(b, SparseTensor) or not isinstance(a, SparseTensor):
        raise TypeError(f"{name}: both operands must be numba_sc.SparseTensor")
    if a.stride != b.stride or not same_coordinates(a.coords, b.coords):
        raise ValueError(
            f"{name}: the two tensors are not on the same coordinates ({len(a)} points at stride "
            f"{a.stride} and {len(b)} at stride {b.stride}); a residual add or a concatenation "
            "needs the same points in the same order (e.g. a U-Net skip and the transposed "
            "layer that came back to its level)")


def add(a, b, relu=False, backend=None):
    """``a + b`` for two tensors on the same coordinates (a residual connection), then
    ReLU when asked; the result keeps the coordinates and their maps."""
    _check_same_coords("add", a, b)
    bk = resolve_backend(backend if backend is not None else _BACKEND.get())
    y = a.with_features(like(pw.add(a.features, b.features, relu, backend=bk), a.features))
    tape = current_tape()
    if tape is not None:
        def back(g, params):
            g = pw.relu_backward(g, y.features, backend=bk) if relu else g
            return [g, g]
        tape.record(y.features, [a.features, b.features], back)
    return y


def cat(a, b, backend=None):
    """``[a | b]`` along the channels for two tensors on the same coordinates (a U-Net
    skip connection); the result keeps the coordinates and their maps."""
    _check_same_coords("cat", a, b)
    bk = resolve_backend(backend if backend is not None else _BACKEND.get())
    y = a.with_features(like(pw.concat(a.features, b.features, backend=bk), a.features))
    tape = current_tape()
    if tape is not None:
        ca = a.channels  # the gradient splits as the channels were joined (copies: kernels want rows)
        tape.record(y.features, [a.features, b.features],
                    lambda g, P: [array_module(g).ascontiguousarray(g[:, :ca]), array_module(g).ascontiguousarray(g[:, ca:])])
    return y
