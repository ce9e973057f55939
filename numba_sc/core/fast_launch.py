"""The fast launch path, and every private attribute of Numba and CuPy the library touches.

:func:`numba_sc.core.launch.launch` starts a kernel the way Numba teaches
(``kernel[blocks, threads](...)``); on a GPU it hands the launch to
:func:`launch_on_gpu`, here. After a kernel's first, ordinary launch with a given
argument signature (which compiles it through Numba's dispatcher),
:class:`FastLauncher` writes the kernel's parameters straight into the driver's
launch call, skipping the dispatcher's per-call work (``docs/performance.md``,
"The launch path", says what that saves).

Doing so reads a few attributes that Numba and CuPy keep private, and a new
release may move any of them. They are all used in this module and listed in
:data:`PRIVATE`; the fast launcher checks them once, at its first use, and if one
is missing it stays off (every launch takes the plain path) and says so in a
warning. ``tests/core/test_fast_launch.py`` fails loudly, naming the attribute and
the library's version, as soon as an installed release lacks one.

The same goes for the simulator's shared arrays (:func:`lock_simulator_shared_arrays`),
a repair of Numba's CUDA simulator that also reaches into its private parts.
"""
from __future__ import annotations

import array
import ctypes
import importlib
import importlib.metadata
import struct
import sys
import threading
import warnings
from operator import attrgetter

import numpy as np

from .device import numba_cuda_config, simulating
from .pieces import Piece
from .state import remember

PRIVATE = (
    # (owner, object path, attribute): every private attribute of Numba and CuPy used here.
    # An instance attribute counts as present when a method of its class names it.
    ("numba-cuda", "numba.cuda.dispatcher._Kernel", "_codelibrary"),  # a compiled kernel's code: its CUfunction
    ("numba-cuda", "numba.cuda.cudadrv.driver", "_to_core_stream"),  # a Numba stream as a cuda.core stream
    ("cupy", "cupy.ndarray", "_c_contiguous"),  # contiguity read without building a Flags object
    ("cupy", "cupy_backends.cuda.api.driver", "launchKernel"),  # cuLaunchKernel, CuPy's (internal) binding
    ("numba-cuda", "numba.cuda.simulator.kernelapi.FakeCUDAShared", "array"),  # the simulator's shared arrays
    ("numba-cuda", "numba.cuda.simulator.kernelapi.FakeCUDAShared", "_allocations"),  # ... and its dict of them
    ("numba-cuda", "numba.cuda.simulator.kernelapi", "types"),  # the simulator's own numba types
    ("numba-cuda", "numba.cuda.simulator.kernelapi", "numpy_support"),  # ... and dtype conversion
)
FAST_PATH = PRIVATE[:4]  # what FastLauncher needs (on a GPU)
SIMULATOR = PRIVATE[4:]  # what lock_simulator_shared_arrays needs (under the simulator)


