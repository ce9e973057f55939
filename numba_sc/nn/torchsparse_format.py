"""Weights from and to TorchSparse's layout, so that a TorchSparse checkpoint runs here (and back).

TorchSparse (``torchsparse.nn.Conv3d``) keeps a convolution's weight as ``kernel`` of
shape ``(K, C_in, C_out)``, this library's shape, or ``(C_in, C_out)`` for a 1x1x1
kernel. The shapes agree; the **order of the K offsets** does not always. TorchSparse
enumerates a kernel's offsets (``get_kernel_offsets``) with the same per-axis values as
:func:`numba_sc.kernel_offsets` (``-(k-1)/2 .. (k-1)/2`` for odd ``k``, ``0 .. k/2``
for ``k = 2``), but in MinkowskiEngine's order when the kernel volume is odd:

* kernel volume odd (3x3x3, 1x3x1, ...): **x fastest**, z slowest,
  ``k_ts = (iz * ky + iy) * kx + ix``;
* kernel volume even (2x2x2, ...): x slowest, z fastest, ``k_ts = (ix * ky + iy) * kz + iz``,
  which is this library's order (lexicographic on (dx, dy, dz)) for every kernel.

So a 3x3x3 kernel is a permutation of the K rows, and a 2x2x2 one is copied as it is::

    ours[(ix * ky + iy) * kz + iz] = ts[(iz * ky + iy) * kx + ix]      (odd volume)

Worked example, 3x3x3: TorchSparse's row 1 is offset (0, -1, -1) (x moved first), ours
is (-1, -1, 0); our row 1 comes from TorchSparse's row 9.

The transposed convolution indexes its weight like the strided one it inverts, on both
sides. BatchNorm (``spnn.BatchNorm``, a ``torch.nn.BatchNorm1d``) has the same tensors;
``torch.nn.Linear`` keeps ``(C_out, C_in)``, the transpose of :class:`numba_sc.nn.Linear`.

:func:`state_dict_from_torchsparse` converts a whole state dict for a numba-sc model
(``rename=`` maps module names that differ, :mod:`numba_sc.nn.checkpoint_keys`), and
:func:`state_dict_to_torchsparse` goes the other way.
"""
from __future__ import annotations

import numpy as np

from ..core import conventions as cv
from .checkpoint_keys import rename_keys
from .layers import ConvLayer, Linear
from .spconv_format import as_numpy

__all__ = ["conv_weight_from_torchsparse", "conv_weight_to_torchsparse", "state_dict_from_torchsparse",
           "state_dict_to_torchsparse", "torchsparse_offsets"]


def torchsparse_offsets(kernel_size=3, dilation=1) -> np.ndarray:
    """The offsets of TorchSparse's weight rows, (K, 3), in its order (see the module's
    docstring): what the permutation below is checked against."""
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    dil = cv.as_int_tuple(dilation, "dilation")
    ax = [cv.axis_offsets(k) * d for k, d in zip(ks, dil)]
    if int(np.prod(ks)) % 2:  # x fastest
        rows = [(x, y, z) for z in ax[2] for y in ax[1] for x in ax[0]]
    else:  # x slowest: this library's order
        rows = [(x, y, z) for x in ax[0] for y in ax[1] for z in ax[2]]
    return np.asarray(rows, dtype=np.int32).reshape(-1, 3)


def _ours_from_ts(kernel_size) -> np.ndarray:
    """``perm`` with ``ours = ts[perm]``: for each of our offsets, TorchSparse's row of it."""
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    kx, ky, kz = ks
    if int(np.prod(ks)) % 2 == 0:
        return np.arange(kx * ky * kz)
    ix, iy, iz = np.meshgrid(np.arange(kx), np.arange(ky), np.arange(kz), indexing="ij")  # our order
    return ((iz * ky + iy) * kx + ix).reshape(-1)


def conv_weight_from_torchsparse(w, kernel_size) -> np.ndarray:
    """TorchSparse ``kernel`` (K, C_in, C_out) or (C_in, C_out) -> ours (K, C_in, C_out),
    rows in :func:`numba_sc.kernel_offsets` order (a NumPy copy)."""
    w = as_numpy(w)
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    K = int(np.prod(ks))
    if w.ndim == 2 and K == 1:
        w = w[None]
    if w.ndim != 3 or w.shape[0] != K:
        raise ValueError(f"a TorchSparse kernel for kernel_size {ks} has shape ({K}, C_in, C_out)"
                         f"{' or (C_in, C_out)' if K == 1 else ''}, got {w.shape}")
    return np.ascontiguousarray(w[_ours_from_ts(ks)])


