"""The launch path's plain part: the grid, the launch, the simulator's pace.

The fast path (``core/fast_launch.py``) has its own tests, ``test_fast_launch.py``.
"""
import sys

import numpy as np
import pytest
from numba import cuda

from numba_sc.core import device, launch as launching
from numba_sc.core.launch import SIMULATOR_SWITCH_INTERVAL, THREADS, blocks_for, launch, simulator_pace


@cuda.jit
def _twice(a, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = 2 * a[i]


@cuda.jit
def _block_ids(out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = cuda.blockIdx.x


@pytest.mark.parametrize("n, threads, blocks", [(0, 256, 1), (1, 256, 1), (256, 256, 1), (257, 256, 2),
                                                (1000, 128, 8), (10**6, THREADS, 3907)])
def test_blocks_for(n, threads, blocks):
    assert blocks_for(n, threads) == blocks


def test_launch_one_thread_per_element():
    a = np.arange(700, dtype=np.int64)
    out = np.zeros_like(a)
    launch(_twice, 700, a, out, threads=128)
    np.testing.assert_array_equal(out, 2 * a)


def test_launch_with_an_explicit_grid():
    out = np.full(40, -1, np.int64)
    launch(_block_ids, 1, out, threads=8, blocks=5)  # 5 blocks of 8 threads, not blocks_for(1)
    np.testing.assert_array_equal(out, np.repeat(np.arange(5), 8))


def test_launch_of_nothing_launches_nothing():
    out = np.full(4, 7, np.int64)
    launch(_twice, 0, np.zeros(4, np.int64), out)
    assert (out == 7).all()


@pytest.mark.skipif(not device.simulating(), reason="a no-op on a GPU")
def test_simulator_pace_sets_and_restores_the_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        with simulator_pace():
            assert sys.getswitchinterval() == pytest.approx(SIMULATOR_SWITCH_INTERVAL)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.skipif(not device.simulating(), reason="the simulator's launch path")
def test_the_library_launch_is_the_plain_launch_under_the_simulator(monkeypatch):
    """Under the simulator nothing is handed to the fast path."""
    for name in ("launch_on_gpu", "first_launch", "current_stream_ptr"):
        monkeypatch.setattr(launching.fast_launch, name, lambda *a, name=name: pytest.fail(f"fast path: {name} called"))
    out = np.zeros(3, np.int64)
    launch(_twice, 3, np.ones(3, np.int64), out)
    assert (out == 2).all()
