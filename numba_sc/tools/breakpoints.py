"""Stop in pdb inside a simulated kernel, at one block and thread, without editing its source.

``numba-sc ladder gather --rung v2 --break 1,3`` lands here. Under Numba's CUDA
simulator every CUDA thread of a launch is a Python thread
(``numba.cuda.simulator.kernel``: one ``BlockThread`` per thread of the block
that runs, whose ``blockIdx`` and ``threadIdx`` are what ``cuda.blockIdx`` and
``cuda.threadIdx`` read), each calling the kernel's Python function. pdb, started
in the main thread, traces the main thread only: a breakpoint set there on a line
of the kernel is never reached (``docs/debugging.md``, section 3).

What reaches a simulated thread is :func:`threading.settrace`: a trace function
that every thread started afterwards installs before it runs. :func:`stop_in`
installs one for the duration of a ``with`` block. In each simulated thread it
watches the calls until the kernel's own frame is entered (the frame that the
simulator's per-thread ``target`` calls), then:

* in the thread whose block and thread match, and in the kernel asked for, it
  starts pdb *on that frame* (``pdb.Pdb().set_trace(frame)``), so the first line
  of the kernel is where the reader lands, with ``cuda.blockIdx``, the kernel's
  arguments and its shared arrays in reach;
* in every other thread it switches tracing off (``sys.settrace(None)``), so the
  rest of the launch runs at the simulator's usual pace.

It stops once: after ``c`` (continue) the launch and the rest of the program run
on. Which kernel: the one named (its code object, or those of the kernel a
kernel factory compiles), or, given none, the first kernel launched inside the
block (a rung that is a host function launching several kernels stops in the
first). Blocks and threads are 1-D (every numba-sc kernel launches a 1-D grid):
``block`` is ``blockIdx.x``, ``thread`` is ``threadIdx.x``.
"""
from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..core.device import simulating
from .lesson import python_function

__all__ = ["Stop", "kernel_codes", "parse_break", "stop_in"]


