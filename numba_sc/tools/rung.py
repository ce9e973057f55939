"""``numba-sc ladder STAGE --rung vN``: one rung of a ladder, run the way llm.c's ``dev/cuda`` runs a kernel.

llm.c keeps every version of a kernel side by side and runs any one of them by
number: its check against the CPU reference, its time, and the napkin math of the
bytes it must move. ``numba-sc ladder gather --rung v2`` does the same for one rung
of a stage's ladder (:mod:`numba_sc.core.rungs`), in four parts:

1. **the code**: the rung's kernel as written (or the kernel factory, or the host
   function that launches its kernels: the object the ladder names ``gather_v2``)
   and the unified diff from the rung below (:mod:`numba_sc.tools.lesson`);
2. **the check**: the rung's result against the stage's NumPy reference, on a crop
   under the simulator or on the whole scan on a GPU, and whether the difference is
   within the ladder's tolerance (the command exits 1 when it is not);
3. **the time**, on a GPU: the rung and the rung below, in interleaved rounds, the
   median GPU time between CUDA events (:func:`numba_sc.tools.ladder.time_rungs`),
   beside the recorded time of the same rung and dtype
   (:data:`numba_sc.tools.ladder.RECORDED_LADDERS`, whose device, cloud and channel
   count are printed: the reader's run may differ in all three). Without a GPU the
   kernels run under the simulator, whose times say nothing about a GPU: the
   recorded figure alone;
4. **the napkin math**: the bytes the stage must move at least (the ladder's
   ``bytes_moved``) and, for a dataflow, the arithmetic it must do (``flops``),
   each over the device's peak: the time no rung can beat, the bound (memory or
   arithmetic) being the larger. On a GPU the peaks are the device's own
   (:func:`device_peaks`) and the rung's measured time gives the bandwidth it
   achieved; without one, a reference device's (:data:`REFERENCE`).

``--break B,T`` runs the check under :func:`numba_sc.tools.breakpoints.stop_in`:
pdb opens inside the rung's kernel at block B, thread T (simulator only).
"""
from __future__ import annotations

import bdb
import dataclasses
import importlib
from dataclasses import dataclass

from ..core.device import device_name, gpu_present, simulating
from . import breakpoints, lesson
from .ladder import CHANNEL_FREE, Context, agreement, agrees, ladder_modules, ladders, recorded_rows, time_rungs

__all__ = ["Peaks", "REFERENCE", "break_target", "device_peaks", "napkin", "peaks_from_attributes", "run_rung",
           "timed_rows"]


@dataclass(frozen=True)
class Peaks:
    """A device's peaks: DRAM bandwidth (bytes/s) and FP32 arithmetic on its CUDA cores
    (FLOP/s), and where they were read (``source``)."""

    device: str
    bandwidth: float
    flops: float
    source: str


# FP32 multiply-adds per clock per SM, by compute capability, where they are not 128
# (the CUDA C++ Programming Guide's table of arithmetic instruction throughput: Volta,
# Turing and the A100 have 64 FP32 lanes an SM; Pascal's GP10x, Ampere's GA10x, Ada,
# Hopper and Blackwell 128).
FP32_LANES = {(6, 0): 64, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64}


def peaks_from_attributes(device, memory_clock_khz, bus_width_bits, sms, clock_khz, capability, source) -> Peaks:
    """The peaks from what CUDA reports of a device (``cudaDevAttr*``): its memory clock
    and bus width, its SM count, clock and compute capability (a (major, minor) pair)."""
    # DRAM transfers on both edges of its clock (double data rate): two bus-widths a cycle
    bandwidth = 2 * memory_clock_khz * 1e3 * bus_width_bits / 8
    # every FP32 lane retires one multiply-add (2 flops) a cycle
    flops = 2 * FP32_LANES.get(tuple(capability), 128) * sms * clock_khz * 1e3
    return Peaks(device, bandwidth, flops, source)


# The reference device without a GPU: the one that recorded ladder_all_kitti.json, as
# CUDA describes it (an H100 SXM5: 2619 MHz memory clock, a 5120-bit bus, 132 SMs at up
# to 1980 MHz, compute capability 9.0; deviceQuery's reading). That gives the peaks of
# NVIDIA's H100 datasheet, 3.35 TB/s and 67 TFLOP/s FP32 (typed: the datasheet's peaks)
REFERENCE = peaks_from_attributes("NVIDIA H100 80GB HBM3", 2_619_000, 5120, 132, 1_980_000, (9, 0),
                                  "no GPU here: the device that recorded ladder_all_kitti.json, as CUDA "
                                  "reports it")


