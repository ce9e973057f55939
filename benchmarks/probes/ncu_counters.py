#!/usr/bin/env python
"""Minuet's mechanism in hardware counters (Nsight Compute), and the paper's Figures 13 and 14.

One command on the GPU machine records it all (issue #35; meant to take about five minutes
on an H100, ``--budget-s`` keeps it under that):

    . benchmarks/gpu_env.sh
    export NUMBA_SC_COMMIT=<the checkout's short hash>
    python3 benchmarks/probes/ncu_counters.py

Five result files go to ``benchmarks/results/`` (``--out-dir``), each with the
``recorded`` block of the other result files (device, driver, versions, commit, date,
command) and the device's L2 size and peak DRAM bandwidth, so that a notebook can say
"x % of peak" (:mod:`numba_sc.tools.counters` reads them):

``counters_map.json``
    The Map step's search, each kind profiled alone by Nsight Compute: one plain binary
    search per query (notebook 03's kernel) over the same queries in three orders, a
    random permutation (``unsorted``), ``sorted`` and Minuet's ``segmented`` order, and
    segmented again with each query made on the fly (exercise 3.2's kernel); then the
    library's Map step with Minuet's search (``minuet``: backward and forward search),
    the hash table (``hash``) and the dense grid (``grid``). On the SemanticKITTI scan and
    on clouds whose tables exceed the 50 MB L2 of an H100: batches of turned copies of the
    scan and random clouds, up to the paper's five million points (each cloud's record says
    how it was made, its voxels and its tables' bytes). Per kernel: L2 and L1 hit rates,
    DRAM bytes read and written, GPU time, DRAM throughput as ncu's share of its peak.
``counters_gather_scatter.json``
    The library's gather and scatter (their top rung) for every tile size Algorithm 2
    tries, on the scan and the 1M random cloud, fp32 and fp16: the same counters.
``counters_layer_stages.json``
    One whole 3x3x3 layer (64 -> 64, fp32, its map built), every kernel profiled, summed
    by stage: Map, metadata, gather, GEMMs, scatter.
``paper_fig13.json``
    Figure 13's density sweep: random clouds of 10^4 to 10^6 voxels in the paper's 400^3
    box; the Map step by method, and MinkUNet42's forward pass beside spconv's twins
    (``bench_net.py``'s measurement, one run per size). Wall clock and CUDA events.
``paper_fig14.json``
    Figure 14's breakdown on one 3x3x3 layer: Minuet's four ideas switched on one after
    the other (autotuned tiles, padding-efficient grouping, segmented query sorting,
    double-traversed binary search), each bar the sum of the Map step, the metadata and
    the GMaS step timed alone (interleaved, wall clock and CUDA events).

How the counters are attributed. The script runs itself under ``ncu`` in a *child* mode
(``--child``), which builds every workload, warms it up (compiles), then for each
measurement calls ``cudaProfilerStart``, launches a tiny *marker* kernel whose grid has
``index + 1`` blocks, runs the workload once, synchronizes and calls ``cudaProfilerStop``.
``ncu --profile-from-start off`` profiles only those launches. The child writes a manifest
(JSON lines: what each index measures). The parent exports ncu's report as CSV, reads the
marker rows' grid sizes back to indices (:func:`attribute`) and files every kernel under
its measurement. ncu's defaults stand: every kernel replayed once per metric pass, caches
flushed before each one (``--cache-control all``: an L2 hit rate is that of a cold start)
and clocks locked to base (``--clock-control base``: times are slower than a CUDA event's).

``--dry-run --tiny`` runs every workload and every timed contender once on a crop of about
150 voxels, in this process, without ncu or timing, and writes nothing: what the tests run
under the simulator (tests/tools/test_ncu_counters.py). Nothing else of it runs in CI.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py, bench_net.py

from common import (HOST_THEN_GPU, RESULTS, find_data, interleaved, random_coords, recorded,  # noqa: E402
                    scan_coords, scan_points)

# --------------------------------------------------------------------------- what ncu measures
# short name (what the result files use) -> Nsight Compute metric (names as `ncu --query-metrics`
# lists them, with a roll-up suffix)
METRICS = {
    "time_ns": "gpu__time_duration.sum",  # the kernel's GPU time
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",  # L2 sectors that hit, of all L2 sector lookups
    "l2_sectors": "lts__t_sectors.sum",  # ... and how many lookups: weights hit rates when summing kernels
    "l1_hit_pct": "l1tex__t_sector_hit_rate.pct",  # the same in L1 (the plain searches go through it)
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_pct_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",  # ncu's own "% of peak"
}
REQUIRED = ("time_ns",)  # without it nothing can be read; the others are dropped if this ncu lacks them
MARKER = "ncu_counters_marker"  # in the name of the marker kernel, whatever ncu prints of it

# The files each part writes, and which parts ncu measures (the others are timed).
FILES = {"map": "counters_map.json", "tiles": "counters_gather_scatter.json",
         "stages": "counters_layer_stages.json", "fig13": "paper_fig13.json", "fig14": "paper_fig14.json"}
NCU_PARTS = ("map", "tiles", "stages")
PARTS = ("map", "tiles", "stages", "fig14", "fig13")  # the order they run in: the counters first

VARIANTS = {  # the Map step's variants, in the order they are profiled (and shown)
    "unsorted": "one lower-bound binary search of the whole source array per query (search_listed), "
                "the queries materialized in a random order",
    "sorted": "the same kernel, all queries materialized and sorted",
    "segmented": "the same kernel, the queries materialized segment by segment, sorted(Q) + delta_k "
                 "(Minuet's order)",
    "segmented_on_the_fly": "segmented order, each query made from its output and offset in the kernel "
                            "(search_segments, exercise 3.2's kernel): nothing materialized",
    "minuet": "the library's Map step, method='sorted': pack, backward search, forward search "
              "(build_kernel_map(..., assume_sorted=True), as a layer calls it)",
    "hash": "the library's Map step, method='hash': pack, table fill, inserts, one probe per query",
    "grid": "the library's Map step, method='grid': pack, box, grid fill, one probe per query",
}
QUERY_STAGES = ("search", "forward search", "probe")  # the query process (paper Figure 16b): per variant

# Kernel name -> stage: the first pattern found in the name (any of ncu's name forms holds the
# Python function's name; cuBLAS's kernels are named after GEMMs).
STAGE_PATTERNS = (
    (MARKER, "marker"),
    ("forward_search", "forward search"),
    ("backward_search", "backward search"),
    ("search_listed", "search"),
    ("search_segments", "search"),
    ("probe", "probe"),
    ("insert_kernel", "hash build"),
    ("extremes_kernel", "grid build"),
    ("fill_kernel", "grid build"),
    ("pack_kernel", "pack"),
    ("metadata", "metadata"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("take_weights", "GEMM"),
    ("gemm", "GEMM"),
    ("gemv", "GEMM"),
    ("xmma", "GEMM"),
    ("cutlass", "GEMM"),
)
LAYER_STAGES = {"pack": "Map", "backward search": "Map", "forward search": "Map", "search": "Map",
                "probe": "Map", "hash build": "Map", "grid build": "Map", "metadata": "metadata",
                "gather": "gather", "GEMM": "GEMMs", "scatter": "scatter"}  # anything else: "other"


def classify(kernel_name: str) -> str:
    """The stage a profiled kernel belongs to, from its name (``"other"``: a CuPy fill, a sort, ...)."""
    low = kernel_name.lower()
    for pattern, stage in STAGE_PATTERNS:
        if pattern in low:
            return stage
    return "other"


# --------------------------------------------------------------------------- reading ncu's CSV
class NcuOutputError(RuntimeError):
    """ncu's output holds no table of results (it printed errors instead)."""


