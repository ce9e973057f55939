"""``python -m numba_sc ladder [STAGE ...]``: each stage's kernels, rung by rung, checked and timed.

A stage that has a ladder keeps its rungs in its own module, in reading order:
``v1`` is the paper's algorithm as plainly as Numba allows, and every later rung
adds one optimization, with a docstring that says what it changed, why the GPU
rewards it, and what it bought when it came in. The library runs the last rung.
This module only runs them, two ways:

* **without a GPU**, every rung under the simulator on a crop of the cloud,
  against the stage's NumPy reference: the agreement table;
* **on a GPU**, every rung on the whole cloud, timed with CUDA events (the
  median of ``rounds`` interleaved rounds, so that a slow minute of the
  machine costs every rung alike), with the speed-up of each step and over
  v1; ``--out`` writes the table with the device, date and command.

The stages with a ladder, in the pipeline's order: ``voxelize`` (stage 1, on the
scan's points), ``outcoords`` (stage 2, a stride-2 layer's outputs),
``backward`` (stage 5), ``search`` (stage 6, the forward search), ``metadata``
(stage 7), ``gather`` (stage 8), ``scatter`` (stage 10), ``batchnorm``
(between the layers), and the two other dataflows of a layer, ``fetch``
(fetch-on-demand) and ``implicit`` (implicit GEMM). The others' workload is one 3x3x3 submanifold layer on
the cloud (its map and plan built by the kernels). The GEMM grouping (stage 9)
has one kernel of its own, ``take_weights_kernel`` (a copy of K small matrices),
with nothing to climb; its lesson is the grouping, on the host. The search rungs build the same table whatever the
features' dtype; they are timed once per dtype all the same.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..dataflows import fetch_on_demand as fod
from ..gmas import gather as ga
from ..dataflows import implicit_gemm as ig
from ..coords import output_coords as oc
from ..nn import pointwise as pw
from ..gmas import scatter as sc
from ..coords import voxelization as vx
from ..gmas.autotune import gpu_time_once, heuristic_tile
from ..core.device import device_name, device_xp, gpu_present, simulating
from ..core.backend import to_device, to_host


@dataclass
class Ladder:
    """One stage's rungs: what each adds, how to run it, what it must equal."""

    stage: str
    adds: dict  # rung -> one line: what this rung adds to the one before
    run: Callable  # run(rung, work) -> result (device)
    reference: Callable  # reference(work) -> result (host)
    written: Callable  # written(work) -> rows of the result that a kernel writes (or None: all)
    tolerance: dict = None  # dtype -> allowed error (relative to the largest value); None: exact
    collect: Callable = None  # collect(result) -> the host array compared with the reference


def _layer_work(coords, channels, dtype, seed=0):
    """One 3x3x3 submanifold layer's arrays on the device: its plan (from the
    kernels), features, a buffer of partial results, a centre product, BatchNorm
    statistics, and the tile the library would pick."""
    from ..map.kernel_map import build_kernel_map
    from ..gmas.metadata import build_plan

    from ..gmas.metadata import submanifold_centre

    rng = np.random.default_rng(seed)
    km = build_kernel_map(to_device(coords), 3, backend="cuda", masks=True)
    plan = build_plan(km, backend="cuda")
    n, rows = len(coords), plan.rows
    xp = device_xp()
    item = np.dtype(dtype).itemsize
    centre = submanifold_centre(km)
    return {
        "weight": xp.asarray((rng.standard_normal((27, channels, channels)) / np.sqrt(channels)).astype(dtype)),
        "centre": centre,
        "fetch_plan": fod.fetch_plan(km.table, km.host_counts(), skip=centre),
        "implicit_plan": ig.implicit_plan(km.table, skip=centre),
        "km": km,
        "coords": to_device(coords),
        "plan": plan,
        "features": xp.asarray(rng.standard_normal((n, channels)).astype(dtype)),
        "obuf": xp.asarray(rng.standard_normal((rows, channels)).astype(dtype)),
        "init": xp.asarray(rng.standard_normal((n, channels)).astype(dtype)),
        "residual": xp.asarray(rng.standard_normal((n, channels)).astype(dtype)),
        "bn": [xp.asarray(v.astype(np.float32)) for v in (rng.uniform(0.5, 1.5, channels), rng.normal(0, 0.2, channels),
                                                           rng.normal(0, 0.2, channels), rng.uniform(0.5, 2, channels))],
        "tile": heuristic_tile(channels, n, item),
    }