def parse_break(text: str) -> tuple:
    """``"B,T"`` (two non-negative integers: block and thread) as ``(B, T)``; a clear
    error for anything else, 3-D indices included."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--break takes BLOCK,THREAD, two non-negative integers such as 1,3 (blockIdx.x and "
                         f"threadIdx.x: every numba-sc kernel launches a 1-D grid), got {text!r}")
    return int(parts[0]), int(parts[1])


def _is_kernel(obj) -> bool:
    """A ``@cuda.jit`` kernel: the simulator's stand-in or numba's dispatcher (both
    carry the Python function as ``py_func``)."""
    return callable(getattr(obj, "py_func", None))


def _jitted_names(fn) -> set:
    """The names of the functions that ``fn``'s source defines under a ``...jit``
    decorator (a kernel factory's kernel)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)}


def _nested_codes(code):
    for const in code.co_consts:
        if inspect.iscode(const):
            yield const
            yield from _nested_codes(const)


def kernel_codes(obj) -> frozenset:
    """The code objects of the kernels that ``obj`` is or compiles: a kernel's own
    function; for a kernel factory (a function that defines a ``@cuda.jit`` kernel
    inside and returns it, ``gather_v3(tile, tiles)``) the inner kernel's code, which
    every kernel the factory compiles shares. Empty for a host function that only
    launches kernels defined elsewhere (``backward_search_v1``)."""
    if _is_kernel(obj):
        return frozenset({python_function(obj).__code__})
    fn = python_function(obj)
    code = getattr(fn, "__code__", None)
    if code is None:
        return frozenset()
    names = _jitted_names(fn)
    return frozenset(c for c in _nested_codes(code) if c.co_name in names)


def _simulator_target_file() -> str:
    """The simulator's kernel module, whose per-thread ``target`` calls the kernel."""
    from numba.cuda.simulator import kernel

    return os.path.normcase(os.path.abspath(kernel.__file__))


@dataclass
class Stop:
    """What :func:`stop_in` saw: whether it stopped (``hit``), in which kernel
    (``kernel``: its name; ``file``, ``line``: where pdb landed), and every launch of a
    watched kernel (``launches``: ``(kernel name, blocks, threads per block)``, in order,
    each once)."""

    block: int
    thread: int
    hit: bool = False
    kernel: str | None = None
    file: str | None = None
    line: int | None = None
    launches: list = field(default_factory=list)

    def missed(self) -> str:
        """The sentence telling the reader that nothing stopped, and why."""
        if not self.launches:
            return (f"block {self.block} thread {self.thread}: the kernel asked for was never launched "
                    "(nothing to stop in)")
        names = sorted({name for name, _, _ in self.launches})
        grids = "; ".join(f"{b} blocks of {t} threads" for _, b, t in dict.fromkeys(self.launches))
        return (f"block {self.block} thread {self.thread} never ran {' or '.join(names)}; the launch was "
                f"{grids}")


@contextmanager
def stop_in(block: int, thread: int, codes=frozenset(), announce=print, debugger=None):
    """Inside the ``with``, the first simulated thread of block ``block``, thread
    ``thread`` to enter a kernel whose code is in ``codes`` (:func:`kernel_codes`; empty:
    the first kernel launched inside the ``with``) stops in pdb on the kernel's first
    line. Yields a :class:`Stop` that says afterwards whether it stopped.

    ``announce(text)`` says where it stopped, before pdb's prompt. ``debugger()``
    makes the debugger (default ``pdb.Pdb(nosigint=True)``: SIGINT handlers belong to
    the main thread); anything with ``set_trace(frame)`` and ``trace_dispatch`` will do
    (the tests record the frame instead of stopping)."""
    if not simulating():
        raise RuntimeError("--break needs Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): on a GPU a kernel's "
                           "threads are not Python threads that pdb can stop in")
    import pdb

    from numba.cuda.simulator.kernel import BlockThread

    make = debugger or (lambda: pdb.Pdb(nosigint=True))
    stop = Stop(block, thread)
    watched = set(codes)  # filled by the first launch when no kernel is named
    target_file = _simulator_target_file()
    lock = threading.Lock()  # the simulated threads of a block start together

    def kernel_frame(frame) -> bool:
        """Whether ``frame`` is a kernel's own frame: the one the simulator's per-thread
        ``target`` calls (a device function's caller is the kernel)."""
        up = frame.f_back
        return (up is not None and up.f_code.co_name == "target"
                and os.path.normcase(os.path.abspath(up.f_code.co_filename)) == target_file)

    def trace(frame, event, arg):
        if event != "call" or not kernel_frame(frame):
            return None  # keep watching this thread's calls, no line events
        me = threading.current_thread()
        with lock:
            if not watched:  # no kernel named: the first one launched is the one
                watched.add(frame.f_code)
            mine = frame.f_code in watched
            if mine:
                fake = frame.f_globals.get("cuda")  # the simulator's cuda module, swapped in for the launch
                launch = (frame.f_code.co_name, fake.gridDim.x, fake.blockDim.x) if fake is not None else None
                if launch and launch not in stop.launches:
                    stop.launches.append(launch)
            here = (mine and not stop.hit and isinstance(me, BlockThread)
                    and tuple(me.blockIdx) == (block, 0, 0) and tuple(me.threadIdx) == (thread, 0, 0))
            if here:
                stop.hit = True
        if not here:
            sys.settrace(None)  # this thread runs on untraced
            return None
        stop.kernel, stop.file, stop.line = frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno
        announce(f"stopped in {stop.kernel} at block {block}, thread {thread} ({stop.file}); "
                 "pdb commands: p cuda.threadIdx.x, n, s, l, c (continue: the rest runs on)")
        dbg = make()
        dbg.set_trace(frame)  # pdb takes over this thread's tracing, from this frame on
        return dbg.trace_dispatch

    previous = threading.gettrace()
    threading.settrace(trace)
    try:
        yield stop
    finally:
        threading.settrace(previous)