_TIME_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
            "second": 1e9, "s": 1e9}
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30,
           "Ti": 2.0 ** 40}
_COUNTED = ("byte", "sector", "cycle", "inst", "request", "warp", "thread", "block")


def to_base(value: float, unit: str) -> float:
    """``value`` in ``unit`` (as ncu prints units) in base units: nanoseconds for times, bytes,
    sectors, ...; percentages and plain counts unchanged. ``--print-units base`` asks ncu
    for base units already; this keeps a report exported without it right too."""
    unit = unit.strip()
    if unit in _TIME_NS:
        return value * _TIME_NS[unit]
    for base in _COUNTED:
        if unit.endswith(base) and unit[:-len(base)] in _PREFIX:
            return value * _PREFIX[unit[:-len(base)]]
    return value


def number(text: str):
    """A metric value as ncu prints it ("1,234,567.5", "87.3", "n/a") -> float, or None."""
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def _grid_x(text: str):
    """The first number of a grid size "(12, 1, 1)" (ncu's "Grid Size" column), or None."""
    m = re.match(r"\s*\(?\s*(\d+)", text or "")
    return int(m.group(1)) if m else None


def parse_ncu_csv(text: str) -> list:
    """The kernels of ncu's CSV output, in launch order: ``[{"id", "name", "grid", "block",
    "metrics": {metric: value in base units}}]``.

    Reads both of ncu's layouts: the *details* page (``--page details``, the default: one row
    per kernel and metric, columns "ID", "Kernel Name", ..., "Metric Name", "Metric Unit",
    "Metric Value") and the *raw* page (``--page raw``: one row per kernel, one column per
    metric, their units in the row under the header). Lines before the header (ncu's
    ``==PROF==`` messages, the program's own output) are skipped; values keep ncu's
    thousands separators out. Raises :class:`NcuOutputError`, quoting ncu's error lines,
    when there is no table at all.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        errors = [line for line in lines if "==ERROR==" in line or "==WARNING==" in line]
        raise NcuOutputError("ncu printed no table of results" + (":\n  " + "\n  ".join(errors[:20]) if errors
                                                                   else " (and no ==ERROR== line)"))
    table = list(csv.reader(io.StringIO("\n".join(line for line in lines[start:] if line.startswith('"')))))
    header, rows = table[0], table[1:]
    col = {name: i for i, name in enumerate(header)}
    if "Kernel Name" not in col:
        raise NcuOutputError(f"ncu's table has no 'Kernel Name' column; its columns: {header}")

    def field(row, name):
        return row[col[name]] if name in col and col[name] < len(row) else ""

    kernels = {}  # ID -> kernel, in first appearance (launch) order
    if "Metric Name" in col:  # the details page
        for row in rows:
            if len(row) <= col["Metric Value"] or not field(row, "ID").strip():
                continue
            k = kernels.setdefault(field(row, "ID"), {"id": int(number(field(row, "ID")) or 0),
                                                      "name": field(row, "Kernel Name"),
                                                      "grid": field(row, "Grid Size"),
                                                      "block": field(row, "Block Size"), "metrics": {}})
            name, value = field(row, "Metric Name"), number(field(row, "Metric Value"))
            if name:
                k["metrics"][name] = None if value is None else to_base(value, field(row, "Metric Unit"))
        return list(kernels.values())
    # the raw page: the row under the header holds the units (its ID cell is empty)
    has_units = bool(rows) and not field(rows[0], "ID").strip()
    units = rows[0] if has_units else [""] * len(header)
    for row in rows[1:] if has_units else rows:
        if not field(row, "ID").strip():
            continue
        metrics = {}
        for name, i in col.items():
            if "__" in name and i < len(row):  # metric names hold a double underscore
                value = number(row[i])
                metrics[name] = None if value is None else to_base(value, units[i] if i < len(units) else "")
        kernels[field(row, "ID")] = {"id": int(number(field(row, "ID")) or 0), "name": field(row, "Kernel Name"),
                                     "grid": field(row, "Grid Size"), "block": field(row, "Block Size"),
                                     "metrics": metrics}
    return list(kernels.values())


def attribute(kernels: list):
    """Split profiled kernels into measurements at the marker kernels: ``({index: [kernels]},
    [kernels before any marker])``. A marker's index is its grid size less one (its
    "Grid Size" column), else its rank among the markers, so a measurement whose marker
    ncu failed to profile loses its kernels to the one before rather than shifting every
    measurement after it."""
    groups, stray, current, rank = {}, [], None, -1
    for k in kernels:
        if MARKER in k["name"]:
            rank += 1
            x = _grid_x(k.get("grid", ""))
            current = groups.setdefault(x - 1 if x else rank, [])
        elif current is None:
            stray.append(k)
        else:
            current.append(k)
    return groups, stray


def kernel_record(k: dict) -> dict:
    """One profiled kernel as the result files keep it: name, stage, grid, and the metrics by
    their short names (None where ncu gave no value)."""
    by_name = {full: short for short, full in METRICS.items()}
    out = {"name": k["name"], "stage": classify(k["name"]), "grid": k.get("grid", ""), "block": k.get("block", "")}
    for full, value in k["metrics"].items():
        if full in by_name:
            out[by_name[full]] = value
    for short in METRICS:
        out.setdefault(short, None)
    return out


def aggregate(kernels: list):
    """The counters of several kernels (records of :func:`kernel_record`) as if one: times,
    bytes and sectors summed; the L2 hit rate weighted by each kernel's L2 sectors (by
    time where those are missing), the L1 hit rate and ncu's DRAM share weighted by time;
    ``bytes_per_s``: DRAM bytes read and written over the summed time. None when
    ``kernels`` is empty; a field is None when a kernel lacks it."""
    if not kernels:
        return None

    def total(key):
        values = [k.get(key) for k in kernels]
        return None if any(v is None for v in values) else float(sum(values))

    def weighted(key, weight):
        pairs = [(k.get(key), k.get(weight)) for k in kernels]
        if any(v is None or w is None for v, w in pairs):
            return None
        w_sum = sum(w for _, w in pairs)
        return float(sum(v * w for v, w in pairs) / w_sum) if w_sum else None

    t, rd, wr = total("time_ns"), total("dram_read_bytes"), total("dram_write_bytes")
    l2 = weighted("l2_hit_pct", "l2_sectors")
    if l2 is None:
        l2 = weighted("l2_hit_pct", "time_ns")
    both = None if rd is None or wr is None else rd + wr
    return {"kernels": len(kernels), "time_ns": t, "dram_read_bytes": rd, "dram_write_bytes": wr,
            "dram_bytes": both, "l2_hit_pct": l2, "l2_sectors": total("l2_sectors"),
            "l1_hit_pct": weighted("l1_hit_pct", "time_ns"), "dram_pct_peak": weighted("dram_pct_peak", "time_ns"),
            "bytes_per_s": both / t * 1e9 if both is not None and t else None}


def build_records(kernels: list, entries: list, rec: dict) -> dict:
    """{file name: record} of the counters parts from the parsed CSV (:func:`parse_ncu_csv`) and
    the child's manifest ``entries`` (its JSON lines, in order); ``rec`` is the ``recorded``
    block. A measurement whose kernels are missing says so in an ``error`` field."""
    groups, stray = attribute(kernels)
    device = next((e["device"] for e in entries if e["kind"] == "device"), {})
    checks = {e["label"]: e["check"] for e in entries if e["kind"] == "check"}
    out = {}
    for part in NCU_PARTS:
        mine = [e for e in entries if e.get("part") == part]
        if not mine:
            continue
        rows = []
        for e in (e for e in mine if e["kind"] == "measure"):
            ks = [kernel_record(k) for k in groups.get(e["index"], [])]
            row = {key: v for key, v in e.items() if key not in ("kind", "part", "index")}
            row["kernels"] = ks
            if e["label"] in checks:
                row["check"] = checks[e["label"]]
            if not ks:
                row["error"] = "no kernel of this measurement is in ncu's report"
            if part == "map":
                row["query"] = aggregate([k for k in ks if k["stage"] in QUERY_STAGES])
                row["step"] = aggregate(ks)
            elif part == "stages":
                by = {}
                for k in ks:
                    by.setdefault(LAYER_STAGES.get(k["stage"], "other"), []).append(k)
                row["by_stage"] = {s: aggregate(v) for s, v in by.items()}
                row["total"] = aggregate(ks)
            else:
                row["total"] = aggregate(ks)
            rows.append(row)
        out[FILES[part]] = {
            "recorded": rec, "device": device, "metrics": METRICS, "about": ABOUT[part],
            "clouds": {e["name"]: {k: v for k, v in e.items() if k not in ("kind", "part", "name")}
                       for e in mine if e["kind"] == "cloud"},
            "rows": rows,
            "not_run": [{k: v for k, v in e.items() if k not in ("kind", "part")} for e in mine
                        if e["kind"] in ("skipped", "refused", "failed")],
            "unattributed_kernels": len(stray),
        }
    return out


ABOUT = {
    "map": "The Map step's search of a 3x3x3 submanifold layer, every variant doing the same lookups: the "
           "ceil(27/2) = 14 segments a symmetric kernel searches (the library mirrors the rest), times the "
           "voxels. 'query' sums the query process (the paper's Figure 16b: Minuet's forward search alone, "
           "the probes, the plain searches), 'step' every kernel of the variant. Each kernel was profiled "
           "alone by Nsight Compute with its defaults: caches flushed before it (cold L2), clocks at base.",
    "tiles": "The library's gather and scatter (gather_cuda, scatter_cuda: their top rung) of one 3x3x3 "
             "submanifold layer for every tile size (channels per thread) that Algorithm 2 tries. 'napkin' "
             "holds the bytes a kernel must move at least (notebook 05's napkin math); caches cold, clocks "
             "at base.",
    "stages": "One 3x3x3 submanifold layer, its map built (sparse_conv3d(..., dataflow='gmas') on a tensor "
              "without maps), every kernel profiled and summed by stage; GEMMs include the submanifold "
              "centre's product and the weights' copy. Caches cold and clocks at base for every kernel, so "
              "the sum is not the layer's time on a warm GPU.",
    "fig13": "Figure 13's setup (paper Section 6.2): random clouds of 10^4 to 10^6 voxels in a 400^3 box. "
             "'map': build_kernel_map(..., assume_sorted=True) by method, host and GPU ms, interleaved. "
             "'network': bench_net.py's measurement of MinkUNet42's forward pass (every map built again each "
             "call), ours beside spconv's twins with the same weights, wall clock; the paper compared with "
             "MinkowskiEngine and TorchSparse instead.",
    "fig14": "Figure 14's breakdown (paper Section 6.2) on one 3x3x3 submanifold layer instead of whole "
             "networks: the Map step (a layer's, with masks; coordinates already sorted), the metadata and "
             "the GMaS step (the map given, its plan kept) are timed alone, interleaved, and each bar adds "
             "its three parts. Baseline: the hash table, the prior engines' fixed tile, one GEMM per offset in "
             "map order; then AT (Algorithm 2's tiles), PG (offsets sorted and grouped with padding), SS "
             "(segmented queries, one plain binary search each: a lower bound of such a Map step, it counts "
             "nothing for the metadata), DTBS (Minuet's backward and forward search: the library).",
}


# --------------------------------------------------------------------------- the kernels of the probe
@cuda.jit
def ncu_counters_marker(flag, index):
    """Launched before each measurement with ``index + 1`` blocks of one thread: its grid size
    names the measurement in ncu's report (:func:`attribute`). Does nothing else."""
    if cuda.grid(1) == 0:
        flag[0] = index


