"""Which device runs the kernels: a GPU, Numba's CUDA simulator, or none.

Asked by every stage before it picks its arrays and its backend
(:mod:`numba_sc.core.backend`). Under the simulator (``NUMBA_ENABLE_CUDASIM=1``
set *before numba is imported*) the device side's arrays are NumPy arrays, on a
GPU they are CuPy arrays.
"""
from __future__ import annotations

import importlib.util

import numpy as np
from numba import config, cuda

from .state import cached

try:  # numba-cuda keeps its own config (newer releases); older ones share numba's
    from numba.cuda.core import config as numba_cuda_config
except ImportError:  # pragma: no cover
    numba_cuda_config = config


def simulating() -> bool:
    """True when Numba's CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1).

    numba-cuda reads the variable into its own config when ``numba.cuda`` is first
    imported; numba's core config may have read it earlier (a pytest plugin can
    import numba before conftest runs), so ask numba-cuda first.
    """
    return bool(numba_cuda_config.ENABLE_CUDASIM)


def gpu_present() -> bool:
    """True when a real CUDA device can run kernels (the simulator does not count).

    Asked once per process (:func:`_driver_has_gpu` is remembered): every layer
    resolves its backend, and asking the driver each time costs host time on the
    hot path.
    """
    return False if simulating() else _driver_has_gpu()


@cached
def _driver_has_gpu() -> bool:
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver is as good as no GPU
        return False


def is_cupy(a) -> bool:
    """Whether ``a`` is a CuPy array (asked by its type's module: CuPy need not be installed)."""
    return type(a).__module__.split(".")[0] == "cupy"


def array_module(a):
    """The array library that holds ``a``: CuPy for a CuPy array, NumPy for anything else."""
    if is_cupy(a):
        import cupy

        return cupy
    return np


def require_device(what: str) -> None:
    """Raise unless ``what`` (``"model.cuda()"``, ``"x.to('cuda')"``) can put arrays on the
    device side: a GPU with CuPy, or the simulator. Says which is missing and what to do,
    where importing CuPy would only say "No module named 'cupy'"."""
    if simulating():
        return
    if importlib.util.find_spec("cupy") is None:
        raise RuntimeError(f"{what} needs CuPy: pip install 'numba-sc[cuda12]' (or [cuda13]); "
                           "without a GPU stay on the CPU (or set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported, to run the kernels under the simulator)")
    if not gpu_present():
        raise RuntimeError(f"{what}: no CUDA GPU is visible; stay on the CPU")


def device_xp():
    """The array library of the device side: CuPy on a GPU, NumPy under the simulator."""
    if simulating():
        return np
    import cupy  # imported lazily: the reference and simulator paths need no CuPy

    return cupy


def device_id() -> int:
    """The current device's number (0 under the simulator): the key of a cache of
    constants copied to each device once (a layer's key deltas, mask bits)."""
    return 0 if simulating() else device_xp().cuda.runtime.getDevice()


def l2_cache_bytes() -> int:
    """The current device's L2 cache in bytes (0 under the simulator or without a GPU):
    whether a layer's outputs stay in it decides how a layer past the workspace is cut
    (:func:`numba_sc.gmas.output_ranges.ranges_pay`)."""
    return 0 if not gpu_present() else _l2_bytes(device_id())


@cached
def _l2_bytes(device: int) -> int:
    return int(device_xp().cuda.runtime.getDeviceProperties(device)["l2CacheSize"])


def device_name() -> str:
    """What runs the kernels, in words, for the records benchmarks and ladders write."""
    if simulating():
        return "CUDA simulator (CPU)"
    if not gpu_present():
        return "no GPU (NumPy references)"
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
