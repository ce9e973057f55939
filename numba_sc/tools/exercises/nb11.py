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
and compares with a reference written here. Each hand-made case is named by what it
tests, and when a wrong number is what a known slip gives (the ratio upside down, the
arithmetic mean, the slower peer, ...), the failure says so: the case that fails is
not always the cause.
"""
from __future__ import annotations

import math
import random
import statistics

from . import ExerciseFailed, Slip, exercise

SPCONV = ("spconv Native", "spconv MaskImplicitGemm")  # the two peers of every bench_net run


def _close(got, expected, what, rule, slips=(), rel=1e-9):
    """Raise :class:`ExerciseFailed` unless the number ``got`` equals ``expected`` to ``rel``.
    ``slips``: ``(what the slip is, the number it gives)``; a wrong ``got`` equal to one of
    them is named as that slip."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise ExerciseFailed(f"{what}: the answer is {got!r}, expected a number", rule)
    if not math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12):
        named = [slip for slip, value in slips if math.isclose(got, value, rel_tol=rel, abs_tol=1e-12)]
        why = f"; {got:.6g} is what {named[0]} gives" if named else ""
        raise ExerciseFailed(f"{what}: got {got:.6g}, expected {expected:.6g}{why}", rule)


def _recorded(name):
    """The result file ``name`` when it is there (a checkout without results checks the
    hand-made cases only)."""
    from .. import results

    try:
        return results.load(name)
    except FileNotFoundError:
        return None


# ------------------------------------------------ 11.1 a geometric-mean speed-up
GEOMEAN_RULE = ("a run's speed-up is the faster peer's time over ours (their time / ours: above 1, ours is "
                "faster), the peers being spconv Native and spconv MaskImplicitGemm only (other entries of "
                "network, such as spconv's own networks, are not peers); the runs' speed-ups are averaged with "
                "a geometric mean, exp(mean(log s)), so that 2 and 0.5 average to 1")


def _speedup(run, pick=min, every_entry=False):
    """A run's speed-up over its faster peer; ``pick=max``: over the slower one;
    ``every_entry``: every other entry of ``network`` taken for a peer."""
    t = run["network"]
    peers = [p for p in t if p != "numba-sc"] if every_entry else SPCONV
    return pick(t[p]["ms"] for p in peers) / t["numba-sc"]["ms"]


def _geomean(values):
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _arithmetic_mean_speedup(runs):
    """A plausible slip: the arithmetic mean, which a single large speed-up pulls up."""
    return statistics.fmean(_speedup(r) for r in runs)


def _ours_over_theirs(runs):
    """A plausible slip: the ratio upside down, ours over the peer's (the README's ratio)."""
    return _geomean(1 / _speedup(r) for r in runs)


def _slower_peer(runs):
    """A plausible slip: the slower of the two peers, which flatters ours."""
    return _geomean(_speedup(r, pick=max) for r in runs)


def _every_entry_a_peer(runs):
    """A plausible slip: every other entry of ``network`` taken for a peer."""
    return _geomean(_speedup(r, every_entry=True) for r in runs)


def _net_run(ours, native, mig, **others):
    network = {"numba-sc": {"ms": ours}, "spconv Native": {"ms": native},
               "spconv MaskImplicitGemm": {"ms": mig}}
    network.update({name: {"ms": ms} for name, ms in others.items()})
    return {"network": network}


@exercise("11.1", "a geometric-mean speed-up", answer="geomean_speedup",
          wrong=[Slip(_arithmetic_mean_speedup, says="the arithmetic mean gives"),
                 Slip(_ours_over_theirs, says="their time / ours"),
                 Slip(_slower_peer, says="the slower peer"),
                 Slip(_every_entry_a_peer, says="are not peers")])
def check_geomean_speedup(geomean_speedup):
    """``geomean_speedup(runs)`` on hand-made runs, each case named by what it tests, then
    on ``net_scans.json``; a wrong number that a known slip gives is named as that slip."""
    cases = {
        # One run, Native the faster peer: the ratio's direction and the peer, nothing else.
        "one run, ours twice as fast as the faster peer": [_net_run(10.0, 20.0, 30.0)],
        # Native faster in one run, MaskImplicitGemm in the other: the best peer changes.
        "two runs, a different peer faster in each": [_net_run(10.0, 20.0, 30.0), _net_run(10.0, 30.0, 5.0)],
        # A run of spconv's own (larger) network is no peer, even when it is faster.
        "a run with spconv's own network beside the peers": [_net_run(8.0, 16.0, 12.0,
                                                                      **{"(Native, own outputs)": 4.0})],
        # Speed-ups 0.5, 2 and 4: geometric mean 1.587..., arithmetic mean 2.167...
        "three runs, speed-ups 0.5, 2 and 4": [_net_run(20.0, 10.0, 11.0), _net_run(5.0, 10.0, 12.0),
                                               _net_run(2.5, 10.0, 13.0)],
    }
    net = _recorded("net_scans")
    if net is not None:
        cases["net_scans.json, every run"] = net["runs"]
        for name in sorted({r["net"] for r in net["runs"]}):
            cases[f"net_scans.json, {name}"] = [r for r in net["runs"] if r["net"] == name]
    for what, runs in cases.items():
        slips = [("the arithmetic mean", _arithmetic_mean_speedup(runs)),
                 ("ours over theirs (the ratio upside down)", _ours_over_theirs(runs)),
                 ("the slower peer", _slower_peer(runs)),
                 ("counting every entry of network as a peer", _every_entry_a_peer(runs))]
        _close(geomean_speedup(runs), _geomean(_speedup(r) for r in runs), what, GEOMEAN_RULE, slips)