@cuda.jit(device=True, inline=True)
def find(src, q):
    """The index of ``q`` in the sorted ``src`` by a lower-bound binary search, or -1: the
    one search both plain kernels below run, whatever order their queries come in."""
    lo, hi = 0, src.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if src[mid] < q:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < src.shape[0] and src[lo] == q else -1


@cuda.jit
def search_listed(src, queries, found):
    """One thread per query of a materialized list: the lower bound of ``queries[t]`` in the
    whole sorted ``src`` (notebook 03's search), ``found[t]`` its index or -1. Only the order
    of ``queries`` differs between the plain variants, so the counters show what order
    alone does to the caches."""
    t = cuda.grid(1)
    if t < queries.shape[0]:
        found[t] = find(src, queries[t])


@cuda.jit
def search_segments(src, qkeys, deltas, table):
    """Exercise 3.2's kernel: thread t takes segment ``k = t // |Q|`` and output ``i = t % |Q|``,
    makes its query ``qkeys[i] + deltas[k]`` (never stored) and searches the whole ``src``:
    segmented query sorting without the double traversal."""
    t = cuda.grid(1)
    n = qkeys.shape[0]
    if t < deltas.shape[0] * n:
        k = t // n
        i = t - k * n
        table[k, i] = find(src, qkeys[i] + deltas[k])


def _threads():
    from numba_sc.core.device import simulating

    return 32 if simulating() else 256  # the simulator runs each thread as a Python thread


# Launched through the library's launch path, as its own kernels are: Figure 14 times the plain
# search's host time beside theirs (a plain Numba launch costs the host more, see core/launch.py).
def run_listed(src, queries, found):
    """Launch :func:`search_listed` over every query."""
    from numba_sc.core.launch import launch

    launch(search_listed, int(queries.shape[0]), src, queries, found, threads=_threads())


def run_segments(src, qkeys, deltas, table):
    """Launch :func:`search_segments` over every (segment, output)."""
    from numba_sc.core.launch import launch

    launch(search_segments, int(deltas.shape[0] * qkeys.shape[0]), src, qkeys, deltas, table, threads=_threads())


