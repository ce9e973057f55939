"""Stage 9, GEMM grouping: offsets ordered by pair count, neighbours batched together.

After the gather, the pairs of offset ``k`` sit in ``counts[k]`` consecutive rows
of the input buffer and must be multiplied by ``W[k]`` (``C_in x C_out``). One
GEMM per offset means K launches (27 for a 3x3x3 kernel), most of them small.
A *batched* GEMM multiplies G equally tall matrices by G weights in one launch,
so offsets are put in groups and every member of a group is padded with zero
rows up to the tallest one. Padding is wasted work; the question is how to group
so that there is little of it (paper Section 5.2.2).

Minuet's answer: **sort the offsets by pair count first**, then group *adjacent*
offsets. Neighbours in sorted order have nearly equal counts, so padding them to
the tallest costs almost nothing. In the map's own (lexicographic) order,
neighbouring offsets can differ a lot (an offset along a scan line finds many
more neighbours than a diagonal one).

Worked example, counts of 6 offsets in map order ``[9, 2, 8, 3, 9, 2]``, and the
policy "a group may waste at most 25 % of its real rows"::

    map order     [9] [2] [8] [3] [9] [2]  -> no two neighbours fit: 6 launches,
                                              no padding
    sorted order  [2 2] [3] [8 9 9]        -> 3 launches; padding 3*9 - 26 = 1 row
                                              over 33 real rows = 3 %
                  ([2 2 3] would pad 2 rows onto 7 real ones: 29 % > 25 %)

The grouping policy (adaptive, after TorchSparse's): walk the offsets in order
and extend the current group with the next offset while the group's padding
stays within ``max_padding`` (a fraction of its real rows), and while the
group's members stay below ``solo_rows`` rows: a GEMM that tall fills the GPU on
its own, so batching it buys nothing and only risks padding. Offsets with no
pair are dropped (no launch at all).

On a real scan (SemanticKITTI at 0.05 m, a 3x3x3 submanifold layer, 26 offsets
outside the centre with 1,881 to 21,662 pairs each) the default policy gives 4
batched GEMMs with 5.9 % padding in sorted order, against 17 in map order.

Every group is one batched GEMM, ``(G, rows, C_in) @ (G, C_in, C_out)``: cuBLAS
through ``cupy.matmul`` on the GPU, ``np.matmul`` under the simulator and in the
reference. On the GPU the groups are issued round-robin on a pool of 4 CUDA
streams so that small GEMMs overlap (Minuet found no gain beyond 4).

Napkin math: the GEMMs read ``4 * rows * C_in`` bytes of buffer and write
``4 * rows * C_out`` (fp32), so each percent of padding is a percent more GEMM
traffic and flops; the grouping itself is a sort of K numbers on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba import cuda

from .backend import device_xp, launch, simulating

DEFAULT_MAX_PADDING = 0.25  # a group may add at most 25 % zero rows to its real rows
DEFAULT_SOLO_ROWS = 1 << 17  # an offset with this many pairs runs as its own GEMM
STREAM_POOL = 4  # Minuet's pool size (Section 5.2.2)


@dataclass
class Group:
    """One batched GEMM: offsets ``members`` (indices into the kernel's offsets),
    each padded to ``rows`` rows, starting at buffer row ``start``."""

    members: tuple
    rows: int
    start: int

    @property
    def padded_rows(self) -> int:
        return len(self.members) * self.rows


def offset_order(counts, sort=True, skip=None) -> np.ndarray:
    """The order offsets are laid out in: by non-decreasing pair count (stable, so
    ties keep the map's order) when ``sort``, else the map's own order. Offsets
    with no pair, and ``skip`` (the submanifold centre), are left out."""
    c = np.asarray(counts, dtype=np.int64).tolist()  # K Python ints: a list beats NumPy calls here
    ks = [k for k in range(len(c)) if c[k] > 0 and k != skip]
    if sort:
        ks.sort(key=c.__getitem__)  # Python's sort is stable: ties keep the map's order
    return np.array(ks, dtype=np.int64)


def make_groups(counts, order, max_padding=DEFAULT_MAX_PADDING,
                solo_rows=DEFAULT_SOLO_ROWS) -> list:
    """Group adjacent offsets of ``order`` under the padding policy (module docstring).

    Returns the :class:`Group` list; groups are laid out back to back in the
    buffer in this order.
    """
    if max_padding < 0:
        raise ValueError(f"max_padding must be >= 0 (a fraction of real rows), got {max_padding}")
    counts = np.asarray(counts, dtype=np.int64).tolist()  # Python ints: a fast loop
    groups, start = [], 0
    members, real, tallest = [], 0, 0
    for k in np.asarray(order).tolist():
        c = counts[k]
        if members:
            t = max(tallest, c)
            padded = t * (len(members) + 1)
            fits = padded - (real + c) <= max_padding * (real + c)
            if fits and t < solo_rows:
                members.append(int(k))
                real, tallest = real + c, t
                continue
            groups.append(Group(tuple(members), tallest, start))
            start += tallest * len(members)
        members, real, tallest = [int(k)], c, c
    if members:
        groups.append(Group(tuple(members), tallest, start))
    return groups


def padding_report(counts, skip=None, max_padding=DEFAULT_MAX_PADDING,
                   solo_rows=DEFAULT_SOLO_ROWS) -> dict:
    """Padding overhead and GEMM launches of the grouping, sorted vs map order.

    For each of ``"sorted"`` and ``"map"``: ``real_rows`` (pairs), ``padding_rows``
    (zero rows added), ``total_rows``, ``overhead`` = padding_rows / real_rows and
    ``launches`` (batched GEMMs). ``skip`` is an offset handled outside the
    groups (the submanifold centre), counted in neither.
    """
    out = {}
    for name, sort in (("sorted", True), ("map", False)):
        order = offset_order(counts, sort, skip)
        groups = make_groups(counts, order, max_padding, solo_rows)
        real = int(np.asarray(counts, np.int64)[order].sum())
        total = sum(g.padded_rows for g in groups)
        out[name] = dict(real_rows=real, padding_rows=total - real, total_rows=total,
                         overhead=(total - real) / real if real else 0.0, launches=len(groups))
    return out


# ------------------------------------------------------------------ the GEMMs
def matmul(a, b):
    """``a @ b``; fp16 operands are accumulated in fp32 and rounded once.

    NumPy gets explicit fp32 copies. CuPy's fp16 matmul calls cuBLAS with fp32
    compute (its default for half precision), so it is used as is.
    """
    if isinstance(a, np.ndarray) and a.dtype == np.float16:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return a @ b


def grouped_gemm_reference(in_buf, weight, groups, out_buf):
    """One ``np.matmul`` per group: ``out_buf[group rows] = in_buf[group rows] @ W``.

    fp16 operands are multiplied in fp32 and rounded once at the end (fp32
    accumulation, as cuBLAS does for half precision).
    """
    for g in groups:
        a = in_buf[g.start:g.start + g.padded_rows].reshape(len(g.members), g.rows, -1)
        res = matmul(a, weight[list(g.members)])
        out_buf[g.start:g.start + g.padded_rows] = res.reshape(g.padded_rows, -1)
    return out_buf


_POOLS = {}  # device id -> (the pool's streams, its reusable events)


def _stream_pool():
    """This device's pool: STREAM_POOL streams and the events reused with them
    (streams and events belong to the device they were made on)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if device not in _POOLS:
        _POOLS[device] = ([cupy.cuda.Stream(non_blocking=True) for _ in range(STREAM_POOL)],
                          _PoolEvents())
    return _POOLS[device]


# cuBLAS is called directly rather than through ``cupy.matmul``: on the H100 a
# batched ``cupy.matmul`` costs 28 us of host time against 13 us for the bare
# cuBLAS call (benchmarks/results/probe_host_costs_*.json), and a layer makes
# several. Row-major ``C = A @ W`` is, read column-major, ``C^T = W^T A^T``: so
# cuBLAS is asked for ``m = C_out, n = rows, k = C_in`` with W as its first
# operand, and no transposition is ever materialized.
_CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}  # CUDA_R_32F, CUDA_R_16F
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation for both dtypes (no TF32)
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
_ONE = np.ones(1, np.float32)  # alpha and beta live on the host (cuBLAS's default pointer mode)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data  # (.ctypes builds an object per call)


def _cublas():
    """CuPy's cuBLAS module and this thread's handle for the current device."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    return cublas, cupy.cuda.device.get_cublas_handle()


def centre_product_cuda(features, weight, centre):
    """``features @ weight[centre]`` as one cuBLAS call (the submanifold centre)."""
    if simulating():
        return matmul(features, weight[centre])
    import cupy

    cublas, handle = _cublas()
    n, c_in = features.shape
    c_out = weight.shape[2]
    out = cupy.empty((n, c_out), dtype=features.dtype)
    t = _CUDA_TYPE[np.dtype(features.dtype)]
    w = weight.data.ptr + centre * c_in * c_out * weight.itemsize
    cublas.gemmEx(handle, 0, 0, c_out, n, c_in, _ONE_PTR, w, t, c_out,
                  features.data.ptr, t, c_in, _ZERO_PTR, out.data.ptr, t, c_out,
                  _COMPUTE_32F, _GEMM_DEFAULT)
    return out


_ORDER_CACHE = {}


def _device_order(members):
    """The group-order offset indices as a device array, copied there once per order."""
    import cupy

    key = (members, cupy.cuda.runtime.getDevice())
    if key not in _ORDER_CACHE:
        if len(_ORDER_CACHE) > 256:
            _ORDER_CACHE.clear()
        _ORDER_CACHE[key] = cupy.asarray(np.array(members, dtype=np.int64))
    return _ORDER_CACHE[key]


def take_weights_reference(weight, order):
    """``weight[order]``: the weights of the buffer's offsets, in buffer order."""
    return np.asarray(weight)[np.asarray(order)]


@cuda.jit
def take_weights_kernel(weight, order, out):
    """``out[g] = weight[order[g]]``, one thread per value; ``weight`` and ``out`` are
    viewed as (offsets, C_in * C_out) so that neighbouring threads copy neighbours."""
    t = cuda.grid(1)
    per = weight.shape[1]
    if t < order.shape[0] * per:
        g = t // per
        out[g, t - g * per] = weight[order[g], t - g * per]


def take_weights_cuda(weight, order):
    """Device ``weight[order]`` with :func:`take_weights_kernel`: one launch through
    the fast path, where ``cupy.take`` cost ~55 us of host time in a layer on the
    H100 (``benchmarks/probe_timeline.py``)."""
    K, c_in, c_out = weight.shape
    out = device_xp().empty((order.shape[0], c_in, c_out), dtype=weight.dtype)
    launch(take_weights_kernel, order.shape[0] * c_in * c_out, weight.reshape(K, c_in * c_out), order,
           out.reshape(order.shape[0], c_in * c_out))
    return out


class _PoolEvents:
    """Events reused from call to call (creating one costs host time): one that marks
    the caller's work before the GEMMs, and one per pool stream marking its end."""

    def __init__(self):
        import cupy

        self.ready = cupy.cuda.Event(disable_timing=True)
        self.done = [cupy.cuda.Event(disable_timing=True) for _ in range(STREAM_POOL)]


def grouped_gemm_cuda(in_buf, weight, groups, out_buf, streams=STREAM_POOL):
    """One batched cuBLAS GEMM per group, round-robin on a pool of ``streams`` streams.

    ``weight`` is on the device. Under the simulator there are no streams: this
    falls back to the reference. The pool waits for the work queued before it
    (the gather) through an event, and the caller's stream waits for every pool
    stream before the scatter, so no host synchronisation is needed.
    ``streams=1`` issues every GEMM on the caller's stream (no events at all).

    A strided batched GEMM wants the weights of a group's members equally spaced
    in memory, so the weights are first gathered into group order
    (:func:`take_weights_cuda`, ``K C_in C_out`` values, small next to the buffers).
    """
    if simulating():
        return grouped_gemm_reference(in_buf, weight, groups, out_buf)
    import cupy

    if not groups:
        return out_buf
    cublas, handle = _cublas()
    c_in, c_out, item = weight.shape[1], weight.shape[2], weight.itemsize
    t = _CUDA_TYPE[np.dtype(weight.dtype)]
    w_sorted = take_weights_cuda(weight, _device_order(tuple(k for g in groups for k in g.members)))
    caller = cupy.cuda.get_current_stream()
    streams_of_device, events = _stream_pool()
    pool = streams_of_device[:max(1, min(int(streams), STREAM_POOL))]
    if len(groups) == 1 or len(pool) == 1:
        pool = [caller]  # one stream: everything stays on the caller's, no events
    if pool[0] is not caller:
        caller.record(events.ready)
    pos = 0
    for i, g in enumerate(groups):
        s = pool[i % len(pool)]
        if s is not caller and i < len(pool):
            s.wait_event(events.ready)
        with s:  # CuPy's cuBLAS wrappers bind the handle to the current stream
            cublas.gemmStridedBatchedEx(
                handle, 0, 0, c_out, g.rows, c_in, _ONE_PTR,
                w_sorted.data.ptr + pos * c_in * c_out * item, t, c_out, c_in * c_out,
                in_buf.data.ptr + g.start * c_in * item, t, c_in, g.rows * c_in,
                _ZERO_PTR, out_buf.data.ptr + g.start * c_out * item, t, c_out, g.rows * c_out,
                len(g.members), _COMPUTE_32F, _GEMM_DEFAULT)
        pos += len(g.members)
    for s, done in zip(pool[:len(groups)], events.done):
        if s is not caller:
            caller.wait_event(s.record(done))
    return out_buf
