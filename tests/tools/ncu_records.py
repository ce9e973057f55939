"""What the tests of the counters share: the probe (``benchmarks/probes/ncu_counters.py``,
imported by its path), Nsight Compute's CSV as it prints it, and the five result files of a
synthetic run made through the probe's own code (so the reading helpers are tested on the
format the probe writes, not on a copy of it).

The synthetic run: the probe's workloads run once under the simulator on a crop of the scan
(``--dry-run --tiny``), which gives the real manifest of measurements; each measurement then
gets made-up kernels (a marker, then kernels named as ncu names the library's) with made-up
counters, printed as ncu's CSV, read back by the probe's parser and filed by its
:func:`build_records`. Figures 13 and 14 run the probe's own record builders with the timer
replaced by made-up times.
"""
import functools
import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE_PATH = ROOT / "benchmarks" / "probes" / "ncu_counters.py"

# ncu's details page, as `ncu --import REPORT --csv --page details` prints it (2023.x on)
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name",'
          '"Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"')
# the unit each metric is printed in without --print-units base, and the factor from base units
PRINTED = {"gpu__time_duration.sum": ("usecond", 1e-3), "lts__t_sector_hit_rate.pct": ("%", 1.0),
           "lts__t_sectors.sum": ("sector", 1.0), "l1tex__t_sector_hit_rate.pct": ("%", 1.0),
           "dram__bytes_read.sum": ("Mbyte", 1e-6), "dram__bytes_write.sum": ("Kbyte", 1e-3),
           "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", 1.0)}
H100 = {"name": "NVIDIA H100 80GB HBM3", "l2_bytes": 52_428_800, "sms": 132, "memory_clock_khz": 2_619_000,
        "bus_width_bits": 5120, "dram_peak_bytes_per_s": 2 * 2_619_000e3 * 5120 / 8}


def probe():
    """The probe script as a module (imported once)."""
    name = "ncu_counters_probe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PROBE_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def details_csv(kernels) -> str:
    """ncu's details-page CSV of ``kernels`` ``[(name, grid x, {metric: value in base units})]``,
    with ncu's own lines before it, its units (not base) and its thousands separators."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             "==PROF== Disconnected from process 4242", HEADER]
    for i, (name, grid, metrics) in enumerate(kernels):
        for metric, value in metrics.items():
            unit, scale = PRINTED[metric]
            lines.append(f'"{i}","4242","python3.12","127.0.0.1","{name}","1","7","(256, 1, 1)","({grid}, 1, 1)",'
                         f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value * scale:,.4f}",'
                         '"","","","",""')
    return "\n".join(lines) + "\n"


def counters(seed: int, sectors=1000.0) -> dict:
    """Made-up but plausible counters of one kernel (base units), different per ``seed``."""
    return {"gpu__time_duration.sum": 10_000.0 + 1000 * seed, "lts__t_sector_hit_rate.pct": 50.0 + seed % 50,
            "lts__t_sectors.sum": sectors + seed, "l1tex__t_sector_hit_rate.pct": 20.0 + seed % 70,
            "dram__bytes_read.sum": 1e6 * (1 + seed), "dram__bytes_write.sum": 2e5 * (1 + seed),
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": 10.0 + seed % 80}


# The kernels ncu would list for each kind of measurement, named as ncu names them.
FWD = ("cudapy::numba_sc::map::forward_search::forward_search_v4::<locals>::forward_search[abi:v1,cw51cXTLSUwv1sDU]"
       "(Array<long long, 1, C, mutable, aligned>)")
KERNELS = {
    "unsorted": ["search_listed"], "sorted": ["search_listed"], "segmented": ["search_listed"],
    "segmented_on_the_fly": ["search_segments"],
    "minuet": ["pack_kernel", "backward_search_v2", FWD],
    "hash": ["pack_kernel", "cupy_fill", "insert_kernel", "probe_kernel::<locals>::probe"],
    "grid": ["pack_kernel", "extremes_kernel", "cupy_fill", "fill_kernel", "probe_kernel::<locals>::probe"],
    "gather": ["gather_v3_kernel"], "scatter": ["scatter_v3_kernel"],
    "layer": ["pack_kernel", "backward_search_v2", FWD, "metadata_v2_kernel", "sm90_xmma_gemm_f32f32_tf32f32",
              "gather_v3_kernel", "take_weights_kernel", "sm90_xmma_gemm_f32f32_tf32f32", "scatter_v3_kernel",
              "cupy_copy__float32_float32"],
}


def kernels_of(entry) -> list:
    """The made-up kernels ncu would have profiled for one manifest entry."""
    if entry["part"] == "map":
        return KERNELS[entry["variant"]]
    if entry["part"] == "tiles":
        return KERNELS[entry["stage"]]
    return KERNELS["layer"]


@functools.lru_cache(maxsize=None)
def dry_run():
    """The probe's ``--dry-run --tiny`` session (simulator): its manifest entries."""
    return probe().main(["--dry-run", "--tiny", "--parts", "map,tiles,stages"], say=lambda *a: None)


def synthetic_csv(entries, drop=()) -> str:
    """ncu's CSV for the measurements of ``entries``: a marker (grid = index + 1), then each one's
    kernels; the measurements whose index is in ``drop`` lose their kernels (ncu failed on them)."""
    kernels, seed = [], 0
    for e in entries:
        if e["kind"] != "measure":
            continue
        kernels.append(("cudapy::__main__::ncu_counters_marker[abi:v1]", e["index"] + 1,
                        {"gpu__time_duration.sum": 1500.0}))
        if e["index"] in drop:
            continue
        for name in kernels_of(e):
            seed += 1
            kernels.append((name, 100 + seed, counters(seed)))
    return details_csv(kernels)


def fake_timed(contenders, args):
    """Made-up host and GPU ms per contender, in the format of the probe's ``timed``."""
    return {k: {"host_ms": 0.1 * (i + 1), "gpu_ms": 0.05 * (i + 1)} for i, k in enumerate(contenders)}


@functools.lru_cache(maxsize=None)
def synthetic_records() -> dict:
    """{file name: record} of the five files of a synthetic run (see the module docstring).
    Returns the same dicts each call: copy before changing them."""
    p = probe()
    entries = [dict(e, device=H100) if e["kind"] == "device" else e for e in dry_run().entries]
    rec = {"device": H100["name"], "date": "2026-11-28", "command": "python3 benchmarks/probes/ncu_counters.py",
           "code": "synthetic"}
    out = p.build_records(p.parse_ncu_csv(synthetic_csv(entries)), entries, rec)
    args = p.parse_args(["--tiny"])
    saved = p.timed
    p.timed = fake_timed
    try:
        out[p.FILES["fig14"]] = p.run_fig14(args, math.inf, None, say=lambda *a: None)
        out[p.FILES["fig13"]] = p.run_fig13(args, math.inf, say=lambda *a: None)
    finally:
        p.timed = saved
    return out


__all__ = ["H100", "HEADER", "PRINTED", "counters", "details_csv", "dry_run", "probe", "synthetic_csv",
           "synthetic_records"]
