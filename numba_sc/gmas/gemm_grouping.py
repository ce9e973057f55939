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

**A launch has a price too** (``launch_rows``). On a small cloud the GPU
finishes each kernel faster than the host issues the next one: there, in the
host time one batched GEMM's launch costs (``LAUNCH_US``, cuBLAS's own share,
measured: ``docs/performance.md``, "gmas/gemm_grouping.py"), the GPU would
multiply thousands of padding rows.
So the policy also extends a group when the padding the extension adds is at
most ``launch_rows`` rows, the rows the GPU moves in the time one launch costs
the host (:func:`launch_rows`: bytes per row at ``BYTES_PER_US``, or flops per
row at ``FLOPS_PER_US`` when those take longer). Each such extension saves one
launch. ``launch_rows=0`` is the plain padding policy above (the default of the
functions here and of :func:`numba_sc.gmas.plan.build_plan`);
:func:`numba_sc.sparse_conv3d` prices launches by its channels unless told
otherwise. On the scan above, 64 -> 64 channels in fp16 (``launch_rows`` ~117k)
gives 2 GEMMs, 18 offsets of 3,239 rows and 8 of 21,662; 4 -> 16 in fp32
(~375k) gives 1; 256 -> 256 in fp32 (~4.6k) keeps the 4 (what each saved: ``docs/performance.md``, "gmas/gemm_grouping.py").

Every group is one batched GEMM, ``(G, rows, C_in) @ (G, C_in, C_out)``: cuBLAS
(called directly, :func:`grouped_gemm_cuda`) on the GPU, ``np.matmul`` under the
simulator and in the reference. On the GPU the groups are issued round-robin on a pool of 4 CUDA
streams so that small GEMMs overlap (Minuet found no gain beyond 4).

Napkin math: the GEMMs read ``4 * rows * C_in`` bytes of buffer and write
``4 * rows * C_out`` (fp32), so each percent of padding is a percent more GEMM
traffic and flops; the grouping itself is a sort of K numbers on the host.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from numba import cuda

from ..core.device import device_xp, simulating
from ..core.launch import launch
from ..core.state import remember

DEFAULT_MAX_PADDING = 0.25  # a group may add at most 25 % zero rows to its real rows
DEFAULT_SOLO_ROWS = 1 << 17  # an offset with this many pairs runs as its own GEMM
STREAM_POOL = 4  # Minuet's pool size (Section 5.2.2)

# What launch_rows weighs (NVIDIA H100; the old benchmarks/README.md's session 7,
# `git show 5cd0a3e:benchmarks/README.md`): the host time of one batched cuBLAS GEMM
# issued by grouped_gemm_cuda (LAUNCH_US: the bare call's is `direct_cublas_batched_host`
# in benchmarks/results/archive/probe_host_costs_h100_2026-11-22.json, quoted in
# docs/performance.md, "gmas/gemm_grouping.py"), and what the GPU does meanwhile with
# padding rows: buffer bytes (memory bound, small channel counts) or flops (large ones;
# fp32 without TF32, fp16 on tensor cores with fp32 sums), at rates estimated below.
LAUNCH_US = 12.0
# The two rates are estimates, not measurements: sustained memory bandwidth, and
# what cuBLAS reaches on skinny GEMMs (fp32 on CUDA cores, fp16 on tensor cores).
BYTES_PER_US = 2.5e6  # ~2.5 TB/s  # typed: napkin math
FLOPS_PER_US = {4: 5.0e7, 2: 2.0e8}  # itemsize -> ~50 TFLOP/s fp32, ~200 fp16  # typed: napkin math


def launch_rows(c_in: int, c_out: int, itemsize: int) -> int:
    """Padding rows the GPU multiplies in the time one GEMM launch costs the host.

    A padding row costs the GEMM ``(C_in + C_out) * itemsize`` bytes of traffic
    and ``2 C_in C_out`` flops; whichever takes longer prices it. For 4 -> 16 fp32
    that is ~375k rows per launch, for 64 -> 64 fp16 ~117k, for 256 -> 256 fp32
    ~4.6k: the fewer the channels, the more padding a saved launch is worth.
    """
    per_row_us = max((c_in + c_out) * itemsize / BYTES_PER_US,
                     2.0 * c_in * c_out / FLOPS_PER_US.get(itemsize, FLOPS_PER_US[4]))
    return int(LAUNCH_US / per_row_us)


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
    return np.array(offset_order_list(_ints(counts), sort, skip), dtype=np.int64)


