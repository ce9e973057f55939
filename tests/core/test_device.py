"""Which device runs the kernels: answers under the simulator (the test suite's default)."""
import os

import numpy as np
import pytest

from numba_sc.core import device
from numba_sc.core.state import clear_caches

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="answers for the simulator")


def test_simulator_answers():
    assert device.simulating() is True
    assert device.gpu_present() is False  # the simulator is no GPU
    assert device.device_xp() is np
    assert device.device_id() == 0
    assert device.device_name() == "CUDA simulator (CPU)"
    device.require_device("x.to('cuda')")  # the simulator can hold device arrays: no error


def test_is_cupy_and_array_module():
    assert device.is_cupy(np.zeros(2)) is False
    assert device.array_module(np.zeros(2)) is np
    assert device.array_module([1, 2]) is np


def test_the_driver_is_asked_once_and_again_after_clear_caches(monkeypatch):
    calls = []
    monkeypatch.setattr(device.cuda, "is_available", lambda: calls.append(1) or True)
    clear_caches()
    assert device._driver_has_gpu() is True and device._driver_has_gpu() is True
    assert len(calls) == 1
    clear_caches()
    device._driver_has_gpu()
    assert len(calls) == 2
    clear_caches()  # (forget the patched answer)
