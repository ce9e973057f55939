"""Data races, caught by recording who touched what instead of waiting for one to happen.

**What a data race is.** The threads of a launch run at the same time, in no order the
program can count on: thread blocks in any order, and the threads of one block too,
except that a barrier (``cuda.syncthreads()``) puts everything a block's threads did
before it ahead of everything they do after it. Two accesses to one element of memory
*race* when they come from two threads that nothing orders, at least one of them
writes, and at least one of them is a plain load or store rather than an atomic
operation. What the element ends up holding then depends on timing. Exercise 2.2's
classic slip, a voxel's maximum without an atomic::

    if value > out[m, c]:     # threads A and B, two points of voxel m, both read -inf ...
        out[m, c] = value     # ... and both write: the later write wins, the larger value may be lost

On a GPU two points of one voxel do read the same old value now and then: the answer
is right on one run and wrong on the next. ``cuda.atomic.max(out, (m, c), value)``
makes the read, the comparison and the write one indivisible step, and atomic
operations of different threads never race with one another.

**Why a checker cannot just run the kernel and compare.** Numba's simulator runs each
CUDA thread as a Python thread, and Python switches threads every few milliseconds,
long after a thread has done those two lines: the bad interleaving practically never
happens there, and a racy answer would pass. So :func:`record` does not wait for it.
It runs the kernel under the simulator with chosen arguments wrapped
(:class:`Watched`), and notes every load and store of their elements with the thread
that made it, the thread's block, and how many barriers the thread had passed; an
atomic operation is noted as such. Shared arrays are watched too, each block's its
own. :meth:`Record.races` then finds the pairs of accesses that race by the
definition above. *Which* thread touched *what* does not depend on *when*, so the
verdict is the same on every run, and on a GPU machine too: the record is always
the simulator's.

The record answers the checkers' other questions about a kernel as well: which
thread wrote an element (does thread ``t`` answer query ``t``?), how many times it
was written (the scatter writes each output once), and what each thread read, in
order (a branch-free search reads its block the same number of times for every query).

**How the record is taken** (the simulator's internals, :data:`SIMULATOR_INTERNALS`;
``numba_sc.core.fast_launch`` keeps the others the package uses). The simulator hands a kernel its own array objects (``FakeCUDAArray``);
:class:`Watched` is one of them that notes its loads and stores. While a launch is
recorded, three of the simulator's functions are wrapped: its atomic operations
(``kernelapi.FakeCUDAAtomic``, Python functions that load and store under a lock)
mark the thread as inside an atomic, so those loads and stores are noted as one
atomic access; ``FakeCUDAShared.array`` returns watched shared arrays; and
``BlockThread.syncthreads`` counts each thread's barriers.
"""
from __future__ import annotations

import sys
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from numba.cuda.simulator import kernel as sim_kernel, kernelapi
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

from ...core.launch import simulator_pace

__all__ = ["Access", "Race", "Record", "SIMULATOR_INTERNALS", "Watched", "record"]

SIMULATOR_INTERNALS = (
    # (object path, attribute): every part of numba-cuda's simulator used here, none of it
    # public API (tests/tools/test_races.py fails, naming it, when a release moves one).
    ("numba.cuda.simulator.kernel", "FakeCUDAKernel"),  # runs a kernel's Python function, a thread per thread
    ("numba.cuda.simulator.kernel.BlockThread", "syncthreads"),  # one thread's barrier
    ("numba.cuda.simulator.kernelapi.FakeCUDAAtomic", "max"),  # the atomics (every method of the class)
    ("numba.cuda.simulator.kernelapi.FakeCUDAShared", "array"),  # cuda.shared.array
    ("numba.cuda.simulator.kernelapi", "types"),  # the simulator's Numba types ...
    ("numba.cuda.simulator.kernelapi", "numpy_support"),  # ... and their dtypes
    ("numba.cuda.simulator.cudadrv.devicearray", "FakeCUDAArray"),  # the array a kernel is handed
)

LOAD, STORE = "load", "store"  # the plain accesses; an atomic one is "atomic max", "atomic add", ...
SHARED = "shared array"  # the name of a shared array in the record: "shared array (line 12)"


@dataclass(frozen=True)
class Access:
    """One access to one element: the array's name, the element's index, the thread
    (its block and its index in the block, both (x, y, z)), the barriers that thread
    had passed, and the kind: ``"load"``, ``"store"`` or ``"atomic <op>"``."""

    array: str
    element: tuple
    block: tuple
    thread: tuple
    barriers: int
    kind: str

    @property
    def writes(self) -> bool:
        return self.kind != LOAD

    @property
    def atomic(self) -> bool:
        return self.kind.startswith("atomic")


@dataclass(frozen=True)
class Race:
    """Two threads that touched ``array[element]`` in a way that races: what each did
    (their kinds of access, e.g. ``("load", "store")``)."""

    array: str
    element: tuple
    first: tuple  # (block, thread)
    first_did: tuple
    second: tuple
    second_did: tuple


