"""Weights from and to spconv's layout, so that a spconv checkpoint runs here.

spconv 2.x keeps a convolution's weight as ``(C_out, kx, ky, kz, C_in)`` (its
"KRSC" layout); this library as ``(K, C_in, C_out)`` with the K offsets in
:func:`numba_sc.kernel_offsets` order, lexicographic on (dx, dy, dz). Both
index a kernel position the same way (spconv's ``(kx, ky, kz)`` is offset
``(kx, ky, kz) - (K - 1) // 2`` of an odd kernel, ``(kx, ky, kz)`` times the
tensor stride of an even one, and both enumerate x slowest), so converting is a
reshape and a transpose::

    ours[k, i, o] = spconv[o, kx, ky, kz, i]     with k = (kx * ky_size + ky) * kz_size + kz

Worked example, a 2x1x1 kernel, 1 input and 2 output channels::

    spconv (C_out=2, 2, 1, 1, C_in=1):  [[[[[a]]], [[[b]]]], [[[[c]]], [[[d]]]]]
    ours   (K=2, C_in=1, C_out=2):     [[[a, c]], [[b, d]]]

One exception, measured against spconv 2.3.8 itself: a 1x1x1 convolution of
stride 1 (a residual shortcut) is run by spconv as a plain matrix product,
``features @ weight.view(C_in, C_out)``: it reads the memory of its
``(C_out, 1, 1, 1, C_in)`` weight as ``(C_in, C_out)``, not as its transpose.
What a spconv checkpoint's shortcut computes is that product, so for those
layers the converters move the memory as it is (``ours[0] =
spconv.reshape(C_in, C_out)``), and a converted network computes what it
computed in spconv.

A PyTorch ``nn.Linear`` keeps ``(C_out, C_in)``, the transpose of this
library's :class:`numba_sc.nn.Linear`. BatchNorm's tensors have the same shape
on both sides.

:func:`state_dict_from_spconv` converts a whole state dict whose names are the
model's (or are made so by ``rename=``) (a spconv network built with the same module names, as
``benchmarks/spconv_nets.py`` builds the two networks of
:mod:`numba_sc.nn.models`), checking every shape against the layer it is for;
:func:`state_dict_to_spconv` goes the other way.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from ..core.backend import to_host
from .checkpoint_keys import rename_keys
from .layers import Linear, ConvLayer


def as_numpy(a):
    """A NumPy array of a NumPy, CuPy or PyTorch array (any device)."""
    if hasattr(a, "detach"):  # a torch tensor
        return a.detach().cpu().numpy()
    return np.asarray(to_host(a))


def conv_weight_from_spconv(w) -> np.ndarray:
    """spconv ``(C_out, kx, ky, kz, C_in)`` -> ``(K, C_in, C_out)`` (a NumPy copy)."""
    w = as_numpy(w)
    if w.ndim != 5:
        raise ValueError(f"a spconv convolution weight has 5 dimensions (C_out, kx, ky, kz, C_in), "
                         f"got shape {w.shape}")
    c_out, c_in = w.shape[0], w.shape[4]
    return np.ascontiguousarray(w.reshape(c_out, -1, c_in).transpose(1, 2, 0))


def conv_weight_to_spconv(w, kernel_size) -> np.ndarray:
    """``(K, C_in, C_out)`` -> spconv ``(C_out, kx, ky, kz, C_in)`` for ``kernel_size``."""
    w = as_numpy(w)
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    if w.ndim != 3 or w.shape[0] != int(np.prod(ks)):
        raise ValueError(f"weight must have shape (K, C_in, C_out) with K = {int(np.prod(ks))} for "
                         f"kernel_size {ks}, got {w.shape}")
    k, c_in, c_out = w.shape
    return np.ascontiguousarray(w.transpose(2, 0, 1).reshape(c_out, *ks, c_in))


def _pointwise_from_spconv(w) -> np.ndarray:
    """A 1x1x1 stride-1 weight as spconv computes with it: its memory read as (C_in, C_out)."""
    c_out, c_in = w.shape[0], w.shape[4]
    return np.ascontiguousarray(w).reshape(1, c_in, c_out).copy()


def _pointwise_to_spconv(w) -> np.ndarray:
    k, c_in, c_out = w.shape
    return np.ascontiguousarray(w).reshape(c_out, 1, 1, 1, c_in).copy()


def _owners(model):
    """Parameter name -> (the module that holds it, the attribute name)."""
    out = {}
    for path, m in model.named_modules():
        for p in m._params:
            out[f"{path}.{p}" if path else p] = (m, p)
    return out


def state_dict_from_spconv(model, state, rename=None) -> dict:
    """A spconv (PyTorch) state dict, converted for ``model`` (a :class:`numba_sc.nn.Module`):
    convolution weights from KRSC, linear weights transposed, the rest as they are.
    Every name of the model must be there (after ``rename``, a callable or a
    ``{regex: replacement}`` dict for a network whose modules are named otherwise:
    :func:`numba_sc.nn.checkpoint_keys.rename_keys`), and every shape must fit its layer."""
    state = rename_keys(state, rename)
    model._assign_names()
    owners = _owners(model)
    missing = [k for k in owners if k not in state]
    if missing:
        raise KeyError(f"the spconv state dict lacks {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                       f"of {type(model).__name__}; if its modules are named otherwise, map the names "
                       "with rename= (a callable or a {regex: replacement} dict)")
    out = {}
    for name, (m, p) in owners.items():
        v = as_numpy(state[name])
        if p == "weight" and isinstance(m, ConvLayer):
            want = (m.out_channels, *m.kernel_size, m.in_channels)
            if v.shape != want:
                raise ValueError(f"{name}: spconv weight of shape {v.shape}, but layer {m.name!r} "
                                 f"({m!r}) needs (C_out, kx, ky, kz, C_in) = {want}")
            v = _pointwise_from_spconv(v) if m.pointwise else conv_weight_from_spconv(v)
        elif p == "weight" and isinstance(m, Linear):
            if v.shape != (m.out_features, m.in_features):
                raise ValueError(f"{name}: nn.Linear weight of shape {v.shape}, but layer {m.name!r} "
                                 f"needs (out_features, in_features) = {(m.out_features, m.in_features)}")
            v = np.ascontiguousarray(v.T)
        out[name] = v
    return out


def state_dict_to_spconv(model) -> dict:
    """``model``'s parameters in spconv's layouts (NumPy arrays; ``torch.from_numpy``
    each for ``spconv_model.load_state_dict``)."""
    out = {}
    for name, (m, p) in _owners(model).items():
        v = as_numpy(getattr(m, p))
        if p == "weight" and isinstance(m, ConvLayer):
            v = _pointwise_to_spconv(v) if m.pointwise else conv_weight_to_spconv(v, m.kernel_size)
        elif p == "weight" and isinstance(m, Linear):
            v = np.ascontiguousarray(v.T)
        out[name] = v
    return out
