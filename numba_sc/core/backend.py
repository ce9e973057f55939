"""Backend selection and the API edge where arrays move to and from the device.

Two backends compute every stage:

``"cuda"``
    The CUDA kernels (Numba). On a machine with a GPU they run on it, with CuPy
    for the library pieces (sort, scan, GEMM). With ``NUMBA_ENABLE_CUDASIM=1`` set
    *before numba is imported* the very same kernels run on the CPU under Numba's
    CUDA simulator, one Python thread per CUDA thread, and the library pieces come
    from NumPy: that is how the tests run on machines without a GPU, and how you
    step through a kernel with ``pdb``.
``"reference"``
    The vectorized NumPy version of each stage.

``backend=None`` picks ``"cuda"`` when a GPU or the simulator is active, else
``"reference"``. Functions accept NumPy or CuPy arrays and return the kind they
were given; arrays move between host and device only here, at the edge.
"""
from __future__ import annotations

import numpy as np

from .device import device_xp, gpu_present, is_cupy, simulating
from .fast_launch import c_contiguous_reader
from .pieces import Piece
from .state import remember

BACKENDS = ("cuda", "reference")


def resolve_backend(backend=None) -> str:
    """Turn the ``backend`` argument into ``"cuda"`` or ``"reference"``."""
    if backend is None:
        return "cuda" if (simulating() or gpu_present()) else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "cuda" and not (simulating() or gpu_present()):
        raise RuntimeError(
            "backend='cuda' needs a CUDA GPU, or the simulator: set NUMBA_ENABLE_CUDASIM=1 "
            "before numba is imported; or use backend='reference'")
    return backend


def to_device(a):
    """Host or CuPy array -> the device side's array kind, C-contiguous.

    A no-op when the array is already there and contiguous, and for a
    :class:`Piece` (``cupy.asarray`` of one would cost more host time than the
    piece saved). Kernels index rows
    with plain strides, so a column slice such as ``scan[:, :3]`` is copied once
    here rather than refused later.
    """
    t = type(a)
    if t is _CONTIGUITY[0] and _CONTIGUITY[1](a):
        return a  # a CuPy array already: the common case, no library call (host time saved)
    if a is None or t is Piece:
        return a  # (a piece is device memory, contiguous, already)
    xp = device_xp()
    a = xp.asarray(a)
    if xp is not np and _CONTIGUITY[0] is None:
        _CONTIGUITY[:] = [xp.ndarray, c_contiguous_reader(xp.ndarray)]
    # (not ascontiguousarray unconditionally: it turns a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


# [CuPy's ndarray, how to read its contiguity cheaply], once seen (core/fast_launch.py knows
# CuPy's flag); a list, not a dict, so that the common case above is one identity test
_CONTIGUITY = [None, None]


def filled(shape, dtype, value):
    """A new device array of ``shape`` with every element ``0`` or ``-1``.

    Why not ``cupy.full``: it launches an elementwise kernel, which costs tens of
    microseconds of host time, and it writes at a fraction of the memory
    bandwidth (``docs/performance.md``, "Memory without host round trips").
    0 and -1 are the two values whose bytes are all equal (0x00, 0xFF in two's
    complement), so a byte-wise ``cudaMemsetAsync`` - one driver call, queued on
    the current stream - writes them at full bandwidth.
    """
    if value not in (0, -1):
        raise ValueError(f"filled() writes 0 or -1 only (a byte pattern), got {value!r}")
    xp = device_xp()
    if xp is np:
        return np.full(shape, value, dtype=dtype)
    a = xp.empty(shape, dtype=dtype)
    if a.nbytes:
        xp.cuda.runtime.memsetAsync(a.data.ptr, value & 0xFF, a.nbytes, xp.cuda.get_current_stream().ptr)
    return a


class _InFlight(list):
    """(pinned host buffer, event after its copy) pairs, kept alive until their copy is
    done; cleared (``numba_sc.clear_caches``) only after waiting for every copy, as a
    buffer freed under a running copy would be overwritten mid-copy."""

    def clear(self):
        for _buf, done in self:
            done.synchronize()
        super().clear()


_STAGING = remember(_InFlight())


def to_device_async(host):
    """Copy a small host array to the device without making the host wait.

    ``cupy.asarray(numpy_array)`` copies from pageable memory, and the driver
    first waits for all work queued on the stream: a hidden sync that stalls the
    host until the GPU has caught up (``docs/performance.md``). Staged
    through pinned memory the copy is queued like a kernel. The pinned buffer
    must outlive the copy, so it is held here until its event has passed.
    """
    host = np.ascontiguousarray(host)
    if simulating():
        return host.copy()
    import cupy
    import cupyx

    _STAGING[:] = [(buf, ev) for buf, ev in _STAGING if not ev.done]
    pinned = cupyx.empty_pinned(host.shape, host.dtype)
    pinned[...] = host
    out = cupy.empty(host.shape, host.dtype)
    stream = cupy.cuda.get_current_stream()
    out.set(pinned, stream=stream)
    _STAGING.append((pinned, stream.record()))
    return out


def to_host(a):
    """Any array -> NumPy."""
    if a is None:
        return None
    return a.get() if is_cupy(a) or type(a) is Piece else np.asarray(a)


def read_later(a):
    """Start reading ``a`` to the host; return a function that finishes the read.

    For a :class:`Piece` the copy is queued at once (:meth:`Piece.get_async`), so
    the host can queue more work for the GPU before it waits; anything else is
    read when the function is called.
    """
    if type(a) is Piece:
        return a.get_async()
    return lambda: to_host(a)


def like(a, template):
    """Return ``a`` as the kind of array ``template`` is (NumPy or CuPy)."""
    if a is None:
        return None
    if is_cupy(template):
        return to_device(a) if not simulating() else a
    return to_host(a)