class Watched(FakeCUDAArray):
    """A simulator array that notes every load and store of its elements in a
    :class:`Record`. A view of it (a row, a slice) is watched as its parent: each
    element is noted by its index in the whole array."""

    def __init__(self, ary, name, log, parent=None, index=None):
        super().__init__(ary)
        self._name, self._log = name, log
        # the whole array's shape, and each element's flat position in it
        self._whole = ary.shape if parent is None else parent._whole
        self._index = np.arange(ary.size).reshape(ary.shape) if parent is None else index

    def __getitem__(self, idx):
        value = self._ary[idx]
        if isinstance(value, np.ndarray):  # a view: no access yet, its elements are watched
            return Watched(value, self._name, self._log, self, self._index[idx])
        self._log.note(self, self._index[idx], LOAD)
        return value

    def __setitem__(self, idx, value):
        self._ary[idx] = value
        self._log.note(self, self._index[idx], STORE)


class Record:
    """Every access a recorded launch made to its watched arrays (:func:`record`)."""

    def __init__(self, grid, block, shapes):
        self.grid, self.block = _dims(grid), _dims(block)
        self.shapes = dict(shapes)  # array name -> shape, to name elements by their index
        self._events = []  # (name, flat position, block, thread, barriers, kind), each thread's in its order

    def note(self, array: Watched, where, kind: str):
        """Note an access by the calling simulator thread (host code is not a thread of
        the launch: its accesses are not noted)."""
        me = threading.current_thread()
        if not hasattr(me, "blockIdx"):
            return
        if getattr(me, "atomic", None):  # inside one of the simulator's atomic operations:
            if me.atomic_noted:  # its load and its store are one access
                return
            kind, me.atomic_noted = f"atomic {me.atomic}", True
        block, thread = tuple(me.blockIdx), tuple(me.threadIdx)
        barriers = getattr(me, "barriers", 0)
        self.shapes.setdefault(array._name, array._whole)
        for flat in np.atleast_1d(where).ravel().tolist():
            self._events.append((array._name, flat, block, thread, barriers, kind))

    # -- reading the record ------------------------------------------------------
    def accesses(self, array: str | None = None) -> list:
        """The accesses (:class:`Access`) to ``array`` (every watched array: None), each
        thread's in the order it made them."""
        return [Access(name, self.element(name, flat), b, t, n, kind)
                for name, flat, b, t, n, kind in self._events if array is None or name == array]

    def element(self, array: str, flat: int) -> tuple:
        """The index of ``array``'s element at flat position ``flat``."""
        shape = self.shapes[array]
        return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()

    def thread_id(self, block: tuple, thread: tuple) -> int:
        """The thread's index in the whole launch, x fastest: ``cuda.grid(1)`` of a
        one-dimensional launch."""
        (bdx, bdy, bdz), (gdx, gdy, _) = self.block, self.grid
        in_block = thread[0] + bdx * (thread[1] + bdy * thread[2])
        block_no = block[0] + gdx * (block[1] + gdy * block[2])
        return block_no * bdx * bdy * bdz + in_block

    def who(self, block: tuple, thread: tuple) -> str:
        """A thread as a reader finds it in the kernel: ``thread 41 (block 0, thread 41)``."""
        def dims(v):
            return str(v[0]) if v[1:] == (0, 0) else str(v)
        return f"thread {self.thread_id(block, thread)} (block {dims(block)}, thread {dims(thread)})"

    def writers(self, array: str) -> dict:
        """{element: the global ids (:meth:`thread_id`) of the threads that wrote it, one
        entry per write, sorted}: who owns what, and how often each element was written."""
        found = defaultdict(list)
        for a in self.accesses(array):
            if a.writes:
                found[a.element].append(self.thread_id(a.block, a.thread))
        return {element: sorted(who) for element, who in found.items()}

    def atomics(self, array: str | None = None) -> list:
        """The atomic accesses to ``array`` (to every watched array: None)."""
        return [a for a in self.accesses(array) if a.atomic]

    def races(self) -> list:
        """Every element that two unordered threads touched in a conflicting way, one
        :class:`Race` per element (its first such pair), elements in order."""
        touched = defaultdict(lambda: defaultdict(set))  # element -> (block, thread, barriers) -> kinds
        for name, flat, b, t, n, kind in self._events:
            own_block = b if name.startswith(SHARED) else None  # shared memory: each block its own
            touched[(name, own_block, flat)][(b, t, n)].add(kind)
        found = []
        for (name, _, flat), by in sorted(touched.items(), key=lambda kv: (kv[0][0], kv[0][1] or (), kv[0][2])):
            kinds = set().union(*by.values())
            if kinds == {LOAD} or all(k.startswith("atomic") for k in kinds):
                continue  # only reads, or only atomics: nothing to race
            order = sorted(by, key=lambda w: (self.thread_id(w[0], w[1]), w[2]))
            pair = next(((a, b) for a in order if any(k != LOAD for k in by[a]) for b in order
                         if _unordered(a, b) and _conflict(by[a], by[b])), None)
            if pair:
                a, b = pair
                found.append(Race(name, self.element(name, flat), a[:2], tuple(sorted(by[a])), b[:2],
                                  tuple(sorted(by[b]))))
        return found

    def explain(self, race: Race) -> str:
        """A race in words: the element, the two threads and what each did."""
        def did(kinds):
            plain = " and ".join(verb for kind, verb in ((LOAD, "loaded"), (STORE, "stored")) if kind in kinds)
            words = [f"{plain} it with plain accesses"] if plain else []
            words += [f"updated it with an {k}" for k in kinds if k.startswith("atomic")]
            return ", and ".join(words)
        index = ", ".join(map(str, race.element))
        where = (f"element [{index}] of the {race.array} in block {race.first[0][0]}"
                 if race.array.startswith(SHARED) else f"{race.array}[{index}]")
        return (f"a data race on {where}: {self.who(*race.first)} {did(race.first_did)}, and "
                f"{self.who(*race.second)} {did(race.second_did)}. Nothing orders these two threads (no "
                "barrier between them; none orders threads of different blocks), so on a GPU their accesses "
                "come in a different order from run to run: a load may see the old value or the new one, and "
                "of two stores either may be the last. (The simulator runs threads one after another, which "
                "hides the race; the record of who touched what shows it on every run.)")