def version(owner: str) -> str | None:
    """The installed version of the distribution ``owner`` (CuPy ships as ``cupy-cuda12x``
    and the like); None when it is not installed."""
    names = [owner] if owner != "cupy" else ["cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x"]
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _resolve(path: str):
    """The object at the dotted ``path``: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # not a module (ImportError), or one that refuses to load here
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def has_private(path: str, attribute: str) -> bool:
    """Whether the object at ``path`` has ``attribute``; for a class, also an instance
    attribute that one of its methods sets or reads (``self._codelibrary = lib``)."""
    try:
        owner = _resolve(path)
    except Exception:
        return False
    if hasattr(owner, attribute):
        return True
    if isinstance(owner, type):
        for klass in owner.__mro__:
            for fn in vars(klass).values():
                code = getattr(fn, "__code__", None)
                if code is not None and attribute in code.co_names:
                    return True
    return False


def missing(rows=PRIVATE) -> list[str]:
    """The rows of ``rows`` whose attribute is missing, each as a sentence that names the
    attribute, the library and its version, and what follows."""
    return [f"{owner} {version(owner) or '(not installed)'} no longer has {path}.{attribute}: "
            f"the fast launcher falls back to the plain launch; update numba_sc/core/fast_launch.py"
            for owner, path, attribute in rows if not has_private(path, attribute)]


# ------------------------------------------------------------------ streams
def current_stream_ptr() -> int:
    """The raw handle of CuPy's current stream (0: the legacy default stream, which is
    also Numba's stream 0). Kernels run there to stay ordered with the CuPy work
    around them: CuPy enqueues on its *current* stream, which the caller may change.
    GPU only (the simulator has no streams); asked at every launch, so CuPy's
    function is looked up once."""
    if not _GET_STREAM:
        import cupy

        _GET_STREAM.append(cupy.cuda.get_current_stream)
    return _GET_STREAM[0]().ptr


_GET_STREAM = remember([])
_NUMBA_STREAMS = remember({})  # raw handle -> Numba's wrapper of it


def numba_stream(ptr):
    """A Numba stream for the raw handle ``ptr`` (wrapped once per stream, as creating
    the wrapper costs host time)."""
    if ptr == 0:
        return 0
    stream = _NUMBA_STREAMS.get(ptr)
    if stream is None:
        from numba import cuda

        stream = _NUMBA_STREAMS[ptr] = cuda.external_stream(ptr)
    return stream


def launch_on_gpu(kernel, grid: int, threads: int, args) -> None:
    """:func:`numba_sc.core.launch.launch` on a GPU: the fast path when the kernel's
    signature is learned, else :func:`first_launch` (which compiles the kernel and
    teaches the fast path its signature). ``launch`` writes these two lines out
    itself, to save a Python call at every launch."""
    ptr = current_stream_ptr()
    if not FAST.launch(kernel, grid, threads, ptr, args):
        first_launch(kernel, grid, threads, ptr, args)


def first_launch(kernel, grid: int, threads: int, ptr: int, args) -> None:
    """The plain launch of ``kernel`` on the stream ``ptr``, through Numba's dispatcher
    (compiling it for these argument types if need be); then the fast path learns
    the kernel's signature, so that later launches skip the dispatcher."""
    # By default Numba *synchronizes the host* with the stream a CuPy argument
    # advertises (``__cuda_array_interface__["stream"]``) before every launch, so
    # the host would wait for the GPU at each kernel. Our kernels run on the very
    # stream the CuPy work is queued on (:func:`current_stream_ptr`), so the order is
    # already guaranteed by the stream itself: that check is switched off around
    # our own launches only.
    previous = numba_cuda_config.CUDA_ARRAY_INTERFACE_SYNC
    numba_cuda_config.CUDA_ARRAY_INTERFACE_SYNC = 0
    try:
        kernel[grid, threads, numba_stream(ptr)](*args)
    finally:
        numba_cuda_config.CUDA_ARRAY_INTERFACE_SYNC = previous
    FAST.learn(kernel, args)


# ------------------------------------------------------------------ contiguity
def c_contiguous_reader(array_type):
    """A function telling whether an array of ``array_type`` (CuPy's ndarray) is
    C-contiguous: CuPy's own flag, read without building a Flags object (host time
    on the hot path), or the public ``flags.c_contiguous`` when a CuPy release has
    no such flag."""
    if has_private("cupy.ndarray", "_c_contiguous") and hasattr(array_type, "_c_contiguous"):
        return attrgetter("_c_contiguous")
    return lambda a: a.flags.c_contiguous