def conv_weight_to_torchsparse(w, kernel_size, pointwise=None) -> np.ndarray:
    """Ours (K, C_in, C_out) -> TorchSparse's ``kernel``; ``pointwise`` (a 1x1x1 layer of
    stride 1, default: when K is 1) gives TorchSparse's (C_in, C_out)."""
    w = as_numpy(w)
    ks = cv.as_int_tuple(kernel_size, "kernel_size")
    K = int(np.prod(ks))
    if w.ndim != 3 or w.shape[0] != K:
        raise ValueError(f"weight must have shape (K, C_in, C_out) with K = {K} for kernel_size {ks}, "
                         f"got {w.shape}")
    out = np.empty_like(w)
    out[_ours_from_ts(ks)] = w
    return np.ascontiguousarray(out[0] if (K == 1 if pointwise is None else pointwise) else out)


def _owners(model):
    out = {}
    for path, m in model.named_modules():
        for p in m._params:
            out[f"{path}.{p}" if path else p] = (m, p, path)
    return out


def state_dict_from_torchsparse(model, state, rename=None) -> dict:
    """A TorchSparse (PyTorch) state dict, converted for ``model`` (a
    :class:`numba_sc.nn.Module`): a convolution's ``kernel`` (or ``weight``) permuted into
    our offset order and named ``weight``, linear weights transposed, the rest as they
    are. ``rename`` (a callable or a ``{regex: replacement}`` dict) maps the checkpoint's
    module names onto the model's first. Every parameter of the model must be found, and
    every shape must fit its layer; entries the model has no place for are refused too
    (a mistaken mapping would otherwise load a part of the network)."""
    state = rename_keys(state, rename)
    model._assign_names()
    out, used = {}, set()
    for name, (m, p, path) in _owners(model).items():
        key = name
        if p == "weight" and isinstance(m, ConvLayer) and name not in state:
            key = f"{path}.kernel" if path else "kernel"  # TorchSparse's name
        if key not in state:
            raise KeyError(f"the TorchSparse state dict has no {name!r}"
                           f"{f' (or {key!r})' if key != name else ''} for layer {m.name!r} ({m!r}); if its "
                           "modules are named otherwise, map the names with rename=")
        used.add(key)
        v = as_numpy(state[key])
        if p == "weight" and isinstance(m, ConvLayer):
            want = (m.in_channels, m.out_channels)
            if v.shape[-2:] != want:
                raise ValueError(f"{key}: TorchSparse kernel of shape {v.shape}, but layer {m.name!r} ({m!r}) "
                                 f"needs (K, C_in, C_out) with (C_in, C_out) = {want}")
            v = conv_weight_from_torchsparse(v, m.kernel_size)
        elif p == "weight" and isinstance(m, Linear):
            if v.shape != (m.out_features, m.in_features):
                raise ValueError(f"{key}: nn.Linear weight of shape {v.shape}, but layer {m.name!r} needs "
                                 f"(out_features, in_features) = {(m.out_features, m.in_features)}")
            v = np.ascontiguousarray(v.T)
        out[name] = v
    extra = [k for k in state if k not in used]
    if extra:
        raise KeyError(f"the TorchSparse state dict has {len(extra)} entries {type(model).__name__} has no "
                       f"place for: {extra[:6]}{' ...' if len(extra) > 6 else ''}; map their names with "
                       "rename=, or drop them (a rename that returns None)")
    return out


def state_dict_to_torchsparse(model) -> dict:
    """``model``'s parameters in TorchSparse's layouts and names (``kernel`` for a
    convolution's weight; NumPy arrays: ``torch.from_numpy`` each for
    ``load_state_dict``)."""
    out = {}
    for name, (m, p, path) in _owners(model).items():
        v = as_numpy(getattr(m, p))
        if p == "weight" and isinstance(m, ConvLayer):
            name = f"{path}.kernel" if path else "kernel"
            v = conv_weight_to_torchsparse(v, m.kernel_size, pointwise=m.pointwise)
        elif p == "weight" and isinstance(m, Linear):
            v = np.ascontiguousarray(v.T)
        out[name] = v
    return out
