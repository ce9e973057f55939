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

import array
import ctypes
import struct
import sys
import threading

import numpy as np
from numba import config, cuda

try:  # numba-cuda keeps its own config (newer releases); older ones share numba's
    from numba.cuda.core import config as _cuda_config
except ImportError:  # pragma: no cover
    _cuda_config = config

BACKENDS = ("cuda", "reference")
THREADS = 256  # default threads per block for one-thread-per-element kernels
SIMULATOR_SWITCH_INTERVAL = 5e-4  # seconds; Python's default is 5e-3


def simulating() -> bool:
    """True when Numba's CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1).

    numba-cuda reads the variable into its own config when ``numba.cuda`` is first
    imported; numba's core config may have read it earlier (a pytest plugin can
    import numba before conftest runs), so ask numba-cuda first.
    """
    return bool(_cuda_config.ENABLE_CUDASIM)


_GPU_PRESENT = None


def gpu_present() -> bool:
    """True when a real CUDA device can run kernels (the simulator does not count).

    Asked once per process: every layer resolves its backend, and asking the
    driver each time costs host time on the hot path.
    """
    global _GPU_PRESENT
    if simulating():
        return False
    if _GPU_PRESENT is None:
        try:
            _GPU_PRESENT = bool(cuda.is_available())
        except Exception:  # a broken driver is as good as no GPU
            _GPU_PRESENT = False
    return _GPU_PRESENT


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


def is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def device_xp():
    """The array library of the device side: CuPy on a GPU, NumPy under the simulator."""
    if simulating():
        return np
    import cupy  # imported lazily: the reference and simulator paths need no CuPy

    return cupy


def to_device(a):
    """Host or CuPy array -> the device side's array kind, C-contiguous.

    A no-op when the array is already there and contiguous, and for a
    :class:`Piece` (``cupy.asarray`` of one would cost more host time than the
    piece saved). Kernels index rows
    with plain strides, so a column slice such as ``scan[:, :3]`` is copied once
    here rather than refused later.
    """
    if a is None or type(a) is Piece:
        return a  # (a piece is device memory, contiguous, already)
    if type(a) in _CONTIGUOUS_DEVICE_TYPES and a._c_contiguous:
        return a  # a CuPy array already: the common case, no library call (~2 us saved)
    xp = device_xp()
    a = xp.asarray(a)
    if xp is not np and not _CONTIGUOUS_DEVICE_TYPES:
        _CONTIGUOUS_DEVICE_TYPES.add(xp.ndarray)
    # (not ascontiguousarray unconditionally: it turns a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


_CONTIGUOUS_DEVICE_TYPES = set()  # CuPy's ndarray, once seen (whose _c_contiguous flag is cheap to read)


def filled(shape, dtype, value):
    """A new device array of ``shape`` with every element ``0`` or ``-1``.

    Why not ``cupy.full``: it launches an elementwise kernel, which costs tens of
    microseconds of host time, and on the H100 it wrote a 108 MB table at a
    quarter of the memory bandwidth (129 us, the retired ``probe_timeline.py``, ``benchmarks/README.md``).
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


_STAGING = []  # (pinned host buffer, event after its copy): kept alive until the copy is done


def to_device_async(host):
    """Copy a small host array to the device without making the host wait.

    ``cupy.asarray(numpy_array)`` copies from pageable memory, and the driver
    first waits for all work queued on the stream: a hidden sync that stalls the
    host until the GPU has caught up (56 us in one layer on the H100). Staged
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


