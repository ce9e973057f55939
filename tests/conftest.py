"""Test set-up: run the real kernels under Numba's CUDA simulator.

The simulator must be switched on *before* numba is first imported, so this is
done here, at the top of conftest, which pytest imports before any test module.
On a GPU machine run the suite with ``NUMBA_ENABLE_CUDASIM=0`` to test the same
kernels on the device instead.
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The real scans live beside the project (../shared/data), never inside it.
DATA_DIR = Path(os.environ.get("NUMBA_SC_DATA", ROOT.parent / "shared" / "data"))

# name -> (file, columns, voxel size used throughout the tests)
SCANS = {
    "semantickitti": ("semantickitti_000000.bin", 4, 0.05),
    "scannet": ("scannet_scene0000_00.bin", 6, 0.02),
    "sunrgbd": ("sunrgbd_000017.bin", 6, 0.02),
}


def load_scan(name):
    """(N, C) float32 array of a real scan, or pytest.skip when the data is absent."""
    fname, cols, _ = SCANS[name]
    path = DATA_DIR / fname
    if not path.exists():
        pytest.skip(f"real scan {path} not present")
    return np.fromfile(path, np.float32).reshape(-1, cols)


def crop(points, n, seed=0):
    """About n points of a scan around a random point: a dense, realistic patch."""
    rng = np.random.default_rng(seed)
    xyz = points[:, :3]
    centre = xyz[rng.integers(len(xyz))]
    d = np.abs(xyz - centre).max(axis=1)
    return points[np.argsort(d, kind="stable")[:n]]


@pytest.fixture(params=sorted(SCANS))
def scan(request):
    """(name, points, voxel_size) for each real scan."""
    return request.param, load_scan(request.param), SCANS[request.param][2]


@pytest.fixture(scope="module")
def coords():
    """Voxel coordinates of a crop of SemanticKITTI (about 260 points): the cloud of the
    gradient and tape tests, made once per test module."""
    import numba_sc as ns  # here, not at the top: numba only after the simulator switch

    pts = crop(load_scan("semantickitti"), 260, seed=5)
    return ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def pytest_configure(config):
    # Added here, not in pyproject.toml: naming a numba warning class there makes
    # pytest import numba before this file has switched the simulator on.
    config.addinivalue_line("filterwarnings", "ignore::numba.core.errors.NumbaPerformanceWarning")