def _ints(values) -> list:
    """K numbers as a list of Python ints: the grouping loops over a few dozen
    numbers, where a list beats NumPy calls (each costs a microsecond or more)."""
    return values if type(values) is list else np.asarray(values, dtype=np.int64).tolist()


def offset_order_list(c: list, sort: bool, skip) -> list:
    """:func:`offset_order` on a list of ints, as a list."""
    ks = [k for k, n in enumerate(c) if n > 0 and k != skip]
    if sort:
        ks.sort(key=c.__getitem__)  # Python's sort is stable: ties keep the map's order
    return ks


def make_groups(counts, order, max_padding=DEFAULT_MAX_PADDING,
                solo_rows=DEFAULT_SOLO_ROWS, launch_rows=0) -> list:
    """Group adjacent offsets of ``order`` under the padding policy (module docstring).

    Returns the :class:`Group` list; groups are laid out back to back in the
    buffer in this order.
    """
    if max_padding < 0:
        raise ValueError(f"max_padding must be >= 0 (a fraction of real rows), got {max_padding}")
    if launch_rows < 0:
        raise ValueError(f"launch_rows must be >= 0 (padding rows a launch is worth), got {launch_rows}")
    counts = _ints(counts)
    groups, start = [], 0
    members, real, tallest = [], 0, 0
    for k in _ints(order):
        c = counts[k]
        if members:
            t = tallest if tallest > c else c
            grown = real + c
            padding = t * (len(members) + 1) - grown
            # Extend while the padding stays within the budget, or adds no more rows
            # than the launch it saves is worth; and while the group is not already
            # tall enough to fill the GPU alone.
            if (padding <= max_padding * grown or padding - (tallest * len(members) - real) <= launch_rows) \
                    and t < solo_rows:
                members.append(k)
                real, tallest = grown, t
                continue
            groups.append(Group(tuple(members), tallest, start))
            start += tallest * len(members)
        members, real, tallest = [k], c, c
    if members:
        groups.append(Group(tuple(members), tallest, start))
    return groups


def padding_report(counts, skip=None, max_padding=DEFAULT_MAX_PADDING,
                   solo_rows=DEFAULT_SOLO_ROWS, launch_rows=0) -> dict:
    """Padding overhead and GEMM launches of the grouping, sorted vs map order.

    For each of ``"sorted"`` and ``"map"``: ``real_rows`` (pairs), ``padding_rows``
    (zero rows added), ``total_rows``, ``overhead`` = padding_rows / real_rows and
    ``launches`` (batched GEMMs). ``skip`` is an offset handled outside the
    groups (the submanifold centre), counted in neither.
    """
    out = {}
    for name, sort in (("sorted", True), ("map", False)):
        order = offset_order(counts, sort, skip)
        groups = make_groups(counts, order, max_padding, solo_rows, launch_rows)
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


def product_dtype(dtype) -> np.dtype:
    """The dtype of the GEMMs' output buffer for features of ``dtype``: the features'
    own (float16, float32, float64).

    In fp16 the buffer holds each per-offset product rounded to fp16: the GEMMs write
    and the scatter reads ``2 n C_out`` bytes where float32 products cost twice that
    (``benchmarks/probes/fp16_products.py`` times the two on a layer and on MinkUNet42;
    ``benchmarks/results/fp16_products.json`` holds what it measured). A product that
    passes fp16's range (65504) while the output does not (``+40000 * 2`` and
    ``-40000 * 2`` through two offsets sum to 0, where an fp16 buffer holds ``+inf``
    and ``-inf``) is computed again in fp32 by the scatter
    (:func:`numba_sc.gmas.scatter.product_of`; the reference:
    :func:`repaired_products`), so the sum is the one the implicit GEMM and
    fetch-on-demand dataflows give (they accumulate in registers).
    """
    return np.dtype(dtype)


def repaired_products(exact, dtype):
    """The buffer's values as the kernels leave them for the scatter: ``exact`` (fp32)
    rounded to ``dtype``, except where the rounding overflows (inf or NaN from finite
    ``exact``): there the fp32 value the scatter computes again. Kept in ``exact``'s
    dtype, which can hold both."""
    if np.dtype(dtype) == exact.dtype:  # nothing is rounded
        return exact
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the point
        rounded = exact.astype(dtype)
        return np.where(np.isfinite(rounded), rounded.astype(exact.dtype), exact)


