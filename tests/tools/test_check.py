"""The checker (``python -m numba_sc check``): it passes on a real scan, catches and
locates a broken kernel (voxelization, the Map step), and refuses unknown stages."""
import numpy as np
from numba import cuda

import numba_sc.coords.voxelization as voxmod
import numba_sc.map.driver as drivermod
from numba_sc.core.backend import to_host
from numba_sc.tools.check import run_check
from numba_sc.tools.synthetic import lidar_scene

from conftest import crop, load_scan


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


def test_check_catches_and_locates_a_broken_map_kernel(monkeypatch):
    """A forward search that drops one hit is found, and told as coordinates."""
    real = drivermod.forward_search_cuda

    def broken(*args, **kw):
        table, report, chunk_counts = real(*args, **kw)
        hits = np.argwhere(to_host(table) >= 0)
        k, i = hits[len(hits) // 2]
        table[k, i] = -1  # the planted bug: one pair lost
        return table, report, chunk_counts

    monkeypatch.setattr(drivermod, "forward_search_cuda", broken)
    pts = crop(load_scan("semantickitti"), 400)
    results = run_check(np.ascontiguousarray(pts[:, :3]), None, 0.05, stage="kernel map", log=lambda *_: None)
    (name, ok, detail), = results
    assert not ok
    assert "offset" in detail and "expected input" in detail and "found no input (-1)" in detail, detail