class Piece:
    """A contiguous piece of a device array, as light as a kernel argument can be.

    Why: on the GPU machine a CuPy slice costs ~3 us of host time, a
    ``view(...).reshape(...)`` ~7 us and an allocation ~4 us, and the Map step
    needs a dozen small arrays (flags, counters, scratch). Made from one
    allocation, as pieces, they cost a Python object each (~2 us). A piece is only
    ever handed to :func:`launch` (whose fast path reads its fields directly;
    Numba's dispatcher reads ``__cuda_array_interface__``) or read back with
    ``get()``; it keeps its base array alive. Under the simulator
    :func:`piece` returns plain NumPy views instead.
    """

    __slots__ = ("base", "offset", "ptr", "shape", "strides", "dtype", "size", "itemsize", "ndim", "flat", "sig",
                 "__weakref__")
    _c_contiguous = True

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
        ~1 us where a new piece costs ~2 us (the Map step cuts a dozen per call)."""
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


def read_later(a):
    """Start reading ``a`` to the host; return a function that finishes the read.

    For a :class:`Piece` the copy is queued at once (:meth:`Piece.get_async`), so
    the host can queue more work for the GPU before it waits; anything else is
    read when the function is called.
    """
    if type(a) is Piece:
        return a.get_async()
    return lambda: to_host(a)


class _NoBase:
    """Stands in for an allocation when a :func:`piece_template` is made: address 0."""

    class data:
        ptr = 0

    nbytes = 1 << 62


def piece_template(offset, shape, dtype):
    """A :class:`Piece` at ``offset`` of no allocation yet: ``.rebased(base)`` puts it
    in one. For layouts worked out once and cut from a new allocation each call
    (~0.3 us a piece instead of ~0.7 us through :func:`piece`, on this machine's
    CPU; the caller has checked that the layout fits). It holds no allocation, so
    a cache of templates keeps no device memory alive. GPU only."""
    return Piece(_NoBase, offset, shape, np.dtype(dtype))


def as_array(a):
    """A :class:`Piece` as a CuPy array; any other array as it is."""
    return a.as_cupy() if type(a) is Piece else a


def piece(base, offset, shape, dtype):
    """Bytes ``offset ..`` of the C-contiguous device array ``base`` as an array of
    ``shape`` (a tuple of ints) and ``dtype``: a :class:`Piece` on a GPU, a NumPy
    view under the simulator. ``offset`` must be a multiple of the dtype's size.

    Plain Python arithmetic on purpose: ``np.prod`` of a shape alone costs ~3 us.
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


_DTYPES = {}
_READS = threading.local()  # (slot, device) -> this thread's pinned buffer, its address and event


def like(a, template):
    """Return ``a`` as the kind of array ``template`` is (NumPy or CuPy)."""
    if a is None:
        return None
    if is_cupy(template):
        return to_device(a) if not simulating() else a
    return to_host(a)


