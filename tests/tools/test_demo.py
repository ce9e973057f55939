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