# ------------------------------------------------------------------ the fast launcher
class FastLauncher:
    """Launch an already compiled Numba kernel on CuPy arrays with little host work.

    Why: a Numba launch given CuPy arrays costs about as much host time on the
    GPU machine as one of our kernels takes on the GPU on ~100k points
    (measured: ``docs/performance.md``, "The launch path";
    ``benchmarks/bench_launch.py`` measures it again), because for every call
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
    CuPy arrays and the library's own :class:`numba_sc.core.pieces.Piece` (which
    carries its fields and key, made once). Anything it does not recognise falls
    back to the ordinary dispatcher path.

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

    When: the private attributes it reads (:data:`FAST_PATH`) are checked once, at
    its first use; if one is missing, :attr:`on` is False, :attr:`missing` says
    which, and :meth:`launch` and :meth:`learn` do nothing from then on (the plain
    launch runs every time). The check costs no launch anything: the first call
    puts the chosen methods in place of itself.

    (Tried and dropped: the same driver call through ``cuda.bindings``, and
    through ``ctypes`` with the parameters packed by ``struct.pack_into``. Both
    cost more per call than they saved; the figures are in ``docs/performance.md``,
    "The launch path".)
    """

    def __init__(self):
        # Learned kernels and made-once objects, registered with numba_sc.core.state:
        # after clear_caches() a kernel is learned again at its next plain launch.
        self._compiled = remember({})  # (dispatcher, key) -> (cuda.core kernel, packers, _RawParams, raw packers)
        self._streams = remember({})
        self._configs = remember({})  # (grid, threads) -> LaunchConfig, made once
        self._array_types = remember(set())  # CuPy's ndarray class, once seen
        self._cupy_type = None  # ... and the same class, for launch's one-pass path
        self.raw = True  # the driver path where it applies (see the class docstring)
        self.on = None  # decided at first use: whether every attribute of FAST_PATH is there
        self.missing = []  # ... and if not, which are missing (sentences)
        self.launch, self.learn = self._first_launch, self._first_learn

    def decide(self) -> bool:
        """Check :data:`FAST_PATH` (once) and put the fast or the idle methods in place."""
        self.missing = missing(FAST_PATH)
        self.on = not self.missing
        if self.on:
            self.launch, self.learn = self._launch, self._learn
        else:
            self.launch, self.learn = self._off, self._off
            warnings.warn("; ".join(self.missing), RuntimeWarning, stacklevel=3)
        return self.on

    def _first_launch(self, kernel, grid, threads, stream_ptr, args) -> bool:
        self.decide()
        return self.launch(kernel, grid, threads, stream_ptr, args)

    def _first_learn(self, kernel, args):
        self.decide()
        return self.learn(kernel, args)

    @staticmethod
    def _off(*_args):
        return False  # the fast path is off: the caller launches plainly

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

    def _learn(self, kernel, args):
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
        except Exception:  # something unforeseen in another numba-cuda: stay on the slow path
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

        core = self._streams[ptr] = driver._to_core_stream(numba_stream(ptr))
        return core

    def _launch(self, kernel, grid, threads, stream_ptr, args) -> bool:
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


_CORE_LAUNCH = remember([])


def _core_launch():
    """``cuda.core.launch``, imported on first use (the simulator never needs it)."""
    if not _CORE_LAUNCH:
        from cuda.core import launch as core_launch

        _CORE_LAUNCH.append(core_launch)
    return _CORE_LAUNCH[0]


FAST = FastLauncher()


# ------------------------------------------------------------------ the simulator
def lock_simulator_shared_arrays() -> bool:
    """Make Numba's CUDA simulator hand every thread of a block the same shared array.

    The simulator runs each CUDA thread as a Python thread, and a block's
    ``cuda.shared.array`` is made by whichever thread reaches the line first: it
    looks the line up in a dict and, finding nothing, stores a new array, with no
    lock between the look-up and the store. Two threads that reach the line together
    (likelier with :func:`numba_sc.core.launch.simulator_pace`'s short switches) each
    make an array; the one whose array is overwritten writes where no other thread
    reads, and the others read ``np.empty``'s garbage there (seen once in CI: the scan
    of :func:`numba_sc.core.unique.unique_one_block` indexed with 9212968597772586325).
    This puts the look-up and the store under one lock. It replaces a method of the
    simulator's private ``kernelapi.FakeCUDAShared`` and reproduces its rule for
    telling arrays apart (the calling file and line); if a Numba release moves any
    of :data:`SIMULATOR`, nothing is replaced and this returns False
    (``tests/core/test_fast_launch.py`` fails loudly then). Returns whether the lock
    is in place. Done at import under the simulator, so plain launches
    (``kernel[blocks, threads](...)``) get it too."""
    if missing(SIMULATOR):
        return False
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    original = shared.array
    types, numpy_support = kernelapi.types, kernelapi.numpy_support  # the simulator's own
    if getattr(original, "numba_sc_locked", False):
        return True
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused, or the one dynamic buffer: no look-up
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)  # the kernel's line: one array per call site, as the simulator keys them
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            made = self._allocations.get(key)
            if made is None:
                made = self._allocations[key] = np.empty(shape, dtype)
        return made

    array.numba_sc_locked = True
    shared.array = array
    return True


if simulating():
    lock_simulator_shared_arrays()