def blocks_for(n: int, threads: int = THREADS) -> int:
    """Blocks needed for one thread per element; at least one so a launch is valid."""
    return max(1, (int(n) + threads - 1) // threads)


_EXTERNAL_STREAMS = {}


def _current_stream_ptr() -> int:
    """The raw handle of CuPy's current stream (0: the legacy default stream, which is
    also Numba's stream 0). Kernels run there to stay ordered with the CuPy work
    around them: CuPy enqueues on its *current* stream, which the caller may change.
    GPU only (the simulator has no streams); asked at every launch, so CuPy's
    function is looked up once."""
    if not _GET_STREAM:
        import cupy

        _GET_STREAM.append(cupy.cuda.get_current_stream)
    return _GET_STREAM[0]().ptr


_GET_STREAM = []


def _numba_stream(ptr):
    """A Numba stream for the raw handle ``ptr`` (wrapped once per stream, as creating
    the wrapper costs host time)."""
    if ptr == 0:
        return 0
    if ptr not in _EXTERNAL_STREAMS:
        _EXTERNAL_STREAMS[ptr] = cuda.external_stream(ptr)
    return _EXTERNAL_STREAMS[ptr]


def launch(kernel, n: int, *args, threads: int = THREADS, blocks: int | None = None):
    """Launch ``kernel`` with one thread per element of an ``n``-element range.

    The single place kernels are launched, so that launch overhead is tuned in
    one spot. ``blocks`` overrides the grid size for kernels that are not
    one-thread-per-element (e.g. one block per query block).

    On a GPU, after the first launch of a kernel with a given argument signature
    (which compiles it through Numba's dispatcher as usual), later launches go
    through :class:`FastLauncher`, which skips the dispatcher's per-call work.
    """
    if n <= 0:
        return
    grid = blocks if blocks is not None else blocks_for(n, threads)
    if simulating():
        ptr = 0
    else:
        ptr = _current_stream_ptr()
        if _FAST.launch(kernel, grid, threads, ptr, args):
            return
    stream = _numba_stream(ptr)
    # By default Numba *synchronizes the host* with the stream a CuPy argument
    # advertises (``__cuda_array_interface__["stream"]``) before every launch, so
    # the host would wait for the GPU at each kernel. Our kernels run on the very
    # stream the CuPy work is queued on (:func:`_current_stream_ptr`), so the order is
    # already guaranteed by the stream itself: that check is switched off around
    # our own launches only.
    previous = _cuda_config.CUDA_ARRAY_INTERFACE_SYNC, sys.getswitchinterval()
    _cuda_config.CUDA_ARRAY_INTERFACE_SYNC = 0
    if simulating():
        # The simulator runs each CUDA thread as a Python thread and polls them
        # while holding the GIL; a short switch interval makes a block of threads
        # several times faster. Nothing else about the run changes.
        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)
    try:
        kernel[grid, threads, stream](*args)
    finally:
        _cuda_config.CUDA_ARRAY_INTERFACE_SYNC = previous[0]
        sys.setswitchinterval(previous[1])
    if not simulating():
        _FAST.learn(kernel, args)


