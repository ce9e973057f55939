"""The demo command and the synthetic scene it runs on."""
import numpy as np

from numba_sc.__main__ import main
from numba_sc.tools.synthetic import lidar_scene


def test_synthetic_scene_is_deterministic_lidar_like():
    a, ia = lidar_scene(n_azimuth=400)
    b, ib = lidar_scene(n_azimuth=400)
    assert np.array_equal(a, b) and np.array_equal(ia, ib)
    r = np.linalg.norm(a[:, :2], axis=1)
    assert 20_000 < len(a) <= 64 * 400 and r.max() < 80.5
    assert (a[:, 2] < 0.05).mean() > 0.3  # most beams hit the ground


def test_demo_runs_and_agrees(capsys):
    assert main(["demo", "--crop", "300"]) == 0
    out = capsys.readouterr().out
    assert "1 voxelize" in out and "NO:" not in out and "yes" in out


def test_demo_on_a_real_scan(capsys):
    from conftest import DATA_DIR, load_scan

    load_scan("sunrgbd")  # skips if absent
    assert main(["demo", "--points", str(DATA_DIR / "sunrgbd_000017.bin"), "--columns", "6",
                 "--voxel-size", "0.02", "--crop", "300"]) == 0


class _WarningStage:
    """A stand-in stage whose kernel run warns (as Numba does on a small grid) and is slow
    the first time (as a launch that compiles is)."""
    name = "fake"

    def __init__(self):
        self.cuda_runs = 0

    def run(self, ctx, backend):
        import time
        import warnings

        if backend == "cuda":
            self.cuda_runs += 1
            warnings.warn("Grid size 1 will likely result in GPU under-utilization", RuntimeWarning)
            if self.cuda_runs == 1:
                time.sleep(0.05)  # the first run compiles
        return len(ctx["points"])

    def size(self, out):
        return f"{out} rows"

    def compare(self, a, b):
        return None if a == b else "differ"


def test_the_demo_table_has_a_compile_column_and_no_warning_inside():
    from numba_sc.tools.demo import HEAD, run_stages

    lines = []
    stage = _WarningStage()
    points = np.random.default_rng(0).uniform(0, 2, (200, 3)).astype(np.float32)
    rows = run_stages(points, None, 0.1, crop=100, stages=[stage], log=lines.append)
    assert stage.cuda_runs == 2  # once untimed (compilation), once timed
    head = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert "compile" in lines[head].split() and HEAD[5] == "compile"
    table, after = lines[head:head + 4], lines[head + 4:]
    assert not any("Grid size" in line or "Warning" in line for line in table)
    ref, ker = rows
    assert ref[5] is None and ker[5] >= 0.04 and ker[4] < 0.04  # the compile apart from the warm time
    assert table[2].split()[-2:] == ["-", "-"]  # the reference: no compile, no comparison
    assert table[3].split()[-1] == "yes" and table[3].count(" ms") == 2  # the kernels: warm time, compile
    assert len(after) == 1 and after[0].startswith("2 warning(s)") and "RuntimeWarning" in after[0]
    assert "Grid size 1" in after[0]
    # and without a warning, no summary line
    lines.clear()
    quiet = _WarningStage()
    quiet.run = lambda ctx, backend: len(ctx["points"])
    run_stages(points, None, 0.1, crop=100, stages=[quiet], log=lines.append)
    assert not any("warning(s)" in line for line in lines)