# --------------------------------------------------------------------------- the clouds
def count(text: str) -> int:
    """"300", "30k", "1M", "2.5M" -> the integer."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKM]?)", text.strip())
    if not m:
        raise ValueError(f"a count is digits with an optional k or M (e.g. 300, 30k, 1M), got {text!r}")
    return int(round(float(m.group(1)) * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6}[m.group(2)]))


def _sorted_rows(coords):
    """Rows of an int32 (N, 3|4) array sorted lexicographically (as the library keeps them)."""
    import numba_sc as ns

    return np.ascontiguousarray(coords[np.argsort(ns.pack_keys(coords), kind="stable")])


def make_cloud(name: str, data) -> tuple:
    """``(sorted int32 coordinates, how it was made)`` of a named cloud:

    * ``kitti``: the SemanticKITTI scan at 0.05 m (94,444 voxels);
    * ``kitti_x<N>``: a batch of N scans: the scan turned about the sensor's vertical axis by
      ``i * 360 / N`` degrees for copy i, each copy voxelized at 0.05 m and given batch index i
      (real structure and density, N times the voxels; turned so the copies differ);
    * ``random_<n>`` / ``random_<n>_box<b>``: n distinct voxels drawn uniformly in a b^3 box
      (b = 400, the paper's Figure 13 box, unless given);
    * ``crop_<n>``: the n voxels of the scan nearest the sensor in plan view (small clouds for
      the simulator); n random voxels at 5 % density when the scan is not at hand.
    """
    import numba_sc as ns

    if name == "kitti":
        return scan_coords(find_data(data), "kitti"), "SemanticKITTI scan 000000 voxelized at 0.05 m"
    m = re.fullmatch(r"kitti_x(\d+)", name)
    if m:
        copies = int(m.group(1))
        pts, voxel = scan_points(find_data(data), "kitti")
        parts = []
        for i in range(copies):
            a = 2 * math.pi * i / copies
            xyz = pts[:, :3] @ np.array([[math.cos(a), math.sin(a), 0], [-math.sin(a), math.cos(a), 0], [0, 0, 1]],
                                        np.float32)
            c = ns.voxelize(np.ascontiguousarray(xyz, np.float32), voxel, backend="reference").coords
            parts.append(np.column_stack([np.full(len(c), i, np.int32), c]))
        return (np.ascontiguousarray(np.concatenate(parts)),  # batch by batch, each sorted: sorted
                f"a batch of {copies} SemanticKITTI scans: scan 000000 turned by i x {360 / copies:.2f} degrees "
                f"about the sensor's vertical axis for batch index i, each voxelized at {voxel} m")
    m = re.fullmatch(r"random_(\d+(?:\.\d+)?[kM]?)(?:_box(\d+))?", name)
    if m:
        n, box = count(m.group(1)), int(m.group(2) or 400)
        return (_sorted_rows(random_coords(n, box)),
                f"{n:,} distinct voxels drawn uniformly in a {box}^3 box ({100 * n / box ** 3:.2g} % of its cells)")
    m = re.fullmatch(r"crop_(\d+)", name)
    if m:
        n = int(m.group(1))
        folder = find_data(data, required=False)
        if folder is None:
            box = max(4, round((n / 0.05) ** (1 / 3)))
            return _sorted_rows(random_coords(n, box)), f"{n} random voxels in a {box}^3 box (no scan at hand)"
        c = scan_coords(folder, "kitti")
        ring = np.abs(c[:, :2]).max(axis=1)
        return (np.ascontiguousarray(c[ring <= np.sort(ring)[min(n, len(c)) - 1]]),
                f"the ~{n} voxels of the SemanticKITTI scan (0.05 m) nearest the sensor in plan view")
    raise ValueError(f"unknown cloud {name!r}: kitti, kitti_x<N>, random_<n>[_box<b>] or crop_<n> "
                     "(n as 300, 30k, 1M)")


# --------------------------------------------------------------------------- the child: what ncu profiles
def _xp():
    from numba_sc.core.device import device_xp

    return device_xp()


def sync():
    """Wait for the device (nothing to wait for under the simulator)."""
    from numba_sc.core.device import simulating

    if not simulating():
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def free_pool():
    """Give CuPy's cached blocks back to the device between clouds: ncu saves and restores the
    device's memory around each replay of a kernel, and a pool holding gigabytes of freed
    blocks from the last cloud would only make that slower."""
    from numba_sc.core.device import simulating

    if not simulating():
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def device_info() -> dict:
    """The device's name, L2 size, SM count and peak DRAM bandwidth (2 x memory clock x bus
    width, from the device attributes), for the result files' "x % of peak"."""
    from numba_sc.core.device import device_name, simulating

    if simulating():
        return {"name": device_name(), "l2_bytes": None, "dram_peak_bytes_per_s": None}
    import cupy

    dev = cupy.cuda.Device()
    attrs, props = dev.attributes, cupy.cuda.runtime.getDeviceProperties(dev.id)

    def pick(attr, prop):
        v = attrs.get(attr) or props.get(prop)
        return int(v) if v else None

    clock_khz, bus_bits = pick("MemoryClockRate", "memoryClockRate"), pick("GlobalMemoryBusWidth", "memoryBusWidth")
    return {"name": device_name(), "l2_bytes": pick("L2CacheSize", "l2CacheSize"),
            "sms": pick("MultiProcessorCount", "multiProcessorCount"), "memory_clock_khz": clock_khz,
            "bus_width_bits": bus_bits,
            "dram_peak_bytes_per_s": 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None,
            "peak_from": "2 x memory clock x bus width, from the device attributes"}


class Session:
    """The child's side of the attribution: every measurement is written to the manifest, then
    run once between ``cudaProfilerStart`` and ``cudaProfilerStop`` after the marker kernel
    (``profile=False``: run without the profiler calls, for a dry run). Past ``deadline``
    (seconds since the epoch) a measurement is recorded as skipped instead."""

    def __init__(self, manifest=None, deadline=math.inf, profile=True, say=print):
        self.entries, self.index, self.deadline, self.say = [], 0, deadline, say
        self.profile = profile
        self.file = open(manifest, "w") if manifest else None
        self.flag = _xp().zeros(1, np.int64)

    def note(self, kind, **fields):
        entry = {"kind": kind, **fields}
        self.entries.append(entry)
        if self.file:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()  # a crash later leaves every line before it

    def marker(self, index):
        ncu_counters_marker[index + 1, 1](self.flag, index)

    def expired(self) -> bool:
        return time.time() > self.deadline

    def warm(self, fn, times=2):
        """Call ``fn`` a few times before it is profiled: compiles, fills the library's caches
        (nothing in a dry run, where :meth:`measure` makes the one call, nor past the deadline)."""
        if self.profile and not self.expired():
            for _ in range(times):
                fn()
            sync()

    def measure(self, part, label, fn, **meta):
        """Profile one call of ``fn`` (already warmed up: compiled, its caches filled) as
        measurement ``label`` of ``part``; ``meta`` goes into its row."""
        if self.expired():
            self.note("skipped", part=part, label=label, why="the time budget ran out (--budget-s)")
            return
        index, self.index = self.index, self.index + 1
        self.note("measure", part=part, label=label, index=index, **meta)
        profiling = self.profile
        if profiling:
            import cupy

            sync()
            cupy.cuda.runtime.profilerStart()
        self.marker(index)
        fn()
        sync()
        if profiling:
            cupy.cuda.runtime.profilerStop()

    def close(self):
        if self.file:
            self.file.close()


