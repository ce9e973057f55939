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
        # (An sdist holds no scans: its tests run without them, and these skip.)
        pytest.skip(f"real scan {path} not present: the real scans are read from $NUMBA_SC_DATA, else "
                    f"../shared/data beside the checkout; set NUMBA_SC_DATA to the folder that holds {fname}")
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


# The slowest tests, started first. Under pytest-xdist (pytest -n auto) the suite lasts as
# long as its busiest worker: a worker that picks up a minutes-long test near the end
# finishes alone while the other idles. Started first, the long tests run beside the
# short ones. The book (every notebook, executed) leads; the others are the slowest that
# `pytest -n auto --durations=20` reports on a 2-core machine, about slowest first. An id
# without [parameters] stands for all of its parameters.
SLOW_FIRST = (
    "tests/test_notebooks.py::test_the_book_builds_and_every_notebook_runs_clean",
    "tests/nn/test_models.py::test_networks_kernels_reference_oracle[unet42]",
    "tests/nn/test_models.py::test_network_fp16_close_to_fp32",
    "tests/train/test_loop.py::test_a_few_training_steps_lower_the_loss",
    "tests/tools/test_ladder.py::test_search_rungs_equal_the_reference",
    "tests/map/test_kernel_map.py::test_given_out_coords",
    "tests/nn/test_models.py::test_networks_kernels_reference_oracle[resnet21]",
    "tests/map/test_kernel_map.py::test_symmetric_search_equals_full_search[5-1-63]",
    "tests/map/test_kernel_map.py::test_kernel_reference_oracle[stride122]",
    "tests/map/test_kernel_map.py::test_sorted_input_needs_no_sort[cuda]",
    "tests/tools/test_ladder.py::test_gather_and_scatter_rungs_equal_the_reference",
)


def pytest_collection_modifyitems(config, items):
    """Move the tests of SLOW_FIRST to the front, in its order; the rest keep theirs. An
    entry whose test function is gone from its file (renamed?) is warned about."""
    def rank(item):
        for i, slow in enumerate(SLOW_FIRST):
            if item.nodeid == slow or item.nodeid.split("[", 1)[0] == slow:
                return i
        return len(SLOW_FIRST)

    for slow in SLOW_FIRST:
        path, _, test = slow.partition("::")
        source = ROOT / path
        if not source.is_file() or f"def {test.split('[', 1)[0]}(" not in source.read_text(encoding="utf-8"):
            import warnings

            warnings.warn(f"tests/conftest.py SLOW_FIRST names {slow}, which is no test: update the list",
                          pytest.PytestWarning)
    items.sort(key=rank)  # (a stable sort: the rest keep their order)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: not called without it)
def pytest_xdist_make_scheduler(config, log):
    """Work stealing for ``-n auto``. xdist's default ("load") hands each worker a fixed run
    of consecutive tests: the slow ones at the front would all wait behind the book on one
    worker while the other, its own run done, idled. With work stealing an idle worker
    takes half of a busy one's queue."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


def pytest_configure(config):
    # Added here, not in pyproject.toml: naming a numba warning class there makes
    # pytest import numba before this file has switched the simulator on.
    config.addinivalue_line("filterwarnings", "ignore::numba.core.errors.NumbaPerformanceWarning")
    if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
        # The simulator runs each CUDA thread as a Python thread: a short switch interval
        # makes a block several times faster. The library's own launches set it around
        # each launch (core.launch.simulator_pace); the plain launches of lessons,
        # exercises and lower rungs (kernel[blocks, threads](...)) do not, so the test
        # session sets it once, for all of them.
        import sys

        from numba_sc.core.launch import SIMULATOR_SWITCH_INTERVAL

        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)
