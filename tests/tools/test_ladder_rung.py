"""``numba-sc ladder STAGE --rung vN`` (numba_sc.tools.rung): every rung of every ladder
runs alone under the simulator, with its code, diff, check, recorded figure and napkin
math; a wrong rung fails the check and the command; the napkin math is the hand-computed
one; ``--plot`` writes a PNG; ``--break`` lands in pdb in the thread asked for."""
import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

import numba_sc as ns
from numba_sc.core.device import simulating
from numba_sc.core.rungs import Ladder, Rung
from numba_sc.gmas import gather as ga
from numba_sc.tools import breakpoints, ladder, rung

from conftest import crop, load_scan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small():
    """A Context on a crop of about 40 voxels, 4 channels, small search blocks (the
    simulator runs every thread as a Python thread: the implicit GEMM's v2 alone takes
    seconds here)."""
    pts = crop(load_scan("semantickitti"), 100, seed=3)
    coords = ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords
    return ladder.Context(coords, 4, points=pts, search_blocks=(32, 16))


def test_every_rung_of_every_ladder_runs_alone(small):
    """What --rung prints and returns for each rung --list names: the rung's code, its
    diff from the rung below (v1: none), the check within tolerance, no time without a
    GPU, the recorded figure where one exists, and the napkin math (bytes, and for the
    dataflows flops and the bound)."""
    declared = {stage: lad.declared for stage, lad in ladder.ladders().items()}
    assert sum(len(r) for r in declared.values()) >= 30  # (every ladder, no rung left out)
    for stage, rungs in declared.items():
        lad = ladder.ladders()[stage]
        for i, r in enumerate(rungs):
            out = []
            rows = rung.run_rung(stage, r.name, small, ("float32",), print_=out.append)
            text = "\n".join(out)
            assert len(rows) == 1, (stage, r.name)
            row = rows[0]
            name = f"{lad.operation}_{r.name}"
            assert f"--- {name}, as written ---" in text and f"def {name}(" in text, (stage, r.name)
            if i == 0:
                assert "is the first rung" in text and row["below"] is None
            else:
                below = f"{lad.operation}_{rungs[i - 1].name}"
                assert f"--- {below}\n+++ {name}" in text, (stage, r.name)
            if r.gpu_only and simulating():  # the tensor-core rung: the simulator cannot run linked C++
                assert row["agrees"] is None and "not run here" in text
            else:
                assert row["agrees"] is True and "agrees with the reference" in text, (stage, r.name, row["error"])
            if simulating():
                assert "GPU time: needs a GPU" in text and "gpu_us" not in row
            else:
                assert row["gpu_us"] > 0 and "GPU time (median of" in text
            record, _, kept = ladder.recorded_rows(stage)
            if any(x["rung"] == r.name and x["dtype"] == "float32" for x in kept):
                assert row["recorded_us"] > 0 and f"recorded ({record}.json" in text
            elif kept:  # a rung newer than the record (implicit_gemm's v5, until it is timed)
                assert row["recorded_us"] is None and f"{record}.json holds no {r.name} in float32" in text
            assert row["bytes"] > 0 and "peak DRAM bandwidth" in text
            assert ("flops" in row) == (stage in ("fetch_on_demand", "implicit_gemm")), stage
            assert row["bound"] in ("memory", "arithmetic")


def test_the_napkin_bytes_of_gather_are_the_hand_computed_ones():
    """3 inputs, 4 channels, 3 offsets: inputs 0 and 2 feed 2 buffer rows each, input 1
    none. At least: 2 inputs x 4 channels read, 4 int32 row numbers, 4 rows written."""
    plan = types.SimpleNamespace(in_table=np.array([[0, -1, 2], [-1, -1, -1], [1, 3, -1]], np.int32))
    for dtype, size in (("float32", 4), ("float16", 2)):
        work = {"features": np.zeros((3, 4), dtype), "plan": plan}
        by_hand = 2 * 4 * size + 4 * 4 + 4 * 4 * size  # 112 bytes in fp32, 64 in fp16
        assert ga.LADDER.bytes_moved(work) == by_hand, dtype
    # every input counted, the one with no row too, would be 16 bytes more: the formula sees the difference
    assert ga.LADDER.bytes_moved({"features": np.zeros((3, 4), np.float32), "plan": plan}) != 3 * 16 + 4 * 4 + 64


