"""``python -m numba_sc demo``: every stage on one scan, kernels beside references.

Each stage runs with the NumPy reference on the whole cloud and with the CUDA
kernels: on the GPU on the whole cloud, or, without a GPU, under Numba's CUDA
simulator on a crop (the simulator runs every CUDA thread as a Python thread, so
a full scan would take hours). The table says, per stage, whether the kernels
agree with the reference on the same input.

**Times without compilation.** Numba compiles a kernel the first time it is launched
with new argument types, which takes far longer than the kernel (hundreds of ms beside
a few). So each stage's kernels run once untimed, then are timed: the ``time`` column is
the warm run, and the ``compile`` column what the first run took on top of it (mostly
JIT compilation). Under the simulator the structure is the same; its numbers time
Python threads, not a GPU.

**Warnings apart from the table.** What the stages warn about while they run (Numba's
NumbaPerformanceWarning on a small grid, say) is caught, so no warning lands between
the table's rows; a one-line summary follows the table.
"""
from __future__ import annotations

import time
import warnings
from collections import Counter

import numpy as np

from ..core.device import gpu_present, simulating
from .check import crop_points, default_stages, make_context


def _sync():
    """Wait for the GPU (a no-op without one), so host timers measure finished work."""
    if gpu_present():
        import cupy

        cupy.cuda.Device().synchronize()


def _timed(fn, *args):
    _sync()
    t0 = time.perf_counter()
    out = fn(*args)
    _sync()
    return out, time.perf_counter() - t0


def _say(line):
    """Print at once: a row appears as soon as its stage has run (stdout may be a pipe)."""
    print(line, flush=True)


HEAD = ("stage", "backend", "input", "output", "time", "compile", "agrees with reference")


def run_stages(points, features, voxel_size, crop=1500, stages=None, log=_say):
    """Run every stage with both backends; return table rows, each printed (via ``log``)
    as soon as it is known, under a header printed first, and after the table one line
    summing up the warnings the stages raised (caught, so none is printed between rows).

    A row is ``(stage, backend, input, output, seconds, compile seconds or None,
    agreement)``: the kernels' seconds are a warm run's, after a first, untimed one
    whose extra time (compilation) is the compile column; the reference has none."""
    stages = stages or default_stages()
    full = make_context(points, features, voxel_size)
    if gpu_present():
        kctx, where = full, "cuda (GPU)"
    else:
        idx = crop_points(points, crop)
        sub = (np.ascontiguousarray(points[idx]), None if features is None else np.ascontiguousarray(features[idx]))
        kctx, where = make_context(*sub, voxel_size), f"cuda (simulator, crop of {len(idx)} points)"
        log(f"No GPU: the CUDA kernels run under Numba's CUDA simulator on a crop of {len(idx)} "
            f"points; the NumPy reference runs on all {len(points)} points.")
    widths = [max(len(HEAD[0]), *(len(st.name) for st in stages)), max(len(HEAD[1]), len(where)),
              max(len(HEAD[2]), len(f"{len(points)} pts")), 18, 10, 10, len(HEAD[6])]
    log(_line(HEAD, widths))
    log(_line(["-" * w for w in widths], widths))
    rows = []

    def add(row):
        rows.append(row)
        log(_line(_cells(row), widths))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # (every one counted, not only the first of each place)
        for st in stages:
            ref, t_ref = _timed(st.run, full, "reference")
            add((st.name, "reference", f"{len(points)} pts", st.size(ref), t_ref, None, "-"))
            _, t_first = _timed(st.run, kctx, "cuda")  # compiles the kernels it launches first
            ker, t_ker = _timed(st.run, kctx, "cuda")
            ref_same = ref if kctx is full else st.run(kctx, "reference")
            problem = st.compare(ker, ref_same)
            add((st.name, where, f"{len(kctx['points'])} pts", st.size(ker), t_ker, max(t_first - t_ker, 0.0),
                 "yes" if problem is None else f"NO: {problem}"))
    summary = warning_summary(caught)
    if summary:
        log(summary)
    return rows


def warning_summary(caught) -> str:
    """One line for the warnings in ``caught`` (``warnings.WarningMessage`` records): how
    many of each category, and the first message of each, cut short. '' for none."""
    if not caught:
        return ""
    counts = Counter(w.category.__name__ for w in caught)
    first = {}
    for w in caught:
        first.setdefault(w.category.__name__, " ".join(str(w.message).split()))
    parts = [f"{n} {name} (first: {first[name][:90]}{'...' if len(first[name]) > 90 else ''})"
             for name, n in counts.most_common()]
    return f"{len(caught)} warning(s) while the stages ran, kept out of the table: " + "; ".join(parts)


def _cells(row):
    """A result row as the table's text cells (the times in ms)."""
    a, b, c, d, t, comp, e = row
    return (a, b, c, d, f"{t * 1e3:.1f} ms", "-" if comp is None else f"{comp * 1e3:.1f} ms", e)


def _line(cells, widths):
    return "  ".join(str(v).ljust(w) for v, w in zip(cells, widths)).rstrip()


def load_points(path, columns):
    """A KITTI-style float32 .bin: x, y, z, then columns-3 feature columns.

    The file must hold whole points (``4 * columns`` bytes each): a file of another
    layout, or one cut short, is refused rather than read as wrong points or with
    its last bytes dropped. Points with a NaN or infinite value are left out."""
    from pathlib import Path

    from ..core.conventions import positive_int

    if positive_int(columns, "columns") < 3:
        raise ValueError(f"--columns must be at least 3 (x, y, z), got {columns}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--points {path}: no such file" + (" (it is a folder)" if path.is_dir() else ""))
    size, row = path.stat().st_size, 4 * columns
    if size == 0 or size % row:
        raise ValueError(f"--points {path} has {size} bytes, not a positive multiple of {row} (--columns {columns} "
                         f"float32 values a point); give the file's --columns (KITTI: 4, x y z remission)")
    data = np.fromfile(path, dtype=np.float32).reshape(-1, columns)
    data = data[np.isfinite(data).all(axis=1)]
    feats = np.ascontiguousarray(data[:, 3:]) if columns > 3 else None
    return np.ascontiguousarray(data[:, :3]), feats


def demo(points_file=None, columns=4, voxel_size=0.05, crop=1500, log=_say, loaded=None):
    """Run and print the table of :func:`run_stages` on ``points_file`` (a float32 .bin of
    ``columns`` columns; default a synthetic LiDAR scene). ``loaded``: the file's
    ``load_points`` result, when the caller has read it already. Returns the exit
    status: 0 when every kernel agrees with its reference."""
    from .synthetic import lidar_scene

    if points_file:
        points, feats = loaded if loaded is not None else load_points(points_file, columns)
        log(f"Loaded {len(points)} points from {points_file}.")
    else:
        points, intensity = lidar_scene()
        feats = intensity[:, None]
        log(f"Synthetic 64-beam LiDAR scene: {len(points)} points (no --points given).")
    log(f"Voxel size {voxel_size} m; backends: reference (NumPy) and cuda "
        f"({'GPU' if gpu_present() else 'simulator' if simulating() else 'unavailable'}).\n")
    rows = run_stages(points, feats, voxel_size, crop=crop, log=log)
    return 0 if all(r[6] in ("-", "yes") for r in rows) else 1
