"""What a lesson shows of a ladder: a rung's code, what the next rung changed, what it bought.

The notebooks climb each stage's ladder (:mod:`numba_sc.core.rungs`) in reading
order: the idea on a toy, ``v1`` printed and run, then each rung as a *diff* against
the one below, with the GPU time it bought as recorded by ``numba-sc ladder --out``
(``benchmarks/results/ladder_all_kitti.json``, read through
:mod:`numba_sc.tools.results`). These three helpers are all a notebook needs for that::

    from numba_sc.tools import lesson
    lesson.show("gather", "v1")          # the plain kernel, highlighted
    lesson.diff("gather", "v1", "v2")    # what v2 changed, as a unified diff
    lesson.bought("gather")              # each rung's recorded GPU time and speed-up

``stage`` is a ladder's name, as ``numba-sc ladder --list`` prints it: every ladder
the tool finds, a module's further ones included (``lesson.show("batch_norm_backward",
"v2")``). A rung's code is the object the ladder convention names
``<operation>_<rung>`` in the module that declares the ladder, the operation being
the ladder's name unless its declaration names another (``gather_v1``;
``batch_norm_v1`` for ``pointwise``, whose ``LADDER`` climbs that operation;
:mod:`numba_sc.core.rungs`). Kernels are shown as written in Python: the function
that ``@cuda.jit`` compiled.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import re
import textwrap

from . import results

__all__ = ["bought", "code", "diff", "diff_text", "python_function", "rung_object", "show"]


def _ladder(stage: str):
    """``(the module that declares stage's ladder, the Ladder)``."""
    from .ladder import ladder_modules, ladders

    found = ladders()
    if stage not in found:
        raise ValueError(f"stage must be one of {list(found)} (numba-sc ladder --list), got {stage!r}")
    return importlib.import_module(ladder_modules()[stage]), found[stage]


def _rung_name(ladder, rung: str) -> str:
    """The name of the object behind ``rung``: ``<operation>_vN`` for a rung, else ``rung`` as given."""
    return f"{ladder.operation}_{rung}" if re.fullmatch(r"v\d+", rung) else rung


def python_function(obj):
    """The Python function behind a kernel (a numba dispatcher, or the simulator's
    stand-in) or a cached kernel factory (``functools.lru_cache``'s wrapper)."""
    for attr in ("py_func", "fn", "__wrapped__"):
        inner = getattr(obj, attr, None)
        if callable(inner):
            return python_function(inner)
    return obj


def rung_object(stage: str, rung: str):
    """``(its name, the object)``: what ``stage``'s rung ``rung`` names (``"v2"``:
    ``gather_v2``, the kernel, kernel factory or host function), or any kernel or
    function of the stage's module by its name (``"atomic_reduce_v1"``)."""
    module, ladder = _ladder(stage)
    name = _rung_name(ladder, rung)
    if not hasattr(module, name):
        have = sorted(n for n in vars(module) if re.fullmatch(r"[a-z_]+_v\d+", n))
        raise ValueError(f"{module.__name__} has no {name}; its rung objects are {have}")
    return name, getattr(module, name)


def code(stage: str, rung: str) -> str:
    """The source of ``stage``'s rung ``rung`` (``code("gather", "v1")``), or of any kernel
    or function of the stage's module by its name (``code("voxelization",
    "atomic_reduce_v1")``: a kernel that one step of a rung launches)."""
    return textwrap.dedent(inspect.getsource(python_function(rung_object(stage, rung)[1])))


def _display(text: str, language: str):
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Code(text, language=language))


def show(stage: str, rung: str) -> None:
    """Print ``stage``'s rung ``rung``, or the kernel of that name (highlighted in a notebook)."""
    _display(code(stage, rung), "python")


def diff(stage: str, lower: str, upper: str, context: int = 2) -> str:
    """What rung ``upper`` changed against rung ``lower``, as a unified diff (printed,
    and returned). Only the lines that differ are shown, with ``context`` lines around.
    Either may name a kernel instead (``diff("voxelization", "atomic_reduce_v1", "v2")``:
    where v1 is a host function launching two kernels, the kernel that v2 replaces)."""
    text = diff_text(stage, lower, upper, context)
    _display(text, "diff")
    return text


def diff_text(stage: str, lower: str, upper: str, context: int = 2) -> str:
    """:func:`diff`'s unified diff, returned without being shown."""
    a, b = code(stage, lower).splitlines(), code(stage, upper).splitlines()
    _, ladder = _ladder(stage)
    lines = difflib.unified_diff(a, b, _rung_name(ladder, lower), _rung_name(ladder, upper), n=context,
                                 lineterm="")
    return "\n".join(lines)


def bought(stage: str, record: str = "ladder_all_kitti", print_=print) -> list:
    """Each rung of ``stage`` as recorded on a GPU by ``numba-sc ladder --out``: what it
    adds, its time per dtype, and its speed-up over the rung below and over v1. Prints a
    table with the record's provenance; returns the rows."""
    from .ladder import CHANNEL_FREE, RECORDED_NAMES

    rec = results.load(record)
    rows = [r for r in rec["rows"] if RECORDED_NAMES.get(r["stage"], r["stage"]) == stage]
    if not rows:
        raise ValueError(f"{record}.json records no rung of {stage!r}")
    channels = "" if stage in CHANNEL_FREE else f", {rec['channels']} channels"
    print_(f"{stage}: {rec['points']:,} voxels{channels} ({results.provenance(rec)})")
    print_(f"{'rung':5} {'dtype':8} {'GPU us':>9} {'vs below':>9} {'vs v1':>7}  adds")
    for r in rows:
        print_(f"{r['rung']:5} {r['dtype']:8} {r['gpu_us']:9.1f} {r['step']:8.2f}x {r['vs_v1']:6.2f}x  {r['adds']}")
    return rows
