"""Everything the library remembers between calls, in one object that can be reset.

A call of the engine can leave things behind that change or speed up a later
call: compiled kernel variants (one per tile size, dtype, word type), layouts
of small device allocations, measured choices (which dataflow, which Map
method, which tile size a layer should use) and switches read from the
environment (``NUMBA_SC_TENSOR_CORES``). All of them hang off :data:`STATE`:

* ``STATE.choices`` holds the measured decisions, one dict per kind
  (``"dataflow"``, ``"map_method"``, ``"tile"``): what ``numba_sc.choose_dataflow``,
  ``numba_sc.choose_map_method`` and ``numba_sc.autotune`` found, read back by
  ``dataflow="auto"``, ``method="auto"`` and ``tile_size=None``;
* ``STATE.switches`` holds the switches, read from the environment once (and
  again after a reset);
* every other cache is registered with :func:`cached` (a function memo, like
  :func:`functools.lru_cache`) or :func:`remember` (a module's dict or list).

:func:`clear_caches` (also ``numba_sc.clear_caches``) empties all of them: after
it a process answers every ``"auto"`` as a fresh one would, and kernels are
compiled again on their next use. Nothing here changes a result except the
measured choices and the switches; the rest only saves time.

Worked example::

    >>> import numba_sc as ns
    >>> ns.choose_dataflow(x, w)          # measures; "auto" now follows the measurement
    >>> ns.clear_caches()                 # forgets it: "auto" is the rule of thumb again
"""
from __future__ import annotations

import functools
import os
from typing import Callable

SWITCHES = {
    # name: (environment variable, default) - read by :meth:`State.switch`
    "tensor_cores": ("NUMBA_SC_TENSOR_CORES", "1"),
}


class State:
    """The library's memory: measured choices, switches and registered caches."""

    def __init__(self):
        self.choices: dict = {"dataflow": {}, "map_method": {}, "tile": {}}
        self.switches: dict = {}
        self.caches: list = []  # functions with cache_clear(), dicts and lists with clear()

    def switch(self, name: str) -> bool:
        """Whether switch ``name`` is on: its environment variable, read once
        (``"0"`` turns it off; anything else, or unset, leaves the default)."""
        hit = self.switches.get(name)
        if hit is None:
            var, default = SWITCHES[name]
            hit = self.switches[name] = os.environ.get(var, default) != "0"
        return hit

    def register(self, cache):
        """Keep ``cache`` (a memoized function, or a dict or list used as a cache)
        so that :meth:`clear` empties it; returns it."""
        if not (hasattr(cache, "cache_clear") or hasattr(cache, "clear")):
            raise TypeError(f"cannot clear a {type(cache).__name__}: give a memoized function, a dict or a list")
        self.caches.append(cache)
        return cache

    def clear(self):
        """Forget everything: measured choices, switches, every registered cache."""
        for kind in self.choices.values():
            kind.clear()
        self.switches.clear()
        for c in self.caches:
            (c.cache_clear if hasattr(c, "cache_clear") else c.clear)()


STATE = State()


def cached(fn: Callable | None = None, *, maxsize: int | None = None):
    """:func:`functools.lru_cache`, registered with :data:`STATE` (``@cached`` or
    ``@cached(maxsize=64)``)."""
    if fn is None:
        return lambda f: cached(f, maxsize=maxsize)
    return STATE.register(functools.lru_cache(maxsize=maxsize)(fn))


def remember(cache):
    """Register a module-level dict or list that caches something; returns it
    (``_LAYOUTS = remember({})``)."""
    return STATE.register(cache)


def clear_caches():
    """Reset the library to a fresh process's state: every measured choice,
    switch and cache (see the module docstring)."""
    STATE.clear()
