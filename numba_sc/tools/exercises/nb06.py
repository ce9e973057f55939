"""Exercises of notebook 06, the GEMM grouping (stage 9).

6.1  Minuet's grouping: offsets sorted by pair count, neighbours batched under a padding budget;
6.2  the least padding any grouping into at most L batched GEMMs can have;
6.3  the price of a launch in padding rows (what ``sparse_conv3d`` weighs on small layers).

The pair counts come from real layers: 3x3x3 kernel maps (stride 1 and 2) of crops of the
SemanticKITTI scan and of the SUN RGB-D frame, and the notebook's eight-offset toy.

The slips: the budget taken before the new offset joins, the map's order for the
sorted one, the centre grouped with the rest (6.1); runs of equal length, the centre
again (6.2); a padding row priced by its bytes alone, the price rounded to nearest (6.3).
"""
from __future__ import annotations

import numpy as np

from ...core.state import cached
from . import ExerciseFailed, Slip, exercise, expect_equal
from .inputs import data_folder

TOY = [5, 2, 8, 6, 2, 7, 5, 8]  # notebook 06's eight offsets, in map order
BUDGETS = (0.0, 0.05, 0.25, 1.0)  # max_padding values every grouping answer is checked with


def layers():
    """(name, pair counts, the centre offset or None) of the toy, then of a few real layers
    (their maps are built on first use: an unanswered exercise stops at the toy)."""
    yield "toy", list(TOY), None
    yield from real_layers()


@cached
def real_layers() -> tuple:
    """(name, pair counts, the centre offset or None) of 3x3x3 layers, stride 1 and 2, on
    crops of 3,000 points of the SemanticKITTI scan and of the SUN RGB-D frame."""
    from ...coords.voxelization import voxelize
    from ...gmas.layout import submanifold_centre
    from ...map.map_step import build_kernel_map
    from ..check import crop_points

    found = []
    for name, fname, cols, size in (("SemanticKITTI", "semantickitti_000000.bin", 4, 0.05),
                                    ("SUN RGB-D", "sunrgbd_000017.bin", 6, 0.02)):
        points = np.fromfile(data_folder(required=True) / fname, np.float32).reshape(-1, cols)
        patch = np.ascontiguousarray(points[crop_points(points, 3000), :3])
        coords = voxelize(patch, size, backend="reference").coords
        for stride in (1, 2):
            km = build_kernel_map(coords, 3, stride=stride, backend="reference")
            centre = submanifold_centre(km)
            found.append((f"{name} crop, 3x3x3 stride {stride}", np.asarray(km.counts).tolist(),
                          centre if centre >= 0 else None))
    return tuple(found)


def _members(groups, what):
    """The answer's groups as a list of tuples of ints, or a clear failure."""
    try:
        return [tuple(int(k) for k in g) for g in groups]
    except TypeError:
        raise ExerciseFailed(f"{what}: return a list of groups, each a tuple of offset indices; "
                             f"got {groups!r}") from None


# --------------------------------------------------------------------- 6.1
GROUPS_RULE = ("Minuet's grouping: leave out the offsets with no pair and the offset skip; order the others "
               "by non-decreasing pair count (ties keep the map's order); walk them, adding the next offset to "
               "the current group while the group's padding rows, with that offset in it, stay at most "
               "max_padding times its real rows, with that offset in it; otherwise start a new group")


def _greedy(order, counts, max_padding, before_adding=False):
    groups, members, real = [], [], 0
    for k in order:
        c = counts[k]  # in sorted order the newcomer is the tallest
        tallest = max([counts[m] for m in members] + [c])
        padding = tallest * (len(members) + 1) - (real + c)
        if members and padding <= max_padding * (real if before_adding else real + c):
            members, real = members + [k], real + c
            continue
        if members:
            groups.append(tuple(members))
        members, real = [k], c
    return groups + ([tuple(members)] if members else [])


def _sorted_offsets(counts, skip):
    return sorted((k for k, n in enumerate(counts) if n > 0 and k != skip), key=lambda k: counts[k])