def grouped_gemm_reference(in_buf, weight, groups, out_buf):
    """One ``np.matmul`` per group: ``out_buf[group rows] = in_buf[group rows] @ W``.

    fp16 operands are multiplied in fp32 (fp32 accumulation, as cuBLAS does for
    half precision) and rounded once, to ``out_buf``'s dtype: a product past fp16's
    range becomes inf there, as cuBLAS writes it (the scatter computes it again,
    :func:`product_of <numba_sc.gmas.scatter.product_of>`).
    """
    for g in groups:
        a = in_buf[g.start:g.start + g.padded_rows].reshape(len(g.members), g.rows, -1)
        w = weight[list(g.members)]
        if a.dtype == np.float16:
            a, w = a.astype(np.float32), w.astype(np.float32)
        with np.errstate(over="ignore"):
            out_buf[g.start:g.start + g.padded_rows] = np.matmul(a, w).reshape(g.padded_rows, -1)
    return out_buf


# ---------------------------------------------------------------- on the GPU
# Everything below runs once or more per layer, between kernels the GPU finishes
# faster than the host issues them (SemanticKITTI at 0.05 m): each microsecond of
# Python here is a microsecond of layer time, so the modules are imported once
# (an ``import`` statement inside a function looks the module up and binds its
# name again at every call) and the pool's streams and events are made once.
_GPU = remember([])  # [cupy, CuPy's cuBLAS module], filled on first use


def _gpu():
    """``(cupy, cublas)``, imported on first use (the reference and the simulator
    never need them)."""
    if not _GPU:
        import cupy
        from cupy_backends.cuda.libs import cublas

        _GPU[:] = [cupy, cublas]
    return _GPU


_POOLS = remember({})  # device id -> (the pool's side streams, its reusable events); cleared: new ones


class _PoolEvents:
    """Events reused from call to call (creating one costs host time): one that marks
    the caller's work before the GEMMs, and one per side stream marking its end."""

    def __init__(self, cupy):
        self.ready = cupy.cuda.Event(disable_timing=True)
        self.done = [cupy.cuda.Event(disable_timing=True) for _ in range(STREAM_POOL - 1)]


def _stream_pool(cupy):
    """This device's side streams (STREAM_POOL - 1 of them: the caller's own stream is
    the pool's first) and the events reused with them (streams and events belong
    to the device they were made on)."""
    device = cupy.cuda.runtime.getDevice()
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS[device] = ([cupy.cuda.Stream(non_blocking=True) for _ in range(STREAM_POOL - 1)],
                                 _PoolEvents(cupy))
    return pool


# cuBLAS is called directly rather than through ``cupy.matmul``: on the H100 a
# batched ``cupy.matmul`` costs about twice the host time of the bare cuBLAS call
# (`cupy_matmul_batched_host` against `direct_cublas_batched_host` in
# benchmarks/results/archive/probe_host_costs_h100_2026-11-22.json; docs/performance.md,
# "Calling cuBLAS directly"), and a layer makes several. Row-major ``C = A @ W``
# is, read column-major, ``C^T = W^T A^T``: so cuBLAS is asked for ``m = C_out,
# n = rows, k = C_in`` with W as its first operand, and no transposition is ever
# materialized.
_CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}  # CUDA_R_32F, CUDA_R_16F
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation for both dtypes (no TF32)
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
_ONE = np.ones(1, np.float32)  # alpha and beta live on the host (cuBLAS's default pointer mode)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data  # (.ctypes builds an object per call)


def centre_product_cuda(features, weight, centre, dtype=None):
    """``features @ weight[centre]`` as one cuBLAS call (the submanifold centre), written
    in ``dtype`` (default: the features'; ``np.float32`` for fp16 features gives the
    fp32 product that a layer run in windows starts its sums from, with no fp32 copy
    of the operands: cuBLAS reads fp16 and writes fp32)."""
    dtype = features.dtype if dtype is None else np.dtype(dtype)
    if simulating():
        if dtype != features.dtype:  # accumulated in fp32 and kept so: no rounding to fp16
            return np.matmul(features.astype(dtype), weight[centre].astype(dtype))
        return matmul(features, weight[centre])
    c_in, c_out = weight.shape[1], weight.shape[2]
    return _product(features, weight.data.ptr + centre * c_in * c_out * weight.itemsize, c_out, dtype)


