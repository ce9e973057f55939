"""Exercises of notebook 11 (the paper's evaluation beside our recorded results): reading
a benchmark the way the paper reports it.

* 11.1 a geometric-mean speed-up: the paper averages speed-ups with a geometric mean
  (Section 6.3); here over the whole-network runs ``bench_net.py`` records, against the
  faster of spconv's two algorithms;
* 11.2 the padding overhead of a GEMM grouping (Figure 5's measure: zero rows over real
  rows);
* 11.3 Algorithm 2's choice: the fastest tile among the timings the autotuner records,
  and what it buys over the fixed tile of prior engines.

No GPU and no simulator: each checker feeds the answer inputs of its own (hand-made
cases that catch the usual slips, and the recorded result files when they are there)
and compares with a reference written here.
"""
from __future__ import annotations

import math
import random
import statistics

from . import ExerciseFailed, exercise

SPCONV = ("spconv Native", "spconv MaskImplicitGemm")  # the two peers of every bench_net run


def _close(got, expected, what, rel=1e-9):
    """Raise :class:`ExerciseFailed` unless the number ``got`` equals ``expected`` to ``rel``."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise ExerciseFailed(f"{what}: the answer should be a number, got {got!r}")
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12):
        raise ExerciseFailed(f"{what}: got {got!r}, expected {expected!r}")


def _recorded(name):
    """The result file ``name`` when it is there (a checkout without results checks the
    hand-made cases only)."""
    from .. import results

    try:
        return results.load(name)
    except FileNotFoundError:
        return None


# ------------------------------------------------ 11.1 a geometric-mean speed-up
def _speedup(run):
    t = run["network"]
    return min(t[p]["ms"] for p in SPCONV) / t["numba-sc"]["ms"]


def _arithmetic_mean_speedup(runs):
    """A plausible slip: the arithmetic mean, which a single large speed-up pulls up."""
    return statistics.fmean(_speedup(r) for r in runs)


def _net_run(ours, native, mig, **others):
    network = {"numba-sc": {"ms": ours}, "spconv Native": {"ms": native},
               "spconv MaskImplicitGemm": {"ms": mig}}
    network.update({name: {"ms": ms} for name, ms in others.items()})
    return {"network": network}


@exercise("11.1", "a geometric-mean speed-up", answer="geomean_speedup", wrong=_arithmetic_mean_speedup)
def check_geomean_speedup(geomean_speedup):
    cases = {
        # Native faster in one run, MaskImplicitGemm in the other: the best peer changes.
        "two runs, each peer best once": [_net_run(10.0, 20.0, 30.0), _net_run(10.0, 30.0, 5.0)],
        # A run of spconv's own (larger) network is no peer, even when it is faster.
        "a run with spconv's own outputs": [_net_run(8.0, 16.0, 12.0, **{"(Native, own outputs)": 4.0})],
        # Speed-ups 0.5, 2 and 4: geometric mean 1.587..., arithmetic mean 2.167...
        "three runs, speed-ups far apart": [_net_run(20.0, 10.0, 11.0), _net_run(5.0, 10.0, 12.0),
                                            _net_run(2.5, 10.0, 13.0)],
    }
    net = _recorded("net_scans")
    if net is not None:
        cases["net_scans.json, every run"] = net["runs"]
        for name in sorted({r["net"] for r in net["runs"]}):
            cases[f"net_scans.json, {name}"] = [r for r in net["runs"] if r["net"] == name]
    for what, runs in cases.items():
        expected = math.exp(statistics.fmean(math.log(_speedup(r)) for r in runs))
        _close(geomean_speedup(runs), expected, what)


# -------------------------------------------------- 11.2 the padding of a grouping
def _padding_over_all_rows(counts, groups):
    """A plausible slip: padding rows over all rows (padded), not over the real ones."""
    real = sum(counts[k] for g in groups for k in g)
    total = sum(len(g) * max(counts[k] for k in g) for g in groups)
    return (total - real) / total


def _overhead(counts, groups):
    real = sum(counts[k] for g in groups for k in g)
    padded = sum(len(g) * max(counts[k] for k in g) for g in groups)
    return (padded - real) / real


@exercise("11.2", "the padding of a grouping", answer="padding_overhead", wrong=_padding_over_all_rows)
def check_padding_overhead(padding_overhead):
    from ...gmas.gemm_grouping import make_groups, offset_order, padding_report

    # docs/notation.md's example, and the worked example of gemm_grouping's docstring
    # (counts in map order, groups of the sorted order).
    _close(padding_overhead([4, 5], [(0, 1)]), 1 / 9, "counts [4, 5] in one group")
    _close(padding_overhead([9, 2, 8, 3, 9, 2], [(1, 5), (3,), (2, 0, 4)]), 1 / 33,
           "counts [9, 2, 8, 3, 9, 2], groups [(1, 5), (3,), (2, 0, 4)]")
    _close(padding_overhead([7, 7, 7], [(0,), (1,), (2,)]), 0.0, "one offset a group: no padding")
    # Kernels of 27 offsets (some with no pair, in no group), grouped as the library
    # groups them, in both orders: the answer must be padding_report's overhead.
    rng = random.Random(11)
    for case in range(6):
        counts = [rng.choice([0, rng.randint(1, 40), rng.randint(500, 20000)]) for _ in range(27)]
        for order_name, sort in (("sorted", True), ("map", False)):
            groups = [g.members for g in make_groups(counts, offset_order(counts, sort))]
            expected = padding_report(counts)[order_name]["overhead"]
            assert math.isclose(expected, _overhead(counts, groups))  # the two references agree
            _close(padding_overhead(counts, groups), expected,
                   f"random kernel {case}, {order_name} order: counts {counts}, groups {groups}")


# ------------------------------------------------------ 11.3 Algorithm 2's choice
def _gain_inverted(timings, fixed=4):
    """A plausible slip: the speed-up turned upside down (best over fixed)."""
    best = min(timings, key=lambda t: (timings[t], int(t)))
    return int(best), timings[best] / timings[str(fixed)]


def _best_tile(timings, fixed):
    best = min(timings, key=lambda t: (timings[t], int(t)))  # ties: the smaller tile
    return int(best), timings[str(fixed)] / timings[best]


@exercise("11.3", "Algorithm 2's choice", answer="best_tile", wrong=_gain_inverted)
def check_best_tile(best_tile):
    cases = {
        # Keys are strings in a result file: "16" sorts before "4" as a string.
        "the fastest tile is 16": ({"1": 9e-5, "2": 6e-5, "4": 4e-5, "8": 3.5e-5, "16": 3e-5}, 4),
        "the fixed tile is the fastest": ({"1": 5e-5, "2": 4e-5, "4": 3e-5, "8": 6e-5}, 4),
        "a tie: the smaller tile": ({"1": 5e-5, "2": 3e-5, "4": 3e-5, "8": 4e-5}, 4),
        "another fixed tile": ({"1": 8e-5, "2": 6e-5, "4": 2e-5, "8": 5e-5}, 8),
    }
    conv = _recorded("conv")
    if conv is not None:
        for r in conv["runs"]:
            if r.get("impl") == "numba-sc" and r.get("tiles", {}).get("timings"):
                for stage, timings in r["tiles"]["timings"].items():
                    if "4" in timings:
                        cases[f"conv.json: {r['dataset']} {r['cin']}->{r['cout']} {r['dtype']} {stage}"] = (timings, 4)
    for what, (timings, fixed) in cases.items():
        got = best_tile(dict(timings), fixed)
        best, gain = _best_tile(timings, fixed)
        if not isinstance(got, tuple) or len(got) != 2:
            raise ExerciseFailed(f"{what}: return (tile, speed-up), got {got!r}")
        if got[0] != best or isinstance(got[0], str):
            raise ExerciseFailed(f"{what}: timings {timings}: the fastest tile is the int {best}, got {got[0]!r}")
        _close(got[1], gain, f"{what}: the speed-up of tile {best} over tile {fixed}")