def test_the_napkin_math_divides_by_the_peaks_and_names_the_bound():
    """Bytes over the peak bandwidth, flops over the peak rate; the bound is the longer;
    a measured time gives the achieved bandwidth."""
    peaks = rung.Peaks("test GPU", bandwidth=1e12, flops=1e13, source="made up")
    memory = Ladder("m", (Rung("v1", None, "."),), None, None, bytes_moved=lambda w: 2_000_000)
    numbers, lines = rung.napkin(memory, {}, peaks, gpu_us=4.0)
    assert numbers["memory_us"] == pytest.approx(2.0) and numbers["bound"] == "memory"
    assert numbers["achieved_gbs"] == pytest.approx(500.0) and numbers["fraction"] == pytest.approx(0.5)
    assert any("50.0 % of the peak bandwidth" in line for line in lines)
    for flops, bound in ((10_000_000, "memory"), (30_000_000, "arithmetic")):  # 1 us and 3 us of arithmetic
        gemm = Ladder("g", (Rung("v1", None, "."),), None, None, bytes_moved=lambda w: 2_000_000,
                      flops=lambda w, f=flops: f)
        numbers, lines = rung.napkin(gemm, {}, peaks, gpu_us=6.0)
        assert numbers["bound"] == bound and f"the bound: {bound}" in "\n".join(lines)
        assert numbers["fraction"] == pytest.approx(max(2.0, flops / 1e7) / 6.0)  # the bound's time / the rung's
        assert any(f"{100 * flops / 6e-6 / 1e13:.1f} % of the FP32 peak" in line for line in lines)
    assert rung.napkin(Ladder("n", (), None, None), {}, peaks)[0] == {}  # none declared: said, not invented


def test_peaks_from_what_cuda_reports():
    """The H100 SXM5's attributes (2619 MHz memory clock, 5120-bit bus, 132 SMs at 1980 MHz,
    compute capability 9.0) give its datasheet's peaks; an A100's 64 FP32 lanes an SM
    halve the rate per SM and clock."""
    h100 = rung.peaks_from_attributes("h100", 2_619_000, 5120, 132, 1_980_000, (9, 0), "")
    assert h100.bandwidth == pytest.approx(3.35e12, rel=2e-3) and h100.flops == pytest.approx(66.9e12, rel=2e-3)
    assert rung.REFERENCE.bandwidth == h100.bandwidth
    a100 = rung.peaks_from_attributes("a100", 1_215_000, 5120, 108, 1_410_000, (8, 0), "")
    assert a100.bandwidth == pytest.approx(1.555e12, rel=2e-3) and a100.flops == pytest.approx(19.5e12, rel=2e-3)


def test_a_wrong_rung_disagrees_and_the_command_exits_1(monkeypatch, capsys):
    """gather v2 with its kernel swapped for one that copies the next point's features
    (an off-by-one point index): --rung reports the disagreement and exits 1."""
    load_scan("semantickitti")  # skips without the data

    @cuda.jit
    def gather_v2(features, in_masks, buffered, in_slots, tile, buf):
        t = cuda.grid(1)
        tiles = features.shape[1] // tile
        if t < features.shape[0] * tiles:
            p = t // tiles
            c0 = (t - p * tiles) * tile
            n = 0
            for w in range(in_masks.shape[0]):
                n += cuda.popc(in_masks[w, p] & buffered[w])
            for s in range(n):
                row = in_slots[s, p]
                for c in range(tile):
                    buf[row, c0 + c] = features[min(p + 1, features.shape[0] - 1), c0 + c]  # p + 1: wrong

    from numba_sc.__main__ import main

    args = ["ladder", "gather", "--rung", "v2", "--crop", "120", "--dtypes", "float32"]
    assert main(args) == 0
    assert "agrees with the reference (exact)" in capsys.readouterr().out
    monkeypatch.setattr(ga, "gather_v2", gather_v2)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "DISAGREES with the reference" in out and "gather v2 disagrees with the reference in float32" in out


