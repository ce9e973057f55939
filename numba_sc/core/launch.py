"""The launch path: how a Numba kernel is started, and why it is fast on the host.

A kernel is launched the way Numba teaches: ``kernel[blocks, threads](args...)``,
one thread per element with ``blocks = blocks_for(n, threads)``. The lessons, the
exercises and every rung below a stage's top rung do exactly that. The library's
own hot path goes through :func:`launch` instead, so that launch overhead is
tuned in one place: under the simulator it is that plain launch (at a faster
thread pace, :func:`simulator_pace`); on a GPU it is handed to the fast path,
:func:`numba_sc.core.fast_launch.launch_on_gpu`, which after a kernel's first,
ordinary launch writes its parameters straight into the driver's launch call.
``docs/performance.md`` ("The launch path") explains the machinery and what it saves.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from . import fast_launch
from .device import simulating

THREADS = 256  # default threads per block for one-thread-per-element kernels
SIMULATOR_SWITCH_INTERVAL = 5e-4  # seconds; Python's default is 5e-3


def blocks_for(n: int, threads: int = THREADS) -> int:
    """Blocks needed for one thread per element; at least one so a launch is valid."""
    return max(1, (int(n) + threads - 1) // threads)


@contextmanager
def simulator_pace():
    """Under the simulator, a short Python thread switch interval for the launches
    inside (:data:`SIMULATOR_SWITCH_INTERVAL`); on a GPU, nothing.

    The simulator runs each CUDA thread as a Python thread and polls them while
    holding the GIL; a short switch interval makes a block of threads several
    times faster. Nothing else about the run changes. For tools that launch plain
    rungs (``kernel[blocks, threads](...)``) under the simulator."""
    if not simulating():
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def launch(kernel, n: int, *args, threads: int = THREADS, blocks: int | None = None):
    """Launch ``kernel`` with one thread per element of an ``n``-element range.

    The plain launch, ``kernel[blocks, threads](*args)``, with ``blocks`` overriding
    the grid size for kernels that are not one-thread-per-element (e.g. one block
    per query block). Nothing is launched when ``n <= 0``.

    On a GPU, the fast path: :func:`numba_sc.core.fast_launch.launch_on_gpu` makes
    the same launch on CuPy's current stream, and after the first launch of a
    kernel with a given argument signature (which compiles it through Numba's
    dispatcher as usual) skips the dispatcher's per-call work.
    """
    if n <= 0:
        return
    grid = blocks if blocks is not None else blocks_for(n, threads)
    if simulating():
        with simulator_pace():
            kernel[grid, threads](*args)
        return
    # On a GPU, the fast path (fast_launch.launch_on_gpu, written out: a network's
    # forward pass launches hundreds of kernels, and one Python call less is
    # measurable host time at each of them).
    ptr = fast_launch.current_stream_ptr()
    if not fast_launch.FAST.launch(kernel, grid, threads, ptr, args):
        fast_launch.first_launch(kernel, grid, threads, ptr, args)
