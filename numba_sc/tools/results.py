"""One source for every number: the recorded results, and the vocabulary that quotes them.

Every performance figure this project states comes from a result file in
``benchmarks/results/`` (the latest run of each benchmark under a stable name, older
runs still cited in ``archive/``; ``paper.json`` holds the figures the Minuet paper
reports, with their section). Notebooks compute what they show from those files with
:func:`load`, and say where the numbers come from with :func:`provenance`. Prose quotes
a figure as a *figure link* whose title is a Python expression over one file, written
in the small vocabulary below (:data:`VOCABULARY`; :func:`evaluate` gives its numbers)::

    MinkUNet42 runs at [0.89x](benchmarks/results/net_scans.json "ratio(run(r, net='minkunet42', cloud='kitti', dtype='float16'))")
    of spconv's time.

:mod:`numba_sc.tools.prose` checks every such link (``numba-sc figures``);
:mod:`numba_sc.tools.tables` makes whole tables from the files.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

__all__ = ["ROOT", "VOCABULARY", "evaluate", "load", "provenance", "results_folder"]

ROOT = Path(__file__).resolve().parents[2]


def results_folder() -> Path:
    """The folder of the result files: ``$NUMBA_SC_RESULTS``, else the checkout's
    ``benchmarks/results/`` (read at each call, so that a changed environment is seen)."""
    return Path(os.environ.get("NUMBA_SC_RESULTS") or ROOT / "benchmarks" / "results")


def load(name: str, results_dir=None) -> dict:
    """The result file ``name`` (``"net_scans"``, ``"archive/map_h100_2026-11-22"``; the
    ``.json`` may be left out), parsed."""
    folder = Path(results_dir) if results_dir is not None else results_folder()
    path = folder / (name if name.endswith(".json") else name + ".json")
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.json"))
        raise FileNotFoundError(f"no result file {path}; the recorded results are {known}")
    with open(path) as f:
        return json.load(f)


def provenance(record: dict) -> str:
    """One line saying where a result file's numbers come from: device, date, command,
    code (the ``recorded`` block every benchmark writes; older files spell it differently)."""
    rec = record.get("recorded", record.get("meta", {}))
    if rec and "device" not in rec and all(isinstance(v, dict) for v in rec.values()):
        # A file merged from several runs (bench_alternatives.py): each part's record.
        return "; ".join(f"{part}: {provenance({'recorded': r})}" for part, r in rec.items())
    device = rec.get("device") or record.get("device") or record.get("gpu") or "?"
    date = rec.get("date") or str(rec.get("time", "?"))[:10]
    parts = [str(device), str(date)]
    if rec.get("command"):
        parts.append(str(rec["command"]))
    code = rec.get("commit") or rec.get("code")
    if code:
        parts.append(f"code {code}")
    return ", ".join(parts)


# -- the vocabulary of figure expressions ------------------------------------------------

def rows(seq, **where):
    """The items of ``seq`` (a list of dicts) whose fields equal ``where``'s values."""
    out = [x for x in seq if all(x.get(k) == v for k, v in where.items())]
    if not out:
        raise LookupError(f"no row with {where}")
    return out


def row(seq, **where):
    """The one item of ``seq`` whose fields equal ``where``'s values."""
    out = rows(seq, **where)
    if len(out) > 1:
        raise LookupError(f"{len(out)} rows with {where}; name more fields")
    return out[0]


def run(record, **where):
    """The one run of a ``bench_net``/``bench_train`` record (its ``runs`` list) matching ``where``."""
    return row(record["runs"], **where)


SPCONV = ("spconv Native", "spconv MaskImplicitGemm")


def ratio(network_run, ours="numba-sc", peers=SPCONV):
    """Our time over the best peer's in one ``bench_net`` run (its ``network`` block), or
    in any block of ``{contender: {"ms": ...}}`` (a ``bench_train`` run's ``step``):
    below 1 we are faster."""
    times = network_run["network"] if "network" in network_run else network_run
    return times[ours]["ms"] / min(times[p]["ms"] for p in peers)


def times(block, key="host_ms"):
    """{contender: time} of a block recorded as ``{"times": {"<row> / <contender>": {"host_ms":
    ..., "gpu_ms": ...}}}`` (``bench_alternatives``, ``ab_compare``); ``key`` picks wall
    clock (``host_ms``, between device-wide synchronizes) or CUDA-event time (``gpu_ms``)."""
    block = block.get("times", block)
    return {name.rpartition(" / ")[2]: t[key] for name, t in block.items()}


def versus(block, ours, key="host_ms"):
    """``ours``' time over the fastest spconv contender's in one such block."""
    t = times(block, key)
    return t[ours] / min(v for name, v in t.items() if name.startswith("spconv"))


def span(values):
    """(smallest, largest) of ``values``: the two numbers of a range such as ``0.78-0.81x``."""
    values = list(values)
    return (min(values), max(values))


VOCABULARY = {"rows": rows, "row": row, "run": run, "ratio": ratio, "span": span, "times": times, "versus": versus, "min": min, "max": max,
              "median": statistics.median, "mean": statistics.fmean, "len": len, "sum": sum, "abs": abs,
              "round": round, "sorted": sorted, "range": range, "SPCONV": SPCONV}


def evaluate(expression: str, record: dict):
    """The numbers ``expression`` gives on ``record`` (bound to ``r``), as a tuple."""
    # One namespace as the globals, so that comprehensions in the expression see ``r``.
    value = eval(expression, dict(VOCABULARY, r=record, __builtins__={}))  # noqa: S307 (our own docs)
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{expression!r} gave {value!r}: a figure must be finite numbers")
    return values