def test_plot_writes_a_png(tmp_path, capsys):
    """Without GPU times, the recorded ladder alone (said); with some, beside it. A stage
    with neither gets no panel; with none at all, a clear error."""
    png = tmp_path / "ladder.png"
    said = []
    ladder.plot_ladder(["gather", "fetch_on_demand"], [], png, print_=said.append)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("recorded times alone" in s for s in said) and any("fetch_on_demand has no recorded" in s
                                                                 for s in said)
    mine = [{"stage": "gather", "dtype": "float32", "rung": r, "gpu_us": t} for r, t in (("v1", 90.0), ("v2", 80.0))]
    mine.append({"stage": "fetch_on_demand", "dtype": "float16", "rung": "v2", "gpu_us": 50.0})
    png2 = tmp_path / "mine.png"
    ladder.plot_ladder(["gather", "fetch_on_demand"], mine, png2, print_=said.append)
    assert png2.read_bytes()[:4] == b"\x89PNG" and "your GPU times beside" in said[-1]
    with pytest.raises(ValueError, match="nothing to plot"):
        ladder.plot_ladder(["batch_norm_backward"], [], tmp_path / "none.png", print_=said.append)
    assert not (tmp_path / "none.png").exists()
    load_scan("semantickitti")
    from numba_sc.__main__ import main

    cli = tmp_path / "cli.png"
    assert main(["ladder", "scatter", "--rung", "v3", "--crop", "100", "--dtypes", "float32", "--plot", str(cli)]) == 0
    assert cli.read_bytes()[:4] == b"\x89PNG" and f"--plot: wrote {cli}" in capsys.readouterr().out


class Recorder:
    """A debugger that records where it was started instead of stopping."""

    frames = []

    def set_trace(self, frame):
        Recorder.frames.append((frame.f_code.co_name, frame.f_code.co_filename))

    def trace_dispatch(self, *args):
        return None


@pytest.mark.skipif(not simulating(), reason="--break stops in the simulator's threads")
def test_break_finds_the_thread_the_kernel_and_says_when_there_is_none(small):
    """stop_in in the rung's own kernel, in the first kernel of a host function (or the one
    --kernel names), and a block outside the launch told with the launch's size."""
    for stage, name, kernel, want in (("gather", "v3", None, "gather_v3_kernel"),
                                      ("backward_search", "v1", None, "pivot_bounds_v1"),
                                      ("backward_search", "v1", "split_rows_v1", "split_rows_v1")):
        lad = ladder.ladders()[stage]
        work = lad.workload(small)
        codes, note = rung.break_target(stage, name, kernel)
        assert bool(note) == (kernel is None and stage == "backward_search")
        Recorder.frames.clear()
        with breakpoints.stop_in(0, 1, codes, announce=lambda s: None, debugger=Recorder) as stop:
            lad.run(name, work)
        assert stop.hit and stop.kernel == want and Recorder.frames == [(want, stop.file)], (stage, name)
        assert stop.file == importlib.import_module(ladder.ladder_modules()[stage]).__file__
    with pytest.raises(ValueError, match="host function, not a kernel"):
        rung.break_target("backward_search", "v1", "backward_search_v1")
    said = []
    rows = rung.run_rung("gather", "v2", small, ("float32",), stop=(99, 0), print_=said.append)
    assert not rows[0]["stopped"].hit and rows[0]["agrees"]
    assert any(re.search(r"block 99 thread 0 never ran gather_v2; the launch was \d+ blocks? of 256 threads", s)
               for s in said), said
    with pytest.raises(ValueError, match="BLOCK,THREAD"):
        breakpoints.parse_break("1,2,3")


def test_cli_refuses_what_it_cannot_do(monkeypatch, capsys, tmp_path):
    from numba_sc.__main__ import main
    import numba_sc.core.device as device

    for args, says in ((["gather", "--plot", str(tmp_path / "nodir" / "l.png")], "--plot"),
                       (["gather", "--break", "1,3"], "give one STAGE and --rung"),
                       (["gather", "scatter", "--rung", "v2"], "give one STAGE"),
                       (["gather", "--rung", "v9"], "gather has the rungs v1, v2, v3, v4"),
                       (["gather", "--rung", "v2", "--break", "1,2,3"], "BLOCK,THREAD"),
                       (["gather", "--rung", "v2", "--kernel", "gather_v1"], "give --break B,T with it"),
                       (["backward_search", "--rung", "v1", "--break", "0,0", "--kernel", "backward_search_v1"],
                        "host function, not a kernel"),
                       (["gather", "--rung", "v2", "--out", "x.json"], "--out records a whole ladder run")):
        if "--break" in args and not simulating():
            continue  # (on a GPU --break is refused first, whatever else is wrong: below)
        assert main(["ladder", *args]) == 2, args
        assert says in capsys.readouterr().err, args
    if simulating():  # (on a GPU there is the reader's own run to plot)
        assert main(["ladder", "batch_norm_backward", "--plot", str(tmp_path / "l.png")]) == 2
        assert "nothing to plot" in capsys.readouterr().err
    # on a GPU --break refuses, on one line, before any work
    monkeypatch.setattr(device, "gpu_present", lambda: True)
    monkeypatch.setattr(device, "simulating", lambda: False)
    assert main(["ladder", "gather", "--rung", "v2", "--break", "1,3"]) == 2
    err = capsys.readouterr().err
    assert "--break needs Numba's CUDA simulator" in err and len(err.strip().splitlines()) == 1