def map_workloads(session, name, coords, how):
    """The Map step's variants on one cloud (:data:`VARIANTS`), each profiled once."""
    import numba_sc as ns
    from numba_sc.core.backend import to_device, to_host
    from numba_sc.map import grid_map, hash_map

    xp = _xp()
    offsets = ns.kernel_offsets(3)
    deltas = ns.key_delta(offsets)  # ascending: the segments' order
    h = (len(offsets) + 1) // 2  # the segments a symmetric submanifold layer searches (the library's)
    n = len(coords)
    keys = to_device(ns.pack_keys(coords, reach_lo=offsets.min(0), reach_hi=offsets.max(0)))
    d = to_device(np.ascontiguousarray(deltas[:h]))
    dev_coords = to_device(coords)
    km = ns.build_kernel_map(dev_coords, 3, assume_sorted=True, method="sorted")
    counts = km.host_counts()
    searched_hits = int(counts[:h].sum())  # what every variant's lookups find: the pairs of the searched half
    try:
        _, cells = grid_map.grid_box_reference(coords)
        grid = {"grid_cells": int(cells), "grid_bytes": 4 * int(cells)}
    except ValueError as e:
        grid = {"grid_cells": None, "grid_bytes": None, "grid_refused": str(e)}
    session.note("cloud", part="map", name=name, voxels=n, made=how, segments_searched=h,
                 queries=h * n, query_bytes=8 * h * n, source_key_bytes=8 * n,
                 hash_table_bytes=12 * hash_map.capacity_for(n),  # int64 key + int32 index per slot
                 pairs=int(counts.sum()), searched_pairs=searched_hits, **grid)
    session.say(f"map {name}: {n:,} voxels, {h * n:,} lookups")

    def check(found):
        """Every variant finds the same pairs: a wrong kernel would show here, not as a counter
        (noted after the measurement, which is then the call that filled ``found``)."""
        got = int(to_host((found >= 0).sum()))
        return "ok" if got == searched_hits else f"MISMATCH: {got:,} hits, the map has {searched_hits:,}"

    found = xp.empty(h * n, np.int32)
    segmented = (d[:, None] + keys[None, :]).ravel()  # segment k = sorted(Q) + delta_k, materialized
    for variant in ("unsorted", "sorted", "segmented"):
        if variant == "unsorted":
            perm = xp.argsort(xp.random.RandomState(0).random_sample(segmented.shape[0]))
            queries = segmented[perm]
            del perm
        else:
            queries = xp.sort(segmented) if variant == "sorted" else segmented
        run = lambda q=queries: run_listed(keys, q, found)  # noqa: E731
        session.warm(run, 1)
        session.measure("map", f"map {name} {variant}", run, cloud=name, variant=variant, what=VARIANTS[variant])
        session.note("check", part="map", label=f"map {name} {variant}", check=check(found))
        del queries
    del segmented, found
    table = xp.empty((h, n), np.int32)
    run = lambda: run_segments(keys, keys, d, table)  # noqa: E731
    session.warm(run, 1)
    session.measure("map", f"map {name} segmented_on_the_fly", run, cloud=name, variant="segmented_on_the_fly",
                    what=VARIANTS["segmented_on_the_fly"])
    session.note("check", part="map", label=f"map {name} segmented_on_the_fly", check=check(table))
    del table
    for variant, method in (("minuet", "sorted"), ("hash", "hash"), ("grid", "grid")):
        if method == "grid" and grid["grid_cells"] is None:  # the box is too large: the library refuses
            session.note("refused", part="map", label=f"map {name} {variant}", cloud=name, variant=variant,
                         why=grid["grid_refused"])
            continue
        run = lambda m=method: ns.build_kernel_map(dev_coords, 3, assume_sorted=True, method=m)  # noqa: E731
        session.warm(run)
        session.measure("map", f"map {name} {variant}", run, cloud=name, variant=variant, what=VARIANTS[variant])


def tile_workloads(session, name, coords, how, channels, dtypes):
    """The library's gather and scatter for every tile size, per dtype, on one cloud."""
    import numba_sc as ns
    from numba_sc.core.backend import to_device, to_host
    from numba_sc.gmas.gather import divisors, gather_cuda  # divisors: the tiles Algorithm 2 tries
    from numba_sc.gmas.gemm_grouping import product_dtype
    from numba_sc.gmas.scatter import scatter_cuda

    xp = _xp()
    dev = to_device(coords)
    km = ns.build_kernel_map(dev, 3, assume_sorted=True, masks=True)  # what a layer builds
    plan = ns.build_plan(km)
    written = int(sum(int(plan.counts[k]) for k in plan.order))  # buffer rows the gather writes
    # The input rows the gather reads at least: the points with a pair at a buffered offset
    # (on a sparse cloud most points have none outside the centre, and the gather skips them).
    lists = plan.in_lists
    masks, buffered = np.asarray(to_host(lists.masks)), np.asarray(to_host(lists.buffered))
    read = int(np.any((masks & buffered[:, None]) != 0, axis=0).sum())
    n = len(coords)
    session.note("cloud", part="tiles", name=name, voxels=n, made=how, buffer_rows=int(plan.rows),
                 written_rows=written, read_rows=read, outputs=int(plan.n_out))
    session.say(f"tiles {name}: {n:,} voxels, {written:,} buffer rows")
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        dt = np.dtype(dtype)
        f = to_device(rng.standard_normal((n, channels)).astype(dt))
        pdt = np.dtype(product_dtype(dt))
        obuf = xp.zeros((plan.rows, channels), pdt)
        napkin = {  # the bytes each kernel must move at least (notebook 05): reads, then writes
            "gather": read * channels * dt.itemsize + written * channels * dt.itemsize,
            "scatter": written * channels * pdt.itemsize + plan.n_out * channels * dt.itemsize,
        }
        for tile in divisors(channels):
            calls = {"gather": lambda t=tile: gather_cuda(f, plan.in_lists, plan.rows, t),
                     "scatter": lambda t=tile: scatter_cuda(obuf, plan.out_lists, None, plan.n_out, channels, dt, t)}
            for stage, run in calls.items():
                session.warm(run, 1)
                session.measure("tiles", f"{stage} {name} {dt.name} T={tile}", run, cloud=name, stage=stage,
                                dtype=dt.name, channels=channels, tile=tile, napkin_bytes=int(napkin[stage]))


def stage_workloads(session, name, coords, how, channels, dtype="float32"):
    """One whole layer with its map built, every kernel profiled (summed by stage later)."""
    import numba_sc as ns
    from numba_sc.core.backend import to_device

    rng = np.random.default_rng(0)
    x = ns.SparseTensor(to_device(coords), to_device(rng.standard_normal((len(coords), channels)).astype(dtype)))
    w = to_device((rng.standard_normal((27, channels, channels)) / np.sqrt(channels)).astype(dtype))
    session.note("cloud", part="stages", name=name, voxels=len(coords), made=how)
    run = lambda: ns.sparse_conv3d(x.without_maps(), w, 3, dataflow="gmas")  # noqa: E731
    session.warm(run, 3)
    session.measure("stages", f"layer {name} {channels}->{channels} {dtype}", run, cloud=name,
                    layer=f"{channels}->{channels} {dtype}", what="sparse_conv3d(x.without_maps(), w, 3, "
                    "dataflow='gmas'): the Map step (with masks), metadata, centre product, gather, GEMMs, scatter")