class FastLauncher:
    """Launch an already compiled Numba kernel on CuPy arrays with little host work.

    Why: a Numba launch given CuPy arrays costs ~117 us of host time on the GPU
    machine (measured, ``benchmarks/bench_launch.py``), because for every call
    and every array the dispatcher parses ``__cuda_array_interface__``, infers
    the Numba type, picks the compiled overload and wraps the array. A stage of
    ours is a few such launches on ~100k points, so the host, not the GPU, sets
    the time.

    What: Numba passes an array to a kernel as the flattened fields of its array
    struct: ``meminfo, parent, size, itemsize, data pointer, shape..., strides...``
    (see ``numba.cuda.dispatcher._Kernel._prepare_args``). Once a kernel has been
    compiled for a signature (the first, ordinary launch), this class remembers
    the compiled kernel under a cheap key (dtype, ndim and contiguity of each
    array, the type of each scalar) and builds those fields straight from the
    CuPy arrays. Anything it does not recognise falls back to the ordinary
    dispatcher path.

    How the fields reach the GPU: every one of them is an 8-byte integer (array
    fields, and the integer and boolean scalars our kernels take), so they are
    written into one ``array('q')`` per kernel signature, and the driver's
    ``cuLaunchKernel`` - through CuPy's thin Cython binding - gets an array of
    pointers to its slots, made once (a parameter narrower than 8 bytes reads the
    low bytes of its slot: little-endian). A float scalar goes in as the integer
    with its bits (a Python float is a float64 parameter; a NumPy float32 its
    four bytes). The driver copies the values at the call, so the slots can be
    rewritten at once; a lock keeps two threads from writing them together.
    ``raw = False`` sends every kernel through ``cuda.core.launch``, as Numba
    itself launches, for comparisons.

    (Tried and dropped: the same driver call through ``cuda.bindings``, 15.6 us a
    launch on the H100 against 13.5 us for ``cuda.core.launch``; through
    ``ctypes`` with the parameters packed by ``struct.pack_into``, 11.6 against
    10.2 us. Both bindings cost more per call than they saved.)
    """

    def __init__(self):
        self._compiled = {}  # (dispatcher, key) -> (cuda.core kernel, packers, _RawParams, raw packers)
        self._streams = {}
        self._configs = {}  # (grid, threads) -> LaunchConfig, made once
        self._array_types = set()  # CuPy's ndarray class, once seen
        self._cupy_type = None  # ... and the same class, for launch's one-pass path
        self.raw = True  # the driver path where it applies (see the class docstring)

    def _key(self, args):
        """A cheap signature of the arguments: what picks the compiled overload."""
        key = []
        for a in args:
            t = type(a)
            if t is Piece:
                key.append(a.sig)
            elif t in self._array_types or t.__module__.startswith("cupy"):
                self._array_types.add(t)
                if t.__name__ == "ndarray" and hasattr(a, "_c_contiguous"):
                    self._cupy_type = t  # launch's one-pass path knows it from now on
                contiguous = getattr(a, "_c_contiguous", None)  # CuPy's own flag: no Flags object
                if contiguous is None:
                    contiguous = a.flags.c_contiguous
                key.append((a.dtype.char, a.ndim, contiguous))
            elif t in (int, float, bool) or isinstance(a, np.generic):
                key.append(t)
            else:
                return None  # NumPy host arrays and the like: dispatcher path
        return tuple(key)

    def learn(self, kernel, args):
        """After an ordinary launch: remember the overload that just ran, and how to
        pass each argument (``None``: an array struct; else a ctypes constructor for
        ``cuda.core``, and for the driver's slots None (as it is) or a float's bits)."""
        key = self._key(args)
        if key is None or (kernel, key) in self._compiled:
            return
        try:
            from numba.cuda import types as nbtypes

            types = tuple(kernel.typeof_pyval(a) for a in args)
            compiled = kernel.overloads[types]
            core_kernel = compiled._codelibrary.get_cufunc().kernel
            packers, bits, n_params = [], [], 0
            for ty in compiled.argument_types:
                if isinstance(ty, nbtypes.Array):
                    packers.append(None)
                    bits.append(None)
                    n_params += 5 + 2 * ty.ndim
                    continue
                if isinstance(ty, nbtypes.Integer):
                    packers.append(getattr(ctypes, f"c_{ty}"))
                    bits.append(None)
                elif ty == nbtypes.boolean:
                    packers.append(bool)
                    bits.append(None)
                elif ty == nbtypes.float64:
                    packers.append(ctypes.c_double)
                    bits.append(_float64_bits)
                elif ty == nbtypes.float32:
                    packers.append(ctypes.c_float)
                    bits.append(_float32_bits)
                else:
                    return  # an argument kind this class does not pack: slow path
                n_params += 1
            raw = _RawParams(int(core_kernel.handle), n_params)
        except Exception:  # an internal moved in another numba-cuda: stay on the slow path
            return
        self._compiled[(kernel, key)] = (core_kernel, tuple(packers), raw, tuple(bits))

    def _config(self, grid, threads):
        from cuda.core import LaunchConfig

        if len(self._configs) > 4096:  # grids follow the data sizes: keep the cache bounded
            self._configs.clear()
        config = self._configs[(grid, threads)] = LaunchConfig(grid=grid, block=threads)
        return config

    def _stream(self, ptr):
        from numba.cuda.cudadrv import driver

        core = self._streams[ptr] = driver._to_core_stream(_numba_stream(ptr))
        return core

    def launch(self, kernel, grid, threads, stream_ptr, args) -> bool:
        """Launch on the stream with raw handle ``stream_ptr``; False when this
        signature has not been learned (the caller takes the dispatcher path)."""
        # One pass makes both the signature key and, for the driver path, the
        # parameter fields: a CuPy array or a piece gives its array struct, an
        # integer or boolean scalar goes as it is into its 8-byte slot.
        key, flat = [], []
        cupy_type = self._cupy_type
        for a in args:
            t = type(a)
            if t is Piece:
                key.append(a.sig)
                flat += a.flat
            elif t is cupy_type:
                key.append((a.dtype.char, a.ndim, a._c_contiguous))
                flat += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
            elif t is int or t is bool:
                key.append(t)
                flat.append(a)
            elif t is float:  # a float64 parameter: its eight bytes, as an integer
                key.append(t)
                flat.append(_float64_bits(a))
            else:
                return self._launch_typed(kernel, grid, threads, stream_ptr, args)
        entry = self._compiled.get((kernel, tuple(key)))
        if entry is None:
            return False
        raw = entry[2]
        if raw is None or not self.raw:
            return self._launch_typed(kernel, grid, threads, stream_ptr, args)
        raw.launch(flat, grid, threads, stream_ptr)
        return True

    def _launch_typed(self, kernel, grid, threads, stream_ptr, args) -> bool:
        """:meth:`launch` for the rarer arguments (NumPy scalars, floats, array kinds
        seen for the first time) and kernels with a float parameter: the general
        key, and ``cuda.core.launch`` unless every field is an integer."""
        key = self._key(args)
        entry = self._compiled.get((kernel, key)) if key is not None else None
        if entry is None:
            return False
        core_kernel, packers, raw, bits = entry
        on_raw = raw is not None and self.raw
        flat = []
        for pack, to_bits, a in zip(packers, bits, args):
            if pack is None:  # the array struct, field by field (a piece has it ready)
                flat += a.flat if type(a) is Piece else (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape,
                                                         *a.strides)
            elif on_raw:  # a scalar into an 8-byte slot: as it is, or a float's bits
                flat.append(a if to_bits is None else to_bits(a))
            else:  # typed for cuda.core
                flat.append(pack(a))
        if on_raw:
            raw.launch(flat, grid, threads, stream_ptr)
            return True
        core_stream = self._streams.get(stream_ptr)
        if core_stream is None:
            core_stream = self._stream(stream_ptr)
        config = self._configs.get((grid, threads))
        if config is None:
            config = self._config(grid, threads)
        _core_launch()(core_stream, config, core_kernel, *flat)
        return True