def _budget_before_adding(counts, skip, max_padding):
    """A plausible slip: the budget taken on the group's real rows *before* the new offset."""
    return _greedy(_sorted_offsets(counts, skip), counts, max_padding, before_adding=True)


def _map_order(counts, skip, max_padding):
    """A plausible slip: the offsets walked in the map's order, unsorted (TorchSparse's)."""
    return _greedy([k for k, n in enumerate(counts) if n > 0 and k != skip], counts, max_padding)


def _centre_grouped(counts, skip, max_padding):
    """A plausible slip: the submanifold centre grouped with the other offsets."""
    return _greedy(_sorted_offsets(counts, None), counts, max_padding)


@exercise("6.1", "Minuet's grouping", answer="minuet_groups",
          wrong=[Slip(_budget_before_adding, says="with that offset in it"),
                 Slip(_map_order, says="non-decreasing pair count"), Slip(_centre_grouped, says="skip")])
def check_groups(minuet_groups):
    """``minuet_groups(counts, skip, max_padding)`` against the library's grouping of the
    sorted offsets (:func:`numba_sc.gmas.gemm_grouping.make_groups`), on every layer and budget."""
    from ...gmas import gemm_grouping as gg

    for name, counts, skip in layers():
        for budget in BUDGETS:
            what = f"{name}, max_padding = {budget}"
            want = [g.members for g in gg.make_groups(counts, gg.offset_order(counts, True, skip), budget)]
            got = _members(minuet_groups(list(counts), skip, budget), what)
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                mine, right = (g[first] if first < len(g) else None for g in (got, want))

                def show(group):
                    return "none" if group is None else f"{group} (counts {[counts[k] for k in group]})"

                raise ExerciseFailed(f"{what}: group {first} is {show(mine)}, expected {show(right)} ({len(got)} "
                                     f"groups, expected {len(want)}; skip = {skip}; counts {list(counts)})",
                                     GROUPS_RULE)


# --------------------------------------------------------------------- 6.2
FEWEST_RULE = ("every offset with pairs, except skip, in exactly one group; at most `launches` groups; each "
               "group padded to its tallest member; and the fewest padding rows of all such groupings (some "
               "best grouping cuts the offsets sorted by count into runs: a dynamic programme over the runs "
               "finds it)")


def padded_rows(counts, groups) -> int:
    """Zero rows a grouping adds: each group padded to its tallest member."""
    return sum(len(g) * max(counts[k] for k in g) - sum(counts[k] for k in g) for g in groups)


def least_padding(counts, skip, launches) -> int:
    """The fewest padding rows of any grouping into at most ``launches`` batched GEMMs.

    Some optimal grouping cuts the offsets *sorted by count* into runs (swapping two
    offsets between groups so that the taller group gets the taller one never adds
    padding), so a dynamic programme over the sorted counts finds it:
    ``best[g][i]`` is the least padding of the i smallest offsets in g groups."""
    c = sorted(n for k, n in enumerate(counts) if n > 0 and k != skip)
    prefix = np.concatenate([[0], np.cumsum(c)])
    inf = float("inf")
    best = [0] + [inf] * len(c)  # no group yet: only the empty prefix costs nothing
    least = best[-1]
    for _ in range(launches):  # one more group: the last run is c[a:i], padded to c[i - 1]
        best = [0] + [min(best[a] + c[i - 1] * (i - a) - (prefix[i] - prefix[a]) for a in range(i))
                      for i in range(1, len(c) + 1)]
        least = min(least, best[-1])
    return int(least)


def _equal_runs(counts, skip, launches):
    """A plausible slip: the sorted offsets cut into ``launches`` runs of equal length,
    wherever the counts jump."""
    ks = _sorted_offsets(counts, skip)
    return [tuple(int(k) for k in part) for part in np.array_split(ks, launches) if len(part)]


