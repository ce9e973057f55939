"""Small device arrays cut from one allocation, as light as a kernel argument can be.

The Map step needs a dozen small arrays per call (flags, counters, scratch). On a
GPU each CuPy allocation or slice costs microseconds of host time, and on a small
scan the host sets the step's time; so they are cut, as :class:`Piece` objects,
from one allocation whose layout is worked out once per layer. Under the simulator
:func:`piece` returns plain NumPy views instead. ``docs/performance.md`` explains
where this sits in the launch path.
"""
from __future__ import annotations

import threading

import numpy as np

from .device import device_xp, simulating
from .state import remember


class Piece:
    """A contiguous piece of a device array, as light as a kernel argument can be.

    Why: on the GPU machine every CuPy slice, ``view(...).reshape(...)`` and
    allocation costs microseconds of host time, and the Map step needs a dozen
    small arrays (flags, counters, scratch). Made from one allocation, as
    pieces, they cost a Python object each (the figures:
    ``docs/performance.md``, "Memory without host round trips"). A piece is only
    ever handed to :func:`numba_sc.core.launch.launch` (whose fast path,
    :class:`numba_sc.core.fast_launch.FastLauncher`, knows the class and reads its
    fields directly; Numba's dispatcher reads ``__cuda_array_interface__``) or read back with
    ``get()``; it keeps its base array alive. Under the simulator
    :func:`piece` returns plain NumPy views instead.
    """

    __slots__ = ("base", "offset", "ptr", "shape", "strides", "dtype", "size", "itemsize", "ndim", "flat", "sig",
                 "__weakref__")

    def __init__(self, base, offset, shape, dtype):
        self.base, self.offset, self.ptr = base, offset, base.data.ptr + offset
        self.dtype, self.itemsize = dtype, dtype.itemsize
        self.shape, self.ndim = shape, len(shape)
        size, strides = 1, ()
        for n in reversed(shape):
            strides = (size * dtype.itemsize,) + strides
            size *= n
        self.size, self.strides = size, strides
        # What FastLauncher needs, made once here instead of at every launch: the
        # flattened Numba array struct (meminfo, parent, size, itemsize, data
        # pointer, shape..., strides...) and the signature key of the argument.
        self.flat = (0, 0, size, dtype.itemsize, self.ptr, *shape, *strides)
        self.sig = (dtype.char, len(shape), True)

    def rebased(self, base):
        """The same piece (offset, shape, dtype) of another allocation ``base``:
        about half the host time of a new piece (the Map step cuts a dozen per call)."""
        p = Piece.__new__(Piece)
        p.base, p.offset, p.ptr = base, self.offset, base.data.ptr + self.offset
        p.dtype, p.itemsize, p.shape, p.ndim = self.dtype, self.itemsize, self.shape, self.ndim
        p.size, p.strides, p.sig = self.size, self.strides, self.sig
        p.flat = self.flat[:4] + (p.ptr,) + self.flat[5:]
        return p

    @property
    def data(self):  # what the fast launcher reads from a CuPy array: .data.ptr
        return self

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": None, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3, "stream": None}

    def as_cupy(self):
        """The same memory as a CuPy array (a CuPy call costs what a piece saves)."""
        import cupy

        return cupy.ndarray(self.shape, self.dtype, self.base.data + self.offset)

    def get(self):
        """The piece's contents on the host (waits for the GPU, like CuPy's ``get``).

        Through a pinned host buffer kept per thread: the Map step ends with one
        such read, and a copy from pinned memory skips the driver's staging of
        pageable memory (and the CuPy array ``as_cupy`` would make)."""
        return self._read("buf")()

    def get_async(self):
        """:meth:`get` in two halves: queue the copy now, return a function that waits
        for it and returns the contents. GPU work queued in between runs after
        the copy, and the host need not wait for it. One such read in flight per
        thread (it has its own pinned buffer, which the next one reuses)."""
        return self._read("async_buf")

    def _read(self, slot):
        import cupy

        nbytes = self.size * self.itemsize
        # One buffer and event per thread, slot and device (an event belongs to a device)
        key = (slot, cupy.cuda.runtime.getDevice())
        staging = _READS.__dict__.get(key)
        if staging is None or staging[0].nbytes < nbytes:
            import cupyx

            buf = cupyx.empty_pinned(max(nbytes, 4096), np.uint8)
            # (.ctypes builds an object per call: the address is kept)
            staging = _READS.__dict__[key] = (buf, buf.ctypes.data, cupy.cuda.Event(disable_timing=True))
        buf, address, done = staging
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(address, self.ptr, nbytes, 2, stream.ptr)  # 2: device to host
        done.record(stream)
        dtype, shape = self.dtype, self.shape

        def wait():
            done.synchronize()
            return buf[:nbytes].view(dtype).reshape(shape).copy()  # the buffer is reused: copy out
        return wait


class _NoBase:
    """Stands in for an allocation when a :func:`piece_template` is made: address 0."""

    class data:
        ptr = 0

    nbytes = 1 << 62


def piece_template(offset, shape, dtype):
    """A :class:`Piece` at ``offset`` of no allocation yet: ``.rebased(base)`` puts it
    in one. For layouts worked out once and cut from a new allocation each call
    (less than half the host time of :func:`piece`; the caller has checked that
    the layout fits). It holds no allocation, so
    a cache of templates keeps no device memory alive. GPU only."""
    return Piece(_NoBase, offset, shape, np.dtype(dtype))


def as_array(a):
    """A :class:`Piece` as a CuPy array; any other array as it is."""
    return a.as_cupy() if type(a) is Piece else a


def piece(base, offset, shape, dtype):
    """Bytes ``offset ..`` of the C-contiguous device array ``base`` as an array of
    ``shape`` (a tuple of ints) and ``dtype``: a :class:`Piece` on a GPU, a NumPy
    view under the simulator. ``offset`` must be a multiple of the dtype's size.

    Plain Python arithmetic on purpose: ``np.prod`` of a shape alone costs more
    host time than the whole of this function's arithmetic.
    """
    dtype = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, np.dtype(dtype))
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if offset % dtype.itemsize or offset + nbytes > base.nbytes:
        raise ValueError(f"piece of {nbytes} bytes at {offset} does not fit or align in {base.nbytes} bytes")
    if simulating():
        return base.reshape(-1).view(np.uint8)[offset:offset + nbytes].view(dtype).reshape(shape)
    return Piece(base, offset, shape, dtype)


_DTYPES = remember({})  # dtype argument -> np.dtype (np.dtype() costs host time)
_READS = threading.local()  # (slot, device) -> this thread's pinned buffer, its address and event


# ------------------------------------------- placeholders: arrays a kernel never touches


def placeholder(shape=(1, 1)):
    """The int64 zeros passed for an array a kernel takes but never touches (the
    masks of a search that sets none; the device count of outputs the host knows);
    one per array library and shape, made once. Never the same array as another
    argument: the simulator copies each argument back after the launch."""
    xp = device_xp()
    if (xp, shape) not in _NO_MASKS:
        _NO_MASKS[xp, shape] = xp.zeros(shape, np.int64)
    return _NO_MASKS[xp, shape]


_NO_MASKS = remember({})  # placeholders per array library and shape, made once