def run_workloads(args, session):
    """Every counters workload the arguments ask for (the child's work, or a dry run's). A
    cloud whose workloads fail (out of memory, ...) is recorded as failed; the others run."""
    data = None if args.tiny else find_data(args.data)
    session.note("device", device=device_info())
    session.marker(0)  # compiled now, never inside a profiled range
    sync()
    plan = [("map", args.map_clouds, lambda name, c, how: map_workloads(session, name, c, how)),
            ("tiles", args.tile_clouds, lambda name, c, how: tile_workloads(session, name, c, how, args.channels,
                                                                           args.dtypes)),
            ("stages", args.stage_clouds, lambda name, c, how: stage_workloads(session, name, c, how, args.channels))]
    for part, clouds, work in plan:
        if part not in args.parts:
            continue
        for name in clouds:
            if session.expired():  # not even the cloud is made
                session.note("skipped", part=part, label=f"{part} {name}", cloud=name,
                             why="the time budget ran out (--budget-s)")
                continue
            try:
                coords, how = make_cloud(name, data)
                work(name, coords, how)
                free_pool()
            except Exception as e:  # noqa: BLE001 - a one-shot run records what failed and goes on
                if not args.dry_run and session.profile:
                    import cupy

                    cupy.cuda.runtime.profilerStop()  # (a failure inside a measurement left it on)
                session.note("failed", part=part, label=f"{part} {name}", cloud=name, why=repr(e))
                session.say(f"{part} {name} failed: {e!r}")
                if args.dry_run:
                    raise


# --------------------------------------------------------------------------- the timed parts
def prior_fixed_tile() -> int:
    """The tile the prior engines fix (paper Appendix A.1, as notebook 11 reads it: channels)."""
    from numba_sc.tools import results

    return int(results.row(results.load("paper")["figures"], id="prior_fixed_tile")["value"])


def ideas_components(coords, channels=64, dtype="float32"):
    """Figure 14 on one layer: ``(components, bars, tiles)``. ``components``: name -> call, each
    timed alone; ``bars``: (name, what it adds, [component names]), the ideas switched on one
    after the other; ``tiles``: the fixed and the autotuned tiles."""
    import numba_sc as ns
    from numba_sc.core.backend import to_device
    from numba_sc.gmas import gemm_grouping as gg

    xp = _xp()
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    x = ns.SparseTensor(to_device(coords), to_device(rng.standard_normal((len(coords), channels)).astype(dt)))
    w = to_device((rng.standard_normal((27, channels, channels)) / np.sqrt(channels)).astype(dt))
    offsets = ns.kernel_offsets(3)
    h = (len(offsets) + 1) // 2
    keys = to_device(ns.pack_keys(coords, reach_lo=offsets.min(0), reach_hi=offsets.max(0)))
    d = to_device(np.ascontiguousarray(ns.key_delta(offsets)[:h]))
    table = xp.empty((h, len(coords)), np.int32)

    def layer_map(method):
        return ns.build_kernel_map(x.coords, 3, assume_sorted=True, method=method, masks=True)

    # One map per GMaS variant: each keeps the plan of its own grouping policy (conv/prepare.py).
    maps = {v: layer_map("sorted") for v in ("fixed", "at", "at+pg")}
    fixed = prior_fixed_tile()
    fixed = fixed if channels % fixed == 0 else 1
    tuned = ns.autotune(x, w, 3, kernel_map=maps["at+pg"])  # Algorithm 2 (the heuristic under the simulator)
    at = (tuned.gather, tuned.scatter)
    no_pg = dict(sort_offsets=False, max_padding=0.0, launch_rows=0)  # map order, no padding: ~one GEMM per offset
    priced = gg.launch_rows(channels, channels, dt.itemsize)  # what sparse_conv3d prices a launch at

    def gmas(variant, tiles, policy):
        return lambda: ns.sparse_conv3d(x, w, 3, kernel_map=maps[variant], dataflow="gmas", tile_size=tiles, **policy)

    components = {
        "map: hash table": lambda: layer_map("hash"),
        "map: segmented queries, a plain binary search each": lambda: run_segments(keys, keys, d, table),
        "map: Minuet's double-traversed search": lambda: layer_map("sorted"),
        "metadata: map order, no padding": lambda: ns.build_plan(maps["fixed"], sort=False, max_padding=0.0,
                                                                 launch_rows=0),
        "metadata: sorted offsets, padded groups": lambda: ns.build_plan(maps["at+pg"], launch_rows=priced),
        "GMaS: fixed tile, one GEMM per offset": gmas("fixed", fixed, no_pg),
        "GMaS: autotuned tiles, one GEMM per offset": gmas("at", at, no_pg),
        "GMaS: autotuned tiles, grouped GEMMs": gmas("at+pg", at, {}),
    }
    hash_map, ss, dtbs, meta0, meta1, g0, g1, g2 = components
    bars = [("baseline", "hash table, fixed tile, one GEMM per offset", [hash_map, meta0, g0]),
            ("+AT", "autotuned gather/scatter tiles", [hash_map, meta0, g1]),
            ("+PG", "padding-efficient GEMM grouping", [hash_map, meta1, g2]),
            ("+SS", "segmented query sorting (sorted array, plain binary search)", [ss, meta1, g2]),
            ("+DTBS", "double-traversed binary search: Minuet, the library", [dtbs, meta1, g2])]
    return components, bars, {"fixed": fixed, "autotuned": list(at), "autotuned_from": tuned.source}


def fig13_map_calls(coords):
    """Figure 13's Map step contenders on one cloud: the library's three methods."""
    import numba_sc as ns
    from numba_sc.core.backend import to_device

    dev = to_device(coords)
    return {m: (lambda m=m: ns.build_kernel_map(dev, 3, assume_sorted=True, method=m))
            for m in ("sorted", "hash", "grid")}


def fig13_network(net, coords, args):
    """MinkUNet42 (or ResNet21) forward on one cloud beside spconv's twins: bench_net.py's run
    (outputs compared, then timed interleaved), or ours alone when spconv does not import."""
    import bench_net

    feats = np.random.default_rng(1).standard_normal((len(coords), 4)).astype(np.float32)
    try:
        import spconv.pytorch  # noqa: F401 - the peers are there?
    except Exception as e:  # noqa: BLE001 - no torch or spconv on this machine: ours alone
        import cupy

        import numba_sc as ns

        model = bench_net.build_ours(net, 4).cuda()
        x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(feats))
        t = bench_net.wall_interleaved({"numba-sc": lambda: model(x.without_maps())}, 2, args.net_reps, args.block)
        return {"net": net, "n": len(coords), "dtype": "float32", "network": t, "peers": f"not run: {e!r}"}
    scratch = Path(tempfile.gettempdir()) / "ncu_counters_net.json"  # run_one writes its record there as it goes
    opts = argparse.Namespace(reps=args.net_reps, warmup=2, block=args.block, diagnose=False, compare_lazy=False,
                              layers=False, layer_reps=0, out=str(scratch))
    out = {"runs": []}
    bench_net.run_one(net, f"random_{len(coords)}", coords, feats, ["float32"], opts, out)
    bench_net.free_memory()
    return out["runs"][0]


def timed(contenders, args):
    """``common.interleaved`` with host (wall) and GPU (CUDA events) ms: name -> {host_ms, gpu_ms}."""
    t = interleaved(contenders, args.rounds, block=args.block, warmup=3, timers=HOST_THEN_GPU)
    return {k: {"host_ms": v["host_ms"], "gpu_ms": v["gpu_ms"]} for k, v in t.items()}