def matmul_cuda(features, matrix):
    """``features @ matrix`` for a (C_in, C_out) matrix on the device, as one cuBLAS
    call: a 1x1x1 convolution or a linear layer on every point."""
    if simulating():
        return matmul(features, matrix)
    return _product(features, matrix.data.ptr, matrix.shape[1])


def transposed_products_cuda(a, b, start, rows, batch, out, out_start=0, accumulate=False):
    """``out[out_start + m] = A_m.T @ B_m`` for m < ``batch``, where ``A_m`` and ``B_m`` are
    the ``rows`` x C row blocks of ``a`` (N, C_a) and ``b`` (N, C_b) starting at row
    ``start + m * rows``; ``out`` (M, C_a, C_b). One strided batched cuBLAS call that
    reads the blocks in place (the weight gradient of a group of offsets: the
    array library's ``matmul`` of a transposed view copies it first).
    ``accumulate``: add to ``out`` instead (``+=``, cuBLAS's beta = 1), for an
    offset whose rows come in pieces (:mod:`numba_sc.gmas.workspace`)."""
    if simulating():
        for m in range(batch):
            lo = start + m * rows
            p = matmul(np.ascontiguousarray(a[lo:lo + rows].T), b[lo:lo + rows])
            if accumulate:
                p = (out[out_start + m].astype(np.float32) + p.astype(np.float32)).astype(out.dtype)
            out[out_start + m] = p
        return out
    cupy, cublas = _gpu()
    ca, cb, item = a.shape[1], b.shape[1], a.itemsize
    t = _CUDA_TYPE[a.dtype]
    # Row-major out_m (C_a x C_b) is column-major out_m^T = B_m^T A_m: cuBLAS reads B_m as the
    # column-major (C_b x rows) matrix it is in memory, and A_m (C_a x rows) transposed.
    cublas.gemmStridedBatchedEx(
        cupy.cuda.device.get_cublas_handle(), 0, 1, cb, ca, rows, _ONE_PTR,
        b.data.ptr + start * cb * item, t, cb, rows * cb,
        a.data.ptr + start * ca * item, t, ca, rows * ca,
        _ONE_PTR if accumulate else _ZERO_PTR, out.data.ptr + out_start * ca * cb * item, t, cb, ca * cb,
        batch, _COMPUTE_32F, _GEMM_DEFAULT)
    return out


def _product(features, w_ptr, c_out, dtype=None):
    """(N, C_in) features times the row-major (C_in, C_out) matrix at ``w_ptr`` (of the
    features' dtype), written in ``dtype`` (default: the features')."""
    cupy, cublas = _gpu()
    n, c_in = features.shape
    out = cupy.empty((n, c_out), dtype=features.dtype if dtype is None else dtype)
    t = _CUDA_TYPE[features.dtype]
    cublas.gemmEx(cupy.cuda.device.get_cublas_handle(), 0, 0, c_out, n, c_in, _ONE_PTR, w_ptr, t, c_out,
                  features.data.ptr, t, c_in, _ZERO_PTR, out.data.ptr, _CUDA_TYPE[out.dtype], c_out,
                  _COMPUTE_32F, _GEMM_DEFAULT)
    return out


_ORDER_CACHE = remember({})  # (groups' members, device) -> their offsets on that device


def device_order(groups, xp):
    """The offsets of ``groups``, in buffer order, as an array of ``xp`` (CuPy, or NumPy
    under the simulator): copied to the device once per grouping (a layer sees the
    same few groupings call after call)."""
    members = tuple(g.members for g in groups)
    key = (members, -1 if xp is np else xp.cuda.runtime.getDevice())
    order = _ORDER_CACHE.get(key)
    if order is None:
        if len(_ORDER_CACHE) > 256:
            _ORDER_CACHE.clear()
        order = _ORDER_CACHE[key] = xp.asarray(np.array([k for m in members for k in m], dtype=np.int64))
    return order


def take_weights_reference(weight, order):
    """``weight[order]``: the weights of the buffer's offsets, in buffer order."""
    return np.asarray(weight)[np.asarray(order)]