def _float64_bits(v) -> int:
    """The eight bytes of ``v`` as a float64, read as a signed integer (a driver slot)."""
    return _Q.unpack(_D.pack(v))[0]


def _float32_bits(v) -> int:
    """The four bytes of ``v`` as a float32, as an integer (the slot's low bytes)."""
    return _I.unpack(_F.pack(v))[0]


_Q, _D, _I, _F = (struct.Struct(f) for f in ("<q", "<d", "<i", "<f"))


class _RawParams:
    """One kernel signature's parameter slots for ``cuLaunchKernel``: ``n`` 8-byte
    integers and the array of pointers to them that the driver reads."""

    def __init__(self, handle, n):
        from cupy_backends.cuda.api import driver

        self.handle, self.n, self._launch = handle, n, driver.launchKernel
        self.slots = array.array("q", bytes(8 * n))
        first = self.slots.buffer_info()[0]
        self.pointers = array.array("Q", [first + 8 * i for i in range(n)])
        self.pointers_at = self.pointers.buffer_info()[0]
        self.lock = threading.Lock()

    def launch(self, values, grid, threads, stream_ptr):
        if len(values) != self.n:
            raise AssertionError(f"kernel expects {self.n} parameter fields, got {len(values)}")
        with self.lock:
            self.slots[:] = array.array("q", values)  # same length: no reallocation, the pointers hold
            self._launch(self.handle, grid, 1, 1, threads, 1, 1, 0, stream_ptr, self.pointers_at, 0)


_CORE_LAUNCH = []


def _core_launch():
    """``cuda.core.launch``, imported on first use (the simulator never needs it)."""
    if not _CORE_LAUNCH:
        from cuda.core import launch as core_launch

        _CORE_LAUNCH.append(core_launch)
    return _CORE_LAUNCH[0]


_FAST = FastLauncher()