def run_fig14(args, deadline, data, dry=False, say=print):
    """Figure 14's record (None in a dry run: every component is called once instead)."""
    clouds = {}
    for name in args.idea_clouds:
        if time.time() > deadline:
            clouds[name] = {"skipped": "the time budget ran out (--budget-s)"}
            continue
        coords, how = make_cloud(name, data)
        components, bars, tiles = ideas_components(coords, args.channels)
        if dry:
            for fn in components.values():
                fn()
            continue
        t = timed(components, args)
        out_bars = [{"name": b, "adds": adds, "parts": parts, "host_ms": sum(t[p]["host_ms"] for p in parts),
                     "gpu_ms": sum(t[p]["gpu_ms"] for p in parts)} for b, adds, parts in bars]
        clouds[name] = {"voxels": len(coords), "made": how, "tiles": tiles, "components": t, "bars": out_bars}
        base = out_bars[0]["host_ms"]
        say(f"fig14 {name}: " + "  ".join(f"{b['name']} {base / b['host_ms']:.2f}x" for b in out_bars)
            + " (baseline's host time / each)")
    if dry:
        return None
    return {"recorded": recorded(args.note), "device": device_info(), "about": ABOUT["fig14"],
            "layer": f"3x3x3 submanifold, {args.channels}->{args.channels} float32", "clouds": clouds}


def run_fig13(args, deadline, dry=False, say=print):
    """Figure 13's record (None in a dry run)."""
    rows = []
    for n in args.fig13_sizes:
        if time.time() > deadline:
            rows.append({"n": n, "skipped": "the time budget ran out (--budget-s)"})
            continue
        coords = _sorted_rows(random_coords(n, args.box))
        calls = fig13_map_calls(coords)
        if dry:
            for fn in calls.values():
                fn()
            continue
        row = {"n": n, "voxels": len(coords), "density_pct": 100 * len(coords) / args.box ** 3,
               "map": timed(calls, args)}
        line = f"fig13 {n:>9,}: map " + " ".join(f"{m} {v['gpu_ms']:.3f}" for m, v in row["map"].items()) + " GPU ms"
        for net in args.fig13_nets:
            if time.time() > deadline:
                row.setdefault("skipped", []).append(net)
                continue
            try:
                run = fig13_network(net, coords, args)
                row.setdefault("networks", []).append(run)
                line += f" | {net} " + " ".join(f"{k} {v['ms']:.1f}" for k, v in run.get("network", {}).items()) + " ms"
            except Exception as e:  # noqa: BLE001 - one failure is recorded, the sweep goes on
                row.setdefault("networks", []).append({"net": net, "error": repr(e)})
        rows.append(row)
        say(line)
    if dry:
        return None
    return {"recorded": recorded(args.note), "device": device_info(), "about": ABOUT["fig13"], "box": args.box,
            "rows": rows}


# --------------------------------------------------------------------------- the parent: ncu, then the timing
# A process of two CuPy kernels: what ncu profiles to learn which metrics it can measure here.
TRIAL = "import cupy; a = cupy.arange(1 << 16, dtype=cupy.float32); float((a + 1).sum())"


def usable_metrics(ncu, say=print, env=None):
    """The metrics of :data:`METRICS` this ncu measures on this GPU, learnt by profiling a
    process of two CuPy kernels with all of them (seconds, where a failure of the long run
    would cost minutes). A metric ncu's errors name is left out, loudly, and the trial runs
    again without it; ncu's ``==ERROR==`` lines are printed when they name none of ours.
    Returns None when not even ``gpu__time_duration.sum`` can be measured."""
    wanted = list(METRICS.values())
    required = [METRICS[r] for r in REQUIRED]
    while True:
        try:
            trial = subprocess.run([ncu, "--csv", "--metrics", ",".join(wanted), sys.executable, "-c", TRIAL],
                                   capture_output=True, text=True, env=env, timeout=180)
        except subprocess.TimeoutExpired:
            say("ncu's trial of two kernels took over 3 minutes: giving up on the counters")
            return None
        text = trial.stdout + trial.stderr
        errors = [line for line in text.splitlines() if "==ERROR==" in line]
        named = [m for m in wanted if any(m in line or _base(m) in line for line in errors)]
        if trial.returncode == 0 and not errors:
            break
        if not named:
            say("ncu failed on a trial of two kernels:\n  " + "\n  ".join(errors or text.splitlines()[-10:]))
            return None
        for m in named:
            say(f"  ncu cannot measure {m} here (its error: {next(e for e in errors if _base(m) in e).strip()}); "
                "left out (`ncu --query-metrics` lists this GPU's metrics)")
        wanted = [m for m in wanted if m not in named]
        if any(m not in wanted for m in required):
            return None
    try:
        seen = {name for k in parse_ncu_csv(trial.stdout) for name in k["metrics"]}
    except NcuOutputError:
        return wanted  # no table to read: let the long run's own output decide
    for m in [m for m in wanted if m not in seen]:
        say(f"  ncu printed no value of {m} in the trial: left out")
    return [m for m in wanted if m in seen] if any(m in seen for m in required) else None


def _base(metric):
    return metric.split(".", 1)[0]


def ncu_version(ncu):
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
        return out.strip().splitlines()[-1] if out.strip() else None
    except Exception:  # noqa: BLE001
        return None


def _child_argv(argv, manifest, deadline):
    """This run's own arguments, for the child, with the child's."""
    return [*argv, "--child", "--manifest", str(manifest), "--deadline", f"{deadline:.0f}"]


def record_counters(args, argv, deadline, say=print) -> dict:
    """Run the counters parts under ncu and read its report: {file name: record}."""
    ncu = shutil.which(args.ncu) or (args.ncu if Path(args.ncu).exists() else None)
    if ncu is None:
        say(f"ncu ({args.ncu}) not found: the counters are not recorded (Nsight Compute; --ncu PATH)")
        return {}
    env = dict(os.environ, LC_ALL="C")  # numbers printed the C way ("1,234.5")
    metrics = usable_metrics(ncu, say, env)
    if metrics is None:
        say("the counters are not recorded (ncu cannot measure gpu__time_duration.sum here)")
        return {}
    work = Path(tempfile.mkdtemp(prefix="ncu_counters_"))
    report = Path(args.report) if args.report else work / "ncu_counters"
    manifest, log = work / "manifest.jsonl", work / "ncu.log"
    cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(metrics), "--export", str(report),
           "--force-overwrite", "--log-file", str(log), sys.executable, str(Path(__file__).resolve()),
           *_child_argv(argv, manifest, deadline)]
    say(f"ncu: {len(metrics)} metrics; the child's workloads follow (ncu's log: {log})")
    rc = subprocess.run(cmd, env=env).returncode
    text = log.read_text(errors="replace") if log.exists() else ""
    if rc != 0:
        errors = [line for line in text.splitlines() if "==ERROR==" in line] or text.splitlines()[-15:]
        say(f"ncu exited with {rc}:\n  " + "\n  ".join(errors) +
            "\n  (a metric name it does not know? `ncu --query-metrics` lists this device's; --ncu PATH)")
    rep = Path(str(report) + ".ncu-rep")
    if not rep.exists():
        say(f"no report at {rep}: nothing to read")
        return {}
    csv_text = ""
    # metric names, not labels, and base units; an older ncu may not take these options
    for options in (["--print-units", "base", "--print-metric-name", "name"], ["--print-units", "base"], []):
        exp = subprocess.run([ncu, "--import", str(rep), "--csv", "--page", "details", *options],
                             capture_output=True, text=True, env=env)
        if exp.returncode == 0 and '"ID"' in exp.stdout:
            csv_text = exp.stdout
            break
    try:
        kernels = parse_ncu_csv(csv_text or exp.stdout + exp.stderr)
    except NcuOutputError as e:
        say(f"could not read ncu's report {rep}: {e}")
        return {}
    if not any(m in k["metrics"] for k in kernels for m in metrics):
        say(f"ncu's CSV names none of the metrics asked for (labels instead of names?); its first kernel: "
            f"{kernels[0] if kernels else None}")
    entries = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    rec = recorded(args.note)
    rec["ncu"] = {"version": ncu_version(ncu), "metrics": metrics, "report": str(rep) if args.report else None,
                  "command": " ".join(["ncu", *cmd[1:cmd.index(sys.executable)], "python3",
                                       "benchmarks/probes/ncu_counters.py", "--child", "..."]),
                  "defaults": "--replay-mode kernel, --cache-control all (caches flushed before every profiled "
                              "kernel), --clock-control base (clocks locked to base)",
                  "exit_code": rc}
    return build_records(kernels, entries, rec)