@cuda.jit
def take_weights_kernel(weight, order, out):
    """``out[g] = weight[order[g]]``, one thread per value, in memory order: neighbouring
    threads copy neighbouring values of one matrix."""
    t = cuda.grid(1)
    c_out = weight.shape[2]
    per = weight.shape[1] * c_out
    if t < order.shape[0] * per:
        g = t // per
        r = t - g * per
        i = r // c_out
        j = r - i * c_out
        out[g, i, j] = weight[order[g], i, j]


def take_weights_cuda(weight, order):
    """Device ``weight[order]`` with :func:`take_weights_kernel`: one launch through
    the fast path, cheaper in host time than ``cupy.take`` (``docs/performance.md``,
    "Calling cuBLAS directly")."""
    K, c_in, c_out = weight.shape
    n = order.shape[0]
    out = device_xp().empty((n, c_in, c_out), dtype=weight.dtype)
    launch(take_weights_kernel, n * c_in * c_out, weight, order, out)
    return out


def grouped_gemm_cuda(in_buf, weight, groups, out_buf, streams=STREAM_POOL):
    """One batched cuBLAS GEMM per group, round-robin on a pool of ``streams`` streams.

    ``out_buf`` may be float32 for fp16 operands (``products=np.float32`` of
    :func:`numba_sc.conv.dataflow.gather_gemm_scatter`): cuBLAS reads fp16, accumulates
    in fp32 and writes fp32. ``weight`` is on the device. Under the simulator there are no streams: this
    falls back to the reference. The pool's first stream is the caller's own;
    the others wait for the work queued before the GEMMs (the gather) through an
    event, and the caller's stream waits for each of them before the scatter, so
    no host synchronisation is needed. ``streams=1`` issues every GEMM on the
    caller's stream (no events at all).

    A strided batched GEMM wants the weights of a group's members equally spaced
    in memory, so the weights are first gathered into group order
    (:func:`take_weights_cuda`, ``K C_in C_out`` values, small next to the buffers).
    """
    if simulating():
        return grouped_gemm_reference(in_buf, weight, groups, out_buf)
    if not groups:
        return out_buf
    cupy, cublas = _gpu()
    handle = cupy.cuda.device.get_cublas_handle()
    c_in, c_out, item, out_item = weight.shape[1], weight.shape[2], weight.itemsize, out_buf.itemsize
    t, out_t = _CUDA_TYPE[weight.dtype], _CUDA_TYPE[out_buf.dtype]
    # Keep the gathered weights referenced until the side streams' GEMMs are joined below:
    # dropped early, their block returns to CuPy's pool tagged with the caller's stream,
    # and another thread allocating on that stream can write it while a side stream's GEMM
    # still reads it (seen with the training loader's threads: non-finite logits).
    w = take_weights_cuda(weight, device_order(groups, cupy))
    w_ptr = w.data.ptr
    a_ptr, c_ptr, w_step = in_buf.data.ptr, out_buf.data.ptr, c_in * c_out
    caller = cupy.cuda.get_current_stream()
    n_streams = max(1, min(int(streams), STREAM_POOL, len(groups)))
    side, events = _stream_pool(cupy) if n_streams > 1 else ((), None)
    pool = [caller, *side[:n_streams - 1]]
    if n_streams > 1:
        caller.record(events.ready)
        for s in pool[1:]:
            s.wait_event(events.ready)
    pos = 0
    for i, g in enumerate(groups):
        s = pool[i % n_streams]
        # CuPy's cuBLAS wrappers bind the handle to the *current* stream: only a side
        # stream needs to be made current.
        with (s if s is not caller else _SAME):
            cublas.gemmStridedBatchedEx(
                handle, 0, 0, c_out, g.rows, c_in, _ONE_PTR,
                w_ptr + pos * w_step * item, t, c_out, w_step,
                a_ptr + g.start * c_in * item, t, c_in, g.rows * c_in,
                _ZERO_PTR, c_ptr + g.start * c_out * out_item, out_t, c_out, g.rows * c_out,
                len(g.members), _COMPUTE_32F, _GEMM_DEFAULT)
        pos += len(g.members)
    for s, done in zip(pool[1:], events.done if events else ()):
        caller.wait_event(s.record(done))
    del w  # now any later use of its block is queued after every GEMM that read it
    return out_buf


_SAME = nullcontext()  # reusable: "no stream switch" for the caller's own stream