def _optimal_with_centre(counts, skip, launches):
    """A plausible slip: the best runs, but of every offset, the centre included."""
    ks = _sorted_offsets(counts, None)
    c = [counts[k] for k in ks]
    best = {(0, 0): (0, [])}  # (groups, offsets) -> (padding, groups)
    for g in range(1, launches + 1):
        for i in range(1, len(ks) + 1):
            options = [(best[(g - 1, a)][0] + c[i - 1] * (i - a) - sum(c[a:i]), best[(g - 1, a)][1] + [tuple(ks[a:i])])
                       for a in range(i) if (g - 1, a) in best]
            if options:
                best[(g, i)] = min(options, key=lambda o: o[0])
    return min((best[(g, len(ks))] for g in range(1, launches + 1) if (g, len(ks)) in best), key=lambda o: o[0])[1]


@exercise("6.2", "the least padding in L launches", answer="fewest_padding_groups",
          wrong=[Slip(_equal_runs, says="fewest padding rows"), Slip(_optimal_with_centre, says="except skip")])
def check_fewest_padding(fewest_padding_groups):
    """``fewest_padding_groups(counts, skip, launches)``: every offset with pairs (but ``skip``)
    in exactly one group, at most ``launches`` groups, and no more padding than the
    optimum (:func:`least_padding`)."""
    for name, counts, skip in layers():
        wanted = sorted(k for k, n in enumerate(counts) if n > 0 and k != skip)
        for launches in (1, 2, 3, 5):
            what = f"{name}, at most {launches} launches"
            groups = _members(fewest_padding_groups(list(counts), skip, launches), what)
            grouped = sorted(k for g in groups for k in g)
            if grouped != wanted:
                extra = sorted(set(grouped) - set(wanted)) or sorted(k for k in set(grouped) if grouped.count(k) > 1)
                missing = sorted(set(wanted) - set(grouped))
                raise ExerciseFailed(f"{what}: the groups {groups} hold offsets {extra} too many and miss {missing} "
                                     f"(skip = {skip})", FEWEST_RULE)
            if len(groups) > launches:
                raise ExerciseFailed(f"{what}: {len(groups)} groups, expected at most {launches}", FEWEST_RULE)
            got, best = padded_rows(counts, groups), least_padding(counts, skip, launches)
            if got > best:
                raise ExerciseFailed(f"{what}: {got} padding rows, expected {best}, the fewest possible (groups "
                                     f"{groups}, counts {list(counts)})", FEWEST_RULE)


# --------------------------------------------------------------------- 6.3
PRICE_RULE = ("a padding row costs the longer of its bytes' time, (c_in + c_out) * itemsize / BYTES_PER_US, "
              "and its flops' time, 2 * c_in * c_out / FLOPS_PER_US[itemsize] (wide layers are compute "
              "bound); launch_rows is LAUNCH_US over that cost, rounded down to an int")


def _bytes_only(c_in, c_out, itemsize):
    """A plausible slip: a padding row priced by its bytes alone, as if every GEMM were
    memory bound (wide layers are not: their flops take longer)."""
    from ...gmas import gemm_grouping as gg

    return int(gg.LAUNCH_US / ((c_in + c_out) * itemsize / gg.BYTES_PER_US))


def _rounded(c_in, c_out, itemsize):
    """A plausible slip: the price rounded to the nearest row, not down."""
    from ...gmas import gemm_grouping as gg

    cost = max((c_in + c_out) * itemsize / gg.BYTES_PER_US, 2 * c_in * c_out / gg.FLOPS_PER_US[itemsize])
    return round(gg.LAUNCH_US / cost)


@exercise("6.3", "the price of a launch", answer="launch_rows",
          wrong=[Slip(_bytes_only, says="flops' time"), Slip(_rounded, says="rounded down")])
def check_launch_rows(launch_rows):
    """``launch_rows(c_in, c_out, itemsize)`` against :func:`numba_sc.gmas.gemm_grouping.launch_rows`
    over the channel counts of the networks, in fp32 and fp16."""
    from ...gmas import gemm_grouping as gg

    shapes = [(c_in, c_out, item) for c_in, c_out in ((4, 16), (16, 32), (32, 32), (64, 64), (96, 128),
                                                      (128, 128), (256, 256), (32, 256))
              for item in (4, 2)]
    for s in shapes:
        expect_equal(launch_rows(*s), gg.launch_rows(*s), f"launch_rows{s} (C_in, C_out, itemsize)", rule=PRICE_RULE)