def test_break_stops_in_pdb_in_that_thread():
    """The command line, pdb driven through standard input: it stops in block 1, thread 3,
    inside gather_v2 in its own source file; `c` lets the check finish."""
    load_scan("semantickitti")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "numba_sc", "ladder", "gather", "--rung", "v2", "--break", "1,3",
                          "--crop", "200"], input="p cuda.blockIdx.x, cuda.threadIdx.x\nc\n",
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout
    source = str(ROOT / "numba_sc" / "gmas" / "gather.py")
    assert f"stopped in gather_v2 at block 1, thread 3 ({source})" in out
    assert f"> {source}(" in out and ")gather_v2()" in out  # pdb's own line: that file, that function
    assert "(Pdb) (1, 3)" in out  # the thread's own indices, as the kernel sees them
    assert out.count("agrees with the reference") == 2  # float32 and float16, after `c`


def test_the_gpu_path_times_the_rung_and_the_one_below(small, monkeypatch, tmp_path):
    """run_rung as on a GPU (the kernels still simulated here; the clock and the device's
    attributes stand-ins): the rung and the rung below timed together, the times beside
    the recorded ones, the achieved bandwidth against the peak, and --plot's rows."""
    timed = []

    def fake_time_rungs(lad, work, rounds, names):
        timed.append((lad.stage, tuple(names), rounds))
        return {n: 10.0 * (len(names) - i) for i, n in enumerate(names)}  # the lower rung slower

    monkeypatch.setattr(rung, "gpu_present", lambda: True)
    monkeypatch.setattr(rung, "simulating", lambda: False)
    monkeypatch.setattr(rung, "time_rungs", fake_time_rungs)
    monkeypatch.setattr(rung, "device_name", lambda: "Test GPU")
    monkeypatch.setattr(rung, "device_peaks", lambda: rung.Peaks("Test GPU", 1e12, 1e13, "its attributes"))
    said = []
    rows = rung.run_rung("scatter", "v3", small, ("float32",), rounds=7, print_=said.append)
    text = "\n".join(said)
    assert timed == [("scatter", ("v2", "v3"), 7)]
    assert rows[0]["gpu_us"] == 10.0 and rows[0]["below_us"] == 20.0
    assert "GPU time (median of 7 interleaved rounds, CUDA events): v3 10.0 us, v2 20.0 us (2.00x)" in text
    assert "the whole cloud on Test GPU" in text and "napkin math (Test GPU: its attributes)" in text
    assert rows[0]["achieved_gbs"] == pytest.approx(rows[0]["bytes"] / 10e-6 / 1e9)
    assert rung.timed_rows(rows) == [{"stage": "scatter", "dtype": "float32", "rung": "v2", "gpu_us": 20.0},
                                     {"stage": "scatter", "dtype": "float32", "rung": "v3", "gpu_us": 10.0}]
    timed.clear()
    rung.run_rung("scatter", "v1", small, ("float32",), print_=said.append)
    assert timed == [("scatter", ("v1",), 20)]  # v1 has no rung below


def test_device_peaks_reads_cupys_attributes(monkeypatch):
    """The peaks of the GPU at hand, from CuPy's device attributes (an A100's here)."""
    attributes = {"MemoryClockRate": 1_215_000, "GlobalMemoryBusWidth": 5120, "MultiProcessorCount": 108,
                  "ClockRate": 1_410_000}
    device = types.SimpleNamespace(attributes=attributes, compute_capability="80")
    runtime = types.SimpleNamespace(CUDARuntimeError=RuntimeError)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device, runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(rung, "device_name", lambda: "A100")
    peaks = rung.device_peaks()
    assert peaks == rung.peaks_from_attributes("A100", 1_215_000, 5120, 108, 1_410_000, (8, 0), peaks.source)
    del attributes["MemoryClockRate"]  # a CUDA that no longer reports it: no peaks, not wrong ones
    assert rung.device_peaks() is None