# -------------------------------------------------- 11.2 the padding of a grouping
PADDING_RULE = ("the padding overhead is the groups' padding rows over their real rows, both totalled over "
                "every offset in the groups (not an average of each group's ratio, not over the padded "
                "rows): each member of a group is padded to its tallest member's count")


def _padding_over_all_rows(counts, groups):
    """A plausible slip: padding rows over all rows (padded), not over the real ones."""
    real = sum(counts[k] for g in groups for k in g)
    total = sum(len(g) * max(counts[k] for k in g) for g in groups)
    return (total - real) / total


def _mean_of_group_overheads(counts, groups):
    """A plausible slip: the mean of each group's overhead, so a small group weighs as much
    as a large one."""
    return statistics.fmean(_overhead(counts, [g]) for g in groups)


def _overhead(counts, groups):
    real = sum(counts[k] for g in groups for k in g)
    padded = sum(len(g) * max(counts[k] for k in g) for g in groups)
    return (padded - real) / real


@exercise("11.2", "the padding of a grouping", answer="padding_overhead",
          wrong=[Slip(_padding_over_all_rows, says="over the padded rows"),
                 Slip(_mean_of_group_overheads, says="an average of each group's ratio")])
def check_padding_overhead(padding_overhead):
    from ...gmas.gemm_grouping import make_groups, offset_order, padding_report

    def close(counts, groups, expected, what):
        slips = [("the padding over the padded rows", _padding_over_all_rows(counts, groups)),
                 ("an average of each group's ratio", _mean_of_group_overheads(counts, groups))]
        _close(padding_overhead(counts, groups), expected, what, PADDING_RULE, slips)

    # docs/notation.md's example, and the worked example of gemm_grouping's docstring
    # (counts in map order, groups of the sorted order).
    close([4, 5], [(0, 1)], 1 / 9, "counts [4, 5] in one group")
    close([9, 2, 8, 3, 9, 2], [(1, 5), (3,), (2, 0, 4)], 1 / 33,
          "counts [9, 2, 8, 3, 9, 2], groups [(1, 5), (3,), (2, 0, 4)]")
    close([7, 7, 7], [(0,), (1,), (2,)], 0.0, "one offset a group: no padding")
    # Kernels of 27 offsets (some with no pair, in no group), grouped as the library
    # groups them, in both orders: the answer must be padding_report's overhead.
    rng = random.Random(11)
    for case in range(6):
        counts = [rng.choice([0, rng.randint(1, 40), rng.randint(500, 20000)]) for _ in range(27)]
        for order_name, sort in (("sorted", True), ("map", False)):
            groups = [g.members for g in make_groups(counts, offset_order(counts, sort))]
            expected = padding_report(counts)[order_name]["overhead"]
            assert math.isclose(expected, _overhead(counts, groups))  # the two references agree
            close(counts, groups, expected, f"random kernel {case}, {order_name} order: counts {counts}, "
                                            f"groups {groups}")


# ------------------------------------------------------ 11.3 Algorithm 2's choice
TILE_RULE = ("the tile is the fastest one, as an int (the keys are strings, and as strings \"16\" < \"4\"), "
             "the smaller tile on a tie; the speed-up is the fixed tile's time over the best tile's (at least "
             "1: how much faster the choice is than the fixed tile of prior engines)")


def _gain_inverted(timings, fixed=4):
    """A plausible slip: the speed-up turned upside down (best over fixed)."""
    best = min(timings, key=lambda t: (timings[t], int(t)))
    return int(best), timings[best] / timings[str(fixed)]


def _tile_as_string(timings, fixed=4):
    """A plausible slip: the tile returned as the result file's key, a string."""
    best = min(timings, key=lambda t: (timings[t], int(t)))
    return best, timings[str(fixed)] / timings[best]


def _tie_to_larger(timings, fixed=4):
    """A plausible slip: on a tie, the larger tile."""
    best = min(timings, key=lambda t: (timings[t], -int(t)))
    return int(best), timings[str(fixed)] / timings[best]


def _best_tile(timings, fixed):
    best = min(timings, key=lambda t: (timings[t], int(t)))  # ties: the smaller tile
    return int(best), timings[str(fixed)] / timings[best]


@exercise("11.3", "Algorithm 2's choice", answer="best_tile",
          wrong=[Slip(_gain_inverted, says="fixed tile's time over the best"), Slip(_tile_as_string, says="as an int"),
                 Slip(_tie_to_larger, says="smaller tile on a tie")])
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
            raise ExerciseFailed(f"{what}: best_tile returned {got!r}", "best_tile returns a pair (tile, speed_up)")
        if got[0] != best or isinstance(got[0], str):
            raise ExerciseFailed(f"{what}: timings {timings}: got the tile {got[0]!r}, expected the int {best}",
                                 TILE_RULE)
        _close(got[1], gain, f"{what}: the speed-up of tile {best} over tile {fixed}", TILE_RULE,
               [("the best tile's time over the fixed tile's (upside down)", 1 / gain)])
