"""The demo command, the synthetic scene, and the checker (including a broken kernel)."""
import numpy as np
from numba import cuda

import numba_sc.coords.voxelization as voxmod
from numba_sc.__main__ import main
from numba_sc.tools.check import run_check
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


def test_check_passes_on_a_real_scan(capsys):
    from conftest import load_scan

    pts = load_scan("semantickitti")
    results = run_check(np.ascontiguousarray(pts[:, :3]), np.ascontiguousarray(pts[:, 3:]), 0.05, crop=400)
    assert results and all(ok for _, ok, _ in results), results


@cuda.jit
def broken_unpack_kernel(ukeys, s, coords):
    """unpack_kernel with a planted bug: voxel 5 gets z + 1."""
    m = cuda.grid(1)
    if m < ukeys.shape[0]:
        k = ukeys[m]
        if s == 1:
            coords[m, 0] = k >> 54
        coords[m, s] = ((k >> 36) & 0x3FFFF) - 131072
        coords[m, s + 1] = ((k >> 18) & 0x3FFFF) - 131072
        coords[m, s + 2] = (k & 0x3FFFF) - 131072 + (1 if m == 5 else 0)


def test_check_catches_and_locates_a_broken_kernel(monkeypatch):
    monkeypatch.setattr(voxmod, "unpack_kernel", broken_unpack_kernel)
    pts, inten = lidar_scene(n_azimuth=200)
    lines = []
    results = run_check(pts, inten[:, None], 0.1, stage="voxelize", crop=300, log=lines.append)
    (name, ok, detail), = results
    assert not ok and "first row 5" in detail, detail
    assert any("FAIL" in line for line in lines)


def test_check_rejects_unknown_stage():
    import pytest

    with pytest.raises(ValueError, match="stages are"):
        run_check(np.zeros((5, 3), np.float32), None, 0.1, stage="no-such-stage")