def _search_work(coords, B=512, C=1024):
    """What the forward search of a 3x3x3 submanifold layer reads, made by the Map
    step's own kernels: packed keys, key deltas, and the balanced query blocks of
    the backward search, once over all K segments (v1, v2) and once over the
    first ceil(K / 2) (v3, v4: a symmetric kernel searched halfway)."""
    from ..core import conventions as cv
    from ..map.backward_search import backward_search_cuda, max_balanced_blocks
    from ..map.forward_search import forward_threads
    from ..map.kernel_map import layer_arguments

    offsets, deltas = layer_arguments(3, 1, 1, 1)[4:]
    K, P = len(offsets), len(coords)
    reach = tuple(int(v) for v in offsets.min(axis=0)), tuple(int(v) for v in offsets.max(axis=0))
    keys = to_device(cv.pack_keys(np.asarray(coords), *reach))  # sorted: coords are
    work = {"B": B, "C": C, "K": K, "keys": keys, "threads": forward_threads(C),
            "table_shape": (K, P)}
    for h, name in ((K, "full"), ((K + 1) // 2, "half")):
        d = to_device(np.array(deltas[:h]))  # (a writable copy: the layer's deltas are read-only)
        upper = max_balanced_blocks(h, P, P, B, C)
        _, rows, n_rows = backward_search_cuda(keys, keys, d, B, C, upper)
        work[name] = {"deltas": d, "rows": rows, "n_rows": n_rows, "upper": upper,
                      "grid": int(to_host(n_rows)[0])}  # v1-v3 launch exactly one block a row
    return work


def _search_rung(rung, w):
    """Run one forward-search rung and what the metadata stage then needs of the map;
    returns the (K, |Q|) table (the mirrored rows filled in for v3 and v4).

    The library's v4 finds, with each pair, what the metadata stage needs of it:
    the pairs per offset, per offset and chunk of outputs, and each point's mask
    of offsets. For v1-v3 those are then made as the metadata stage makes them for
    a map that lacks them (a count of the table, :func:`~numba_sc.gmas.metadata.chunk_counts_cuda`,
    :func:`~numba_sc.gmas.metadata.masks_cuda`: three more passes over it), so that every
    rung is timed for the same result.
    """
    from ..core.backend import filled
    from ..core.launch import launch
    from ..map.forward_search import forward_search_cuda, forward_search_v1, forward_search_v2, forward_search_v3
    from ..gmas.metadata import chunk_counts_cuda, masks_cuda

    B, C = w["B"], w["C"]
    if rung == "v4":  # the library's: the upper-bound grid, counts, chunk counts and masks
        half = w["half"]
        K, P = w["table_shape"]
        masks = [filled((-(-K // 32), P), np.int64, 0) for _ in range(2)]
        table, _, _ = forward_search_cuda(w["keys"], w["keys"], half["deltas"], half["rows"], half["n_rows"], B, C,
                                          half["upper"], n_offsets=K, out_masks=masks[0], in_masks=masks[1])
        return table
    kernel, part = {"v1": (forward_search_v1, "full"), "v2": (forward_search_v2, "full"),
                    "v3": (forward_search_v3, "half")}[rung]
    seg = w[part]
    table = filled(w["table_shape"], np.int32, -1)
    if seg["grid"]:
        launch(kernel(B), seg["grid"], w["keys"], w["keys"], seg["deltas"], seg["rows"], table,
               threads=w["threads"], blocks=seg["grid"])
    (table >= 0).sum(axis=1)  # pairs per offset
    chunk_counts_cuda(table)
    masks_cuda(table, w["table_shape"][1])
    return table


def _backward_rung(rung, w):
    """One backward-search rung over all K segments: ``(bounds, rows, n_rows)``."""
    from ..map.backward_search import backward_search_cuda, backward_search_v1

    full = w["full"]
    if rung == "v1":
        return backward_search_v1(w["keys"], w["keys"], full["deltas"], w["B"], w["C"])
    return backward_search_cuda(w["keys"], w["keys"], full["deltas"], w["B"], w["C"], full["upper"])


def _bounds_and_rows(result):
    """The bounds, then the rows in (k, j, start) order (v2 writes them in any order)."""
    bounds, rows, n_rows = (to_host(a) for a in result)
    rows = rows[:int(n_rows[0])]
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    return np.concatenate([bounds.ravel(), rows.ravel()])


def _backward_reference(w):
    from ..map.backward_search import backward_search_reference, split_query_blocks_reference

    keys = to_host(w["keys"])
    bounds, _ = backward_search_reference(keys, keys, to_host(w["full"]["deltas"]), w["B"])
    return np.concatenate([bounds.ravel(), split_query_blocks_reference(bounds, w["C"]).ravel()])


def _search_reference(w):
    from ..map.kernel_map import build_kernel_map_reference
    from ..core.conventions import unpack_keys

    coords = unpack_keys(to_host(w["keys"]), with_batch=False)
    return build_kernel_map_reference(coords, 3, assume_sorted=True).table


def _rows_in(table):
    """Buffer rows a table points at (the gather writes those and no padding)."""
    t = to_host(table)
    return np.unique(t[t >= 0])


def _voxelize_work(points, voxel_size, dtype):
    """The scan's points (x, y, z) and, as their features, their own columns cast to
    ``dtype`` (4 with a remission column), on the device."""
    points = np.asarray(points, np.float32)
    return {"points": to_device(np.ascontiguousarray(points[:, :3])), "voxel_size": voxel_size,
            "point_features": to_device(np.ascontiguousarray(points[:, :4].astype(dtype)))}


def _voxels(result):
    """Coordinates and features of a voxelization, side by side."""
    return np.concatenate([to_host(result.coords), to_host(result.features)], axis=1)


def _voxelize_reference(w):
    from ..coords.voxelization import voxelize_reference

    v = voxelize_reference(to_host(w["points"]), w["voxel_size"], to_host(w["point_features"]))
    return np.concatenate([v.coords, v.features], axis=1)


def _tables(result):
    """A plan's dense tables (made from its lists), or v1's, as one array."""
    from ..gmas.metadata import GmasPlan

    out_table, in_table = (result.out_table, result.in_table) if isinstance(result, GmasPlan) else result
    return np.concatenate([to_host(out_table).ravel(), to_host(in_table).ravel()])


def _metadata_rung(rung, w):
    from ..gmas.metadata import build_plan_cuda, build_tables_v1

    return build_tables_v1(w["km"]) if rung == "v1" else build_plan_cuda(w["km"])


def _metadata_reference(w):
    from ..gmas.metadata import build_plan_reference

    plan = build_plan_reference(w["km"])
    return _tables(plan)


LADDERS = {
    "voxelize": Ladder(
        "voxelize",
        {"v1": "the points added into their voxels by atomics (float64), then a division",
         "v2": "+ each voxel's sorted run summed in a register: no atomics, one pass (the library's)"},
        lambda r, w: vx.voxelize_rung(r, w["points"], w["voxel_size"], w["point_features"]),
        _voxelize_reference,
        lambda w: None,
        # v1 adds in float64 in the threads' order: exact for these values, but not promised
        {"float32": 1e-7, "float16": 1e-3},
        _voxels,
    ),
    "outcoords": Ladder(
        "outcoords",
        {"v1": "Eq. 1 through voxelization's de-duplication (argsort, order, inverse); two reads",
         "v2": "+ the keys alone sorted, the range flag read with the count: one read (the library's)"},
        lambda r, w: oc.output_coordinates_rung(r, w["coords"], 2),
        lambda w: oc.output_coordinates_reference(to_host(w["coords"]), 2),
        lambda w: None,
    ),
    "backward": Ladder(
        "backward",
        {"v1": "Figure 11 steps 1-3 as listed: search every pivot; scan the row counts; cut the blocks",
         "v2": "+ one kernel: the neighbour's end shared, rows placed by atomics, no read (the library's)"},
        lambda r, w: _backward_rung(r, w["search"]),
        lambda w: _backward_reference(w["search"]),
        lambda w: None,
        None,
        _bounds_and_rows,
    ),
    "search": Ladder(
        "search",
        {"v1": "the paper's forward search: shared-memory source block, a lo/hi binary search",
         "v2": "+ branch-free: exactly log2(B) halvings over a padded block",
         "v3": "+ a symmetric kernel searched halfway, each hit written twice",
         "v4": "+ counts, chunk counts, masks found with the pairs (v1-v3: 3 passes after); constants, unsigned"},
        lambda r, w: _search_rung(r, w["search"]),
        lambda w: _search_reference(w["search"]),
        lambda w: None,
    ),
    "metadata": Ladder(
        "metadata",
        {"v1": "dense tables: a library scan over all K x |Q| entries, one thread per entry",
         "v2": "+ chunks counted by the search, a scan inside each block, per-point lists (the library's)"},
        _metadata_rung,
        _metadata_reference,
        lambda w: None,
        None,
        _tables,
    ),
    "gather": Ladder(
        "gather",
        {"v1": "Algorithm 1: each thread walks its point's row of the dense input table",
         "v2": "+ per-point lists: a mask and only the rows that exist",
         "v3": "+ sizes compiled in, the tile in registers, unsigned indices",
         "v4": "+ whole 8/4-byte words instead of channels (the library's)"},
        lambda r, w: ga.gather_rung(r, w["features"], w["plan"], w["tile"]),
        lambda w: ga.gather_reference(to_host(w["features"]), to_host(w["plan"].in_table), w["plan"].rows),
        lambda w: _rows_in(w["plan"].in_table),
    ),
    "scatter": Ladder(
        "scatter",
        {"v1": "each thread walks its output's row of the dense output table, a channel at a time",
         "v2": "+ per-point lists: a mask and only the rows that exist",
         "v3": "+ sizes compiled in, the tile's sums in registers, unsigned indices",
         "v4": "+ whole words, unpacked into channels to be added (the library's)"},
        lambda r, w: sc.scatter_rung(r, w["obuf"], w["plan"], w["init"], w["tile"]),
        lambda w: sc.scatter_reference(to_host(w["obuf"]), to_host(w["plan"].out_table), to_host(w["init"])),
        lambda w: None,
    ),
    "batchnorm": Ladder(
        "batchnorm",
        {"v1": "one thread per value; BatchNorm, residual add and ReLU in one pass",
         "v2": "+ the channel count compiled in, fast math (the library's)"},
        lambda r, w: pw.batch_norm_rung(r, w["features"], *w["bn"], 1e-5, w["residual"], True),
        lambda w: pw.batch_norm_reference(to_host(w["features"]), *[to_host(v) for v in w["bn"]], 1e-5,
                                          to_host(w["residual"]), True),
        lambda w: None,
        # the GPU fuses a multiply and an add (and v2 approximates the root and the
        # division): a float32 ulp or two, which may move a fp16 rounding by one ulp
        {"float32": 4e-6, "float16": 2e-3},
    ),
    # The two other dataflows (#17): a whole layer outside the centre, added onto
    # ``init`` (the centre product). Float sums in another order: a tolerance.
    "fetch": Ladder(
        "fetch",
        {"v1": "one thread per (pair, output channel): global reads, one atomic add each",
         "v2": "+ the fetched rows and W[k] in shared memory, a register tile per thread (the library's)"},
        lambda r, w: fod.fetch_rung(r, w["features"], w["weight"], w["fetch_plan"], w["features"].shape[0],
                                    w["init"]),
        lambda w: _dataflow_reference(fod.fetch_on_demand_reference, w),
        lambda w: None,
        {"float32": 1e-5, "float16": 2e-3},
    ),
    "implicit": Ladder(
        "implicit",
        {"v1": "one thread per (output, output channel) over every offset and input channel",
         "v2": "+ shared-memory tiles of the gathered rows and of W[k]",
         "v3": "+ outputs sorted by offset mask, tiles skip absent offsets, a register tile (the library's)"},
        lambda r, w: ig.implicit_rung(r, w["features"], w["weight"], w["km"].table, w["implicit_plan"], w["init"]),
        lambda w: _dataflow_reference(ig.implicit_gemm_reference, w),
        lambda w: None,
        {"float32": 1e-5, "float16": 2e-3},
    ),
}


def _dataflow_reference(reference, w):
    return reference(to_host(w["features"]), to_host(w["weight"]), to_host(w["km"].table), to_host(w["init"]),
                     w["centre"])


def agreement(ladder, rung, work):
    """Max |rung - reference| over the values the rung writes, relative to the largest
    reference value (or 1, when they are all smaller): 0 for an exact stage."""
    res = ladder.run(rung, work)
    got = np.asarray(ladder.collect(res) if ladder.collect else to_host(res), np.float64)
    want = np.asarray(ladder.reference(work), np.float64)
    rows = ladder.written(work)
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.shape != want.shape:
        return float("inf")
    if not got.size:
        return 0.0
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def agrees(ladder, dtype, error) -> bool:
    """Whether an :func:`agreement` is within the ladder's tolerance (exact by default)."""
    return error <= (ladder.tolerance or {}).get(dtype, 0.0)


def time_rungs(ladder, work, rounds=20, warmup=5):
    """Median GPU microseconds of each rung, interleaved rounds, after ``warmup`` calls
    of each (the first compiles; the rest let the library's caches and memory pool
    settle: with one warm-up call, the stages that call the array library read up to
    2x slower in a fresh process, measured on the H100)."""
    rungs = list(ladder.adds)
    for _ in range(warmup):
        for r in rungs:
            ladder.run(r, work)
    samples = {r: [] for r in rungs}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for i in rng.permutation(len(rungs)):
            r = rungs[i]
            samples[r].append(gpu_time_once(lambda: ladder.run(r, work)) * 1e6)
    return {r: float(np.median(v)) for r, v in samples.items()}


def make_work(coords, channels=8, dtype="float32", points=None, voxel_size=0.05, search_blocks=None, seed=0):
    """Everything the ladders read, for one dtype: a 3x3x3 layer's map, plan and arrays
    on ``coords``; the points for ``voxelize`` (when given); the search's keys and
    blocks when ``search_blocks = (B, C)`` is given (small blocks make a crop's
    search cross many source blocks, as the whole scan's does)."""
    work = _layer_work(coords, channels, dtype, seed)
    if points is not None:
        work.update(_voxelize_work(points, voxel_size, dtype))
    if search_blocks is not None:
        work["search"] = _search_work(coords, *search_blocks)
    return work


def check_rungs(stages, work, dtype="float32", print_=print):
    """Every rung of ``stages`` against its reference on ``work``; raises on a
    disagreement. Returns {(stage, rung): error}."""
    errors = {}
    for stage in stages:
        ladder = LADDERS[stage]
        for rung, adds in ladder.adds.items():
            err = agreement(ladder, rung, work)
            errors[stage, rung] = err
            print_(f"{stage:10s} {rung}  error {err:.1e}  {adds}")
            if not agrees(ladder, dtype, err):
                raise AssertionError(f"{stage} {rung} disagrees with the reference: {err:.3g}")
    return errors


def plot_recorded(record, stages, axes=None):
    """Bars of a recorded ladder run (a ``--out`` file, loaded): each rung's GPU time per
    dtype, labelled with its speed-up over v1; one panel a stage (needs matplotlib)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False)
        axes = axes[0]
    for ax, stage in zip(axes, stages):
        for j, dt in enumerate(("float32", "float16")):
            rows = [r for r in record["rows"] if r["stage"] == stage and r["dtype"] == dt]
            xs = np.arange(len(rows)) + (j - 0.5) * 0.38
            ax.bar(xs, [r["gpu_us"] for r in rows], 0.38, label=dt, color=f"C{j}")
            for x, r in zip(xs, rows):
                ax.text(x, r["gpu_us"], f"{r['vs_v1']:.1f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["rung"] for r in rows])
        ax.set_title(stage)
        ax.set_ylabel("GPU us")
    axes[0].legend(fontsize=8)
    rec = record["recorded"]
    axes[0].figure.suptitle(f"{rec['device']}, {rec['date']}: {record['points']:,} voxels", fontsize=9)
    return axes


def run_ladder(stages, coords, channels=64, dtypes=("float32", "float16"), rounds=20, out=None, note="",
               print_=print, points=None, voxel_size=0.05):
    """The ladder table of ``stages`` on ``coords``: agreement with the reference always,
    GPU times when a GPU runs the kernels. Returns the rows; writes ``out`` (JSON).

    ``points`` (N, 3 or 4), voxelized at ``voxel_size`` into ``coords``: what the
    ``voxelize`` ladder starts from (without them it is left out)."""
    if points is None:
        stages = [s for s in stages if s != "voxelize"]
    timed = gpu_present() and not simulating()
    rows = []
    head = f"{'stage':10s} {'dtype':8s} {'rung':5s} {'error':>9s} {'ok':>3s}"
    head += f" {'GPU us':>9s} {'step':>6s} {'vs v1':>6s}" if timed else ""
    print_(head + "  adds")
    search = _search_work(coords) if {"search", "backward"} & set(stages) else None  # (the same for every dtype)
    for dtype in dtypes:
        work = make_work(coords, channels, dtype, points, voxel_size)
        work["search"] = search
        for stage in stages:
            ladder = LADDERS[stage]
            times = time_rungs(ladder, work, rounds) if timed else {}
            prev = None
            for rung, adds in ladder.adds.items():
                err = agreement(ladder, rung, work)
                ok = agrees(ladder, dtype, err)
                row = {"stage": stage, "dtype": dtype, "rung": rung, "adds": adds, "error": err, "agrees": ok}
                line = f"{stage:10s} {dtype:8s} {rung:5s} {err:9.2e} {'yes' if ok else 'NO':>3s}"
                if timed:
                    t = times[rung]
                    row.update(gpu_us=t, step=(times[prev] / t) if prev else 1.0, vs_v1=times["v1"] / t)
                    line += f" {t:9.1f} {row['step']:5.2f}x {row['vs_v1']:5.2f}x"
                print_(line + "  " + adds)
                rows.append(row)
                prev = rung
    if out:
        rec = {"points": int(len(coords)), "channels": channels, "rounds": rounds, "rows": rows,
               "recorded": {"device": device_name(), "date": time.strftime("%Y-%m-%d"),
                            "command": "python -m numba_sc " + " ".join(sys.argv[1:]), "code": note}}
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)
    return rows