def device_peaks() -> Peaks | None:
    """This GPU's peaks, read from its attributes through CuPy (memory clock, bus width,
    SMs, clock, compute capability); None when they cannot be read."""
    import cupy

    try:
        dev = cupy.cuda.Device()
        a = dev.attributes
        cc = dev.compute_capability  # "90"
        return peaks_from_attributes(device_name(), a["MemoryClockRate"], a["GlobalMemoryBusWidth"],
                                     a["MultiProcessorCount"], a["ClockRate"], (int(cc[:-1]), int(cc[-1])),
                                     "this GPU's attributes: memory clock x bus width, SMs x clock")
    except (KeyError, ValueError, cupy.cuda.runtime.CUDARuntimeError):
        return None


def _size(n: float) -> str:
    """Bytes, in the unit that reads best."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} bytes"


def _time(us: float) -> str:
    """Microseconds, or nanoseconds below one (a crop's napkin time)."""
    return f"{us * 1e3:.3g} ns" if us < 1 else f"{us:.3g} us"


def napkin(ladder, work, peaks: Peaks, gpu_us=None) -> tuple:
    """The napkin math of ``ladder``'s stage on ``work``: ``(numbers, lines)``.

    ``numbers``: ``bytes`` (the ladder's ``bytes_moved``), ``memory_us`` (those bytes at
    the peak bandwidth), ``flops`` and ``arithmetic_us`` (for a ladder that declares
    ``flops``), ``bound`` (``"memory"`` or ``"arithmetic"``, whichever takes longer) and,
    given the rung's measured ``gpu_us``, ``achieved_gbs`` and ``fraction`` (of the
    bound's time the rung needs: bound time / measured time). ``lines``: the same, said."""
    if ladder.bytes_moved is None:
        return {}, [f"napkin math: none declared for {ladder.stage} (Ladder.bytes_moved)"]
    nbytes = int(ladder.bytes_moved(work))
    out = {"bytes": nbytes, "memory_us": nbytes / peaks.bandwidth * 1e6, "bound": "memory"}
    lines = [f"napkin math ({peaks.device}: {peaks.source}):",
             f"  memory: at least {_size(nbytes)} read + written (the stage's arrays, each once); at the peak "
             f"DRAM bandwidth, {peaks.bandwidth / 1e9:,.0f} GB/s, that is {_time(out['memory_us'])}"]
    if ladder.flops is not None:
        flops = int(ladder.flops(work))
        out.update(flops=flops, arithmetic_us=flops / peaks.flops * 1e6)
        lines.append(f"  arithmetic: at least {flops / 1e9:.3g} GFLOP (a multiply-add is 2); at the CUDA cores' "
                     f"FP32 peak, {peaks.flops / 1e12:.3g} TFLOP/s, that is {_time(out['arithmetic_us'])}")
        if out["arithmetic_us"] > out["memory_us"]:
            out["bound"] = "arithmetic"
        lines.append(f"  the bound: {out['bound']} (the longer of the two: "
                     f"{_time(max(out['memory_us'], out['arithmetic_us']))})")
    else:
        lines.append("  the bound: memory (the stage does next to no arithmetic)")
    if gpu_us:
        best = out["arithmetic_us"] if out["bound"] == "arithmetic" else out["memory_us"]
        seconds = gpu_us * 1e-6
        out.update(achieved_gbs=nbytes / seconds / 1e9, fraction=best / gpu_us)
        lines.append(f"  this rung: {gpu_us:.1f} us moves them at {out['achieved_gbs']:,.1f} GB/s, "
                     f"{100 * nbytes / seconds / peaks.bandwidth:.1f} % of the peak bandwidth")
        if "flops" in out:
            rate = out["flops"] / seconds  # FLOP/s
            lines.append(f"  and computes at {rate / 1e12:.3g} TFLOP/s, {100 * rate / peaks.flops:.1f} % of the "
                         "FP32 peak" + (" (above it: tensor cores)" if rate > peaks.flops else ""))
        lines.append(f"  the bound's time is {100 * out['fraction']:.1f} % of the rung's")
    return out, lines


def _recorded_line(stage, rung, below, dtype) -> tuple:
    """``(the recorded time of stage's rung in dtype or None, a line saying it with its
    provenance)``."""
    name, record, rows = recorded_rows(stage)
    if not rows:
        return None, "recorded: no recorded ladder holds this stage"
    times = {r["rung"]: r["gpu_us"] for r in rows if r["dtype"] == dtype}
    if rung not in times:
        return None, f"recorded: {name}.json holds no {rung} in {dtype}"
    rec = record["recorded"]
    channels = "" if stage in CHANNEL_FREE else f", {record['channels']} channels"
    line = (f"recorded ({name}.json: {rec['device']}, {rec['date']}; {record['points']:,} voxels{channels}; "
            f"your device, cloud and channels may differ): {rung} {times[rung]:.1f} us")
    if below in times:
        line += f", {below} {times[below]:.1f} us ({times[below] / times[rung]:.2f}x)"
    return times[rung], line


def break_target(stage: str, rung: str, kernel=None) -> tuple:
    """What ``--break`` stops in: ``(code objects, note)``. The code objects are those of
    the rung's kernel, or of ``kernel`` (a kernel or kernel factory of the stage's module,
    by name) when given (:func:`numba_sc.tools.breakpoints.kernel_codes`); none for a
    rung whose object is not itself a kernel (a host function that launches kernels,
    or ``gather_v4``, which hands over ``gather_v3``'s), which stops in the first kernel
    the rung launches, as the note then says. A ``kernel`` that names no kernel is
    refused (ValueError)."""
    name, obj = lesson.rung_object(stage, kernel or rung)
    codes = breakpoints.kernel_codes(obj)
    if codes:
        return codes, ""
    if kernel:
        raise ValueError(f"--kernel {kernel}: {name} is a host function, not a kernel; name one of the kernels "
                         "it launches")
    # the kernels of the module that the host function names: the ones --kernel can pick
    module = vars(importlib.import_module(ladder_modules()[stage]))
    named = lesson.python_function(obj).__code__.co_names
    steps = [n for n in dict.fromkeys(named) if n in module and breakpoints.kernel_codes(module[n])]
    return frozenset(), (f"{name} is not itself a kernel: --break stops in the first kernel the rung launches"
                         + (f" (or --kernel NAME, one of those it names: {', '.join(steps)})" if steps else ""))


def run_rung(stage: str, rung: str, context: Context, dtypes=("float32", "float16"), rounds=20,
             stop=None, kernel=None, print_=print) -> list:
    """``numba-sc ladder STAGE --rung vN`` (module docstring): ``stage``'s rung ``rung``
    printed, diffed, checked on the workload built from ``context`` (in each of
    ``dtypes``), timed on a GPU (``rounds`` interleaved rounds) and set against its
    napkin math. ``stop=(block, thread)`` opens pdb in the rung's kernel there during
    the first check (simulator only; ``kernel`` names another kernel of the stage's
    module to stop in). Returns one row a dtype: ``error`` and ``agrees`` (None where the
    rung cannot run here), ``gpu_us`` and ``below_us`` on a GPU, ``recorded_us``, the
    napkin numbers (:func:`napkin`); with ``stop``, ``stopped`` (a
    :class:`~numba_sc.tools.breakpoints.Stop`) in the first, and ``quit`` where the
    reader quit pdb (the rest is then not run)."""
    found = ladders()
    if stage not in found:
        raise ValueError(f"{stage!r} has no ladder; the ladders are {', '.join(found)} (numba-sc ladder --list)")
    ladder = found[stage]
    declared = [r.name for r in ladder.declared]
    if rung not in declared:
        raise ValueError(f"--rung: {stage} has the rungs {', '.join(declared)}, got {rung!r}")
    missing = [n for n in ladder.needs if getattr(context, n) is None]
    if missing:
        raise ValueError(f"{stage}'s workload needs {', '.join(missing)} (the scan's points: give --points, or "
                         "leave it out to use the SemanticKITTI scan)")
    runnable = rung in ladder.names  # (a gpu_only rung is not, under the simulator)
    if stop is not None and not simulating():
        raise RuntimeError("--break needs Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): on a GPU a kernel's "
                           "threads are not Python threads that pdb can stop in")
    if stop is not None and not runnable:
        raise ValueError(f"--break: {stage} {rung} cannot run under the simulator (it calls linked CUDA C++)")
    if kernel and stop is None:
        raise ValueError("--kernel names the kernel --break stops in; give --break B,T with it")
    codes, note = break_target(stage, rung, kernel) if stop is not None else (None, "")
    at = declared.index(rung)
    below = declared[at - 1] if at else None

    # 1. the code, and what it changed
    name, _ = lesson.rung_object(stage, rung)
    print_(f"{stage} {rung} ({ladder_modules()[stage]}): {ladder.declared[at].adds}")
    print_(f"\n--- {name}, as written ---\n{lesson.code(stage, rung).rstrip()}")
    if below is None:
        print_(f"\n--- {rung} is the first rung: the paper's algorithm as plainly as Numba allows; no rung below "
               "to diff against ---")
    else:
        print_(f"\n--- what {rung} changed against {below} ---\n{lesson.diff_text(stage, below, rung)}")
    if note:
        print_(f"\n{note}")

    # 2-4. per dtype: the check, the time, the napkin math
    timed = gpu_present() and not simulating()
    peaks = (device_peaks() if timed else REFERENCE)
    where = (f"the whole cloud on {device_name()}" if timed else "a crop, kernels under Numba's CUDA simulator")
    print_(f"\n{len(context.coords):,} voxels, {context.channels} channels: {where}")
    rows = []
    for i, dtype in enumerate(dtypes):
        work = ladder.workload(dataclasses.replace(context, dtype=dtype))
        row = {"stage": stage, "rung": rung, "dtype": dtype, "below": below, "error": None, "agrees": None}
        rows.append(row)
        tolerance = (ladder.tolerance or {}).get(dtype, 0.0)
        print_(f"\n{dtype}:")
        if not runnable:
            print_(f"  check: not run here: {rung} calls linked CUDA C++, which Numba's CUDA simulator cannot run; "
                   "run it on a GPU")
        else:
            try:
                if stop is not None and i == 0:
                    with breakpoints.stop_in(*stop, codes, announce=print_) as stopped:
                        row["error"] = agreement(ladder, rung, work)
                    row["stopped"] = stopped
                    if not stopped.hit:
                        print_(f"  --break: {stopped.missed()}")
                else:
                    row["error"] = agreement(ladder, rung, work)
            except bdb.BdbQuit:
                row["quit"] = True
                print_("  quit in pdb: the rest of the run is skipped")
                return rows
            row["agrees"] = agrees(ladder, dtype, row["error"])
            limit = f"tolerance {tolerance:.1e}" if tolerance else "exact"
            verdict = "agrees with" if row["agrees"] else "DISAGREES with"
            print_(f"  check: error {row['error']:.2e} (the largest |{rung} - reference|, relative to the largest "
                   f"value): {verdict} the reference ({limit})")
        gpu_us = None
        if timed and runnable:
            times = time_rungs(ladder, work, rounds, names=[r for r in (below, rung) if r])
            gpu_us = row["gpu_us"] = times[rung]
            line = f"  GPU time (median of {rounds} interleaved rounds, CUDA events): {rung} {gpu_us:.1f} us"
            if below:
                row["below_us"] = times[below]
                line += f", {below} {times[below]:.1f} us ({times[below] / gpu_us:.2f}x)"
            print_(line)
        elif not timed:
            print_("  GPU time: needs a GPU (under the simulator a kernel's time says nothing about one)")
        row["recorded_us"], line = _recorded_line(stage, rung, below, dtype)
        print_("  " + line)
        if peaks is None:
            print_("  napkin math: this GPU's peaks could not be read (CuPy's device attributes)")
            continue
        numbers, lines = napkin(ladder, work, peaks, gpu_us)
        row.update(numbers)
        for text in lines:
            print_("  " + text)
    return rows


def timed_rows(rows) -> list:
    """The GPU times of :func:`run_rung`'s rows as rows of a ladder run (stage, dtype,
    rung, gpu_us), the rung below included: what ``--plot`` draws."""
    out = []
    for r in rows:
        if r.get("below_us"):
            out.append({"stage": r["stage"], "dtype": r["dtype"], "rung": r["below"], "gpu_us": r["below_us"]})
        if r.get("gpu_us"):
            out.append({"stage": r["stage"], "dtype": r["dtype"], "rung": r["rung"], "gpu_us": r["gpu_us"]})
    return out