def say_counters(records, say=print):
    """One short line per measurement."""
    for fname, r in records.items():
        for row in r["rows"]:
            agg = row.get("query") or row.get("total") or row.get("step")
            if not agg:
                say(f"  {row['label']}: {row.get('error', 'no counters')}")
                continue

            def pct(v):
                return f"{v:5.1f} %" if v is not None else "    - "

            mb = f"{agg['dram_bytes'] / 1e6:8.2f} MB" if agg["dram_bytes"] is not None else "       - MB"
            us = f"{agg['time_ns'] / 1e3:9.1f} us" if agg["time_ns"] is not None else ""
            say(f"  {row['label']:44s} L2 hit {pct(agg['l2_hit_pct'])}  L1 hit {pct(agg['l1_hit_pct'])}  "
                f"DRAM {mb} {us}  DRAM {pct(agg['dram_pct_peak'])} of peak"
                + (f"  [{row['check']}]" if row.get("check", "ok") != "ok" else ""))


def write_record(out_dir, fname, record, say=print):
    from numba_sc.core.files import write_text

    path = write_text(Path(out_dir) / fname, json.dumps(record, indent=1), name="--out-dir")
    say(f"wrote {path}")


# --------------------------------------------------------------------------- the command line
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    listed = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--parts", type=listed, default=list(PARTS),
                    help=f"which parts, in the order they run: {','.join(PARTS)} (default: all)")
    ap.add_argument("--map-clouds", type=listed,
                    default=listed("crop_20000,kitti,kitti_x12,kitti_x56,random_1M,random_5M_box640"),
                    help="crop_20000 is notebook 03's region of the scan, where its LRU model runs")
    ap.add_argument("--tile-clouds", type=listed, default=listed("kitti,random_1M"))
    ap.add_argument("--stage-clouds", type=listed, default=listed("kitti,random_1M"))
    ap.add_argument("--idea-clouds", type=listed, default=listed("kitti,random_1M"))
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--dtypes", type=listed, default=listed("float32,float16"))
    ap.add_argument("--fig13-sizes", type=lambda s: [count(v) for v in listed(s)],
                    default=[10_000, 30_000, 100_000, 300_000, 1_000_000])
    ap.add_argument("--fig13-nets", type=listed, default=listed("unet42"), help="networks of the sweep ('' for none)")
    ap.add_argument("--box", type=int, default=400, help="Figure 13's box (the paper's: 400)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds of the timed parts")
    ap.add_argument("--block", type=int, default=3, help="timed calls per contender and round")
    ap.add_argument("--net-reps", type=int, default=6, help="timed network calls per contender")
    ap.add_argument("--budget-s", type=float, default=330,
                    help="seconds for the whole command: the counters may start measurements until 60 %% of it, "
                         "the timed parts until its end; what is left is recorded as skipped")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--ncu", default="ncu", help="the Nsight Compute command line")
    ap.add_argument("--report", default=None, help="where ncu's report is kept (default: a temporary folder)")
    ap.add_argument("--note", default="", help="what code this measures, in words (recorded)")
    ap.add_argument("--tiny", action="store_true",
                    help="a crop of ~150 voxels for every part, 8 channels, fp32, no network (for --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run every workload and contender once here: no ncu, no timing, no file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--manifest", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; the parts are {','.join(PARTS)}")
    if args.tiny:
        args.map_clouds = args.tile_clouds = args.stage_clouds = args.idea_clouds = ["crop_120"]
        args.channels, args.dtypes, args.fig13_sizes, args.fig13_nets, args.box = 8, ["float32"], [100], [], 10
    for dt in args.dtypes:
        if dt not in ("float32", "float16"):
            ap.error(f"--dtypes: float32 or float16, got {dt!r}")
    return args


def main(argv=None, say=print):
    """The command (see the module docstring): the child's workloads under ncu (``--child``),
    a dry run (returns its :class:`Session`), or the whole record: the counters under ncu,
    then Figures 14 and 13 timed in this process, each file written as its part ends."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:  # under ncu: the counters' workloads, nothing else
        session = Session(args.manifest, args.deadline, say=say)
        try:
            run_workloads(args, session)
        finally:
            session.close()
        return None
    t0 = time.time()
    if args.dry_run:  # every workload and contender once, here: what the tests run under the simulator
        session = Session(None, profile=False, say=say)
        run_workloads(args, session)
        data = None if args.tiny else find_data(args.data)
        if "fig14" in args.parts:
            run_fig14(args, math.inf, data, dry=True, say=say)
        if "fig13" in args.parts:
            run_fig13(args, math.inf, dry=True, say=say)
        say(f"dry run: {session.index} measurements would be profiled "
            f"({sum(e['kind'] == 'refused' for e in session.entries)} refused), in {time.time() - t0:.0f} s")
        return session
    from numba_sc.core.device import gpu_present

    if not gpu_present():
        raise SystemExit("ncu_counters.py records GPU counters and times: run it on the GPU machine "
                         "(or with --dry-run --tiny to try its workloads under the simulator)")
    from numba_sc.core.files import check_writable

    check_writable(Path(args.out_dir) / FILES["map"], "--out-dir")
    counters = [p for p in args.parts if p in NCU_PARTS]
    if counters:
        records = record_counters(args, argv, t0 + 0.6 * args.budget_s, say)
        say_counters(records, say)
        for fname, rec in records.items():
            write_record(args.out_dir, fname, rec, say)
    data = None
    if "fig14" in args.parts:
        data = find_data(args.data)
        write_record(args.out_dir, FILES["fig14"], run_fig14(args, t0 + args.budget_s - 20, data, say=say), say)
    if "fig13" in args.parts:
        write_record(args.out_dir, FILES["fig13"], run_fig13(args, t0 + args.budget_s - 10, say=say), say)
    say(f"done in {time.time() - t0:.0f} s")
    return None


if __name__ == "__main__":
    main()