def _dims(d) -> tuple:
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def _unordered(a, b) -> bool:
    """Whether nothing orders two (block, thread, barriers): different threads, and not
    two threads of one block on either side of a barrier."""
    if a[:2] == b[:2]:
        return False  # one thread: its own accesses happen in program order
    return a[0] != b[0] or a[2] == b[2]


def _conflict(kinds_a, kinds_b) -> bool:
    """Two threads' accesses to one element conflict when one of them writes and not
    both are atomic."""
    return any((x != LOAD or y != LOAD) and not (x.startswith("atomic") and y.startswith("atomic"))
               for x in kinds_a for y in kinds_b)


# -- the launch --------------------------------------------------------------------
def record(kernel, grid, block, args: dict, watch=()) -> Record:
    """Run ``kernel[grid, block](*args.values())`` under the simulator (on any machine),
    noting every access to the arguments named in ``watch`` and to every shared array.

    ``args`` maps the kernel's parameter names to its arguments, in order; the watched
    ones must be NumPy arrays, which the kernel writes in place (the others are passed
    as a launch passes them). Returns the :class:`Record`."""
    fn = getattr(kernel, "py_func", None)
    if fn is None or not callable(fn):
        raise TypeError(f"{kernel!r} is not a @cuda.jit kernel: decorate the function with @cuda.jit "
                        "and launch it as kernel[blocks, threads](...)")
    missing = set(watch) - set(args)
    if missing:
        raise ValueError(f"watch names {sorted(missing)}, which are not among the arguments {list(args)}")
    log = Record(grid, block, {name: np.shape(args[name]) for name in watch})
    values = [Watched(np.asarray(v), name, log) if name in watch else v for name, v in args.items()]
    with _recording(log), simulator_pace():
        sim_kernel.FakeCUDAKernel(fn, device=False)[grid, block](*values)
    return log


@contextmanager
def _recording(log: Record):
    """While inside: the simulator's atomics mark their thread, its shared arrays are
    watched, and each thread counts the barriers it passed."""
    atomic_ops = {name: op for name, op in vars(kernelapi.FakeCUDAAtomic).items()
                  if callable(op) and not name.startswith("_")}
    shared_array = kernelapi.FakeCUDAShared.array
    syncthreads = sim_kernel.BlockThread.syncthreads

    def marked(name, op):
        def atomic(self, array, *args):
            me = threading.current_thread()
            me.atomic, me.atomic_noted = name.rstrip("_"), False  # and_ -> and
            try:
                return op(self, array, *args)
            finally:
                me.atomic = None
        return atomic

    def watched_shared(self, shape, dtype, alignment=None):
        if shape == 0:  # dynamic shared memory: not watched
            return shared_array(self, shape, dtype, alignment)
        # The simulator keeps one array per line that makes one; so do we. Every thread of
        # the block asks for it: setdefault (one step under the GIL) hands them all the same.
        caller = sys._getframe(1)
        arrays = self.__dict__.setdefault("watched", {})
        key = (caller.f_code.co_filename, caller.f_lineno)
        if key not in arrays:
            if isinstance(dtype, kernelapi.types.Type):  # a Numba type (int64), as kernels name them
                dtype = kernelapi.numpy_support.as_dtype(dtype)
            arrays.setdefault(key, Watched(np.empty(shape, dtype), f"{SHARED} (line {caller.f_lineno})", log))
        return arrays[key]

    def counted(self):
        syncthreads(self)
        self.barriers = getattr(self, "barriers", 0) + 1

    try:
        for name, op in atomic_ops.items():
            setattr(kernelapi.FakeCUDAAtomic, name, marked(name, op))
        kernelapi.FakeCUDAShared.array = watched_shared
        sim_kernel.BlockThread.syncthreads = counted
        yield
    finally:
        for name, op in atomic_ops.items():
            setattr(kernelapi.FakeCUDAAtomic, name, op)
        kernelapi.FakeCUDAShared.array = shared_array
        sim_kernel.BlockThread.syncthreads = syncthreads
