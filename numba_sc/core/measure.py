"""How the library times candidates when asked to choose (a dataflow, a Map method):
wall clock between device-wide synchronizes, interleaved rounds, the median.

Kept apart from what is chosen so that every stage that measures (the Map step's
methods, the layer's dataflows) times the same way, and from the record of what
was chosen (:data:`numba_sc.core.state.STATE`'s ``choices``).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Choice:
    """A decision and where it came from."""

    value: str
    source: str  # "measured" | "rule"
    timings: dict = field(default_factory=dict)  # candidate -> median seconds (measured only)


def size_class(n: int) -> int:
    """Clouds whose sizes round to the same power of two share a choice."""
    return int(round(math.log2(max(int(n), 1))))


def wall_timer(fn) -> float:
    """Seconds of one call of ``fn`` as a user meets it: wall clock between two
    device-wide synchronizes (so the host's launches and every stream count)."""
    import cupy

    dev = cupy.cuda.Device()
    dev.synchronize()
    t = time.perf_counter()
    fn()
    dev.synchronize()
    return time.perf_counter() - t


def measure(candidates: dict, timer, rounds: int = 5, block: int = 3) -> dict:
    """Median seconds of each candidate ``name -> fn``: ``rounds`` interleaved rounds,
    each a block of calls whose first is not kept (cold host caches), so that a
    slow moment of a shared GPU costs every candidate alike."""
    times = {name: [] for name in candidates}
    for fn in candidates.values():  # compile and warm every candidate first
        fn()
    for r in range(rounds):
        names = list(candidates) if r % 2 == 0 else list(candidates)[::-1]
        for name in names:
            candidates[name]()
            times[name].extend(timer(candidates[name]) for _ in range(block))
    return {name: statistics.median(t) for name, t in times.items()}
