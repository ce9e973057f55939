"""The kernel map: which input feeds which output through which offset.

PLACEHOLDER CONTRACT (to be completed by the Map-step work, issue 3): the
``KernelMap`` fields below are the interface the GMaS step relies on. The
builder here is a plain ``searchsorted`` reference; the Map step replaces it with
Minuet's segmented query sorting + double-traversed binary search.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import conventions as cv
from .backend import to_host
from .output_coords import output_coordinates


@dataclass
class KernelMap:
    in_coords: np.ndarray  # int32 (|P|, 3|4), sorted
    out_coords: np.ndarray  # int32 (|Q|, 3|4), sorted
    in_order: np.ndarray  # int64 (|P|,): caller's input row i is in_coords[...]; see build
    offsets: np.ndarray  # int32 (K, 3), sorted lexicographically
    table: np.ndarray  # int32 (K, |Q|): index into in_coords of out_coords[i] + offsets[k], or -1
    counts: np.ndarray  # int64 (K,): pairs per offset
    stats: dict = field(default_factory=dict)
    kernel_size: tuple = (3, 3, 3)
    stride: tuple = (1, 1, 1)
    dilation: tuple = (1, 1, 1)
    tensor_stride: tuple = (1, 1, 1)
    out_tensor_stride: tuple = (1, 1, 1)

    def transposed(self):
        """T.in_coords = out_coords, T.out_coords = in_coords, T.offsets = -offsets[::-1],
        T.table[K-1-k, j] = i exactly when table[k, i] = j."""
        K = len(self.offsets)
        t = np.full((K, len(self.in_coords)), -1, np.int32)
        for k in range(K):
            i = np.flatnonzero(self.table[k] >= 0)
            t[K - 1 - k, self.table[k, i]] = i
        return KernelMap(self.out_coords, self.in_coords, np.arange(len(self.out_coords)),
                         np.ascontiguousarray(-self.offsets[::-1]), t, self.counts[::-1].copy(), {},
                         self.kernel_size, self.stride, self.dilation, self.out_tensor_stride,
                         self.tensor_stride)


def build_kernel_map(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1,
                     out_coords=None, backend=None, source_block=256, query_block=512):
    coords = cv.validate_coords(to_host(in_coords), "in_coords")
    keys = cv.pack_keys(coords)
    in_order = np.argsort(keys, kind="stable")
    src = keys[in_order]
    in_sorted = coords[in_order]
    if out_coords is None:
        out_coords = output_coordinates(in_sorted, stride, tensor_stride, backend="reference")
    offsets = cv.kernel_offsets(kernel_size, dilation, tensor_stride)
    qk = cv.pack_keys(out_coords, offsets.min(0), offsets.max(0))
    d = cv.key_delta(offsets)
    table = np.full((len(offsets), len(qk)), -1, np.int32)
    for k in range(len(offsets)):
        q = qk + d[k]
        pos = np.searchsorted(src, q)
        pos_c = np.minimum(pos, len(src) - 1)
        hit = src[pos_c] == q
        table[k, hit] = pos_c[hit]
    ts = cv.as_int_tuple(tensor_stride, "tensor_stride")
    st = cv.as_int_tuple(stride, "stride")
    return KernelMap(in_sorted, np.asarray(out_coords, np.int32), in_order, offsets, table,
                     (table >= 0).sum(1).astype(np.int64), {}, cv.as_int_tuple(kernel_size, "k"),
                     st, cv.as_int_tuple(dilation, "d"), ts, tuple(a * b for a, b in zip(ts, st)))
