"""Progress bars for long loops, and log lines that do not break them.

A long command (training epochs, an evaluation, the book's notebooks, a benchmark's
loop) should say how far it is and when it will end. :func:`bar` wraps a loop in a
`tqdm <https://tqdm.github.io>`_ bar with an ETA, written to **stderr**, so what a
command prints on stdout (a table, JSON, CSV) is never mixed with it.

A bar is drawn only where someone watches it: by default when stderr is a terminal.
A pipe, a log file, a test's captured stream and a Jupyter kernel get none, so files
and notebooks' outputs stay clean. Two switches override that, the later winning:

* the environment: ``NUMBA_SC_PROGRESS=1`` draws bars on any stderr, ``=0`` none;
* the program: :func:`set_progress` (``True``, ``False``, or ``None`` for the default);
  the ``numba-sc`` command calls it for ``--progress``, ``--no-progress`` and ``-q``.

Library code reports with :mod:`logging` (``logging.getLogger(__name__)``) and never
configures it; a program that shows the log while a bar is drawn sends it through
:class:`BarSafeHandler`, which lifts the bar, writes the line and draws the bar again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from tqdm import tqdm

from .state import remember

ENV = "NUMBA_SC_PROGRESS"
# set_progress's choice, {"on": True or False} (absent: the environment, then the terminal);
# kept with the library's other state, so numba_sc.clear_caches() forgets it too
_FORCED = remember({})


def set_progress(on) -> None:
    """Draw bars always (``True``), never (``False``), or as the default says (``None``)."""
    if on not in (True, False, None):
        raise ValueError(f"on must be True, False or None, got {on!r}")
    if on is None:
        _FORCED.pop("on", None)
    else:
        _FORCED["on"] = on


def progress_enabled(stream=None) -> bool:
    """Whether :func:`bar` draws on ``stream`` (default ``sys.stderr``): :func:`set_progress`'s
    choice, else ``$NUMBA_SC_PROGRESS`` (1 or 0), else whether the stream is a terminal."""
    if "on" in _FORCED:
        return _FORCED["on"]
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"${ENV}={env!r}: give 1 (bars always), 0 (never), or leave it unset (on a terminal)")
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (a closed or unusual stream: no terminal)
        return False


def bar(iterable=None, total=None, desc=None, unit="it", leave=True, disable=False, **kwargs) -> tqdm:
    """``iterable`` wrapped in a progress bar on stderr with an ETA (a tqdm bar; disabled,
    and then a plain loop, where :func:`progress_enabled` says no). ``total``: the number
    of items when ``len(iterable)`` cannot tell it; ``disable``: no bar whatever the
    switches say (e.g. on a rank other than the first of a data-parallel run). Use ``.set_postfix(loss=...)`` to show
    a running value, ``.set_description(...)`` to rename it; as a context manager, or
    iterated to the end, it closes itself."""
    stream = sys.stderr  # (looked up now: a test or a notebook may have replaced it)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream,
                disable=disable or not progress_enabled(stream), dynamic_ncols=True, **kwargs)


@contextlib.contextmanager
def prints_above_bars():
    """While the block runs, what it prints on stdout is written above the bars (through
    ``tqdm.write``) instead of into them; nothing changes where bars are off. For a
    script that prints results as it goes inside a loop with a bar (the benchmarks)."""
    if not progress_enabled():
        yield
        return
    from tqdm.contrib import DummyTqdmFile

    with contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
        yield


class BarSafeHandler(logging.Handler):
    """A logging handler writing to stderr through ``tqdm.write``: a line logged while a
    bar is drawn appears above the bar instead of inside it."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging's own contract: report, never raise
            self.handleError(record)


__all__ = ["BarSafeHandler", "ENV", "bar", "prints_above_bars", "progress_enabled", "set_progress"]
