"""The launch path: the fast launcher must compute what Numba's dispatcher computes.

The fast path exists only on a real GPU (under the simulator every launch goes
through the dispatcher), so this test runs on the GPU machine and is skipped in
CI, where no GPU exists; `.ci/run` cannot exercise it.
"""
import numpy as np
import pytest
from numba import cuda

from numba_sc.core import device, launch as launching, pieces


@cuda.jit
def mixed_kernel(a2d, b, scale, offset, flip, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = a2d[i, 0] * scale + a2d[i, 1] + b[i] + offset
        out[i] = -v if flip else v


@pytest.mark.skipif(not device.gpu_present(), reason="the fast launch path runs only on a GPU")
def test_fast_launch_matches_dispatcher(monkeypatch):
    monkeypatch.setattr(launching, "_FAST", launching.FastLauncher())  # learns afresh
    import cupy

    rng = np.random.default_rng(1)
    a = cupy.asarray(rng.normal(size=(5000, 2)).astype(np.float32))
    b = cupy.asarray(rng.integers(-9, 9, 5000).astype(np.int64))
    expect = (a[:, 0] * 1.5 + a[:, 1] + b + 7).get()
    for flip in (False, True, False):  # first call learns, the others go fast
        out = cupy.full(5000, np.nan, np.float32)
        launching.launch(mixed_kernel, 5000, a, b, 1.5, 7, flip, out, threads=128)
        np.testing.assert_allclose(out.get(), -expect if flip else expect, rtol=1e-5, atol=1e-5)
    (entry,) = [v for k, v in launching._FAST._compiled.items() if k[0] is mixed_kernel]
    assert entry[2] is not None  # a float scalar goes through the driver's slots too (its bits)
    out = cupy.full(5000, np.nan, np.float32)  # a NumPy float32 scalar: another signature, learned
    for _ in range(2):
        launching.launch(mixed_kernel, 5000, a, b, np.float32(-0.25), 7, False, out, threads=128)
        np.testing.assert_allclose(out.get(), (a[:, 0] * -0.25 + a[:, 1] + b + 7).get(), rtol=1e-5, atol=1e-5)
    # A non-contiguous view is a different signature: it is learned, not mixed up.
    out2 = cupy.zeros(10000, np.float32)[::2]
    launching.launch(mixed_kernel, 5000, a, b, 1.5, 7, False, out2)
    launching.launch(mixed_kernel, 5000, a, b, 1.5, 7, False, out2)
    np.testing.assert_allclose(out2.get(), expect, rtol=1e-5, atol=1e-5)
    # Negative integers and a float32 scalar fill their slots correctly too.
    expect = (a[:, 0] * np.float32(-0.25) + a[:, 1] + b - 3).get()
    for _ in range(2):
        out = cupy.full(5000, np.nan, np.float32)
        launching.launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, out, threads=64)
        np.testing.assert_allclose(out.get(), expect, rtol=1e-5, atol=1e-5)
    # A CuPy stream made current is the stream the launch goes to: ordered with the
    # allocation, fill and read queued on it.
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(2):
            out = cupy.full(5000, np.nan, np.float32)
            launching.launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, out, threads=64)
            np.testing.assert_allclose(out.get(), expect, rtol=1e-5, atol=1e-5)
    # A piece of a larger allocation (numba_sc.core.pieces.Piece) is an array argument too.
    big = cupy.full(7000, np.nan, np.float32)
    for _ in range(2):
        part = pieces.piece(big, 4 * 1000, (5000,), np.float32)
        launching.launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, part, threads=64)
        np.testing.assert_allclose(big[1000:6000].get(), expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part.get(), expect, rtol=1e-5, atol=1e-5)
    assert np.isnan(big[:1000].get()).all() and np.isnan(big[6000:].get()).all()  # nothing outside


@cuda.jit
def integer_kernel(a2d, b, offset, flip, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = a2d[i, 0] * 3 + a2d[i, 1] + b[i] + offset
        out[i] = -v if flip else v


@pytest.mark.skipif(not device.gpu_present(), reason="the fast launch path runs only on a GPU")
@pytest.mark.parametrize("raw", [True, False])
def test_raw_driver_launch_matches_dispatcher(monkeypatch, raw):
    """Integer-only signatures go straight to cuLaunchKernel from 8-byte slots
    (``FastLauncher.raw``); ``raw=False`` sends them through ``cuda.core``. Both
    must pass every field: 2-D and 1-D arrays, int32 and int64 arrays, negative
    scalars, booleans, pieces, a non-default stream."""
    fast = launching.FastLauncher()
    fast.raw = raw
    monkeypatch.setattr(launching, "_FAST", fast)
    import cupy

    rng = np.random.default_rng(2)
    a = cupy.asarray(rng.integers(-50, 50, (3000, 2)).astype(np.int32))
    b = cupy.asarray(rng.integers(-9, 9, 3000).astype(np.int64))
    for offset, flip in ((5, False), (-(2 ** 40), True), (-7, False), (0, True)):
        expect = (a[:, 0].astype(np.int64) * 3 + a[:, 1] + b + offset).get()
        out = cupy.zeros(3000, np.int64)
        launching.launch(integer_kernel, 3000, a, b, offset, flip, out, threads=128)
        np.testing.assert_array_equal(out.get(), -expect if flip else expect)
    (entry,) = [v for k, v in fast._compiled.items() if k[0] is integer_kernel]
    assert entry[2] is not None  # integer-only: the driver path is available
    big = cupy.full(5000, -1, np.int64)
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(2):
            part = pieces.piece(big, 8 * 1000, (3000,), np.int64)
            launching.launch(integer_kernel, 3000, a, b, -3, False, part, threads=64)
            expect = (a[:, 0].astype(np.int64) * 3 + a[:, 1] + b - 3).get()
            np.testing.assert_array_equal(part.get(), expect)
    assert (big[:1000].get() == -1).all() and (big[4000:].get() == -1).all()


def test_simulator_threads_of_a_block_share_one_shared_array():
    """Numba's simulator makes a block's shared array in the first thread to reach the
    line, with no lock between its look-up and its store: two threads arriving together
    each made an array, and a thread wrote where nobody read (CI, 2026-11-27). Made
    certain here: the look-up is slowed so that every thread arrives before any store;
    with the lock, they all still get the very same array."""
    import threading
    import time

    from numba.cuda.simulator import kernelapi

    from numba_sc.core.launch import lock_simulator_shared_arrays

    assert lock_simulator_shared_arrays(), "numba's simulator moved FakeCUDAShared.array: update core/launch.py"

    class SlowLookUp(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            time.sleep(0.01)  # between the look-up and the store: every thread looks before any stores
            return found

    shared = kernelapi.FakeCUDAShared(0)
    shared._allocations = SlowLookUp()
    got, start = [], threading.Barrier(8)

    def thread():
        start.wait()
        got.append(shared.array(16, np.int64))  # one call site, as in a kernel (kept: ids of freed arrays repeat)

    threads = [threading.Thread(target=thread) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    arrays = {id(a) for a in got}
    assert len(got) == 8 and len(arrays) == 1, f"{len(arrays)} different arrays for one block"
